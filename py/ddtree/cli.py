"""ddtree-run: make models, generate tokens, describe the machine.

Every failure on bad input prints one line naming what is at fault and exits non-zero.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ddtree.errors import DDTreeError, RequestError
from ddtree.results import GenerationResult

PRESETS = ("tiny", "small", "k2-layers")
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "ddtree" / "tiny-seed0"


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree-run", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

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

    sub.add_parser("info", help="describe the CUDA devices and the native build")
    return parser


def _make_model(args: argparse.Namespace, console: Console) -> int:
    from ddtree.presets import make_model

    if args.layers is not None and args.preset != "k2-layers":
        raise RequestError(f"--layers applies to the k2-layers preset only, not {args.preset!r}")
    start = time.perf_counter()
    with console.status(f"writing {args.preset} checkpoint to {args.out}"):
        cfg = make_model(args.preset, args.out, seed=args.seed, layers=args.layers)
    console.print(f"wrote {args.preset} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                  f"{cfg.n_routed_experts} experts, vocab {cfg.vocab_size}) to {args.out} "
                  f"in {time.perf_counter() - start:.1f} s")
    return 0


def _reference_generate(model_dir: Path, prompts: list[list[int]], n: int, temperature: float, seed: int,
                        on_token: Callable[[], None]) -> list[GenerationResult]:
    """Greedy decoding with the numpy reference, one stream at a time (the backend without a GPU)."""
    import numpy as np

    from ddtree.reference import ReferenceModel

    if temperature != 0.0:
        raise RequestError("--temperature other than 0 needs --backend engine; the reference backend is greedy")
    model = ReferenceModel.load(model_dir)
    results = []
    for prompt in prompts:
        cache = model.new_cache()
        start = time.perf_counter()
        logits = model.forward(np.asarray(prompt), np.arange(len(prompt)), cache).logits
        tokens = [int(np.argmax(logits[-1]))]
        on_token()
        prefilled = time.perf_counter()
        while len(tokens) < n:
            logits = model.forward(np.asarray(tokens[-1:]), np.asarray([cache.length]), cache).logits
            tokens.append(int(np.argmax(logits[-1])))
            on_token()
        results.append(GenerationResult(tokens, prefilled - start, time.perf_counter() - prefilled))
    return results


def _engine_generate(model_dir: Path, prompts: list[list[int]], n: int, temperature: float, seed: int,
                     on_token: Callable[[], None]) -> list[GenerationResult]:
    from ddtree.engine import Engine

    max_context = max(len(p) for p in prompts) + n
    engine = Engine(model_dir, streams=len(prompts), max_context=max_context)
    results = engine.generate(prompts, n, temperature=temperature, seed=seed)
    for _ in range(n * len(prompts)):
        on_token()
    return results


def _generate(args: argparse.Namespace, console: Console) -> int:
    from ddtree.device import has_cuda_device

    model_dir = args.model
    if model_dir is None:
        model_dir = DEFAULT_MODEL_DIR
        if not (model_dir / "config.json").is_file():
            from ddtree.presets import make_model

            make_model("tiny", model_dir, seed=0)
    elif not model_dir.is_dir():
        raise RequestError(f"--model {model_dir}: directory does not exist")
    backend = args.backend
    if backend == "auto":
        backend = "engine" if has_cuda_device() else "reference"
    elif backend == "engine" and not has_cuda_device():
        raise RequestError("--backend engine needs a CUDA device, and none is present")
    run = _engine_generate if backend == "engine" else _reference_generate

    prompts = args.prompt_ids
    total = args.max_new_tokens * len(prompts)
    progress = Progress(TextColumn(f"[bold]{backend}[/bold] generating"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True)
    with progress:
        task = progress.add_task("tokens", total=total)
        results = run(model_dir, prompts, args.max_new_tokens, args.temperature, args.seed,
                      lambda: progress.advance(task))
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        console.print(f"[{i}] prompt {prompt} -> {result.tokens}")
        console.print(f"    {len(result.tokens)} tokens, prefill {result.prefill_seconds * 1e3:.1f} ms, "
                      f"decode {result.tokens_per_second:.1f} tokens/s ({backend})")
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
