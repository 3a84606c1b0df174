#!/usr/bin/env bash
# Run tests/gpu under compute-sanitizer, one tool after another, on a machine where tools/gpu_suite.sh has built and
# installed the package (run it first in the same session).
#
#   tools/sanitize_gpu.sh [-k PYTEST_EXPR] [TOOL ...]      TOOL: memcheck racecheck initcheck synccheck (default all)
#
# Each tool's log goes to $REPORT_DIR/sanitize_TOOL.log (default: $OUT/reports, or bench/results/latest), packed into
# $OUT/sanitize.tar.gz when $OUT is set. A tool's step is killed after $STEP_TIMEOUT seconds (default 540): the
# sanitizers slow every kernel by 10-100x, so a subset (-k) is what fits one device command. torch's caching
# allocator is turned off so that memcheck sees every allocation's bounds. Exits non-zero when a tool reports an
# error, a test fails or a step times out.
set -uo pipefail
cd "$(dirname "$0")/.."

pytest_expr=()
if [[ ${1:-} == -k ]]; then
    pytest_expr=(-k "$2")
    shift 2
fi
tools=("$@")
(( ${#tools[@]} )) || tools=(memcheck racecheck initcheck synccheck)
report_dir=${REPORT_DIR:-${OUT:+$OUT/reports}}
report_dir=${report_dir:-bench/results/latest}
step_timeout=${STEP_TIMEOUT:-540}
mkdir -p "$report_dir"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONUNBUFFERED=1
root=$PWD

status=0
for tool in "${tools[@]}"; do
    case $tool in
        memcheck) extra=(--leak-check no) ;;
        racecheck) extra=(--racecheck-report all) ;;
        initcheck | synccheck) extra=() ;;
        *) echo "unknown tool $tool (memcheck, racecheck, initcheck, synccheck)"; exit 2 ;;
    esac
    log=$report_dir/sanitize_$tool.log
    start=$(date +%s)
    (cd /tmp && timeout "$step_timeout" compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 86 \
        python3 -m pytest -q -p no:cacheprovider "$root/tests/gpu" ${pytest_expr[@]+"${pytest_expr[@]}"}) \
        >"$log" 2>&1
    rc=$?
    summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1)
    tests=$(grep -E "passed|failed" "$log" | tail -1)
    echo "$tool: exit $rc in $(( $(date +%s) - start )) s; ${summary:-no summary (timed out or crashed)}; $tests"
    (( rc == 0 )) || status=1
done
if [[ -n ${OUT:-} ]]; then
    tar -czf "$OUT/sanitize.tar.gz" -C "$report_dir" $(cd "$report_dir" && ls sanitize_*.log)
fi
exit $status
