"""The Engine's step-level API (add / step / abort), token-id checks and thread safety."""
from __future__ import annotations

import threading

import pytest

from tvm_llm.errors import UserError

PROMPTS = [[5, 9, 33, 41, 7], [100, 3, 250, 17, 18, 19, 60, 61], [11, 12]]


@pytest.fixture(scope="module")
def engine(built):
    from tvm_llm import Engine

    return Engine(built("llama"), num_threads=1)


@pytest.mark.parametrize("bad", [100000000, -3, 2**63 - 1])
def test_out_of_range_token_ids_are_user_errors(engine, bad):
    v = engine.vocab_size
    with pytest.raises(UserError, match=rf"token id {bad} is out of range.*vocabulary size is {v}"):
        engine.generate([[5, bad]], max_new_tokens=2)
    with pytest.raises(UserError, match="out of range"):
        engine.add([5, bad])
    with pytest.raises(UserError, match="out of range"):  # the low-level calls are guarded too
        engine.hidden_states([5, bad])
    sid = engine.cache.add()
    try:
        with pytest.raises(UserError, match=rf"token id {bad} is out of range"):
            engine.decode_step([sid], [bad])
        assert engine.cache.sequences[sid] == 0  # refused before the cache moved
    finally:
        engine.cache.remove(sid)
    with pytest.raises(UserError, match="not an integer"):
        engine.add([5, 1.5])
    assert not engine.has_work() and engine.cache.sequences == {}
    # the last valid id is accepted and the engine keeps working
    assert len(engine.generate_ids([[5, v - 1]], max_new_tokens=3, ignore_eos=True)[0]) == 3


def test_step_api_matches_generate_and_abort_frees_pages(engine):
    expected = engine.generate_ids(PROMPTS, max_new_tokens=8, ignore_eos=True)
    rids = [engine.add(p, max_new_tokens=8, ignore_eos=True, buffer=False)[0] for p in PROMPTS]
    extra = engine.add(PROMPTS[0] * 20, max_new_tokens=50, ignore_eos=True, buffer=False)[0]
    got = {r: [] for r in rids}
    steps = 0
    while any(len(v) < 8 for v in got.values()):
        for e in engine.step():
            if e.request_id in got:
                got[e.request_id].append(e.token)
        steps += 1
    assert [got[r] for r in rids] == expected
    assert engine.cache.sequences  # the long request still runs
    engine.abort(extra)
    assert not engine.has_work()
    assert engine.cache.free_pages() == engine.cache.total_pages and engine.cache.sequences == {}


@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("budget", ["chunk", 16])
def test_long_prompt_prefill_does_not_stall_running_sequences(engine, budget, mixed):
    """A prompt of several chunks is prefilled `decode_prefill_tokens` per step while another
    sequence decodes (in the same prefill call when `mixed_steps`, else in a call of its own),
    and the running sequence keeps decoding a token every step; the tokens equal a run without
    interleaving."""
    chunk = engine.cache.prefill_chunk_size
    per_step = chunk if budget == "chunk" else budget
    if mixed:  # the decoding sequence's token shares the call's chunk
        per_step = min(per_step, chunk - 1)
    long_prompt = [(7 * i) % 300 + 3 for i in range(3 * chunk + 5)]
    expected = engine.generate_ids([long_prompt], max_new_tokens=2, ignore_eos=True)[0]
    engine.decode_prefill_tokens = chunk if budget == "chunk" else budget
    engine.mixed_steps = mixed
    try:
        short = engine.add(PROMPTS[0], max_new_tokens=200, ignore_eos=True, buffer=False)[0]
        engine.step()  # the short prompt is prefilled and decoding
        long_rid = engine.add(long_prompt, max_new_tokens=2, ignore_eos=True, buffer=False)[0]
        got, first_long = [], None
        for step in range(1, 3 * chunk // per_step + 5):
            events = engine.step()
            assert any(e.request_id == short for e in events), f"step {step}: the short one stalled"
            got += [e.token for e in events if e.request_id == long_rid]
            if first_long is None and got:
                first_long = step
        assert first_long == -(-len(long_prompt) // per_step)
        assert got == expected
    finally:
        engine.decode_prefill_tokens = None
        engine.mixed_steps = True
        engine.abort(short)
        engine.abort(long_rid)
    assert engine.cache.free_pages() == engine.cache.total_pages


def test_one_ragged_prefill_call_equals_each_chunk_alone(engine):
    """Several prompts' chunks and decoding sequences' one-token chunks in one prefill call
    (how a mixed step batches them) give each row the logits it gets alone."""
    import numpy as np

    def fresh(prompt):
        sid = engine.cache.add()
        if prompt:
            engine.prefill([(sid, prompt)])
        return sid

    chunks = [([], PROMPTS[1]), ([], PROMPTS[2]), (PROMPTS[0], [44]), (PROMPTS[1], [45])]
    alone = []
    for before, chunk in chunks:
        sid = fresh(before)
        alone.append(engine.prefill([(sid, chunk)])[0])
        engine.cache.remove(sid)
    sids = [fresh(before) for before, _ in chunks]
    together = engine.prefill([(sid, chunk) for sid, (_, chunk) in zip(sids, chunks)])
    for sid in sids:
        engine.cache.remove(sid)
    np.testing.assert_allclose(together, np.stack(alone), rtol=1e-4, atol=1e-4)
    assert (together.argmax(axis=1) == np.stack(alone).argmax(axis=1)).all()
    # the one-token chunks equal what the decode function gives those sequences
    sids = [fresh(before) for before, _ in chunks[2:]]
    decoded = engine.decode_step(sids, [chunk[0] for _, chunk in chunks[2:]])
    for sid in sids:
        engine.cache.remove(sid)
    np.testing.assert_allclose(together[2:], decoded, rtol=1e-5, atol=1e-5)
    assert (together[2:].argmax(axis=1) == decoded.argmax(axis=1)).all()
    assert engine.cache.sequences == {}


def test_step_prefill_budget_follows_the_measured_times(engine):
    """The budget arithmetic on given timings: ratio x decode step / prefill token, scaled by
    waiting over decoding sequences, capped at the chunk; a fixed count wins; nothing decoding
    -> a whole chunk."""
    chunk = engine.cache.prefill_chunk_size
    saved = (dict(engine._decode_seconds), engine._prefill_token_seconds, engine.prefill_step_ratio)
    try:
        engine._decode_seconds.clear()
        engine._decode_seconds[2] = 0.02
        engine._prefill_token_seconds = 0.004
        engine.prefill_step_ratio = 1.0
        assert engine._step_prefill_room(0) == chunk
        assert engine._step_prefill_room(2) == 5  # 0.02 / 0.004
        engine.prefill_step_ratio = 0.5
        assert engine._step_prefill_room(2) == 2
        assert engine._step_prefill_room(4) == 3  # batch 4 estimated as 0.02 + 2 x 0.004
        engine._prefill_token_seconds = 1.0
        assert engine._step_prefill_room(2) == 1  # at least one token a step
        engine._prefill_token_seconds = 1e-9
        assert engine._step_prefill_room(2) == chunk
        engine._prefill_token_seconds = 0.004
        engine.prefill_step_ratio = 1.0
        ids = [engine.add(PROMPTS[0], max_new_tokens=2)[0] for _ in range(6)]
        try:
            assert engine._step_prefill_room(2) == min(chunk, 15)  # 6 waiting / 2 decoding
        finally:
            for rid in ids:
                engine.abort(rid)
        engine.decode_prefill_tokens = 7
        assert engine._step_prefill_room(2) == 7
    finally:
        engine.decode_prefill_tokens = None
        engine._decode_seconds.clear()
        engine._decode_seconds.update(saved[0])
        engine._prefill_token_seconds, engine.prefill_step_ratio = saved[1], saved[2]
    assert not engine.has_work()


def test_timed_prefill_slices_and_mixed_steps_keep_tokens(engine):
    """The default step budget (prompt tokens sized from measured step times) with the running
    sequences' tokens in the prefill call: several long prompts arriving while others decode
    get the same tokens as each run alone, nobody decoding ever misses a step, and while
    sequences decode, a step prefills fewer tokens than a whole chunk once times are known."""
    chunk = engine.cache.prefill_chunk_size
    prompts = [[(k * 11 + 7 * i) % 300 + 3 for i in range(2 * chunk + 3 * k)] for k in range(3)]
    alone = [engine.generate_ids([p], max_new_tokens=6, ignore_eos=True)[0] for p in prompts]
    shorts = [engine.generate_ids([p], max_new_tokens=40, ignore_eos=True)[0] for p in PROMPTS]
    assert engine.decode_prefill_tokens is None and engine.mixed_steps
    assert engine._decode_seconds and engine._prefill_token_seconds  # measured by those runs
    assert 1 <= engine._step_prefill_room(2) <= chunk
    short_ids = [engine.add(p, max_new_tokens=40, ignore_eos=True, buffer=False)[0] for p in PROMPTS]
    got = {r: [] for r in short_ids}
    for e in engine.step():  # the short prompts are prefilled and decoding
        got[e.request_id].append(e.token)
    long_ids = [engine.add(p, max_new_tokens=6, ignore_eos=True, buffer=False)[0] for p in prompts]
    got.update({r: [] for r in long_ids})
    while engine.has_work():
        running = {r.rid for r in engine._running}
        events = engine.step()
        stepped = {e.request_id for e in events}
        assert running <= stepped, "a running sequence missed a step"
        for e in events:
            got[e.request_id].append(e.token)
    assert [got[r] for r in short_ids] == shorts
    assert [got[r] for r in long_ids] == alone
    assert engine.cache.free_pages() == engine.cache.total_pages and engine.cache.sequences == {}


def test_threads_share_one_engine_and_match_the_serial_run(engine):
    """4 threads x 20 generations on one Engine: each equals the serial run (greedy and seeded
    sampling), and nothing is left in the cache."""
    jobs = [(t, k) for t in range(4) for k in range(20)]

    def job(t, k):
        prompt = [3 + t, 40 + k, 77, 5 + (t * k) % 50]
        kw = dict(max_new_tokens=4 + (k % 5), ignore_eos=True)
        if k % 3 == 0:
            kw.update(temperature=1.0, top_p=0.9, seed=t * 100 + k)
        return prompt, kw

    serial = {(t, k): engine.generate_ids([job(t, k)[0]], **job(t, k)[1])[0] for t, k in jobs}
    results, errors = {}, []

    def worker(t):
        try:
            for k in range(20):
                prompt, kw = job(t, k)
                results[(t, k)] = engine.generate_ids([prompt], **kw)[0]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert results == serial
    assert engine.cache.free_pages() == engine.cache.total_pages and engine.cache.sequences == {}


def test_aborting_the_prefilling_leader_keeps_its_forked_sample(engine):
    """n=2 on a prompt longer than a chunk: the first sample (whose sequence carries the
    prompt) is aborted mid-prefill; the second still forks from it and equals a normal run."""
    prompt = [(5 * i) % 200 + 3 for i in range(engine.cache.prefill_chunk_size + 9)]
    kw = dict(max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    expected = engine.generate_ids([prompt], n=2, **kw)[0][1]
    first, second = engine.add(prompt, n=2, buffer=False, **kw)
    engine.step()  # one chunk of the prompt is in the cache
    engine.abort(first)
    got = []
    while engine.has_work():
        got += [e.token for e in engine.step() if e.request_id == second]
    assert got == expected
    assert engine.cache.free_pages() == engine.cache.total_pages and engine.cache.sequences == {}
