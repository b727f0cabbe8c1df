"""The planner's arithmetic against sizes computed by hand, for two configurations:
the tiny test llama (2 layers, hidden 64, 4 heads / 2 KV heads, vocab 320) and a
llama-110m-shaped one (12 layers, hidden 768, 12 heads / 4 KV heads, MLP 2048, vocab 32000)."""
from __future__ import annotations

import pytest

from tvm_llm.errors import UserError
from tvm_llm.memory.kv_budget import (KVPool, kv_bytes_per_token, kv_workspace_bytes,
                                      logits_pool_bytes, parse_budget, tvm_total_pages)
from tvm_llm.memory.planner import ActivationPlan, FunctionPlan, plan_memory

MiB, GiB = 2**20, 2**30
RESERVE_CPU = 256 * MiB


def llama_weight_bytes(hidden, layers, heads, kv_heads, mlp, vocab, dtype_bytes=4):
    head_dim = hidden // heads
    per_layer = (hidden * hidden  # q
                 + 2 * hidden * kv_heads * head_dim  # k, v
                 + hidden * hidden  # o
                 + 3 * hidden * mlp  # gate, up, down
                 + 2 * hidden)  # two RMSNorms
    return (2 * vocab * hidden + layers * per_layer + hidden) * dtype_bytes


def test_weight_bytes_by_hand():
    # tiny: 2*320*64 + 2*(64*64*2 + 2*64*32 + 3*64*128 + 128) + 64 = 115008 params
    assert llama_weight_bytes(64, 2, 4, 2, 128, 320) == 115008 * 4 == 460032
    # 110m: 49,152,000 embeddings + 12 * 6,292,992 per layer + 768 = 124,668,672 params
    assert llama_weight_bytes(768, 12, 12, 4, 2048, 32000) == 124_668_672 * 4


def test_kv_bytes_per_token():
    # 2 (K and V) * layers * kv_heads * head_dim * 4 bytes
    assert kv_bytes_per_token(2, 2, 16, "float32") == 2 * 2 * 2 * 16 * 4 == 512
    assert kv_bytes_per_token(12, 4, 64, "float32") == 2 * 12 * 4 * 64 * 4 == 24576
    assert kv_bytes_per_token(12, 4, 64, "float16") == 12288


def test_tvm_page_count_and_capacity_round_trip():
    # TVM allocates ceil(max_total_seq_len / page) + 1 pages
    assert tvm_total_pages(64, 16) == 5 and tvm_total_pages(65, 16) == 6
    pool = KVPool(512, 16, 37)
    assert pool.max_total_seq_len == 36 * 16
    assert tvm_total_pages(pool.max_total_seq_len, 16) == 37  # exactly the planned pages
    assert pool.tokens == 37 * 16 and pool.bytes == 37 * 16 * 512


def test_logits_pool_is_one_rounded_buffer_per_row_count():
    row = 32000 * 4
    by_hand = sum(-(-r * row // 4096) * 4096 for r in range(1, 9))
    assert logits_pool_bytes(32000, "float32", 8) == by_hand
    # 1280-byte rows: 1, 2 and 3 rows share one 4 KiB buffer, 4 rows take 8 KiB
    assert logits_pool_bytes(320, "float32", 4) == 4096 + 8192


@pytest.mark.parametrize("spec,expected", [
    ("4GB", 4 * 10**9), ("4GiB", 4 * GiB), ("4G", 4 * GiB), ("512MB", 512 * 10**6),
    ("1.5GiB", int(1.5 * GiB)), ("300 MiB", 300 * MiB), ("0.5", 8 * GiB), ("25%", 4 * GiB)])
def test_parse_budget(spec, expected):
    assert parse_budget(spec, 16 * GiB).bytes == expected


@pytest.mark.parametrize("spec", ["lots", "4XB", "0", "1.5", "-1GB", "150%", ""])
def test_unparsable_budgets_are_user_errors(spec):
    with pytest.raises(UserError, match="--max-memory"):
        parse_budget(spec, 16 * GiB)


def _acts(prefill, decode):
    return ActivationPlan({"prefill": FunctionPlan("prefill", prefill, 1, {"seq": 512}),
                           "decode": FunctionPlan("decode", decode, 1, {"batch": 8})})


def test_activations_resident_counts_both_functions_per_size():
    # pooled allocator: sizes round to 4 KiB; one storage of a size serves both functions
    acts = _acts([10 * MiB, 4096, 100], [10 * MiB, 5000])
    assert acts.functions["prefill"].bytes == 10 * MiB + 4196
    # 10 MiB: one, shared; prefill holds two 4 KiB storages (4096, 100); decode's 5000 -> 8 KiB
    assert acts.resident_bytes == 10 * MiB + 2 * 4096 + 8192
    permanent = ActivationPlan({**acts.functions, "graph_alloc": FunctionPlan("graph_alloc", [MiB], 0, {})})
    assert permanent.resident_bytes == acts.resident_bytes + MiB


def _plan_110m(**kw):
    weights = [{"dtype": "float32", "nbytes": llama_weight_bytes(768, 12, 12, 4, 2048, 32000)}]
    return plan_memory(weights=weights, activations=_acts([12 * MiB], [MiB]), vocab_size=32000,
                       num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64, dtype="float32",
                       max_position_embeddings=2048, **kw)


def test_110m_pages_tokens_and_sequences_for_a_budget():
    plan = _plan_110m(budget=parse_budget("1GiB"), max_batch_size=8, prefill_chunk_size=512)
    weights = 124_668_672 * 4
    logits = sum(-(-r * 128000 // 4096) * 4096 for r in range(1, 9))  # 8 distinct sizes
    staging = 512 * (2 * 12 + 2 * 4) * 64 * 4 + 2 * 512 * 12 * 4  # q, out, k, v + two lse
    ws = plan.kv_workspace_bytes
    assert staging < ws < staging + MiB  # plus int32 page tables
    left = GiB - weights - 13 * MiB - logits - ws - RESERVE_CPU
    page = 24576 * 16  # 384 KiB
    assert plan.kv.page_bytes == page
    assert plan.kv.pages == left // page
    assert plan.kv.tokens == plan.kv.pages * 16
    assert plan.sequences_at(2048) == plan.kv.pages // 128  # 2048 tokens = 128 pages each
    assert plan.to_dict()["concurrent_sequences"] == min(plan.kv.pages // 128, 8)
    assert plan.total_bytes <= GiB
    assert plan.context_window == 2048 and plan.context_source == "default"


def test_110m_context_is_bounded_by_the_budget_not_max_positions():
    weights = 124_668_672 * 4
    # room for ~1000 tokens of KV: the context window becomes what the pool holds
    budget = weights + 13 * MiB + RESERVE_CPU + 6 * MiB + 1000 * 24576
    plan = _plan_110m(budget=parse_budget(f"{budget}B"))
    assert plan.context_source == "budget"
    assert plan.context_window == plan.kv.tokens < 2048
    assert any("2048-token context" in n for n in plan.notes)
    with pytest.raises(UserError, match="--context-window 2048 does not fit"):
        _plan_110m(budget=parse_budget(f"{budget}B"), context_window=2048)


def test_tiny_llama_pages_for_a_budget():
    weights = 460032
    plan = plan_memory(weights=[{"dtype": "float32", "nbytes": weights}],
                       activations=_acts([150 * 1024], [9 * 1024]), vocab_size=320, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32",
                       budget=parse_budget("260MiB"), max_batch_size=4, prefill_chunk_size=64,
                       max_position_embeddings=512)
    acts = (152 * 1024) + 12 * 1024  # 150 KiB rounds up to 152 KiB, 9 KiB to 12 KiB
    logits = 4096 + 8192  # rows of 1280 bytes: 1..3 rows in 4 KiB, 4 rows in 8 KiB
    left = 260 * MiB - weights - acts - logits - plan.kv_workspace_bytes - RESERVE_CPU
    assert plan.kv.pages == left // (512 * 16)
    assert plan.sequences_at(512) == plan.kv.pages // 32
    assert plan.context_window == 512


def test_sliding_window_sequences_hold_window_pages_only():
    """Every layer slides with a 256-token window (Mistral-style): a sequence holds at most
    ceil(256 / 16) + 1 = 17 pages at any length, so far more long sequences fit; when only some
    layers slide (Gemma), pages follow the length and the plan says why."""
    full = _plan_110m(budget=parse_budget("1GiB"))
    slid = _plan_110m(budget=parse_budget("1GiB"), sliding_window=256)
    assert slid.kv.pages == full.kv.pages
    assert slid.pages_per_sequence(2048) == 17 and full.pages_per_sequence(2048) == 128
    assert slid.sequences_at(2048) == slid.kv.pages // 17
    assert slid.sequences_at(100) == slid.kv.pages // 7  # shorter than the window: its length
    assert slid.to_dict()["sliding_window"] == 256
    assert any("at most 17 pages" in n for n in slid.notes)
    mixed = _plan_110m(budget=parse_budget("1GiB"), sliding_layers=6)
    assert mixed.sequences_at(2048) == full.sequences_at(2048)
    assert any("6 of 12 layers slide" in n for n in mixed.notes)


def test_budget_below_weights_is_one_line_user_error():
    with pytest.raises(UserError, match=r"--max-memory 100MB \(95.4 MiB\) is below the 475.6 MiB of weights"):
        _plan_110m(budget=parse_budget("100MB"))


def test_budget_without_room_for_kv_is_user_error():
    with pytest.raises(UserError, match="leaves .* for the KV cache .* give at least"):
        _plan_110m(budget=parse_budget("760MiB"))


def test_budget_and_kv_cache_tokens_conflict():
    with pytest.raises(UserError, match="not both"):
        _plan_110m(budget=parse_budget("2GiB"), kv_cache_tokens=4096)


def test_without_budget_the_pool_is_the_requested_capacity():
    plan = _plan_110m(kv_cache_tokens=4096)
    assert plan.kv.pages == 4096 // 16 + 1
    assert plan.budget is None and plan.context_window == 2048


def test_kv_workspace_cpu_counts_staging_not_the_cuda_aux_buffer():
    cpu = kv_workspace_bytes("cpu", 12, 4, 64, "float32", 512, 8, 1000)
    cuda = kv_workspace_bytes("cuda", 12, 4, 64, "float32", 512, 8, 1000)
    assert cuda - cpu > 100 * MiB  # the 128 MiB aux staging buffer is committed on CUDA only
