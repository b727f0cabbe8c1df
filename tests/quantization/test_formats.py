"""Weight formats' numpy reference (quantization/formats.py) and QuantPlan (plan.py): round
trips within each format's bounds, importance-weighted rounding, determinism."""
from __future__ import annotations

import numpy as np
import pytest

from tvm_llm.quantization.formats import (ACTIVATION_BLOCK, FORMATS, fake_quantize,
                                          fake_quantize_activation, kquant_group_params,
                                          quantize_activation, super_groups)
from tvm_llm.quantization.plan import QuantPlan


def _weights(N=24, K=576, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((N, K)) * 0.05).astype("float32")
    w[3, 40:72] *= 30  # an outlier group
    w[5, :32] = 0.0  # an all-zero group
    w[6, 64:96] = 0.02  # a constant group
    return w


REL_ERR = {"q8_0": 0.008, "q4_0": 0.09, "q4_1": 0.08, "q3_k": 0.16, "q4_k": 0.08, "q5_k": 0.04, "q6_k": 0.025}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_round_trip_bounds_and_layout(name):
    f = FORMATS[name]
    w = _weights()
    st = f.quantize(w)
    N, K = w.shape
    lo, hi = f.qrange
    assert st["q"].shape == (N, K) and st["q"].min() >= lo and st["q"].max() <= hi
    deq = f.dequantize(st)
    assert deq.dtype == np.float32 and deq.shape == w.shape
    err = np.abs(deq - w)
    # each weight is within about one quantization step of its group (half a step where it is
    # not clipped; the search trades a little max error for less squared error; q4_k's 6-bit
    # group scales next to an outlier group clip more)
    if f.kind == "kquant":
        step, _ = kquant_group_params(st)
        assert st["sc"].max() <= 63 and st["mn"].max() <= 63
        assert st["d"].shape == (N, K // 32 // super_groups(K))
    else:
        step = st["d"].astype(np.float32)
    step = np.abs(np.repeat(step, 32, axis=1))
    # (5 and 6-bit codes: the 6-bit minimum of a group beside the outlier group is off by up
    # to half its super-block's coarse minimum step, ~3 of these finer code steps)
    tol = (3.0 if f.bits <= 4 else 4.0) if f.kind == "kquant" else 1.5
    assert np.all(np.delete(err <= step * tol + 1e-7, 6, axis=0))
    assert np.all(deq[5, :32] == 0)  # zero group stays exactly zero
    np.testing.assert_allclose(deq[6, 64:96], 0.02, rtol=0.02)
    rel = np.linalg.norm(err) / np.linalg.norm(w)
    assert rel < REL_ERR[name], rel
    assert np.array_equal(fake_quantize(w, name), deq)


def test_bits_per_weight():
    assert FORMATS["q8_0"].bits_per_weight() == 8.5
    assert FORMATS["q4_0"].bits_per_weight() == 4.5
    assert FORMATS["q4_1"].bits_per_weight() == 5.0
    assert FORMATS["q4_k"].bits_per_weight() == 4.5
    assert [FORMATS[f].bits_per_weight() for f in ("q3_k", "q5_k", "q6_k")] == [3.5, 5.5, 6.5]
    assert super_groups(576) == 6 and FORMATS["q4_k"].bits_per_weight(576) > 4.5
    assert not FORMATS["q4_0"].applies_to(8, 48) and FORMATS["q4_0"].applies_to(8, 64)


def test_asymmetric_formats_beat_symmetric_on_shifted_weights():
    rng = np.random.default_rng(3)
    w = (rng.random((32, 256)) * 0.1 + 0.02).astype(np.float32)  # all positive
    errs = {n: np.linalg.norm(fake_quantize(w, n) - w) for n in ("q4_0", "q4_1", "q4_k")}
    assert errs["q4_1"] < 0.8 * errs["q4_0"] and errs["q4_k"] < 0.8 * errs["q4_0"], errs


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_importance_changes_the_choice_and_lowers_weighted_error(name):
    w = _weights(seed=1)
    K = w.shape[1]
    imp = np.ones(K, np.float32)
    imp[::7] = 50.0  # a few salient input channels
    plain, weighted = fake_quantize(w, name), fake_quantize(w, name, imp)
    assert not np.array_equal(plain, weighted)

    def werr(d):
        return float((((d - w) ** 2) * imp).sum())

    assert werr(weighted) < werr(plain)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_deterministic(name):
    w = _weights(seed=2)
    imp = np.random.default_rng(0).random(w.shape[1]).astype(np.float32)
    a, b = FORMATS[name].quantize(w, imp), FORMATS[name].quantize(w.copy(), imp.copy())
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_bad_inputs_are_value_errors():
    with pytest.raises(ValueError):
        FORMATS["q4_0"].quantize(np.zeros((4, 40), np.float32))
    with pytest.raises(ValueError):
        FORMATS["q4_0"].quantize(np.zeros((4, 64), np.float32), -np.ones(64))
    with pytest.raises(ValueError):
        QuantPlan("q5_9")


def test_activation_round_trip_per_block():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 128)).astype(np.float32)
    x[0, 0, 5] = 2e4  # one outlier: only its own block loses precision
    q, s = quantize_activation(x)
    assert q.dtype == np.int8 and s.shape == (3, 2, 128 // ACTIVATION_BLOCK)
    y = fake_quantize_activation(x)
    err = np.abs(y - x)
    assert np.all(err <= np.repeat(s, ACTIVATION_BLOCK, -1) * 0.5 + 1e-6)
    assert err[0, 0, 32:].max() < 0.02  # other blocks of the outlier's row stay fine
    assert np.all(fake_quantize_activation(np.zeros((1, 32), np.float32)) == 0)


def test_16_bit_activations_split_into_int8_halves():
    """The kernel's 16-bit activations: q in [-32512, 32512] per block, 256x finer than int8,
    and q = 256 hi + lo with hi = (q + 128) >> 8 in [-127, 127], lo in [-128, 127] (int8 each,
    the signed operand of vpdpbusd)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x[0, 7] = 2e4
    x[1, 32:64] = np.linspace(-1, 1, 32)  # the block's max at both signs: q = +-32512
    q, s = quantize_activation(x, 16)
    assert q.dtype == np.int32 and np.abs(q).max() == 127 * 256
    err16 = np.abs(fake_quantize_activation(x, 16) - x)
    # half a step, and float32's rounding of x * (Q / max|x|) (~2e-3 of a step at |q| ~ 32512)
    assert np.all(err16 <= np.repeat(s, ACTIVATION_BLOCK, -1) * 0.504)
    err8 = np.abs(fake_quantize_activation(x) - x)
    assert err16[1:].max() * 200 < err8[1:].max()  # rows without the outlier: ~256x finer
    hi = (q + 128) >> 8
    lo = q - 256 * hi
    assert hi.min() >= -127 and hi.max() <= 127 and lo.min() >= -128 and lo.max() <= 127
    assert np.array_equal(hi * 256 + lo, q)


def test_plan_format_for_merged_and_bits():
    plan = QuantPlan("q4_k", "int8", {"model.layers.0.self_attn.k_proj.weight": "q8_0",
                                      "lm_head.weight": "float"})
    qkv = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert plan.format_for(qkv) == "q8_0"
    assert plan.format_for(["model.layers.1.mlp.up_proj.weight"]) == "q4_k"
    assert plan.format_for(["lm_head.weight", "x"]) == "float"
    shapes = {"a": (256, 512), "lm_head.weight": (256, 512)}
    assert plan.bits_per_weight(shapes) == pytest.approx((4.5 + 32) / 2)
    assert QuantPlan("q8_0").bits_per_weight({"a": (8, 64)}) == 8.5
