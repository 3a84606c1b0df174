"""A command under compute-sanitizer, run in a session of its own and supervised: the options every run takes, and
the ending of a run that passes a limit (its Python stacks printed first) with nothing of it left behind.

tools/sanitize_run.py (the shards of tools/gpu_suite.sh) and tools/sanitizer_cost.py use it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

# Every run's options. Host backtraces off: to print them, compute-sanitizer keeps a reference to the Python frames of
# every CUDA call, which keeps each frame's locals (engines and their device memory) alive until exit; a kernel's
# errors still come with its device backtrace. API errors unreported: NCCL's initialization asks
# cudaFuncGetAttributes about each of its kernels and skips those without an sm_90 image (error 209, 8 reports per
# communicator); the runtime checks every CUDA call it makes outside destructors and raises, failing the test.
COMMON_OPTIONS = ("--show-backtrace", "device", "--report-api-errors", "no", "--error-exitcode", "86")
TOOL_OPTIONS = {
    "memcheck": ("--leak-check", "no"),  # leaks are caught a level up: nanobind reports engines alive at exit
    "racecheck": ("--racecheck-report", "all"),  # each hazard, not only the analysis
    "initcheck": (),
    "synccheck": (),
}
POLL_SECONDS = 2.0
DUMP_SECONDS = 3.0  # for the stacks to be written before the limit is checked again
TERM_SECONDS = 10.0  # SIGTERM, then SIGKILL
REAP_SECONDS = 30.0  # for a killed session's processes to be gone


def sanitizer_command(tool: str, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """compute-sanitizer with `tool`, the options every run takes, then `extra`."""
    return ["compute-sanitizer", "--tool", tool, *COMMON_OPTIONS, *TOOL_OPTIONS[tool], *extra]


def exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it: 128 + the signal for one a signal ended."""
    return 128 - returncode if returncode < 0 else returncode


def session_pids(sid: int) -> list[int]:
    """The processes of session `sid` (compute-sanitizer and the program it started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def resident_mb(pids: list[int]) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
    return total // 2**20


def is_python_process(pid: int) -> bool:
    """A Python interpreter: the program under the sanitizer, not compute-sanitizer (whose command line names the
    program too, and which SIGUSR1 would end)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return Path(argv[0].decode(errors="replace")).name.startswith("python")


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def end_session(proc: subprocess.Popen) -> None:
    """SIGTERM to the session, SIGKILL to what is left, then wait until none of it remains."""
    signal_all(session_pids(proc.pid), signal.SIGTERM)
    try:
        proc.wait(TERM_SECONDS)
    except subprocess.TimeoutExpired:
        pass
    reap_session(proc)


def reap_session(proc: subprocess.Popen) -> None:
    """SIGKILL to whatever of the session outlived its leader (a program whose sanitizer died, say), and wait for
    it: nothing of one run may hold the GPU beside the next."""
    deadline = time.time() + REAP_SECONDS
    while (pids := session_pids(proc.pid)) and time.time() < deadline:
        signal_all(pids, signal.SIGKILL)
        if proc.poll() is None:
            try:
                proc.wait(1.0)
            except subprocess.TimeoutExpired:
                pass
        else:
            time.sleep(0.2)
    proc.wait()


def supervise(command: list[str], stdout, reason_to_end: Callable[[int], str | None]) -> tuple[int, str | None, int]:
    """Run `command` in a session of its own, output to `stdout`, and poll it: with the session's resident MB each
    time, reason_to_end says why it should end now, or None. Given a reason, the Python processes get SIGUSR1 (their
    stacks, where faulthandler is registered for it) and, if the reason still holds DUMP_SECONDS later (a test that
    ended meanwhile takes it back), the session ends. Returns the exit status, the reason it was ended for (None if
    it ended by itself) and the most resident MB seen."""
    proc = subprocess.Popen(command, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True)
    peak, reason = 0, None
    try:
        while proc.poll() is None:
            time.sleep(POLL_SECONDS)
            used = resident_mb(session_pids(proc.pid))
            peak = max(peak, used)
            first = reason_to_end(used)
            if first is None:
                continue
            signal_all([p for p in session_pids(proc.pid) if is_python_process(p)], signal.SIGUSR1)
            time.sleep(DUMP_SECONDS)
            if proc.poll() is not None:  # a program without the handler dies of SIGUSR1: still this script's end
                reason = first if proc.returncode == -signal.SIGUSR1 else None
                break
            reason = reason_to_end(resident_mb(session_pids(proc.pid)))
            if reason is not None:
                end_session(proc)
                break
    finally:
        if proc.poll() is None:  # this process is being ended itself (SIGTERM from timeout(1), say)
            end_session(proc)
        reap_session(proc)
    return exit_status(proc.returncode), reason, peak
