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
launcher starts every service, owns its autogroup, so its nice value is set there too.

A thread's scheduler slice (Linux 6.12 and later, the EEVDF scheduler's custom slices: the
``sched_runtime`` of ``sched_setattr`` on a fair-class thread, 0.1-100 ms) decides how soon it
runs when woken on a core another thread is computing on. With the default slice (1.4 ms on
the Zen 4 VM) the computing thread keeps the core for the rest of its own slice, and the kernel
notices that end only at its next tick: a thread woken for every decode step on the step's
core, doing 0.5 ms of work each time, waited 3.6 ms at the 90th percentile and 4.0 ms at the
99th (HZ=250); with a 0.1 ms slice of its own, 0.06-0.09 and 0.12-0.18 ms (BENCHMARKS.md, issue
4, session 73). A slice changes latency only: the threads' shares of the core still follow
their weights. So the services give every thread a short slice (set_process_slice, a
service's --wakeup-slice-us) except the ones that compute or move bulk data, which take the
default back (mark_bulk_thread) so that they are not cut into short pieces among themselves."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import platform
import struct
import threading
import time

log = logging.getLogger(__name__)

NICE_RANGE = (0, 19)  # an unprivileged process may only lower its threads' priority
IDLE = "idle"  # SCHED_IDLE: the thread runs only while nothing else of ours wants the core
AUTOGROUP = "/proc/self/autogroup"
AUTOGROUP_RETRY_S = 2.0  # unprivileged autogroup writes: one per 100 ms, system-wide
SLICE_RANGE_US = (100, 100_000)  # what the kernel takes as a fair thread's sched_runtime
DEFAULT_WAKEUP_SLICE_US = 100
# struct sched_attr (include/uapi/linux/sched/types.h, with the utilization clamps): size,
# policy, flags, nice, priority, runtime, deadline, period (ns), util_min, util_max
_SCHED_ATTR = struct.Struct("=IIQiIQQQII")
_SCHED_SETATTR_GETATTR = {"x86_64": (314, 315), "aarch64": (274, 275)}
_FAIR_POLICIES = (getattr(os, "SCHED_OTHER", 0), getattr(os, "SCHED_BATCH", 3),
                  getattr(os, "SCHED_IDLE", 5))
_bulk_threads: set[int] = set()  # native ids of threads that keep the default slice


def thread_ids() -> list[int]:
    """The native ids of this process's threads (/proc/self/task); without /proc only the
    calling thread's, which the threads it starts later inherit from."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [threading.get_native_id()]


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
    for tid in thread_ids():
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


def check_slice_us(slice_us: int, setting: str = "--wakeup-slice-us") -> int:
    """``slice_us`` unchanged if it is 0 (the kernel's default slice) or in SLICE_RANGE_US;
    otherwise ValueError naming ``setting`` and what it allows."""
    low, high = SLICE_RANGE_US
    if isinstance(slice_us, bool) or not isinstance(slice_us, int) or \
            not (slice_us == 0 or low <= slice_us <= high):
        raise ValueError(f"{setting} must be 0 (the kernel's default slice) or microseconds in "
                         f"[{low}, {high}], got {slice_us!r}")
    return slice_us


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _sched_attr_syscalls() -> tuple[int, int] | None:
    if not hasattr(os, "sched_setaffinity"):  # not Linux
        return None
    return _SCHED_SETATTR_GETATTR.get(platform.machine())


def _sched_getattr(tid: int) -> tuple | int | None:
    """Thread ``tid``'s struct sched_attr as a tuple (_SCHED_ATTR's fields), the errno where
    the call failed, or None where there is no such call (not Linux, another architecture)."""
    calls = _sched_attr_syscalls()
    if calls is None:
        return None
    buf = ctypes.create_string_buffer(_SCHED_ATTR.size)
    if _libc().syscall(calls[1], tid, buf, _SCHED_ATTR.size, 0) != 0:
        return ctypes.get_errno()
    return _SCHED_ATTR.unpack(buf.raw)


def thread_slice_us(tid: int = 0) -> int | None:
    """The scheduler slice of thread ``tid`` (0: the calling one) in microseconds, as Linux 6.12
    and later report it for a fair-class thread; None where the kernel reports none (older
    kernels, other policies, other systems)."""
    attr = _sched_getattr(tid)
    if not isinstance(attr, tuple):
        return None
    return attr[5] // 1000 if attr[1] in _FAIR_POLICIES and attr[5] else None


def set_thread_slice(slice_us: int, tid: int = 0) -> bool:
    """Gives thread ``tid`` (0: the calling one) a scheduler slice of ``slice_us`` microseconds,
    or the kernel's default for 0, keeping its policy and nice value. True where the kernel
    took it (it reports the slice back), False where it has no custom slices (before 6.12, not
    Linux) or the thread is not in the fair class; OSError where the call fails otherwise."""
    check_slice_us(slice_us, "slice_us")
    attr = _sched_getattr(tid)
    if attr is None or attr in (errno.ENOSYS, errno.EINVAL):
        return False
    if isinstance(attr, int):
        raise OSError(attr, f"sched_getattr({tid}): {os.strerror(attr)}")
    _, policy, _, nice, priority, *_ = attr
    if policy not in _FAIR_POLICIES:
        return False
    packed = ctypes.create_string_buffer(_SCHED_ATTR.pack(
        _SCHED_ATTR.size, policy, 0, nice, priority, slice_us * 1000, 0, 0, 0, 0))
    if _libc().syscall(_sched_attr_syscalls()[0], tid, packed, 0) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EINVAL, errno.E2BIG):
            return False
        raise OSError(err, f"sched_setattr({tid}): {os.strerror(err)}")
    reported = thread_slice_us(tid)
    return reported is not None and (slice_us == 0 or reported == slice_us)


def mark_bulk_thread() -> None:
    """The calling thread computes or moves bulk data (a compute thread, a local prefill, a KV
    transfer): it takes the kernel's default slice back, and set_process_slice leaves it there."""
    _bulk_threads.add(threading.get_native_id())
    with contextlib.suppress(OSError):
        set_thread_slice(0)


def set_process_slice(slice_us: int) -> bool:
    """Gives every thread of this process but the bulk ones (mark_bulk_thread) a scheduler slice
    of ``slice_us`` microseconds (0: the kernel's default); threads started later inherit their
    creator's. True where the kernel took it, False where it has no custom slices."""
    check_slice_us(slice_us, "slice_us")
    tids = thread_ids()
    _bulk_threads.intersection_update(tids)  # ended ones: their ids may come back for others
    took = False
    for tid in tids:
        if tid in _bulk_threads:
            continue
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            took = set_thread_slice(slice_us, tid) or took
    return took
