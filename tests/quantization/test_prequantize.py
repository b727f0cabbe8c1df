"""Weights quantized early, beside trace and passes (tvm_llm/quantization/prequantize.py): a
result is handed over only for the very computation the weight transform would run, and it
equals the transform's own quantizer byte for byte."""
from __future__ import annotations

import numpy as np

from tvm_llm.quantization import prequantize
from tvm_llm.quantization.formats import get_format
from tvm_llm.quantization.plan import QuantPlan
from tvm_llm.quantization.scheme import parse_scheme


def _model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint("llama")).eval()


def test_taken_results_equal_the_quantizer_and_mismatches_are_refused(checkpoint):
    model = _model(checkpoint)
    layer = model.model.layers[0]
    qkv = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
    names = [f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
    imp = np.linspace(0.5, 2.0, qkv[0].in_features).astype(np.float32)
    plan = QuantPlan("q4_k", formats={"model.layers.0.mlp.down_proj.weight": "q8_0"},
                     importance={names[0]: imp})
    scheme = parse_scheme("q4_k", activations="float", plan=plan)
    try:
        assert prequantize.start(model, scheme) > 0
        prequantize.finish()  # (a build takes what is done; here: every check below applies)
        key = ",".join(sorted(names))
        w = np.concatenate([m.weight.detach().numpy() for m in qkv])
        got = prequantize.take(key, "q4_k", imp, w)
        want = get_format("q4_k").quantize(w, imp)
        assert got is not None and set(got) == set(want)
        assert all(np.array_equal(got[k], want[k]) for k in want)
        assert prequantize.take(key, "q4_k", imp, w) is None  # handed over once

        down = layer.mlp.down_proj.weight.detach().numpy()
        key = "model.layers.0.mlp.down_proj.weight"
        other = down.copy()
        other[0, 0] += 1.0  # not the matrix quantized early: the transform quantizes it itself
        assert prequantize.take(key, "q8_0", None, other) is None
        o_key = "model.layers.0.self_attn.o_proj.weight"
        o = layer.self_attn.o_proj.weight.detach().numpy()
        assert prequantize.take(o_key, "q8_0", None, o) is None  # another format
        assert prequantize.counts()["taken"] == 1
    finally:
        prequantize.stop()
    assert prequantize.counts() == {"queued": 0, "taken": 0}


def test_q4k_searches_are_compiled_on_the_calling_thread(checkpoint, monkeypatch):
    """start() compiles the q4_k searches its units need (plain and importance-weighted here)
    before the background thread runs: TVM's compiler never runs beside the build's passes."""
    import threading

    from tvm_llm.quantization import kquant_search

    calls = []
    real = kquant_search.compiled

    def recording(nmax, numerators, weighted):
        calls.append((threading.current_thread() is threading.main_thread(), weighted))
        return real(nmax, numerators, weighted)

    monkeypatch.setattr(kquant_search, "compiled", recording)
    model = _model(checkpoint)
    q = "model.layers.0.self_attn.q_proj.weight"
    plan = QuantPlan("q4_k", importance={q: np.linspace(0.5, 2.0, model.config.hidden_size)
                                         .astype(np.float32)})
    try:
        assert prequantize.start(model, parse_scheme("q4_k", activations="float", plan=plan)) > 0
        prequantize.finish()
    finally:
        prequantize.stop()
    first_background = next((i for i, (main, _) in enumerate(calls) if not main), len(calls))
    assert {w for main, w in calls[:first_background] if main} == {False, True}
