"""tools/sanitizer_cost.py, which finds what checking each kernel family costs a compute-sanitizer tool by leaving
one family out at a time: the families cover every kernel, each exclusion matches its family's mangled names only,
and a variant's seconds, memory, exit and summary come back (a variant past its limit is ended)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
_spec = importlib.util.spec_from_file_location("sanitizer_cost", ROOT / "tools" / "sanitizer_cost.py")
cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cost)


def test_the_families_hold_every_kernel_once() -> None:
    families = cost.kernel_families()
    names = [n for ns in families.values() for n in ns]
    declared = sum(p.read_text().count("__global__") for p in (ROOT / "kernels").glob("*.cu"))
    assert len(names) == len(set(names)) == declared
    assert "topk_kernel" in families["topk"] and "sample_kernel" in families["sample"]


def test_an_exclusion_matches_its_family_and_no_other() -> None:
    families = cost.kernel_families()
    # as nvcc mangles a kernel in an anonymous namespace inside ddtree, and a template instance
    names_of = [n for ns in families.values() for n in ns]
    mangled = {n: f"_ZN6ddtree12_GLOBAL__N_1{len(n)}{n}ILi64ELi2EEEvPKfPii" for n in names_of}
    demangled = {n: f"void ddtree::(anonymous namespace)::{n}<64, 2>(const float*, int*, int)" for n in names_of}
    for stem, names in families.items():
        pattern = re.compile(cost.name_filter(names).removeprefix("regex="))
        for spelled in (mangled, demangled):
            assert {n for n, m in spelled.items() if pattern.fullmatch(m)} == set(names), stem


def test_every_wave_has_its_own_all() -> None:
    families = cost.kernel_families()
    waves = cost.waves(families, 12)
    assert all(len(w) <= 12 and w[0] == ("all", []) for w in waves)
    names = [v[0] for w in waves for v in w[1:]]
    assert names == ["none"] + [f"without {stem}" for stem in families]


def test_a_variant_reports_its_seconds_and_summary_and_is_ended_past_its_limit(tmp_path: Path) -> None:
    done = cost.run_variant("all", 1, [sys.executable, "-c", "print('stage create: 0.5 s, 812 MB'); "
                                       "print('workload seconds: 1.500'); print("
                                       "'========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)')"],
                            tmp_path / "a.log", 30.0, 0)
    assert (done["workload_s"], done["exit"], done["ended"]) == (1.5, 0, None)
    assert done["summary"].startswith("RACECHECK SUMMARY: 0 hazards")
    assert done["stages"] == [("create", 0.5, 812)]
    slow = cost.run_variant("without gemm", 1, [sys.executable, "-c", "import time; time.sleep(60)"],
                            tmp_path / "b.log", 1.0, 0)
    assert slow["ended"] == "limit 1 s" and slow["workload_s"] is None and slow["wall_s"] < 30
    assert slow["exit"] == 143  # SIGTERM's: a process without a handler for the stacks' SIGUSR1 does not get it
    rows = [done, {**done, "variant": "none", "workload_s": 1.0}, slow,
            {**done, "variant": "without mla_attn", "workload_s": 0.7},
            {**done, "wave": 2}, {**done, "variant": "without rope", "wave": 2, "workload_s": 1.2}]
    lines = [line for line in cost.report("racecheck", "decode", "tiny", 0.5, rows).splitlines()
             if line.startswith("| without")]
    # each against its own wave's `all`: 1.5 - 0.7 and 1.5 - 1.2
    assert lines[0].startswith("| without mla_attn | 1 | 0.7 | 0.8 |")
    assert lines[1].startswith("| without rope | 2 | 1.2 | 0.3 |")
    assert lines[2].startswith("| without gemm | 1 | - |  |")
    assert lines[0].endswith("| create 0 (812) |")


def test_the_only_mode_checks_each_family_with_the_cluster_kernels() -> None:
    families = cost.kernel_families()
    clusters = cost.cluster_kernels()
    assert clusters == ["sample_kernel", "topk_kernel"]
    [wave, *rest] = cost.waves(families, 64, "only", clusters)
    assert not rest and wave[0] == ("all", [])
    assert wave[1] == ("only sample_kernel+topk_kernel", ["--kernel-name", cost.name_filter(clusters)])
    gemm = dict(wave)["only gemm"]
    pattern = re.compile(gemm[1].removeprefix("regex="))
    assert gemm[0] == "--kernel-name"
    assert pattern.fullmatch("_ZN6ddtree12_GLOBAL__N_111gemm_kernelILi1ELi1ELi2EEEvNS0_10GemmParamsE")
    assert pattern.fullmatch("_ZN6ddtree7kernels12_GLOBAL__N_111topk_kernelEPfPiPKflii")
    assert not pattern.fullmatch("_ZN6ddtree12_GLOBAL__N_115moe_gemm_kernelEv")
    # topk is all in the baseline; sample's other kernel (advance_kernel) makes a variant
    assert "only topk" not in dict(wave) and "only sample" in dict(wave)
    # no kernel that must stay checked: the baseline checks nothing (an empty name list would match every kernel)
    [bare, *_] = cost.waves({"gemm": ["gemm_kernel"]}, 4, "only", [])
    assert bare[1] == ("only none", ["--kernel-name", "kns=no_kernel_has_this_name"])
