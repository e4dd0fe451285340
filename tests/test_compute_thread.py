"""nxdi_common.serving.compute: a worker's parallel torch work on one thread. Each check runs in
a fresh Python process, since torch's thread counts and OpenMP's teams are per process."""
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Counts the process's threads around torch work on the main thread, on the compute thread and
# on a thread started later: GNU OpenMP adds a team's threads to the process the first time a
# thread runs a parallel region with more than one torch thread, and keeps them while the
# thread lives.
PRELUDE = textwrap.dedent("""
    import os, threading, torch
    from nxdi_common import kernels
    from nxdi_common.serving.compute import ComputeThread
    assert kernels.kernels_unavailable_reason() is None

    def tasks():
        return len(os.listdir("/proc/self/task"))

    def parallel_work():
        # torch's own parallel op, and one of our kernels (at::parallel_for compiled into our
        # library, which keeps its own per-thread record of torch's thread count)
        x = torch.ones(1 << 22)
        for _ in range(3):
            x.sum()
            torch.ops.nxdi.silu_mul(x.view(256, -1))
        counts = {torch.get_num_threads(), torch.ops.nxdi.thread_count()}
        assert len(counts) == 1, counts
        return counts.pop()

    def on_new_thread(fn):
        # fn's result on a new thread, and the process's thread count right after it, taken
        # on that thread while it is alive (any OpenMP team it made is alive with it; once it
        # exits, libgomp lets the team go, and the OS removes it a moment after join()
        # returns, so counts taken afterwards race with that)
        out = []
        t = threading.Thread(target=lambda: out.append((fn(), tasks())))
        t.start(); t.join()
        return out[0]
""")


def run(script: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(script), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_only_the_compute_thread_runs_torch_in_parallel():
    run("""
        compute = ComputeThread(2, "compute")
        assert compute.threads == 2
        assert compute.call(parallel_work) == 2
        settled = tasks()
        # the creating thread and threads started afterwards run torch on one thread: no team
        assert parallel_work() == 1
        # the new thread itself, and no team of its own
        assert on_new_thread(parallel_work) == (1, settled + 1)
        assert compute.call(parallel_work) == 2  # unchanged by the others
        assert tasks() == settled
    """)


def test_without_it_a_second_thread_adds_a_second_team():
    # The situation ComputeThread prevents, so that the test above means something here: a
    # thread's parallel work after the main thread's brings OpenMP threads of its own.
    run("""
        torch.set_num_threads(2)
        assert parallel_work() == 2
        settled = tasks()
        # the new thread and, beside it, the OpenMP team it made (one more thread for 2)
        assert on_new_thread(parallel_work) == (2, settled + 2)
    """)


def test_calls_return_results_raise_errors_and_run_in_order():
    run("""
        main_threads = torch.get_num_threads()
        compute = ComputeThread(1, "compute")
        assert compute.threads == 1
        assert torch.get_num_threads() == main_threads  # one torch thread: no other changes
        seen = []
        futures = [compute.submit(seen.append, i) for i in range(5)]
        for f in futures:
            f.result(timeout=30)
        assert seen == [0, 1, 2, 3, 4]
        assert compute.call(threading.get_ident) == compute.ident != threading.get_ident()
        try:
            compute.call(int, "not a number")
        except ValueError as exc:
            assert "not a number" in str(exc)
        else:
            raise AssertionError("the error was not raised")
        compute.close(timeout=30)
        try:
            compute.submit(print)
        except RuntimeError as exc:
            assert "has stopped" in str(exc)
        else:
            raise AssertionError("a stopped compute thread took work")
    """)


def test_workers_load_and_run_their_model_on_the_compute_thread(tiny_chat_model):
    """A decode and a prefill worker with two torch threads: the model loaded on the engine's
    compute thread (two threads there), the process's other threads on one."""
    run("""
        import sys
        from decode_service.main import build, parse_args as decode_args
        from prefill_service.server import load_app, parse_args as prefill_args
        common = ["--model", sys.argv[1], "--dtype", "float32", "--backend", "eager",
                  "--threads", "2", "--max-model-len", "256"]
        _, engine, _, _ = build(decode_args(common + ["--kv-blocks", "24", "--block-size", "16",
                                                      "--max-batch-size", "4"]))
        runner = engine._runner
        assert runner is not None and runner.threads == 2, runner
        assert runner.call(torch.get_num_threads) == 2
        assert torch.get_num_threads() == 1
        assert on_new_thread(torch.get_num_threads)[0] == 1
        app = load_app(prefill_args(common))
        prefill_runner = app.engine._runner
        assert prefill_runner is not None and prefill_runner is not runner, prefill_runner
        assert prefill_runner.call(torch.get_num_threads) == 2
        assert torch.get_num_threads() == 1
        engine.start(); app.engine.start()
        assert engine._done is not None and not engine._done.done()
        engine.stop(); app.engine.stop(30)
        assert engine._done.done() and app.engine._done.done()
    """, str(tiny_chat_model))
