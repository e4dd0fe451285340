"""Decode steps beside a prefill thread at a given nice value, in one process: what the decode
worker's --local-prefill-nice trades (decode_service/background_prefill.py).

    taskset -c 1 python bench/bench_background_prefill.py [--rows 8] [--length 256]
                                                          [--seconds 6] [--nice 0 5 10 idle]
                                                          [--pace-ms 0]

Loads the bundled model as a one-thread decode worker does (bf16, block KV cache, compiled,
256-token pieces) and reports the gaps between decode steps (p50 / p90 / p99 / max) of --rows
rows of --length cached positions: alone, then beside a thread running 256-token prompt pieces
at each --nice value; and the prefill's tokens per second alone and beside the steps. With
--pace-ms the steps beside the prefill are paced as the engine paces them (--itl-target-ms).
Pin it to one core (taskset) to see one core shared, as a disaggregated decode worker's is."""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_tkg_step as tkg  # noqa: E402
from decode_service.background_prefill import StepPacer, parse_nice  # noqa: E402
from nxdi_common.serving.thread_priority import set_thread_priority  # noqa: E402
from nxdi_common.serving.compute import use_torch_threads  # noqa: E402
from nxdi_common.serving.worker import ModelOptions, decode_neuron_config, load_model  # noqa: E402

PIECE = 256
FIRST_BLOCK = 1500  # the prompt's blocks, away from the decode rows'


def piece_args(start: int) -> dict:
    """One prompt's piece [start, start + PIECE) in blocks of its own, seq_id 15."""
    table = [FIRST_BLOCK + j for j in range(4 * PIECE // tkg.BLOCK)]
    slots = [table[p // tkg.BLOCK] * tkg.BLOCK + p % tkg.BLOCK for p in range(start, start + PIECE)]
    return dict(input_ids=torch.randint(100, 20000, (1, PIECE)), seq_ids=torch.tensor([15]),
                position_ids=torch.arange(start, start + PIECE).unsqueeze(0),
                sampling_params=torch.tensor([[1, 1.0, 1.0]]), slot_mapping=torch.tensor([slots]),
                block_table=torch.tensor([table]), rand=torch.rand(1))


def prefill_loop(model, nice: int | str | None, stop: threading.Event, pieces: list) -> None:
    use_torch_threads(1)
    if nice is not None:
        set_thread_priority(nice)
    k = 0
    with torch.no_grad():
        while not stop.is_set():
            model.forward(**piece_args(PIECE * (k % 4)))
            pieces.append(time.perf_counter())
            k += 1


def decode_for(model, lengths: list[int], seconds: float, pace: float = 0.0):
    """Over `seconds`: the gaps between decode steps' ends (what a stream sees), the steps'
    own times, and how late each paced wake-up came; with `pace`, the steps are paced as the
    engine paces them (StepPacer: gaps within `pace`, the time between to the prefill)."""
    gaps, steps, late, end = [], [], [], time.perf_counter() + seconds
    pacer = StepPacer(pace) if pace else None
    last = time.perf_counter()
    with torch.no_grad():
        while time.perf_counter() < end:
            if pacer is not None and (wait := pacer.pause_s(time.perf_counter())) > 0:
                due = time.perf_counter() + wait
                time.sleep(wait)
                late.append(max(0.0, time.perf_counter() - due))
            began = time.perf_counter()
            tkg.step(model, lengths)
            done = time.perf_counter()
            if pacer is not None:
                pacer.done(began, done)
            gaps.append(done - last)
            steps.append(done - began)
            last = done
    return gaps, steps, late


def _at(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3 if values else float("nan")


def report(name: str, timed, pieces: int, seconds: float) -> None:
    gaps, steps, late = timed
    line = (f"{name:>16}: gaps {len(gaps):4d}, p50 {_at(gaps, 0.5):6.1f} p90 {_at(gaps, 0.9):6.1f}"
            f" p99 {_at(gaps, 0.99):6.1f} max {_at(gaps, 1.0):6.1f} ms; prefill "
            f"{pieces * PIECE / seconds:5.0f} tok/s")
    if gaps:
        line += f"; step p50/p99 {_at(steps, 0.5):.1f}/{_at(steps, 0.99):.1f} ms"
    if late:
        line += f"; wake-up late p50/p99 {_at(late, 0.5):.2f}/{_at(late, 0.99):.2f} ms"
    print(line, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--nice", nargs="+", default=["0", "5", "10"],
                   help="nice values, or 'idle' (SCHED_IDLE), for the prefill thread")
    p.add_argument("--pace-ms", type=float, default=0.0,
                   help="beside a prefill thread, pace the steps to end this many ms apart "
                        "(StepPacer, as the engine's --itl-target-ms)")
    args = p.parse_args(argv)
    use_torch_threads(1)
    opts = ModelOptions(threads=1)
    model = load_model(opts, decode_neuron_config(opts, 16, tkg.BLOCKS, tkg.BLOCK,
                                                  prefill_chunk_tokens=PIECE))
    lengths = [args.length] * args.rows
    with torch.no_grad():
        for _ in range(3):
            tkg.step(model, lengths)
            model.forward(**piece_args(0))
    report("decode alone", decode_for(model, lengths, args.seconds), 0, args.seconds)
    for nice in [None, *map(parse_nice, args.nice)]:
        stop, pieces = threading.Event(), []
        thread = threading.Thread(target=prefill_loop, args=(model, nice, stop, pieces))
        thread.start()
        if nice is None:
            time.sleep(args.seconds)
            times = [], [], []
        else:
            times = decode_for(model, lengths, args.seconds, args.pace_ms / 1e3)
        stop.set()
        thread.join()
        report("prefill alone" if nice is None else f"both, nice {nice}", times, len(pieces),
               args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
