"""The z-lab/Kimi-K2.5-DFlash drafter as a test fixture: its config.json (tests/data, the published fields) with
seeded random weights, at the real shapes (about 6.5 GiB of bf16; for GPU tests) or at tiny shapes.

The tiny replica keeps every field that gives the drafter its semantics (Qwen3 GQA with 8 query heads per KV
head, YaRN factor 64 over 4096 original positions with mscale = mscale_all_dim = 1, theta 50000, block 8, the
mask id two below the vocabulary's end, explicit taps in dflash_config) and takes its sizes from the `tiny`
target preset, so the reference DDTree loop can run it against that target on a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddtree.drafter import DrafterConfig, parse_drafter_config, random_drafter_tensors, write_drafter
from ddtree.presets import preset_config

KIMI_DFLASH_CONFIG = Path(__file__).parent / "data" / "kimi_k2_5_dflash_config.json"
SCALES = ("real", "tiny")


def kimi_dflash_config_json(scale: str) -> dict[str, Any]:
    """The replica's config.json: the published one for "real", its tiny-shaped twin for "tiny"."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    raw = json.loads(KIMI_DFLASH_CONFIG.read_text())
    if scale == "real":
        return raw
    target = preset_config("tiny")
    layers = 2
    raw.update(
        hidden_size=target.hidden_size, intermediate_size=160, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=1, head_dim=16, vocab_size=target.vocab_size, num_target_layers=target.num_hidden_layers,
        layer_types=["full_attention"] * layers, max_window_layers=layers,
        bos_token_id=target.bos_token_id, eos_token_id=target.eos_token_ids[0],
        # A 3-layer target can tap layers 0 and 1 only (its last layer's HF output is the final-normed one).
        dflash_config={"mask_token_id": target.vocab_size - 2, "target_layer_ids": [0, 1]},
    )
    return raw


def write_kimi_dflash_replica(out_dir: str | Path, seed: int, scale: str = "tiny") -> DrafterConfig:
    """Write the replica drafter (config.json as kimi_dflash_config_json gives it, seeded random bf16 tensors,
    one shard per layer) to `out_dir` and return its parsed config."""
    raw = kimi_dflash_config_json(scale)
    cfg = parse_drafter_config(raw, where=str(KIMI_DFLASH_CONFIG))
    write_drafter(out_dir, cfg, random_drafter_tensors(cfg, seed), config_json=raw)
    return cfg
