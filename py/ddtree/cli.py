"""ddtree-run: make models, generate tokens, benchmark and profile the GPU engine, estimate tokens/s on other GPUs,
describe the machine.

Every failure prints one line on stderr and exits non-zero: bad input (status 2) names what is at fault, a command
that needs a CUDA device on a machine without one says so (status 3), anything unexpected (status 1) names the
exception, whose traceback --traceback shows. Warnings are one line each.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import sys
import time
import typing
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console

from ddtree import __version__
from ddtree.config import ModelConfig
from ddtree.errors import DDTreeError, DeviceError, NonFiniteError, RequestError
from ddtree.estimate.gpus import GPUS as GPU_PRESETS
from ddtree.generation_view import OnTokens, Run, progress_display, show_results
from ddtree.limits import MAX_TREE_BUDGET
from ddtree.request import AUTO, AUTO_MAX_BUDGET, ArgumentNames, check_request, check_seed, check_stop_ids
from ddtree.results import GenerationResult, with_text
from ddtree.tokenizer import encode_prompts

PRESETS = ("tiny", "small", "k2-layers")
# The built-in model, installed with the package: a small K2-architecture target and its DFlash drafter trained on
# the Python standard library (tools/train_demo.py; figures in bench/results/demo), with its tokenizer.json.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "demo"
DRAFTER_SUBDIR = "drafter"


# A non-negative integer in ASCII digits (spaces around it allowed): int() would also take '+1', '1_0', other scripts.
# At most 1000 digits: int() refuses more than 4300, and argparse would then report only 'invalid value'.
DECIMAL = re.compile(r"\s*[0-9]{1,1000}\s*")


def _prompt_ids(text: str) -> list[int]:
    """Comma-separated decimal token ids, every one present: '1,,2' and '1,2,' are refused, not read as [1, 2]."""
    pieces = text.split(",")
    for i, piece in enumerate(pieces):
        if not DECIMAL.fullmatch(piece):
            raise argparse.ArgumentTypeError(f"must be comma-separated token ids (decimal integers >= 0), got "
                                             f"{text!r:.80}: item {i + 1} is {piece!r:.40}")
    return [int(piece) for piece in pieces]


def _positive(text: str) -> int:
    value = int(text) if DECIMAL.fullmatch(text) else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r:.40}")
    return value


def _budget(text: str) -> int | str:
    """A tree budget: a positive integer, or 'auto' (the cost-aware budget per round)."""
    if text.strip() == AUTO:
        return AUTO
    value = int(text) if DECIMAL.fullmatch(text) else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {text!r:.40}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r:.40}")
    return value


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default, where it has one; epilogs (the examples) keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == [] or \
            action.default is argparse.SUPPRESS
        return text if unset or not action.option_strings else text + " (default: %(default)s)"


class _OneLineParser(argparse.ArgumentParser):
    """Argument errors are one line on stderr and exit status 2, like every other ddtree-run error; no option
    is matched by a prefix of its name (--prompt is not --prompt-ids)."""

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        super().__init__(*args, allow_abbrev=False, formatter_class=_HelpFormatter, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"ddtree-run: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="ddtree-run", description=__doc__.splitlines()[0],
                            epilog="example:\n  ddtree-run generate --prompt 'def fibonacci(n):' --method ddtree")
    parser.add_argument("--version", action="version", version=f"ddtree {__version__}")
    # --traceback is accepted before or after the command; a subcommand's default must not hide the top one's.
    parser.add_argument("--traceback", action="store_true", help="show the traceback of an unexpected error")
    common = _OneLineParser(add_help=False)
    common.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)

    make = sub.add_parser("make-model", parents=[common], help="write a seeded random checkpoint in the real K2 format",
                          description="Write a seeded random target checkpoint in the real Kimi-K2 format and a "
                                      f"matching DFlash drafter in OUT/{DRAFTER_SUBDIR}.",
                          epilog="example:\n  ddtree-run make-model --preset tiny --out models/tiny --seed 0")
    make.add_argument("--preset", choices=PRESETS, required=True,
                      help="tiny (seconds on a CPU), small (about 300 MB), k2-layers (real K2 dimensions)")
    make.add_argument("--out", type=Path, required=True, help="directory to write (new or empty)")
    make.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    make.add_argument("--layers", type=_positive, default=None, help="layer count (k2-layers only)")

    gen = sub.add_parser("generate", parents=[common], help="generate text or tokens from a prompt",
                         description="Generate from text prompts (--prompt, with the checkpoint's tokenizer) or token "
                                     "ids (--prompt-ids), one stream per prompt, greedily or sampled.",
                         epilog="examples:\n"
                                "  ddtree-run generate --prompt 'def fibonacci(n):' -n 64 --method ddtree --budget 32\n"
                                "  ddtree-run generate --model models/tiny --prompt-ids 1,2,3 -n 16\n"
                                "  ddtree-run generate --model MODEL --prompt 'The capital of France is' -n 32 "
                                "--method ddtree")
    gen.add_argument("--model", type=Path, default=None,
                     help=f"checkpoint directory (default: the built-in demo model, trained on Python's standard "
                          f"library, in {DEFAULT_MODEL_DIR})")
    prompts = gen.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", metavar="TEXT",
                         help="prompt text, encoded with the checkpoint's tokenizer (tokenizer.json, or "
                              "tiktoken.model with tokenizer_config.json); repeat for several streams")
    prompts.add_argument("--prompt-ids", type=_prompt_ids, action="append",
                         help="comma-separated prompt token ids; repeat for several streams")
    gen.add_argument("-n", "--max-new-tokens", type=_positive, default=32, help="the most tokens to generate")
    gen.add_argument("--stop-ids", type=_prompt_ids, default=[],
                     help="comma-separated token ids that end a stream (kept in its output), besides the "
                          "eos_token_id of config.json")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="do not stop at config.json's eos_token_id (always generate -n tokens, unless --stop-ids)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; above 0 samples")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--backend", choices=("auto", "engine", "reference"), default="auto",
                     help="engine needs a CUDA device and the native module; auto picks it when both are there "
                          "(ddtree-run info says which it picks)")
    gen.add_argument("--method", choices=("ar", "ddtree"), default="ar",
                     help="autoregressive decoding, or DDTree speculative decoding with the drafter")
    gen.add_argument("--budget", type=_budget, default=None,
                     help=f"DDTree node budget, at most {MAX_TREE_BUDGET} (default block_size - 1), or 'auto': each "
                          "round's budget among 8, 16, 32, 64, chosen for the most expected tokens per second")
    gen.add_argument("--drafter", type=Path, default=None,
                     help=f"drafter checkpoint directory (default: MODEL/{DRAFTER_SUBDIR})")
    gen.add_argument("--stages", action="store_true",
                     help="GPU DDTree: run the rounds eagerly with each stage timed and print the device time split "
                          "(tokens/s is then that of eager rounds)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON document (backend, method, and per stream: tokens, text, timings, "
                          "acceptance lengths) instead of lines and progress")

    est = sub.add_parser("estimate", parents=[common],
                         help="project DDTree and AR tokens/s for a GPU, layout and acceptance (no GPU needed)",
                         description="Project tokens/s of DDTree rounds and AR decoding from a per-round cost model "
                                     "fitted to the H200 measurements committed with ddtree (bench/results), for "
                                     "another GPU, the full K2 on a G-GPU expert-parallel layout and acceptance "
                                     "profiles, each with its uncertainty.",
                         epilog="examples:\n"
                                "  ddtree-run estimate --gpu b300 --streams 1 16 --budget 32 --mean-accept 4 6\n"
                                "  ddtree-run estimate --gpus 1 --layers 4 --context 176 --streams 16 --budget 64 "
                                "--mean-accept 7.1   # a measured H200 configuration\n"
                                "  ddtree-run estimate --gpu h100 --json")
    est.add_argument("--gpu", choices=sorted(GPU_PRESETS), default="h200",
                     help="GPU preset (h200 is the measured one)")
    est.add_argument("--gpus", type=_positive, default=8,
                     help="GPUs: attention heads and dense parts split G ways, 384 / G routed experts each, the "
                          "drafter whole on each; partial sums gathered after each attention and MLP")
    est.add_argument("--layers", type=_positive, default=61,
                     help="target layers (1 dense + the rest MoE; K2 has 61, the measured models 4)")
    est.add_argument("--context", type=_positive, default=1024, help="committed tokens per stream")
    est.add_argument("--streams", type=_positive, nargs="+", default=[1, 16], metavar="N", help="stream counts")
    est.add_argument("--budget", type=_positive, nargs="+", default=[8, 32], metavar="B", help="DDTree node budgets")
    est.add_argument("--mean-accept", type=_finite, nargs="+", default=[2.0, 4.0, 6.0], metavar="A",
                     help="tokens committed per round per stream (accepted nodes + the bonus token)")
    est.add_argument("--json", action="store_true", help="print one JSON document instead of the table")

    engine_model = _OneLineParser(add_help=False)
    engine_model.add_argument("--model", type=Path, default=None,
                              help=f"checkpoint directory with its drafter in MODEL/{DRAFTER_SUBDIR} (default: the "
                                   "built-in demo pair)")
    engine_model.add_argument("--drafter", type=Path, default=None,
                              help=f"drafter checkpoint directory (default: MODEL/{DRAFTER_SUBDIR})")
    engine_model.add_argument("--preset", choices=PRESETS, default=None,
                              help="random weights of a preset's dims (and a random drafter of them) instead of a "
                                   "checkpoint; nothing is written to disk")
    engine_model.add_argument("--layers", type=_positive, default=None, help="layer count (--preset k2-layers)")

    bench = sub.add_parser("bench", parents=[common, engine_model],
                           help="GPU: tokens/s of AR and DDTree over budgets x streams x context",
                           description="Measure greedy tokens/s of autoregressive decoding and of DDTree rounds on the "
                                       "GPU engine over budgets x streams x context, with the drafter's candidates "
                                       "or, with --accept, an oracle's at set acceptance profiles; a live table, "
                                       "and bench.json, bench.md and bench.png in --out.",
                           epilog="examples:\n"
                                  "  ddtree-run bench --out bench-demo\n"
                                  "  ddtree-run bench --preset k2-layers --layers 4 --streams 1 16 --budget 8 32 "
                                  "--accept 2 4 6 --out bench-k2")
    bench.add_argument("--streams", type=_positive, nargs="+", default=[1, 4], metavar="N", help="stream counts")
    bench.add_argument("--budget", type=_budget, nargs="+", default=[8, 16, 32], metavar="B",
                       help="DDTree node budgets; 'auto' adds rows of the cost-aware budget per round (among the "
                            "powers of two from 8 up to the largest budget given, 64 when none is)")
    bench.add_argument("--context", type=_positive, nargs="+", default=[128, 512], metavar="L",
                       help="prompt tokens per stream")
    bench.add_argument("-n", "--max-new-tokens", type=_positive, default=64, help="tokens decoded per stream")
    bench.add_argument("--accept", type=_finite, nargs="+", default=None, metavar="A",
                       help="oracle candidates at these mean tokens per round (accepted nodes + the bonus token) "
                            "instead of the drafter's")
    bench.add_argument("--out", type=Path, default=None, help="directory for bench.json, bench.md and bench.png")
    bench.add_argument("--json", action="store_true", help="print one JSON document instead of the live table")

    prof = sub.add_parser("profile", parents=[common, engine_model],
                          help="GPU: list the captured CUDA graphs, replay them, split rounds by stage",
                          description="Run a short generation on the GPU engine to capture its CUDA graphs, list "
                                      "them and replay each (or --graph) on its own with its device time per "
                                      "replay; --stages adds the eager DDTree rounds' device time per stage; "
                                      "--single replays one graph once and nothing else, for Nsight Compute.",
                          epilog="examples:\n"
                                 "  ddtree-run profile --stages\n"
                                 "  ddtree-run profile --graph 'ar streams=1 span=127' --replays 100\n"
                                 "  ncu --graph-profiling node --nvtx --nvtx-include 'replay/' ddtree-run profile "
                                 "--single --graph NAME")
    prof.add_argument("--streams", type=_positive, default=1, help="streams decoded together")
    prof.add_argument("--budget", type=_positive, default=None,
                      help=f"DDTree node budget, at most {MAX_TREE_BUDGET} (default block_size - 1)")
    prof.add_argument("--context", type=_positive, default=64, help="prompt tokens per stream")
    prof.add_argument("-n", "--max-new-tokens", type=_positive, default=32, help="tokens decoded per stream")
    prof.add_argument("--method", choices=("ar", "ddtree", "both"), default=None,
                      help="which graphs to capture (default: both with a drafter, else ar)")
    prof.add_argument("--graph", metavar="NAME", default=None, help="replay only this captured graph")
    prof.add_argument("--replays", type=_positive, default=None, help="replays per graph (default 20)")
    prof.add_argument("--stages", action="store_true",
                      help="also run the DDTree rounds eagerly and print each stage's device time per round")
    prof.add_argument("--single", action="store_true",
                      help="replay --graph once, with no warm-up and nothing else on the device (for ncu)")
    prof.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")

    sub.add_parser("info", parents=[common], help="describe the CUDA devices, the native build and the backend",
                   description="Describe the CUDA devices, the native module, the backend generate uses by default "
                               "and where the built-in model is.",
                   epilog="example:\n  ddtree-run info")
    return parser


def _write_preset(preset: str, out: Path, seed: int, layers: int | None) -> ModelConfig:
    """The target checkpoint in `out`, its matching DFlash drafter in `out/drafter`."""
    from ddtree.drafter import make_drafter
    from ddtree.presets import make_model

    cfg = make_model(preset, out, seed=seed, layers=layers)
    make_drafter(cfg, out / DRAFTER_SUBDIR, seed=seed + 1, preset=preset)
    return cfg


def _make_model(args: argparse.Namespace, console: Console) -> int:
    if args.layers is not None and args.preset != "k2-layers":
        raise RequestError(f"--layers applies to the k2-layers preset only, not {args.preset!r}")
    check_seed(args.seed, "--seed")
    if args.out.exists() and not args.out.is_dir():
        raise RequestError(f"--out {args.out}: exists and is not a directory")
    if args.out.is_dir() and any(args.out.iterdir()):
        raise RequestError(f"--out {args.out}: directory is not empty; make-model writes a new model and never "
                           f"over an existing one (remove it or choose another directory)")
    start = time.perf_counter()
    with console.status(f"writing {args.preset} checkpoint and drafter to {args.out}"):
        cfg = _write_preset(args.preset, args.out, args.seed, args.layers)
    console.print(f"wrote {args.preset} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                  f"{cfg.n_routed_experts} experts, vocab {cfg.vocab_size}) to {args.out}, drafter to "
                  f"{args.out / DRAFTER_SUBDIR}, in {time.perf_counter() - start:.1f} s")
    return 0


def _model_dir(args: argparse.Namespace) -> Path:
    """--model, or the built-in demo model."""
    if args.model is None:
        if not (DEFAULT_MODEL_DIR / "config.json").is_file():
            raise RequestError(f"the built-in model is missing from this installation ({DEFAULT_MODEL_DIR}): "
                               f"reinstall ddtree, or pass --model")
        return DEFAULT_MODEL_DIR
    if not args.model.is_dir():
        fault = "is not a directory" if args.model.exists() else "directory does not exist"
        raise RequestError(f"--model {args.model}: {fault}")
    return args.model


def _drafter_dir(args: argparse.Namespace, model_dir: Path) -> Path:
    drafter_dir = args.drafter if args.drafter is not None else model_dir / DRAFTER_SUBDIR
    if not drafter_dir.is_dir():
        raise RequestError(f"--drafter {drafter_dir}: directory does not exist (make-model writes one into "
                           f"MODEL/{DRAFTER_SUBDIR})")
    return drafter_dir


def _backend(backend: str, method: str) -> tuple[str, str]:
    """The backend `generate` runs (`backend` is --backend) and why."""
    from ddtree.device import has_cuda_device, native_unavailable

    if backend == "reference":
        return "reference", "--backend reference"
    missing = native_unavailable()
    if missing is not None:
        if backend == "engine":
            raise RequestError(f"--backend engine: {missing}")
        return "reference", "the native module is not built"
    if not has_cuda_device():
        if backend == "engine":
            raise RequestError("--backend engine needs a CUDA device, and none is present")
        return "reference", "no CUDA device is present"
    return "engine", "a CUDA device is present"


def _stop_ids(args: argparse.Namespace, cfg: ModelConfig) -> list[int]:
    """config.json's eos ids (unless --ignore-eos; one outside the vocabulary is never generated, so it is left out)
    and --stop-ids."""
    stops = [] if args.ignore_eos else [eos for eos in cfg.eos_token_ids if 0 <= eos < cfg.vocab_size]
    stops += check_stop_ids(args.stop_ids, cfg.vocab_size, "--stop-ids")
    return stops


def _check_requests(args: argparse.Namespace, model_dir: Path, prompts: list[Sequence[int]]) -> list[int]:
    """Every stream's request, checked against the configs before any weight is read or any stream runs; the stop
    ids."""
    from ddtree.config import load_config
    from ddtree.drafter import DrafterConfig, load_drafter_config

    cfg = load_config(model_dir)
    drafter: DrafterConfig | None = None
    drafter_config = "--drafter"
    if args.method == "ddtree":
        drafter_dir = _drafter_dir(args, model_dir)
        drafter = load_drafter_config(drafter_dir, cfg)
        drafter_config = str(drafter_dir / "config.json")
    elif args.drafter is not None:
        raise RequestError("--drafter applies to --method ddtree only")
    flag = "--prompt" if args.prompt is not None else "--prompt-ids"
    for i, prompt in enumerate(prompts):
        names = ArgumentNames(prompt=f"{flag} of stream {i}", new_tokens="-n", method="--method",
                              budget="--budget", temperature="--temperature", seed="--seed",
                              model_config=str(model_dir / "config.json"), drafter_config=drafter_config)
        check_request(cfg, drafter, prompt, args.max_new_tokens, args.method, args.budget, args.temperature,
                      args.seed, names)
    return _stop_ids(args, cfg)


def _reference_generate(args: argparse.Namespace, model_dir: Path, prompts: list[Sequence[int]], stops: list[int],
                        on_tokens: OnTokens) -> list[GenerationResult]:
    """The numpy reference, one stream at a time: the backend for machines without a GPU."""
    import numpy as np

    from ddtree.reference import ReferenceModel, generate
    from ddtree.reference.drafter import ReferenceDrafter

    model = ReferenceModel.load(model_dir)
    drafter = None
    if args.method == "ddtree":
        drafter = ReferenceDrafter.for_model(_drafter_dir(args, model_dir), model)
    # The first forward widens the weights it reads to float32 and dequantizes the experts it routes to, once; a
    # discarded prefill of the first prompt pays that, so no stream's prefill time includes it.
    model.forward(prompts[0], np.arange(len(prompts[0])), model.new_cache())
    results = []
    for i, prompt in enumerate(prompts):
        try:
            results.append(generate(model, drafter, prompt, args.max_new_tokens, method=args.method,
                                    budget=args.budget, temperature=args.temperature, seed=args.seed, stream=i,
                                    stop_token_ids=stops, on_tokens=lambda tokens, i=i: on_tokens(i, tokens)))
        except NonFiniteError as e:
            raise NonFiniteError(f"stream {i}: {e}") from e
    return results


def _engine_generate(args: argparse.Namespace, model_dir: Path, prompts: list[Sequence[int]], stops: list[int],
                     on_tokens: OnTokens) -> list[GenerationResult]:
    """The native GPU engine, all streams at once: autoregressive, or DDTree rounds with the drafter."""
    from ddtree.engine import Engine

    drafter_dir = _drafter_dir(args, model_dir) if args.method == "ddtree" else None
    auto = args.budget == AUTO
    engine = Engine(model_dir, drafter_dir=drafter_dir, streams=len(prompts),
                    max_context=max(map(len, prompts)) + args.max_new_tokens,
                    budget=AUTO_MAX_BUDGET if auto else args.budget)
    results = engine.generate(prompts, args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                              method=args.method, stop_token_ids=stops, profile=args.stages,
                              **({"budget": AUTO} if auto else {}))
    for i, result in enumerate(results):
        on_tokens(i, result.tokens)
    return results


def _generate(args: argparse.Namespace, console: Console) -> int:
    model_dir = _model_dir(args)
    backend, _ = _backend(args.backend, args.method)
    if args.stages and (backend != "engine" or args.method != "ddtree"):
        raise RequestError("--stages times the GPU engine's DDTree rounds: it needs --method ddtree on the engine "
                           "backend")
    prompts, tokenizer = encode_prompts(args.prompt or args.prompt_ids, model_dir)
    stops = _check_requests(args, model_dir, prompts)
    run = Run(backend, args.method, prompts, args.prompt, args.max_new_tokens)
    generate = _engine_generate if backend == "engine" else _reference_generate
    with progress_display(run, console, tokenizer, quiet=args.json) as on_tokens:
        results = generate(args, model_dir, prompts, stops, on_tokens)
    show_results(run, [with_text(result, tokenizer) for result in results], console, as_json=args.json)
    return 0


def _estimate(args: argparse.Namespace, console: Console) -> int:
    from ddtree.estimate import project
    from ddtree.estimate.request import check_estimate
    from ddtree.estimate.view import show

    req = check_estimate(args.gpu, args.gpus, args.layers, args.context, args.streams, args.budget, args.mean_accept)
    rows = [project(req.layout, req.context, s, b, a) for s in req.streams for b in req.budgets
            for a in req.mean_accepts]
    show(req, rows, console, as_json=args.json)
    return 0


def _model_source(args: argparse.Namespace):
    from ddtree.bench.models import model_source

    return model_source(args.model, args.preset, args.layers, args.drafter, DEFAULT_MODEL_DIR, DRAFTER_SUBDIR)


def _require_device(command: str) -> str:
    """The device bench and profile run on, described; DeviceError saying what is missing otherwise."""
    from ddtree.device import device_info, native_unavailable

    missing = native_unavailable()
    if missing is not None:
        raise DeviceError(f"{command} runs the GPU engine: {missing}")
    info = device_info()
    if not info.devices:
        raise DeviceError(f"{command} runs the GPU engine and needs a CUDA device: {info}")
    return str(info)


def _bench(args: argparse.Namespace, console: Console) -> int:
    import json

    from ddtree.bench.report import write_report
    from ddtree.bench.sweep import bench_engine, check_bench, run_sweep
    from ddtree.bench.view import live_rows

    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise RequestError(f"--out {args.out}: exists and is not a directory")
    source = _model_source(args)
    req = check_bench(source, args.streams, args.budget, args.context, args.accept, args.max_new_tokens)
    device = _require_device("bench")
    with console.status(f"loading {source.label}") if not args.json else contextlib.nullcontext():
        engine = bench_engine(source, req)
    title = f"{source.label} on {device}"
    with live_rows(console, title, req, quiet=args.json) as on_row:
        rows = run_sweep(engine, source, req, on_row)
    meta = {"model": source.label, "device": device}
    if args.json:
        console.out(json.dumps({**meta, "rows": [r.as_dict() for r in rows]}, indent=2), highlight=False)
    if args.out is not None:
        written = write_report(args.out, meta, req, rows)
        if not any(p.suffix == ".png" for p in written):
            warnings.warn("matplotlib is not installed (pip install 'ddtree[bench]'): bench.png was not written")
        if not args.json:
            console.print(f"wrote {', '.join(str(p) for p in written)}", highlight=False)
    if not all(r.exact for r in rows):
        raise RuntimeError("DDTree tokens differ from AR's in a row marked NO: greedy DDTree must equal greedy AR")
    return 0


def _profile(args: argparse.Namespace, console: Console) -> int:
    from ddtree.bench.profile import check_profile, profile_engine, run_profile
    from ddtree.bench.profile_view import show_profile

    source = _model_source(args)
    req = check_profile(source, args.streams, args.budget, args.context, args.max_new_tokens, args.method,
                        args.graph, args.replays, args.stages, args.single)
    device = _require_device("profile")
    engine = profile_engine(source, req)
    result = run_profile(engine, source, req)
    header = (f"{source.label} on {device}: {req.streams} stream{'s' if req.streams > 1 else ''}, context "
              f"{req.context}, {req.new_tokens} new tokens")
    show_profile(header, req, result, console, as_json=args.json)
    return 0


def _info(args: argparse.Namespace, console: Console) -> int:
    from ddtree.device import device_info, native_unavailable

    missing = native_unavailable()
    if missing is None:
        import ddtree._native as native

        version = native.cuda_runtime_version()
        console.out(f"ddtree {__version__} native module: CUDA runtime {version // 1000}.{version % 1000 // 10} "
                    f"(static), built for sm_{native.gpu_archs}", highlight=False)
    else:
        console.out(f"ddtree {__version__}: {missing}", highlight=False)
    console.out(str(device_info()), highlight=False)
    backend, why = _backend("auto", "ar")
    console.out(f"generate runs on the {backend} backend ({why}; --backend overrides it; --method ddtree runs on "
                f"the reference backend)", highlight=False)
    missing = "" if (DEFAULT_MODEL_DIR / "config.json").is_file() else " (missing from this installation)"
    console.out(f"built-in model (generate without --model): {DEFAULT_MODEL_DIR}{missing}", highlight=False)
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, Console], int]] = {
    "make-model": _make_model,
    "generate": _generate,
    "estimate": _estimate,
    "bench": _bench,
    "profile": _profile,
    "info": _info,
}


def _say(text: str) -> None:
    """One line on stderr, whatever newlines the text holds."""
    print("ddtree-run: " + " ".join(text.split()), file=sys.stderr)


def _warn(message: Warning | str, category: type[Warning], filename: str, lineno: int,
          file: typing.TextIO | None = None, line: str | None = None) -> None:
    _say(f"warning: {message}")


def _describe(error: Exception) -> str:
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror}"
    return str(error)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as stop:  # argparse has printed its one line (or the help): return its status, not raise
        return int(stop.code or 0)
    # soft_wrap: a long line stays one line when piped, where rich would wrap it at 80 columns
    console = Console(soft_wrap=True)
    with warnings.catch_warnings():
        warnings.showwarning = _warn
        try:
            return COMMANDS[args.command](args, console)
        except KeyboardInterrupt:
            _say("interrupted")
            return 130
        except DeviceError as e:
            _say(f"error: {e}")
            return 3
        except (DDTreeError, OSError) as e:
            if args.traceback:
                raise
            _say(f"error: {_describe(e)}")
            return 2
        except Exception as e:  # a bug, or a failure no check foresaw: still one line, the traceback on request
            if args.traceback:
                raise
            _say(f"internal error: {type(e).__name__}: {e} (run with --traceback to see where)")
            return 1


if __name__ == "__main__":
    sys.exit(main())
