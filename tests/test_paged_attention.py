"""The paged decode attention kernel (nxdi_common/kernels): equal to gather + SDPA over the block
table, reads nothing past a row's own position or outside its blocks, refuses out-of-range block
ids and positions, and is chosen, recorded and loaded with compiled graphs as configured."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from nxdi_common import kernels
from nxdi_common.application_base import MANIFEST
from nxdi_common.config import NeuronConfig
from nxdi_common.models.llama.modeling_llama import NeuronLlamaForCausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 4  # block size of the synthetic caches


@pytest.fixture(scope="module")
def op():
    return kernels.paged_attention()


def reference(q, k_cache, v_cache, table, pos, scale=None):
    """Gather each row's blocks into [B, Hkv, W * block size, D] and run SDPA with position
    masking."""
    b, h, s, d = q.shape
    length = table.shape[1] * k_cache.shape[1]
    k = k_cache[table.reshape(-1)].view(b, length, -1, d).transpose(1, 2).to(q.dtype)
    v = v_cache[table.reshape(-1)].view(b, length, -1, d).transpose(1, 2).to(q.dtype)
    allowed = torch.arange(length).view(1, 1, 1, length) <= pos.view(b, 1, s, 1)
    mask = torch.where(allowed, 0.0, float("-inf")).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)


def poisoned(k, v, table, pos):
    """Copies of the caches with NaN everywhere a row must not read: past its last position in
    its blocks, and in every block outside the table."""
    block_size = k.shape[1]
    poisoned_k, poisoned_v = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    for row in range(table.shape[0]):
        for p in range(int(pos[row].max()) + 1):
            block, off = int(table[row, p // block_size]), p % block_size
            poisoned_k[block, off], poisoned_v[block, off] = k[block, off], v[block, off]
    return poisoned_k, poisoned_v


def case(seed, dtype=torch.float32, kv_dtype=None, heads=6, kv_heads=2, queries=1, dim=16,
         width=6, num_blocks=40, positions=(0, 3, 4, 13, 23), block_size=BS):
    """q, caches, a shuffled block table (distinct blocks per row) and positions [B, queries]
    (each row's queries are consecutive positions ending at the given one)."""
    g = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    b = len(positions)
    k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(kv_dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(kv_dtype)
    q = torch.randn(b, heads, queries, dim, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[:b * width].view(b, width)
    last = torch.tensor(positions).view(b, 1)
    pos = (last - queries + 1 + torch.arange(queries)).clamp(min=0)
    return q, k, v, table, pos


@pytest.mark.parametrize("dtype,kv_dtype,tol", [
    (torch.float32, None, 2e-6), (torch.bfloat16, None, 2e-2), (torch.float16, None, 2e-3),
    (torch.bfloat16, torch.float8_e4m3fn, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (3, 1)])
@pytest.mark.parametrize("queries", [1, 3])
@pytest.mark.parametrize("dim", [24, 64])  # 64: the AVX-512 path where the CPU has it; 24: portable
def test_equals_gather_and_sdpa(op, dtype, kv_dtype, tol, heads, kv_heads, queries, dim):
    q, k, v, table, pos = case(1, dtype, kv_dtype, heads, kv_heads, queries, dim)
    out = op(q, k, v, table, pos, q.shape[-1] ** -0.5)
    ref = reference(q, k, v, table, pos)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.float() - ref.float()).abs().max() <= tol


# The decode worker's case (bf16, 9 query heads on 3 KV heads) at every AVX-512 head size it may
# meet, with block sizes below, at and above 16 and positions at and around block edges; and 12
# query heads on one KV head (with 3 queries each, 36 queries share every V row: the bf16 path
# accumulates them 4 at a time).
@pytest.mark.parametrize("block_size", [4, 16, 40])
@pytest.mark.parametrize("dim", [64, 96, 128])
@pytest.mark.parametrize("queries", [1, 3])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (12, 1)])
def test_bf16_block_sizes_equal_gather_and_sdpa(op, block_size, dim, queries, heads, kv_heads):
    width = 160 // block_size + 1
    q, k, v, table, pos = case(7, torch.bfloat16, heads=heads, kv_heads=kv_heads, queries=queries,
                               dim=dim, width=width, num_blocks=8 * width + 4,
                               positions=(0, 15, 16, 17, 31, 47, 100, 159), block_size=block_size)
    out = op(q, k, v, table, pos, dim ** -0.5)
    ref = reference(q, k, v, table, pos)
    assert (out.float() - ref.float()).abs().max() <= 2e-2


@pytest.mark.parametrize("dtype,dim,block_size", [
    (torch.float32, 24, BS), (torch.float32, 64, BS), (torch.bfloat16, 64, 16),
    (torch.bfloat16, 64, 40)])
@pytest.mark.parametrize("queries", [1, 3])
def test_reads_only_each_rows_own_positions(op, dtype, dim, block_size, queries):
    """NaN everywhere a row must not read (past its position in its blocks, and every block not in
    the table) leaves the output finite and equal to the clean cache's. With 3 queries a row's
    earlier queries must also ignore the positions its later ones attend to."""
    q, k, v, table, pos = case(2, dtype, dim=dim, queries=queries, block_size=block_size,
                               width=48 // block_size + 1, num_blocks=8 * (48 // block_size + 1),
                               positions=(0, 3, 4, 13, 23, 47))
    poisoned_k, poisoned_v = poisoned(k, v, table, pos)
    out = op(q, poisoned_k, poisoned_v, table, pos, 0.25)
    assert torch.isfinite(out).all()
    assert torch.equal(out, op(q, k, v, table, pos, 0.25))
    ref = reference(q, k, v, table, pos, 0.25)
    assert (out.float() - ref.float()).abs().max() <= (2e-6 if dtype == torch.float32 else 2e-2)


def _bf16_run(env_value: str, cases_file, name: str = "NXDI_ATTENTION_BF16_DOT",
              threads: int = 1) -> list:
    """The kernel's outputs for the cases (its arguments, scale last) saved in cases_file, in a
    process whose environment variable `name` is env_value ("": the default; the library reads
    it once), on `threads` torch threads."""
    code = ("import io, sys, torch; from nxdi_common import kernels; "
            f"torch.set_num_threads({threads}); op = kernels.paged_attention(); "
            f"cases = torch.load({str(cases_file)!r}, weights_only=True); "
            "buf = io.BytesIO(); torch.save([op(*c) for c in cases], buf); "
            "sys.stdout.buffer.write(buf.getvalue())")
    env = {**os.environ, name: env_value}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, env=env)
    return torch.load(io.BytesIO(out.stdout), weights_only=True)


def test_bf16_runs_on_dot_products_or_float32_fmas_as_the_cpu_suits(tmp_path):
    """A bf16 query and cache with a head size of 32, 64, 96 or 128 multiply on vdpbf16ps where
    the CPU has AVX512-BF16 and is not Intel's (there it runs at a quarter of the FMAs' rate),
    else on float32 FMAs; NXDI_ATTENTION_BF16_DOT=1/0 decides where set. vdpbf16ps flushes
    subnormal inputs to zero: values of 2^-130 average to 0 there and to 2^-130 on the float32
    paths (and at head size 48, the portable widening). Both paths match gather + SDPA."""
    dot_products = "avx512_bf16" in kernels.cpu_flags()
    dims = (32, 64, 96, 128, 48)
    cases = []
    for dim in dims:
        q, k, v, table, pos = case(4, torch.bfloat16, heads=9, kv_heads=3, dim=dim, block_size=16,
                                   width=4, positions=(0, 17, 40, 63))
        cases += [(q, k, v, table, pos, 0.125),
                  (q, k, torch.full_like(v, 2.0 ** -130), table, pos, 0.125)]
    torch.save(cases, tmp_path / "cases.pt")
    runs = {value: _bf16_run(value, tmp_path / "cases.pt") for value in ("", "0", "1")}
    for value, outs in runs.items():
        dot = dot_products and (value == "1" or (value == "" and not kernels.cpu_is_intel()))
        for i, dim in enumerate(dims):
            (q, k, v, table, pos, _), tiny = cases[2 * i], outs[2 * i + 1].float()
            assert (not tiny.any()) if dot and dim != 48 else bool((tiny > 0).all()), (value, dim)
            err = (outs[2 * i].float() - reference(q, k, v, table, pos, 0.125).float()).abs().max()
            assert err <= 2e-2, (value, dim, err)
    expected_default = "1" if dot_products and not kernels.cpu_is_intel() else "0"
    assert all(torch.equal(a, b) for a, b in zip(runs[""], runs[expected_default]))


@pytest.mark.parametrize("threads", [1, 2])
def test_how_far_ahead_it_prefetches_changes_no_output(tmp_path, threads):
    """NXDI_ATTENTION_PREFETCH_AHEAD (1-4; default 2, 1 on Intel) moves only prefetches: every
    value gives the same bits, on rows of one block to many, a task's rows one after another (one
    thread: each prefetches into the next row's blocks, -1 in the table past a row's last) or
    cut into segments (two threads, one row), and caches that are NaN past each row's position."""
    cases = []
    for dtype, kv_dtype in ((torch.bfloat16, None), (torch.bfloat16, torch.float8_e4m3fn),
                            (torch.float32, None)):
        for positions in ((0, 15, 16, 47, 160, 3), (161,)):
            q, k, v, table, pos = case(11, dtype, kv_dtype, heads=9, kv_heads=3, dim=64,
                                       block_size=16, width=12, num_blocks=80,
                                       positions=positions)
            k, v = poisoned(k, v, table, pos)
            used = torch.arange(table.shape[1]) <= pos[:, -1:] // 16
            cases.append((q, k, v, torch.where(used, table, -1), pos, 0.125))
    torch.save(cases, tmp_path / "cases.pt")
    runs = {value: _bf16_run(value, tmp_path / "cases.pt", "NXDI_ATTENTION_PREFETCH_AHEAD",
                             threads) for value in ("", "1", "2", "4")}
    for q, k, v, table, pos, scale in cases[:1]:
        ref = reference(q.float(), k.nan_to_num().float(), v.nan_to_num().float(),
                        table.clamp(min=0), pos, scale)
        assert (runs[""][0].float() - ref).abs().max() <= 2e-2
    for value, outs in runs.items():
        assert all(torch.isfinite(o).all() for o in outs), value
        assert all(torch.equal(a, b) for a, b in zip(outs, runs["1"])), value


def test_the_built_kernels_keep_their_prefetches():
    """Every instantiation of the paged attention kernel (attend_heads: the next block) and of
    the panel products' tiles (dot_tile: the weights 4 KB ahead) in the built library holds its
    prefetcht1, every AVX2 panel tile (nxdi_tile::tile: a panel read in place, 4 KB ahead) and
    every AMX block (amx_block: both panels 4 KB ahead) its prefetcht0: GCC once deleted the attention's prefetch loops outright after an unrelated
    change, silently, and the kernel took up to 1.5x the time from memory (simd.h,
    prefetch_l2)."""
    import shutil

    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    path = kernels.library_path()
    assert path is not None and path.is_file()
    listing = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(path)], check=True,
                             capture_output=True, text=True).stdout
    instruction = {"_ZN12_GLOBAL__N_112attend_heads": "prefetcht1",
                   "_ZN12_GLOBAL__N_18dot_tile": "prefetcht1", "_ZN9nxdi_tile4tileI": "prefetcht0",
                   "_ZN12_GLOBAL__N_19amx_block": "prefetcht0"}
    prefixes = tuple(instruction)
    prefetches: dict[str, int] = {}
    name = wanted = None
    for line in listing.splitlines():
        if line.endswith(">:") and " <" in line:
            name = line.split(" <", 1)[1][:-2]
            if name.startswith(prefixes) and ".cold" not in name and "@plt" not in name:
                prefetches.setdefault(name, 0)
                wanted = instruction[next(p for p in prefixes if name.startswith(p))]
            else:
                name = None
        elif name is not None and wanted in line:
            prefetches[name] += 1
    flags = kernels.cpu_flags()
    # dot_tile: the bf16 dot-product and FMA tiles, built where the CPU has AVX512-BF16;
    # nxdi_tile::tile: the float32 FMA tiles, built where it has AVX2 and FMA; amx_block: built
    # where it has AMX-BF16 (whether or not Linux grants the tiles)
    expected = [prefixes[0]] + ([prefixes[1]] if "avx512_bf16" in flags else []) + (
        [prefixes[2]] if {"avx2", "fma"} <= flags else []) + (
        [prefixes[3]] if {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags else [])
    for prefix in expected:
        assert any(n.startswith(prefix) for n in prefetches), f"no {prefix} in the library"
    assert all(prefetches.values()), [n for n, c in prefetches.items() if c == 0][:3]


@pytest.mark.parametrize("dim", [24, 64])
def test_two_threads_equal_one(op, torch_threads, dim):
    """With at least as many rows as threads a task is a whole row: the same sums in the same
    order whatever the thread count."""
    q, k, v, table, pos = case(3, torch.bfloat16, dim=dim)
    one = op(q, k, v, table, pos, 0.25)
    with torch_threads(2):
        assert torch.equal(op(q, k, v, table, pos, 0.25), one)


@pytest.mark.parametrize("threads,positions", [(2, (159,)), (2, (40,)), (2, (5,)), (3, (0, 100)),
                                               (3, (63, 64))])
@pytest.mark.parametrize("dtype,kv_dtype,dim,block_size", [
    (torch.float32, None, 24, BS), (torch.bfloat16, None, 64, 16),
    (torch.bfloat16, torch.float8_e4m3fn, 64, 16), (torch.bfloat16, None, 128, 40)])
@pytest.mark.parametrize("queries", [1, 3])
def test_rows_cut_into_segments_for_the_threads(op, torch_threads, threads, positions, dtype,
                                                kv_dtype, dim, block_size, queries):
    """With fewer rows than threads each row's positions are cut into segments of whole blocks,
    one a thread, and merged: equal to gather + SDPA, and still reading nothing past a row's
    position (NaN there), with segments past a short row's end left empty ((5,): one block)."""
    width = 160 // block_size + 1
    q, k, v, table, pos = case(9, dtype, kv_dtype, heads=9, kv_heads=3, queries=queries, dim=dim,
                               width=width, num_blocks=4 * width + 4, positions=positions,
                               block_size=block_size)
    poisoned_k, poisoned_v = poisoned(k, v, table, pos)
    with torch_threads(threads):
        out = op(q, poisoned_k, poisoned_v, table, pos, dim ** -0.5)
    ref = reference(q.float(), k.float(), v.float(), table, pos, dim ** -0.5)
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max() <= (2e-6 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("change,message", [
    (lambda q, k, v, t, p: (q, k, v, t.clone().fill_(40), p), "block ids"),
    (lambda q, k, v, t, p: (q, k, v, t.clone().fill_(-1), p), "block ids"),
    (lambda q, k, v, t, p: (q, k, v, t, p + 100), "positions"),
    (lambda q, k, v, t, p: (q, k, v, t, p - 100), "positions"),
    (lambda q, k, v, t, p: (q[..., :8], k, v, t, p), "head_dim"),
    (lambda q, k, v, t, p: (q[:, :5], k, v, t, p), "not a multiple"),
    (lambda q, k, v, t, p: (q[0], k, v, t, p), "q must be"),
    (lambda q, k, v, t, p: (q, k, v.float().half(), t, p), "dtypes differ"),
    (lambda q, k, v, t, p: (q, k, v, t[:2], p), "block_table"),
])
def test_bad_input_is_refused(op, change, message):
    """A block id outside the cache or a position outside the table is an error, not a read of
    someone else's memory."""
    args = change(*case(4))
    with pytest.raises(RuntimeError, match=message):
        op(*args, 0.25)


@pytest.mark.parametrize("queries", [1, 3])
def test_layer_op_takes_the_whole_cache_and_heads_last(op, queries):
    """nxdi::paged_decode_attention_layer: q [B, S, H, D] and the model's [layers, 2, ...] cache
    give paged_decode_attention's result over that layer's K and V as [B, S, H * D]; a layer
    outside the cache or a cache of another shape is refused by name."""
    q, k, v, table, pos = case(9, dtype=torch.bfloat16, dim=64, queries=queries)
    other = torch.randn(2, *k.shape).bfloat16()
    cache = torch.stack([other, torch.stack([k, v])])  # layer 1 holds k and v
    got = torch.ops.nxdi.paged_decode_attention_layer(q.transpose(1, 2).contiguous(), cache, 1,
                                                      table, pos, 0.25)
    want = op(q, k, v, table, pos, 0.25).transpose(1, 2).flatten(2)
    assert got.shape == (q.shape[0], queries, q.shape[1] * q.shape[3])
    assert torch.equal(got, want)
    heads_last = q.transpose(1, 2).contiguous()
    # int32 indices (and, with one query a row, every other layout) take the path through views
    assert torch.equal(torch.ops.nxdi.paged_decode_attention_layer(
        heads_last, cache, 1, table.int(), pos.int(), 0.25), want)
    with pytest.raises(RuntimeError, match=r"head_dim of q \(64\) and of the cache \(32\)"):
        torch.ops.nxdi.paged_decode_attention_layer(heads_last, cache[..., :32].contiguous(), 1,
                                                    table, pos, 0.25)
    with pytest.raises(RuntimeError, match="position_ids must be"):
        torch.ops.nxdi.paged_decode_attention_layer(heads_last, cache, 1, table, pos[:, :0], 0.25)
    with pytest.raises(RuntimeError, match="layer 2 is not in 0..1"):
        torch.ops.nxdi.paged_decode_attention_layer(heads_last, cache, 2, table, pos, 0.25)
    with pytest.raises(RuntimeError, match="cache must be"):
        torch.ops.nxdi.paged_decode_attention_layer(heads_last, cache[1], 0, table, pos, 0.25)
    with pytest.raises(RuntimeError, match="q must be"):
        torch.ops.nxdi.paged_decode_attention_layer(heads_last[0], cache, 1, table, pos, 0.25)


# ---- choice of attention path, and compiled graphs --------------------------------------------


def block_config(**overrides) -> NeuronConfig:
    kwargs = dict(batch_size=2, seq_len=64, torch_dtype=torch.float32, enable_bucketing=True,
                  context_encoding_buckets=[32, 64], token_generation_buckets=[64], backend="cpu",
                  is_block_kv_layout=True, pa_block_size=8, pa_num_blocks=24)
    kwargs.update(overrides)
    return NeuronConfig(**kwargs)


def test_paged_needs_the_block_layout():
    with pytest.raises(ValueError, match="cpu_attention_kernel 'paged' needs is_block_kv_layout"):
        NeuronConfig(batch_size=1, seq_len=64, cpu_attention_kernel="paged")
    with pytest.raises(ValueError, match="cpu_attention_kernel must be one of"):
        block_config(cpu_attention_kernel="fast")


def test_auto_falls_back_when_the_kernel_cannot_be_built(tiny_llama_ckpt, monkeypatch):
    """Without a compiler, auto runs gather + SDPA and says why; an explicit 'paged' refuses."""
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "_build_and_load",
                        lambda: (_ for _ in ()).throw(OSError("no C++ compiler")))
    model = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=block_config())
    assert model.resolve_attention_kernel("cpu") == kernels.SDPA
    assert "no C++ compiler" in kernels.kernels_unavailable_reason()
    explicit = NeuronLlamaForCausalLM(tiny_llama_ckpt,
                                      neuron_config=block_config(cpu_attention_kernel="paged"))
    with pytest.raises(ValueError, match="'paged' cannot be used: .*no C\\+\\+ compiler"):
        explicit.resolve_attention_kernel("cpu")


def greedy(model, steps: int = 12) -> torch.Tensor:
    model.reset()
    prompt = (torch.arange(40) * 37 + 11).remainder(256).view(2, 20)
    logits = [model(prompt).logits]
    for _ in range(steps):
        logits.append(model(logits[-1].argmax(-1, keepdim=True)).logits)
    return torch.stack(logits)


_CHILD = """
import sys, torch
torch.set_num_threads(1)
from nxdi_common.models.llama.modeling_llama import LlamaInferenceConfig, NeuronLlamaForCausalLM
folder, ckpt, out = sys.argv[1:4]
model = NeuronLlamaForCausalLM(ckpt, config=LlamaInferenceConfig.load(folder))
model.load(folder)
assert model.attention_kernel == "paged", model.attention_kernel
torch.save(greedy(model), out)
"""


def test_compiled_paged_graphs_load_in_a_fresh_process(tiny_llama_ckpt, tmp_path,
                                                       compile_cache_dir):
    """The manifest records the kernel; a new process loads the library before the graphs and
    reproduces the logits; an sdpa-compiled folder is refused by a paged config."""
    from nxdi_common.models.llama.modeling_llama import LlamaInferenceConfig
    import inspect
    folder = tmp_path / "paged"
    model = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=block_config())
    model.compile(folder)
    model.load(folder)
    assert json.loads((folder / MANIFEST).read_text())["attention_kernel"] == kernels.PAGED
    expected = greedy(model)
    eager = NeuronLlamaForCausalLM(tiny_llama_ckpt,
                                   neuron_config=block_config(cpu_attention_kernel="sdpa"))
    eager.to_cpu()
    assert (greedy(eager) - expected).abs().max() <= 1e-4

    script = tmp_path / "child.py"
    script.write_text("import torch\n" + textwrap.dedent(inspect.getsource(greedy)) + _CHILD)
    proc = subprocess.run([sys.executable, str(script), str(folder), str(tiny_llama_ckpt),
                           str(tmp_path / "out.pt")], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)

    sdpa_folder = tmp_path / "sdpa"
    NeuronLlamaForCausalLM(tiny_llama_ckpt,
                           neuron_config=block_config(cpu_attention_kernel="sdpa")).compile(sdpa_folder)
    paged = NeuronLlamaForCausalLM(tiny_llama_ckpt, config=LlamaInferenceConfig.load(folder))
    with pytest.raises(ValueError, match="compiled for 'sdpa' token-generation attention"):
        paged.load(sdpa_folder)


@pytest.mark.parametrize("dim", [24, 64])  # portable and AVX-512 conversions
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])  # bf16: the dot products
def test_every_float8_value_reads_exactly(op, dim, q_dtype):
    """All 256 float8_e4m3fn codes (subnormals, zeros, the largest 448, NaN) come out of an fp8
    cache as torch's own float conversion gives them: with one cached position the output is
    that position's V row (each code is a bf16 value too)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    rows = -(-256 // dim)
    v = torch.zeros(rows + 1, 1, 1, dim, dtype=torch.uint8)
    v.view(-1)[:256] = codes.view(torch.uint8)
    v = v.view(torch.float8_e4m3fn)
    k = torch.zeros_like(v)
    q = torch.zeros(rows, 1, 1, dim, dtype=q_dtype)
    out = op(q, k, v, torch.arange(rows).view(rows, 1), torch.zeros(rows, 1, dtype=torch.long), 1.0)
    got, want = out.float().reshape(-1)[:256], codes.float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got[~torch.isnan(want)], want[~torch.isnan(want)])  # -0 sums to +0


def test_a_float8_cache_takes_the_bf16_path(tmp_path):
    """With a bf16 query a float8 cache is made bf16 as it is read (exactly, scaled by a power of
    two that the scores and the output take back), so its output equals, bit for bit, the
    output over the same cache cast to bf16 on the bf16 dot products, where the CPU has them
    (head sizes 64 and 128; where it does not, both widen to float32 alike; 48: the portable
    widening). A bf16 cache takes those dot products where NXDI_ATTENTION_BF16_DOT=1 (by
    default not on Intel; a float8 cache always does). Widening float8 to float32 instead
    (float32 products and probabilities) would not be equal."""
    cases = []
    for dim in (64, 128, 48):
        q, k, v, table, pos = case(5, torch.bfloat16, torch.float8_e4m3fn, heads=9, kv_heads=3,
                                   dim=dim, block_size=16, width=4, positions=(0, 17, 40, 63))
        cases += [(q, k, v, table, pos, dim ** -0.5),
                  (q, k.to(torch.bfloat16), v.to(torch.bfloat16), table, pos, dim ** -0.5)]
    torch.save(cases, tmp_path / "cases.pt")
    outs = _bf16_run("1", tmp_path / "cases.pt")
    for i, dim in enumerate((64, 128, 48)):
        assert torch.equal(outs[2 * i], outs[2 * i + 1]), dim
