"""The comparison's outputs: a Markdown table and PNG plots, from the results dictionary that
``compare`` writes as JSON (so a saved run can be re-plotted or compared with a later one)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from nxdi_bench.peers import format_cpu_list

__all__ = ["markdown_table", "write_plots"]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def _point_at(sweep: dict, rate: float | None) -> dict | None:
    for p in sweep.get("points", []):
        if rate is not None and abs(p["rate"] - rate) < 1e-9:
            return p["summary"]
    return None


def markdown_table(results: dict) -> str:
    """The headline table: goodput per configuration, latencies unloaded and at the goodput rate."""
    meta = results["meta"]
    baseline = results["configs"].get("aggregated", {}).get("sweep", {}).get("goodput")
    rows = ["| configuration | goodput (req/s) | vs aggregated | p50 TTFT at goodput (ms) | "
            "p99 TTFT at goodput (ms) | p50 TPOT at goodput (ms) | p99 ITL at goodput (ms) | "
            "p99 ITL unloaded (ms) | p99 ITL loaded/unloaded | output tok/s at goodput |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in results["configs"].items():
        if res.get("status") != "ok":
            rows.append(f"| {name} | not run: {res.get('error', '?')[:160]} | | | | | | | | |")
            continue
        sweep = res["sweep"]
        good = sweep["goodput"]
        at = _point_at(sweep, good)
        unl = res["unloaded"]
        ratio = f"{good / baseline:.2f}x" if baseline else "-"
        itl_u = unl["itl_s"]["p99"]
        itl_l = at["itl_s"]["p99"] if at else None
        loaded = f"{itl_l / itl_u:.2f}x" if itl_l and itl_u else "-"
        tput = f"{at['output_token_throughput']:.1f}" if at else "-"
        rows.append(
            f"| {name} | {good:.3g} | {ratio} | {_ms(at and at['ttft_s']['p50'])} | "
            f"{_ms(at and at['ttft_s']['p99'])} | {_ms(at and at['tpot_s']['p50'])} | "
            f"{_ms(itl_l)} | {_ms(itl_u)} | {loaded} | {tput} |")
    slo = meta["slo"]
    head = (f"Workload `{meta['workload']}`, SLO: TTFT <= {slo['ttft_s']} s and TPOT <= "
            f"{slo['tpot_s'] * 1000:.0f} ms for >= {_pct(slo['attainment'])} of requests.")
    return head + "\n" + placement(meta) + "\n\n" + "\n".join(rows) + "\n"


def _cpus(cpus: list[int] | None) -> str:
    """ "on CPU 0" / "on CPUs 0-1" (the kernel's notation), or "not pinned" (None or empty)."""
    if not cpus:
        return "not pinned"
    return f"on CPU{'s' if len(cpus) > 1 else ''} {format_cpu_list(cpus)}"


def placement(meta: dict) -> str:
    """Where the run put its processes: the configurations' cores, our router's, and the load
    generator's. It belongs beside the figures: the client's placement alone moved a peer's
    goodput 2.7x (BENCHMARKS.md issue 4, session 74)."""
    serve = meta.get("serve", {})
    return (f"Served {_cpus(serve.get('cpus'))} (disaggregated: the prefill worker on the first, "
            f"the decode worker on the last); our router {_cpus(serve.get('router_cpus'))}; "
            f"the load generator {_cpus(meta.get('client_cpus'))} (alike for every "
            f"configuration).")


def _cdf(ax, values: list[float], label: str) -> None:
    v = np.sort(np.asarray(values, dtype=np.float64)) * 1000
    if v.size:
        ax.plot(v, np.arange(1, v.size + 1) / v.size, label=label, drawstyle="steps-post")


def _finish(fig, axes, path: Path) -> Path:
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter
    for ax in axes:
        lo, hi = ax.get_xlim()
        wide = lo > 0 and hi / lo > 1000  # label 1-2-5 per decade unless that crowds the axis
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0,) if wide else (1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _latency_figure(plt, ok: dict, path: Path) -> Path:
    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in ok.items():
        cdf = res.get("cdf", {})
        _cdf(ax_ttft, cdf.get("ttft_s", []), f"{name} ({cdf.get('label', '')})")
        _cdf(ax_itl, cdf.get("itl_s", []), name)
    ax_ttft.set(title="Time to first token", xlabel="ms", ylabel="fraction of requests",
                xscale="log")
    ax_itl.set(title="Inter-token latency", xlabel="ms", ylabel="fraction of gaps", xscale="log")
    try:
        return _finish(fig, (ax_ttft, ax_itl), path)
    finally:
        plt.close(fig)


def _goodput_figure(plt, ok: dict, slo: dict, path: Path) -> Path:
    fig, (ax_att, ax_good) = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in ok.items():
        pts = sorted(res["sweep"]["points"], key=lambda p: p["rate"])
        rates = [p["rate"] for p in pts]
        ax_att.plot(rates, [p["summary"]["slo_attainment"] for p in pts], "o-", label=name)
        ax_good.plot(rates, [p["summary"]["good_request_rate"] for p in pts], "o-",
                     label=f"{name}: goodput {res['sweep']['goodput']:.3g} req/s")
    ax_att.axhline(slo["attainment"], color="gray", linestyle="--", linewidth=1)
    ax_att.set(title="SLO attainment", xlabel="offered rate (req/s)", ylabel="fraction meeting SLO",
               xscale="log", ylim=(0, 1.05))
    ax_good.set(title="Requests meeting the SLO per second", xlabel="offered rate (req/s)",
                ylabel="req/s", xscale="log")
    try:
        return _finish(fig, (ax_att, ax_good), path)
    finally:
        plt.close(fig)


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    """latency_cdfs.png (TTFT and ITL CDFs at a common rate) and goodput.png (SLO attainment and
    good requests/s against the offered rate)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out_dir = Path(out_dir)
    ok = {n: r for n, r in results["configs"].items() if r.get("status") == "ok"}
    return [_latency_figure(plt, ok, out_dir / "latency_cdfs.png"),
            _goodput_figure(plt, ok, results["meta"]["slo"], out_dir / "goodput.png")]
