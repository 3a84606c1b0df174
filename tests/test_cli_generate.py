"""ddtree-run as a new user runs it, in process: text prompts through the checkpoint's tokenizer, stop tokens,
JSON output, acceptance lengths, help with defaults and examples, --version, the backend and the built-in model."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.text import Text

from ddtree import __version__, cli, device
from ddtree.drafter import make_drafter
from ddtree.generation_view import Run, progress_display
from ddtree.presets import preset_config
from ddtree.reference import ReferenceModel
from ddtree.results import GenerationResult
from ddtree.tokenizer import load_tokenizer
from tokenizer_files import write_tiktoken_model, write_tokenizer_json


@pytest.fixture(scope="module")
def text_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target with a tokenizer.json and a drafter."""
    model = tmp_path_factory.mktemp("text") / "tiny"
    shutil.copytree(tiny_model_dir, model)
    write_tokenizer_json(model)
    make_drafter(preset_config("tiny"), model / cli.DRAFTER_SUBDIR, seed=1, preset="tiny")
    return model


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert cli.main(["generate", "--backend", "reference", "--json", *argv]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return json.loads(captured.out)


def test_text_prompt_is_encoded_and_its_continuation_streamed(capsys: pytest.CaptureFixture[str],
                                                              text_model: Path) -> None:
    tokenizer = load_tokenizer(text_model)
    by_text = _json(capsys, "--model", str(text_model), "--prompt", "hello world", "-n", "12", "--ignore-eos")
    [stream] = by_text["streams"]
    assert stream["prompt_ids"] == tokenizer.encode("hello world") and stream["prompt"] == "hello world"
    assert stream["text"] == tokenizer.decode(stream["tokens"])
    by_ids = _json(capsys, "--model", str(text_model), "--prompt-ids", ",".join(map(str, stream["prompt_ids"])),
                   "-n", "12", "--ignore-eos")
    assert by_ids["streams"][0]["tokens"] == stream["tokens"] and "text" not in by_ids["streams"][0]

    assert cli.main(["generate", "--model", str(text_model), "--prompt", "hello world", "-n", "12",
                     "--ignore-eos", "--backend", "reference"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[0] hello world" + stream["text"].rstrip("\ufffd")
    assert lines[1].startswith("[0] 12 tokens, prefill ")


def test_text_prompt_through_kimi_tiktoken(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path,
                                           tmp_path: Path) -> None:
    model = tmp_path / "kimi"
    shutil.copytree(tiny_model_dir, model)
    write_tiktoken_model(model)
    result = _json(capsys, "--model", str(model), "--prompt", "the 世界", "--prompt", "hello", "-n", "4")
    tokenizer = load_tokenizer(model)
    assert [s["prompt_ids"] for s in result["streams"]] == [tokenizer.encode("the 世界"), tokenizer.encode("hello")]


def test_text_prompt_without_tokenizer_is_one_line(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path) -> None:
    assert cli.main(["generate", "--model", str(tiny_model_dir), "--prompt", "hello"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"ddtree-run: error: {tiny_model_dir}: no tokenizer: text needs "
                                         f"tokenizer.json, or tiktoken.model with tokenizer_config.json, in the "
                                         f"model directory (token ids run without one)"]


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_generation_stops_at_stop_ids_and_eos(capsys: pytest.CaptureFixture[str], text_model: Path, tmp_path: Path,
                                              method: str) -> None:
    argv = ["--prompt-ids", "1,2,3", "-n", "12", "--method", method]
    full = _json(capsys, "--model", str(text_model), *argv, "--ignore-eos")["streams"][0]["tokens"]
    stop = full[4]
    cut = full[: full.index(stop) + 1]
    assert _json(capsys, "--model", str(text_model), *argv, "--ignore-eos", "--stop-ids", f"{stop}")[
        "streams"][0]["tokens"] == cut

    eos_model = tmp_path / "eos"
    shutil.copytree(text_model, eos_model)
    config = json.loads((eos_model / "config.json").read_text())
    (eos_model / "config.json").write_text(json.dumps({**config, "eos_token_id": [stop]}))
    assert _json(capsys, "--model", str(eos_model), *argv)["streams"][0]["tokens"] == cut
    assert _json(capsys, "--model", str(eos_model), *argv, "--ignore-eos")["streams"][0]["tokens"] == full


def test_ddtree_shows_acceptance_lengths_and_the_near_one_note(capsys: pytest.CaptureFixture[str],
                                                              text_model: Path) -> None:
    argv = ["--model", str(text_model), "--prompt-ids", "1,2,3", "-n", "8", "--method", "ddtree", "--ignore-eos"]
    lengths = _json(capsys, *argv)["streams"][0]["accept_lengths"]
    assert lengths and all(length >= 1 for length in lengths)
    assert cli.main(["generate", "--backend", "reference", *argv]) == 0
    out = capsys.readouterr().out
    assert f"acceptance length per round: {' '.join(map(str, lengths))}" in out
    assert "note: a mean acceptance length near 1" in out and "slower than autoregressive decoding" in out


@pytest.mark.parametrize("command", ["make-model", "generate", "info"])
def test_every_subcommand_has_help_with_defaults_and_an_example(capsys: pytest.CaptureFixture[str],
                                                                command: str) -> None:
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"ddtree-run {command}" in out.split("example", 1)[1]
    if command == "generate":
        assert "(default: 32)" in out and "(default: 0.0)" in out and "(default: auto)" in out
        assert "(default: None)" not in out and "(default: [])" not in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"ddtree {__version__}\n"


def test_info_names_the_backend_and_the_built_in_model(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "native_unavailable", lambda: "ddtree._native is not built: no nvcc")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"ddtree {__version__}: ddtree._native is not built: no nvcc" in out
    assert "generate runs on the reference backend (the native module is not built;" in out
    assert f"built-in model (generate without --model): {cli.DEFAULT_MODEL_DIR}" in out


def test_engine_backend_without_the_native_module_is_one_line(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              text_model: Path) -> None:
    monkeypatch.setattr(device, "native_unavailable", lambda: "ddtree._native is not built: no nvcc")
    monkeypatch.setattr(device, "has_cuda_device", lambda: True)
    assert cli.main(["generate", "--model", str(text_model), "--prompt-ids", "1", "--backend", "engine"]) == 2
    assert capsys.readouterr().err == "ddtree-run: error: --backend engine: ddtree._native is not built: no nvcc\n"
    assert cli.main(["generate", "--model", str(text_model), "--prompt-ids", "1", "-n", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "reference"


def test_progress_bars_are_labelled_per_stream_with_tokens_per_second() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    run = Run("reference", "ar", [[1], [2]], None, 4)
    with progress_display(run, console, None, quiet=False) as on_tokens:
        for stream in range(2):
            for count in range(1, 5):
                on_tokens(stream, list(range(count)))
    text = Text.from_ansi(out.getvalue()).plain
    assert "reference ar stream 0" in text and "reference ar stream 1" in text and "tokens/s" in text


def test_reference_prefill_is_timed_warm(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                         text_model: Path) -> None:
    """The first stream's prefill converts no weight to float32: the discarded warm-up prefill did."""
    import ddtree.reference

    real_generate = ddtree.reference.generate
    converted_inside = []

    def generate(model: ReferenceModel, *args: Any, **kwargs: Any) -> GenerationResult:
        before = len(model._float32)
        result = real_generate(model, *args, **kwargs)
        converted_inside.append(len(model._float32) - before)
        return result

    monkeypatch.setattr(ddtree.reference, "generate", generate)
    _json(capsys, "--model", str(text_model), "--prompt-ids", "1,2,3", "-n", "4")
    assert converted_inside == [0]
