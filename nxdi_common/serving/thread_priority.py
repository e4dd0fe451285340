"""OS scheduling priority of one thread: the decode worker runs its local-prefill thread and the
KV socket's receiving threads below its compute thread, so that a decode step keeps the core.

Linux schedules threads, so a nice value set with the thread's native id (``setpriority``) holds
for that thread alone. An unprivileged process may only lower its threads' priority: values run
from 0 (the default) to 19. "idle" is Linux's SCHED_IDLE policy (a weight of 3 against a nice-0
thread's 1024: with the compute thread runnable, such a thread gets well under 1% of the core).

A whole process's nice value (a service's --nice) has one more place to go. With autogroup
scheduling (CONFIG_SCHED_AUTOGROUP, on in most distributions' kernels) the kernel shares a core
between sessions (setsid) first and between the threads of a session second, so a thread's nice
weighs only against its own session's threads: a prefill worker at nice 19 in a session of its
own takes a core shared with the router as if at nice 0, and the router's woken threads wait for
the next scheduler tick (up to 4 ms at HZ=250). A process that leads its session, as the
launcher starts every service, owns its autogroup, so its nice value is set there too."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time

log = logging.getLogger(__name__)

NICE_RANGE = (0, 19)  # an unprivileged process may only lower its threads' priority
IDLE = "idle"  # SCHED_IDLE: the thread runs only while nothing else of ours wants the core
AUTOGROUP = "/proc/self/autogroup"
AUTOGROUP_RETRY_S = 2.0  # unprivileged autogroup writes: one per 100 ms, system-wide


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
    started already are set one by one) and, where the process leads its session, on its
    autogroup (set_autogroup_nice). PermissionError where it would raise one."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [threading.get_native_id()]  # no /proc: the calling thread, which later ones inherit
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    try:
        set_autogroup_nice(nice)
    except OSError as exc:  # the threads' values hold; say that the session's group did not move
        log.warning("nice %d: the threads are set, but not this session's autogroup (%s): "
                    "against other sessions the process runs as before", nice, exc)


def set_autogroup_nice(nice: int, path: str = AUTOGROUP) -> bool:
    """Gives this process's autogroup nice ``nice`` if the process leads its own session (the
    group is then its own and its children's, not a shell's or a launcher's); False where it
    does not or the kernel has no autogroups. The kernel refuses unprivileged writes less than
    100 ms after anyone's last one (EAGAIN): services started together retry for a while."""
    if os.getsid(0) != os.getpid() or not os.path.exists(path):
        return False
    deadline = time.monotonic() + AUTOGROUP_RETRY_S
    while True:
        try:
            with open(path, "w") as f:
                f.write(str(nice))
            return True
        except OSError as exc:
            if exc.errno != errno.EAGAIN or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def autogroup_nice(pid: int | str = "self") -> int | None:
    """The nice value of process ``pid``'s autogroup ("/autogroup-N nice V"); None without one."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None
