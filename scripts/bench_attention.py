#!/usr/bin/env python
"""Time the CPU attention kernels alone (schedules/cpu/attention.py) on the llama-110m shape.

    python scripts/bench_attention.py [--threads 2] [--heads 12 --kv-heads 4 --head-dim 64]
        [--contexts 64,128,256,512] [--batches 1] [--cold] [--baseline REV]

decode: one query token per sequence over the cached tokens of --contexts, each batch size of
--batches (GB/s of K and V read), the decode kernel built for --threads cores (the build passes
the target's); --cold rotates over copies of the cache (96 MiB in all) so that K/V come from
memory as in a model step, where the weights stream through the caches between two calls of a
layer; with --baseline the git revision's kernel is timed beside the current one, round by
round (median of --rounds, with min and max: on a shared machine compare within a run).
prefill: the ragged causal prefill over 128 and 512 new tokens (GFLOP/s of the causal q.k and
p.v products), and the paged prefill of 512 new tokens over 512 and 1536 cached ones in pages of
--page tokens (a long prompt's second and fourth chunk), the fastest of several runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


COLD_BYTES = 96 << 20  # --cold: K/V copies rotated per call, 3x the 32 MiB L3 of our machines


def _load_baseline(rev: str):
    """schedules/cpu/attention.py as of git `rev`, imported beside the current one."""
    import importlib.util
    import subprocess
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = subprocess.run(["git", "show", f"{rev}:schedules/cpu/attention.py"], cwd=root,
                          check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "attention_baseline.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("schedules.cpu.attention_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--only", choices=("decode", "prefill"), default=None)
    ap.add_argument("--contexts", default="128,512,2048", help="decode: cached tokens, comma list")
    ap.add_argument("--batches", default="1,8", help="decode: sequences per call, comma list")
    ap.add_argument("--cold", action="store_true",
                    help="decode: rotate over copies of the cache (K/V read from memory)")
    ap.add_argument("--rounds", type=int, default=7, help="decode: interleaved timing rounds")
    ap.add_argument("--baseline", metavar="REV", default=None,
                    help="also time schedules/cpu/attention.py as of git REV, interleaved")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import numpy as np
    import tvm

    import schedules.cpu.attention as current
    versions = {"": current}
    if args.baseline:
        versions = {"now  ": current, "base ": _load_baseline(args.baseline)}
    from tvm_llm.targets.llvm import LLVMTarget

    target = LLVMTarget().tvm_target()
    H_kv, H, D, P, dt = args.kv_heads, args.heads, args.head_dim, args.page, args.dtype

    def prefill_kw(module, func) -> dict:
        """The build's AMX choice (targets/llvm.py) for a version whose kernels take it."""
        import inspect

        from schedules.cpu.amx_bf16 import target_has_amx
        from tvm_llm.targets.llvm import request_amx_permission

        if "amx" not in inspect.signature(getattr(module, func)).parameters:
            return {}
        return {"amx": target_has_amx(target) and request_amx_permission()[0]}
    dev = tvm.cpu()
    rng = np.random.default_rng(0)

    def t(a):
        return tvm.runtime.tensor(a, dev)

    def cast(a):  # the kernels' dtype: q, pages and output alike
        if dt in ("float32", "float16"):
            return a.astype(dt)
        import ml_dtypes
        return a.astype(ml_dtypes.bfloat16)

    def timeit(f, *a, n=None):
        f(*a)
        reps = n or 5
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            inner = 20
            for _ in range(inner):
                f(*a)
            times.append((time.perf_counter() - t0) / inner)
        return min(times)  # the least disturbed run (the machine may be shared)

    if args.only in (None, "decode"):
        import inspect

        def decode_kernel(m):
            kw = {}
            if "threads" in inspect.signature(m.decode_attention_func).parameters:
                kw["threads"] = args.threads  # the build passes the target's cores
            return tvm.compile(tvm.IRModule({"main": m.decode_attention_func(
                H_kv, H, D, dt, P, **kw)}), target=target)["main"]

        decs = {k: decode_kernel(m) for k, m in versions.items()}
        for B in batches:
            for ctx in contexts:
                npg = -(-ctx // P)
                nbytes = B * ctx * 2 * H_kv * D * (4 if dt == "float32" else 2)
                # --cold: enough copies of the cache that each call reads K/V from memory
                # (past a 32 MiB L3), as in a model step where the weights stream in between
                copies = max(1, -(-COLD_BYTES // nbytes)) if args.cold else 1
                pools = [t(cast(rng.standard_normal((B * npg + 1, 2, H_kv, P, D))))
                         for _ in range(copies)]
                indptr = t(np.arange(B + 1, dtype="int32") * npg)
                values = t(rng.permutation(B * npg).astype("int32"))
                last = t(np.full(B, (ctx - 1) % P + 1, "int32"))
                zeros = t(np.zeros(B, "int32"))
                pos = t(np.full(B, ctx - 1, "int32"))
                q = t(cast(rng.standard_normal((B, H, D))))
                out = t(cast(np.zeros((B, H, D))))
                lse = t(np.zeros((B, H), "float32"))
                per = {name: [] for name in decs}
                inner = max(copies, 20)
                for _ in range(args.rounds):  # versions interleaved round by round
                    for name, dec in decs.items():
                        dec(q, pools[0], indptr, values, last, zeros, pos, out, lse, 0, 1.0,
                            1e4, 0.125)
                        t0 = time.perf_counter()
                        for i in range(inner):
                            dec(q, pools[i % copies], indptr, values, last, zeros, pos, out,
                                lse, 0, 1.0, 1e4, 0.125)
                        per[name].append((time.perf_counter() - t0) / inner)
                for name, secs in per.items():
                    sec = statistics.median(secs)
                    print(f"{name}decode  batch {B} context {ctx:5d}{' cold' if args.cold else ''}:"
                          f" {sec * 1e6:8.1f} us  {nbytes / sec / 1e9:6.1f} GB/s  (median of "
                          f"{args.rounds} rounds, min {min(secs) * 1e6:.1f} max "
                          f"{max(secs) * 1e6:.1f} us)", flush=True)
    if args.only in (None, "prefill"):
        rags = {k: tvm.compile(tvm.IRModule({"main": m.prefill_ragged_attention_func(
            H_kv, H, D, dt, **prefill_kw(m, "prefill_ragged_attention_func"))}),
            target=target)["main"] for k, m in versions.items()}
        for n in (128, 512):
            q = t(cast(rng.standard_normal((n, H, D))))
            k = t(cast(rng.standard_normal((n, H_kv, D))))
            v = t(cast(rng.standard_normal((n, H_kv, D))))
            ind = t(np.array([0, n], "int32"))
            qpos = t(np.arange(n, dtype="int32"))
            koff = t(np.zeros(1, "int32"))
            out = t(cast(np.zeros((n, H, D))))
            lse = t(np.zeros((n, H), "float32"))
            flops = 2 * 2 * H * D * n * (n + 1) / 2
            for name, rag in rags.items():
                sec = timeit(rag, q, ind, k, v, ind, qpos, koff, out, lse, 1, 0, 1.0, 1e4, 0.125,
                             n=3)
                print(f"{name}prefill ragged {n:4d} tokens: {sec * 1e3:8.3f} ms  "
                      f"{flops / sec / 1e9:6.1f} GFLOP/s", flush=True)
        pageds = {k: tvm.compile(tvm.IRModule({"main": m.prefill_paged_attention_func(
            H_kv, H, D, dt, P, **prefill_kw(m, "prefill_paged_attention_func"))}),
            target=target)["main"] for k, m in versions.items()}
        n = 512
        for cached in (512, 1536):  # a prompt's later chunk over the earlier chunks' pages
            n_pages = cached // P
            pages = t(cast(rng.standard_normal((n_pages, 2, H_kv, P, D))))
            q = t(cast(rng.standard_normal((n, H, D))))
            args = (q, t(np.array([0, n], "int32")), pages, t(np.array([0, n_pages], "int32")),
                    t(np.arange(n_pages, dtype="int32")), t(np.array([P], "int32")),
                    t(np.zeros(1, "int32")), t(np.arange(cached, cached + n, dtype="int32")),
                    t(cast(np.zeros((n, H, D)))), t(np.zeros((n, H), "float32")))
            flops = 2 * 2 * H * D * n * cached
            for name, paged in pageds.items():
                sec = timeit(paged, *args, 0, 0, 1.0, 1e4, 0.125, n=3)
                print(f"{name}prefill paged {n:4d} tokens over {cached:4d} cached: "
                      f"{sec * 1e3:8.3f} ms  {flops / sec / 1e9:6.1f} GFLOP/s", flush=True)


if __name__ == "__main__":
    main()
