"""Per-request stall breakdown from an `nxdi-bench` records.json (one rate point's requests):
for every request its TTFT, TPOT, whether it met the SLO, its median inter-token gap at or under
--stall-s (the decode step it saw), and the gaps over --stall-s (stalls: prefill work between two
of its tokens): how many, their sum and the largest. Then each configuration's attainment.

    python bench/records_stalls.py results/goodput/<run>/records.json [--slo-ttft 4] [--slo-tpot 0.1]
"""
from __future__ import annotations

import argparse
import json
import statistics


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("records")
    p.add_argument("--slo-ttft", type=float, default=4.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--stall-s", type=float, default=0.08)
    args = p.parse_args(argv)
    with open(args.records) as f:
        records = json.load(f)
    for config, requests in records.items():
        print(f"== {config}")
        met = []
        for r in sorted(requests, key=lambda r: r["due_s"]):
            times = r["token_times"]
            if not times:
                print(f"{r['index']:3d} no tokens: {r['error']}")
                met.append(False)
                continue
            ttft = times[0] - r["sent_s"]
            gaps = [b - a for a, b in zip(times, times[1:])]
            tpot = (times[-1] - times[0]) / max(len(times) - 1, 1)
            stalls = [g for g in gaps if g > args.stall_s]
            steps = [g for g in gaps if g <= args.stall_s]
            ok = ttft <= args.slo_ttft and tpot <= args.slo_tpot
            met.append(ok)
            print(f"{r['index']:3d} {r['kind']:5s} due {r['due_s']:6.1f} s, prompt "
                  f"{r['prompt_tokens']:5d}, out {len(times):4d}: TTFT {ttft:5.2f} s, TPOT "
                  f"{tpot * 1e3:6.1f} ms {'met   ' if ok else 'missed'} step "
                  f"{statistics.median(steps) * 1e3 if steps else 0:5.1f} ms, {len(stalls):2d} "
                  f"stalls, {sum(stalls):5.2f} s in all, longest {max(stalls, default=0):4.2f} s")
        print(f"{config}: attainment {sum(met) / len(met):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
