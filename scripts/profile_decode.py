#!/usr/bin/env python
"""Kernels per decode step, and the share of the step spent outside kernels.

For each built output directory: the decode step's wall time (median, no instrumentation),
the kernels one step launches and their summed time (the Relax VM's instrumentation hook
times every call), and what is left, the time outside kernels: the VM's own dispatch, shape
functions (``shape_func``, ``compute_symbolic_expr``), and the allocation / shape builtins
(``vm.builtin.alloc_tensor``, ``make_shape``...), which the hook also times and which are
listed apart (`--host`), and the engine's own Python around the VM call (KV cache begin/end
forward, the input tensors, the logits copy). The paged-attention builtin counts as a kernel.

    python scripts/profile_decode.py OUT [OUT ...] [--threads 2] [--context 128] [--steps 30]

The hook is a Python callback, called before and after every call: it costs microseconds a
call, ~2.4 ms over a llama-110m step's ~640 calls (quiet machine), more than the step spends
outside its kernels. So each timed call is corrected by the hook's share inside it, taken as
the mean time the hook measures around `vm.builtin.null_value` (a call that does nothing):
"kernels ms" and the host builtins' ms are corrected, and "outside ms" is the plain steps'
wall time less the corrected kernel time; "glue ms" is its part in the engine's Python around
the VM call (from plain steps), the rest is inside the VM call. "hooked out" is the older
figure, the instrumented steps' wall time less their kernels' (hook included). Plain and
instrumented steps alternate, so both see the same machine load; on a busy machine compare
shares, not milliseconds.
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


def _hook_share(eng, instrument, calls: dict) -> float:
    """Mean time the hook measures around `vm.builtin.null_value` in a one-token prefill (on a
    scratch sequence, removed after); its entries are taken out of `calls` again."""
    before = {k: list(v) for k, v in calls.items()}  # the entries are mutated in place
    sid = eng.cache.add()
    eng.vm.set_instrument(instrument)
    try:
        eng.prefill([(sid, [5])])
    finally:
        eng.vm.set_instrument(None)
        eng.cache.remove(sid)
    null = calls.get("vm.builtin.null_value")
    calls.clear()
    calls.update(before)
    return null[1] / null[0] if null else 0.0


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
    vm_call = [0.0]

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

    decode_fn = getattr(eng, "_decode_fn", None)  # None: an older engine (no glue figure)

    def timed_decode(*args):  # the VM call alone, to tell the engine's glue from the VM's
        t0 = time.perf_counter()
        try:
            return decode_fn(*args)
        finally:
            vm_call[0] = time.perf_counter() - t0

    if decode_fn is not None:
        eng._decode_fn = timed_decode
    walls, vm_walls, hooked = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.decode_step([sid], [5])
        walls.append(time.perf_counter() - t0)
        vm_walls.append(vm_call[0])
        eng.vm.set_instrument(instrument)
        step_kernel[0] = 0.0
        t0 = time.perf_counter()
        try:
            eng.decode_step([sid], [5])
        finally:
            eng.vm.set_instrument(None)
        wall_i = time.perf_counter() - t0
        hooked.append(wall_i - step_kernel[0])
    if decode_fn is not None:
        eng._decode_fn = decode_fn
    eng.cache.remove(sid)

    null = calls.get("vm.builtin.null_value")
    # the hook's share of one timed call; a decode without kills (LeanVMCalls) makes no
    # null_value call: then it is taken from the kills of a one-token prefill
    per_call = null[1] / null[0] if null else _hook_share(eng, instrument, calls)
    kern = {k: v for k, v in calls.items() if is_kernel(k)}
    host = {k: v for k, v in calls.items() if not is_kernel(k)}

    def table(group):  # (ms per step, calls per step, symbol), the hook's share taken off
        return sorted(((v[1] / steps - v[0] / steps * per_call) * 1e3, v[0] // steps, k)
                      for k, v in group.items())[::-1]

    wall = statistics.median(walls)
    kernel_s = sum(ms for ms, _, _ in table(kern)) / 1e3
    return {"out": out, "wall_ms": wall * 1e3,
            "kernels": sum(v[0] for v in kern.values()) // steps,
            "distinct_kernels": len(kern),
            "host_calls": sum(v[0] for v in host.values()) // steps,
            "kernel_ms": kernel_s * 1e3,
            "hook_us": per_call * 1e6,
            "host_builtin_ms": sum(ms for ms, _, _ in table(host)),
            "outside_ms": (wall - kernel_s) * 1e3,
            "outside_share": (wall - kernel_s) / wall,
            "glue_ms": (statistics.median(w - v for w, v in zip(walls, vm_walls)) * 1e3
                        if decode_fn is not None else float("nan")),
            "hooked_outside_ms": statistics.median(hooked) * 1e3,
            "top": table(kern), "host": table(host)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outs", nargs="+", metavar="OUT", help="built output directories")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=128, help="tokens in the cache before decoding")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--top", type=int, default=8, help="slowest kernels listed per build")
    p.add_argument("--host", action="store_true",
                   help="also list the host calls (shape and allocation builtins) per type")
    args = p.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

    rows = [profile(o, args.threads, args.context, args.steps) for o in args.outs]
    print(f"# decode step after {args.context} tokens, {args.threads} threads, {args.steps} steps")
    print(f"{'build':<36}{'kernels':>8}{'host calls':>11}{'step ms':>9}{'kernels ms':>11}"
          f"{'outside ms':>11}{'outside':>9}{'glue ms':>9}{'hooked out':>11}")
    for r in rows:
        print(f"{os.path.basename(r['out'].rstrip('/'))[:35]:<36}{r['kernels']:>8}"
              f"{r['host_calls']:>11}{r['wall_ms']:>9.2f}{r['kernel_ms']:>11.2f}"
              f"{r['outside_ms']:>11.2f}{r['outside_share']:>9.1%}{r['glue_ms']:>9.2f}"
              f"{r['hooked_outside_ms']:>11.2f}")
    for r in rows:
        print(f"\n{r['out']}: slowest kernels per step (hook share {r['hook_us']:.2f} us a call "
              f"taken off; host builtins {r['host_builtin_ms']:.2f} ms in {r['host_calls']} calls)")
        for ms, n, name in r["top"][:args.top]:
            print(f"  {ms:8.3f} ms {n:4d}x  {name[:90]}")
        if args.host:
            print("  host calls per step:")
            for ms, n, name in r["host"]:
                print(f"  {ms:8.3f} ms {n:4d}x  {name[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
