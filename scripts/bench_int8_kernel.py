#!/usr/bin/env python
"""The int8-activation VNNI kernel alone (schedules/cpu/int8_act_matmul.py), by rows of x.

Compiles the kernel as a build does (Relax emitter, lowering, schedule pass) for each
linear shape of --shape (a scripts/bench.py shape: qkv, o, gate_up, down, lm_head) and times x of M rows in the decode layout (M, 1, K) for each M in --rows (1 = decode, 2..16 = batched decode, 32+ = prefill) and prints the best time over
--repeats, the packed weight bytes read per call and the GB/s this gives (wall), the time per
row relative to M = 1 (how well a batch amortizes the weight reads), and the error against the
numpy reference. Times are the best of --repeats, wall and CPU (all threads together; on a
shared machine the CPU time is the steadier one, and the per-row and GOP/s columns use it).
`--cold` cycles over enough weight copies to defeat the last-level cache
(what decode sees); the copies sit in one huge-page arena as the engine's weights do
(`--small-pages` puts them on ordinary 4 KiB pages, where every 4 KiB is a TLB miss and a
prefetcher stop); by default one copy stays hot in cache, which shows the kernel's compute.
The machine's read bandwidth at --threads (scripts/bench.py machine_limits, in a subprocess so
torch's threads do not compete with TVM's) is measured before and after the kernels in the same
run; the `share` column is the wall GB/s over the larger of the two. `--asm FILE` writes the
generated assembly of every compiled kernel there. `--against FILE` also compiles the kernel of
another copy of schedules/cpu/int8_act_matmul.py (e.g. `git show HEAD~1:schedules/cpu/
int8_act_matmul.py > /tmp/old.py`) and times the two interleaved, round by round, in one
process (lines marked `*`): on a shared machine the only comparison that holds.

    python scripts/bench_int8_kernel.py --threads 2 [--shape llama-1b] [--formats q8_0,q4_k]
        [--rows 1,2,4,8,16] [--only qkv,down] [--cold] [--asm /tmp/k.s] [--against /tmp/old.py]
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
    p.add_argument("--small-pages", action="store_true",
                   help="weights on ordinary 4 KiB pages (default: one huge-page arena, as the engine)")
    p.add_argument("--shape", default="llama-110m", help="a scripts/bench.py shape")
    p.add_argument("--asm", default="", help="write the kernels' assembly to this file")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the read-bandwidth reference")
    p.add_argument("--against", default="", help="another int8_act_matmul.py to time beside this one")
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



def linear_shapes(shape: str) -> dict:
    """name: (K, N) of the decoder's linears (fused as a build fuses them) of a bench.py shape."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench import SHAPES

    s = SHAPES[shape]
    h, inter = s["hidden_size"], s["intermediate_size"]
    hd = h // s["num_attention_heads"]
    qkv = h + 2 * s["num_key_value_heads"] * hd
    return {"qkv": (h, qkv), "o": (h, h), "gate_up": (h, 2 * inter), "down": (inter, h),
            "lm_head": (h, s["vocab_size"])}


def read_bandwidth(threads: int) -> float:
    """GB/s of a 256 MB reduction with torch at `threads` (bench.py machine_limits), measured
    in a child process so that torch's spinning threads stay out of the kernels' timings."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import bench; print(bench.machine_limits({threads})['read_GB_s'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def weight_set(arrays, dev) -> list:
    """Device tensors of `arrays`: by default in one huge-page arena as the engine holds
    weights (runtime/engine.py _huge_page_arena: on 4 KiB pages a streamed weight pays a TLB
    miss and a prefetcher stop every 4 KiB), with --small-pages ordinary allocations."""
    from tvm_llm.runtime.engine import _huge_page_arena

    offsets = np.cumsum([0] + [-(-a.nbytes // 4096) * 4096 for a in arrays])
    arena = None if ARGS.small_pages else _huge_page_arena(int(offsets[-1]))
    if arena is None:
        return [tvm.runtime.tensor(a.copy(), dev) for a in arrays]
    out = []
    for a, off in zip(arrays, offsets):
        region = arena[off: off + a.nbytes]
        region[...] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        out.append(tvm.runtime.from_dlpack(region)._create_view(a.shape, str(a.dtype)))
    return out


def compiled_from(path: str, fmt: str, K: int, N: int):
    """compiled() with the kernel function of another copy of int8_act_matmul.py."""
    import importlib.util

    import schedules.cpu.int8_act_matmul as kernel_module

    spec = importlib.util.spec_from_file_location("int8_act_matmul_against", path)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    own = kernel_module.int8_act_matmul_func
    kernel_module.int8_act_matmul_func = other.int8_act_matmul_func  # the target imports it per call
    try:
        return compiled(fmt, K, N)
    finally:
        kernel_module.int8_act_matmul_func = own


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
    if ARGS.asm:
        with open(ARGS.asm, "a") as f:
            f.write(f"### {fmt} K={K} N={N}\n" + ex.mod.imports[0].inspect_source("asm") + "\n")
    return relax.VirtualMachine(ex, tvm.cpu())["main"]


def _time(calls, copies: int):
    """[(best wall seconds, best CPU seconds of all threads)] per call of each of `calls`, timed
    round by round in turn: on a shared machine the CPU time is the steadier figure (the wall
    time includes waiting for a core)."""
    iters = max(copies, 10)
    best = [(1e9, 1e9)] * len(calls)
    for _ in range(ARGS.repeats):
        for k, call in enumerate(calls):
            call(0)
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(iters):
                call(i)
            t, c = (time.perf_counter() - t0) / iters, (time.process_time() - c0) / iters
            best[k] = (min(best[k][0], t), min(best[k][1], c))
    return best


def main():
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    rows = [int(r) for r in ARGS.rows.split(",")]
    only = set(filter(None, ARGS.only.split(",")))
    if ARGS.asm:
        open(ARGS.asm, "w").close()
    bw = 0.0 if ARGS.no_bandwidth else read_bandwidth(ARGS.threads)
    print(f"{ARGS.shape}, threads {ARGS.threads}, weights {'cold (rotated past LLC)' if ARGS.cold else 'hot'}"
          + ("" if ARGS.no_bandwidth else f", read bandwidth before {bw:.1f} GB/s"))
    print(f"{'shape':>8} {'fmt':>5} {'M':>3} {'wall us':>8} {'cpu us':>8} {'MB':>6} {'GB/s':>6} {'share':>5} "
          f"{'cpu/row vs M=1':>13} {'GOP/cpu-s':>7} {'max rel err':>11}")
    results = []
    for fmt in ARGS.formats.split(","):
        for name, (K, N) in linear_shapes(ARGS.shape).items():
            if only and name not in only:
                continue
            w = (rng.standard_normal((N, K)) * 0.02).astype("float32")
            arrays = stored_np(w, fmt, "vnni")
            nbytes = sum(a.nbytes for a in arrays)
            copies = max(1, int(ARGS.rotate_mb * 2**20 // nbytes) + 1) if ARGS.cold else 1
            sets = [weight_set(arrays, dev) for _ in range(copies)]
            fs = [compiled(fmt, K, N)] + ([compiled_from(ARGS.against, fmt, K, N)] if ARGS.against else [])
            wd = fake_quantize(w, fmt)
            t1 = [None] * len(fs)
            for m in rows:
                x = rng.standard_normal((m, 1, K)).astype("float32")  # decode layout
                ref = fake_quantize_activation(x).reshape(m, K) @ wd.T
                xt = tvm.runtime.tensor(x, dev)
                errs = [float(np.abs(f(xt, *sets[0]).numpy().reshape(m, N) - ref).max() / np.abs(ref).max())
                        for f in fs]
                times = _time([lambda i, f=f: f(xt, *sets[i % copies]) for f in fs], copies)
                for k, ((t, cpu), err) in enumerate(zip(times, errs)):
                    t1[k] = cpu if m == 1 else t1[k]
                    per_row = f"{cpu / m / t1[k]:13.2f}" if t1[k] else f"{'':>13}"
                    share = f"{nbytes / t / 1e9 / bw:5.2f}" if bw else f"{'':>5}"
                    print(f"{name + ('*' if k else ''):>8} {fmt:>5} {m:3d} {t * 1e6:8.1f} {cpu * 1e6:8.1f} "
                          f"{nbytes / 1e6:6.2f} {nbytes / t / 1e9:6.1f} {share} {per_row} "
                          f"{2 * N * K * m / cpu / 1e9:7.1f} {err:11.2e}", flush=True)
                    results.append((name + ("*" if k else ""), fmt, m, t, nbytes))
            del sets
    if not ARGS.no_bandwidth:
        bw2 = read_bandwidth(ARGS.threads)
        best = max(bw, bw2)
        print(f"read bandwidth after {bw2:.1f} GB/s; share of the larger ({best:.1f}) by kernel, M = 1:")
        for name, fmt, m, t, nbytes in results:
            if m == 1:
                print(f"  {name:>8} {fmt:>5} {t * 1e6:8.1f} us {nbytes / t / 1e9:6.1f} GB/s {nbytes / t / 1e9 / best:5.2f}")


if __name__ == "__main__":
    main()
