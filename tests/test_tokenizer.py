"""A checkpoint's tokenizer from its local files: round trips through tokenizer.json and Kimi's tiktoken.model,
streamed decoding, text prompts in the Python API, and errors naming the missing or malformed file."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from ddtree.errors import CheckpointError, RequestError
from ddtree.reference import ReferenceModel, generate
from ddtree.tokenizer import KIMI_RESERVED_SPECIAL_TOKENS, TextStream, encode_prompts, load_tokenizer
from tokenizer_files import EOS_TEXT, TIKTOKEN_MERGES, TIKTOKEN_SPECIAL, write_tiktoken_model, write_tokenizer_json

TEXTS = ["hello world, the quick brown fox", "  spaces\tand\nnewlines  ", "ünïcödé 世界 and emoji 🦊", ""]
TIKTOKEN_BASE = 256 + len(TIKTOKEN_MERGES)


@pytest.fixture
def json_dir(tmp_path: Path) -> Path:
    write_tokenizer_json(tmp_path)
    return tmp_path


@pytest.fixture
def tiktoken_dir(tmp_path: Path) -> Path:
    write_tiktoken_model(tmp_path)
    return tmp_path


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_json_round_trip(json_dir: Path, text: str) -> None:
    tokenizer = load_tokenizer(json_dir)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.path == json_dir / "tokenizer.json"


def test_tokenizer_json_merges_and_special_tokens(json_dir: Path) -> None:
    tokenizer = load_tokenizer(json_dir)
    assert len(tokenizer.encode("hello world")) < len("hello world")  # trained merges apply
    ids = tokenizer.encode(f"hello{EOS_TEXT}")
    assert ids[-1] == 0 and tokenizer.decode(ids) == f"hello{EOS_TEXT}"  # the special token is one id, kept


@pytest.mark.parametrize("text", TEXTS)
def test_tiktoken_round_trip(tiktoken_dir: Path, text: str) -> None:
    tokenizer = load_tokenizer(tiktoken_dir)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tiktoken_merges_and_kimi_special_tokens(tiktoken_dir: Path) -> None:
    tokenizer = load_tokenizer(tiktoken_dir)
    assert tokenizer.encode("hello") == [256 + TIKTOKEN_MERGES.index(b"hello")]
    im_end = TIKTOKEN_BASE + TIKTOKEN_SPECIAL["<|im_end|>"]
    reserved = TIKTOKEN_BASE + 7  # named by no tokenizer_config.json entry
    text = f"the<|im_end|><|reserved_token_{reserved}|>"
    assert tokenizer.encode(text) == [256 + TIKTOKEN_MERGES.index(b"the"), im_end, reserved]
    assert tokenizer.decode(tokenizer.encode(text)) == text
    last = TIKTOKEN_BASE + KIMI_RESERVED_SPECIAL_TOKENS - 1
    assert tokenizer.decode([last]) == f"<|reserved_token_{last}|>"


def test_tiktoken_splits_han_from_latin_as_kimi_does(tiktoken_dir: Path) -> None:
    """Kimi's pattern keeps a Han run apart from the Latin word before it: 'the' still merges."""
    tokenizer = load_tokenizer(tiktoken_dir)
    assert tokenizer.encode("the世")[0] == 256 + TIKTOKEN_MERGES.index(b"the")


def test_ids_the_tokenizer_does_not_hold_decode_to_nothing(json_dir: Path, tiktoken_dir: Path) -> None:
    for model_dir in (json_dir, tiktoken_dir):
        tokenizer = load_tokenizer(model_dir)
        hello = tokenizer.encode("hello")
        assert tokenizer.decode([*hello, 10**6, *hello]) == "hellohello"


def test_text_stream_waits_for_whole_characters(tiktoken_dir: Path) -> None:
    """Byte tokens of one character arrive one at a time: no piece holds half of it (a U+FFFD)."""
    tokenizer = load_tokenizer(tiktoken_dir)
    ids = tokenizer.encode("a世界🦊b")
    stream = TextStream(tokenizer)
    pieces = [stream.update(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(pieces) == "a世界🦊b"
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces[1:3] == ["", ""] and pieces[3] == "世"


def test_tokenizer_json_comes_first(json_dir: Path) -> None:
    write_tiktoken_model(json_dir)
    assert load_tokenizer(json_dir).path.name == "tokenizer.json"


def test_missing_tokenizer_names_the_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no tokenizer: text needs tokenizer\.json, or tiktoken\.model with "
                                              r"tokenizer_config\.json"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("damage,needle", [
    (lambda d: (d / "tokenizer_config.json").unlink(), r"tokenizer_config\.json: file not found"),
    (lambda d: (d / "tokenizer_config.json").write_text("{"), r"tokenizer_config\.json: not valid JSON"),
    (lambda d: (d / "tokenizer_config.json").write_text('{"added_tokens_decoder": {"x": {"content": "a"}}}'),
     r"added_tokens_decoder\['x'\] must map a decimal id"),
    (lambda d: (d / "tokenizer_config.json").write_text('{"added_tokens_decoder": {"3": {"content": "a"}}}'),
     r"added_tokens_decoder id 3 is outside the special ids 264\.\.519"),
    (lambda d: (d / "tiktoken.model").write_text("aGk= 0\nnot-base64! 1\n"), r"tiktoken\.model: line 2 is not"),
    (lambda d: (d / "tiktoken.model").write_text("aGk= 0\naGk= 1\n"), r"line 2: ranks must be 0, 1, 2"),
    (lambda d: (d / "tiktoken.model").write_text("\n"), r"tiktoken\.model: holds no tokens"),
])
def test_malformed_tiktoken_files_are_named(tiktoken_dir: Path, damage: Callable[[Path], object],
                                            needle: str) -> None:
    damage(tiktoken_dir)
    with pytest.raises(CheckpointError, match=needle):
        load_tokenizer(tiktoken_dir)


def test_malformed_tokenizer_json_is_named(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not a tokenizers file"):
        load_tokenizer(tmp_path)


def test_token_id_prompts_need_no_tokenizer(tmp_path: Path) -> None:
    assert encode_prompts([[1, 2], [3]], tmp_path) == ([[1, 2], [3]], None)
    with pytest.raises(RequestError, match="a text prompt needs the tokenizer of a checkpoint directory"):
        encode_prompts(["hi"], None)


def test_reference_generate_takes_text(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    write_tokenizer_json(model_dir)
    model = ReferenceModel.load(model_dir)
    tokenizer = load_tokenizer(model_dir)
    by_text = generate(model, None, "hello world", 8)
    by_ids = generate(model, None, tokenizer.encode("hello world"), 8)
    assert by_text.tokens == by_ids.tokens
    assert by_text.text == tokenizer.decode(by_text.tokens) and by_ids.text is None
