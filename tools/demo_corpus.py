"""The demo pair's corpus: the Python standard library's own source, a byte-level BPE tokenizer trained on it, and
the token streams the training and evaluation tools read (CPU only; no torch).

Every machine with Python has this text offline. Files are split by a hash of their path inside the standard
library, so the held-out set is the same on every machine of one Python version; the tokenizer is trained on the
training files only. Each file is followed by the end-of-text token, so the model learns where files end.

    python3 tools/demo_corpus.py --out DATA    # writes tokenizer.json, train.npy, held_out.npy, corpus.json
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import zlib
from pathlib import Path

import numpy as np

EOS_TEXT = "<|endoftext|>"
MASK_TEXT = "<|mask|>"  # the drafter's mask token: never in the text, so its embedding means only 'to be drafted'
SPECIAL_TOKENS = (EOS_TEXT, MASK_TEXT)  # ids 0 and 1
VOCAB_SIZE = 4096
HELD_OUT_MODULUS = 50  # one file in 50 is held out
# Not source code a model should learn: site-packages is whatever was installed, pydoc_data one huge string,
# _sysconfigdata the build machine's own paths and flags.
EXCLUDED = ("site-packages/", "pydoc_data/", "_sysconfigdata")


def stdlib_files(stdlib: Path) -> list[str]:
    """The standard library's .py files as sorted POSIX paths relative to `stdlib`."""
    paths = (p.relative_to(stdlib).as_posix() for p in stdlib.rglob("*.py"))
    return sorted(p for p in paths if not any(p.startswith(x) or f"/{x}" in p for x in EXCLUDED))


def is_held_out(relative_path: str) -> bool:
    return zlib.crc32(relative_path.encode()) % HELD_OUT_MODULUS == 0


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def token_stream(tokenizer, texts: list[str]) -> tuple[np.ndarray, list[int]]:
    """The texts' tokens, each text followed by the end-of-text id, as one uint16 array; and each text's offset."""
    eos = tokenizer.token_to_id(EOS_TEXT)
    pieces, offsets, offset = [], [], 0
    for encoding in tokenizer.encode_batch(texts):
        offsets.append(offset)
        pieces.append(np.asarray(encoding.ids + [eos], dtype=np.uint16))
        offset += len(encoding.ids) + 1
    return np.concatenate(pieces), offsets


def build(stdlib: Path, out: Path, vocab_size: int) -> dict:
    files = stdlib_files(stdlib)
    train = [f for f in files if not is_held_out(f)]
    held_out = [f for f in files if is_held_out(f)]
    train_texts = [read_text(stdlib / f) for f in train]
    held_texts = [read_text(stdlib / f) for f in held_out]
    tokenizer = train_tokenizer(train_texts, vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    train_ids, _ = token_stream(tokenizer, train_texts)
    held_ids, held_offsets = token_stream(tokenizer, held_texts)
    np.save(out / "train.npy", train_ids)
    np.save(out / "held_out.npy", held_ids)
    summary = {
        "python": sys.version.split()[0],
        "vocab_size": vocab_size,
        "special_ids": {text: tokenizer.token_to_id(text) for text in SPECIAL_TOKENS},
        "train_files": len(train), "train_bytes": sum(len(t.encode()) for t in train_texts),
        "train_tokens": int(train_ids.size),
        "held_out_files": held_out, "held_out_offsets": held_offsets,
        "held_out_bytes": sum(len(t.encode()) for t in held_texts), "held_out_tokens": int(held_ids.size),
    }
    (out / "corpus.json").write_text(json.dumps(summary, indent=1))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()
    s = build(args.stdlib, args.out, args.vocab_size)
    print(f"Python {s['python']}: {s['train_files']} training files ({s['train_tokens']} tokens, "
          f"{s['train_bytes'] / s['train_tokens']:.2f} bytes/token), {len(s['held_out_files'])} held out "
          f"({s['held_out_tokens']} tokens)")


if __name__ == "__main__":
    main()
