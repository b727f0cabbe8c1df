"""GFLOP/s of the AMX-BF16 GEMM (schedules/cpu/amx_bf16.py) against torch.matmul in bfloat16
and float32 and our GEMM rule on vdpbf16ps, at equal thread counts, on llama-110m and
llama-1b linear shapes: C (M x N) = A (M x K) @ W^T.

Each thread count runs in its own process (TVM's thread pool is sized once, from
TVM_NUM_THREADS, at first use). The AMX kernel writes float32; the vdpbf16ps GEMM (built as
scripts/bench_bf16_gemm.py builds it) also rounds its output to bfloat16, as a bf16 model does;
torch bf16 returns bfloat16 (oneDNN, which may itself use AMX). Best of --rounds, wall time.

    python scripts/bench_amx_gemm.py [--threads 2,1] [--rows 128,512] [--rounds 5] [--no-dot]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = [("110m qkv", 768, 2304), ("110m o", 768, 768), ("110m gate_up", 768, 4096),
          ("110m down", 2048, 768), ("1b o", 2048, 2048), ("1b gate_up", 2048, 11264),
          ("1b down", 5632, 2048)]
COLS = ["amx", "dot", "torch_bf16", "torch_f32"]


def _parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="2,1", help="comma list; one process each")
    p.add_argument("--rows", default="128,512")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-dot", action="store_true", help="skip the vdpbf16ps GEMM (slow build)")
    return p.parse_args()


def _best(f, rounds):
    f()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def run_one(threads: int, rows, rounds: int, dot: bool):
    """In a process whose TVM_NUM_THREADS is already set: {(shape, M): {column: GFLOP/s}}."""
    sys.path.insert(0, os.path.join(HERE, ".."))
    import ml_dtypes
    import numpy as np
    import torch
    import tvm

    from schedules.cpu import amx_bf16
    from tvm_llm.targets import get_target
    from tvm_llm.targets.llvm import request_amx_permission

    granted, why = request_amx_permission()
    if not granted:
        raise SystemExit(f"no AMX: {why}")
    torch.set_num_threads(threads)
    target = get_target("llvm").tvm_target()
    vm = None
    if dot:
        sys.argv = [sys.argv[0], "--threads", str(threads)]
        sys.path.insert(0, HERE)
        import bench_bf16_gemm as b16  # builds with the GEMM rule as the build does

        names = [(f"s{i}", K, N) for i, (_, K, N) in enumerate(SHAPES)]
        vm, _ = b16.build(names, "bfloat16", True, b16.workloads.host_target(threads))
    rng = np.random.default_rng(0)
    res = {}
    for i, (name, K, N) in enumerate(SHAPES):
        func = amx_bf16.amx_bf16_matmul_func(K, N).with_attr("global_symbol", "main")
        ex = tvm.compile(tvm.IRModule({"main": func}), target=target)
        w = rng.standard_normal((N, K)).astype(ml_dtypes.bfloat16)
        bp = tvm.runtime.tensor(amx_bf16.pack_weight(w))
        wp = vm[f"s{i}_transform_params"]([tvm.runtime.tensor(w)]) if vm else None
        wt = torch.from_numpy(w.astype(np.float32))
        for M in rows:
            a = rng.standard_normal((M, K)).astype(ml_dtypes.bfloat16)
            at, ct = tvm.runtime.tensor(a), tvm.runtime.tensor(np.zeros((M, N), np.float32))
            xf = torch.from_numpy(a.astype(np.float32))
            xb, wb = xf.bfloat16(), wt.bfloat16()
            t = {"amx": _best(lambda: ex(at, bp, ct), rounds),
                 "torch_bf16": _best(lambda: torch.matmul(xb, wb.T), rounds),
                 "torch_f32": _best(lambda: torch.matmul(xf, wt.T), rounds)}
            if vm:
                x3 = tvm.runtime.tensor(a.reshape(1, M, K))
                t["dot"] = _best(lambda: vm[f"s{i}"](x3, *wp), rounds)
            res[(name, M)] = {k: 2.0 * M * K * N / v / 1e9 for k, v in t.items()}
    return res


def main():
    args = _parse()
    rows = [int(r) for r in args.rows.split(",")]
    if "_AMX_BENCH_CHILD" in os.environ:
        print(repr(run_one(int(os.environ["TVM_NUM_THREADS"]), rows, args.rounds,
                           not args.no_dot)))
        return
    for threads in [int(t) for t in args.threads.split(",")]:
        env = dict(os.environ, TVM_NUM_THREADS=str(threads), _AMX_BENCH_CHILD="1")
        out = subprocess.run([sys.executable, __file__, "--rows", args.rows, "--rounds",
                              str(args.rounds)] + (["--no-dot"] if args.no_dot else []),
                             env=env, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"{threads} thread(s) failed:\n{out.stderr[-3000:]}")
        out = out.stdout
        res = eval(out.strip().splitlines()[-1])  # noqa: S307 (our own child's repr)
        print(f"\n{threads} thread(s), GFLOP/s, best of {args.rounds} (wall time)")
        cols = [c for c in COLS if any(c in v for v in res.values())]
        print(f"{'shape':14s} {'K':>5s} {'N':>6s} {'M':>4s} " + " ".join(f"{c:>10s}" for c in cols)
              + "  amx/torch_bf16 amx/torch_f32" + ("  amx/dot" if "dot" in cols else ""))
        for name, K, N in SHAPES:
            for M in rows:
                g = res[(name, M)]
                line = (f"{name:14s} {K:5d} {N:6d} {M:4d} " + " ".join(f"{g[c]:10.1f}" for c in cols)
                        + f"  {g['amx'] / g['torch_bf16']:14.2f} {g['amx'] / g['torch_f32']:13.2f}")
                print(line + (f"  {g['amx'] / g['dot']:7.2f}" if "dot" in g else ""))


if __name__ == "__main__":
    main()
