#!/usr/bin/env python
"""Time the MLA decode attention kernel (schedules/cpu/mla_attention.py) against the general
decode kernel (schedules/cpu/attention.py) on a latent cache of one KV head.

Default shape: DeepSeek-V2-Lite's attention (16 heads, latent row 512 + 64 = 576 floats),
1024 cached tokens per sequence, batch 1 and 4. Rounds are interleaved and the best kept (the
machine may be shared: compare the two kernels from the same run).

    TVM_NUM_THREADS=2 python scripts/bench_mla_decode.py [--heads 16] [--row 576] [--tokens 1024]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--row", type=int, default=576, help="kv_lora_rank + qk_rope_head_dim")
    p.add_argument("--tokens", type=int, default=1024, help="cached tokens per sequence")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    import numpy as np
    import tvm

    from schedules.cpu.attention import decode_attention_func
    from schedules.cpu.mla_attention import latent_decode_attention_func
    from tvm_llm.targets import get_target

    target = get_target("llvm").tvm_target()
    H, D, PAGE, n = args.heads, args.row, 16, args.tokens
    kernels = {"general (attention.py)": decode_attention_func(1, H, D, "float32", page_size=PAGE),
               "latent (mla_attention.py)": latent_decode_attention_func(H, D, "float32", page_size=PAGE)}
    compiled = {k: tvm.compile(tvm.IRModule({"main": f}), target=target)["batch_decode_paged_kv_cpu"]
                for k, f in kernels.items()}
    dev, rng = tvm.cpu(), np.random.default_rng(0)
    for B in (int(b) for b in args.batches.split(",")):
        per_seq = -(-n // PAGE)
        pages = rng.standard_normal((B * per_seq, 2, 1, PAGE, D)).astype("float32")
        inputs = [tvm.runtime.tensor(a, dev) for a in (
            rng.standard_normal((B, H, D)).astype("float32"), pages,
            np.arange(0, B * per_seq + 1, per_seq, dtype="int32"),
            np.arange(B * per_seq, dtype="int32"), np.full(B, (n - 1) % PAGE + 1, "int32"),
            np.zeros(B, "int32"), np.zeros(B, "int32"))]
        out = tvm.runtime.empty((B, H, D), "float32", dev)
        lse = tvm.runtime.empty((B, H), "float32", dev)
        best = {k: float("inf") for k in compiled}
        for _ in range(args.rounds):
            for name, f in compiled.items():
                f(*inputs, out, lse, 0, 1.0, 1e4, 0.1)
                t = time.perf_counter()
                for _ in range(10):
                    f(*inputs, out, lse, 0, 1.0, 1e4, 0.1)
                best[name] = min(best[name], (time.perf_counter() - t) / 10)
        for name, sec in best.items():
            print(f"batch {B}, {n} tokens, {H} heads, row {D}: {name:28s} {sec * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
