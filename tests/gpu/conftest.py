"""tests/gpu needs the native module, a CUDA device and torch with CUDA; without them every test here is skipped with
the reason."""

from __future__ import annotations

import faulthandler
import gc
import inspect
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from ddtree.device import device_info, native_unavailable
from engine_models import make_model_dirs


def _skip_reason() -> str | None:
    missing = native_unavailable()
    if missing is not None:
        return missing
    info = device_info()
    if not info.devices:
        return f"needs a CUDA device: {info}"
    try:
        import torch
    except ImportError:
        return "needs torch as the external reference"
    if not torch.cuda.is_available():
        return "needs a CUDA build of torch as the external reference"
    return None


_REASON = _skip_reason()


# Sanitizer mode: tools/gpu_suite.sh sets DDTREE_SANITIZE=1 for its compute-sanitizer runs only (kernels run 10-100x
# slower, and those streaming gigabytes of weights slower still). It trims repetition, not coverage: every
# kernel template instantiation and code path of the plain run still runs. What it trims, and why that keeps
# coverage:
# - test_tree_kernels fuzz: 2,000 build inputs instead of 100,000 (seed 23 still launches every frontier-size
#   instantiation tree_build_kernel<1, 2, 4, 8, 16, 32>: 1072, 54, 486, 23, 185 and 180 streams), and 2,000
#   malformed accept inputs in launches of 100 streams instead of 1,000 (20 launches, 4 of them with budgets past
#   64; the *_memcheck tests and test_build_edge_shapes keep their fixed budgets 0 .. 1024). The reference checks
#   run in this process (no forked workers under the sanitizer).
# - test_round_equals_autoregressive: 8 new tokens instead of 64 (every budget 1, 2, 8, 32, 64, 255 and the
#   drafter's own candidates still run, the same graph buckets and GEMM row counts, on one or two rounds each), and
#   one temperature per (model, streams) instead of both: temperature index (model index + streams index) % 2, so
#   every model preset (tiny, small, tiny-fused, k2-layers) and every stream count (1, 3, 16) runs greedy and
#   sampled (the other 12 (model, streams, temperature) cases' 84 tests are deselected at collection,
#   sanitize_keep). Stream i's prompt is 5 + 3 i tokens instead of 5 + 29 i, but for the last stream's (16
#   streams: 5, 8, .., 47 and 440 instead of 5, 34, .., 440; the same shortest and longest: rows of one and of
#   several attention chunks, prefills of several forwards, a ragged batch still). k2-layers has 2 layers (the
#   dense one and one MoE layer: the target's kernel instantiations; its drafter then taps one layer instead of
#   two) instead of 3. Its acceptance statistics are left to the plain run: a round or two per budget are too few
#   to hold a mean.
# - test_streams_stop_at_different_rounds: 10 new tokens, the stop ids taken at tokens 2 and 7 instead of 9 and 30,
#   and only the oracle's pass (commits of several tokens reach the stops at different rounds); the drafter's pass
#   and the Python API's run the same kernels.
# - test_a_dropped_engine_is_freed_at_once: its checkpoint (tiny) case only, without the device-memory check (the
#   shards share the device, so its free memory moves under them).
# - test_budget_gpu.py: the exactness checks at 12 new tokens, one temperature per oracle profile (none, 0.9, 0.3
#   alternate greedy and sampled); the policy checks keep their 64 (their budgets need a run of rounds).
# - test_replayed_round_equals_eager_round: 6 new tokens (every stage runs in every round, captured, replayed and
#   eager).
# - test_nodes_equal_autoregressive_paths(_k2): the autoregressive forwards that check verify's nodes run one
#   leaf per distinct path length of the forward's trees, in the stream of the longest prefix that has it (the
#   same forward_logits row counts as every leaf's; every parametrization and the verify launch itself
#   unchanged); nodes on no such path go unchecked. Its 16 streams' prefixes are 1, 8, .., 99 and 556 tokens instead of
#   1, 38, .., 556 (the shortest and the longest, past a 512-key attention chunk, kept).
# - test_replay_time_is_that_of_a_step: the replay still runs, its time is not held to the step's (a sanitizer's
#   per-launch cost is not the same in a generation and in a replay loop: initcheck's made it 3x).
# Nothing else changes; the plain run (DDTREE_SANITIZE unset) is as before.
def sanitizing() -> bool:
    """True in the sanitizer mode (DDTREE_SANITIZE=1); the one place the variable is read."""
    return os.environ.get("DDTREE_SANITIZE", "") == "1"


def trimmed(plain, sanitized):
    """`plain` in a plain run, `sanitized` in the sanitizer mode."""
    return sanitized if sanitizing() else plain


def sanitize_keep(keep):
    """Decorator of a parametrized test: in the sanitizer mode, its cases for which keep(**params) is false are
    deselected at collection (so the shards are balanced over what runs)."""
    def mark(test):
        test.sanitize_keep = keep
        return test
    return mark


def _named(keep, params: dict) -> dict:
    """The parameters a sanitize_keep predicate names: adding a parametrization to its test leaves it as it is."""
    return {name: params[name] for name in inspect.signature(keep).parameters}


_STACKS_OUT = None  # the stack dumps' stream in the sanitizer mode (pytest_configure), open for the process's life


def pytest_configure(config: pytest.Config) -> None:
    if sanitizing():
        # tools/sanitize_run.py sends SIGUSR1 before it ends a test process (the deadline, a test's time or memory
        # limit): the stacks of every thread say where the test was. To a copy of the process's stderr, kept for its
        # life: pytest's capture of a running test would take the stacks away with the process.
        global _STACKS_OUT
        _STACKS_OUT = os.fdopen(os.dup(sys.stderr.fileno()), "w")
        faulthandler.register(signal.SIGUSR1, file=_STACKS_OUT, all_threads=True)


def pytest_report_header(config: pytest.Config) -> str | None:
    return "ddtree GPU tests: sanitizer mode (DDTREE_SANITIZE=1), repetition trimmed" if sanitizing() else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if sanitizing():
        kept, dropped = [], []
        for item in items:
            keep = getattr(getattr(item, "function", None), "sanitize_keep", None)
            params = item.callspec.params if hasattr(item, "callspec") else {}
            (kept if keep is None or keep(**_named(keep, params)) else dropped).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if _REASON is not None:
                item.add_marker(pytest.mark.skip(reason=_REASON))


def _record_test_time(nodeid: str, when: str, seconds: float, outcome: str) -> None:
    """With DDTREE_TEST_TIMES set (tools/gpu_suite.sh does, per sanitizer shard), a JSON line to that file at once:
    tools/sanitize_run.py reads it while the tests run (which test is running, since when), a shard cut short still
    leaves the times of what it ran, and tools/sanitize_shards.py balances the next shards by them."""
    path = os.environ.get("DDTREE_TEST_TIMES")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"nodeid": nodeid, "when": when, "seconds": seconds, "outcome": outcome,
                                  "tool": os.environ.get("DDTREE_SANITIZE_TOOL", ""), "at": time.time()}) + "\n")


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _record_test_time(nodeid, "start", 0.0, "started")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record_test_time(report.nodeid, report.when, report.duration, report.outcome)


@pytest.fixture(autouse=True)
def _release_engines():
    # engines (and their device memory) held by a finished or failed test are freed here, not at a random later
    # point in another test
    yield
    gc.collect()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints of the presets and variants the engine tests run on (engine_models), written once."""
    return make_model_dirs(tmp_path_factory)
