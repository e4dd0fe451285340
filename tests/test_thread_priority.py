"""nxdi_common.serving.thread_priority: the nice values the decode worker's threads run at."""
import os
import threading

import pytest

from nxdi_common.serving import thread_priority
from nxdi_common.serving.thread_priority import (DEFAULT_WAKEUP_SLICE_US, IDLE, autogroup_nice,
                                                 check_nice, check_slice_us, mark_bulk_thread,
                                                 set_process_slice, set_thread_priority,
                                                 set_thread_slice, thread_slice_us)


@pytest.mark.parametrize("nice", [None, 0, 7, 19])
def test_check_nice_passes_unset_and_values_in_range(nice):
    assert check_nice(nice, "x nice", "default") == nice


@pytest.mark.parametrize("nice", [-1, 20, 2.5, True, "5", IDLE])
def test_check_nice_names_the_setting_and_what_it_allows(nice):
    with pytest.raises(ValueError, match=r"^x nice must be an integer in \[0, 19\] \(or unset: "
                                         r"the default\), got "):
        check_nice(nice, "x nice", "the default")


def test_idle_only_where_allowed_and_said_in_the_message():
    assert check_nice(IDLE, "y", "z", allow_idle=True) == IDLE
    with pytest.raises(ValueError, match=r"in \[0, 19\] or 'idle' \(or unset: z\), got 20"):
        check_nice(20, "y", "z", allow_idle=True)


def _thread_sched(tid: int) -> tuple[int, int]:
    """(nice, policy) of thread ``tid`` of this process from /proc."""
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[16]), int(fields[38])  # fields 19 and 41 of stat(5), after pid and comm


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux /proc needed")
@pytest.mark.parametrize("nice, policy", [(6, os.SCHED_OTHER), (IDLE, getattr(os, "SCHED_IDLE", 5))])
def test_set_thread_priority_changes_the_calling_thread_only(nice, policy):
    seen = {}

    def run():
        set_thread_priority(nice)
        seen["tid"] = threading.get_native_id()
        seen["sched"] = _thread_sched(seen["tid"])

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if nice == IDLE:
        assert seen["sched"][1] == policy
    else:
        assert seen["sched"] == (nice, policy)
    assert _thread_sched(threading.get_native_id()) == (os.getpriority(os.PRIO_PROCESS, 0),
                                                         os.SCHED_OTHER)


AUTOGROUPS = os.path.exists("/proc/self/autogroup")
_CHILD = """
import os, sys
from nxdi_common.serving.thread_priority import autogroup_nice, set_process_priority
before = autogroup_nice()
set_process_priority(int(sys.argv[1]))
print(before, autogroup_nice(), os.getpriority(os.PRIO_PROCESS, 0))
"""


def _child_nices(nice: int, new_session: bool) -> list[str]:
    """(autogroup nice before, autogroup nice after, process nice) of a child that runs
    set_process_priority(nice), in a session of its own or in this one."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _CHILD, str(nice)], capture_output=True,
                         text=True, check=True, start_new_session=new_session, timeout=60)
    return out.stdout.split()


@pytest.mark.skipif(not AUTOGROUPS, reason="a kernel with autogroup scheduling needed")
def test_a_session_leader_puts_its_nice_on_its_autogroup_too():
    """With autogroups a thread's nice weighs only against its own session's threads: a
    service in a session of its own (as the launcher starts them) sets its group's nice too."""
    assert _child_nices(9, new_session=True) == ["0", "9", "9"]


@pytest.mark.skipif(not AUTOGROUPS, reason="a kernel with autogroup scheduling needed")
def test_a_process_in_someone_elses_session_leaves_that_sessions_group_alone():
    """Not the session's leader (started from a shell or by a test runner): the group holds
    others' processes too, so only the process's own threads change."""
    mine = autogroup_nice()
    assert _child_nices(11, new_session=False) == [str(mine), str(mine), "11"]
    assert autogroup_nice() == mine


def test_autogroup_writes_refused_for_now_are_retried_and_other_errors_raised(monkeypatch,
                                                                               tmp_path):
    """The kernel takes an unprivileged autogroup nice at most once per 100 ms system-wide
    (EAGAIN): services started together retry; any other refusal is raised."""
    import errno

    from nxdi_common.serving import thread_priority
    target = tmp_path / "autogroup"
    target.write_text("/autogroup-1 nice 0\n")
    refusals = [errno.EAGAIN, errno.EAGAIN, errno.EAGAIN]

    def fake_open(path, mode="r"):
        if refusals:
            raise OSError(refusals.pop(0), "refused")
        return open(path, mode)

    monkeypatch.setattr(os, "getsid", lambda pid: os.getpid())  # as if the session's leader
    monkeypatch.setattr(thread_priority, "open", fake_open, raising=False)
    assert thread_priority.set_autogroup_nice(5, str(target)) is True
    assert target.read_text() == "5" and not refusals
    refusals.append(errno.EACCES)
    with pytest.raises(PermissionError):
        thread_priority.set_autogroup_nice(6, str(target))
    assert target.read_text() == "5"
    assert thread_priority.set_autogroup_nice(7, str(tmp_path / "missing")) is False


# ------------------------------------------------------------------ scheduler slices (Linux 6.12+)

def _custom_slices() -> bool:
    """Whether this kernel reports (and so takes) a fair thread's slice."""
    return thread_slice_us() is not None


needs_slices = pytest.mark.skipif(not os.path.isdir("/proc/self/task") or not _custom_slices(),
                                  reason="a kernel with EEVDF custom slices (Linux 6.12+)")


@pytest.mark.parametrize("value", [0, 100, 2500, 100_000])
def test_check_slice_us_passes_zero_and_values_in_range(value):
    assert check_slice_us(value) == value


@pytest.mark.parametrize("value", [-1, 1, 99, 100_001, 2.5, True, "100"])
def test_check_slice_us_names_the_setting_and_what_it_allows(value):
    with pytest.raises(ValueError, match=r"^--wakeup-slice-us must be 0 \(the kernel's default "
                                         r"slice\) or microseconds in \[100, 100000\], got "):
        check_slice_us(value)


def _in_thread(fn):
    """fn() on a new thread; (its result, the thread's native id)."""
    seen = {}

    def run():
        seen["tid"] = threading.get_native_id()
        seen["result"] = fn()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen["result"], seen["tid"]


@needs_slices
def test_a_threads_slice_is_set_and_given_back_keeping_its_nice():
    default = thread_slice_us()

    def run():
        set_thread_priority(4)
        before = _thread_sched(threading.get_native_id())
        took = set_thread_slice(250)
        short = thread_slice_us()
        after = _thread_sched(threading.get_native_id())
        set_thread_slice(0)
        return took, short, thread_slice_us(), before, after

    (took, short, back, before, after), _ = _in_thread(run)
    assert took and short == 250 and back == default != 250
    assert after == before == (4, os.SCHED_OTHER)  # the nice value and the policy stay
    assert thread_slice_us() == default  # the calling thread's own is untouched


@needs_slices
def test_a_sched_idle_thread_keeps_its_policy_and_the_default_slice():
    """The kernel takes custom slices for SCHED_OTHER and SCHED_BATCH threads only."""
    def run():
        set_thread_priority(IDLE)
        return set_thread_slice(250), thread_slice_us(), _thread_sched(threading.get_native_id())

    (took, slice_us, (_, policy)), _ = _in_thread(run)
    assert not took and slice_us == thread_slice_us() != 250
    assert policy == getattr(os, "SCHED_IDLE", 5)


@needs_slices
def test_set_process_slice_reaches_every_thread_but_the_bulk_ones_and_later_threads_inherit():
    default = thread_slice_us()
    started, release, bulk_marked = threading.Event(), threading.Event(), threading.Event()
    tids = {}

    def waiter(name, bulk):
        tids[name] = threading.get_native_id()
        if bulk:
            mark_bulk_thread()
            bulk_marked.set()
        started.set()
        release.wait()

    threads = [threading.Thread(target=waiter, args=(n, b)) for n, b in (("plain", False),
                                                                       ("bulk", True))]
    for t in threads:
        t.start()
    bulk_marked.wait(5)
    try:
        assert set_process_slice(300)
        assert thread_slice_us(tids["plain"]) == 300  # started before: set
        assert thread_slice_us(tids["bulk"]) == default  # marked: left at the default
        assert thread_slice_us() == 300
        inherited, _ = _in_thread(thread_slice_us)  # started after: its creator's
        assert inherited == 300
        bulk_later, _ = _in_thread(lambda: (mark_bulk_thread(), thread_slice_us())[1])
        assert bulk_later == default
    finally:
        release.set()
        for t in threads:
            t.join()
        set_process_slice(0)
    assert thread_slice_us() == default


def test_without_custom_slices_nothing_is_set_and_nothing_raises(monkeypatch):
    monkeypatch.setattr(thread_priority, "_sched_attr_syscalls", lambda: None)
    assert thread_slice_us() is None
    assert set_thread_slice(100) is False
    assert set_process_slice(100) is False


def test_the_services_take_wakeup_slice_us_and_refuse_bad_values(capsys):
    from nxdi_common.serving.worker import add_wakeup_slice_arg
    from router.server import build_parser
    import argparse
    parser = argparse.ArgumentParser(prog="worker")
    add_wakeup_slice_arg(parser)
    assert parser.parse_args([]).wakeup_slice_us == DEFAULT_WAKEUP_SLICE_US == 100
    assert parser.parse_args(["--wakeup-slice-us", "0"]).wakeup_slice_us == 0
    for bad, message in (("50", "must be 0 (the kernel's default slice) or microseconds in "
                                "[100, 100000], got 50"),
                         ("fast", "must be an integer, got 'fast'")):
        for p in (parser, build_parser()):
            with pytest.raises(SystemExit):
                p.parse_args(["--wakeup-slice-us", bad])
            assert f"--wakeup-slice-us {message}" in capsys.readouterr().err
