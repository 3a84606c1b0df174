#!/usr/bin/env bash
# Build ddtree on a GPU machine, run tests/gpu and the named benchmarks, and pack every report.
#
#   tools/gpu_suite.sh [-k PYTEST_EXPR] [BENCH ...]      BENCH names tools/bench_BENCH.py (default: none)
#
# Reports go to $REPORT_DIR (default: $OUT/reports, or bench/results/latest) and, when $OUT is set, are also
# packed into $OUT/reports.tar.gz: the device tool returns at most 8 files. Wheels that the machine lacks
# (meson-python, pyproject-metadata) are taken from .wheels/ when that folder exists. The build directory is kept
# under build/ so a second call on a warm machine recompiles only what changed. Each step is killed after
# $STEP_TIMEOUT seconds (default 540), so a hung kernel costs one step, not the whole device session.
#
# SANITIZE="memcheck racecheck initcheck synccheck" (any of them) runs the tests under each compute-sanitizer tool in
# turn, in place of the plain run (PLAIN=1 runs that first too). They slow every kernel by 10-100x, so each tool runs
# $SANITIZE_JOBS (default 8) compute-sanitizer processes at once, each over one shard of the collected node ids
# (tools/sanitize_shards.py: balanced by the per-test seconds of earlier sanitizer shards, the .jsonl files committed
# in bench/results/gpu_tests, then by the junit xml files there; or by $SANITIZE_TIMES), with DDTREE_SANITIZE=1
# (tests/gpu/conftest.py: repetition trimmed, coverage kept) and torch's caching allocator off, so that memcheck
# sees every allocation's bounds. Each shard runs under tools/sanitize_run.py and logs sanitize_TOOL_I.log (its node
# ids in sanitize_TOOL_I.txt, its per-test seconds in sanitize_TOOL_I.times.jsonl, written test by test): a test that
# runs past $SANITIZE_TEST_LIMIT seconds from its start (default: no limit), or while which the shard's processes
# (compute-sanitizer and pytest) hold more than $SANITIZE_MEMORY_MB together (default: the shard's share of 90% of the
# host's memory), is cut, its Python stacks printed into the log, and a new process runs the shard's tests that have
# not run; the step's deadline cuts the test then running and ends the shard. Then one line per tool sums the
# sanitizer's errors and the tests over the shards, and a shard's error, failed or cut test or timeout fails the
# suite, as does a test process (plain or sanitized) that exits with native objects alive (nanobind's leak report: an
# engine kept past its test). sanitize_TOOL_memory.txt holds the host's and the GPU's used memory every 15 s of the
# step.
# SANITIZE_K gives the sanitizer steps a -k expression of their own (PLAIN=1 SANITIZE_K=...: the whole plain run, then
# a part of the suite sanitized, in one command).
# SUITE_DEADLINE (seconds after the start) cuts every sanitizer step's timeout so that the step ends by then, leaving
# time to pack the reports before the device command's own limit. SANITIZE_ARGS adds compute-sanitizer options to
# every tool's run (e.g. "--kernel-name kns=ddtree": check only the engine's kernels, not torch's).
set -uo pipefail
cd "$(dirname "$0")/.."

pytest_expr=()
if [[ ${1:-} == -k ]]; then
    pytest_expr=(-k "$2")
    shift 2
fi
sanitize_expr=(${pytest_expr[@]+"${pytest_expr[@]}"})
[[ -n ${SANITIZE_K:-} ]] && sanitize_expr=(-k "$SANITIZE_K")
report_dir=${REPORT_DIR:-${OUT:+$OUT/reports}}
report_dir=${report_dir:-bench/results/latest}
step_timeout=${STEP_TIMEOUT:-540}
sanitize_jobs=${SANITIZE_JOBS:-8}
if [[ -n ${SANITIZE:-} ]]; then run_plain=${PLAIN:-0}; else run_plain=${PLAIN:-1}; fi
mkdir -p "$report_dir"
report_dir=$(cd "$report_dir" && pwd)  # the tests run from /tmp
export PYTHONUNBUFFERED=1

if compgen -G ".wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ddtree-build-site .wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/ddtree-build-site${PYTHONPATH:+:$PYTHONPATH}
fi

# The copy onto the device may keep a file's old time, which ninja would take as unchanged: touch every source
# whose content differs from the last build's.
# Without a stamp from a successful build, the kept objects cannot be trusted: start the build over.
sources_stamp=build/gpu-suite.sources.md5
if [[ -f $sources_stamp ]]; then
    md5sum -c --quiet "$sources_stamp" 2>/dev/null | sed -n 's/: FAILED.*$//p' | xargs -r touch -c
else
    rm -rf build/gpu-suite
fi

# One sanitizer step per tool: the node ids (collected in the sanitizer mode, -k applied) in balanced shards, all at
# once, each under tools/sanitize_run.py (a compute-sanitizer process, one more after each test cut); then the tool's
# summary line (tools/sanitize_shards.py summary).
sanitize_suite() {
    local repo=$PWD shard_dir tool limit memory_mb i monitor ok=0
    local -a shards pids times logs
    local -x DDTREE_SANITIZE=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1
    # the shards share the CPU cores: no numpy or torch thread pools sized for the whole machine in each
    local threads=$(( $(nproc) / sanitize_jobs )); (( threads >= 1 )) || threads=1
    local -x OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
    if ! (cd /tmp && timeout "$step_timeout" python3 -m pytest --collect-only -q -p no:cacheprovider "$repo/tests/gpu" \
            ${sanitize_expr[@]+"${sanitize_expr[@]}"}) >"$report_dir/sanitize_collect.log" 2>&1; then
        echo "sanitize: collection failed; see sanitize_collect.log"; tail -20 "$report_dir/sanitize_collect.log"
        return 1
    fi
    if [[ -n ${SANITIZE_TIMES:-} ]]; then
        read -ra times <<<"$SANITIZE_TIMES"
    else
        mapfile -t times < <(compgen -G "bench/results/gpu_tests/*.xml"; compgen -G "bench/results/gpu_tests/*.jsonl")
    fi
    for tool in $SANITIZE; do
        case $tool in
            memcheck | racecheck | initcheck | synccheck) ;;  # their options: tools/sanitizer_process.py
            *) echo "SANITIZE: unknown tool $tool (memcheck, racecheck, initcheck, synccheck)"; ok=1; continue ;;
        esac
        # shards per tool: each tool slows the tests by its own factors (sanitize_shards.py --tool)
        shard_dir=$(mktemp -d)
        mapfile -t shards < <(python3 tools/sanitize_shards.py split --shards "$sanitize_jobs" --out-dir "$shard_dir" \
            --tool "$tool" --nodeids "$report_dir/sanitize_collect.log" --times ${times[@]+"${times[@]}"} \
            2>"$report_dir/sanitize_shards_$tool.log")
        if (( ${#shards[@]} == 0 )); then
            echo "$tool: no shards; see sanitize_shards_$tool.log and sanitize_collect.log"
            cat "$report_dir/sanitize_shards_$tool.log"; ok=1; continue
        fi
        limit=$step_timeout
        if [[ -n ${SUITE_DEADLINE:-} ]]; then
            (( SUITE_DEADLINE - ($(date +%s) - start) < limit )) && limit=$(( SUITE_DEADLINE - ($(date +%s) - start) ))
            if (( limit < 60 )); then  # the runner's deadline is 30 s before, and a process needs 20 s
                echo "$tool: not run, ${limit} s left before SUITE_DEADLINE"; ok=1; continue
            fi
        fi
        # each shard's processes may hold their share of the host's memory (tools/sanitize_run.py ends a test
        # past it): a test whose sanitizer state grows without bound is cut, its neighbours go on
        memory_mb=${SANITIZE_MEMORY_MB:-$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) * 9 / 10 / 1024 / ${#shards[@]} ))}
        echo "$tool: ${#shards[@]} shards, ${limit} s each at most, ${memory_mb} MB each${SANITIZE_TEST_LIMIT:+, ${SANITIZE_TEST_LIMIT} s a test}"
        rm -f "$report_dir"/sanitize_"$tool"_*
        pids=() logs=()
        # host and device memory every 15 s while the shards run (a shard killed for memory can show in it); it
        # stops with the step, or with this script if that is killed first
        while sleep 15 && kill -0 $$ 2>/dev/null; do
            echo "$(date +%T) host_used_mb=$(free -m | awk '/^Mem:/ {print $3}')" \
                "gpu_used_mb=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | paste -sd+)"
        done >"$report_dir/sanitize_${tool}_memory.txt" 2>&1 &
        monitor=$!
        for i in "${!shards[@]}"; do
            logs+=("$report_dir/sanitize_${tool}_$i.log")
            cp "${shards[i]}" "$report_dir/sanitize_${tool}_$i.txt"
            (
                cd /tmp || exit 1
                export DDTREE_TEST_TIMES="$report_dir/sanitize_${tool}_$i.times.jsonl" DDTREE_SANITIZE_TOOL=$tool
                rm -f "$DDTREE_TEST_TIMES"
                # the runner keeps its deadline (30 s early: ending a process and its session takes up to about
                # 15 s), and timeout(1) the step's limit, against the runner hanging: its SIGTERM ends the runner's
                # sanitizer session too
                timeout -k 10 "$limit" python3 "$repo/tools/sanitize_run.py" --tool "$tool" \
                    --nodeids "$report_dir/sanitize_${tool}_$i.txt" --root "$repo" --times "$DDTREE_TEST_TIMES" \
                    --until $(( $(date +%s) + limit - 30 )) --test-limit "${SANITIZE_TEST_LIMIT:-0}" \
                    --memory-limit-mb "$memory_mb" --sanitizer-args="${SANITIZE_ARGS:-}" -- \
                    python3 -m pytest -q -p no:cacheprovider
            ) >"${logs[i]}" 2>&1 &
            pids+=($!)
        done
        for i in "${!pids[@]}"; do wait "${pids[i]}"; done
        kill "$monitor" 2>/dev/null; wait "$monitor" 2>/dev/null
        rm -rf "$shard_dir"
        python3 tools/sanitize_shards.py summary --tool "$tool" "${logs[@]}" | tee -a "$report_dir/sanitize_summary.txt"
        (( PIPESTATUS[0] == 0 )) || ok=1
    done
    return $ok
}

status=0
start=$(date +%s)
rm -f "$sources_stamp"
if ! python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/gpu-suite . \
        >"$report_dir/build.log" 2>&1; then
    echo "build failed; see build.log"; tail -40 "$report_dir/build.log"; status=1
fi
echo "build: $(( $(date +%s) - start )) s"
if (( status == 0 )); then
    find kernels runtime py meson.build meson.options pyproject.toml -type f -exec md5sum {} + >"$sources_stamp"
fi
nvidia-smi >"$report_dir/nvidia-smi.txt" 2>&1
# Run from outside the source tree so the installed package (with its native module) is imported.
if (( status == 0 )); then
    if (( run_plain )); then
        (cd /tmp && timeout "$step_timeout" python3 -m pytest -q -p no:cacheprovider "$OLDPWD/tests/gpu" \
            ${pytest_expr[@]+"${pytest_expr[@]}"} --junitxml="$report_dir/gpu_tests.xml" 2>&1) | tee "$report_dir/gpu_tests.log"
        (( PIPESTATUS[0] == 0 )) || status=1
        # nanobind names the native objects still alive at the interpreter's exit: an engine kept past its test
        if grep -q "nanobind: leaked" "$report_dir/gpu_tests.log"; then
            echo "gpu tests: native objects alive at exit (nanobind's report in gpu_tests.log)"; status=1
        fi
    fi
    if [[ -n ${SANITIZE:-} ]]; then
        sanitize_suite || status=1
    fi
    for bench in "$@"; do
        echo "== bench $bench"
        (cd /tmp && timeout "$step_timeout" python3 "$OLDPWD/tools/bench_$bench.py" --out "$report_dir/$bench" 2>&1) \
            | tee "$report_dir/bench_$bench.log"
        (( PIPESTATUS[0] == 0 )) || status=1
    done
fi
if [[ -n ${OUT:-} ]]; then
    tar -czf "$OUT/reports.tar.gz" -C "$report_dir" .
fi
echo "gpu suite finished with status $status in $(( $(date +%s) - start )) s"
exit $status
