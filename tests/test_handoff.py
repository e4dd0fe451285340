"""LoopHandoff (nxdi_common/serving/handoff.py): items posted from another thread reach the loop
in order, a burst in one wake-up, and a closed loop drops them without raising."""
import asyncio
import threading

from nxdi_common.serving.handoff import LoopHandoff


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
