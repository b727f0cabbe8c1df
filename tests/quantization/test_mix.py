"""The automatic mix (tvm_llm/quantization/mix.py): it stays within the bits-per-weight
budget, spends it where the estimated loss per added bit is largest, and its Fisher estimate
ranks units the way measured loss does on the tiny Llama."""
from __future__ import annotations

import numpy as np
import pytest

from tvm_llm.errors import UserError
from tvm_llm.quantization import mix
from tvm_llm.quantization.plan import format_bits


def _units():
    # (errors at q4_0, q8_0) per unit; sizes differ so error per added bit decides
    spec = [("a", (64, 256), 10.0), ("b", (64, 256), 1.0), ("c", (128, 256), 12.0),
            ("d", (64, 512), 0.5), ("lm_head", (512, 256), 30.0)]
    return [mix.Unit((f"{n}.weight",), shape, {"q4_0": e, "q8_0": e / 100}) for n, shape, e in spec]


def test_mix_respects_the_budget_and_buys_the_largest_error_per_bit():
    units = _units()
    for budget in (4.5, 5.0, 5.6, 6.5, 8.5):
        choice = mix.choose(units, ["q4_0", "q8_0"], budget)
        assert mix.average_bits(units, choice) <= budget + 1e-9
    choice = mix.choose(units, ["q4_0", "q8_0"], 5.0)
    # per added bit: a 10/16k, c 12/32k, lm_head 30/131k, b 1/16k, d 0.5/32k
    assert choice["a"] == "q8_0" and choice["b"] == "q4_0" and choice["d"] == "q4_0"
    assert mix.choose(units, ["q4_0", "q8_0"], 4.5) == {u.label: "q4_0" for u in units}
    assert set(mix.choose(units, ["q4_0", "q8_0"], 8.5).values()) == {"q8_0"}
    with pytest.raises(UserError, match="below the cheapest"):
        mix.choose(units, ["q4_0", "q8_0"], 4.0)


def test_body_count_leaves_the_head_out_of_the_budget():
    units = _units()
    choice = mix.choose(units, ["q4_0", "q8_0"], 4.5, count="body")
    assert choice["lm_head"] == "q8_0"  # not counted: it gets the best format
    body = [u for u in units if u.label != "lm_head"]
    assert mix.average_bits(units, choice, "body") == pytest.approx(
        sum(u.size * format_bits(choice[u.label]) for u in body) / sum(u.size for u in body))


def test_in_between_formats_let_a_large_unit_rise_where_8_bits_do_not_fit():
    """With the 5 and 6-bit k-quants among the candidates, a unit too large to afford q8_0
    within the budget (the LM head: 2 bits on its 131k weights) still rises to q5_k / q6_k;
    candidates whose error does not fall with their bits are skipped (not on the hull)."""
    units = [mix.Unit((f"{n}.weight",), shape, {"q4_k": e, "q5_k": e / 4, "q6_k": e / 16, "q8_0": e / 256})
             for n, shape, e in [("a", (64, 256), 1.0), ("b", (64, 256), 1.0), ("lm_head", (512, 256), 30.0)]]
    steps = ["q4_k", "q5_k", "q6_k", "q8_0"]
    assert mix.choose(units, ["q4_k", "q8_0"], 5.6)["lm_head"] == "q4_k"
    choice = mix.choose(units, steps, 5.6)
    assert choice["lm_head"] == "q5_k" and mix.average_bits(units, choice) <= 5.6 + 1e-9
    assert mix.choose(units, steps, 6.4)["lm_head"] == "q6_k"
    units[0].errors["q5_k"] = 2.0  # worse than its q4_k: never chosen
    assert "q5_k" not in [mix.choose(units, steps, b)["a"] for b in (4.6, 5.0, 5.6, 6.0, 7.0)]


@pytest.fixture(scope="module")
def calibrated():
    """The bundled trained model, its tied head untied (the build quantizes a copy), and a
    calibration with gradients over 4 windows of 128 tokens."""
    from transformers import AutoModelForCausalLM

    from tvm_llm.cli import DEFAULT_MODEL_DIR
    from tvm_llm.quantization import calibration as C
    from tvm_llm.quantization.simulation import untie_head

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, attn_implementation="eager").eval()
    untie_head(model)
    calib = C.collect(model, C.token_windows(DEFAULT_MODEL_DIR, C.read_calibration(None), 128, 4),
                      gradients=True)
    return model, calib


def test_fisher_estimate_ranks_units_like_measured_loss(calibrated):
    """On the bundled trained model: quantizing one unit alone to q4_0 in transformers, the
    calibration-time Fisher estimate and the measured loss increase on held-out text agree on
    the most sensitive unit (the tied LM head here, by far), and rank the rest alike (positive
    rank correlation; most single units move the held-out loss by about its noise)."""
    import torch

    from tvm_llm.cli import DEFAULT_MODEL_DIR
    from tvm_llm.perplexity import read_text
    from tvm_llm.quantization import calibration as C
    from tvm_llm.quantization.plan import QuantPlan
    from tvm_llm.quantization.calibration import fisher_units
    from tvm_llm.quantization.simulation import SimulatedPlan

    model, calib = calibrated
    units = fisher_units(model, calib, ["q4_0", "q8_0"])
    assert len(units) == 17  # 4 x (qkv, o, gate|up, down) + lm_head
    assert all(u.errors["q8_0"] < u.errors["q4_0"] for u in units)
    held = C.token_windows(DEFAULT_MODEL_DIR, read_text(None), 128, 4)

    def loss():
        with torch.no_grad():
            return sum(float(torch.nn.functional.cross_entropy(
                model(torch.tensor([w[:-1]])).logits[0], torch.tensor(w[1:]), reduction="sum"))
                for w in held)

    base = loss()
    measured = {}
    for u in units:
        with SimulatedPlan(model, QuantPlan("q4_0"), only=set(u.names)):
            measured[u.label] = loss() - base
    top = max(units, key=lambda u: u.errors["q4_0"]).label
    assert top == max(measured, key=measured.get), (top, measured)
    est = np.array([u.errors["q4_0"] for u in units])
    meas = np.array([measured[u.label] for u in units])
    rank = np.corrcoef(np.argsort(np.argsort(est)), np.argsort(np.argsort(meas)))[0, 1]
    assert rank > 0.2, (rank, measured)


def test_fisher_estimate_on_drawn_rows_matches_all_rows(calibrated, monkeypatch):
    """The mix's Fisher estimate rounds FISHER_ROWS rows per unit drawn in proportion to their
    squared gradient (calibration._fisher_rows): on the bundled model every unit with more
    rows than that (q|k|v, gate|up, the LM head, whose gradient sits on the few vocabulary
    rows of the calibration text) gets within 5% of the estimate over all rows, the others
    exactly it."""
    from tvm_llm.quantization import calibration as C

    model, calib = calibrated
    drawn = C.fisher_units(model, calib, ["q4_k", "q8_0"])
    assert C.FISHER_ROWS == 256
    monkeypatch.setattr(C, "FISHER_ROWS", None)
    every = C.fisher_units(model, calib, ["q4_k", "q8_0"])
    assert [u.label for u in drawn] == [u.label for u in every]
    assert {u.label for u in every if u.shape[0] > 256} >= {"lm_head"}
    for a, b in zip(drawn, every):
        assert a.shape == b.shape
        for fmt in ("q4_k", "q8_0"):
            if b.shape[0] <= 256:
                assert a.errors[fmt] == pytest.approx(b.errors[fmt], rel=1e-9), a.label
            else:
                assert a.errors[fmt] == pytest.approx(b.errors[fmt], rel=0.05), a.label
