"""A per-round cost model of DDTree and AR decoding, fitted to the committed H200 measurements (bench/results) and
projected to other GPUs, to the full 61-layer K2 on a G-GPU expert-parallel layout, and to acceptance profiles.

Modules: `shapes` (bytes and FLOPs of every part at K2 dimensions, per GPU of a layout), `gpus` (presets),
`measurements` (the shipped H200 points), `components` (one fitted curve per part), `round_cost` (a round and an
AR step composed from them), `validation` (held-out accuracy), `projection` (tokens/s with uncertainty).
"""

from ddtree.estimate.gpus import GPUS, GpuSpec
from ddtree.estimate.projection import Projection, project
from ddtree.estimate.round_cost import Layout

__all__ = ["GPUS", "GpuSpec", "Layout", "Projection", "project"]
