#!/usr/bin/env python
"""The int8-activation VNNI kernel alone (schedules/cpu/int8_act_matmul.py), by rows of x.

Compiles the kernel as a build does (Relax emitter, lowering, schedule pass) for each
llama-110m linear shape and times x of M rows in the decode layout (M, 1, K) for each M in --rows (1 = decode, 2..16 = batched decode, 32+ = prefill) and prints the best time over
--repeats, the packed weight bytes read per call and the GB/s this gives (wall), the time per
row relative to M = 1 (how well a batch amortizes the weight reads), and the error against the
numpy reference. Times are the best of --repeats, wall and CPU (all threads together; on a
shared machine the CPU time is the steadier one, and the per-row and GOP/s columns use it).
`--cold` cycles over enough weight copies to defeat the last-level cache
(what decode sees); by default one copy stays hot in cache, which shows the kernel's compute.

    python scripts/bench_int8_kernel.py --threads 2 [--formats q8_0,q4_k] [--rows 1,2,4,8,16]
        [--only qkv,down] [--cold]
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", default="q8_0,q4_k")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--only", default="")
    p.add_argument("--cold", action="store_true", help="rotate weight copies past the LLC")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rotate-mb", type=int, default=96)
    return p.parse_args()


ARGS = _parse()
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import numpy as np  # noqa: E402
import tvm  # noqa: E402

import cpu_workloads as workloads  # noqa: E402  (tests/cpu_workloads.py)
from tvm_llm.quantization.formats import fake_quantize, fake_quantize_activation  # noqa: E402
from tvm_llm.quantization.scheme import stored_np  # noqa: E402
from tvm_llm.targets import get_target  # noqa: E402

SHAPES = {"qkv": (768, 1280), "o": (768, 768), "gate_up": (768, 4096), "down": (2048, 768),
          "lm_head": (768, 32000)}  # name: (K, N) of llama-110m


def compiled(fmt: str, K: int, N: int):
    """main(x (M, 1, K), *stored) -> y, lowered and compiled as a build does (the QuantizeLinear
    pass's emitter, our lowering and CPU schedule pass): a direct tvm.compile of the PrimFunc
    can generate different code for the same kernel."""
    from tvm import relax

    from schedules.cpu import cpu_schedule_pass
    from tvm_llm.passes.quantize_linear import emit_quantized_matmul
    from tvm_llm.quantization.kernels import stored_shapes

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([tvm.tirx.Var("m", "int64"), 1, K], "float32"))
    ws = [relax.Var(f"w{i}", relax.TensorType(shape, dtype))
          for i, (shape, dtype) in enumerate(stored_shapes(N, K, fmt, "vnni"))]
    with bb.function("main", [x] + ws):
        with bb.dataflow():
            y = bb.emit_output(emit_quantized_matmul(bb, x, ws, fmt, "vnni", K, N, "float32",
                                                     get_target("llvm")))
        bb.emit_func_output(y)
    target = workloads.host_target(ARGS.threads)
    with target, tvm.transform.PassContext(opt_level=3):
        mod = cpu_schedule_pass()(workloads.lower_to_tir(bb.get()))
        ex = tvm.compile(mod, target=target)
    return relax.VirtualMachine(ex, tvm.cpu())["main"]


def _time(call, copies: int):
    """(best wall seconds, best CPU seconds of all threads) per call: on a shared machine the
    CPU time is the steadier figure (the wall time includes waiting for a core)."""
    iters = max(copies, 10)
    best, best_cpu = 1e9, 1e9
    for _ in range(ARGS.repeats):
        call(0)
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(iters):
            call(i)
        best = min(best, (time.perf_counter() - t0) / iters)
        best_cpu = min(best_cpu, (time.process_time() - c0) / iters)
    return best, best_cpu


def main():
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    rows = [int(r) for r in ARGS.rows.split(",")]
    only = set(filter(None, ARGS.only.split(",")))
    print(f"threads {ARGS.threads}, weights {'cold (rotated past LLC)' if ARGS.cold else 'hot'}")
    print(f"{'shape':>8} {'fmt':>5} {'M':>3} {'wall ms':>8} {'cpu ms':>8} {'MB':>6} {'GB/s':>6} "
          f"{'cpu/row vs M=1':>13} {'GOP/cpu-s':>7} {'max rel err':>11}")
    for fmt in ARGS.formats.split(","):
        for name, (K, N) in SHAPES.items():
            if only and name not in only:
                continue
            w = (rng.standard_normal((N, K)) * 0.02).astype("float32")
            arrays = stored_np(w, fmt, "vnni")
            nbytes = sum(a.nbytes for a in arrays)
            copies = max(1, int(ARGS.rotate_mb * 2**20 // nbytes) + 1) if ARGS.cold else 1
            sets = [[tvm.runtime.tensor(a.copy(), dev) for a in arrays] for _ in range(copies)]
            f = compiled(fmt, K, N)
            wd = fake_quantize(w, fmt)
            t1 = None
            for m in rows:
                x = rng.standard_normal((m, 1, K)).astype("float32")  # decode layout
                ref = fake_quantize_activation(x).reshape(m, K) @ wd.T
                xt = tvm.runtime.tensor(x, dev)
                got = f(xt, *sets[0]).numpy()
                err = float(np.abs(got.reshape(m, N) - ref).max() / np.abs(ref).max())
                t, cpu = _time(lambda i: f(xt, *sets[i % copies]), copies)
                t1 = cpu if m == 1 else t1
                per_row = f"{cpu / m / t1:13.2f}" if t1 else f"{'':>13}"
                print(f"{name:>8} {fmt:>5} {m:3d} {t * 1e3:8.3f} {cpu * 1e3:8.3f} {nbytes / 1e6:6.2f} "
                      f"{nbytes / t / 1e9:6.1f} {per_row} {2 * N * K * m / cpu / 1e9:7.1f} {err:11.2e}", flush=True)


if __name__ == "__main__":
    main()
