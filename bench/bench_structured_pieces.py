"""What a constrained row costs the decode worker per token, piece by piece (one thread, one row
of bf16 logits, the bundled tokenizer, bench_structured.py's schema fed a fixed answer): the
mask, the biased/masked logits (mask included), the host sampling, feeding the token back; and
compiling the schema.

    .venv/bin/python bench/bench_structured_pieces.py"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_structured import SCHEMA  # noqa: E402

from nxdi_common.bundled import bundled_model_dir  # noqa: E402
from nxdi_common.serving.sampling import host_logits, sample_row  # noqa: E402
from nxdi_common.serving.structured import GrammarCompiler  # noqa: E402
from nxdi_common.serving.types import SamplingOptions, StructuredOutput  # noqa: E402

ANSWER = '{\n    "name": "Sneaky Sneak",\n    "age": 25,\n    "city": "Cherry"\n}'


def main() -> None:
    from transformers import AutoTokenizer
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(bundled_model_dir())
    grammars = GrammarCompiler(lambda: tok, len(tok), [tok.eos_token_id])
    so = StructuredOutput("json_schema", json.dumps(SCHEMA))
    start = time.perf_counter()
    grammars.compile(so)
    print(f"first compile (builds llguidance's tokenizer): {1e3 * (time.perf_counter() - start):.0f} ms")
    ids = tok.encode(ANSWER)
    logits = torch.randn(len(tok)).to(torch.bfloat16)
    sampling = SamplingOptions(temperature=0.7, structured=so)
    for _ in range(4):
        start = time.perf_counter()
        c = grammars.compile(so)
        compile_ms = 1e3 * (time.perf_counter() - start)
        sums = [0.0] * 4
        for token in ids:
            t0 = time.perf_counter()
            c.allowed()
            t1 = time.perf_counter()
            row = host_logits(logits, [], sampling, c)
            t2 = time.perf_counter()
            sample_row(row, sampling, 0.5, 256)
            t3 = time.perf_counter()
            c.accept(token)
            t4 = time.perf_counter()
            for i, dt in enumerate((t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                sums[i] += dt
        us = [1e6 * s / len(ids) for s in sums]
        print(f"compile {compile_ms:.1f} ms; per token: mask {us[0]:.0f} us, masked logits "
              f"(mask included) {us[1]:.0f} us, sampling {us[2]:.0f} us, feeding back {us[3]:.0f} us")


if __name__ == "__main__":
    main()
