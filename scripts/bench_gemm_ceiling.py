#!/usr/bin/env python
"""What our float32 prefill micro-kernel design reaches on this CPU without TVM: the ceiling a
GEMM kernel figure is judged against (AVX-512 CPUs).

Compiles scripts/gemm_ceiling.c (the 6x4-zmm register tile of schedules/cpu/gemm.py over a
packed 64-wide panel, written by hand) with the system C compiler and runs one copy per thread
at once (--threads, one process each: no shared thread pool), each timing a walk over --panels
panels of K x 64 floats against --rows rows of activations, hot (the same panels again) and
cold (fresh panels of a 700 MiB buffer each round), for each next-panel prefetch spread
(--spreads: 0 none, S = over the first S row tiles, -1 = over all of them). In the same run,
scripts/bench.py's sgemm probe (torch, 2048^3, best of 5) and torch's GEMM at the shape
(rows x K x 64 panels). Prints GFLOP/s of all copies together and their share of the probe.

    python scripts/bench_gemm_ceiling.py [--k 2048] [--rows 60] [--panels 88] [--threads 2]
                                         [--spreads 0,16,8,-1]

Rows are rounded down to a multiple of 6 (whole row tiles); --panels x 64 is the N walked per
timed call of each copy.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def compile_kernel(workdir: str) -> str | None:
    """The compiled gemm_ceiling binary (cc -O3 -march=native), or None after printing why
    (no C compiler, or a CPU without AVX-512)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        print("bench_gemm_ceiling: no C compiler found: install gcc or set CC", file=sys.stderr)
        return None
    exe = os.path.join(workdir, "gemm_ceiling")
    done = subprocess.run([cc, "-O3", "-march=native", "-o", exe,
                           os.path.join(HERE, "gemm_ceiling.c")], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        print(f"bench_gemm_ceiling: compiling gemm_ceiling.c failed ({last}); it needs a CPU "
              "with AVX-512", file=sys.stderr)
        return None
    return exe


def torch_figures(threads: int, rows: int, K: int, N: int) -> tuple:
    """(scripts/bench.py's sgemm probe in GFLOP/s, torch's GEMM at rows x K x N, best of 5)."""
    import torch

    from bench import machine_limits

    probe = machine_limits(threads)["sgemm_GFLOP_s"]
    torch.set_num_threads(threads)
    a, b = torch.randn(rows, K), torch.randn(K, N)
    a @ b
    top = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(5):
            a @ b
        top = max(top, 2 * rows * K * N * 5 / (time.perf_counter() - t0) / 1e9)
    return probe, top


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--rows", type=int, default=60)
    p.add_argument("--panels", type=int, default=88)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--spreads", default="0,16,8,-1")
    args = p.parse_args(argv)
    rows = args.rows // 6 * 6
    if rows < 6 or args.k < 1 or args.panels < 1 or args.threads < 1:
        print("bench_gemm_ceiling: --rows must be at least 6, --k, --panels and --threads at "
              "least 1", file=sys.stderr)
        return 2
    spreads = [s.strip() for s in args.spreads.split(",") if s.strip()]
    if not spreads or not all(s.lstrip("-").isdigit() and int(s) >= -1 for s in spreads):
        print(f"bench_gemm_ceiling: --spreads takes a comma list of integers >= -1, not "
              f"{args.spreads!r} (0: no next-panel prefetch, -1: over every row tile)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        exe = compile_kernel(tmp)
        if exe is None:
            return 2
        cmd = [exe, str(args.k), str(rows), str(args.panels)] + spreads
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(args.threads)]
        outs = [pr.communicate() for pr in procs]
    for pr, (_, err) in zip(procs, outs):
        if pr.returncode != 0:
            print(f"bench_gemm_ceiling: {err.strip()}", file=sys.stderr)
            return 2
    probe, torch_shape = torch_figures(args.threads, rows, args.k, 64 * args.panels)
    per = {}  # spread -> [(hot, cold) per copy]
    for out, _ in outs:
        for line in out.split("\n"):
            if line.strip():
                s, hot, cold = line.split()
                per.setdefault(s, []).append((float(hot), float(cold)))
    print(f"# {args.threads} copies at once, K={args.k}, rows={rows}, {args.panels} panels of 64 "
          f"per walk; torch sgemm probe {probe:.0f} GFLOP/s, torch at {rows}x{args.k}x"
          f"{64 * args.panels} {torch_shape:.0f} GFLOP/s ({torch_shape / probe:.2f} of the probe)")
    print(f"{'spread':>8} {'hot GF/s':>10} {'(probe)':>8} {'cold GF/s':>10} {'(probe)':>8}")
    for s in spreads:
        hot = sum(h for h, _ in per[s])
        cold = sum(c for _, c in per[s])
        name = {"0": "none", "-1": "all"}.get(s, s)
        print(f"{name:>8} {hot:10.0f} {hot / probe:8.2f} {cold:10.0f} {cold / probe:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
