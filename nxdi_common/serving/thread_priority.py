"""OS scheduling priority of one thread: the decode worker runs its local-prefill thread and the
KV socket's receiving threads below its compute thread, so that a decode step keeps the core.

Linux schedules threads, so a nice value set with the thread's native id (``setpriority``) holds
for that thread alone. An unprivileged process may only lower its threads' priority: values run
from 0 (the default) to 19. "idle" is Linux's SCHED_IDLE policy (a weight of 3 against a nice-0
thread's 1024: with the compute thread runnable, such a thread gets well under 1% of the core)."""

from __future__ import annotations

import contextlib
import os
import threading

NICE_RANGE = (0, 19)  # an unprivileged process may only lower its threads' priority
IDLE = "idle"  # SCHED_IDLE: the thread runs only while nothing else of ours wants the core


def check_nice(nice, setting: str, unset: str, allow_idle: bool = False):
    """``nice`` unchanged if it is None, an integer in NICE_RANGE, or (``allow_idle``) "idle";
    otherwise ValueError naming ``setting``, what it allows, and what leaving it unset means
    (``unset``)."""
    low, high = NICE_RANGE
    if nice is None or (allow_idle and nice == IDLE):
        return nice
    if isinstance(nice, bool) or not isinstance(nice, int) or not low <= nice <= high:
        idle = f" or {IDLE!r}" if allow_idle else ""
        raise ValueError(f"{setting} must be an integer in [{low}, {high}]{idle} (or unset: "
                         f"{unset}), got {nice!r}")
    return nice


def set_thread_priority(nice: int | str) -> None:
    """Gives the calling thread nice ``nice`` or, for "idle", the SCHED_IDLE policy. OSError or
    AttributeError where the OS has neither."""
    tid = threading.get_native_id()
    if nice == IDLE:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.setpriority(os.PRIO_PROCESS, tid, nice)


def set_process_priority(nice: int) -> None:
    """Gives every thread of this process nice ``nice``, so that the threads it starts
    afterwards inherit it too (a nice value is per thread on Linux; the threads imports have
    started already are set one by one). PermissionError where it would raise one."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [threading.get_native_id()]  # no /proc: the calling thread, which later ones inherit
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.setpriority(os.PRIO_PROCESS, tid, nice)
