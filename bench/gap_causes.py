"""Which decode steps made a run's long inter-token gaps: an `nxdi-bench compare` run of the
disaggregated configuration with `--decode-log-steps` (its decode worker's step lines are in
logs/disaggregated.log) and its records.json (`--cdf-rate R`: the requests of rate R). Each gap
over --over-ms between two tokens of a stream is put down to

- paced: the step that made the later token followed a paced pause (local prefill time) and
  the two steps' ends were that far apart;
- slow step: no pause, the steps' ends that far apart;
- delivery: the steps' ends were not that far apart, the tokens reached the client later;
- unmatched: a token far from the step it would come from (long_gaps).

The client's clock (perf_counter from the run's start) is put on the wall clock by the router's
request lines (logged as a request ends, ms resolution), then shifted so that tokens sit on
their nearest step ends. Also: the step times by rows, and how many slow steps of one or two
rows came while some request waited for its first token (the prefill worker busy, or a KV
transfer on its way).

    python bench/gap_causes.py results/goodput/<run> [--over-ms 21.3] [--slow-ms 17] [--list 40]
"""
from __future__ import annotations

import argparse
import bisect
import datetime
import json
import re
import statistics
from collections import Counter
from pathlib import Path

STEP = re.compile(r"step end=([\d.]+) seconds=([\d.]+) rows=(\d+) calls=(\d+) "
                  r"paused=([\d.]+) local=(\d+)")
UNMATCHED_S = 0.05  # a token this far from the end of the step it is put on: not matched
REQUEST = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) .*router\.requests: .* "
                     r"prompt=(\d+) cached=\d+ output=(\d+) ")


def wall(stamp: str) -> float:
    """A log line's "YYYY-MM-DD HH:MM:SS,mmm" (UTC) as Unix seconds."""
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").replace(
        tzinfo=datetime.timezone.utc).timestamp()


def load(run: Path) -> tuple[list[dict], list[tuple], dict]:
    """The disaggregated records, the step lines (end, seconds, rows, calls, paused, local)
    and the router's end times by (prompt tokens, output tokens)."""
    records = json.loads((run / "records.json").read_text()).get("disaggregated")
    if records is None:
        raise SystemExit(f"{run}: records.json has no disaggregated run (the configuration did "
                         f"not run at --cdf-rate, or was not among --configs)")
    steps, ends = [], {}
    for line in (run / "logs" / "disaggregated.log").read_text().splitlines():
        if m := STEP.search(line):
            steps.append(tuple(float(x) for x in m.groups()))
        elif m := REQUEST.search(line):
            ends.setdefault((int(m[2]), int(m[3])), []).append(wall(m[1]))
    if not steps:
        raise SystemExit(f"{run}: no step lines (run the decode worker with --log-steps: "
                         f"nxdi-bench compare --decode-log-steps)")
    return records, sorted(steps), ends


def clock_offset(records, step_ends, router_ends) -> float:
    """Seconds to add to a record's times to put them on the wall clock of the step lines."""
    offsets = [router_ends[key][-1] - r["token_times"][-1] for r in records
               if r["token_times"] and (key := (r["prompt_tokens"], r["output_tokens"]
                                                or len(r["token_times"]))) in router_ends]
    if not offsets:
        raise SystemExit("no request of records.json matches a router request line")
    offset = statistics.median(offsets)
    for _ in range(3):  # tokens onto their nearest step ends
        offset -= statistics.median(t + offset - nearest(step_ends, t + offset)
                                    for r in records for t in r["token_times"][1:])
    return offset


def nearest(ends: list[float], t: float) -> float:
    i = bisect.bisect_left(ends, t)
    return min((ends[j] for j in (i - 1, i) if 0 <= j < len(ends)), key=lambda e: abs(t - e))


def stream_steps(records, ends: list[float], offset: float):
    """Each record's token times on the steps' clock and, per token, the index of the step it
    came from (None for the first): a running stream gets a token from every step, so its
    tokens are put on consecutive steps, from the offset between token and step numbers most
    of its tokens agree on (a token late by more than half a step is nearest the next step's
    end, and would be put down to it alone)."""
    index = {e: i for i, e in enumerate(ends)}
    for r in records:
        times = [t + offset for t in r["token_times"]]
        if len(times) < 2:
            continue
        shift = Counter(index[nearest(ends, t)] - k for k, t in enumerate(times)
                        if k).most_common(1)[0][0]
        yield r, times, [None] + [min(max(shift + k, 0), len(ends) - 1)
                                  for k in range(1, len(times))]


def long_gaps(records, steps, offset: float, over: float) -> tuple[int, list[tuple]]:
    """How many gaps there are, and each gap over ``over`` seconds as (its end on the client's
    clock, the gap, how far apart the ends of the steps that made its two tokens were, the
    later step's seconds, its pause, rows and local prompts waiting, the cause); tokens on
    their steps as stream_steps puts them. A token more than UNMATCHED_S from its step's end
    (the stream preempted, say) is "unmatched"."""
    ends = [s[0] for s in steps]
    found, total = [], 0
    for _, times, made_by in stream_steps(records, ends, offset):
        for k in range(1, len(times)):
            total += 1
            a, b = times[k - 1], times[k]
            if b - a <= over:
                continue
            i0, i1 = max(made_by[k] - 1, 0), made_by[k]
            _, seconds, rows, _, paused, local = steps[i1]
            apart = ends[i1] - ends[i0]
            if abs(b - ends[i1]) > UNMATCHED_S or i1 == i0:
                cause = "unmatched"
            elif apart <= over:
                cause = "delivery"
            else:
                cause = "paced" if paused > 0.001 else "slow step"
            found.append((b - offset, b - a, apart, seconds, paused, int(rows), int(local), cause))
    return total, found


def waited_at(records, offset: float):
    """A predicate on the steps' clock: did some request wait for its first token then?"""
    spans = sorted((r["due_s"] + offset, r["token_times"][0] + offset)
                   for r in records if r["token_times"])
    starts = [a for a, _ in spans]
    longest = max((b - a for a, b in spans), default=0.0)

    def waiting(t: float) -> bool:
        i = bisect.bisect_right(starts, t)
        j = bisect.bisect_left(starts, t - longest)
        return any(b >= t for _, b in spans[j:i])
    return waiting


def print_delivery(records, steps, offset: float) -> None:
    """How late tokens reached the client after their steps ended, beyond the median (the clock
    offset puts the median near 0): all of them, those of steps while some request waited for
    its first token (the prefill worker's core busy, with the router and client on it where
    they are pinned there), and the others."""
    ends = [s[0] for s in steps]
    waiting = waited_at(records, offset)
    late: dict[str, list[float]] = {"all": [], "waiting": [], "not waiting": []}
    for _, times, made_by in stream_steps(records, ends, offset):
        for k in range(1, len(times)):
            i = made_by[k]
            if abs(times[k] - ends[i]) <= UNMATCHED_S:
                x = times[k] - ends[i]
                late["all"].append(x)
                late["waiting" if waiting(ends[i]) else "not waiting"].append(x)
    median = statistics.median(late["all"]) if late["all"] else 0.0
    for name, xs in late.items():
        if len(xs) < 2:
            continue
        q = statistics.quantiles([x - median for x in xs], n=100)
        over = sum(x - median > 0.002 for x in xs) / len(xs)
        print(f"delivery after the step's end, {name}: {len(xs)} tokens, p90 {q[89] * 1e3:+.1f} "
              f"ms, p99 {q[98] * 1e3:+.1f} (from the median); over 2 ms late {over:.1%}")


def print_steps(records, steps, offset: float, slow_ms: float) -> None:
    """Step times by rows, and the slow 1-2-row steps that came while a request waited for its
    first token."""
    by_rows: dict[int, list[float]] = {}
    for s in steps:
        by_rows.setdefault(int(s[2]), []).append(s[1])
    for rows, seconds in sorted(by_rows.items()):
        q = statistics.quantiles(seconds, n=100) if len(seconds) > 1 else seconds * 99
        print(f"steps of {rows} rows: {len(seconds)}, p50 {q[49] * 1e3:.1f} ms, p90 "
              f"{q[89] * 1e3:.1f}, p99 {q[98] * 1e3:.1f}")
    waiting = waited_at(records, offset)
    small = [s for s in steps if s[2] <= 2]
    slow = [s for s in small if s[1] > slow_ms / 1e3]
    during = [s for s in slow if waiting(s[0])]
    share = sum(waiting(s[0]) for s in small) / max(len(small), 1)
    print(f"steps of 1-2 rows over {slow_ms} ms: {len(slow)} of {len(small)}; "
          f"{len(during)} while a request waited for its first token ({share:.0%} of all such "
          f"steps were)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path, help="the compare run's --out-dir")
    p.add_argument("--over-ms", type=float, default=21.3, help="a long gap: over this")
    p.add_argument("--slow-ms", type=float, default=17.0, help="a slow step of 1-2 rows")
    p.add_argument("--list", type=int, default=0, help="print the first N long gaps")
    args = p.parse_args(argv)
    records, steps, router_ends = load(args.run)
    offset = clock_offset(records, [s[0] for s in steps], router_ends)
    total, found = long_gaps(records, steps, offset, args.over_ms / 1e3)
    causes = Counter(g[-1] for g in found)
    print(f"{total} gaps, {len(found)} over {args.over_ms} ms ({len(found) / max(total, 1):.2%}): "
          + ", ".join(f"{c} {n}" for c, n in causes.most_common()))
    for t, gap, apart, seconds, paused, rows, local, cause in found[:args.list]:
        print(f"  {t:8.2f} s gap {gap * 1e3:5.1f} ms, step ends {apart * 1e3:5.1f} apart, step "
              f"{seconds * 1e3:5.1f} ms, paused {paused * 1e3:4.1f}, rows {rows}, local {local}: "
              f"{cause}")
    print_steps(records, steps, offset, args.slow_ms)
    print_delivery(records, steps, offset)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
