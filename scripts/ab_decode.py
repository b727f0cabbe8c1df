#!/usr/bin/env python
"""Interleaved A/B of decode steps (or prefills): two or more builds as Engines in one process.

Each build gets one sequence prefilled with --context random tokens; then every round times
--steps batch-1 decode steps of each build in turn (the order reversed every other round, so
neither build always runs after the other). Prints per round the median step of each build,
then per build the median over rounds (ms and tok/s) and its CPU time per step (all threads),
and the per-round ratio of each build to the first. This VM's memory bandwidth drifts 2x
within a minute: only figures of the same rounds compare; on a shared machine at 1 thread the
CPU-time ratio is the steadier one.

    python scripts/ab_decode.py OUT_A OUT_B [--threads 2] [--context 128] [--rounds 16] [--steps 8]
                                [--reverse-load] [--batch 1]

--reverse-load creates the Engines last build first (the baseline stays the first for the
ratios): where a build's weights land in memory can matter, so run both orders. --batch B
decodes B sequences per step (the batched kernels' path). --prefill N times prefills of N
tokens into a fresh sequence instead of decode steps (a prompt longer than the build's prefill
chunk in chunks: the later ones attend to the earlier ones' pages).
"""
from __future__ import annotations

import argparse
import statistics
import time


def timed_prefill(eng, prompt) -> float:
    """Seconds of one prefill of `prompt` into a fresh sequence (removed afterwards), in the
    build's prefill chunks when it is longer (as generate feeds it)."""
    sid = eng.cache.add()
    chunk = eng.cache.prefill_chunk_size
    t0 = time.perf_counter()
    for i in range(0, len(prompt), chunk):
        eng.prefill([(sid, prompt[i:i + chunk])])
    took = time.perf_counter() - t0
    eng.cache.remove(sid)
    return took


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outs", nargs="+", help="built output directories (the first is the baseline)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--reverse-load", action="store_true", help="create the Engines in reverse order")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded per step")
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="time prefills of N random tokens (a fresh sequence each), not decode steps")
    args = p.parse_args()

    import numpy as np

    from tvm_llm import Engine

    prompt = [int(t) for t in np.random.default_rng(0).integers(10, 200, size=args.context)]
    prefill_prompt = [int(t) for t in np.random.default_rng(1).integers(10, 200, size=args.prefill)]
    engines = [None] * len(args.outs)
    for k in (reversed(range(len(args.outs))) if args.reverse_load else range(len(args.outs))):
        eng = Engine(args.outs[k], num_threads=args.threads, max_batch_size=args.batch)
        sids = [] if args.prefill else [eng.cache.add() for _ in range(args.batch)]
        for sid in sids:
            eng.prefill([(sid, prompt)])
        for _ in range(3):  # warm-up
            if args.prefill:
                timed_prefill(eng, prefill_prompt)
            else:
                eng.decode_step(sids, [5] * args.batch)
        engines[k] = (eng, sids)
    wall = [[] for _ in engines]
    cpu = [[] for _ in engines]
    for r in range(args.rounds):
        order = list(range(len(engines)))
        for k in (order if r % 2 == 0 else order[::-1]):
            eng, sids = engines[k]
            steps = []
            c0 = time.process_time()
            for _ in range(args.steps):
                if args.prefill:
                    steps.append(timed_prefill(eng, prefill_prompt))
                    continue
                t0 = time.perf_counter()
                eng.decode_step(sids, [5] * args.batch)
                steps.append(time.perf_counter() - t0)
            cpu[k].append((time.process_time() - c0) / args.steps)
            wall[k].append(statistics.median(steps))
        print(f"round {r:2d}: " + "  ".join(f"{1e3 * w[-1]:7.2f} ms" for w in wall), flush=True)
    for out, w, c in zip(args.outs, wall, cpu):
        what, toks = ("prefill", args.prefill) if args.prefill else ("step", args.batch)
        print(f"{out}: median {what} {1e3 * statistics.median(w):.2f} ms = "
              f"{toks / statistics.median(w):.1f} tok/s "
              f"(rounds {1e3 * min(w):.2f}-{1e3 * max(w):.2f} ms), CPU {1e3 * statistics.median(c):.2f} ms/step")
    for k in range(1, len(engines)):
        rw = [b / a for a, b in zip(wall[0], wall[k])]
        rc = [b / a for a, b in zip(cpu[0], cpu[k])]
        print(f"{args.outs[k]} / {args.outs[0]} per round: step time median {statistics.median(rw):.3f} "
              f"({min(rw):.3f}-{max(rw):.3f}), CPU time median {statistics.median(rc):.3f} "
              f"({min(rc):.3f}-{max(rc):.3f})")


if __name__ == "__main__":
    main()
