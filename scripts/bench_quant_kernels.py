#!/usr/bin/env python
"""Quantized matmul kernels, one per weight format and activation kind: what a build runs.

For each Llama linear shape it builds the exact kernels the QuantizeLinear pass emits
(weight-only: the dequantize TE of tvm_llm/quantization/kernels.py scheduled by our CPU rules;
`_a8` / `_a16`: the VNNI kernel with int8 / int16 activations, schedules/cpu/int8_act_matmul.py) and times decode
(x: 1 x 1 x K, `--rows 1`) or prefill (x: 1 x n x K, `--rows n`), cycling over enough weight
copies to defeat the last-level cache. Prints ms, bytes of packed weights read per call, GB/s,
the fraction of the machine's read bandwidth measured in the same run (torch sum over a 512 MB
tensor), GFLOP/s, and the error against the numpy reference. torch's fp32 linear is the reference.
Kernels are scheduled as a build for `--arch` schedules them (tvm_llm/targets: weights marked
layout-free, so fp32 runs the GEMM over weights packed once, as a build packs them, and
weight-only prefill the target's choice of rule; x86-64-v3 gives AVX2 code, which runs here).

    python scripts/bench_quant_kernels.py --threads 2 [--models 110m,1b] [--only qkv,down]
        [--schemes fp32,q8_0,q4_0,q4_1,q4_k,q8_0_a8,q4_0_a8,q4_1_a8,q4_k_a8,q4_k_a16] [--rows 1|128]
        [--arch x86-64-v3]
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
    p.add_argument("--schemes", default="fp32,q8_0,q4_0,q4_1,q4_k,q8_0_a8,q4_0_a8,q4_1_a8,q4_k_a8")
    p.add_argument("--rows", type=int, default=1, help="rows of x: 1 = decode, n = prefill")
    p.add_argument("--only", default="")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rotate-mb", type=int, default=256)
    p.add_argument("--arch", default=None, help="--arch of the build (default: this CPU)")
    return p.parse_args()


ARGS = _parse()
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
from schedules.cpu import cpu_schedule_pass  # noqa: E402
from tvm_llm.passes.quantize_linear import emit_quantized_matmul  # noqa: E402
from tvm_llm.quantization import kernels  # noqa: E402
from tvm_llm.quantization.formats import FORMATS, fake_quantize_activation  # noqa: E402
from tvm_llm.quantization.scheme import stored_np  # noqa: E402
from tvm_llm.targets import get_target  # noqa: E402

SHAPES = {  # name: (K, N)
    "110m": {"qkv": (768, 2304), "o": (768, 768), "gate_up": (768, 4096), "down": (2048, 768)},
    "1b": {"qkv": (2048, 2560), "o": (2048, 2048), "gate_up": (2048, 11264), "down": (5632, 2048),
           "lm_head": (2048, 32000)},
}


def _scheme(name):
    """None (fp32) or (format, layout, activation bits): `q4_k` weight-only (float
    activations), `q4_k_a8` / `q4_k_a16` int8 / int16 activations (the VNNI kernel)."""
    if name == "fp32":
        return None
    fmt, _, bits = name.partition("_a")
    if fmt not in FORMATS or bits not in ("", "8", "16"):
        raise SystemExit(f"unknown scheme {name!r}: fp32 or a format of {', '.join(FORMATS)}, "
                         "_a8 / _a16 for int8 / int16 activations")
    return fmt, ("vnni" if bits else "rows"), int(bits or 0)


def kernel_module(K: int, N: int, scheme):
    """(VirtualMachine, fn name, transform_params or None): `fn(x (b, 1, K) or (1, n, K),
    *weights) -> y` built as the pass builds it and scheduled as a build for --arch schedules
    it (tvm_llm/targets/llvm.py schedule_passes: fp32 weights packed by transform_params)."""
    bb = relax.BlockBuilder()
    b = tvm.tirx.Var("b", "int64")
    x = relax.Var("x", relax.TensorType([b, 1, K] if ARGS.rows == 1 else [1, b, K], "float32"))
    shapes = [([N, K], "float32")] if scheme is None else kernels.stored_shapes(N, K, *scheme[:2])
    ws = [relax.Var(f"w{i}", relax.TensorType(shape, dtype)) for i, (shape, dtype) in enumerate(shapes)]
    spec = get_target("llvm", arch=ARGS.arch)
    name = "decode" if ARGS.rows == 1 else "prefill"  # a model function: its packing is lifted
    with bb.function(name, [x] + ws, attrs={"num_input": 1}):
        with bb.dataflow():
            if scheme is None:
                y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(ws[0])))
            else:
                y = bb.emit(emit_quantized_matmul(bb, x, ws, scheme[0], scheme[1], K, N,
                                                  "float32", spec, scheme[2] or 8))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    mod = bb.get()
    target = spec.tvm_target()  # num-cores from TVM_NUM_THREADS (--threads)
    with target, tvm.transform.PassContext(opt_level=3):
        mod = relax.transform.FuseTransposeMatmul()(mod)
        mod = workloads.lower_to_tir(mod)
        for p in spec.schedule_passes():
            mod = p(mod)
        ex = tvm.compile(mod, target=target)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    names = {gv.name_hint for gv in mod.get_global_vars()}
    return vm, name, (vm["transform_params"] if "transform_params" in names else None)


def stored_weights(w: np.ndarray, scheme):
    return [w] if scheme is None else stored_np(w, *scheme[:2])


def _reference(x, w, scheme):
    """What the kernel must compute: x times the dequantized weight (int8 activations: times
    the per-block int8 round trip of x as well)."""
    from tvm_llm.quantization.formats import fake_quantize

    wd = fake_quantize(w, scheme[0])
    if scheme[1] == "vnni":
        x = fake_quantize_activation(x, scheme[2])
    return x.reshape(-1, x.shape[-1]) @ wd.T


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
    print(f"x rows: {ARGS.rows} ({'decode' if ARGS.rows == 1 else 'prefill'})")
    print(f"{'shape':>14} {'scheme':>8} {'ms':>8} {'MB':>7} {'GB/s':>6} {'of bw':>6} {'GFLOP/s':>8} "
          f"{'vs torch':>8} {'max rel err':>11}")
    rng = np.random.default_rng(0)
    only = set(filter(None, ARGS.only.split(",")))
    for model in ARGS.models.split(","):
        for name, (K, N) in SHAPES[model].items():
            if only and name not in only:
                continue
            w = (rng.standard_normal((N, K)) * 0.02).astype("float32")
            x = rng.standard_normal((1, 1, K) if ARGS.rows == 1 else (1, ARGS.rows, K)).astype("float32")
            ref_f = x.reshape(-1, K) @ w.T
            tw = torch.from_numpy(w)
            copies_t = max(1, int(ARGS.rotate_mb * 2**20 // w.nbytes) + 1)
            tws = [tw.clone() for _ in range(copies_t)]
            tx = torch.from_numpy(x)
            t_torch = _time(lambda i: torch.nn.functional.linear(tx, tws[i % copies_t]), copies_t)
            for sname in ARGS.schemes.split(","):
                scheme = _scheme(sname)
                vm, fname, packer = kernel_module(K, N, scheme)
                arrays = stored_weights(w, scheme)
                ref = ref_f if scheme is None else _reference(x, w, scheme)
                nbytes = sum(a.nbytes for a in arrays)
                copies = max(1, int(ARGS.rotate_mb * 2**20 // nbytes) + 1)
                sets = [[tvm.runtime.tensor(a.copy(), dev) for a in arrays] for _ in range(copies)]
                if packer is not None:  # the build-time weight packing, once per copy
                    sets = [list(packer(s)) for s in sets]
                xt = tvm.runtime.tensor(x, dev)
                f = vm[fname]
                out = f(xt, *sets[0]).numpy().reshape(-1, N)
                err = float(np.abs(out - ref).max() / np.abs(ref).max())
                t = _time(lambda i: f(xt, *sets[i % copies]), copies)
                flops = 2 * N * K * ARGS.rows / t / 1e9
                print(f"{model + ' ' + name:>14} {sname:>8} {t * 1e3:8.3f} {nbytes / 1e6:7.2f} "
                      f"{nbytes / t / 1e9:6.1f} {nbytes / t / 1e9 / bw:6.2f} {flops:8.1f} {t_torch / t:7.2f}x "
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
