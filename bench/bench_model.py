"""Model benchmark (issue: nxdi_common performance): nxdi_common vs transformers' generate() on the
same checkpoint, same dtype, same threads, in one run. Prints a Markdown table and writes JSON.

    .venv/bin/python bench/bench_model.py --dtype bfloat16 --int8 --out results/bench_model.json
    .venv/bin/python bench/bench_model.py --kv-layout block ...   # as the decode workers run

--kv-layout block: the block KV cache (16-token blocks, contiguous per row) with the paged
attention kernel where it builds (cpu_attention_kernel "auto"), instead of the flat per-row cache
whose decode attention is SDPA over the whole 640-token bucket.

Figures: prefill tokens/s for a 512-token prompt; decode tokens/s at batch 1 and aggregate at batch
16 (128 new tokens); the memory-bandwidth bound (weight bytes / measured read bandwidth); peak
resident memory while loading (measured in a fresh process). The decode figures and the read
bandwidth come from --rounds rounds of (probe, batch 1, batch 16, probe), each round's batch 1
set against the bound from its own probes and its batch 16 against its own batch 1
(speed_figures)."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

PROMPT_LEN, NEW_TOKENS, BIG_BATCH = 512, 128, 16
BLOCK_SIZE = 16


def read_bandwidth_gbs(size_mib: int = 1024, repeats: int = 7) -> float:
    """Median GB/s of summing a freshly written float32 tensor far larger than the caches."""
    t = torch.rand(size_mib * 1024 * 1024 // 4)
    t.sum()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        t.sum()
        runs.append(t.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return statistics.median(runs)


def weight_bytes(model_dir: str, dtype: torch.dtype) -> int:
    """Bytes of distinct weights read per decode step (tied embeddings counted once)."""
    from safetensors import safe_open
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        numel = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
    return numel * torch.finfo(dtype).bits // 8


def kv_bytes_per_row(model_dir: str, dtype: torch.dtype, kv_layout: str) -> int:
    """Bytes of K and V one row's decode step reads on average over the NEW_TOKENS steps: the
    block layout's kernel reads each row's positions up to its own (512..639, 576 on average),
    the flat layout's SDPA the whole 640-position bucket."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    positions = (PROMPT_LEN + (NEW_TOKENS + 1) / 2 if kv_layout == "block"
                 else PROMPT_LEN + NEW_TOKENS)
    per_position = cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    return int(per_position * positions)


def read_bound_shares(gbs: float, weights: int, kv_per_row: int, rates: dict) -> dict:
    """{"b<B>_share_of_read_bound": tokens/s over the bound of the bytes a step of batch B reads
    (weights + B rows' KV) at gbs} for each batch B -> tokens/s in rates."""
    return {f"b{batch}_share_of_read_bound":
            rate / (batch * gbs * 1e9 / (weights + batch * kv_per_row))
            for batch, rate in rates.items()}


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _median_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_ours(model_dir: str, dtype, batch: int, compiled_root: Path, int8: bool = False,
               kv_layout: str = "flat", weight_layout: str = "auto", sampling: str = "device"):
    """Compiled and loaded; with int8, weights quantized per channel (written once). sampling
    "device": greedy on-device sampling (the graph returns the argmax token, as NxD Inference and
    our workers run); "host": the graph returns logits and the caller takes the argmax."""
    from nxdi_common.config import NeuronConfig, OnDeviceSamplingConfig
    from nxdi_common.models.llama import NeuronLlamaForCausalLM
    quant = dict(quantized=True, quantization_type="per_channel_symmetric",
                 quantized_checkpoints_path=str(compiled_root / "int8-per-channel")) if int8 else {}
    layout = {}
    if kv_layout == "block":
        blocks_per_row = -(-(PROMPT_LEN + NEW_TOKENS) // BLOCK_SIZE)
        layout = dict(is_block_kv_layout=True, pa_block_size=BLOCK_SIZE,
                      pa_num_blocks=batch * blocks_per_row, cpu_attention_kernel="auto")
    nc = NeuronConfig(batch_size=batch, seq_len=PROMPT_LEN + NEW_TOKENS, torch_dtype=dtype,
                      enable_bucketing=True, context_encoding_buckets=[PROMPT_LEN],
                      token_generation_buckets=[PROMPT_LEN + NEW_TOKENS], backend="cpu",
                      fused_qkv=True, cpu_weight_layout=weight_layout, **quant, **layout,
                      on_device_sampling_config=(OnDeviceSamplingConfig(do_sample=False)
                                                 if sampling == "device" else None))
    model = NeuronLlamaForCausalLM(model_dir, neuron_config=nc)
    if int8 and not Path(quant["quantized_checkpoints_path"]).is_dir():
        NeuronLlamaForCausalLM.save_quantized_state_dict(model_dir, model.config)
    path = compiled_root / (f"b{batch}-{str(dtype).split('.')[-1]}{'-int8' if int8 else ''}"
                            f"{'-block' if kv_layout == 'block' else ''}"
                            f"{'' if weight_layout == 'auto' else '-' + weight_layout}"
                            f"{'-ods' if sampling == 'device' else ''}")
    model.compile(str(path))
    model.load(str(path))
    return model, path


def ours_decode(model, batch: int, repeats: int = 3) -> float:
    """Aggregate decode tokens/s over NEW_TOKENS steps after a PROMPT_LEN prefill: the median of
    `repeats` runs (one run moved by 10-20% between back-to-back invocations on the Zen 4 VM)."""
    ids = torch.randint(100, 20000, (batch, PROMPT_LEN))
    rates = []
    for _ in range(repeats):
        model.reset()
        nxt = next_tokens(model(ids))
        start = time.perf_counter()
        for _ in range(NEW_TOKENS):
            nxt = next_tokens(model(nxt[:, None]))
        rates.append(batch * NEW_TOKENS / (time.perf_counter() - start))
    return statistics.median(rates)


def next_tokens(out) -> torch.Tensor:
    """[B]: the tokens sampled on device, else the argmax of the returned logits."""
    return out.tokens if out.tokens is not None else out.logits.argmax(-1)


def ours_prefill(model) -> float:
    ids = torch.randint(100, 20000, (1, PROMPT_LEN))

    def run():
        model.reset()
        model(ids)
    run()
    return PROMPT_LEN / _median_time(run)


def hf_figures(model_dir: str, dtype) -> dict:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    out = {}
    with torch.no_grad():
        ids = torch.randint(100, 20000, (1, PROMPT_LEN))
        hf(ids)
        out["prefill_tok_s"] = PROMPT_LEN / _median_time(lambda: hf(ids))
        for batch in (1, BIG_BATCH):
            ids = torch.randint(100, 20000, (batch, PROMPT_LEN))
            gen = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
            t1 = _median_time(lambda: hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **gen), 2)
            tn = _median_time(lambda: hf.generate(ids, max_new_tokens=NEW_TOKENS + 1,
                                                  min_new_tokens=NEW_TOKENS + 1, **gen), 1)
            out[f"decode_b{batch}_tok_s"] = batch * NEW_TOKENS / (tn - t1)
    return out


LOAD_PROBE = """
import resource, sys, torch
from nxdi_common.config import InferenceConfig
from nxdi_common.models.llama import NeuronLlamaForCausalLM
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
model_dir, compiled = sys.argv[1], sys.argv[2]
cfg = InferenceConfig.load(compiled)
cfg.neuron_config.skip_warmup = True
model = NeuronLlamaForCausalLM(model_dir, neuron_config=cfg.neuron_config)
base = rss()
model.load(compiled)
loaded = rss()
model.warmup()
print(base, loaded, rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
      model.kv_cache.numel() * model.kv_cache.element_size())
"""


def load_memory(model_dir: str, compiled: Path) -> dict:
    """Resident memory added by load() (weights memory-mapped, graphs, KV cache), and after one
    warm-up pass over every bucket (weights fully paged in, allocator and oneDNN buffers), measured
    in a fresh process."""
    out = subprocess.run([sys.executable, "-c", LOAD_PROBE, model_dir, str(compiled)],
                         capture_output=True, text=True, check=True).stdout.split()
    base, loaded, warm, peak, kv = map(int, out[-5:])
    return {"load_rss_growth_bytes": loaded - base, "warm_rss_growth_bytes": warm - base,
            "process_peak_rss_bytes": peak, "kv_cache_bytes": kv}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", help="checkpoint dir (default: bundled SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="results/bench_model.json")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--kv-layout", choices=("flat", "block"), default="flat",
                   help="our KV cache: flat rows, or blocks with the paged attention kernel")
    p.add_argument("--weight-layout", choices=("auto", "onednn", "panels", "plain"),
                   default="auto", help="NeuronConfig.cpu_weight_layout of our model")
    p.add_argument("--sampling", choices=("device", "host"), default="device",
                   help="greedy next token: on-device sampling in our graph (NxD Inference's way, "
                        "and our workers'), or argmax of the returned logits on the host")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of (read probe, batch 1, batch 16, read probe) for the decode "
                        "figures (speed_figures)")
    p.add_argument("--int8", action="store_true",
                   help="also measure int8 weights (per-channel, torch's weight-only int8 kernel)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from nxdi_common.runtime import keep_large_buffers_in_heap
    keep_large_buffers_in_heap()  # as the workers run (nxdi_common/runtime.py)
    from nxdi_common.bundled import prepare_bundled_model
    model_dir = args.model or str(prepare_bundled_model())
    dtype = getattr(torch, args.dtype)
    compiled_root = Path(args.out).parent / "compiled"
    res = {"dtype": args.dtype, "threads": args.threads, "torch": torch.__version__,
           "kv_layout": args.kv_layout, "weight_layout": args.weight_layout,
           "sampling": args.sampling}
    res["weight_bytes"] = weight_bytes(model_dir, dtype)
    res["kv_bytes_per_row"] = kv_bytes_per_row(model_dir, dtype, args.kv_layout)
    ours, path1 = speed_figures(model_dir, dtype, compiled_root, kv_layout=args.kv_layout,
                                weight_layout=args.weight_layout, sampling=args.sampling,
                                rounds=args.rounds, weights=res["weight_bytes"],
                                kv_per_row=res["kv_bytes_per_row"])
    res["read_bandwidth_gbs"] = ours.pop("read_bandwidth_gbs")  # the rounds' median
    res["bound_tok_s"] = res["read_bandwidth_gbs"] * 1e9 / res["weight_bytes"]
    ours.update(load_memory(model_dir, path1))
    res["nxdi"] = ours
    if args.int8:
        res["nxdi_int8"] = speed_figures(model_dir, dtype, compiled_root, int8=True,
                                         kv_layout=args.kv_layout,
                                         weight_layout=args.weight_layout,
                                         sampling=args.sampling, rounds=args.rounds)[0]
    if not args.skip_hf:
        res["transformers"] = hf_figures(model_dir, dtype)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return 0


def speed_figures(model_dir: str, dtype, compiled_root: Path, int8: bool = False,
                  kv_layout: str = "flat", weight_layout: str = "auto", sampling: str = "device",
                  rounds: int = 5, weights: int | None = None, kv_per_row: int = 0):
    """(prefill and decode tokens/s, the batch-1 compiled folder) of our model.

    The decode figures come from `rounds` rounds of: read probe, batch 1, batch 16, read probe.
    On a VM whose read bandwidth moves 30-56 GB/s within the hour (BENCHMARKS.md, session 28) a
    probe taken minutes before the decode runs, and batch 1 and batch 16 taken minutes apart,
    compared different machine states; each round's shares (batch 1 against the bound from its
    own two probes, batch 16 against its own batch 1) compare one. The figures are the medians
    over the rounds, each round's kept in "rounds". With `kv_per_row`, each batch is also set
    against the bound of all the bytes its steps read (the weights and its rows' KV), which at
    batch 16 are the weights plus 16 rows' caches: the ratio batch 16 / batch 1 can reach
    16 (weights + KV of 1) / (weights + KV of 16) at equal shares of those bounds."""
    one, path1 = build_ours(model_dir, dtype, 1, compiled_root, int8, kv_layout, weight_layout,
                            sampling)
    out = {"prefill_tok_s": ours_prefill(one)}
    big, _ = build_ours(model_dir, dtype, BIG_BATCH, compiled_root, int8, kv_layout,
                        weight_layout, sampling)
    out["rounds"] = []
    for i in range(rounds):
        before = read_bandwidth_gbs()
        b1, b16 = ours_decode(one, 1), ours_decode(big, BIG_BATCH)
        gbs = (before + read_bandwidth_gbs()) / 2
        row = {"read_bandwidth_gbs": gbs, "decode_b1_tok_s": b1,
               f"decode_b{BIG_BATCH}_tok_s": b16, f"b{BIG_BATCH}_over_b1": b16 / b1}
        if weights:
            row["b1_share_of_bound"] = b1 / (gbs * 1e9 / weights)
        if weights and kv_per_row:
            row.update(read_bound_shares(gbs, weights, kv_per_row, {1: b1, BIG_BATCH: b16}))
        out["rounds"].append(row)
        print(f"round {i + 1}/{rounds}: read {gbs:.1f} GB/s, batch 1 {b1:.1f} tok/s"
              + (f" ({row['b1_share_of_bound']:.0%} of its bound)" if weights else "")
              + f", batch {BIG_BATCH} {b16:.1f} tok/s ({b16 / b1:.1f}x)", flush=True)
    for key in out["rounds"][0]:
        out[key] = statistics.median(r[key] for r in out["rounds"])
    return out, path1


def markdown(res: dict) -> str:
    ours, hf, int8 = res["nxdi"], res.get("transformers", {}), res.get("nxdi_int8")
    rows = [("prefill 512 tok (tok/s)", "prefill_tok_s"), ("decode batch 1 (tok/s)", "decode_b1_tok_s"),
            (f"decode batch {BIG_BATCH} aggregate (tok/s)", f"decode_b{BIG_BATCH}_tok_s")]
    lines = ["| figure | nxdi_common | transformers | ratio |", "|---|---|---|---|"]
    if int8:
        lines = ["| figure | nxdi_common | transformers | ratio | nxdi_common int8 | int8 ratio |",
                 "|---|---|---|---|---|---|"]
    for label, key in rows:
        h = hf.get(key)
        line = (f"| {label} | {ours[key]:.1f} | {h:.1f} | {ours[key] / h:.2f}x |" if h else
                f"| {label} | {ours[key]:.1f} | - | - |")
        if int8:
            line += f" {int8[key]:.1f} | {int8[key] / h:.2f}x |" if h else f" {int8[key]:.1f} | - |"
        lines.append(line)
    rounds = ours.get("rounds", [])
    share = [r["b1_share_of_bound"] for r in rounds if "b1_share_of_bound" in r]
    ratio = [r[f"b{BIG_BATCH}_over_b1"] for r in rounds]
    lines.append(f"\nour KV layout: {res.get('kv_layout', 'flat')}; weight layout "
                 f"{res.get('weight_layout', 'auto')}; "
                 f"read bandwidth {res['read_bandwidth_gbs']:.1f} GB/s (median of {len(rounds)} "
                 f"rounds); weights {res['weight_bytes'] / 1e6:.0f} MB; bound "
                 f"{res['bound_tok_s']:.1f} tok/s")
    if share:
        lines.append(f"batch-1 decode against its round's bound: median "
                     f"{ours['b1_share_of_bound']:.0%} (rounds "
                     f"{', '.join(f'{x:.0%}' for x in share)})")
    if ratio:
        lines.append(f"batch-{BIG_BATCH} / batch-1 in the same round: median "
                     f"{ours[f'b{BIG_BATCH}_over_b1']:.1f}x (rounds "
                     f"{', '.join(f'{x:.1f}x' for x in ratio)})")
    kv = res.get("kv_bytes_per_row")
    big_share = f"b{BIG_BATCH}_share_of_read_bound"
    if kv and rounds and big_share in rounds[0]:
        w = res["weight_bytes"]
        lines.append(f"against all the bytes a step reads (weights + {kv / 1e6:.1f} MB of KV a "
                     f"row): batch 1 median {ours['b1_share_of_read_bound']:.0%}, batch "
                     f"{BIG_BATCH} median {ours[big_share]:.0%} (rounds "
                     f"{', '.join(f'{r[big_share]:.0%}' for r in rounds)}); at equal shares "
                     f"batch {BIG_BATCH} / batch 1 would be "
                     f"{BIG_BATCH * (w + kv) / (w + BIG_BATCH * kv):.1f}x")
    lines.append(f"memory: load() adds {ours['load_rss_growth_bytes'] / 1e6:.0f} MB resident, "
                 f"{ours['warm_rss_growth_bytes'] / 1e6:.0f} MB after warm-up (weights "
                 f"{res['weight_bytes'] / 1e6:.0f} MB + KV {ours['kv_cache_bytes'] / 1e6:.0f} MB)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
