"""GEMM-only GFLOP/s of the CPU GEMM rule on llama-110m's linear shapes: float32, bfloat16
widened to float32 (vpmovzxwd + vpslld + FMA), and bfloat16 on vdpbf16ps (AVX512-BF16).

Each kernel is y = x @ W^T with x (1, n, K) and the weight prepacked once (as the build does);
bfloat16 kernels sum in float32 and round the output to bfloat16 (AccumulateHalfMatmulInFloat32).
Best of --rounds, wall time at --threads threads (or the thread's CPU time with --threads 1
--cpu-time, steadier on a shared machine).

    python scripts/bench_bf16_gemm.py [--rows 128,512] [--threads 2] [--rounds 5]
    python scripts/bench_bf16_gemm.py --threads 1 --cpu-time
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# (name, K, N): llama-110m (hidden 768, intermediate 2048, 12 heads, vocabulary 32000)
SHAPES = [("qkv", 768, 2304), ("o", 768, 768), ("gate_up", 768, 4096), ("down", 2048, 768),
          ("lm_head", 768, 32000)]


def _parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="128,512", help="comma list of n (tokens)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("TVM_NUM_THREADS", "2")))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", default="", help="comma list of shape names to keep")
    p.add_argument("--cpu-time", action="store_true",
                   help="with --threads 1: time with the thread's CPU time, which a busy shared "
                        "machine inflates much less than wall time")
    return p.parse_args()


ARGS = _parse()
if ARGS.cpu_time and ARGS.threads != 1:
    raise SystemExit("--cpu-time needs --threads 1 (other threads' CPU time is not counted)")
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.s_tir import dlight as dl  # noqa: E402

import cpu_workloads as workloads  # noqa: E402  (tests/cpu_workloads.py)
from schedules.cpu import cpu_rules  # noqa: E402
from schedules.cpu.gemm import GEMM  # noqa: E402
from tvm_llm.passes.accumulate_half_matmul import AccumulateHalfMatmulInFloat32  # noqa: E402

VARIANTS = [("fp32", "float32", True), ("bf16-widen", "bfloat16", False),
            ("bf16-dot", "bfloat16", True)]


def clock():
    return time.thread_time() if ARGS.cpu_time else time.perf_counter()


def build(shapes, dtype, bf16_dot, target):
    mod = workloads.linear_suite([dict(name=n, K=k, N=nn, mode="prefill", dtype=dtype)
                                  for n, k, nn in shapes],
                                 graph_passes=[AccumulateHalfMatmulInFloat32()])
    mod = relax.transform.AttachAttrLayoutFreeBuffers()(mod)
    rules = [GEMM(bf16_dot=bf16_dot) if isinstance(r, GEMM) else r for r in cpu_rules()]
    with target:
        mod = dl.ApplyDefaultSchedule(*rules)(mod)
        mod = relax.transform.SplitLayoutRewritePreproc()(mod)
        mod = relax.transform.LiftTransformParams()(mod)
    ex = tvm.compile(mod, target=target)
    asm = "".join(m.inspect_source("asm") for m in [ex.mod, *ex.mod.imports] if m.kind == "llvm")
    return relax.VirtualMachine(ex, tvm.cpu()), asm.count("vdpbf16ps")


def main():
    target = workloads.host_target(ARGS.threads)
    shapes = [s for s in SHAPES if not ARGS.only or s[0] in ARGS.only.split(",")]
    rows = [int(r) for r in ARGS.rows.split(",")]
    rng = np.random.default_rng(0)
    dev = tvm.cpu()
    print(f"target {target.attrs['mcpu']}, {ARGS.threads} threads, best of {ARGS.rounds}"
          + (" (CPU time)" if ARGS.cpu_time else " (wall time)"))
    results = {}
    for label, dtype, dot in VARIANTS:
        vm, n_dot = build(shapes, dtype, dot, target)
        np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
        for name, K, N in shapes:
            w = rng.standard_normal((N, K)).astype(np.float32).astype(np_dtype)
            wp = vm[f"{name}_transform_params"]([tvm.runtime.tensor(w, dev)])
            for n in rows:
                x = tvm.runtime.tensor(rng.standard_normal((1, n, K)).astype(np.float32)
                                       .astype(np_dtype), dev)
                f = vm[name]
                f(x, *wp)
                best = float("inf")
                for _ in range(ARGS.rounds):
                    t0 = clock()
                    f(x, *wp)
                    best = min(best, clock() - t0)
                results[(label, name, n)] = 2.0 * n * K * N / best / 1e9
        print(f"{label}: {n_dot} vdpbf16ps in the module")
    print(f"{'shape':10s} {'n':>5s} " + " ".join(f"{v[0]:>11s}" for v in VARIANTS)
          + "   dot/widen")
    for name, K, N in shapes:
        for n in rows:
            g = [results[(v[0], name, n)] for v in VARIANTS]
            print(f"{name:10s} {n:5d} " + " ".join(f"{x:11.1f}" for x in g)
                  + f"   {g[2] / g[1]:9.2f}")
    for n in rows:
        tot = {v[0]: sum(2.0 * n * K * N for _, K, N in shapes)
               / sum(2.0 * n * K * N / results[(v[0], nm, n)] for nm, K, N in shapes)
               for v in VARIANTS}
        print(f"all shapes n={n}: " + ", ".join(f"{k} {x:.1f} GFLOP/s" for k, x in tot.items()))


if __name__ == "__main__":
    main()
