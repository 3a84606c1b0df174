"""A stand-in for the GPU engine with the surface `ddtree-run bench` and `profile` use (generate, the native
generate_ddtree, graphs, replay), so their flow, tables and reports run on a machine without a GPU. Its tokens
and times are made up: greedy DDTree gives AR's tokens, every round accepts 3 tokens."""

from __future__ import annotations

from types import SimpleNamespace

from ddtree.engine import CapturedGraph
from ddtree.results import GenerationResult


class FakeEngine:
    def __init__(self, streams: int, max_context: int, budget: int | None) -> None:
        self.streams, self.max_context, self.budget = streams, max_context, budget
        self.captured: list[str] = []
        self.replayed: list[tuple[str, int, bool]] = []
        self.native = SimpleNamespace(generate_ddtree=self._generate_ddtree)

    def _tokens(self, prompts, n):
        return [[(sum(p) + i) % 97 for i in range(n)] for p in prompts]

    def _capture(self, name: str) -> None:
        if name not in self.captured:
            self.captured.append(name)

    def generate(self, prompts, max_new_tokens, method="ar", stop_token_ids=None, budget=None, profile=False,
                 **_):
        tokens = self._tokens(prompts, max_new_tokens)
        if method == "ar":
            self._capture(f"ar streams={len(prompts)} span=128")
            return [GenerationResult(t, 1e-3, 1e-4 * max_new_tokens) for t in tokens]
        out = self._generate_ddtree(prompts, max_new_tokens, 0.0, 0, budget or 7, profile=profile)
        stages = dict(out["stages"])
        return [GenerationResult(t, 1e-3, out["decode_seconds"], a, stage_seconds=stages)
                for t, a in zip(out["tokens"], out["accept_lengths"])]

    def _generate_ddtree(self, prompts, n, temperature, seed, budget, stop_ids=(), profile=False, reference=None,
                         hit=None, oracle_seed=0):
        rounds = -(-(n - 1) // 3)
        if not profile:
            self._capture(f"round streams={len(prompts)} budget={budget} depth=7 width={budget} span=128 "
                          f"draft_span=100" + (" oracle" if reference is not None else ""))
        return {"tokens": self._tokens(prompts, n), "accept_lengths": [[3] * rounds for _ in prompts],
                "rounds": rounds, "prefill_seconds": 1e-3, "decode_seconds": 2e-4 * rounds,
                "host_seconds_per_round": 1e-5,
                "stages": [("verify", 1e-4 * rounds), ("draft", 5e-5 * rounds)] if profile else []}

    def graphs(self) -> list[CapturedGraph]:
        return [CapturedGraph(name, 10) for name in self.captured]

    def replay(self, name: str, n: int = 20, warmup: bool = True) -> float:
        self.replayed.append((name, n, warmup))
        return 1e-4
