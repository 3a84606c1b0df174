"""A command under compute-sanitizer, run in a session of its own and supervised: the options every run takes, and
the ending of a run that passes a limit (its Python stacks printed first) with nothing of it left behind.

tools/sanitize_run.py (the shards of tools/gpu_suite.sh) and tools/sanitizer_cost.py use it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

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
_LIVE: set[subprocess.Popen] = set()  # the sessions supervise() runs now (end_live_sessions)


def sanitizer_command(tool: str, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """compute-sanitizer with `tool`, the options every run takes, then `extra`."""
    return ["compute-sanitizer", "--tool", tool, *COMMON_OPTIONS, *TOOL_OPTIONS[tool], *extra]


def exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it: 128 + the signal for one a signal ended."""
    return 128 - returncode if returncode < 0 else returncode


def session_pids(sid: int) -> list[int]:
    """The live processes of session `sid` (compute-sanitizer and the program it started); zombies, which hold no
    memory and wait for a parent to reap them, are left out."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid and process_state(int(entry.name)) != "Z":
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R, S, D, Z, ...), or "" for a process gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def resident_mb(pids: list[int]) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
    return total // 2**20


def catches_sigusr1(pid: int) -> bool:
    """Whether the process has a handler for SIGUSR1 (faulthandler's, printing its stacks): the signal would end one
    without (a program still starting, or compute-sanitizer itself)."""
    try:
        caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)


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


def supervise(command: list[str], stdout: IO[str] | None,
              reason_to_end: Callable[[int], str | None]) -> tuple[int, str | None, int]:
    """Run `command` in a session of its own, output to `stdout`, and poll it: with the session's resident MB each
    time, reason_to_end says why it should end now, or None. Given a reason, the processes with a SIGUSR1 handler
    get the signal (faulthandler prints their stacks) and, if the reason still holds DUMP_SECONDS later (a test that
    ended meanwhile takes it back), the session ends. Returns the exit status, the reason it was ended for (None if
    it ended by itself) and the most resident MB seen."""
    proc = subprocess.Popen(command, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True)
    _LIVE.add(proc)
    peak, reason = 0, None
    try:
        while proc.poll() is None:
            time.sleep(POLL_SECONDS)
            used = resident_mb(session_pids(proc.pid))
            peak = max(peak, used)
            if reason_to_end(used) is None:
                continue
            signal_all([p for p in session_pids(proc.pid) if catches_sigusr1(p)], signal.SIGUSR1)
            time.sleep(DUMP_SECONDS)
            if proc.poll() is not None:
                break  # it ended by itself meanwhile
            used = resident_mb(session_pids(proc.pid))
            peak = max(peak, used)
            reason = reason_to_end(used)
            if reason is not None:
                end_session(proc)
                break
    finally:
        if proc.poll() is None:  # this process is being ended itself (end_live_sessions)
            end_session(proc)
        reap_session(proc)
        _LIVE.discard(proc)
    return exit_status(proc.returncode), reason, peak


def end_live_sessions(*_) -> None:
    """A SIGTERM handler for the scripts that supervise sessions: the sessions end with them (timeout(1)'s TERM
    would otherwise leave them running on the GPU)."""
    for proc in list(_LIVE):
        end_session(proc)
    sys.exit(143)
