"""A decode worker's local prefills on a thread of their own, beside the decode steps
(``--local-prefill-nice N`` or ``idle``).

Inline (the default), the engine runs a local prefill's pieces on its compute thread between
decode steps or inside them (mixed steps), so every running stream waits out each piece: a
256-token piece holds one Zen 4 core for ~0.3 s, twenty inter-token gaps' worth, and that is
what put session 38's p99 inter-token latency at 24x its unloaded value (BENCHMARKS.md, issue 4).
With a nice value the pieces run here, at that OS scheduling priority, while the compute thread
goes on stepping; the kernel shares the core between the two by weight (nice 5 leaves the
steps ~3/4 of it, nice 10 ~9/10), so a stream's gaps grow by that share instead of by whole
pieces, and a core with no decode step to run goes to the prefill whole. The pieces are whole
chunks (--prefill-chunk-tokens) or whole prompts, at their full efficiency.

With "idle" the thread runs under SCHED_IDLE: while a decode step runs the step has the core
(the kernel preempts the thread at once when the compute thread wakes), so the split is the
engine's to make: with an ITL target the steps are paced (StepPacer) and the thread gets the
time between them, all of the core while no stream runs; with a TTFT target too, the engine
stretches the gap where the local prompts' deadlines need it, by the rate this thread's pieces
go at per second of its own CPU time (``core_rate``: what the whole core would give). A nice
value splits by weight during the steps too: at nice 5 an 8-row step went from 15 to 20 ms
(BENCHMARKS.md, session 42).

Threads: the compute thread keeps the scheduler and every sequence's state; this thread only
computes a sequence's prompt into the blocks admission gave it (its own model calls: the
model's positions bookkeeping is per cache row, our kernels keep no shared scratch, the block
manager is behind the engine's lock) and hands the last piece's output back as an engine
command. A sequence dropped while its piece runs is released after that piece, so its blocks
are never handed out while the piece still writes them. This thread runs torch on one thread.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

from nxdi_common.serving.rates import PrefillRate
from nxdi_common.serving.thread_priority import IDLE, check_nice as check_thread_nice
from nxdi_common.serving.thread_priority import mark_bulk_thread, set_thread_priority

log = logging.getLogger(__name__)


def check_nice(nice: int | str | None) -> int | str | None:
    """ValueError naming the setting unless ``nice`` is None, in NICE_RANGE or "idle"."""
    return check_thread_nice(nice, "local_prefill_nice", "pieces between the decode steps",
                             allow_idle=True)


def parse_nice(text: str | None) -> int | str | None:
    """The command line's --local-prefill-nice text as check_nice takes it; ValueError naming the
    setting for anything else."""
    if text is None or text == IDLE:
        return text
    try:
        value: int | str = int(text)
    except ValueError:
        value = text  # refused by check_nice, with the setting's message
    return check_nice(value)


class StepPacer:
    """When the next decode step may start, so that the gaps between steps' ends, which are the
    gaps a stream sees between its tokens, stay within ``target_s`` while the time between
    steps goes to a local prefill (the engine's paced steps: --itl-target-ms with the thread).

    A step starts ``target_s`` minus the longest of the last ``window`` steps after the previous
    one ended: a gap is then the target less the difference between that longest step and this
    one, at most the target while steps stay as long as they lately were. Pacing the starts
    instead (one per target) put each step's variation into two gaps: session 42's
    bench_background_prefill at an 18 ms pace, 4 rows beside a SCHED_IDLE prefill, measured
    gaps p50 18.1 / p99 21.9 ms, the steps 15.4 / 18.3 (slower just after the prefill ran)."""

    def __init__(self, target_s: float, window: int = 8):
        self.target_s = target_s
        self._recent: deque[float] = deque(maxlen=window)
        self._ended: float | None = None

    def done(self, began: float, ended: float) -> None:
        """A decode step ran from ``began`` to ``ended`` (perf_counter seconds)."""
        self._recent.append(ended - began)
        self._ended = ended

    def pause_s(self, now: float, target_s: float | None = None) -> float:
        """Seconds to wait before the next step (<= 0: start it now); ``target_s``: the gap
        to keep this time instead of the pacer's own (the engine stretches it for deadlines)."""
        if self._ended is None:
            return 0.0
        target = self.target_s if target_s is None else target_s
        return self._ended + target - max(self._recent) - now


class BackgroundPrefill:
    """Runs the engine's local prefills, a piece at a time, the next one picked as the engine
    orders them (engine.local_order) after every piece."""

    def __init__(self, engine, nice: int | str):
        self.engine, self.nice = engine, check_nice(nice)
        self._cond = threading.Condition()
        self._waiting: list = []  # submitted, not running now; a begun one first
        self._current = None  # the sequence whose piece runs now
        self._cancelled = False  # _current was dropped while its piece ran
        self._stopping = False
        self._mark: float | None = None  # the local rate's clock (engine._measured_local)
        # the rate of this thread's pieces per second of its own CPU time: what the prefill
        # does with the whole core (the engine's stretched pace, _paced_gap_s)
        self.core_rate = PrefillRate()
        self._thread = threading.Thread(target=self._run, name="local-prefill", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def submit(self, seq) -> None:
        with self._cond:
            if not self._waiting and self._current is None:
                self._mark = time.perf_counter()  # a prompt arrived to an empty queue
            self._waiting.append(seq)
            self._cond.notify()

    def cancel(self, seq) -> bool:
        """Forget ``seq``; True when the caller may release it now, False when its piece is
        running (it comes back as a "drop" command once the piece is done)."""
        with self._cond:
            if seq is self._current:
                self._cancelled = True
                return False
            if seq in self._waiting:
                self._waiting.remove(seq)
            return True

    def __len__(self) -> int:
        with self._cond:
            return len(self._waiting) + (self._current is not None)

    def queued(self) -> list:
        """The local prefills not done, in the order they run: the one whose piece runs now,
        then the waiting ones as the engine orders them."""
        with self._cond:
            current = [] if self._current is None else [self._current]
            return current + self.engine.local_order(self._waiting)

    def _take(self):
        """The next sequence to run a piece of (None when stopping); waits for one."""
        with self._cond:
            while not self._waiting and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            seq = self.engine.local_order(self._waiting)[0]
            self._waiting.remove(seq)
            self._current, self._cancelled = seq, False
            return seq

    def _run(self) -> None:
        from nxdi_common.serving.compute import use_torch_threads  # torch: this module is not
        use_torch_threads(1)  # (nxdi-bench validates --decode-local-prefill-nice with it)
        mark_bulk_thread()
        try:
            set_thread_priority(self.nice)
        except (AttributeError, OSError) as exc:  # not Linux-like: it runs at the same priority
            log.warning("local prefill thread: cannot set nice %s (%s)", self.nice, exc)
        while (seq := self._take()) is not None:
            start, end = self.engine.next_piece(seq)
            out = error = None
            cpu = time.thread_time()
            try:
                out = self.engine.piece_output(seq, start, end)
            except Exception as exc:  # noqa: BLE001 - reported to the request
                log.exception("%s: local prefill piece failed", seq.request_id)
                error = exc
            else:
                self.core_rate.add(end - start, time.thread_time() - cpu)
            with self._cond:
                self._current = None
                cancelled = self._cancelled
                seq.prefilled = end
                if not cancelled and error is None and end < seq.prompt_len:
                    self._waiting.insert(0, seq)  # begun: first among equals
            self._measured(end - start)
            if cancelled:
                self.engine.command("drop", seq)
            elif error is not None:
                self.engine.command("failed", seq, error)
            elif end == seq.prompt_len:
                self.engine.command("prefilled", seq, out)

    def _measured(self, tokens: int) -> None:
        """The local rate: a piece's tokens over the wall time since the previous piece ended or
        the queue stopped being empty (the decode steps' share of the core included)."""
        now = time.perf_counter()
        if self._mark is not None:
            self.engine.local_rate.add(tokens, now - self._mark)
        with self._cond:
            self._mark = now if self._waiting else None
