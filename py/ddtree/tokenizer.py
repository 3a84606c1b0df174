"""A checkpoint's tokenizer, read from its own local files (never fetched): `tokenizer.json` through `tokenizers`,
or Kimi's `tiktoken.model` with the special tokens of `tokenizer_config.json` through `tiktoken`.

Text in special-token markup (`<|im_end|>`) encodes to the special token, as Kimi's own tokenizer does, and
decoding keeps special tokens, so a stop token shows in the text.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree.errors import CheckpointError, RequestError, printable

TOKENIZER_JSON = "tokenizer.json"
TIKTOKEN_MODEL = "tiktoken.model"
TOKENIZER_CONFIG = "tokenizer_config.json"

# Kimi's tokenization_kimi.py: 256 special ids follow the BPE ranks; those tokenizer_config.json does not name
# are reserved placeholders.
KIMI_RESERVED_SPECIAL_TOKENS = 256
# Kimi's pre-tokenizer split (tokenization_kimi.py): Han runs, cased words with English contractions, up to
# three digits, punctuation runs, newlines, whitespace.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """Text to token ids and back. Ids the tokenizer does not hold (a model's vocabulary may be larger) decode to
    nothing, as `tokenizers` decodes them."""

    path: Path  # the file it was read from
    _encode: Callable[[str], list[int]]
    _decode: Callable[[list[int]], str]

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode([int(i) for i in ids])


class TextStream:
    """Decodes a growing list of tokens into text pieces to print as they arrive. A piece ends before a character
    whose UTF-8 bytes are still incomplete (a byte-level token can hold half a character)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._shown = 0  # characters of the decoded text already returned

    def update(self, tokens: Sequence[int]) -> str:
        """The text that `tokens` (every token so far) add to what was returned before."""
        text = self._tokenizer.decode(tokens).rstrip("\ufffd")
        piece = text[self._shown:]
        self._shown = max(self._shown, len(text))
        return piece


def encode_prompts(prompts: Sequence[str | Sequence[int]], model_dir: str | Path | None
                   ) -> tuple[list[Sequence[int]], Tokenizer | None]:
    """Every prompt as token ids, text through the tokenizer of the checkpoint in `model_dir` (read only when a
    prompt is text), and that tokenizer (None when every prompt is ids)."""
    if not any(isinstance(prompt, str) for prompt in prompts):
        return [prompt for prompt in prompts if not isinstance(prompt, str)], None  # all of them
    if model_dir is None:
        raise RequestError("a text prompt needs the tokenizer of a checkpoint directory, and this model was not "
                           "loaded from one: pass token ids")
    tokenizer = load_tokenizer(model_dir)
    return [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts], tokenizer


def find_tokenizer(model_dir: str | Path) -> Path | None:
    """The tokenizer file a checkpoint holds (tokenizer.json first), or None."""
    for name in (TOKENIZER_JSON, TIKTOKEN_MODEL):
        if (Path(model_dir) / name).is_file():
            return Path(model_dir) / name
    return None


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The checkpoint's tokenizer; CheckpointError naming the missing or malformed file otherwise."""
    path = find_tokenizer(model_dir)
    if path is None:
        raise CheckpointError(f"{model_dir}: no tokenizer: text needs {TOKENIZER_JSON}, or {TIKTOKEN_MODEL} with "
                              f"{TOKENIZER_CONFIG}, in the model directory (token ids run without one)")
    return _load_tokenizer_json(path) if path.name == TOKENIZER_JSON else _load_tiktoken(path)


def _load_tokenizer_json(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tokenizer = HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for every malformed file
        raise CheckpointError(f"{path}: not a tokenizers file ({printable(str(e))})") from None
    return Tokenizer(path, lambda text: tokenizer.encode(text).ids,
                     lambda ids: tokenizer.decode(ids, skip_special_tokens=False))


def _load_tiktoken(path: Path) -> Tokenizer:
    import tiktoken

    ranks = _read_bpe_ranks(path)
    special = _kimi_special_tokens(path.parent / TOKENIZER_CONFIG, len(ranks))
    try:
        encoding = tiktoken.Encoding(path.stem, pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=special)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    known = len(ranks) + len(special)
    return Tokenizer(path, lambda text: encoding.encode(text, allowed_special="all"),
                     lambda ids: encoding.decode([i for i in ids if 0 <= i < known], errors="replace"))


def _read_bpe_ranks(path: Path) -> dict[bytes, int]:
    """Lines of 'base64-token rank', rank i on line i. Read here rather than by tiktoken's load_tiktoken_bpe, which
    caches every file it reads under a name made from its path, so an edited file would load stale."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error):
            raise CheckpointError(f"{path}: line {number} is not 'base64-token rank'") from None
        if rank != len(ranks) or token in ranks:
            raise CheckpointError(f"{path}: line {number}: ranks must be 0, 1, 2, ... over distinct tokens, got "
                                  f"rank {rank} after {len(ranks)} tokens")
        ranks[token] = rank
    if not ranks:
        raise CheckpointError(f"{path}: holds no tokens")
    return ranks


def _kimi_special_tokens(config_path: Path, first_id: int) -> dict[str, int]:
    """Kimi's special tokens: ids first_id .. first_id + 255, named by tokenizer_config.json's added_tokens_decoder
    where it names them."""
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: file not found ({TIKTOKEN_MODEL} needs it for its special tokens)")
    try:
        config: Any = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None
    added = config.get("added_tokens_decoder", {}) if isinstance(config, dict) else None
    if not isinstance(added, dict):
        raise CheckpointError(f"{config_path}: added_tokens_decoder must be an object of id -> token")
    names: dict[int, str] = {}
    for key, token in added.items():
        content = token.get("content") if isinstance(token, dict) else None
        if not key.isdecimal() or not isinstance(content, str):
            raise CheckpointError(f"{config_path}: added_tokens_decoder[{printable(key)!r}] must map a decimal id "
                                  f"to an object with a string 'content'")
        if content in names.values():
            raise CheckpointError(f"{config_path}: added_tokens_decoder names {printable(content)!r} twice")
        names[int(key)] = content
    ids = range(first_id, first_id + KIMI_RESERVED_SPECIAL_TOKENS)
    outside = sorted(set(names) - set(ids))
    if outside:
        raise CheckpointError(f"{config_path}: added_tokens_decoder id {outside[0]} is outside the special ids "
                              f"{ids.start}..{ids.stop - 1} that follow the {first_id} tokens of {TIKTOKEN_MODEL}")
    return {names.get(i, f"<|reserved_token_{i}|>"): i for i in ids}
