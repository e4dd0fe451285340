"""`nxdi-generate`: generate text for a prompt with nxdi_common on the bundled SmolLM2-135M-Instruct
(or any Llama-family HF checkpoint directory)."""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="nxdi-generate", description=__doc__)
    p.add_argument("prompt", nargs="?", default="What is the capital of France?",
                   help="the user message (the model's chat template is applied)")
    p.add_argument("--model", help="HF checkpoint directory (default: the bundled SmolLM2)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--backend", choices=("compiled", "eager"), default="compiled",
                   help="compiled: traced per bucket and cached; eager: plain torch")
    p.add_argument("--compiled-root", help="folder for compiled models, one sub-folder per "
                   "configuration (default: next to the model under the cache)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    return p.parse_args(argv)


def build_model(args, model_dir: Path):
    import torch
    from nxdi_common.config import NeuronConfig, OnDeviceSamplingConfig
    from nxdi_common.models.llama import NeuronLlamaForCausalLM
    from nxdi_common.runtime import keep_large_buffers_in_heap
    keep_large_buffers_in_heap()
    nc = NeuronConfig(batch_size=1, seq_len=args.seq_len, torch_dtype=getattr(torch, args.dtype),
                      enable_bucketing=True, backend="cpu", fused_qkv=True,
                      on_device_sampling_config=OnDeviceSamplingConfig(dynamic=True, do_sample=True))
    model = NeuronLlamaForCausalLM(str(model_dir), neuron_config=nc)
    if args.backend == "eager":
        model.to_cpu()
        return model
    # The folder is named by the config, so a changed config never meets a stale compiled folder.
    key = hashlib.sha256(model.config.to_json_string().encode()).hexdigest()[:12]
    compiled = Path(args.compiled_root or model_dir.parent / "compiled") / f"{model_dir.name}-{key}"
    if not (compiled / "nxdi_manifest.json").is_file():
        _log(f"compiling to {compiled} (first run only; reused from the compile cache after)")
        model.compile(str(compiled))
    model.load(str(compiled))
    return model


def _log(msg: str) -> None:
    print(f"[nxdi-generate] {msg}", file=sys.stderr, flush=True)


def encode_prompt(tokenizer, prompt: str, raw: bool):
    if raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer(prompt, return_tensors="pt")
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer
    from nxdi_common.bundled import prepare_bundled_model
    from nxdi_common.generation import HuggingFaceGenerationAdapter
    model_dir = Path(args.model) if args.model else prepare_bundled_model()
    start = time.perf_counter()
    model = build_model(args, model_dir)
    _log(f"model ready in {time.perf_counter() - start:.1f} s ({args.backend}, {args.dtype})")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    inputs = encode_prompt(tokenizer, args.prompt, args.raw)
    start = time.perf_counter()
    out = HuggingFaceGenerationAdapter(model).generate(
        inputs.input_ids, attention_mask=inputs.attention_mask, max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed)
    elapsed = time.perf_counter() - start
    new = out[0, inputs.input_ids.shape[1]:]
    print(tokenizer.decode(new, skip_special_tokens=True))
    _log(f"{len(new)} tokens in {elapsed:.2f} s ({len(new) / elapsed:.1f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
