"""Model loading for the prefill and decode workers: command-line options, the NeuronConfig each
role needs, compile-or-load through the persistent cache, the tokenizer, and the model fingerprint.

A prefill worker runs context encoding (CTE) over a flat KV cache with one row per prompt in flight,
or over a block KV cache that keeps its prompts' prefixes (with chunked prefill for the rest of a
prompt past one); a decode worker runs token generation (TKG) over a block KV cache (and CTE for
local prefill)."""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from nxdi_common.bucketing import (decode_batch_buckets, parse_buckets, prefill_buckets,
                                   quartered_buckets, validate_buckets)
from nxdi_common.kv_transfer import ModelFingerprint
from nxdi_common.serving.thread_priority import (DEFAULT_WAKEUP_SLICE_US, NICE_RANGE, check_nice,
                                                 check_slice_us, set_process_priority,
                                                 set_process_slice)

log = logging.getLogger(__name__)
DTYPES = ("float32", "bfloat16")
QUANTIZE = ("int8",)
ATTENTION_KERNELS = ("auto", "paged", "sdpa")
KV_CACHE_DTYPES = ("auto", "fp8")


MIN_CONTEXT_BUCKET = 32  # the default context buckets' smallest length (_neuron_config)


@dataclass(frozen=True)
class ModelOptions:
    """Which model a worker serves and how it runs it."""

    model: str | None = None  # HF checkpoint directory; None: the bundled SmolLM2
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    backend: str = "compiled"  # "compiled" (traced per bucket, cached) or "eager"
    compiled_root: str | None = None
    threads: int | None = None  # torch intra-op threads; None: torch's default
    quantize: str | None = None  # "int8": weights int8 per output channel; None: dtype weights
    context_buckets: tuple[int, ...] | None = None  # CTE lengths; None: quartered from 32
    attention_kernel: str = "auto"  # decode's TKG attention (NeuronConfig.cpu_attention_kernel)
    kv_cache_dtype: str = "auto"  # "fp8": float8_e4m3fn KV cache (kv_cache_quant); auto: dtype

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.backend not in ("compiled", "eager"):
            raise ValueError(f"backend must be 'compiled' or 'eager', got {self.backend!r}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {QUANTIZE} or unset, got {self.quantize!r}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel must be one of {ATTENTION_KERNELS}, "
                             f"got {self.attention_kernel!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.context_buckets is not None:
            validate_buckets(self.context_buckets, self.max_model_len, "context_buckets",
                             "max_model_len")
            if self.context_buckets[-1] != self.max_model_len:
                raise ValueError(f"context_buckets must end at max_model_len "
                                 f"({self.max_model_len}) so that every allowed prompt has a "
                                 f"bucket; got {list(self.context_buckets)}")

    def model_dir(self) -> Path:
        if self.model:
            return Path(self.model)
        from nxdi_common.bundled import prepare_bundled_model
        return prepare_bundled_model()


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Where a worker listens, and its log level."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: pick a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--nice", type=process_nice, default=None, metavar="N",
                   help="OS nice value (0-19) of this worker, every thread it starts included "
                        "and, when it leads its session (as the launcher starts it), its "
                        "autogroup: e.g. a prefill worker sharing its core with the router "
                        "below it, so that the router's token deliveries do not wait behind a "
                        "prefill (default: unchanged)")
    add_wakeup_slice_arg(p)


WAKEUP_SLICE_HELP = ("the OS scheduler slice of this process's threads that wait on the network "
                     "and hand work on (its event loop, gRPC's), in microseconds (100-100000; "
                     "0: the kernel's default), Linux 6.12 and later: a thread woken on a core "
                     "where a step or a prefill computes then runs within ~0.1 ms instead of "
                     "at the kernel's next tick (up to 4 ms at HZ=250). The threads that compute "
                     "or move KV keep the default. Shares of the core do not change; older "
                     "kernels ignore it (default: %(default)s)")


def add_wakeup_slice_arg(p) -> None:
    """--wakeup-slice-us, for the workers and the router (apply_wakeup_slice)."""
    p.add_argument("--wakeup-slice-us", type=wakeup_slice_us, default=DEFAULT_WAKEUP_SLICE_US,
                   metavar="US", help=WAKEUP_SLICE_HELP)


def wakeup_slice_us(text: str) -> int:
    """--wakeup-slice-us: 0 or microseconds in thread_priority.SLICE_RANGE_US."""
    return _checked_int(text, "--wakeup-slice-us", "an integer", check_slice_us)


def apply_wakeup_slice(slice_us: int) -> bool:
    """--wakeup-slice-us, in a process's main before it starts its compute threads (those mark
    themselves, thread_priority.mark_bulk_thread); logs whether the kernel took it."""
    took = set_process_slice(slice_us)
    if slice_us:
        logging.getLogger(__name__).info(
            "wakeup slice %d us: %s", slice_us,
            "set" if took else "not available on this kernel (Linux 6.12+ has it): unchanged")
    return took


WAKE_MS_RANGE = (0.1, 1000.0)  # 0: off


def wake_interval_ms(text: str) -> float:
    """The router's --wake-ms (router.server.wake_every): 0 (off) or milliseconds in
    WAKE_MS_RANGE."""
    low, high = WAKE_MS_RANGE
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if value == 0 or low <= value <= high:
        return value
    raise argparse.ArgumentTypeError(f"--wake-ms must be 0 (off) or milliseconds in [{low:g}, "
                                     f"{high:g}], got {text!r}")


def process_nice(text: str) -> int:
    """--nice: an integer in thread_priority.NICE_RANGE."""
    def check(value: int) -> int:
        return check_nice(value, "--nice", "the nice value the process started with")
    return _checked_int(text, "--nice", f"an integer in {list(NICE_RANGE)}", check)


def _checked_int(text: str, option: str, allowed: str, check) -> int:
    """``check(int(text))``, argparse.ArgumentTypeError with its message (or, for text that is
    no integer, one naming ``option`` and what it allows) where it fails."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{option} must be {allowed}, got {text!r}") from None
    try:
        return check(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def apply_nice(nice: int | None) -> None:
    """--nice, first thing in a process's main (thread_priority.set_process_priority; None:
    leave it); SystemExit naming the option where the OS refuses it."""
    if nice is None:
        return
    try:
        set_process_priority(nice)
    except PermissionError:
        raise SystemExit(f"--nice {nice}: below this process's nice "
                         f"{os.getpriority(os.PRIO_PROCESS, 0)} needs privilege") from None


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model options every worker command line takes."""
    g = p.add_argument_group("model")
    g.add_argument("--model", help="HF checkpoint directory (default: the bundled SmolLM2)")
    g.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    g.add_argument("--max-model-len", type=int, default=2048,
                   help="longest prompt plus output, in tokens (the model's seq_len)")
    g.add_argument("--backend", choices=("compiled", "eager"), default="compiled")
    g.add_argument("--compiled-root", help="folder for compiled models (default: in the cache)")
    g.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    g.add_argument("--context-buckets", type=parse_buckets, metavar="N,N,...",
                   help="prompt-length buckets for context encoding, ending at --max-model-len "
                        "(default on a decode worker: powers of two from 32 to 1024, then "
                        "quarter steps: 32,64,128,256,512,1024,1280,1536,1792,2048 for 2048; on a "
                        "prefill worker denser: 32,64,128,192,256,384,512,768,1024, then steps of "
                        "128 to 2048); denser buckets pad prompts less and take longer to "
                        "compile and warm up")
    g.add_argument("--quantize", choices=QUANTIZE,
                   help="int8: weights quantized per output channel (written once, cached next "
                        "to the compiled models); faster decode at small batch, slightly less "
                        "accurate")
    g.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default="auto",
                   help="decode attention: paged (C++ kernel reading each sequence's KV blocks in "
                        "place; built once per machine), sdpa (gather the blocks, torch SDPA), "
                        "auto (paged where it builds)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="fp8: keep (and send) the KV cache as float8_e4m3fn, half the bytes of "
                        "bf16: twice the cached tokens per block pool, slightly less accurate, "
                        "and on CPU slower decode steps than bf16 (BENCHMARKS.md); prefill and "
                        "decode workers must agree (the model fingerprint checks it); auto: the "
                        "model's dtype")


def model_options_from_args(args) -> ModelOptions:
    return ModelOptions(args.model, args.dtype, args.max_model_len, args.backend,
                        args.compiled_root, args.threads, getattr(args, "quantize", None),
                        getattr(args, "context_buckets", None),
                        getattr(args, "attention_kernel", "auto"),
                        getattr(args, "kv_cache_dtype", "auto"))



# A prefill worker's chunked-prefill lengths (prefix cache): the rest of a prompt past its cached
# prefix runs in pieces of the largest that it fills, the last padded to the smallest that holds
# it (prefill_service/prefix_cache.pieces): under 32 padded tokens a prompt, at most log2 calls.
PREFILL_PIECE_SIZES = (32, 64, 128, 256, 512)


def prefill_neuron_config(opts: ModelOptions, max_batch_size: int, ctx_batch_size: int,
                          max_batch_tokens: int | None = None, prefix_cache_blocks: int = 0,
                          block_size: int = 16):
    """CTE batches of up to ctx_batch_size prompts, of several prompts only within
    max_batch_tokens padded tokens. Without a prefix cache a flat KV cache, one row per prompt
    being encoded; with one (prefix_cache_blocks > 0) a block KV cache of that many blocks and
    chunked-prefill sub-models (PREFILL_PIECE_SIZES up to max_model_len) for the rest of a
    prompt past its cached prefix; no mixed sub-models (a prefill worker never decodes)."""
    kwargs = {}
    if prefix_cache_blocks:
        sizes = [n for n in PREFILL_PIECE_SIZES if n < opts.max_model_len] or [opts.max_model_len - 1]
        kwargs.update(is_block_kv_layout=True, pa_num_blocks=prefix_cache_blocks,
                      pa_block_size=block_size, prefill_chunk_size=sizes[-1],
                      mixed_chunk_buckets=sizes, mixed_steps=False,
                      cpu_attention_kernel=opts.attention_kernel, **_paged_token_generation(opts))
    return _neuron_config(opts, prefill_buckets, max_batch_size=max_batch_size,
                          ctx_batch_size=ctx_batch_size, tkg_batch_size=1,
                          max_context_batch_tokens=max_batch_tokens,
                          cpu_weight_layout=prefill_weight_layout(opts), **kwargs)


def _paged_token_generation(opts: ModelOptions) -> dict:
    """One token-generation length bucket when the paged attention kernel builds here: each row
    reads only its own blocks, so a call costs the same in every length bucket (fewer graphs to
    build); else {} (the default buckets)."""
    if opts.attention_kernel == "sdpa":
        return {}
    from nxdi_common.kernels import kernels_unavailable_reason
    if kernels_unavailable_reason() is not None:
        return {}
    return {"token_generation_buckets": [opts.max_model_len]}


def prefill_weight_layout(opts: ModelOptions) -> str:
    """A prefill worker's cpu_weight_layout. Its products are whole prompts, tens to thousands of
    rows, where the choice "auto" makes for a model that also decodes (our panels where they win
    at 1 to 32 rows) is the slower one: with oneDNN's packed weights the bundled model's prompts
    encode as fast at 128 tokens, 1.00-1.18x faster at 512, 1.17-1.26x at 1024, 1.29-1.34x at
    1536 and 1.35x at 2048 on one core of the Intel VM with AMX (bench/bench_prefill.py,
    BENCHMARKS.md session 23), and the prefill products ran 2-6% faster on the AMD Zen 4 VM
    (session 13). So "onednn" for bfloat16 weights wherever oneDNN packs them, else
    "auto" (without bf16 support oneDNN cannot; int8 weights keep their own kernels). Except
    where our panels multiply many rows on float32 FMAs without AMX (Intel Xeons that list no
    AMX, kernels.panel_fma_rows()): there oneDNN has no AMX either, and the panels encoded 512,
    1024 and 1792-token prompts in 0.64-0.79x, 0.67-0.69x and 0.73-0.74x of oneDNN's time on
    one core (bench/bench_prefill.py --cpu 1, BENCHMARKS.md session 48), so "auto"."""
    import torch
    if opts.dtype != "bfloat16" or opts.quantize:
        return "auto"
    from nxdi_common import kernels
    from nxdi_common.modules.linear import onednn_unavailable_reason
    if onednn_unavailable_reason(torch.bfloat16) is not None:
        return "auto"
    if kernels.panel_fma_rows() > 0 and not kernels.panel_amx_tiles():
        return "auto"
    return "onednn"


def decode_neuron_config(opts: ModelOptions, max_batch_size: int, num_blocks: int,
                         block_size: int, prefill_chunk_tokens: int = 0,
                         piece_sizes: tuple[int, ...] | None = None,
                         batch_buckets: list[int] | None = None):
    """Block KV cache of num_blocks blocks; TKG batch buckets batch_buckets (default
    decode_batch_buckets) up to max_batch_size; CTE (local prefill) one prompt at a time, in
    pieces of prefill_chunk_tokens (0: whole; no pieces either when a piece would hold any
    prompt the model takes), beside a running batch in pieces of any of piece_sizes (the mixed
    sub-model's chunk lengths; None: the chunk alone)."""
    kwargs = {}
    if 0 < prefill_chunk_tokens < opts.max_model_len:
        kwargs["prefill_chunk_size"] = prefill_chunk_tokens
        if piece_sizes:
            kwargs["mixed_chunk_buckets"] = list(piece_sizes)
    kwargs.update(_paged_token_generation(opts))  # one TKG call per step
    kwargs["token_generation_batch_buckets"] = list(batch_buckets
                                                    or decode_batch_buckets(max_batch_size))
    return _neuron_config(opts, max_batch_size=max_batch_size, ctx_batch_size=1,
                          tkg_batch_size=max_batch_size, is_block_kv_layout=True,
                          pa_num_blocks=num_blocks, pa_block_size=block_size,
                          cpu_attention_kernel=opts.attention_kernel, **kwargs)


def _neuron_config(opts: ModelOptions, default_buckets=quartered_buckets, **kwargs):
    import torch
    from nxdi_common.config import NeuronConfig, OnDeviceSamplingConfig
    sampling = OnDeviceSamplingConfig(dynamic=True, do_sample=True)
    # A prompt pads to its bucket, and on a CPU its prefill costs about its padded tokens: past 1024
    # tokens quarter steps keep the padding under 25% (powers of two would run a 1025-token prompt
    # as 2048, twice the prefill time), and below 128 the 32 and 64 buckets spare short chat
    # prompts most of a 128-token prefill (one AVX2 core: 115 / 198 / 388 ms at 32 / 64 / 128).
    # Prefill workers, whose time is prefill, take the denser prefill_buckets (more graphs to warm
    # up: the disaggregated stack at 2048 came up in ~43 s instead of ~34, graphs cached).
    kwargs["context_encoding_buckets"] = list(opts.context_buckets or default_buckets(
        MIN_CONTEXT_BUCKET, opts.max_model_len))
    if opts.kv_cache_dtype == "fp8":
        kwargs["kv_cache_quant"] = True
    if opts.quantize:
        kwargs.update(quantized=True, quantization_dtype=opts.quantize,
                      quantization_type="per_channel_symmetric",
                      quantized_checkpoints_path=str(quantized_dir(opts)))
    return NeuronConfig(batch_size=kwargs["max_batch_size"], seq_len=opts.max_model_len,
                        max_context_length=opts.max_model_len,
                        torch_dtype=getattr(torch, opts.dtype), enable_bucketing=True,
                        is_continuous_batching=True, backend="cpu", fused_qkv=True,
                        output_logits=True, skip_warmup=opts.backend == "eager",
                        on_device_sampling_config=sampling, **kwargs)


@contextlib.contextmanager
def compile_lock(compiled: Path):
    """Hold an exclusive lock on ``compiled``'s lock file (beside it) for the block. Several
    workers started at once with one configuration (nxdi-serve --decode-workers 2, pods on one
    cache volume) would otherwise all compile it, and one's compile replaced the folder while
    another was loading from it. flock: the kernel releases it when a holder dies."""
    import fcntl
    compiled.parent.mkdir(parents=True, exist_ok=True)
    with open(compiled.with_name(compiled.name + ".lock"), "a") as f:
        waited = time.monotonic()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process compiling %s", compiled)
            fcntl.flock(f, fcntl.LOCK_EX)
            log.info("waited %.1f s for %s", time.monotonic() - waited, compiled.name)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def compiled_root(opts: ModelOptions) -> Path:
    return Path(opts.compiled_root) if opts.compiled_root else opts.model_dir().parent / "compiled"


def quantized_dir(opts: ModelOptions) -> Path:
    """Where the quantized checkpoint of opts.model lives (written on first use)."""
    model_dir = opts.model_dir()
    return compiled_root(opts) / f"{model_dir.name}-{weights_hash(model_dir)[:12]}-{opts.quantize}"


def load_model(opts: ModelOptions, neuron_config):
    """Build, compile (once, cached by configuration) or load, and return the application. Call
    it on the worker's ComputeThread (nxdi_common/serving/compute.py), which holds opts.threads
    torch threads, the thread that then runs the model."""
    from nxdi_common.models.llama import NeuronLlamaForCausalLM
    from nxdi_common.runtime import keep_large_buffers_in_heap
    keep_large_buffers_in_heap()
    model_dir = opts.model_dir()
    model = NeuronLlamaForCausalLM(str(model_dir), neuron_config=neuron_config)
    if neuron_config.quantized and not Path(neuron_config.quantized_checkpoints_path).is_dir():
        log.info("quantizing %s to %s (first run only)", model_dir.name,
                 neuron_config.quantized_checkpoints_path)
        NeuronLlamaForCausalLM.save_quantized_state_dict(str(model_dir), model.config)
    if opts.backend == "eager":
        model.to_cpu()
        return model
    # The folder is named by the configuration and the modeling code, so a code change compiles
    # again instead of loading graphs traced from the old code.
    from nxdi_common.backends.compile_cache import code_fingerprint
    key = hashlib.sha256((model.config.to_json_string() + code_fingerprint()).encode()).hexdigest()[:12]
    compiled = compiled_root(opts) / f"{model_dir.name}-{key}"
    with compile_lock(compiled):  # workers started together compile it once, the others wait
        if not (compiled / "nxdi_manifest.json").is_file():
            log.info("compiling %s to %s (first run only)", model_dir.name, compiled)
            model.compile(str(compiled))
    model.load(str(compiled))
    return model


def load_tokenizer(opts: ModelOptions):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(opts.model_dir()))


def grammar_compiler(opts: ModelOptions, vocab_size: int, tokenizer=None):
    """The worker's structured-output compiler (its tokenizer loaded on first use unless given)."""
    from nxdi_common.serving.structured import GrammarCompiler
    return GrammarCompiler((lambda: tokenizer) if tokenizer is not None
                           else (lambda: load_tokenizer(opts)),
                           vocab_size, eos_token_ids(opts.model_dir()))


def weights_hash(model_dir: Path) -> str:
    """sha256 over the checkpoint's weight files (names, then contents), hex. Computed once per
    process for the same files (a worker asks for it for its quantized folder and its
    fingerprint; it reads every weight byte)."""
    files = sorted(p for p in Path(model_dir).iterdir()
                   if p.suffix in (".safetensors", ".bin", ".pt") and p.is_file())
    return _hash_files(tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))


@functools.lru_cache(maxsize=8)
def _hash_files(files: tuple[tuple[str, int, int], ...]) -> str:
    """sha256 of (name, contents) per file; keyed by path, size and mtime."""
    h = hashlib.sha256()
    for name, _, _ in files:
        path = Path(name)
        h.update(path.name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def model_fingerprint(model, opts: ModelOptions) -> ModelFingerprint:
    """The fingerprint KV transfers are checked against: geometry and dtypes of the KV cache as
    this worker stores it, and the weights it was computed with."""
    nc = model.neuron_config
    shape = model._model.kv_mgr.shape  # flat [L, 2, B+1, H, S, D]; block [L, 2, NB+1, BS, H, D]
    heads = shape[4] if nc.is_block_kv_layout else shape[3]
    model_dir = opts.model_dir()
    weights = weights_hash(model_dir) + (f"+{opts.quantize}" if opts.quantize else "")
    return ModelFingerprint(model_dir.name, shape[0], heads, shape[-1], opts.dtype,
                            "fp8_e4m3fn" if nc.kv_cache_quant else "none", weights)


def eos_token_ids(model_dir: Path) -> set[int]:
    """End-of-sequence ids from config.json and generation_config.json (int or list each)."""
    import json
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else (value or []))
    return ids
