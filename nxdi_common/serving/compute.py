"""The one thread of a worker process that runs torch's multi-threaded work.

torch's CPU operators (and our kernels, through at::parallel_for) split their work over an OpenMP
team, and GNU OpenMP gives every thread that starts a parallel region a team of its own, kept for
the thread's life. A worker that loaded its model on the main thread (the packing of its weights
runs in parallel there) and then ran the model on an engine thread held two teams; once a process
holds more OpenMP threads than it has CPUs, libgomp stops the idle ones from spinning (GOMP's
"throttled" spin count), so every parallel region waits for a sleeping thread to be woken. On 2
vCPUs, 40 products of 3072 x 576 weights by 4 rows with two threads took 13.4-13.8 ms a pass from
such a second thread, as long as on one thread (13.4-14.0), against 6.2-7.4 ms with one team
(and 7.2 ms with the weights packed and multiplied on the same non-main thread): an aggregated
worker on two cores decoded at one core's speed.

So a worker with more than one torch thread does everything parallel on one ComputeThread: it
loads (and compiles and warms up) the model there, then runs its engine loop there. Every other
thread runs torch on one thread (their work is small: protobuf and KV copies): the thread that
creates the ComputeThread is set so, and so is every thread started after it (torch sets a new
thread's count, on its first use, from the last count set anywhere)."""
from __future__ import annotations

import concurrent.futures
import queue
import threading

from nxdi_common.serving.thread_priority import mark_bulk_thread

__all__ = ["ComputeThread", "run_loop", "use_torch_threads"]


def use_torch_threads(threads: int | None) -> int:
    """Set this thread's torch intra-op threads (None: keep torch's default) and fix it now, in
    libtorch and in our kernel library, so that a count set later on another thread does not
    reach this one; returns the count."""
    import torch

    from nxdi_common import kernels
    if threads is not None:
        torch.set_num_threads(threads)
    count = torch.get_num_threads()  # the first call fixes libtorch's count for this thread
    if kernels.kernels_unavailable_reason() is None:
        # at::parallel_for in our library sets a thread's count once, from torch's latest
        # setting anywhere (fused_ops.cpp, thread_count): fix it here too, now
        ours = torch.ops.nxdi.thread_count()
        if ours != count:
            raise RuntimeError(f"our kernels would run on {ours} threads on this thread, torch "
                               f"on {count}: the thread ran them before its count was set")
    return count


class ComputeThread:
    """A daemon thread that runs submitted callables in order with ``threads`` torch threads.

    Creating one with more than one torch thread leaves the creating thread, and threads started
    later, on one torch thread (module doc). ``call`` runs a function there and returns its
    result (or raises its exception); ``submit`` returns a concurrent.futures.Future, e.g. for
    an engine loop that runs until stopped."""

    def __init__(self, threads: int | None, name: str = "compute"):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._serve, args=(threads, ready), name=name,
                                        daemon=True)
        self._thread.start()
        self.threads = ready.result()
        if self.threads > 1:
            use_torch_threads(1)

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def _serve(self, threads: int | None, ready: concurrent.futures.Future) -> None:
        mark_bulk_thread()  # the kernel's default slice: its torch threads inherit it
        try:
            ready.set_result(use_torch_threads(threads))
        except BaseException as exc:  # noqa: BLE001 - reported to the creator
            ready.set_exception(exc)
            return
        while (task := self._tasks.get()) is not None:
            _run_into(*task)

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        if not self._thread.is_alive():
            raise RuntimeError(f"compute thread {self._thread.name!r} has stopped")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((future, fn, args, kwargs))
        return future

    def call(self, fn, *args, **kwargs):
        return self.submit(fn, *args, **kwargs).result()

    def close(self, timeout: float | None = None) -> None:
        """Stop after the callables already submitted (waits up to ``timeout`` seconds)."""
        self._tasks.put(None)
        self._thread.join(timeout)


def run_loop(fn, runner: ComputeThread | None, name: str) -> concurrent.futures.Future:
    """Start ``fn`` (an engine loop) on ``runner``, or without one on a daemon thread of its own
    named ``name``; the future completes when ``fn`` returns or raises."""
    if runner is not None:
        return runner.submit(fn)
    future: concurrent.futures.Future = concurrent.futures.Future()
    threading.Thread(target=_run_into, args=(future, fn, (), {}), name=name, daemon=True).start()
    return future


def _run_into(future: concurrent.futures.Future, fn, args, kwargs) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
        future.set_exception(exc)
