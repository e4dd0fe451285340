"""LoopHandoff (nxdi_common/serving/handoff.py): items posted from another thread reach the loop
in order, a burst in one wake-up, and a closed loop drops them without raising."""
import asyncio
import contextlib
import threading
import time

from nxdi_common.serving.handoff import LoopHandoff, deferred_wakeups


def test_a_burst_arrives_in_order_in_one_wakeup():
    async def main():
        handoff, got = LoopHandoff(asyncio.get_running_loop()), []
        done = asyncio.Event()

        def engine():  # a step's events: posted back to back from the engine thread
            for i in range(50):
                handoff.post(got.append, i)
            handoff.post(lambda _: done.set(), None)

        thread = threading.Thread(target=engine)
        thread.start()
        thread.join()  # the loop is blocked until the whole burst is posted
        await asyncio.wait_for(done.wait(), 5)
        return got, handoff.wakeups

    got, wakeups = asyncio.run(main())
    assert got == list(range(50)) and wakeups == 1


def test_posts_after_a_drain_wake_the_loop_again():
    async def main():
        handoff, got = LoopHandoff(asyncio.get_running_loop()), []
        for step in range(3):  # a step's 4 events, posted while the loop is busy
            thread = threading.Thread(target=lambda: [handoff.post(got.append, (step, i))
                                                      for i in range(4)])
            thread.start()
            thread.join()
            while len(got) < 4 * (step + 1):
                await asyncio.sleep(0.01)
        return got, handoff.wakeups

    got, wakeups = asyncio.run(main())
    assert got == [(s, i) for s in range(3) for i in range(4)] and wakeups == 3


def test_a_closed_loop_drops_items_without_raising():
    loop = asyncio.new_event_loop()
    handoff = LoopHandoff(loop)
    loop.close()
    handoff.post(print, "never")  # no RuntimeError into the engine thread
    assert handoff.wakeups == 1


def test_posts_inside_deferred_wakeups_wake_the_loop_once_at_the_end():
    """The loop is free while the engine thread posts a step's events with host work between
    them: without the block each post woke it and it drained that one item (a GIL handoff per
    token); inside deferred_wakeups nothing is delivered until the block ends, then everything
    in order, in one wake-up."""
    async def run_step(handoff, deferred: bool):
        got, seen_inside = [], []

        def engine():
            with deferred_wakeups() if deferred else contextlib.nullcontext():
                for i in range(5):
                    handoff.post(got.append, i)
                    deadline = time.monotonic() + (0.05 if deferred else 5)
                    while len(got) <= i and time.monotonic() < deadline:  # the loop is free
                        time.sleep(0.005)
                seen_inside.append(len(got))

        before = handoff.wakeups
        thread = threading.Thread(target=engine)
        thread.start()
        while thread.is_alive() or len(got) < 5:
            await asyncio.sleep(0.002)
        return got, handoff.wakeups - before, seen_inside[0]

    async def main():
        handoff = LoopHandoff(asyncio.get_running_loop())
        return await run_step(handoff, False), await run_step(handoff, True)

    (got, wakeups, inside), (d_got, d_wakeups, d_inside) = asyncio.run(main())
    assert got == list(range(5)) and wakeups == 5 and inside == 5
    assert d_got == list(range(5)) and d_wakeups == 1 and d_inside == 0
