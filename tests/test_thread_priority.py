"""nxdi_common.serving.thread_priority: the nice values the decode worker's threads run at."""
import os
import threading

import pytest

from nxdi_common.serving.thread_priority import IDLE, check_nice, set_thread_priority


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
