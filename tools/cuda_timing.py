"""Timing helpers of the GPU benchmarks: CUDA-event samples, the device time of a call replayed in a CUDA graph,
and the copy bandwidth every byte floor is measured against, so that the engine, MoE and tree reports use one
definition of each."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from ddtree._native import kernels

COPY_BYTES = 4 << 30


def event_seconds(fn: Callable[[], object], repeats: int, warmup: int = 0) -> list[float]:
    """Device seconds of `fn` per call: `warmup` untimed calls, then one CUDA-event pair around each of `repeats`
    calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3)
    return samples


def copy_bandwidth(repeats: int = 20) -> float:
    """Bytes per second (read + write) of a 4 GiB device-to-device copy, median of `repeats` after 3 warm-ups."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / statistics.median(event_seconds(lambda: dst.copy_(src), repeats, warmup=3))


def median_ms(fn, reps: int = 20, replays: int = 15) -> float:
    """Device time of one call: `reps` calls captured back to back in a CUDA graph (so host launch cost never
    shows), median over graph replays, divided by reps."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        kernels.use_stream(stream.cuda_stream)
        try:
            fn()
            fn()
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(reps):
                    fn()
        finally:
            kernels.use_stream(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    return statistics.median(event_seconds(graph.replay, replays)) * 1e3 / reps
