"""ddtree-run: make models, generate tokens, describe the machine.

Every failure on bad input prints one line naming what is at fault and exits non-zero.
"""

from __future__ import annotations

import argparse
import sys
import time
import typing
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ddtree.config import ModelConfig
from ddtree.errors import DDTreeError, RequestError
from ddtree.results import GenerationResult

PRESETS = ("tiny", "small", "k2-layers")
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "ddtree" / "tiny-seed0"
DRAFTER_SUBDIR = "drafter"


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids must name at least one token id")
    return ids


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


class _OneLineParser(argparse.ArgumentParser):
    """Argument errors are one line on stderr and exit status 2, like every other ddtree-run error."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"ddtree-run: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="ddtree-run", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)

    make = sub.add_parser("make-model", help="write a seeded random checkpoint in the real K2 format")
    make.add_argument("--preset", choices=PRESETS, required=True)
    make.add_argument("--out", type=Path, required=True, help="directory to write (created)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--layers", type=_positive, default=None, help="layer count (k2-layers)")

    gen = sub.add_parser("generate", help="generate tokens greedily (or sampled) from prompt ids")
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
    gen.add_argument("--budget", type=_positive, default=None, help="DDTree node budget (default block_size - 1)")
    gen.add_argument("--drafter", type=Path, default=None,
                     help=f"drafter checkpoint directory (default: MODEL/{DRAFTER_SUBDIR})")

    sub.add_parser("info", help="describe the CUDA devices and the native build")
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
    start = time.perf_counter()
    with console.status(f"writing {args.preset} checkpoint and drafter to {args.out}"):
        cfg = _write_preset(args.preset, args.out, args.seed, args.layers)
    console.print(f"wrote {args.preset} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                  f"{cfg.n_routed_experts} experts, vocab {cfg.vocab_size}) to {args.out}, drafter to "
                  f"{args.out / DRAFTER_SUBDIR}, in {time.perf_counter() - start:.1f} s")
    return 0


def _reference_generate(args: argparse.Namespace, model_dir: Path,
                        on_tokens: Callable[[int, int], None]) -> list[GenerationResult]:
    """The numpy reference, one stream at a time: the backend for machines without a GPU."""
    from ddtree.reference import ReferenceModel, generate
    from ddtree.reference.drafter import ReferenceDrafter

    model = ReferenceModel.load(model_dir)
    drafter = None
    if args.method == "ddtree":
        drafter = ReferenceDrafter.for_model(_drafter_dir(args, model_dir), model)
    return [generate(model, drafter, prompt, args.max_new_tokens, method=args.method, budget=args.budget,
                     temperature=args.temperature, seed=args.seed + i,
                     on_tokens=lambda count, i=i: on_tokens(i, count))
            for i, prompt in enumerate(args.prompt_ids)]


def _drafter_dir(args: argparse.Namespace, model_dir: Path) -> Path:
    drafter_dir = args.drafter if args.drafter is not None else model_dir / DRAFTER_SUBDIR
    if not drafter_dir.is_dir():
        raise RequestError(f"--drafter {drafter_dir}: directory does not exist (make-model writes one into "
                           f"MODEL/{DRAFTER_SUBDIR})")
    return drafter_dir


def _engine_generate(args: argparse.Namespace, model_dir: Path,
                     on_tokens: Callable[[int, int], None]) -> list[GenerationResult]:
    """The native GPU engine, all streams at once."""
    from ddtree.engine import Engine

    if args.method != "ar":
        raise RequestError("--method ddtree runs on the reference backend only for now (--backend reference)")
    prompts = args.prompt_ids
    engine = Engine(model_dir, streams=len(prompts), max_context=max(map(len, prompts)) + args.max_new_tokens)
    results = engine.generate(prompts, args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    for i, result in enumerate(results):
        on_tokens(i, len(result.tokens))
    return results


def _generate(args: argparse.Namespace, console: Console) -> int:
    from ddtree.device import has_cuda_device

    model_dir = args.model
    if model_dir is None:
        model_dir = DEFAULT_MODEL_DIR
        if not (model_dir / "config.json").is_file():
            _write_preset("tiny", model_dir, seed=0, layers=None)
    elif not model_dir.is_dir():
        raise RequestError(f"--model {model_dir}: directory does not exist")
    backend = args.backend
    if backend == "auto":
        backend = "engine" if has_cuda_device() and args.method == "ar" else "reference"
    elif backend == "engine" and not has_cuda_device():
        raise RequestError("--backend engine needs a CUDA device, and none is present")
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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    try:
        return COMMANDS[args.command](args, console)
    except (DDTreeError, OSError) as e:
        print(f"ddtree-run: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
