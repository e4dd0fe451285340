"""Design spike for the next decode-path change (not used by the services): one token-generation
call in which the last row attends over a long length bucket and the other rows over a short one,
with the projections batched once, against what the decode engine does today (one call padded to
the long bucket, or two calls: short rows, then the long row).

    .venv/bin/python bench/spike_split_attention.py

It patches NeuronAttention.forward and NeuronBaseModel._attention_mask in this process only, traces
the three variants on the decode worker's model (bundled SmolLM2, bf16, block KV, one thread) and
prints the median step time of each and the largest logit difference between the split call and
the padded one."""
import statistics, time, warnings
import torch, torch.nn.functional as F
from nxdi_common.serving.worker import ModelOptions, decode_neuron_config, load_model
from nxdi_common.backends.weights import swapped_parameters
from nxdi_common.models.base import NeuronBaseModel
from nxdi_common.modules import attention as attn_mod
import sys
sys.path.insert(0, "bench")
from bench_tkg_step import BLOCK, BLOCKS, MAX_BATCH  # noqa: E402

orig_mask = NeuronBaseModel._attention_mask
def split_mask(position_ids, kv_len, dtype):
    if not isinstance(kv_len, tuple):
        return orig_mask(position_ids, kv_len, dtype)
    ls, ll, n = kv_len
    return (orig_mask(position_ids[:-n], ls, dtype), orig_mask(position_ids[-n:], ll, dtype))
NeuronBaseModel._attention_mask = staticmethod(split_mask)

cls = [c for c in vars(attn_mod).values() if isinstance(c, type) and hasattr(c, "project")][0]
orig_fwd = cls.forward
def split_fwd(self, x, cos, sin, mask, cache, layer, kv_mgr, index, kv_len, residual=None):
    if not isinstance(kv_len, tuple):
        return orig_fwd(self, x, cos, sin, mask, cache, layer, kv_mgr, index, kv_len, residual)
    ls, ll, n = kv_len
    q, k, v = self.project(x, cos, sin)
    kv_mgr.write(cache, layer, k, v, index)
    seq, pos, slots, table = index
    short = (seq[:-n], pos[:-n], slots[:-n], table[:-n, :ls // BLOCK])
    long = (seq[-n:], pos[-n:], slots[-n:], table[-n:, :ll // BLOCK])
    ks, vs = kv_mgr.read(cache, layer, short, ls)
    kl, vl = kv_mgr.read(cache, layer, long, ll)
    os_ = F.scaled_dot_product_attention(q[:-n], ks, vs, attn_mask=mask[0], enable_gqa=True)
    ol = F.scaled_dot_product_attention(q[-n:], kl, vl, attn_mask=mask[1], enable_gqa=True)
    out = torch.cat([os_, ol]).transpose(1, 2).flatten(2)
    return self.o_proj(out) if residual is None else self.o_proj.add_to(residual, out)
cls.forward = split_fwd

opts = ModelOptions(threads=1)
app = load_model(opts, decode_neuron_config(opts, MAX_BATCH, BLOCKS, BLOCK))
model, weights, cache = app._model, app.weights, app.kv_cache
order = ("input_ids", "attention_mask", "position_ids", "seq_ids", "sampling_params", "rand",
         "slot_mapping", "block_table")

def inputs(batch, lengths):
    """Rows with the given cache lengths (block table padded to the longest)."""
    width = max(lengths) // BLOCK
    table = torch.tensor([[(i * 128 + j) % BLOCKS for j in range(width)] for i in range(batch)])
    pos = torch.tensor([[l - 1] for l in lengths])
    slots = torch.tensor([[int(table[i][(l - 1) // BLOCK]) * BLOCK + (l - 1) % BLOCK]
                          for i, l in enumerate(lengths)])
    d = dict(input_ids=torch.zeros(batch, 1, dtype=torch.long), attention_mask=torch.ones(batch, 1, dtype=torch.long),
             position_ids=pos, seq_ids=torch.arange(batch, dtype=torch.int32),
             sampling_params=torch.tensor([[1, 1.0, 1.0]] * batch), rand=torch.rand(batch),
             slot_mapping=slots, block_table=table)
    return tuple(d[k] for k in order)

def traced(kv_len, example):
    def run(*args):
        *ins, kv, w = args
        with swapped_parameters(model, w):
            return model(*ins, kv, kv_len=kv_len)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.trace(run, example + (cache, weights), check_trace=False, strict=False)

def timed(fn, args):
    for _ in range(3): fn(*args)
    t = []
    for _ in range(7):
        s = time.perf_counter(); fn(*args); t.append(time.perf_counter() - s)
    return statistics.median(t) * 1000

torch.set_num_threads(1)
for b, ls, ll in [(8, 256, 2048), (8, 512, 2048), (16, 256, 2048), (4, 256, 1280)]:
    short_lens = [ls] * (b - 1)
    full = inputs(b, short_lens + [ll])
    one = traced(ll, full)
    split = traced((ls, ll, 1), full)
    s_in = inputs(b, short_lens + [ls])  # short call (the long row's slot padded as short)
    l_in = inputs(1, [ll])
    t_one = timed(one, full + (cache, weights))
    t_split = timed(split, full + (cache, weights))
    short_call = traced(ls, s_in); long_call = traced(ll, l_in)
    t_two = timed(short_call, s_in + (cache, weights)) + timed(long_call, l_in + (cache, weights))
    o1 = one(*full, cache, weights)[1]; o2 = split(*full, cache, weights)[1]
    print(f"b{b} short {ls} long {ll}: one padded call {t_one:.1f} ms, two calls {t_two:.1f} ms, "
          f"split call {t_split:.1f} ms; max |logit diff| split vs padded {(o1 - o2).abs().max():.3g}",
          flush=True)
