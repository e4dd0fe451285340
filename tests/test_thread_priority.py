"""nxdi_common.serving.thread_priority: the nice values the decode worker's threads run at."""
import os
import threading

import pytest

from nxdi_common.serving.thread_priority import (IDLE, autogroup_nice, check_nice,
                                                 set_thread_priority)


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
