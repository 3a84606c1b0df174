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
# SANITIZE="memcheck racecheck initcheck synccheck" (any of them) runs the tests once under each compute-sanitizer
# tool, after the plain run, logging sanitize_TOOL.log; a tool's error fails the suite. They slow every kernel by
# 10-100x, so a subset (-k) is what fits one device command; torch's caching allocator is then off, so that
# memcheck sees every allocation's bounds.
set -uo pipefail
cd "$(dirname "$0")/.."

pytest_expr=()
if [[ ${1:-} == -k ]]; then
    pytest_expr=(-k "$2")
    shift 2
fi
report_dir=${REPORT_DIR:-${OUT:+$OUT/reports}}
report_dir=${report_dir:-bench/results/latest}
step_timeout=${STEP_TIMEOUT:-540}
mkdir -p "$report_dir"
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
    (cd /tmp && timeout "$step_timeout" python3 -m pytest -q -p no:cacheprovider "$OLDPWD/tests/gpu" ${pytest_expr[@]+"${pytest_expr[@]}"} \
        --junitxml="$report_dir/gpu_tests.xml" 2>&1) | tee "$report_dir/gpu_tests.log"
    (( PIPESTATUS[0] == 0 )) || status=1
    for tool in ${SANITIZE:-}; do
        case $tool in
            memcheck) extra=(--leak-check no) ;;
            racecheck) extra=(--racecheck-report all) ;;
            initcheck | synccheck) extra=() ;;
            *) echo "SANITIZE: unknown tool $tool (memcheck, racecheck, initcheck, synccheck)"; status=1; continue ;;
        esac
        log=$report_dir/sanitize_$tool.log
        (cd /tmp && PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$step_timeout" compute-sanitizer --tool "$tool" \
            "${extra[@]}" --error-exitcode 86 python3 -m pytest -q -p no:cacheprovider "$OLDPWD/tests/gpu" \
            ${pytest_expr[@]+"${pytest_expr[@]}"}) >"$log" 2>&1
        rc=$?
        summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1)
        echo "$tool: exit $rc; ${summary:-no summary (timed out or crashed)}; $(grep -E "passed|failed" "$log" | tail -1)"
        (( rc == 0 )) || status=1
    done
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
