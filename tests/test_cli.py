"""ddtree-run end to end: make-model, generate on the reference backend, and one-line errors on bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddtree.cli", *args], capture_output=True, text=True,
                          timeout=300)


def _one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_make_model_then_generate(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    made = _run("make-model", "--preset", "tiny", "--out", str(out), "--seed", "3")
    assert made.returncode == 0, made.stderr
    assert (out / "config.json").is_file()
    gen = _run("generate", "--model", str(out), "--prompt-ids", "1,2,3", "-n", "16", "--ignore-eos",
               "--backend", "reference")
    assert gen.returncode == 0, gen.stderr
    assert "prompt [1, 2, 3] ->" in gen.stdout and "tokens/s" in gen.stdout
    tokens = gen.stdout.split("->", 1)[1].split("]", 1)[0]
    assert len(tokens.split(",")) == 16


def test_bad_model_dir_is_one_line(tmp_path: Path) -> None:
    _one_line_error(_run("generate", "--model", str(tmp_path / "missing"), "--prompt-ids", "1"),
                    "ddtree-run: error:", "missing", "does not exist")


def test_prompt_id_outside_vocabulary_is_one_line(tiny_model_dir: Path) -> None:
    proc = _run("generate", "--model", str(tiny_model_dir), "--prompt-ids", "1,99999999", "-n", "2",
                "--backend", "reference")
    _one_line_error(proc, "ddtree-run: error:", "99999999")


def test_broken_checkpoint_is_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text('{"model_type": "llama"}')
    _one_line_error(_run("generate", "--model", str(model), "--prompt-ids", "1", "--backend", "reference"),
                    "config.json", "model_type")


@pytest.mark.parametrize("args,needle", [
    (("generate", "--prompt-ids", "a,b"), "--prompt-ids"),
    (("generate", "--prompt-ids", "1", "-n", "0"), "positive"),
    (("make-model", "--preset", "huge", "--out", "x"), "--preset"),
])
def test_bad_arguments_exit_non_zero(args: tuple[str, ...], needle: str) -> None:
    _one_line_error(_run(*args), "ddtree-run: error:", needle)


def test_info_runs_without_gpu() -> None:
    proc = _run("info")
    assert proc.returncode == 0, proc.stderr
    native = "CUDA runtime" in proc.stdout or "ddtree._native is not built" in proc.stdout
    assert native and "generate runs on the" in proc.stdout and "built-in model" in proc.stdout


def test_python_m_ddtree_is_ddtree_run() -> None:
    proc = subprocess.run([sys.executable, "-m", "ddtree", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("ddtree "), proc.stderr


def test_piped_output_is_not_wrapped(tiny_model_dir: Path) -> None:
    """rich wraps at 80 columns when it cannot ask a terminal for its width; a pipe must get whole lines."""
    gen = _run("generate", "--model", str(tiny_model_dir), "--prompt-ids", "1,2,3", "-n", "48", "--ignore-eos",
               "--backend", "reference")
    assert gen.returncode == 0, gen.stderr
    [line] = [line for line in gen.stdout.splitlines() if "->" in line]
    assert len(line) > 80 and len(line.split("->", 1)[1].split(",")) == 48


def test_text_prompt_without_tokenizer_is_one_line(tiny_model_dir: Path) -> None:
    _one_line_error(_run("generate", "--model", str(tiny_model_dir), "--prompt", "hello"),
                    "ddtree-run: error:", str(tiny_model_dir), "no tokenizer", "tokenizer.json", "tiktoken.model")
