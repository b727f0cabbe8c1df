#!/usr/bin/env python
"""The int8-activation VNNI kernel alone (schedules/cpu/int8_act_matmul.py), by rows of x.

Compiles the kernel as a build does (Relax emitter, lowering, schedule pass) for each
linear shape of --shape (a scripts/bench.py shape: qkv, o, gate_up, down, lm_head) and times x
of M rows in the decode layout (M, 1, K) for each M in --rows (1 = decode, 2..16 = batched
decode, 32+ = prefill): the best over --repeats rounds of a round's median call (wall) and of
its mean CPU time (all threads together), the packed weight bytes read per call and the GB/s
this gives (wall),
the time per row relative to M = 1 (how well a batch amortizes the weight reads), and the error
against the numpy reference. `--cold` cycles over enough weight copies to defeat the last-level
cache (what decode sees); the copies sit in one huge-page arena as the engine's weights do
(`--small-pages` puts them on ordinary 4 KiB pages, where every 4 KiB is a TLB miss and a
prefetcher stop); by default one copy stays hot in cache, which shows the kernel's compute.

The stream reference (`ref` lines): a torch sum at --threads over a huge-page buffer of the same
bytes per call, rotated over as many copies as the weights, timed in the same rounds as the
kernels (each round times every kernel and the reference in turn). The `share` column is the
kernel's GB/s over the reference's GB/s of the same round, the median over the rounds, with
their min-max: this VM's bandwidth drifts 2x within a minute, so a reference measured before
or after the kernels says nothing about them. On an overloaded machine (more runnable threads
than cores) a 2-thread torch sum's median call can take 16 ms (libgomp's barrier waits for a
descheduled thread), so the wall share means nothing there: use `--threads 1 --clock cpu`.
`--gap` sleeps before each timed block so that the pool timed before (TVM's or torch's) has
stopped spinning. `--asm FILE` writes the generated assembly of
every compiled kernel there. `--against FILE` also compiles the kernel of another copy of
schedules/cpu/int8_act_matmul.py (e.g. `git show HEAD~1:schedules/cpu/int8_act_matmul.py >
/tmp/old.py`) and times the two interleaved, round by round, in one process (lines marked `*`):
on a shared machine the only comparison that holds.

Caveat, measured (machine shared, 1 thread, one process, the same weight memory): this compile
does not reproduce a build's machine code exactly. Without the software prefetch, the q8_0 LM
head of a llama-110m build (its model.so) ran at 2.2-2.4 ms a call, the same kernel compiled
here (in memory or exported to a library) at 1.3-1.45 ms; LLVM issued the loads of a block in
another order. Confirm a kernel change on whole builds with scripts/ab_decode.py.

    python scripts/bench_int8_kernel.py --threads 2 [--shape llama-1b] [--formats q8_0,q4_k]
        [--rows 1,2,4,8,16] [--only qkv,down] [--cold] [--asm /tmp/k.s] [--against /tmp/old.py]
        [--act-bits 8|16] [--arch x86-64-v3]
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
    p.add_argument("--repeats", type=int, default=9, help="rounds")
    p.add_argument("--rotate-mb", type=int, default=96)
    p.add_argument("--gap", type=float, default=0.2,
                   help="seconds of sleep before each timed block, so that the other thread pool "
                        "(TVM's or torch's) has stopped spinning")
    p.add_argument("--small-pages", action="store_true",
                   help="weights on ordinary 4 KiB pages (default: one huge-page arena, as the engine)")
    p.add_argument("--shape", default="llama-110m", help="a scripts/bench.py shape")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="the share's clock: cpu (at --threads 1) does not count time the process waited "
                        "for a core on a shared machine")
    p.add_argument("--asm", default="", help="write the kernels' assembly to this file")
    p.add_argument("--no-reference", action="store_true", help="skip the torch-sum stream reference")
    p.add_argument("--against", default="", help="another int8_act_matmul.py to time beside this one")
    p.add_argument("--arch", default=None,
                   help="compile for this CPU (an LLVM -mcpu, e.g. x86-64-v3: the AVX2 kernels; "
                        "default: this machine)")
    p.add_argument("--act-bits", type=int, choices=[8, 16], default=16,
                   help="activation bits (16: the default of exact format names on x86 with AVX2 or "
                        "AVX-512)")
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


def reference_sum(nbytes: int, copies: int):
    """The stream reference: call(i) sums copy i % copies of `nbytes` float32 bytes with torch
    (at --threads threads), the copies in one huge-page arena as the weights."""
    import torch

    from tvm_llm.runtime.engine import _huge_page_arena

    torch.set_num_threads(ARGS.threads)
    n = max(1, nbytes // 4)
    stride = -(-n * 4 // 4096) * 4096
    arena = None if ARGS.small_pages else _huge_page_arena(stride * copies)
    if arena is None:
        bufs = [torch.ones(n, dtype=torch.float32) for _ in range(copies)]
    else:
        bufs = [torch.from_numpy(arena[i * stride: i * stride + n * 4].view(np.float32)) for i in range(copies)]
        for buf in bufs:
            buf.fill_(1.0)
    return lambda i: bufs[i % copies].sum(), n * 4


def weight_sets(arrays, dev, copies: int) -> list:
    """`copies` sets of device tensors of `arrays`: by default all in one huge-page arena, as
    the engine holds its weights (runtime/engine.py _huge_page_arena; an arena per copy of a
    few MB would get at most one aligned 2 MiB huge page, the rest 4 KiB pages: on those a
    streamed weight pays a TLB miss and a prefetcher stop every 4 KiB); with --small-pages
    ordinary allocations."""
    from tvm_llm.runtime.engine import _huge_page_arena

    offsets = np.cumsum([0] + [-(-a.nbytes // 4096) * 4096 for a in arrays])
    stride = int(offsets[-1])
    arena = None if ARGS.small_pages else _huge_page_arena(stride * copies)
    if arena is None:
        return [[tvm.runtime.tensor(a.copy(), dev) for a in arrays] for _ in range(copies)]
    sets = []
    for c in range(copies):
        out = []
        for a, off in zip(arrays, offsets):
            region = arena[c * stride + off: c * stride + off + a.nbytes]
            region[...] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            out.append(tvm.runtime.from_dlpack(region)._create_view(a.shape, str(a.dtype)))
        sets.append(out)
    return sets


def compiled_from(path: str, fmt: str, K: int, N: int):
    """compiled() with the kernel function of another copy of int8_act_matmul.py."""
    import importlib.util
    import inspect

    import schedules.cpu.int8_act_matmul as kernel_module

    spec = importlib.util.spec_from_file_location("int8_act_matmul_against", path)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    from tvm_llm.targets import llvm as llvm_target

    def forget():  # the target caches its kernels by shape: without this both would be one
        llvm_target._int8_act_kernel.cache_clear()
        llvm_target._int8_act_template.cache_clear()

    own, theirs = kernel_module.int8_act_matmul_func, other.int8_act_matmul_func
    known = inspect.signature(theirs).parameters  # an older copy may lack newer options

    def func(*args, **kwargs):
        return theirs(*args, **{k: v for k, v in kwargs.items() if k in known})

    kernel_module.int8_act_matmul_func = func  # the target imports it per call
    forget()
    try:
        return compiled(fmt, K, N)
    finally:
        kernel_module.int8_act_matmul_func = own
        forget()


def compiled(fmt: str, K: int, N: int):
    """main(x (M, 1, K), *stored) -> y, lowered and compiled as a build does (the QuantizeLinear
    pass's emitter, our lowering and CPU schedule pass): a direct tvm.compile of the PrimFunc
    can generate different code for the same kernel."""
    from tvm import relax

    from schedules.cpu import cpu_schedule_pass
    from tvm_llm.passes.quantize_linear import emit_quantized_matmul
    from tvm_llm.quantization.kernels import stored_shapes

    spec = get_target("llvm", arch=ARGS.arch)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([tvm.tirx.Var("m", "int64"), 1, K], "float32"))
    ws = [relax.Var(f"w{i}", relax.TensorType(shape, dtype))
          for i, (shape, dtype) in enumerate(stored_shapes(N, K, fmt, "vnni"))]
    with bb.function("main", [x] + ws):
        with bb.dataflow():
            y = bb.emit_output(emit_quantized_matmul(bb, x, ws, fmt, "vnni", K, N, "float32",
                                                     spec, ARGS.act_bits))
        bb.emit_func_output(y)
    target = workloads.host_target(ARGS.threads) if ARGS.arch is None else \
        tvm.target.Target(dict(spec.tvm_target().export(), **{"num-cores": ARGS.threads}))
    with target, tvm.transform.PassContext(opt_level=3):
        mod = cpu_schedule_pass()(workloads.lower_to_tir(bb.get()))
        ex = tvm.compile(mod, target=target)
    if ARGS.asm:
        with open(ARGS.asm, "a") as f:
            f.write(f"### {fmt} K={K} N={N}\n" + ex.mod.imports[0].inspect_source("asm") + "\n")
    return relax.VirtualMachine(ex, tvm.cpu())["main"]


def _time(calls, copies: int):
    """[[(wall seconds, CPU seconds of all threads) per round] per call] of each of `calls`,
    timed round by round in turn (every round times each call `iters` times): the wall figure
    of a round is its median call (a call that waited for a core does not move it), the CPU
    figure its mean. On a shared machine only figures of the same round compare."""
    import statistics

    iters = max(copies, 10)
    rounds = [[] for _ in calls]
    for _ in range(ARGS.repeats):
        for k, call in enumerate(calls):
            time.sleep(ARGS.gap)
            call(0)
            walls = []
            c0 = time.process_time()
            for i in range(iters):
                t0 = time.perf_counter()
                call(i)
                walls.append(time.perf_counter() - t0)
            rounds[k].append((statistics.median(walls), (time.process_time() - c0) / iters))
    return rounds


def _share(kernel_rounds, ref_rounds) -> str:
    """Median (min-max) over the rounds of kernel GB/s / reference GB/s (same bytes per call):
    the reference's time over the kernel's (--clock), round by round."""
    import statistics

    k = 0 if ARGS.clock == "wall" else 1
    r = [rt[k] / kt[k] for kt, rt in zip(kernel_rounds, ref_rounds)]
    return f"{statistics.median(r):5.2f} ({min(r):.2f}-{max(r):.2f})"


def main():
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    rows = [int(r) for r in ARGS.rows.split(",")]
    only = set(filter(None, ARGS.only.split(",")))
    if ARGS.asm:
        open(ARGS.asm, "w").close()
    isa = get_target("llvm", arch=ARGS.arch).int8_dot_isa()
    print(f"{ARGS.shape}, {ARGS.arch or 'this CPU'} ({isa} dot products), {ARGS.act_bits}-bit activations,"
          f" threads {ARGS.threads}, weights {'cold (rotated past LLC)' if ARGS.cold else 'hot'}, "
          f"{'4 KiB' if ARGS.small_pages else 'huge'} pages, {ARGS.repeats} rounds, share by {ARGS.clock} time")
    print(f"{'shape':>8} {'fmt':>5} {'M':>3} {'wall us':>8} {'cpu us':>8} {'MB':>6} {'GB/s':>6} "
          f"{'share (min-max)':>16} {'cpu/row vs M=1':>13} {'GOP/cpu-s':>7} {'max rel err':>11}")
    summary = []
    for fmt in ARGS.formats.split(","):
        for name, (K, N) in linear_shapes(ARGS.shape).items():
            if only and name not in only:
                continue
            w = (rng.standard_normal((N, K)) * 0.02).astype("float32")
            arrays = stored_np(w, fmt, "vnni")
            nbytes = sum(a.nbytes for a in arrays)
            copies = max(1, int(ARGS.rotate_mb * 2**20 // nbytes) + 1) if ARGS.cold else 1
            sets = weight_sets(arrays, dev, copies)
            ref, ref_bytes = (None, 0) if ARGS.no_reference else reference_sum(nbytes, copies)
            fs = [compiled(fmt, K, N)] + ([compiled_from(ARGS.against, fmt, K, N)] if ARGS.against else [])
            wd = fake_quantize(w, fmt)
            t1 = [None] * len(fs)
            for m in rows:
                x = rng.standard_normal((m, 1, K)).astype("float32")  # decode layout
                want = fake_quantize_activation(x, ARGS.act_bits).reshape(m, K) @ wd.T
                xt = tvm.runtime.tensor(x, dev)
                errs = [float(np.abs(f(xt, *sets[0]).numpy().reshape(m, N) - want).max() / np.abs(want).max())
                        for f in fs]
                calls = [lambda i, f=f: f(xt, *sets[i % copies]) for f in fs] + ([ref] if ref else [])
                rounds = _time(calls, copies)
                for k, err in enumerate(errs):
                    t, cpu = min(w for w, _ in rounds[k]), min(c for _, c in rounds[k])
                    t1[k] = cpu if m == 1 else t1[k]
                    per_row = f"{cpu / m / t1[k]:13.2f}" if t1[k] else f"{'':>13}"
                    share = _share(rounds[k], rounds[-1]) if ref else ""
                    label = name + ("*" if k else "")
                    print(f"{label:>8} {fmt:>5} {m:3d} {t * 1e6:8.1f} {cpu * 1e6:8.1f} "
                          f"{nbytes / 1e6:6.2f} {nbytes / t / 1e9:6.1f} {share:>16} {per_row} "
                          f"{2 * N * K * m / cpu / 1e9:7.1f} {err:11.2e}", flush=True)
                    summary.append((label, fmt, m, nbytes / t / 1e9, share))
                if ref:
                    rt = min(w for w, _ in rounds[-1])
                    print(f"{'ref':>8} {'sum':>5} {m:3d} {rt * 1e6:8.1f} {min(c for _, c in rounds[-1]) * 1e6:8.1f} {ref_bytes / 1e6:6.2f} "
                          f"{ref_bytes / rt / 1e9:6.1f}", flush=True)
            sets = ref = None  # free the copies before the next shape's
    if not ARGS.no_reference:
        print("share of the stream reference (same bytes, same rounds), M = 1:")
        for label, fmt, m, gbs, share in summary:
            if m == 1:
                print(f"  {label:>8} {fmt:>5} {gbs:6.1f} GB/s  share {share}")


if __name__ == "__main__":
    main()
