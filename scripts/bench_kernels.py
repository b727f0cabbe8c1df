#!/usr/bin/env python
"""Benchmark the CPU matmul kernels of schedules/cpu on Llama linear shapes.

For llama-110m and llama-1b (qkv, o, gate_up, down, lm_head), prefill (x: 1 x n x K, n=128)
and decode (x: b x 1 x K, b=1), it times:

  packed   our GEMM rule, weights prepacked once (build-time layout, as the build folds it)
  rowmaj   our GEMV rule on the row-major (N, K) weight (what runs without prepacking)
  default  TVM's default build of the same kernel (no schedule), for a few small shapes
  torch    torch.nn.functional.linear at the same thread count
  numpy    x @ W.T (OpenBLAS) at the same thread count

and prints ms, GFLOP/s, GB/s (weight bytes / time), and the fraction of the machine's
measured sgemm peak (prefill) or read bandwidth (decode). Decode cycles over enough copies of
the weight to defeat the last-level cache, so it reports DRAM bandwidth. The machine is shared:
every candidate is measured in interleaved rounds and the best round is kept; compare ratios
from the same run.

    TVM_NUM_THREADS=2 python scripts/bench_kernels.py [--threads 2] [--models 110m,1b]
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=int(os.environ.get("TVM_NUM_THREADS", "2")))
    p.add_argument("--models", default="110m,1b")
    p.add_argument("--prefill", type=int, default=128, help="prefill tokens n")
    p.add_argument("--batch", type=int, default=1, help="decode batch b")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gap", type=float, default=0.2,
                   help="seconds of sleep before each timed candidate, so that the pool timed "
                        "before (torch's OpenMP, numpy's OpenBLAS) has stopped spinning: they "
                        "took a core from the kernel timed next (5 ms llama-1b qkv / o prefill "
                        "calls of our GEMM ran at one thread's speed, ~2x slower than alone)")
    p.add_argument("--no-default", action="store_true", help="skip TVM's unscheduled kernels")
    p.add_argument("--rotate-mb", type=int, default=384,
                   help="decode cycles over weight copies totalling at least this many MB")
    p.add_argument("--only", default="", help="comma list of layer names to keep (e.g. qkv,down)")
    p.add_argument("--gemm-tiles", default="",
                   help="comma list of packed-GEMM register tiles MrxNv to time besides the "
                        "CPU's default (e.g. 7x2,4x3,6x4): measures a row of schedules/cpu/microarch.py")
    p.add_argument("--decode-streams", default="",
                   help="comma list of decode stream counts to time the packed GEMV at (packed "
                        "panels one row walks at once, e.g. 1,2,4)")
    p.add_argument("--cpu-time", action="store_true",
                   help="with --threads 1: time with the thread's CPU time (time.thread_time), "
                        "which a busy shared machine inflates much less than wall time")
    return p.parse_args()


ARGS = _parse()
if ARGS.cpu_time and ARGS.threads != 1:
    raise SystemExit("--cpu-time needs --threads 1 (other threads' CPU time is not counted)")
# Thread pools are sized when the libraries load: set the environment first.
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

import cpu_workloads as workloads  # noqa: E402  (tests/cpu_workloads.py)
from schedules.cpu import common, cpu_schedule_pass  # noqa: E402
from schedules.cpu.pipeline import cpu_tir_pipeline  # noqa: E402

torch.set_num_threads(ARGS.threads)

MODELS = {
    # name: (hidden, intermediate, heads, kv_heads, head_dim, vocab)
    "110m": (768, 2048, 12, 4, 64, 32000),
    "1b": (2048, 5632, 32, 4, 64, 32000),
}


def linear_shapes(model):
    h, inter, nh, nkv, hd, vocab = MODELS[model]
    return [("qkv", h, (nh + 2 * nkv) * hd), ("o", nh * hd, h), ("gate_up", h, 2 * inter),
            ("down", inter, h), ("lm_head", h, vocab)]


def host_target():
    return workloads.host_target(ARGS.threads)


def tiles():
    return [tuple(int(v) for v in t.split("x")) for t in ARGS.gemm_tiles.split(",") if t]


def tile_label(t):
    return t if isinstance(t, str) else "%dx%d" % t


def schedule_pass(tile):
    """Our CPU rules, the packed GEMM at register tile `tile` when one is given."""
    if tile is None:
        return cpu_schedule_pass()
    from tvm.s_tir import dlight as dl

    from schedules.cpu import cpu_rules
    from schedules.cpu.gemm import GEMM

    kw = dict(decode_streams=int(tile[1:])) if isinstance(tile, str) else dict(tile=tile)
    rules = [GEMM(**kw) if isinstance(r, GEMM) else r for r in cpu_rules()]
    return dl.ApplyDefaultSchedule(*rules)


def build(specs, mode, tile=None):
    """mode: packed | rowmaj | default -> VirtualMachine with one function per spec."""
    target = host_target()
    mod = workloads.linear_suite(specs)
    with target:
        if mode == "packed":
            mod = relax.transform.AttachAttrLayoutFreeBuffers()(mod)
        if mode in ("packed", "rowmaj"):
            mod = schedule_pass(tile)(mod)
            bad = [k for k, f in workloads.prim_funcs(mod).items()
                   if not f.attrs.get("tirx.is_scheduled", False)]
            assert not bad, f"unscheduled kernels: {bad}"
        if mode == "packed":
            mod = relax.transform.SplitLayoutRewritePreproc()(mod)
            mod = relax.transform.LiftTransformParams()(mod)
    t0 = time.perf_counter()
    ex = tvm.compile(mod, target=target, tir_pipeline=cpu_tir_pipeline())
    print(f"  built {mode}{' ' + tile_label(tile) if tile else ''} ({len(specs)} kernels) in {time.perf_counter() - t0:.1f}s", flush=True)
    return relax.VirtualMachine(ex, tvm.cpu())


def best_of(fns: dict, rounds: int) -> dict:
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            time.sleep(ARGS.gap)
            best[k] = min(best[k], f())
    return best


def clock():
    return time.thread_time() if ARGS.cpu_time else time.perf_counter()


def timed(call, iters):
    def run():
        t0 = clock()
        for i in range(iters):
            call(i)
        return (clock() - t0) / iters
    return run


def measure_peaks(rounds):
    """Read bandwidth (torch sum over 256 MB at the thread count) and sgemm peak (2048^3)."""
    a = torch.ones(64 << 20, dtype=torch.float32)
    x = torch.randn(2048, 2048)
    y = torch.randn(2048, 2048)

    def bw():
        t0 = clock()
        a.sum()
        return clock() - t0

    def mm():
        t0 = clock()
        torch.mm(x, y)
        return clock() - t0

    best = best_of({"bw": bw, "mm": mm}, rounds * 2)
    return a.numel() * 4 / best["bw"] / 1e9, 2 * 2048 ** 3 / best["mm"] / 1e9


def main():
    dev = tvm.cpu()
    target = host_target()
    print(f"target {target}  isa={common.vector_isa(target)}  threads={ARGS.threads}")
    rows = []
    only = set(filter(None, ARGS.only.split(",")))
    for model in ARGS.models.split(","):
        shapes = [s for s in linear_shapes(model) if not only or s[0] in only]
        for phase in ("prefill", "decode"):
            mode_arg = "prefill" if phase == "prefill" else "decode"
            M = ARGS.prefill if phase == "prefill" else ARGS.batch
            specs = [dict(name=f"{name}", K=K, N=N, mode=mode_arg) for name, K, N in shapes]
            print(f"{model} {phase}: building", flush=True)
            vms = {"packed": build(specs, "packed"), "rowmaj": build(specs, "rowmaj")}
            streams = ["s" + v for v in ARGS.decode_streams.split(",") if v]
            for t in (tiles() if phase == "prefill" else streams):
                vms["packed:" + tile_label(t)] = build(specs, "packed", t)
            small = [s for s in specs if s["K"] * s["N"] <= 768 * 1280] if not ARGS.no_default else []
            if small:
                vms["default"] = build(small, "default")
            rng = np.random.default_rng(0)
            for name, K, N in shapes:
                w = rng.standard_normal((N, K)).astype("float32")
                xs = (1, M, K) if phase == "prefill" else (M, 1, K)
                x = rng.standard_normal(xs).astype("float32")
                ref = x @ w.T
                ncopy = 1
                if phase == "decode":
                    ncopy = max(2, -(-(ARGS.rotate_mb << 20) // w.nbytes))
                xt = tvm.runtime.tensor(x, dev)
                fns = {}
                for vname, vm in vms.items():
                    if vname == "default" and not any(s["name"] == name for s in small):
                        continue
                    if vname.startswith("packed"):
                        packed0 = vm[f"{name}_transform_params"]([tvm.runtime.tensor(w, dev)])[0]
                        ws = [packed0] + [vm[f"{name}_transform_params"](
                            [tvm.runtime.tensor(w, dev)])[0] for _ in range(ncopy - 1)]
                    else:
                        ws = [tvm.runtime.tensor(w, dev) for _ in range(ncopy)]
                    f = vm[name]
                    out = f(xt, ws[0]).numpy()
                    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=3e-3)
                    iters = max(ncopy, 3 if vname != "default" else 1)
                    fns[vname] = timed(lambda i, f=f, ws=ws: f(xt, ws[i % len(ws)]), iters)
                tx = torch.from_numpy(x)
                tws = [torch.from_numpy(w.copy()) for _ in range(ncopy)]
                fns["torch"] = timed(lambda i: torch.nn.functional.linear(tx, tws[i % ncopy]),
                                     max(ncopy, 3))
                nws = [w.copy() for _ in range(ncopy)]
                x2 = x.reshape(-1, K)
                fns["numpy"] = timed(lambda i: x2 @ nws[i % ncopy].T, max(ncopy, 3))
                best = best_of(fns, ARGS.rounds)
                bw, peak = measure_peaks(2)
                rows.append((model, phase, name, M, K, N, best, bw, peak))
                print_row(rows[-1], header=(len(rows) == 1))
                del fns, tws, nws
    print()
    print("Summary (packed = ours with build-time packed weights; frac = of sgemm peak for "
          "prefill, of read bandwidth for decode, both measured in the same run)")
    print_table(rows)


def fmt_ms(v):
    return f"{v * 1e3:8.3f}" if v != float("inf") else "       -"


def print_row(r, header=False):
    model, phase, name, M, K, N, best, bw, peak = r
    fl = 2 * M * N * K
    by = N * K * 4
    ours = best["packed"]
    frac = (fl / ours / 1e9) / peak if phase == "prefill" else (by / ours / 1e9) / bw
    cells = " ".join(f"{k}={fmt_ms(v).strip()}ms" for k, v in best.items())
    print(f"  {model:5s} {phase:7s} {name:8s} M={M:<4d} K={K:<5d} N={N:<6d} | {cells} | ours "
          f"{fl / ours / 1e9:6.1f} GF/s {by / ours / 1e9:6.1f} GB/s frac={frac:.2f} "
          f"(bw {bw:.1f} GB/s, sgemm {peak:.0f} GF/s)", flush=True)


def print_table(rows):
    print(f"{'model':5s} {'phase':7s} {'layer':8s} {'M':>4s} {'K':>5s} {'N':>6s} | "
          f"{'packed':>8s} {'rowmaj':>8s} {'default':>8s} {'torch':>8s} {'numpy':>8s} ms | "
          f"{'GF/s':>6s} {'GB/s':>6s} {'frac':>5s} {'vs torch':>8s}")
    for model, phase, name, M, K, N, best, bw, peak in rows:
        fl = 2 * M * N * K
        by = N * K * 4
        ours = best["packed"]
        frac = (fl / ours / 1e9) / peak if phase == "prefill" else (by / ours / 1e9) / bw
        print(f"{model:5s} {phase:7s} {name:8s} {M:4d} {K:5d} {N:6d} | "
              f"{fmt_ms(best['packed'])} {fmt_ms(best['rowmaj'])} "
              f"{fmt_ms(best.get('default', float('inf')))} {fmt_ms(best['torch'])} "
              f"{fmt_ms(best['numpy'])}    | {fl / ours / 1e9:6.1f} {by / ours / 1e9:6.1f} "
              f"{frac:5.2f} {best['torch'] / ours:8.2f}")
    bw = max(r[7] for r in rows)
    peak = max(r[8] for r in rows)
    labels = [k for k in rows[0][6] if k.startswith("packed:") and not k.startswith("packed:s")] if rows else []
    if labels:
        print("packed GEMM GFLOP/s by register tile (prefill; 'packed' = the CPU's default):")
        print(f"{'model':5s} {'layer':8s} {'packed':>8s} " + " ".join(f"{k[7:]:>8s}" for k in labels))
        for model, phase, name, M, K, N, best, _, _ in rows:
            if phase == "prefill" and all(k in best for k in labels):
                gf = [2 * M * N * K / best[k] / 1e9 for k in ["packed"] + labels]
                print(f"{model:5s} {name:8s} " + " ".join(f"{v:8.1f}" for v in gf))
    dl = sorted({k for r in rows for k in r[6] if k.startswith("packed:s")}, key=lambda k: int(k[8:]))
    if dl:
        print("packed decode GB/s by streams (panels one row walks at once; 'packed' = the CPU's "
              "default), rowmaj and torch:")
        print(f"{'model':5s} {'layer':8s} {'packed':>8s} " + " ".join(f"{k[7:]:>8s}" for k in dl)
              + f" {'rowmaj':>8s} {'torch':>8s}")
        for model, phase, name, M, K, N, best, _, _ in rows:
            if phase == "decode":
                gb = [N * K * 4 / best[k] / 1e9 for k in ["packed"] + dl + ["rowmaj", "torch"]]
                print(f"{model:5s} {name:8s} " + " ".join(f"{v:8.1f}" for v in gb))
    print(f"(best measured read bandwidth {bw:.1f} GB/s, sgemm peak {peak:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
