"""ddtree-run: make models, generate tokens, describe the machine.

Every failure prints one line on stderr and exits non-zero: bad input (status 2) names what is at fault, anything
unexpected (status 1) names the exception, whose traceback --traceback shows. Warnings are one line each.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import typing
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ddtree.config import ModelConfig
from ddtree.errors import DDTreeError, NonFiniteError, RequestError
from ddtree.limits import MAX_TREE_BUDGET
from ddtree.request import ArgumentNames, check_request, check_seed
from ddtree.results import GenerationResult

PRESETS = ("tiny", "small", "k2-layers")
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "ddtree" / "tiny-seed0"
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


class _OneLineParser(argparse.ArgumentParser):
    """Argument errors are one line on stderr and exit status 2, like every other ddtree-run error; no option
    is matched by a prefix of its name (--prompt is not --prompt-ids)."""

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"ddtree-run: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="ddtree-run", description=__doc__.splitlines()[0])
    # --traceback is accepted before or after the command; a subcommand's default must not hide the top one's.
    parser.add_argument("--traceback", action="store_true", help="show the traceback of an unexpected error")
    common = _OneLineParser(add_help=False)
    common.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)

    make = sub.add_parser("make-model", parents=[common], help="write a seeded random checkpoint in the real K2 format")
    make.add_argument("--preset", choices=PRESETS, required=True)
    make.add_argument("--out", type=Path, required=True, help="directory to write (new or empty)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--layers", type=_positive, default=None, help="layer count (k2-layers)")

    gen = sub.add_parser("generate", parents=[common], help="generate tokens greedily (or sampled) from prompt ids")
    gen.add_argument("--model", type=Path, default=None,
                     help="checkpoint directory (default: a built-in tiny model, written on first use)")
    gen.add_argument("--prompt-ids", type=_prompt_ids, action="append", required=True,
                     help="comma-separated prompt token ids; repeat for several streams")
    gen.add_argument("-n", "--max-new-tokens", type=_positive, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--backend", choices=("auto", "engine", "reference"), default="auto",
                     help="engine needs a CUDA device; auto picks it when one is present")
    gen.add_argument("--method", choices=("ar", "ddtree"), default="ar",
                     help="autoregressive decoding, or DDTree speculative decoding with the drafter")
    gen.add_argument("--budget", type=_positive, default=None,
                     help=f"DDTree node budget, at most {MAX_TREE_BUDGET} (default block_size - 1)")
    gen.add_argument("--drafter", type=Path, default=None,
                     help=f"drafter checkpoint directory (default: MODEL/{DRAFTER_SUBDIR})")

    sub.add_parser("info", parents=[common], help="describe the CUDA devices and the native build")
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
    """--model, or the built-in tiny model, written on first use."""
    if args.model is None:
        if not (DEFAULT_MODEL_DIR / "config.json").is_file():
            _write_preset("tiny", DEFAULT_MODEL_DIR, seed=0, layers=None)
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


def _backend(args: argparse.Namespace) -> str:
    from ddtree.device import has_cuda_device

    if args.backend == "auto":
        return "engine" if args.method == "ar" and has_cuda_device() else "reference"
    if args.backend == "engine":
        if args.method != "ar":
            raise RequestError("--method ddtree runs on the reference backend only for now (--backend reference)")
        if not has_cuda_device():
            raise RequestError("--backend engine needs a CUDA device, and none is present")
    return str(args.backend)


def _check_requests(args: argparse.Namespace, model_dir: Path) -> None:
    """Every stream's request, checked against the configs before any weight is read or any stream runs."""
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
    for i, prompt in enumerate(args.prompt_ids):
        names = ArgumentNames(prompt=f"--prompt-ids of stream {i}", new_tokens="-n", method="--method",
                              budget="--budget", temperature="--temperature", seed="--seed",
                              model_config=str(model_dir / "config.json"), drafter_config=drafter_config)
        check_request(cfg, drafter, prompt, args.max_new_tokens, args.method, args.budget, args.temperature,
                      args.seed, names)


def _reference_generate(args: argparse.Namespace, model_dir: Path,
                        on_tokens: Callable[[int, int], None]) -> list[GenerationResult]:
    """The numpy reference, one stream at a time: the backend for machines without a GPU."""
    from ddtree.reference import ReferenceModel, generate
    from ddtree.reference.drafter import ReferenceDrafter

    model = ReferenceModel.load(model_dir)
    drafter = None
    if args.method == "ddtree":
        drafter = ReferenceDrafter.for_model(_drafter_dir(args, model_dir), model)
    results = []
    for i, prompt in enumerate(args.prompt_ids):
        try:
            results.append(generate(model, drafter, prompt, args.max_new_tokens, method=args.method,
                                    budget=args.budget, temperature=args.temperature, seed=args.seed + i,
                                    on_tokens=lambda count, i=i: on_tokens(i, count)))
        except NonFiniteError as e:
            raise NonFiniteError(f"stream {i}: {e}") from e
    return results


def _engine_generate(args: argparse.Namespace, model_dir: Path,
                     on_tokens: Callable[[int, int], None]) -> list[GenerationResult]:
    """The native GPU engine, all streams at once."""
    from ddtree.engine import Engine

    prompts = args.prompt_ids
    engine = Engine(model_dir, streams=len(prompts), max_context=max(map(len, prompts)) + args.max_new_tokens)
    results = engine.generate(prompts, args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    for i, result in enumerate(results):
        on_tokens(i, len(result.tokens))
    return results


def _generate(args: argparse.Namespace, console: Console) -> int:
    model_dir = _model_dir(args)
    backend = _backend(args)
    _check_requests(args, model_dir)
    run = _engine_generate if backend == "engine" else _reference_generate

    prompts = args.prompt_ids
    progress = Progress(TextColumn(f"[bold]{backend}[/bold] {args.method}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True)
    with progress:
        tasks = [progress.add_task(f"stream {i}", total=args.max_new_tokens) for i in range(len(prompts))]
        results = run(args, model_dir, lambda stream, count: progress.update(tasks[stream], completed=count))
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        console.print(f"[{i}] prompt {prompt} -> {result.tokens}")
        line = (f"    {len(result.tokens)} tokens, prefill {result.prefill_seconds * 1e3:.1f} ms, "
                f"decode {result.tokens_per_second:.1f} tokens/s ({backend}, {args.method})")
        if result.accept_lengths:
            mean = sum(result.accept_lengths) / len(result.accept_lengths)
            line += f", {len(result.accept_lengths)} rounds, mean acceptance length {mean:.2f}"
        console.print(line)
    return 0


def _info(args: argparse.Namespace, console: Console) -> int:
    import ddtree._native as native
    from ddtree.device import device_info

    version = native.cuda_runtime_version()
    console.print(f"ddtree native module: CUDA runtime {version // 1000}.{version % 1000 // 10} (static), "
                  f"built for sm_{native.gpu_archs}")
    console.print(str(device_info()))
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, Console], int]] = {
    "make-model": _make_model,
    "generate": _generate,
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
    console = Console()
    with warnings.catch_warnings():
        warnings.showwarning = _warn
        try:
            return COMMANDS[args.command](args, console)
        except KeyboardInterrupt:
            _say("interrupted")
            return 130
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
