"""What the tuning log buys: per-kernel and end-to-end latency with the log versus without.

    python scripts/bench_tuning.py --shape llama-110m --threads 2 \
        --tuning-log autotune_logs/cpu-x86_64-znver4-avx512 [--no-rules]

Builds the random-weight checkpoint of scripts/bench.py three ways (cached under
~/.cache/tvm_llm/bench; --rebuild to redo): with our hand-written schedule rules only, with the
tuning log applied before those rules, and (--no-rules) with the scheduling phase switched off.
Then, in one run, interleaved:

* per kernel: each kernel's time in one batch-1 decode step and in one prefill of
  --prompt-len tokens (VM instrumentation, median over --kernel-repeats calls), tuned kernels
  matched to the generic kernel they replace;
* end to end: prefill and decode tokens/s as scripts/bench.py measures them.

Figures, not assertions: never a test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import SHAPES, TvmRunner, build_model, make_checkpoint, measure  # noqa: E402


def _kernel_times(engine, step, repeats: int, skip: set) -> dict:
    """{kernel name: median ms per step} for the VM calls one step() makes."""
    per_run = []
    current = {}
    starts = {}

    def instrument(func, name, before_run, ret, *args):
        name = str(name)
        if name in skip or (name.startswith("vm.builtin.") and "attention" not in name):
            return 0
        if before_run:
            starts[name] = time.perf_counter()
        else:
            current[name] = current.get(name, 0.0) + time.perf_counter() - starts.pop(name)
        return 0

    import tvm_ffi

    engine.vm.set_instrument(tvm_ffi.convert(instrument))
    try:
        step()  # warm-up
        for _ in range(repeats):
            current.clear()
            step()
            per_run.append(dict(current))
    finally:
        engine.vm.set_instrument(tvm_ffi.convert(lambda *a: 0))
    names = {n for r in per_run for n in r}
    return {n: statistics.median(r.get(n, 0.0) for r in per_run) * 1e3 for n in names}


def _steps(engine, prompt_len: int):
    import numpy as np

    prompt = [int(t) for t in np.random.default_rng(0).integers(10, 1000, size=prompt_len)]

    def prefill():
        sid = engine.cache.add()
        engine.prefill([(sid, prompt)])
        engine.cache.remove(sid)

    state = {}

    def decode():
        if "sid" not in state:
            state["sid"] = engine.cache.add()
            engine.prefill([(state["sid"], prompt[:16])])
        engine.decode_step([state["sid"]], [5])

    def done():
        if "sid" in state:
            engine.cache.remove(state.pop("sid"))

    return prefill, decode, done


def _generic(name: str, tuned: dict) -> str:
    return tuned.get(name, name)


def kernel_table(results: dict, order: list, phase: str) -> list:
    """rows: (kernel, {build: ms}); tuned copies folded onto their generic kernel."""
    rows = {}
    for build in order:
        times, tuned = results[build]["kernels"][phase], results[build]["tuned"]
        for name, ms in times.items():
            g = _generic(name, tuned)
            row = rows.setdefault(g, {"from_log": False})
            row[build] = row.get(build, 0.0) + ms
            if name in tuned:
                row["from_log"] = True
    return sorted(rows.items(), key=lambda kv: -max(v for k, v in kv[1].items() if k != "from_log"))


def print_kernels(results, order, phase, base, top):
    rows = kernel_table(results, order, phase)
    print(f"\n## {phase}: ms per step by kernel (median), top {top} by time; "
          f"x = {base} / tuned")
    head = "".join(f"{b:>14}" for b in order)
    print(f"{'kernel':<58}{head}{'x':>8}  source")
    totals = {b: 0.0 for b in order}
    for name, row in rows:
        for b in order:
            totals[b] += row.get(b, 0.0)
    for name, row in rows[:top]:
        cells = "".join(f"{row.get(b, float('nan')):>14.3f}" for b in order)
        x = (row.get(base, 0) / row["tuned"]) if row.get("tuned") else float("nan")
        short = name if len(name) <= 56 else name[:26] + ".." + name[-28:]
        print(f"{short:<58}{cells}{x:>8.2f}  {'log' if row['from_log'] else 'rules'}")
    cells = "".join(f"{totals[b]:>14.3f}" for b in order)
    x = totals[base] / totals["tuned"] if totals.get("tuned") else float("nan")
    print(f"{'total (' + str(len(rows)) + ' kernels)':<58}{cells}{x:>8.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-110m", choices=sorted(SHAPES))
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--tuning-log", default=None, metavar="DIR",
                   help="default: autotune_logs/<hw-key> of this machine")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kernel-repeats", type=int, default=5)
    p.add_argument("--top", type=int, default=14, help="kernels shown per table")
    p.add_argument("--no-rules", action="store_true",
                   help="also build without any schedule rules (scheduling phase off)")
    p.add_argument("--rebuild", action="store_true")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    from tvm_llm.targets import get_target

    hw_key = get_target("llvm").hw_key()
    log_dir = args.tuning_log or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                              "autotune_logs", hw_key)
    ckpt = make_checkpoint(args.shape)
    builds = {"rules": build_model(ckpt, args.shape, args.rebuild, tag="tunebench-rules"),
              "tuned": build_model(ckpt, args.shape, args.rebuild, tag="tunebench-tuned",
                                   tuning_log=os.path.abspath(log_dir))}
    if args.no_rules:
        builds["no rules"] = build_model(ckpt, args.shape, args.rebuild, tag="tunebench-norules",
                                         disabled_phases=("scheduling",))
    order = list(builds)
    runners = {b: TvmRunner(out, args.threads, name=b) for b, out in builds.items()}

    results = {}
    for b, r in runners.items():
        tuning = r.engine.manifest["report"].get("tuning") or {}
        tuned = {k["kernel"]: k["generic"] for k in tuning.get("kernels", [])}
        copies = {x["function"] for x in tuning.get("buckets", [])}
        prefill, decode, done = _steps(r.engine, args.prompt_len)
        dec = _kernel_times(r.engine, decode, args.kernel_repeats, copies)
        done()
        pre = _kernel_times(r.engine, prefill, max(1, args.kernel_repeats // 2), copies)
        results[b] = {"out": builds[b], "tuned": tuned, "kernels": {"decode": dec, "prefill": pre}}
        if b == "tuned":
            print(f"# tuning log {tuning.get('log')} [{tuning.get('hw_key')}]: "
                  f"{len(tuned)} kernels from the log, buckets "
                  f"{', '.join(x['bucket'] for x in tuning.get('buckets', [])) or 'none'}"
                  + (f"; {len(tuning.get('warnings', []))} warnings" if tuning.get("warnings") else ""))
    print(f"# {args.shape}, fp32, batch 1, {args.threads} threads; per-kernel medians of "
          f"{args.kernel_repeats} steps; end to end: prompt {args.prompt_len}, generate "
          f"{args.gen_len}, median of {args.repeats}")
    for phase in ("decode", "prefill"):
        print_kernels(results, order, phase, "rules", args.top)

    e2e = measure(list(runners.values()), args.prompt_len, args.gen_len, args.repeats)
    print("\n## end to end")
    print(f"{'build':<12}{'prefill tok/s':>15}{'decode tok/s':>15}{'decode ms/tok':>15}"
          f"{'prefill x':>11}{'decode x':>10}   (x = vs rules)")
    ref = e2e["rules"]
    for b in order:
        r = e2e[b]
        print(f"{b:<12}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>15.2f}"
              f"{1e3 / r['decode_tok_s']:>15.2f}{r['prefill_tok_s'] / ref['prefill_tok_s']:>11.2f}"
              f"{r['decode_tok_s'] / ref['decode_tok_s']:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "kernels": results, "end_to_end": e2e}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
