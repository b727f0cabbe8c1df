"""Quantized builds of the tiny Llama: what they store, and that they compute exactly what
the scheme says (transformers with the same fake-quantized weights), close to float32."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from quant_simulation import Simulated as _Simulated
from tiny_models import VOCAB
from tvm_llm.quantization.plan import QuantPlan
from tvm_llm.quantization.scheme import parse_scheme

PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, VOCAB, size=13)]
L0, L1 = "model.layers.0.", "model.layers.1."
# one build covers every format: layer 0's linears in four formats, layer 1's q|k|v in q5_k,
# its o_proj kept float by --keep-float and its down_proj by the plan, the LM head in q6_k
MIX = QuantPlan("q4_k", formats={
    L0 + "self_attn.q_proj.weight": "q4_1", L0 + "self_attn.k_proj.weight": "q4_0",
    L0 + "self_attn.o_proj.weight": "q8_0", L0 + "mlp.gate_proj.weight": "q4_0", L0 + "mlp.up_proj.weight": "q4_0",
    L0 + "mlp.down_proj.weight": "q3_k", L1 + "self_attn.q_proj.weight": "q5_k",
    L1 + "mlp.down_proj.weight": "float", "lm_head.weight": "q6_k"})
MIX_KEEP = "*layers.1.self_attn.o_proj*"


@pytest.fixture(scope="module")
def qbuild(tmp_path_factory, checkpoint):
    made = {}

    def get(quantization, activations=None, keep_float=None, plan=None, arch=None):
        key = (quantization, activations, keep_float, plan is not None, arch)
        if key not in made:
            import tvm_llm

            out = str(tmp_path_factory.mktemp("q") / "out")
            tvm_llm.build(checkpoint("llama"), out, max_batch_size=4, prefill_chunk_size=64,
                          quantization=quantization, activations=activations, arch=arch,
                          keep_float=keep_float, quant_plan=plan, log=lambda *a: None)
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


def _manifest(out):
    return json.load(open(os.path.join(out, "manifest.json")))


def _reference(model, quantized=None):
    """transformers logits for PROMPT + the next greedy token, simulating the build."""
    with _Simulated(model, quantized), torch.no_grad():
        first = model(torch.tensor([PROMPT])).logits[0].numpy()
        nxt = int(first[-1].argmax())
        return model(torch.tensor([PROMPT + [nxt]])).logits[0].numpy()


def _cosine(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / np.sqrt((a @ a) * (b @ b)))


def _untied_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint("llama"), attn_implementation="eager").eval()


def test_mixed_weight_only_build_equals_fake_quantized_transformers(qbuild, checkpoint):
    out = qbuild("q4", activations="float", keep_float=MIX_KEEP, plan=MIX)
    q = _manifest(out)["quantization"]
    fmts = {k: v["format"] for k, v in q["quantized"].items()}
    assert fmts[",".join(L0 + f"self_attn.{p}_proj.weight" for p in "kqv")] == "q4_1"  # most bits
    assert fmts[L0 + "mlp.gate_proj.weight," + L0 + "mlp.up_proj.weight"] == "q4_0"
    assert fmts["lm_head.weight"] == "q6_k" and fmts[L1 + "mlp.gate_proj.weight," + L1 + "mlp.up_proj.weight"] == "q4_k"
    assert fmts[",".join(L1 + f"self_attn.{p}_proj.weight" for p in "kqv")] == "q5_k"
    assert fmts[L0 + "mlp.down_proj.weight"] == "q3_k"
    assert set(q["kept_float"]) == {L1 + "mlp.down_proj.weight", L1 + "self_attn.o_proj.weight"}
    # the untied embedding table is stored 8-bit (q8_0) and dequantized by the lookup
    assert fmts["model.embed_tokens.weight"] == "q8_0"
    assert q["quantized"]["model.embed_tokens.weight"]["activations"] == "lookup"
    assert q["format_counts"] == {"q4_1": 1, "q8_0": 2, "q4_0": 1, "q3_k": 1, "q5_k": 1, "q4_k": 1,
                                  "q6_k": 1, "float": 2}
    assert 4.5 < q["bits_per_weight"] < 32
    pre, step, _ = _logits(out)
    ref = _reference(_untied_model(checkpoint), q["quantized"])
    n = len(PROMPT)
    assert np.abs(pre - ref[:n]).max() < 1e-4
    assert np.abs(step - ref[n]).max() < 1e-4


def _integer_activation_build(qbuild, checkpoint, activations, arch=None):
    """The mixed plan built with int8 / int16 activations (for `arch`, default this CPU): (pre,
    step) logits of the build, and of its simulation and of the weight-only simulation, each
    split the same way."""
    out = qbuild("q4", activations=activations, keep_float=MIX_KEEP, plan=MIX, arch=arch)
    q = _manifest(out)["quantization"]["quantized"]
    assert all(v["activations"] == ("lookup" if "embed" in k else activations) for k, v in q.items())
    pre, step, _ = _logits(out)
    model = _untied_model(checkpoint)
    n = len(PROMPT)
    sim = _reference(model, q)
    weight_only = _reference(model, {k: {**v, "activations": "float"} for k, v in q.items()})
    return (pre, step), (sim[:n], sim[n]), (weight_only[:n], weight_only[n])


def test_mixed_int8_activation_build_matches_its_simulation(qbuild, checkpoint):
    (pre, step), (sim_pre, sim_step), (wo_pre, _) = _integer_activation_build(qbuild, checkpoint, "int8")
    # int8 rounding of activations can flip at exact ties between two float orders; the
    # simulation is otherwise the same arithmetic
    assert _cosine(pre, sim_pre) > 0.99999 and _cosine(step, sim_step) > 0.99999
    # per-32-block activation scales cost little next to the weights' own rounding
    assert _cosine(pre, wo_pre) > 0.999


def test_avx2_int8_activation_build_matches_its_simulation_and_the_host_build(qbuild, checkpoint):
    """CPUs without VNNI (x86-64-v3: AVX2) run the same integer kernels on vpmaddubsw: the
    default activations there are integer, and the build computes what the simulation and this
    host's build (VNNI here) do: the integer sums are exact on both, the float terms the same."""
    import tvm

    from cpu_workloads import host_target

    if not tvm.target.codegen.llvm_cpu_has_features("avx2", host_target(2)):
        pytest.skip("x86-64-v3 code needs AVX2 on the host to run")
    from tvm_llm.config import BuildConfig

    assert BuildConfig.create(quantization="q4", arch="x86-64-v3").scheme.activations == "int8"
    assert BuildConfig.create(quantization="q4_0", arch="x86-64-v3").scheme.activations == "int16"
    (pre, step), (sim_pre, sim_step), _ = _integer_activation_build(qbuild, checkpoint, "int8", "x86-64-v3")
    assert _cosine(pre, sim_pre) > 0.99999 and _cosine(step, sim_step) > 0.99999
    host_pre, host_step, _ = _logits(qbuild("q4", activations="int8", keep_float=MIX_KEEP, plan=MIX))
    scale = np.abs(host_pre).max()
    assert np.abs(pre - host_pre).max() < 1e-4 * scale and np.abs(step - host_step).max() < 1e-4 * scale


def test_mixed_int16_activation_build_equals_the_weight_only_simulation(qbuild, checkpoint):
    """16-bit activations (two int8 halves in the VNNI kernel, the default of exact format
    names on VNNI CPUs) compute what float activations do, to float32 rounding's order."""
    build, sim, weight_only = _integer_activation_build(qbuild, checkpoint, "int16")
    # measured: 16-bit simulation 3e-4 / 5e-4 apart (logits up to 6.2), float activations 9e-4;
    # the int8 build of the same plan is 0.2 from float activations (1 - cosine 2.4e-4, here 5e-9)
    for got, ref in [*zip(build, sim), *zip(build, weight_only)]:
        assert np.abs(got - ref).max() < 2e-3 and 1 - _cosine(got, ref) < 1e-7


def test_stored_weights_and_report(qbuild, built):
    out = qbuild("q4", activations="float")
    manifests = {"fp32": _manifest(built("llama")), "q4": _manifest(out)}
    q = manifests["q4"]["quantization"]
    assert q["scheme"] == "q4" and q["format"] == "q4_k" and q["activations"] == "float"
    # 2 layers x (qkv, o, gate_up, down) + lm_head, and the embedding table at 8 bits
    assert len(q["quantized"]) == 10 and not q.get("kept_float")
    assert q["format_counts"] == {"q4_k": 9, "q8_0": 1}
    params = manifests["q4"]["params"]
    assert "uint8" in {p["dtype"] for p in params} and "int8" in {p["dtype"] for p in params}
    # no float32 weight matrix ships: the float32 2-D params are q4_k's group scales and
    # offsets and the embedding's q8_0 scales, one per 32 weights of K (64 or 128 here)
    float_2d = [p for p in params if p["dtype"] == "float32" and len(p["shape"]) == 2]
    assert len(float_2d) == 19 and all(p["shape"][1] in (2, 4) for p in float_2d), float_2d
    # the report's bits per weight are the bytes stored: q4_k "rows" keeps a float32 scale and
    # offset per 32 weights (6 bits), the q8_0 table a float32 scale (9 bits)
    stored = sum(p["nbytes"] for p in params if p["dtype"] in ("uint8", "int8")) \
        + sum(p["nbytes"] for p in float_2d)
    weights = sum(v["shape"][0] * v["shape"][1] for v in q["quantized"].values())
    assert q["bits_per_weight"] == pytest.approx(8 * stored / weights, abs=1e-4)
    assert 6.0 < q["bits_per_weight"] < 9.0
    size = {k: os.path.getsize(os.path.join(o, "weights.bin"))
            for k, o in [("fp32", built("llama")), ("q4", out)]}
    assert size["q4"] < size["fp32"]
    assert manifests["fp32"].get("quantization") is None


def test_generation_runs_and_perplexity_equals_the_simulation(qbuild, checkpoint, tmp_path):
    from tvm_llm import Engine
    from tvm_llm.perplexity import engine_perplexity
    from tvm_llm.quantization.sensitivity import sensitivity

    out = qbuild("q4", activations="float")
    eng = Engine(out)
    ids = eng.generate_ids([PROMPT], max_new_tokens=8, ignore_eos=True)[0]
    assert len(ids) == 8
    text = " ".join(f"word{i % 37} and more text {i}" for i in range(400))
    built_ppl = engine_perplexity(eng, text, window=48, max_windows=3)["perplexity"]
    from tvm_llm.perplexity import transformers_perplexity

    model = _untied_model(checkpoint)
    with _Simulated(model, _manifest(out)["quantization"]["quantized"]):
        sim_ppl = transformers_perplexity(model, eng.tokenizer.encode(text).ids, window=48,
                                          max_windows=3)["perplexity"]
    assert abs(sim_ppl / built_ppl - 1) < 1e-4
    # the sensitivity sweep simulates the linears (the build also stores the embedding 8-bit)
    report = sensitivity(checkpoint("llama"), parse_scheme("q4"), text, window=48, max_windows=3,
                         log=lambda *a: None)
    assert abs(report.all_perplexity / built_ppl - 1) < 5e-3
    assert {r.unit for r in report.rows} == {"layer 0", "layer 1", "lm_head"}
    assert "most sensitive" in report.format()


def test_quantized_cuda_cross_build(checkpoint, tmp_path):
    """GPU targets take the weight-only schemes through TVM's dlight GPU rules (dequantize
    inlined into the GEMV); the build cross-compiles here (no GPU to run it), every format of
    the mixed plan included."""
    import tvm_llm

    m = tvm_llm.build(checkpoint("llama"), str(tmp_path / "cuda_q4"), target="cuda", arch="sm_90",
                      quantization="q4", quant_plan=MIX, log=lambda *a: None)
    q = m["quantization"]
    assert q["tag"] == "q4_k" and len(q["quantized"]) == 9 and len(q["kept_float"]) == 1
    assert {v["format"] for v in q["quantized"].values()} == {"q4_1", "q8_0", "q4_0", "q3_k", "q5_k",
                                                              "q4_k", "q6_k"}
    assert any(p["dtype"] == "uint8" for p in m["params"])


def test_plan_sizes_quantized_weights_as_the_build_stores_them(qbuild, checkpoint):
    from tvm_llm.config import BuildConfig
    from tvm_llm.front import plan as plan_checkpoint

    m = json.load(open(os.path.join(qbuild("q4", activations="float"), "manifest.json")))
    config = BuildConfig.create(quantization="q4", activations="float", max_batch_size=4,
                                prefill_chunk_size=64)
    plan = plan_checkpoint(checkpoint("llama"), config, log=lambda *a: None).to_dict()
    assert plan["weights"] == m["memory"]["weights"]
    assert "uint8" in plan["weights"]["by_dtype"]
