"""The model a `bench` or `profile` run loads, and the prompts it decodes from: the built-in demo pair, a checkpoint
directory with its DFlash drafter, or a preset's dimensions with seeded random weights (nothing on disk)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddtree.bench.oracle import random_prompts
from ddtree.config import ModelConfig, load_config
from ddtree.drafter import DrafterConfig, drafter_config_for, load_drafter_config
from ddtree.engine import Engine
from ddtree.errors import RequestError
from ddtree.presets import preset_config
from ddtree.tokenizer import find_tokenizer, load_tokenizer

# Text the demo pair was trained on the like of (Python source): this package's own modules, read in name order.
_TEXT_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What a run loads: `label` says which; `model_dir` (and `drafter_dir`) for a checkpoint, None for a preset's
    random weights; `drafter` None for a checkpoint without one (autoregressive only)."""

    label: str
    config: ModelConfig
    drafter: DrafterConfig | None
    model_dir: Path | None = None
    drafter_dir: Path | None = None

    @property
    def depth(self) -> int:
        """The deepest node of a round's tree: the drafter's block size - 1."""
        return self.drafter.block_size - 1 if self.drafter is not None else 0

    def engine(self, streams: int, max_context: int, budget: int | None) -> Engine:
        if self.model_dir is None:
            return Engine.random(self.config, streams, max_context, budget=budget, seed=0, drafter=self.drafter)
        return Engine(self.model_dir, self.drafter_dir, streams=streams, max_context=max_context, budget=budget)

    def prompts(self, streams: int, length: int, seed: int = 0) -> list[list[int]]:
        """`streams` prompts of `length` tokens: windows of Python source (this package's) through the checkpoint's
        tokenizer when it has one, so a trained drafter sees text like its training data; else seeded random
        ids."""
        if self.model_dir is None or find_tokenizer(self.model_dir) is None:
            return random_prompts(self.config.vocab_size, streams, length, seed)
        tokenizer, ids = load_tokenizer(self.model_dir), []
        for path in sorted(_TEXT_ROOT.rglob("*.py")):
            ids += tokenizer.encode(path.read_text(encoding="utf-8"))
            if len(ids) >= streams * length:
                break
        if len(ids) < streams * length:
            raise RequestError(f"{streams} prompts of {length} tokens need more text than the {len(ids)} tokens of "
                               f"ddtree's own sources that prompts are cut from")
        stride = len(ids) // streams
        return [ids[i * stride:i * stride + length] for i in range(streams)]


def model_source(model: Path | None, preset: str | None, layers: int | None, drafter: Path | None,
                 default_model: Path, drafter_subdir: str) -> ModelSource:
    """The source the --model / --preset / --layers / --drafter options name (RequestError naming the option at
    fault): a preset's random weights with a random drafter of its dims, else the checkpoint in `model` (default
    `default_model`) with the drafter in --drafter or MODEL/drafter_subdir (none when that is missing and no
    --drafter was given)."""
    if preset is not None:
        if model is not None or drafter is not None:
            raise RequestError("--preset runs random weights of the preset's dims: it takes no --model or --drafter")
        if layers is not None and preset != "k2-layers":
            raise RequestError(f"--layers applies to the k2-layers preset only, not {preset!r}")
        if preset == "k2-layers" and layers is None:
            raise RequestError("--preset k2-layers needs --layers N (K2 has 61; each MoE layer holds about 10 GB)")
        cfg = preset_config(preset, layers)
        label = f"{preset}{f' ({layers} layers)' if layers else ''}, random weights"
        return ModelSource(label, cfg, drafter_config_for(cfg, preset) if cfg.num_hidden_layers >= 2 else None)
    if layers is not None:
        raise RequestError("--layers applies to --preset k2-layers only")
    model_dir = default_model if model is None else model
    if not model_dir.is_dir():
        fault = "is not a directory" if model_dir.exists() else "directory does not exist"
        raise RequestError(f"--model {model_dir}: {fault}")
    cfg = load_config(model_dir)
    drafter_dir = drafter if drafter is not None else model_dir / drafter_subdir
    if drafter is not None and not drafter.is_dir():
        raise RequestError(f"--drafter {drafter}: directory does not exist")
    dcfg = load_drafter_config(drafter_dir, cfg) if drafter_dir.is_dir() else None
    label = "the built-in demo pair" if model is None else str(model_dir)
    return ModelSource(label, cfg, dcfg, model_dir, drafter_dir if dcfg is not None else None)


def check_lengths(source: ModelSource, contexts: Sequence[int], new_tokens: int, names: tuple[str, str]) -> None:
    """Every context + new tokens (+ the drafter's last block) within both models' max_position_embeddings;
    RequestError naming the options (`names`: the context's and the token count's) otherwise."""
    reach = source.drafter.block_size - 2 if source.drafter is not None else 0
    limits = [(source.config.max_position_embeddings, "the model's")]
    if source.drafter is not None:
        limits.append((source.drafter.max_position_embeddings, "the drafter's"))
    for context in contexts:
        for limit, whose in limits:
            if context + new_tokens + reach > limit:
                raise RequestError(f"{names[0]} {context} + {names[1]} {new_tokens}"
                                   f"{f' + {reach} (the last draft block)' if reach else ''} positions exceed "
                                   f"{whose} max_position_embeddings {limit}")
