#!/usr/bin/env python
"""Where the time of one decode step and one prefill goes, kernel by kernel.

Runs a built output directory through the Engine and times every call the Relax VM makes
(kernels, the paged-KV-cache attention builtin, shape and allocation builtins) with the VM's
instrumentation hook; prints the untimed step time next to it, since the hook adds about a
microsecond per call.

    python scripts/profile_step.py OUT [--threads 2] [--prompt-len 128] [--steps 20] [--prefills 3]
                                      [--cold MB]

`--cold MB` reads an MB-sized buffer before every prefill, as scripts/bench.py's bandwidth probe
does before each timed run, so the weights come from DRAM rather than the L3.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", metavar="OUT")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prefills", type=int, default=3, help="prefill runs averaged (each timed "
                   "and untimed)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--cold", type=int, default=0, metavar="MB",
                   help="read an MB-sized buffer before every prefill (0: warm caches)")
    args = p.parse_args(argv)
    if args.cold < 0:
        p.error(f"--cold takes megabytes >= 0, not {args.cold}")
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import numpy as np

    from tvm_llm import Engine

    eng = Engine(args.out, num_threads=args.threads, max_batch_size=1)
    flush = np.ones(args.cold * 2**18, dtype=np.float32)

    def evict():
        if args.cold:
            float(flush.sum())
    prompt = [int(t) for t in np.random.default_rng(0).integers(10, 1000, size=args.prompt_len)]
    sid = eng.cache.add()
    eng.prefill([(sid, prompt)])  # warm-up
    eng.cache.remove(sid)

    times: dict = {}
    started = [0.0]

    def instrument(func, symbol, before, ret, *a):
        if before:
            started[0] = time.perf_counter()
        else:
            entry = times.setdefault(symbol.rstrip("0123456789_"), [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - started[0]
        return 0

    def report(title, runs, wall):
        total = sum(v[1] for v in times.values()) / runs
        print(f"{title}: {wall * 1e3:.2f} ms untimed, {total * 1e3:.2f} ms in "
              f"{sum(v[0] for v in times.values()) // runs} timed calls")
        for name, (count, sec) in sorted(times.items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"  {sec / runs * 1e3:8.3f} ms {count // runs:5d}x  {name[:90]}")
        times.clear()

    # prefill: untimed, then timed, `prefills` times
    wall = 0.0
    for run in range(args.prefills):
        evict()
        t0 = time.perf_counter()
        sid = eng.cache.add()
        eng.prefill([(sid, prompt)])
        wall += time.perf_counter() - t0
        eng.cache.remove(sid)
        evict()
        eng.vm.set_instrument(instrument)
        sid = eng.cache.add()
        eng.prefill([(sid, prompt)])
        eng.vm.set_instrument(None)
        if run + 1 < args.prefills:
            eng.cache.remove(sid)
    report(f"prefill of {args.prompt_len} tokens", args.prefills, wall / args.prefills)

    # decode steps after that prompt
    for _ in range(3):
        eng.decode_step([sid], [5])
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.decode_step([sid], [5])
    wall = (time.perf_counter() - t0) / args.steps
    eng.vm.set_instrument(instrument)
    for _ in range(args.steps):
        eng.decode_step([sid], [5])
    eng.vm.set_instrument(None)
    report("decode step", args.steps, wall)
    return 0


if __name__ == "__main__":
    sys.exit(main())
