"""KV memory of a mixed chat workload: a contiguous max-length reservation per conversation
versus the pages TVM's paged KV cache actually holds.

    python scripts/memory_report.py                       # -> scripts/figures/memory_report.png
    python scripts/memory_report.py --conversations 200 --max-len 2000 --concurrency 16 -o kv.png

The workload (seeded): conversations of varied length (log-normal, clipped to [32, --max-len]
tokens; 60% prompt, 40% reply) served --concurrency at a time, a new one starting as soon as
one ends. Page counts are measured, not computed: the workload is replayed through the real
runtime (TVM's paged KV cache of a tiny compiled llama: add_sequence, begin/end_forward with
each step's token counts, remove_sequence) and the pool's free-page count is read after every
step. Bytes are those pages times the page size of the model the figures are for (llama-110m:
2 x 12 layers x 4 KV heads x 64 x fp32 = 24 KiB per token). The model itself never runs: page
accounting does not depend on it. A contiguous cache reserves --max-len tokens per
conversation for its whole life, whatever its length.

Needs matplotlib (`pip install -e .[report]`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SHAPE_KV = {  # layers, kv heads, head dim: what one token's K and V cost
    "llama-110m": (12, 4, 64),
    "llama-1b": (22, 4, 64),
}


def workload(n: int, max_len: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=np.log(max_len / 4), sigma=0.8, size=n), 32, max_len).astype(int)
    return [(int(L * 0.6), int(L) - int(L * 0.6)) for L in lengths]  # (prompt, reply)


def tiny_engine(out: str | None, concurrency: int, capacity: int):
    from tvm_llm import Engine

    if out is None:
        import memory_check

        out = os.path.join(os.path.expanduser("~"), ".cache", "tvm_llm", "bench", "llama-tiny-report-out")
        if not os.path.isfile(os.path.join(out, "manifest.json")):
            import tvm_llm

            tvm_llm.build(memory_check.checkpoint("llama-tiny"), out, force=True,
                          max_batch_size=concurrency, log=lambda *a: None)
    return Engine(out, max_batch_size=concurrency, kv_cache_tokens=capacity)


def replay(cache, convs, concurrency: int, decode_chunk: int, chunk: int):
    """Serve the conversations through the runtime's page pool; one sample per step:
    (step, tokens held, pages held, conversations active)."""
    waiting = list(enumerate(convs))
    active = {}  # seq id -> [prompt left, reply left, tokens held]
    samples, step = [], 0
    while waiting or active:
        while waiting and len(active) < concurrency:
            _, (prompt, reply) = waiting.pop(0)
            active[cache.add()] = [prompt, reply, 0]
        ids, lengths, room = [], [], chunk  # one step holds at most a prefill chunk of tokens
        for sid, st in active.items():
            n = min(st[0] if st[0] else min(st[1], decode_chunk), room)
            if n:
                ids.append(sid)
                lengths.append(n)
                room -= n
        cache.begin(ids, lengths)  # pages are taken here; the model need not run for that
        cache.end()
        for sid, n in zip(ids, lengths):
            st = active[sid]
            st[2] += n
            if st[0]:
                st[0] -= n
            else:
                st[1] -= n
        step += 1
        samples.append((step, sum(st[2] for st in active.values()),
                        cache.total_pages - cache.free_pages(), len(active)))
        for sid in [s for s, st in active.items() if st[0] == 0 and st[1] == 0]:
            cache.remove(sid)
            del active[sid]
    assert cache.free_pages() == cache.total_pages, "pages did not all return to the pool"
    return samples


def plot(samples, convs, args, bpt, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    GiB, page_bytes = 2**30, bpt * args.page_size
    steps = [s[0] for s in samples]
    paged = [s[2] * page_bytes / GiB for s in samples]
    exact = [s[1] * bpt / GiB for s in samples]
    contiguous = [s[3] * args.max_len * bpt / GiB for s in samples]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2.2, 1]})
    ax.plot(steps, contiguous, color="#c0392b", lw=1.6,
            label=f"contiguous: {args.max_len} tokens reserved per conversation")
    ax.plot(steps, paged, color="#2471a3", lw=1.6, label=f"paged: pages held ({args.page_size} tokens each)")
    ax.plot(steps, exact, color="#222222", lw=0.7, ls=":",
            label="tokens actually stored (pages waste < 1 page per conversation)")
    ax.set_xlabel(f"serving step (one token per decoding conversation; prompts share a "
                  f"{args.prefill_chunk}-token chunk)")
    ax.set_ylabel("KV cache memory (GiB)")
    ax.set_title(f"{len(convs)} conversations, {args.concurrency} at a time ({args.shape}, fp32)")
    ax.set_ylim(0, max(contiguous) * 1.3)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=9, framealpha=0.95)

    peaks = [max(contiguous), max(paged)]
    means = [sum(contiguous) / len(contiguous), sum(paged) / len(paged)]
    x = range(2)
    w = 0.38
    b1 = bx.bar([i - w / 2 for i in x], peaks, w, label="peak", color=["#c0392b", "#2471a3"])
    b2 = bx.bar([i + w / 2 for i in x], means, w, label="mean", color=["#e6b0aa", "#a9cce3"])
    for bars in (b1, b2):
        for b in bars:
            bx.annotate(f"{b.get_height():.2f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=9)
    bx.set_xticks(list(x), ["contiguous", "paged"])
    bx.set_ylabel("GiB")
    bx.set_title(f"peak {peaks[0] / peaks[1]:.1f}x, mean {means[0] / means[1]:.1f}x less with pages")
    bx.set_ylim(0, peaks[0] * 1.15)
    bx.legend(fontsize=9)
    bx.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    return peaks, means


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--max-len", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--decode-chunk", type=int, default=1, help="decode tokens per step (page "
                   "accounting only: larger values replay faster, coarser in time)")
    p.add_argument("--shape", default="llama-110m", choices=sorted(SHAPE_KV))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="a built tiny model (default: build one, cached)")
    p.add_argument("-o", "--output", default=os.path.join(HERE, "figures", "memory_report.png"))
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("memory_report.py needs matplotlib: pip install -e '.[report]'")

    from tvm_llm.memory.kv_budget import fmt_bytes, kv_bytes_per_token

    convs = workload(args.conversations, args.max_len, args.seed)
    engine = tiny_engine(args.out, args.concurrency, args.concurrency * args.max_len)
    cache = engine.cache
    if cache.page_size != args.page_size:  # the page size is a runtime choice: make our own pool
        from tvm_llm.runtime.kv_cache import PagedKVCache

        cache = PagedKVCache(engine.vm, args.concurrency, args.concurrency * args.max_len,
                             engine.cache.prefill_chunk_size, args.page_size)
    samples = replay(cache, convs, args.concurrency, args.decode_chunk,
                     min(args.prefill_chunk, cache.prefill_chunk_size))
    layers, kv_heads, head_dim = SHAPE_KV[args.shape]
    bpt = kv_bytes_per_token(layers, kv_heads, head_dim, "float32")
    peaks, means = plot(samples, convs, args, bpt, args.output)
    total = sum(a + b for a, b in convs)
    print(f"{len(convs)} conversations, {total} tokens (mean {total / len(convs):.0f}, max "
          f"{max(a + b for a, b in convs)}), {args.concurrency} at a time, {len(samples)} steps; "
          f"{args.shape}: {fmt_bytes(bpt)} per token, pages of {args.page_size} tokens")
    print(f"contiguous ({args.max_len} tokens each): peak {fmt_bytes(peaks[0] * 2**30)}, "
          f"mean {fmt_bytes(means[0] * 2**30)}")
    print(f"paged (measured pages):          peak {fmt_bytes(peaks[1] * 2**30)}, "
          f"mean {fmt_bytes(means[1] * 2**30)}  -> {peaks[0] / peaks[1]:.1f}x / "
          f"{means[0] / means[1]:.1f}x less")
    print(f"wrote {args.output}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": samples, "conversations": convs, "bytes_per_token": bpt,
                       "page_size": args.page_size, "max_len": args.max_len}, f)


if __name__ == "__main__":
    main()
