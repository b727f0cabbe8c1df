"""Plan versus measured memory: build llama-110m (random weights) with a budget, fill its KV
pool by generating, and compare the process's resident memory with the plan.

    python scripts/memory_check.py --max-memory 1GB

Measured = RSS at the end of generation (the pool full) minus the RSS of this same interpreter
after importing the runtime and TVM, before the engine loads anything: the baseline is the
interpreter + TVM runtime, which the plan covers with its fixed "runtime reserve", so the
comparison is between the plan's model figures (weights + activations + logits + KV pool + KV
workspace) and what loading and running the model added. Peak RSS (VmHWM) is reported too: it
shows whether loading the weights ever held them twice. Never a test: figures, not assertions.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    return _status_kib("VmRSS")


def checkpoint(shape: str) -> str:
    """bench.make_checkpoint's cached random checkpoint; its tokenizer comes from the bundled
    default model, so when that is missing write the tiny test tokenizer instead (generation
    here works on token ids; any tokenizer will do)."""
    import bench

    path = os.path.join(bench.CACHE, shape)
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    if os.path.isfile(os.path.join(HERE, "..", "tvm_llm", "default_model", "tokenizer.json")):
        return bench.make_checkpoint(shape)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import tiny_models

    torch.manual_seed(0)
    cfg = LlamaConfig(**bench.SHAPES[shape], max_position_embeddings=2048, tie_word_embeddings=False)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp, safe_serialization=True)
    tiny_models.make_tokenizer(tmp)
    os.replace(tmp, path)
    return path


def build(shape: str, max_memory: str, rebuild: bool, **kw) -> str:
    import bench

    import tvm_llm

    tag = "mem-" + max_memory.replace("%", "pct").replace(".", "p")
    out = os.path.join(bench.CACHE, f"{shape}-{tag}-out")
    if rebuild or not os.path.isfile(os.path.join(out, "manifest.json")):
        t0 = time.perf_counter()
        tvm_llm.build(checkpoint(shape), out, force=True, max_memory=max_memory, **kw)
        print(f"# built {shape} with --max-memory {max_memory} in {time.perf_counter() - t0:.0f}s")
    return out


def fill_pool(engine, context: int, seed: int = 0, gen: int = 16):
    """Generate, all at once, as many sequences of `context` tokens as the pool and the batch
    allow, plus one shorter sequence for the pages left over, so that every page of the pool
    holds KV data at the end; returns (tokens processed, pages in use at peak)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    cache = engine.cache
    vocab = engine.manifest["model"]["vocab_size"]
    per_seq = -(-context // cache.page_size)
    n = min(cache.max_batch_size, cache.total_pages // per_seq)
    lengths = [context - gen] * n
    left = (cache.total_pages - n * per_seq) * cache.page_size - gen
    if n < cache.max_batch_size and left > 0:
        lengths.append(left)
    prompts = [[int(t) for t in rng.integers(10, vocab, size=L)] for L in lengths]
    peak = [0]
    orig_end = cache.end

    def end():  # record the pages in use at the end of every step
        peak[0] = max(peak[0], cache.total_pages - cache.free_pages())
        orig_end()

    cache.end = end
    try:
        out = engine.generate_ids(prompts, max_new_tokens=gen, ignore_eos=True)
    finally:
        del cache.end
    return sum(map(len, out)) + sum(map(len, prompts)), peak[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-110m")
    p.add_argument("--max-memory", default="1GB")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--prefill-chunk-size", type=int, default=512)
    p.add_argument("--context", type=int, default=None,
                   help="tokens per sequence (default: the plan's context window)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--rebuild", action="store_true")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    out = build(args.shape, args.max_memory, args.rebuild, max_batch_size=args.max_batch_size,
                prefill_chunk_size=args.prefill_chunk_size, log=lambda *a: None)
    if "torch" in sys.modules:  # the build ran here: measure in a fresh interpreter
        import subprocess

        cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])]
        sys.exit(subprocess.call([c for c in cmd if c != "--rebuild"]))

    from tvm_llm.report import format_memory
    from tvm_llm.runtime.artifact import read_manifest
    from tvm_llm.runtime.engine import configure_threads
    from tvm_llm.memory.kv_budget import fmt_bytes

    configure_threads(args.threads)  # imports the TVM runtime
    import tokenizers  # noqa: F401  (the engine's imports, so the baseline holds them)

    baseline = rss()
    mem = read_manifest(out)["memory"]
    print(format_memory(mem))
    from tvm_llm import Engine

    t0 = time.perf_counter()
    engine = Engine(out, num_threads=args.threads)
    loaded = rss() - baseline
    load_peak = _status_kib("VmHWM") - baseline
    context = args.context or mem["context_window"]
    tokens, pages = fill_pool(engine, context)
    measured = rss() - baseline
    peak = _status_kib("VmHWM") - baseline
    seconds = time.perf_counter() - t0
    plan = mem["model_bytes"]
    plan_weights = mem["weights"]["bytes"]
    print()
    print(f"baseline (interpreter + numpy + TVM runtime, subtracted): {fmt_bytes(baseline)}")
    print(f"after loading:  {fmt_bytes(loaded)} resident (plan: weights {fmt_bytes(plan_weights)}); "
          f"peak while loading {fmt_bytes(load_peak)}")
    print(f"processed {tokens} tokens (prompts + generated) in {seconds:.0f}s, KV pages in use "
          f"at peak: {pages} of "
          f"{engine.cache.total_pages}")
    print(f"plan (weights + activations + logits + KV pool + KV workspace): {fmt_bytes(plan)}")
    print(f"measured RSS - baseline: {fmt_bytes(measured)} ({measured / plan - 1:+.1%} vs plan); "
          f"peak {fmt_bytes(peak)}")
    print(f"plan total with runtime reserve {fmt_bytes(mem['total_bytes'])}; measured process RSS "
          f"{fmt_bytes(rss())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plan_model_bytes": plan, "measured_bytes": measured, "peak_bytes": peak,
                       "baseline_bytes": baseline, "loaded_bytes": loaded,
                       "load_peak_bytes": load_peak, "pages_used": pages,
                       "total_pages": engine.cache.total_pages, "tokens": tokens,
                       "plan_total_bytes": mem["total_bytes"], "process_rss": rss()}, f, indent=2)


if __name__ == "__main__":
    main()
