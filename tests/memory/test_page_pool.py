"""The page pool at run time (tiny llama, TVM's paged KV cache): exact Python-side page checks,
pages returning to the pool, forks sharing pages, exhaustion and preemption."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from tvm_llm.runtime.kv_cache import PagePoolFull

PROMPT = [5, 9, 33, 41, 7, 100, 3, 250, 17, 18, 19, 60, 61, 70, 71, 72, 80, 81, 90, 91, 92, 93,
          94, 95, 96, 97, 98, 99, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112]  # 40


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def out(budget_built):
    return budget_built


@pytest.fixture(scope="module")
def engine(out):
    from tvm_llm import Engine

    return Engine(out, num_threads=1)  # a tiny model: one thread beats syncing two


def small_engine(out, tokens: int):
    from tvm_llm import Engine

    return Engine(out, kv_cache_tokens=tokens, num_threads=1)


def test_page_checks_match_tvm_exactly(engine):
    """Random add / fork / append / remove: every append and fork takes exactly the pages the
    Python-side check predicts (TVM would leave a corrupt cache if the check were short)."""
    cache = engine.cache
    rng = np.random.default_rng(0)
    live = []
    for _ in range(400):
        op = rng.integers(4)
        free = cache.free_pages()
        if op == 0 and len(live) < cache.max_batch_size:
            live.append(cache.add())
            assert cache.free_pages() == free
        elif op == 1 and live and len(live) < cache.max_batch_size:
            parent = live[rng.integers(len(live))]
            need = cache.fork_pages(parent)
            live.append(cache.fork(parent))
            assert free - cache.free_pages() == need
        elif op == 2 and live:
            ids = [s for s in live if rng.random() < 0.6] or live[:1]
            lengths = [int(rng.integers(1, 24)) for _ in ids]
            need = cache.pages_needed(ids, lengths)
            if need > free:
                with pytest.raises(PagePoolFull):
                    cache.begin(ids, lengths)
                assert cache.free_pages() == free
                continue
            cache.begin(ids, lengths)  # page accounting only: the model need not run
            cache.end()
            assert free - cache.free_pages() == need
        elif op == 3 and live:
            cache.remove(live.pop(rng.integers(len(live))))
    for sid in live:
        cache.remove(sid)
    assert cache.free_pages() == cache.total_pages
    assert cache.sequences == {}


def test_fork_shares_prefix_pages_and_matches_unforked_tokens(engine):
    cache = engine.cache
    total, ps = cache.total_pages, cache.page_size
    sid = cache.add()
    engine.prefill([(sid, PROMPT)])  # 40 tokens: 2 full pages + 8 tokens on a third
    assert total - cache.free_pages() == 3
    child = cache.fork(sid)
    assert total - cache.free_pages() == 4  # only the partial last page is copied
    at_boundary = cache.add()
    engine.prefill([(at_boundary, PROMPT[:2 * ps])])
    used = total - cache.free_pages()
    fork2 = cache.fork(at_boundary)
    assert total - cache.free_pages() == used  # a fork at a page boundary copies nothing
    a, b = engine.decode_step([sid, child], [7, 7])
    np.testing.assert_array_equal(a, b)
    for s in (sid, child, at_boundary, fork2):
        cache.remove(s)
    assert cache.free_pages() == total

    # parallel sampling through the generation API: the samples share the prompt's pages
    peak = [0]
    end = cache.end

    def spy():
        peak[0] = max(peak[0], cache.total_pages - cache.free_pages())
        end()

    alone = engine.generate_ids([PROMPT], max_new_tokens=8, ignore_eos=True)[0]
    cache.end = spy
    try:
        forked = engine.generate_ids([PROMPT], max_new_tokens=8, ignore_eos=True, n=4)[0]
    finally:
        del cache.end
    assert forked == [alone] * 4  # greedy: every sample is the unforked run
    assert peak[0] == 3 + 3  # 3 prompt pages shared + one own last page per extra sample
    assert cache.free_pages() == total

    kw = dict(max_new_tokens=10, temperature=1.2, top_k=40, ignore_eos=True)
    samples = engine.generate_ids([PROMPT, PROMPT[:20]], n=3, seed=11, **kw)
    for i, p in enumerate([PROMPT, PROMPT[:20]]):
        for j in range(3):  # sample j of prompt i draws from seed + i * n + j
            assert samples[i][j] == engine.generate_ids([p], seed=11 + i * 3 + j, **kw)[0]
    assert len({tuple(s) for s in samples[0]}) > 1
    assert cache.free_pages() == total


def test_1000_add_generate_remove_cycles_leave_pages_and_rss_flat(engine):
    cache = engine.cache
    rng = np.random.default_rng(1)

    def cycle(i):
        n = int(rng.integers(1, 60))
        prompt = [int(t) for t in rng.integers(3, 300, size=n)]
        if i % 2:
            sid = cache.add()
            tok = int(np.argmax(engine.prefill([(sid, prompt)])[0]))
            for _ in range(int(rng.integers(1, 4))):
                tok = int(np.argmax(engine.decode_step([sid], [tok])[0]))
            cache.remove(sid)
        else:
            engine.generate_ids([prompt] * int(rng.integers(1, 3)), max_new_tokens=3,
                                ignore_eos=True, n=int(rng.integers(1, 3)))
        assert cache.free_pages() == cache.total_pages

    for i in range(150):  # warm up: every logits size and pooled buffer has been seen
        cycle(i)
    gc.collect()
    before = _rss()
    for i in range(1000):
        cycle(i)
    gc.collect()
    grown = _rss() - before
    assert cache.free_pages() == cache.total_pages and cache.sequences == {}
    assert grown < 2 * 2**20, f"RSS grew by {grown / 2**20:.2f} MiB over 1000 cycles"


def test_pool_exhaustion_is_a_clear_error_and_the_engine_keeps_working(out):
    eng = small_engine(out, 64)  # TVM: ceil(64 / 16) + 1 = 5 pages = 80 tokens
    cache = eng.cache
    assert cache.total_pages == 5
    expected = eng.generate_ids([PROMPT[:10]], max_new_tokens=5, ignore_eos=True)

    # a prompt longer than the pool is refused before anything is allocated
    with pytest.raises(PagePoolFull, match="--max-memory"):
        eng.generate_ids([PROMPT * 3], max_new_tokens=4, ignore_eos=True)
    assert cache.free_pages() == cache.total_pages and cache.sequences == {}

    # a lone sequence that outgrows the pool stops with the error, never a TVM abort
    with pytest.raises(PagePoolFull, match="more than the KV pool"):
        eng.generate_ids([PROMPT[:30]], max_new_tokens=100, ignore_eos=True)
    assert cache.free_pages() == cache.total_pages and cache.sequences == {}

    # the low-level API: a refused step leaves lengths and pages untouched
    sid = cache.add()
    eng.prefill([(sid, PROMPT)])
    free, lengths = cache.free_pages(), dict(cache.sequences)
    with pytest.raises(PagePoolFull, match="pages needed"):
        cache.begin([sid], [60])
    assert cache.free_pages() == free and cache.sequences == lengths
    others = [cache.add() for _ in range(cache.max_batch_size - 1)]
    with pytest.raises(PagePoolFull, match="max-batch-size"):
        cache.add()
    with pytest.raises(PagePoolFull, match="max-batch-size"):
        cache.fork(sid)
    for s in [sid, *others]:
        cache.remove(s)

    assert eng.generate_ids([PROMPT[:10]], max_new_tokens=5, ignore_eos=True) == expected
    assert cache.free_pages() == cache.total_pages


def test_full_pool_preempts_the_youngest_and_results_match(out):
    eng = small_engine(out, 64)  # 5 pages: four 30-token prompts cannot all grow at once
    prompts = [[3 + i] + PROMPT[: 25 + i] for i in range(4)]
    alone = [eng.generate_ids([p], max_new_tokens=20, ignore_eos=True)[0] for p in prompts]
    together = eng.generate_ids(prompts, max_new_tokens=20, ignore_eos=True)
    assert together == alone
    assert eng.preemptions > 0
    assert eng.cache.free_pages() == eng.cache.total_pages


def test_why_the_python_check_must_be_exact(out):
    """What TVM itself does past capacity: kv_state_begin_forward raises only after growing the
    sequence and taking every free page, so the cache is left inconsistent (no abort, but no
    recovery either). This engine is thrown away afterwards."""
    eng = small_engine(out, 64)
    cache = eng.cache
    sid = cache.add()
    with pytest.raises(Exception, match="The KV cache is full"):
        cache._f["kv_state_begin_forward"](cache.handle, cache._shape([sid]), cache._shape([200]))
    assert cache.free_pages() == 0  # pages taken for a forward that never happened
    assert int(cache._f["attention_kv_cache_get_total_sequence_length"](cache.handle)) == 200
