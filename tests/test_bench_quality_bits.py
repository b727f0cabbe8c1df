"""scripts/bench_quality.py's stored bits per weight: which tensors are the LM head and which the
embedding lookup table, on the layouts our builds store (manifests written by hand, no build)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import bench_quality  # noqa: E402

V, H = 49152, 576  # SmolLM2-135M: 3072 (its gate_up rows) x 16 = V


def _p(name, shape, dtype):
    bits = {"float32": 32, "bfloat16": 16, "float16": 16, "int8": 8, "uint8": 8}[dtype]
    return {"name": name, "shape": list(shape), "dtype": dtype, "nbytes": int(np.prod(shape)) * bits // 8}


BODY_Q4 = [_p("gate_up", (3072, 18, 16), "uint8"), _p("gate_up.d", (3072, 18), "float32")]  # rows q4_0


def test_float_build_with_a_packed_head_counts_the_head_once():
    body = [_p("norm", (H,), "float32"), _p("wqkv", (64, H, 48), "float32")]
    params = [_p("lm_head.weight", (V, H), "float32")] + body + [_p("head", (V // 48, H, 48), "float32")]
    all_bytes, head = bench_quality.stored_bytes(params, V, H, {})
    assert head == 4 * V * H
    assert all_bytes == head + sum(p["nbytes"] for p in body)  # the lookup table is not counted


def test_bf16_head_packed_in_k_pairs_counts_the_head_once():
    """The layout of a bfloat16 CPU build with vdpbf16ps (llama-110m's head: (1000, 384, 32, 2));
    the lookup table was counted a second time as the head before."""
    body = [_p("norm", (H,), "bfloat16"), _p("wqkv", (64, H // 2, 48, 2), "bfloat16")]
    params = [_p("embed", (V, H), "bfloat16")] + body + [_p("head", (V // 32, H // 2, 32, 2), "bfloat16")]
    all_bytes, head = bench_quality.stored_bytes(params, V, H, {})
    assert head == 2 * V * H
    assert all_bytes == head + sum(p["nbytes"] for p in body)


def test_tied_float_head_reading_the_table_is_kept():
    params = [_p("lm_head.weight", (V, H), "bfloat16"), _p("w", (12, 1536, 48), "bfloat16")]
    all_bytes, head = bench_quality.stored_bytes(params, V, H, {})
    assert head == 2 * V * H and all_bytes == sum(p["nbytes"] for p in params)


def test_quantized_head_and_quantized_table_beside_a_body_of_v_rows_worth():
    table = [_p("emb", (V, H), "int8"), _p("emb.d", (V, 18), "float32")]
    head = [_p("head", (V // 16, 18, 8, 64), "uint8"), _p("head.d", (V // 16, 18, 16), "float16")]
    params = table + BODY_Q4 + head
    q = {"lm_head.weight": {"format": "q8_0", "activations": "int8"}}
    all_bytes, head_bytes = bench_quality.stored_bytes(params, V, H, q)
    assert head_bytes == V * H + 2 * V * 18  # 8.5 bits
    assert all_bytes - head_bytes == sum(p["nbytes"] for p in BODY_Q4)


def test_a_missing_head_tensor_is_an_error():
    q = {"lm_head.weight": {"format": "q8_0", "activations": "int8"}}
    with pytest.raises(ValueError, match="not stored"):
        bench_quality.stored_bytes(BODY_Q4, V, H, q)


def test_q4_k_head_in_the_int8_layout_is_its_packed_tensors_at_stored_bits():
    """q4_k in the int8-activation layout: nibbles, 6-bit codes packed at 12 bits per group
    (per pair of groups: a byte of scale nibbles and two bytes of minimums and scale tops) and
    float16 super-scales per 6 groups (K = 576)."""
    from tvm_llm.quantization.scheme import stored_bits

    head = [_p("head", (V // 16, 18, 4, 64), "uint8"), _p("head.sl", (V // 16, 9, 16), "uint8"),
            _p("head.mh", (V // 16, 9, 32), "uint8"), _p("head.d", (V // 16, 3, 16), "float16"),
            _p("head.dmin", (V // 16, 3, 16), "float16")]
    q = {"lm_head.weight": {"format": "q4_k", "activations": "int8"}}
    all_bytes, head_bytes = bench_quality.stored_bytes(BODY_Q4 + head, V, H, q)
    assert head_bytes * 8 / (V * H) == pytest.approx(stored_bits("q4_k", V, H, "vnni"))
    assert head_bytes * 8 / (V * H) == pytest.approx(4 + 12 / 32 + 32 / (32 * 6))
