#!/usr/bin/env python
"""Interleaved A/B of the float32 prefill GEMM under variants of this CPU's tile-table row.

Each variant names overrides of the row's fields (schedules/cpu/microarch.py TileRow, e.g.
``gemm_next_panel_bytes=0`` turns the next-panel prefetch off, ``gemm_k_block_bytes=0`` the k
blocks), ``spread=S`` (pipeline.NEXT_PANEL_SPREAD) or ``min_k=K`` (gemm.MIN_K_BLOCK); an
empty variant is the row as it is. Every variant's kernels are compiled in this process, then
each round times each of the --shape's linears (qkv, o, gate_up, down; llama-1b by default;
"l2": two whose weights stay in a 2 MiB L2) at --rows rows, cold (the packed weight rotated
over copies past the last-level cache, as a prefill meets it) and hot (one copy), the order
reversed every other round; prints the median GFLOP/s of each. Only figures of one run
compare.

    TVM_NUM_THREADS=2 python scripts/ab_prefill_kernels.py base: \\
        off:gemm_next_panel_bytes=0,gemm_k_block_bytes=0 [--rows 64] [--only down]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

# weights that stay in a 2 MiB L2, one per float32 tile of the Intel row
L2_LINEARS = [("l2_6x4", 768, 512), ("l2_8x3", 768, 384)]


def linears(shape: str) -> list:
    """(name, K, N) of the qkv, o, gate_up and down linears of a scripts/bench.py shape, or
    L2_LINEARS for "l2"."""
    if shape == "l2":
        return L2_LINEARS
    from bench import SHAPES

    s = SHAPES[shape]
    h, i = s["hidden_size"], s["intermediate_size"]
    kv = s["num_key_value_heads"] * (h // s["num_attention_heads"])
    return [("qkv", h, h + 2 * kv), ("o", h, h), ("gate_up", h, 2 * i), ("down", i, h)]


def parse_variant(text: str):
    """'NAME:field=value,...' -> (name, {field: int})."""
    name, _, rest = text.partition(":")
    fields = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        fields[key.strip()] = int(value)
    return name, fields


def build(shapes, fields: dict):
    """A VirtualMachine of the prefill linears scheduled with the row's fields overridden."""
    import tvm
    from tvm import relax

    import cpu_workloads as workloads
    from schedules.cpu import cpu_schedule_pass, gemm, microarch, pipeline

    row, spread, min_k = microarch.tile_row, pipeline.NEXT_PANEL_SPREAD, gemm.MIN_K_BLOCK
    overrides = {k: v for k, v in fields.items() if k not in ("spread", "min_k")}
    microarch.tile_row = lambda t: dataclasses.replace(row(t), **overrides)
    pipeline.NEXT_PANEL_SPREAD = fields.get("spread", spread)
    gemm.MIN_K_BLOCK = fields.get("min_k", min_k)
    try:
        target = workloads.host_target(int(os.environ.get("TVM_NUM_THREADS", "2")))
        mod = workloads.linear_suite([dict(name=n, K=k, N=nn, mode="prefill")
                                      for n, k, nn in shapes])
        with target:
            mod = relax.transform.AttachAttrLayoutFreeBuffers()(mod)
            mod = cpu_schedule_pass()(mod)
            mod = relax.transform.SplitLayoutRewritePreproc()(mod)
            mod = relax.transform.LiftTransformParams()(mod)
        ex = tvm.compile(mod, target=target, tir_pipeline=pipeline.cpu_tir_pipeline())
    finally:
        microarch.tile_row, pipeline.NEXT_PANEL_SPREAD, gemm.MIN_K_BLOCK = row, spread, min_k
    return relax.VirtualMachine(ex, tvm.cpu())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="+", help="NAME:field=value,... (NAME: alone = the row as is)")
    p.add_argument("--rows", type=int, default=64, help="prefill rows M")
    p.add_argument("--shape", choices=["llama-110m", "llama-1b", "l2"], default="llama-1b")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--only", default="", help="comma list of linears (qkv,o,gate_up,down)")
    p.add_argument("--cold-mb", type=int, default=1200, help="bytes of weight copies rotated")
    args = p.parse_args(argv)

    import numpy as np
    import tvm

    shapes = [s for s in linears(args.shape) if not args.only or s[0] in args.only.split(",")]
    vms = {name: build(shapes, fields) for name, fields in map(parse_variant, args.variants)}
    dev, rng = tvm.cpu(), np.random.default_rng(0)
    for name, K, N in shapes:
        w = rng.standard_normal((N, K)).astype("float32")
        x = rng.standard_normal((1, args.rows, K)).astype("float32")
        xt, wt = tvm.runtime.tensor(x, dev), tvm.runtime.tensor(w, dev)
        copies = max(2, -(-(args.cold_mb << 20) // w.nbytes))
        fns = {}
        for vname, vm in vms.items():
            ws = [vm[f"{name}_transform_params"]([wt])[0] for _ in range(copies)]
            f = vm[name]
            np.testing.assert_allclose(f(xt, ws[0]).numpy(), x @ w.T, rtol=1e-3, atol=3e-3)

            def cold(f=f, ws=ws):
                t0 = time.perf_counter()
                for wc in ws:
                    f(xt, wc)
                return (time.perf_counter() - t0) / len(ws)

            def hot(f=f, ws=ws):
                f(xt, ws[0])
                t0 = time.perf_counter()
                for _ in range(3):
                    f(xt, ws[0])
                return (time.perf_counter() - t0) / 3

            fns[f"{vname} cold"], fns[f"{vname} hot"] = cold, hot
        times = {k: [] for k in fns}
        for r in range(args.rounds):
            for k, fn in (list(fns.items()) if r % 2 == 0 else list(reversed(fns.items()))):
                time.sleep(0.2)  # the previous call's worker threads stop spinning
                times[k].append(fn())
        flops = 2 * args.rows * K * N
        print(f"{name} K={K} N={N} M={args.rows}: " + "  ".join(
            f"{k} {flops / statistics.median(v) / 1e9:.0f} GF/s" for k, v in times.items()),
            flush=True)


if __name__ == "__main__":
    main()
