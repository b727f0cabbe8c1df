#!/usr/bin/env python
"""Decode GEMV (b = 1) over fp32, q8, q4 and W8A8 weights: the kernels a quantized build runs.

For each Llama linear shape it builds the exact TE kernels the QuantizeLinear pass emits
(tvm_llm/quantization/kernels.py), schedules them with our CPU rules, and times one token
(x: 1 x 1 x K), cycling over enough weight copies to defeat the last-level cache. Prints ms,
bytes read per call (weights + scales), GB/s, and the fraction of the machine's read bandwidth
measured in the same run (torch sum over a 512 MB tensor). torch's fp32 linear is the reference.

    python scripts/bench_quant_kernels.py --threads 2 [--models 1b] [--only qkv,down]
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", default="1b")
    p.add_argument("--schemes", default="fp32,q8,q4,w8a8,w4a8")
    p.add_argument("--only", default="")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rotate-mb", type=int, default=256)
    return p.parse_args()


ARGS = _parse()
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from schedules.cpu import cpu_schedule_pass, workloads  # noqa: E402
from tvm_llm.passes.quantize_linear import emit_quantized_matmul  # noqa: E402
from tvm_llm.quantization import kernels  # noqa: E402
from tvm_llm.quantization.scheme import QuantScheme, quantize_np, stored_np  # noqa: E402

SHAPES = {  # name: (K, N)
    "110m": {"qkv": (768, 2304), "o": (768, 768), "gate_up": (768, 4096), "down": (2048, 768)},
    "1b": {"qkv": (2048, 2560), "o": (2048, 2048), "gate_up": (2048, 11264), "down": (5632, 2048),
           "lm_head": (2048, 32000)},
}
SCHEMES = {"fp32": None, "q8": QuantScheme("q8"), "q4": QuantScheme("q4"),
           "w8a8": QuantScheme("q8", activations="int8"), "w4a8": QuantScheme("q4", activations="int8")}


def kernel_module(K: int, N: int, scheme):
    """IRModule with `main(x (b, 1, K), *weights) -> y` built as the pass builds it."""
    bb = relax.BlockBuilder()
    b = tvm.tirx.Var("b", "int64")
    x = relax.Var("x", relax.TensorType([b, 1, K], "float32"))
    shapes = [([N, K], "float32")] if scheme is None else kernels.stored_shapes(N, K, scheme)
    ws = [relax.Var(f"w{i}", relax.TensorType(shape, dtype)) for i, (shape, dtype) in enumerate(shapes)]
    with bb.function("main", [x] + ws):
        with bb.dataflow():
            if scheme is None:
                y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(ws[0])))
            else:
                y = bb.emit(emit_quantized_matmul(bb, x, ws, scheme, K, N, "float32"))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    mod = bb.get()
    target = workloads.host_target(ARGS.threads)
    with target, tvm.transform.PassContext(opt_level=3):
        mod = relax.transform.FuseTransposeMatmul()(mod)
        mod = workloads.lower_to_tir(mod)
        mod = cpu_schedule_pass()(mod)
        ex = tvm.compile(mod, target=target)
    return relax.VirtualMachine(ex, tvm.cpu())


def stored_weights(w: np.ndarray, scheme):
    return [w] if scheme is None else stored_np(w, scheme)


def _reference(x, w, scheme):
    """What the kernel must compute: x times the dequantized weight (W8A8: times the int8
    round trip of x as well)."""
    from tvm_llm.quantization.scheme import dequantize_np

    wd = dequantize_np(*quantize_np(w, scheme), scheme)
    if scheme.activations == "int8":
        s = np.abs(x[0]).max(axis=-1, keepdims=True) / 127.0
        x = (np.clip(np.round(x[0] / s), -127, 127) * s)[None]
    return x[0] @ wd.T


def read_bandwidth() -> float:
    t = torch.ones(128 << 20)
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        t.sum()
        best = min(best, time.perf_counter() - t0)
    return t.numel() * 4 / best / 1e9


def main():
    torch.set_num_threads(ARGS.threads)
    dev = tvm.cpu()
    bw = read_bandwidth()
    print(f"read bandwidth (torch sum, {ARGS.threads} threads): {bw:.1f} GB/s")
    print(f"{'shape':>14} {'scheme':>6} {'ms':>8} {'MB':>7} {'GB/s':>6} {'of bw':>6} {'vs torch':>8} {'max rel err':>11}")
    rng = np.random.default_rng(0)
    only = set(filter(None, ARGS.only.split(",")))
    for model in ARGS.models.split(","):
        for name, (K, N) in SHAPES[model].items():
            if only and name not in only:
                continue
            w = (rng.standard_normal((N, K)) * 0.02).astype("float32")
            x = rng.standard_normal((1, 1, K)).astype("float32")
            ref_f = x[0] @ w.T
            tw = torch.from_numpy(w)
            copies_t = max(1, int(ARGS.rotate_mb * 2**20 // w.nbytes) + 1)
            tws = [tw.clone() for _ in range(copies_t)]
            tx = torch.from_numpy(x)
            t_torch = _time(lambda i: torch.nn.functional.linear(tx, tws[i % copies_t]), copies_t)
            for sname in ARGS.schemes.split(","):
                scheme = SCHEMES[sname]
                vm = kernel_module(K, N, scheme)
                arrays = stored_weights(w, scheme)
                ref = ref_f if scheme is None else _reference(x, w, scheme)
                nbytes = sum(a.nbytes for a in arrays)
                copies = max(1, int(ARGS.rotate_mb * 2**20 // nbytes) + 1)
                sets = [[tvm.runtime.tensor(a.copy(), dev) for a in arrays] for _ in range(copies)]
                xt = tvm.runtime.tensor(x, dev)
                f = vm["main"]
                out = f(xt, *sets[0]).numpy()[0]
                err = float(np.abs(out - ref).max() / np.abs(ref).max())
                t = _time(lambda i: f(xt, *sets[i % copies]), copies)
                print(f"{model + ' ' + name:>14} {sname:>6} {t * 1e3:8.3f} {nbytes / 1e6:7.2f} "
                      f"{nbytes / t / 1e9:6.1f} {nbytes / t / 1e9 / bw:6.2f} {t_torch / t:7.2f}x "
                      f"{err:11.2e}", flush=True)


def _time(call, copies):
    iters = max(copies * 2, 20)
    best = 1e9
    for _ in range(ARGS.rounds):
        call(0)
        t0 = time.perf_counter()
        for i in range(iters):
            call(i)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


if __name__ == "__main__":
    main()
