"""Quantized builds of the tiny Llama: what they store, and that they compute exactly what
the scheme says (transformers with the same fake-quantized weights), close to float32."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tiny_models import VOCAB
from tvm_llm.quantization.scheme import parse_scheme
from tvm_llm.quantization.sensitivity import _Quantized, _units

PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, VOCAB, size=13)]


@pytest.fixture(scope="module")
def qbuild(tmp_path_factory, checkpoint):
    made = {}

    def get(quantization, activations=None, keep_float=None):
        key = (quantization, activations, keep_float)
        if key not in made:
            import tvm_llm

            out = str(tmp_path_factory.mktemp("q") / "out")
            tvm_llm.build(checkpoint("llama"), out, max_batch_size=4, prefill_chunk_size=64,
                          quantization=quantization, activations=activations,
                          keep_float=keep_float, log=lambda *a: None)
            made[key] = out
        return made[key]

    return get


def _logits(out):
    from tvm_llm import Engine

    eng = Engine(out)
    sid = eng.cache.add()
    n = len(PROMPT)
    pre = eng.prefill_positions([sid], [n], np.array([PROMPT]), np.arange(n)[None], np.arange(n))[0]
    step = eng.decode_step([sid], [int(pre[-1].argmax())])[0]
    eng.cache.remove(sid)
    return pre, step, int(pre[-1].argmax())


def _reference(model, scheme):
    """transformers logits for PROMPT + the next greedy token, linears fake-quantized."""
    lins = [lin for lins in _units(model).values() for lin in lins] if scheme else []
    with _Quantized(lins, scheme) if scheme else _NoOp():
        with torch.no_grad():
            first = model(torch.tensor([PROMPT])).logits[0].numpy()
            nxt = int(first[-1].argmax())
            full = model(torch.tensor([PROMPT + [nxt]])).logits[0].numpy()
    return full


class _NoOp:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _cosine(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / np.sqrt((a @ a) * (b @ b)))


def _untied_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint("llama"), attn_implementation="eager").eval()


@pytest.mark.parametrize("quantization", ["q8", "q4"])
def test_weight_only_build_equals_fake_quantized_transformers(quantization, qbuild, checkpoint):
    out = qbuild(quantization)
    pre, step, _ = _logits(out)
    ref = _reference(_untied_model(checkpoint), parse_scheme(quantization))
    n = len(PROMPT)
    assert np.abs(pre - ref[:n]).max() < 1e-4
    assert np.abs(step - ref[n]).max() < 1e-4


def test_q8_logits_cosine_against_float32(qbuild, checkpoint):
    pre, step, _ = _logits(qbuild("q8"))
    ref = _reference(_untied_model(checkpoint), None)
    n = len(PROMPT)
    assert _cosine(pre, ref[:n]) >= 0.999
    assert _cosine(step, ref[n]) >= 0.999


@pytest.mark.parametrize("quantization", ["q8", "q4"], ids=["w8a8", "w4a8"])
def test_int8_activation_build_matches_its_simulation(quantization, qbuild, checkpoint):
    pre, step, _ = _logits(qbuild(quantization, activations="int8"))
    model = _untied_model(checkpoint)
    sim = _reference(model, parse_scheme(quantization, activations="int8"))
    ref = _reference(model, None)
    n = len(PROMPT)
    # int8 rounding of activations can flip at exact ties between two float orders; the
    # simulation is otherwise the same arithmetic
    assert _cosine(pre, sim[:n]) > 0.99999 and _cosine(step, sim[n]) > 0.99999
    if quantization == "q8":  # (q4 on random tiny weights is far from float32 either way)
        assert _cosine(pre, ref[:n]) >= 0.999


def test_stored_weights_and_report(qbuild, built):
    manifests = {k: json.load(open(os.path.join(o, "manifest.json")))
                 for k, o in [("fp32", built("llama")), ("q8", qbuild("q8")), ("q4", qbuild("q4"))]}
    q4 = manifests["q4"]
    q = q4["quantization"]
    assert q["scheme"] == "q4" and q["group_size"] == 32
    # 2 layers x (qkv, o, gate_up, down) + lm_head
    assert len(q["quantized"]) == 9 and not q.get("kept_float")
    dtypes = {p["dtype"] for p in q4["params"]}
    assert "uint8" in dtypes
    # no float32 linear weight ships: besides the embedding table (looked up, not multiplied)
    # the float32 2-D params are the scales, one per 32 weights of K (64 or 128 here)
    float_2d = [p for p in q4["params"] if p["dtype"] == "float32" and len(p["shape"]) == 2
                and p["name"] != "model.embed_tokens.weight"]
    assert len(float_2d) == 9 and all(p["shape"][1] in (2, 4) for p in float_2d), float_2d
    size = {k: os.path.getsize(os.path.join(os.path.dirname(os.path.join(o, "x")), "weights.bin"))
            for k, o in [("fp32", built("llama")), ("q8", qbuild("q8")), ("q4", qbuild("q4"))]}
    assert size["q4"] < size["q8"] < size["fp32"]
    assert manifests["fp32"].get("quantization") is None


def test_keep_float_leaves_chosen_layers_float(qbuild, checkpoint):
    out = qbuild("q4", keep_float="0,lm_head")
    m = json.load(open(os.path.join(out, "manifest.json")))
    kept = m["quantization"]["kept_float"]
    assert any("layers.0." in k for k in kept) and any("lm_head" in k for k in kept)
    assert all("layers.1." in k for k in m["quantization"]["quantized"])
    pre, step, _ = _logits(out)
    scheme = parse_scheme("q4", keep_float="0,lm_head")
    ref = _reference(_untied_model(checkpoint), scheme)
    assert np.abs(pre - ref[:len(PROMPT)]).max() < 1e-4


def test_generation_runs_and_perplexity_equals_the_simulation(qbuild, checkpoint, tmp_path):
    from tvm_llm import Engine
    from tvm_llm.perplexity import engine_perplexity
    from tvm_llm.quantization.sensitivity import sensitivity

    out = qbuild("q4")
    eng = Engine(out)
    ids = eng.generate_ids([PROMPT], max_new_tokens=8, ignore_eos=True)[0]
    assert len(ids) == 8
    text = " ".join(f"word{i % 37} and more text {i}" for i in range(400))
    built_ppl = engine_perplexity(eng, text, window=48, max_windows=3)["perplexity"]
    report = sensitivity(checkpoint("llama"), parse_scheme("q4"), text, window=48, max_windows=3,
                         log=lambda *a: None)
    assert abs(report.all_perplexity / built_ppl - 1) < 1e-4
    assert {r.unit for r in report.rows} == {"layer 0", "layer 1", "lm_head"}
    assert "most sensitive" in report.format()


def test_quantized_cuda_cross_build(checkpoint, tmp_path):
    """GPU targets take the weight-only schemes through TVM's dlight GPU rules (dequantize
    inlined into the GEMV); the build cross-compiles here (no GPU to run it)."""
    import tvm_llm

    m = tvm_llm.build(checkpoint("llama"), str(tmp_path / "cuda_q4"), target="cuda", arch="sm_90",
                      quantization="q4", log=lambda *a: None)
    assert m["quantization"]["tag"] == "q4" and len(m["quantization"]["quantized"]) == 9
    assert any(p["dtype"] == "uint8" for p in m["params"])


def test_plan_sizes_quantized_weights_as_the_build_stores_them(qbuild, checkpoint):
    from tvm_llm.memory import plan_checkpoint

    m = json.load(open(os.path.join(qbuild("q4"), "manifest.json")))
    plan = plan_checkpoint(checkpoint("llama"), quantization="q4", max_batch_size=4,
                           prefill_chunk_size=64, log=lambda *a: None).to_dict()
    assert plan["weights"] == m["memory"]["weights"]
    assert "uint8" in plan["weights"]["by_dtype"]
