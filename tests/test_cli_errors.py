"""ddtree-run on bad input, in process: one line on stderr naming the argument, file or tensor at fault, a non-zero
status, and nothing run or written before the check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ddtree import cli
from ddtree.checkpoint import INDEX_FILE, TensorSpec, open_checkpoint, write_tensor_dir
from ddtree.reference import ReferenceModel

PROMPT = "1,2,3"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny target with its drafter, as make-model writes them."""
    out = tmp_path_factory.mktemp("cli") / "tiny"
    assert cli.main(["make-model", "--preset", "tiny", "--out", str(out), "--seed", "0"]) == 0
    return out


@pytest.fixture()
def model_copy(model_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    return copy


@pytest.fixture()
def nothing_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the CLI reads any weights: a request error must come before."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the request was checked")

    monkeypatch.setattr(ReferenceModel, "load", refuse)


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str, status: int = 2) -> str:
    assert cli.main(argv) == status
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _streams(out: str) -> list[list[int]]:
    """The tokens of each stream that generate printed ('[i] prompt [...] -> [tokens]')."""
    return [json.loads(line.split("->", 1)[1]) for line in out.splitlines() if "->" in line]


def _tokens(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[list[int]]:
    assert cli.main(argv) == 0, capsys.readouterr().err
    return _streams(capsys.readouterr().out)


def _generate(model_dir: Path, *args: str) -> list[str]:
    return ["generate", "--model", str(model_dir), "--backend", "reference", *args]


@pytest.mark.parametrize("budget", ["100000", "4096", "1025"])
def test_budget_over_the_maximum_gives_the_memory(capsys, model_dir, nothing_loads, budget) -> None:
    _fails(capsys, _generate(model_dir, "--prompt-ids", PROMPT, "--method", "ddtree", "--budget", budget),
           f"--budget {budget} is more than the maximum tree budget 1024", "GiB in the reference backend")


def test_budget_100000_names_the_149_gib_it_would_have_needed(capsys, model_dir, nothing_loads) -> None:
    _fails(capsys, _generate(model_dir, "--prompt-ids", PROMPT, "--method", "ddtree", "--budget", "100000"),
           "at least 149.")  # the traceback said: Unable to allocate 149. GiB


def test_budget_at_the_maximum_runs(capsys, model_dir) -> None:
    ddtree = _tokens(capsys, _generate(model_dir, "--prompt-ids", PROMPT, "-n", "2", "--method", "ddtree",
                                       "--budget", "1024"))
    assert ddtree == _tokens(capsys, _generate(model_dir, "--prompt-ids", PROMPT, "-n", "2"))


def test_too_many_new_tokens_for_the_positions(capsys, model_dir, nothing_loads) -> None:
    _fails(capsys, _generate(model_dir, "--prompt-ids", PROMPT, "-n", "5000"),
           "--prompt-ids of stream 0 (3 ids) and -n 5000 need 5003 positions", "max_position_embeddings 1024",
           str(model_dir / "config.json"))
    _fails(capsys, _generate(model_dir, "--prompt-ids", PROMPT, "-n", "1020", "--method", "ddtree"),
           "-n 1020 need 1029 positions (6 of them for the last draft block", "max_position_embeddings 1024")


@pytest.mark.parametrize("command", ["generate", "make-model"])
@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_seed_out_of_range(capsys, model_dir, tmp_path, nothing_loads, command, seed) -> None:
    argv = (_generate(model_dir, "--prompt-ids", PROMPT) if command == "generate"
            else ["make-model", "--preset", "tiny", "--out", str(tmp_path / "new")])
    _fails(capsys, [*argv, "--seed", seed], f"--seed must be an integer in [0, 2**64), got {seed}")
    assert not (tmp_path / "new").exists()


def test_config_with_fewer_layers_than_the_checkpoint(capsys, model_copy) -> None:
    config = json.loads((model_copy / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (model_copy / "config.json").write_text(json.dumps(config))
    _fails(capsys, _generate(model_copy, "--prompt-ids", PROMPT), "tensor 'model.layers.2.",
           "counts (it lists fewer layers or experts than the checkpoint holds)")


def _edit_tensors(model_dir: Path, edit) -> None:
    """Rewrite the checkpoint (one shard) with the tensors `edit` returns from the name -> array mapping."""
    tensors = edit({name: np.array(array) for name, array in open_checkpoint(model_dir).items()})
    for shard in model_dir.glob("*.safetensors"):
        shard.unlink()
    specs = {name: TensorSpec(("",), array.shape) for name, array in tensors.items()}
    write_tensor_dir(model_dir, json.loads((model_dir / "config.json").read_text()), specs, tensors, [list(tensors)])


def test_weight_shape_that_disagrees_with_the_packed_size(capsys, model_copy) -> None:
    name = "model.layers.1.mlp.experts.2.down_proj.weight_shape"
    _edit_tensors(model_copy, lambda t: {**t, name: np.array([64, 64], np.int32)})
    _fails(capsys, _generate(model_copy, "--prompt-ids", PROMPT), f"tensor '{name}' holds [64, 64], expected [64, 32]")


def test_unknown_extra_tensor_is_a_one_line_warning(capsys, model_dir, model_copy) -> None:
    _edit_tensors(model_copy, lambda t: {**t, "model.rotary_emb.inv_freq": np.zeros(8, np.float32)})
    assert cli.main(_generate(model_copy, "--prompt-ids", PROMPT, "-n", "3")) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"ddtree-run: warning: {model_copy}: ignoring 1 tensor(s) this model does "
                                         f"not use: 'model.rotary_emb.inv_freq'"]
    assert _streams(captured.out) == _tokens(capsys, _generate(model_dir, "--prompt-ids", PROMPT, "-n", "3"))


def test_nan_norm_weights_name_the_stream_and_position(capsys, model_copy) -> None:
    _edit_tensors(model_copy, lambda t: {**t, "model.norm.weight": np.full_like(t["model.norm.weight"], 0x7FC0)})
    _fails(capsys, _generate(model_copy, "--prompt-ids", "5", "--prompt-ids", PROMPT),
           "stream 0: the target model's logits at position 0 hold nan")


@pytest.mark.parametrize("argv,needles", [
    (["-n", "abc"], ["argument -n/--max-new-tokens: must be a positive integer, got 'abc'"]),
    (["-n", "0"], ["must be a positive integer, got '0'"]),
    (["--budget", "x", "--method", "ddtree"], ["argument --budget: must be a positive integer or 'auto', got 'x'"]),
    (["--budget", "9" * 5000, "--method", "ddtree"],
     ["argument --budget: must be a positive integer or 'auto', got '999"]),
    (["--budget", "9" * 500, "--method", "ddtree"], ["--budget 999", "is more than the maximum tree budget 1024"]),
    (["--prompt-ids", "1" * 5000], ["argument --prompt-ids: must be comma-separated token ids"]),
    (["--prompt", "hello"], ["argument --prompt: not allowed with argument --prompt-ids"]),
    (["--stop-ids", "1,x"], ["argument --stop-ids: must be comma-separated token ids"]),
    (["--stop-ids", "600"], ["--stop-ids: token id 600 at position 0 is outside the vocabulary [0, 512)"]),
    (["--prompt-ids", "1", "--prompt-id", "2"], ["unrecognized arguments: --prompt-id 2"]),
    (["--temperature", "nan"], ["--temperature must be a finite number >= 0, got nan"]),
    (["--temperature", "-1"], ["--temperature must be a finite number >= 0"]),
    (["--budget", "8"], ["--budget applies to --method 'ddtree' only"]),
    (["--drafter", "x"], ["--drafter applies to --method ddtree only"]),
])
def test_bad_arguments(capsys, model_dir, nothing_loads, argv, needles) -> None:
    line = _fails(capsys, _generate(model_dir, "--prompt-ids", PROMPT, *argv), *needles)
    assert "_positive" not in line


@pytest.mark.parametrize("ids,item", [("1,,2", "item 2 is ''"), ("1,2,", "item 3 is ''"), (",1", "item 1 is ''"),
                                      ("+1", "item 1 is '+1'"), ("1_0", "item 1 is '1_0'"), ("-3", "item 1 is '-3'"),
                                      ("1;2", "item 1 is '1;2'"), ("", "item 1 is ''"), ("١", "item 1 is '١'")])
def test_prompt_ids_are_parsed_strictly(capsys, model_dir, nothing_loads, ids, item) -> None:
    _fails(capsys, _generate(model_dir, f"--prompt-ids={ids}"),
           "argument --prompt-ids: must be comma-separated token ids", item)


def test_prompt_ids_allow_spaces_around_items(capsys, model_dir) -> None:
    assert _tokens(capsys, _generate(model_dir, "--prompt-ids", " 1, 2 ,3", "-n", "2")) == \
        _tokens(capsys, _generate(model_dir, "--prompt-ids", "1,2,3", "-n", "2"))


def test_token_id_beyond_64_bits(capsys, model_dir, nothing_loads) -> None:
    _fails(capsys, _generate(model_dir, "--prompt-ids", f"1,{2**70}"),
           f"--prompt-ids of stream 0: token id {2**70} at position 1 is outside the vocabulary [0, 512)")


def test_malformed_index_names_the_field(capsys, model_copy) -> None:
    (model_copy / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": ["a", "b"]}))
    _fails(capsys, _generate(model_copy, "--prompt-ids", PROMPT), INDEX_FILE,
           "field 'weight_map' must be an object mapping tensor names to shard files")


def test_out_that_is_a_file(capsys, tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    _fails(capsys, ["make-model", "--preset", "tiny", "--out", str(tmp_path / "f")],
           f"--out {tmp_path / 'f'}: exists and is not a directory")
    _fails(capsys, ["make-model", "--preset", "tiny", "--out", str(tmp_path / "f" / "m")], str(tmp_path / "f"))


def test_make_model_never_overwrites(capsys, model_copy) -> None:
    before = {p.name: p.read_bytes() for p in model_copy.iterdir() if p.is_file()}
    _fails(capsys, ["make-model", "--preset", "tiny", "--out", str(model_copy), "--seed", "9"],
           f"--out {model_copy}: directory is not empty")
    assert {p.name: p.read_bytes() for p in model_copy.iterdir() if p.is_file()} == before
    (model_copy.parent / "empty").mkdir()
    assert cli.main(["make-model", "--preset", "tiny", "--out", str(model_copy.parent / "empty")]) == 0


def test_bad_stream_among_good_ones_fails_before_any_runs(capsys, model_dir, monkeypatch) -> None:
    alone = _tokens(capsys, _generate(model_dir, "--prompt-ids", PROMPT, "--prompt-ids", "7,8", "-n", "4"))
    with monkeypatch.context() as patch:
        patch.setattr(ReferenceModel, "load", lambda *a: pytest.fail("a stream ran before every one was checked"))
        _fails(capsys, _generate(model_dir, "--prompt-ids", PROMPT, "--prompt-ids", "7,512", "--prompt-ids", "7,8",
                                 "-n", "4"), "--prompt-ids of stream 1: token id 512 at position 1")
        _fails(capsys, _generate(model_dir, "--prompt-ids", PROMPT, "--prompt-ids", ",".join(["1"] * 1022),
                                 "-n", "4"), "--prompt-ids of stream 1 (1022 ids) and -n 4 need 1026 positions")
    assert _tokens(capsys, _generate(model_dir, "--prompt-ids", PROMPT, "--prompt-ids", "7,8", "-n", "4")) == alone


def test_unexpected_exception_is_one_line_and_traceback_on_request(capsys, model_dir, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(ReferenceModel, "load", broken)
    _fails(capsys, _generate(model_dir, "--prompt-ids", PROMPT),
           "ddtree-run: internal error: RuntimeError: boom second line (run with --traceback", status=1)
    for argv in (["--traceback", *_generate(model_dir, "--prompt-ids", PROMPT)],
                 [*_generate(model_dir, "--prompt-ids", PROMPT), "--traceback"]):
        with pytest.raises(RuntimeError, match="boom"):
            cli.main(argv)


def test_oserror_is_one_line_with_the_file(capsys, model_dir, monkeypatch) -> None:
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(model_dir / "config.json"))

    monkeypatch.setattr(ReferenceModel, "load", denied)
    _fails(capsys, _generate(model_dir, "--prompt-ids", PROMPT),
           f"ddtree-run: error: {model_dir / 'config.json'}: Permission denied")


# ---- any argument list ---------------------------------------------------------------------------------------

GARBAGE = st.sampled_from(["", " ", "-1", "0", "abc", "nan", "inf", "-inf", "1e999", "1.5", "+3", "1_0", "٣",
                           str(2**64), str(2**70), "1,,2", ",", "\n", "--", "-n"])


def _mostly(valid: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """A valid value three times in four, else garbage."""
    return st.one_of(valid, valid, valid, GARBAGE)


VALUES = {
    "--prompt-ids": _mostly(st.lists(st.integers(0, 600), min_size=1, max_size=4).map(
        lambda ids: ",".join(map(str, ids)))),
    "-n": _mostly(st.sampled_from(["1", "3", "6", "5000"])),
    "--temperature": _mostly(st.sampled_from(["0", "0.7", "2"])),
    "--seed": _mostly(st.integers(0, 9).map(str)),
    "--method": _mostly(st.sampled_from(["ar", "ddtree"])),
    "--budget": _mostly(st.sampled_from(["1", "7", "64", "1025", "100000"])),
    "--backend": _mostly(st.sampled_from(["reference", "auto", "engine"])),
    "--drafter": _mostly(st.just("MODEL/drafter")),
    "--prompt": GARBAGE,
    "--stop-ids": _mostly(st.lists(st.integers(0, 600), min_size=1, max_size=2).map(
        lambda ids: ",".join(map(str, ids)))),
}


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_generate_arguments_end_in_a_run_or_one_line(capsys, model_dir: Path, data: st.DataObject) -> None:
    """Flags in any order with valid or malformed values: status 0 with the tokens, or status 2 and one error
    line; never an internal error or a traceback."""
    flags = ["--prompt-ids", *data.draw(st.lists(st.sampled_from(sorted(VALUES)), max_size=5))]
    argv = ["generate", "--model", str(model_dir)]
    for flag in flags:
        argv += [flag, data.draw(VALUES[flag]).replace("MODEL", str(model_dir))]
    status = cli.main(argv)
    event(f"status {status}")
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    if status == 0:
        assert "->" in captured.out and lines == [], lines
    else:
        assert status == 2 and len(lines) == 1 and lines[0].startswith("ddtree-run: error: "), (status, lines)
