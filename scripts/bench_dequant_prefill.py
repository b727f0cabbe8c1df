#!/usr/bin/env python
"""Weight-only quantized prefill kernels against the packed fp32 GEMM, interleaved in one process.

For each linear shape it builds, for a target CPU (`--mcpu`, default x86-64-v3: AVX2 code,
which runs on any newer x86), the fp32 GEMM over weights packed once (as a build packs them)
and, per weight format, the weight-only kernel under the dot-product rule with the dequantize
inlined (`dot`, schedules/cpu/gemv.py) and under the dequantize-panel GEMM (`panel`,
schedules/cpu/dequant_gemm.py). All kernels are timed round by round (median and spread of
`--rounds`), so machine noise hits them alike; each result is checked against numpy.

    python scripts/bench_dequant_prefill.py [--mcpu x86-64-v3|znver4] [--rows 128]
        [--shapes 768x2304,768x768,768x4096,2048x768] [--formats q8_0,q4_k] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mcpu", default="x86-64-v3")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", default="768x2304,768x768,768x4096,2048x768", help="KxN,...")
    p.add_argument("--formats", default="q8_0,q4_k")
    p.add_argument("--rounds", type=int, default=7)
    return p.parse_args()


ARGS = _parse()
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.s_tir import dlight as dl  # noqa: E402

import cpu_workloads as workloads  # noqa: E402  (tests/cpu_workloads.py)
from schedules.cpu import cpu_rules  # noqa: E402
from schedules.cpu.prepack import MarkWeightsLayoutFree, prepack_passes  # noqa: E402
from tvm_llm.passes.quantize_linear import emit_quantized_matmul  # noqa: E402
from tvm_llm.quantization import kernels  # noqa: E402
from tvm_llm.quantization.formats import FORMATS  # noqa: E402
from tvm_llm.quantization.scheme import stored_np  # noqa: E402

TARGET = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": ARGS.mcpu,
                            "num-cores": ARGS.threads})


def build(K: int, N: int, fmt: str, panel: bool):
    """(prefill function, transform_params or None) of one linear: fp32 or `fmt` weight-only."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, tvm.tirx.Var("n", "int64"), K], "float32"))
    shapes = [([N, K], "float32")] if fmt == "fp32" else kernels.stored_shapes(N, K, fmt, "rows")
    ws = [relax.Var(f"w{i}", relax.TensorType(s, d)) for i, (s, d) in enumerate(shapes)]
    with bb.function("prefill", [x] + ws, attrs={"num_input": 1}):  # a model function: packing lifted
        with bb.dataflow():
            if fmt == "fp32":
                y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(ws[0])))
            else:
                y = bb.emit(emit_quantized_matmul(bb, x, ws, fmt, "rows", K, N, "float32"))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    with TARGET, tvm.transform.PassContext(opt_level=3):
        mod = MarkWeightsLayoutFree()(workloads.lower_to_tir(bb.get()))
        mod = dl.ApplyDefaultSchedule(*cpu_rules(dequant_panel=panel))(mod)
        for ps in prepack_passes():
            mod = ps(mod)
        ex = tvm.compile(mod, target=TARGET)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    names = {gv.name_hint for gv in mod.get_global_vars()}
    return vm["prefill"], (vm["transform_params"] if "transform_params" in names else None)


def main():
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    print(f"# mcpu {ARGS.mcpu}, {ARGS.threads} threads, {ARGS.rows} rows, median of {ARGS.rounds} "
          "interleaved rounds")
    for shape in ARGS.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        w = (rng.standard_normal((N, K)) * 0.02).astype("float32")
        x = rng.standard_normal((1, ARGS.rows, K)).astype("float32")
        xt = tvm.runtime.tensor(x, dev)
        cands = {}
        for fmt in ["fp32"] + ARGS.formats.split(","):
            for panel in ([True] if fmt == "fp32" else [False, True]):
                f, packer = build(K, N, fmt, panel)
                args = [tvm.runtime.tensor(a, dev) for a in ([w] if fmt == "fp32" else stored_np(w, fmt, "rows"))]
                if packer is not None:
                    args = list(packer(args))
                wd = w if fmt == "fp32" else FORMATS[fmt].dequantize(FORMATS[fmt].quantize(w))
                ref = x.reshape(-1, K).astype(np.float64) @ wd.T.astype(np.float64)
                got = f(xt, *args).numpy().reshape(-1, N)
                err = float(np.abs(got - ref).max() / np.abs(ref).max())
                cands["fp32" if fmt == "fp32" else f"{fmt} {'panel' if panel else 'dot'}"] = (f, args, err)
        times = {k: [] for k in cands}
        for _ in range(ARGS.rounds):
            for k, (f, args, _) in cands.items():
                f(xt, *args)
                t0 = time.perf_counter()
                for _ in range(10):
                    f(xt, *args)
                times[k].append((time.perf_counter() - t0) / 10)
        base = float(np.median(times["fp32"]))
        for k, v in times.items():
            med = float(np.median(v))
            print(f"K={K:5d} N={N:5d} {k:>12} {med * 1e3:8.3f} ms {2 * N * K * ARGS.rows / med / 1e9:7.1f} "
                  f"GFLOP/s  {base / med:5.2f}x fp32  (spread {min(v) * 1e3:.3f}-{max(v) * 1e3:.3f}) "
                  f"rel err {cands[k][2]:.1e}", flush=True)


if __name__ == "__main__":
    main()
