"""Small tokenizer files written beside a test checkpoint: a byte-level BPE `tokenizer.json` trained here, and a
Kimi-style `tiktoken.model` (the 256 bytes and a few merges) with its `tokenizer_config.json`."""

from __future__ import annotations

import base64
import json
from pathlib import Path

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer", "DDTree drafts a tree"]
EOS_TEXT = "<|eos|>"
TIKTOKEN_MERGES = [b"th", b"the", b"he", b"ll", b"hello", b" w", b"or", b"ld"]
TIKTOKEN_SPECIAL = {"<|im_end|>": 1, "[EOS]": 5}  # offsets after the BPE ranks


def write_tokenizer_json(model_dir: Path, vocab_size: int = 300) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 10, trainer)
    path = model_dir / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def write_tiktoken_model(model_dir: Path) -> Path:
    """Ranks 0..255 the single bytes, then TIKTOKEN_MERGES (each a pair of earlier tokens); the special tokens of
    TIKTOKEN_SPECIAL named in tokenizer_config.json, the other reserved ids unnamed."""
    tokens = [bytes([b]) for b in range(256)] + TIKTOKEN_MERGES
    path = model_dir / "tiktoken.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    added = {str(len(tokens) + offset): {"content": text, "special": True} for text, offset in TIKTOKEN_SPECIAL.items()}
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    return path
