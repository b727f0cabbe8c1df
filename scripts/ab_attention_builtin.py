#!/usr/bin/env python
"""Interleaved A/B of the paged-attention builtin alone, per layer, in built outputs.

    python scripts/ab_attention_builtin.py OUT_A OUT_B [...] [--threads 2] [--context 128]
                                          [--batch 1] [--rounds 12] [--calls 2000]

Each build gets --batch sequences prefilled with --context random tokens and one decode token
begun (kv_state_begin_forward); then every round times --calls calls of
`vm.builtin.attention_kv_cache_attention_with_fused_qkv` per build (layer 0, 1, ... in turn,
the same token re-appended), builds in turn, the order reversed every other round. That is
what the model's decode step runs per layer: the q/k/v split, the K/V append and the decode
attention kernel, with the cache's own per-call work. Prints each build's median and minimum
microseconds per call (one Python call each, ~0.1 us, is included). On a shared machine compare
builds within one run; at 1 thread the figures are steadier (no thread-pool wake-up).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _setup(out: str, threads: int, context: int, batch: int):
    import numpy as np
    import tvm

    from tvm_llm import Engine

    eng = Engine(out, num_threads=threads, max_batch_size=batch)
    prompt = [int(t) for t in np.random.default_rng(0).integers(10, 200, size=context)]
    sids = [eng.cache.add() for _ in range(batch)]
    for sid in sids:
        eng.prefill([(sid, prompt)])
    model = json.load(open(os.path.join(out, "manifest.json")))["model"]
    heads, kv_heads, dim = model["num_heads"], model["num_kv_heads"], model["head_dim"]
    rng = np.random.default_rng(1)
    qkv = tvm.runtime.tensor(
        rng.standard_normal((batch, heads + 2 * kv_heads, dim)).astype("float32"))
    out_rows = tvm.runtime.tensor(np.zeros((batch, heads, dim), "float32"))
    cache = eng.cache
    cache._f["kv_state_begin_forward"](cache.handle, cache._shape(sids), cache._shape([1] * batch))
    return eng, cache, qkv, out_rows, model["num_layers"], 1.0 / dim ** 0.5


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outs", nargs="+", metavar="OUT", help="built output directories (float32)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import tvm

    attend = tvm.get_global_func("vm.builtin.attention_kv_cache_attention_with_fused_qkv")
    builds = [_setup(o, args.threads, args.context, args.batch) for o in args.outs]
    times = [[] for _ in builds]
    for r in range(args.rounds):
        order = list(range(len(builds)))
        for k in (order if r % 2 == 0 else order[::-1]):
            _, cache, qkv, out_rows, layers, scale = builds[k]
            t0 = time.perf_counter()
            for i in range(args.calls):
                attend(cache.handle, i % layers, scale, qkv, out_rows)
            times[k].append((time.perf_counter() - t0) / args.calls * 1e6)
    print(f"# attention builtin per layer: {args.context} cached tokens, batch {args.batch}, "
          f"{args.threads} threads, {args.rounds} rounds of {args.calls} calls")
    for out, t in zip(args.outs, times):
        print(f"{os.path.basename(out.rstrip('/'))[:40]:<42}median {statistics.median(t):7.2f} us"
              f"   min {min(t):7.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
