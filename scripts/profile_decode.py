#!/usr/bin/env python
"""Kernels per decode step, and the share of the step spent outside kernels.

For each built output directory: the decode step's wall time (median, no instrumentation),
the kernels one step launches and their summed time (the Relax VM's instrumentation hook
times every call), and what is left, the time outside kernels: the VM's own dispatch, shape
functions (``shape_func``, ``compute_symbolic_expr``), and the allocation / shape builtins
(``vm.builtin.alloc_tensor``, ``make_shape``...), which the hook also times and which are
listed apart, and the engine's own Python around the VM call (KV cache begin/end forward,
the logits copy). The paged-attention builtin counts as a kernel.

    python scripts/profile_decode.py OUT [OUT ...] [--threads 2] [--context 128] [--steps 30]

"outside" is measured within the instrumented steps (their wall time minus their kernels'),
so it includes the hook's own cost, about a microsecond per call (both kernel and host
calls): an overestimate by that much. The step time column is from plain steps, alternated
with the instrumented ones. On a busy machine compare the shares, not the milliseconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HOST_PREFIXES = ("shape_func", "compute_symbolic_expr")


def is_kernel(symbol: str) -> bool:
    """A compute kernel (a PrimFunc of the model, or the attention builtin), not host glue."""
    if symbol.startswith("vm.builtin."):
        return "attention" in symbol
    return not symbol.startswith(HOST_PREFIXES)


def profile(out: str, threads: int, context: int, steps: int) -> dict:
    import numpy as np

    from tvm_llm import Engine

    eng = Engine(out, num_threads=threads, max_batch_size=1)
    prompt = [int(t) for t in np.random.default_rng(0).integers(10, 200, size=context)]
    sid = eng.cache.add()
    eng.prefill([(sid, prompt)])
    for _ in range(3):  # warm-up
        eng.decode_step([sid], [5])

    calls: dict = {}
    started = [0.0]
    step_kernel = [0.0]

    def instrument(func, symbol, before, ret, *args):
        if before:
            started[0] = time.perf_counter()
        else:
            dt = time.perf_counter() - started[0]
            entry = calls.setdefault(str(symbol), [0, 0.0])
            entry[0] += 1
            entry[1] += dt
            if is_kernel(str(symbol)):
                step_kernel[0] += dt
        return 0

    # plain and instrumented steps alternate, so both see the same machine load
    walls, outside = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.decode_step([sid], [5])
        walls.append(time.perf_counter() - t0)
        eng.vm.set_instrument(instrument)
        step_kernel[0] = 0.0
        t0 = time.perf_counter()
        try:
            eng.decode_step([sid], [5])
        finally:
            eng.vm.set_instrument(None)
        wall_i = time.perf_counter() - t0
        outside.append((wall_i - step_kernel[0], wall_i))
    eng.cache.remove(sid)

    kern = {k: v for k, v in calls.items() if is_kernel(k)}
    host = {k: v for k, v in calls.items() if not is_kernel(k)}
    wall = statistics.median(walls)
    kernel_s = sum(v[1] for v in kern.values()) / steps
    out_s = statistics.median(o for o, _ in outside)
    share = statistics.median(o / w for o, w in outside)
    return {"out": out, "wall_ms": wall * 1e3,
            "kernels": sum(v[0] for v in kern.values()) // steps,
            "distinct_kernels": len(kern),
            "host_calls": sum(v[0] for v in host.values()) // steps,
            "kernel_ms": kernel_s * 1e3,
            "host_builtin_ms": sum(v[1] for v in host.values()) / steps * 1e3,
            "outside_ms": out_s * 1e3,
            "outside_share": share,
            "top": sorted(((v[1] / steps * 1e3, v[0] // steps, k) for k, v in kern.items()),
                          reverse=True)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outs", nargs="+", metavar="OUT", help="built output directories")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=128, help="tokens in the cache before decoding")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--top", type=int, default=8, help="slowest kernels listed per build")
    args = p.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

    rows = [profile(o, args.threads, args.context, args.steps) for o in args.outs]
    print(f"# decode step after {args.context} tokens, {args.threads} threads, {args.steps} steps")
    print(f"{'build':<40}{'kernels':>8}{'host calls':>11}{'step ms':>9}{'kernels ms':>11}"
          f"{'outside ms':>11}{'outside':>9}")
    for r in rows:
        print(f"{os.path.basename(r['out'].rstrip('/'))[:39]:<40}{r['kernels']:>8}"
              f"{r['host_calls']:>11}{r['wall_ms']:>9.2f}{r['kernel_ms']:>11.2f}"
              f"{r['outside_ms']:>11.2f}{r['outside_share']:>9.1%}")
    for r in rows:
        print(f"\n{r['out']}: slowest kernels per step "
              f"(host builtins timed: {r['host_builtin_ms']:.2f} ms in {r['host_calls']} calls)")
        for ms, n, name in r["top"][:args.top]:
            print(f"  {ms:8.3f} ms {n:4d}x  {name[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
