"""Mixture-of-experts models (experts through tvm_llm::moe_experts, frontend/moe.py) against
transformers: the same numeric matrix as test_end_to_end, plus the experts op alone on
gpt-oss's expert block (interleaved gate/up with biases, clamped swiglu, biased router)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import test_end_to_end as e2e
from tiny_models import COMMON, MOE_ARCHS


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_logits_and_greedy_tokens_match_transformers(arch, built, hf_model):
    e2e.test_prefill_decode_logits_and_greedy_tokens_match_transformers(arch, built, hf_model)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_ragged_batch_decodes_like_each_prompt_alone(arch, built):
    e2e.test_ragged_batch_decodes_like_each_prompt_alone(arch, built)


class _MLPOut(torch.nn.Module):
    """GptOssMLP returns (hidden, router scores): the hidden states alone."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x)[0]


@pytest.fixture(scope="module")
def gpt_oss_block():
    """(Relax module of gpt-oss's MoE block, inputs, transformers' outputs). The experts go
    through tvm_llm::moe_experts; the block: interleaved gate/up with biases, clamped swiglu
    with sigmoid(alpha g), transposed weights, a router with a bias and a softmax over the
    top-k logits. Inputs of 1, 3 and 9 tokens."""
    import transformers as T
    from tvm.relax.frontend.torch import from_exported_program

    from tvm_llm.frontend.moe import use_tvm_experts
    from tvm_llm.frontend.moe_relax import moe_converter

    torch.manual_seed(0)
    cfg = T.GptOssConfig(**{**COMMON, "head_dim": 16}, num_local_experts=4, num_experts_per_tok=2,
                         swiglu_limit=1.5)
    mlp = T.models.gpt_oss.modeling_gpt_oss.GptOssMLP(cfg).eval()
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    xs = {n: torch.randn(1, n, cfg.hidden_size) for n in (1, 3, 9)}
    with torch.no_grad():  # transformers' own experts loop (no implementation chosen: eager)
        want = {n: mlp(x)[0].numpy() for n, x in xs.items()}
    # the clamp limit is reached: the test covers both sides of it
    flat = torch.cat([x.reshape(-1, cfg.hidden_size) for x in xs.values()])
    assert ((flat @ mlp.experts.gate_up_proj[0]).abs() > cfg.swiglu_limit).any()

    assert use_tvm_experts(mlp) == 1
    seq = torch.export.Dim("seq", min=1, max=64)
    with torch.no_grad():
        ep = torch.export.export(_MLPOut(mlp), (xs[3],), dynamic_shapes={"x": {1: seq}}, strict=False)
    return from_exported_program(ep, custom_convert_map=moe_converter()), xs, want


def test_gpt_oss_expert_block_matches_transformers(gpt_oss_block):
    """The block compiled for the CPU with our schedules (both moe_gemm kernels claimed by
    the MoE rule) against transformers' GptOssMLP on the same weights."""
    import tvm
    from tvm import relax

    from schedules.cpu import cpu_schedule_pass
    from tvm_llm.targets import get_target

    mod, xs, want = gpt_oss_block
    spec = get_target("llvm")
    target = spec.tvm_target()
    with target, tvm.transform.PassContext(opt_level=3):
        mod = relax.transform.LegalizeOps()(mod)
        mod = cpu_schedule_pass()(mod)
        moe = [gv.name_hint for gv, f in mod.functions_items() if gv.name_hint.startswith("moe_gemm")]
        assert len(moe) == 2 and all(mod[n].attrs.get("tirx.is_scheduled") for n in moe)
        ex = tvm.compile(mod, target=target)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    for n, x in xs.items():
        got = vm["main"](tvm.runtime.tensor(x.numpy()))[0].numpy()  # a 1-tuple: the hidden states
        assert got.shape == want[n].shape
        assert np.abs(got - want[n]).max() < 1e-4, n


@pytest.mark.parametrize("target,arch", [("cuda", "sm_90"), ("rocm", "gfx942")])
def test_expert_block_cross_compiles_for_gpus(gpt_oss_block, target, arch, tmp_path):
    """The expert sort and the grouped expert GEMMs lower for CUDA and ROCm through the
    targets' own passes (each kernel bound to threads) and link into a library."""
    import tvm
    from tvm import relax

    from gpu_verify import lower_for_scheduling
    from tvm_llm.targets import get_target

    spec = get_target(target, arch=arch)
    tvm_target = spec.tvm_target()
    with tvm_target, tvm.transform.PassContext(opt_level=3, config=spec.pass_context_config()):
        mod = relax.backend.DispatchSortScan()(gpt_oss_block[0])
        mod = tvm.transform.Sequential(spec.schedule_passes())(lower_for_scheduling(mod))
        ex = tvm.compile(mod, target=tvm_target, tir_pipeline=spec.tir_pipeline())
    spec.export_library(ex, str(tmp_path / "block.so"))
    device = [f for f in spec.emit_source(ex, str(tmp_path / "src")) if "host" not in f]
    code = "".join(open(f, errors="replace").read() for f in device)
    assert "moe_gemm" in code


def test_q8_moe_build_equals_its_fake_quantized_simulation(checkpoint, hf_model, tmp_path):
    """--quantization q8 (weight-only) on Mixtral: the expert weights are quantized too (each
    expert along its input in groups of 32, quantization/experts.py) and the build computes
    exactly transformers with every reported weight fake-quantized (experts by the same
    reference quantizer, expert by expert)."""
    import tvm_llm
    from quant_simulation import Simulated
    from tvm_llm.quantization.formats import fake_quantize

    out = str(tmp_path / "q8")
    m = tvm_llm.build(checkpoint("mixtral"), out, max_batch_size=2, prefill_chunk_size=64,
                      quantization="q8", activations="float", log=lambda *a: None)
    quantized = m["quantization"]["quantized"]
    experts = {k: v for k, v in quantized.items() if "experts" in v}
    assert len(experts) == 4 and all(v["format"] == "q8_0" for v in experts.values())  # 2 layers
    eng = e2e._engine(out)
    prompt = e2e._prompt(11, seed=6)
    n = len(prompt)
    sid = eng.cache.add()
    pre = eng.prefill_positions([sid], [n], np.array([prompt]), np.arange(n)[None], np.arange(n))[0]
    nxt = int(pre[-1].argmax())
    step = eng.decode_step([sid], [nxt])[0]
    eng.cache.remove(sid)

    model = hf_model("mixtral")
    params = dict(model.named_parameters())
    saved = {k: params[k].data for k in experts}
    try:
        for k, v in experts.items():  # Mixtral stores each expert (out, in): quantized along in
            w = params[k].detach().numpy()
            params[k].data = torch.from_numpy(np.stack([fake_quantize(w[e], v["format"])
                                                        for e in range(w.shape[0])]))
        rest = {k: v for k, v in quantized.items() if k not in experts}
        with Simulated(model, rest), torch.no_grad():
            ref = model(torch.tensor([prompt + [nxt]])).logits[0].numpy()
        with torch.no_grad():  # the float model differs: the test would notice unquantized experts
            for k in experts:
                params[k].data = saved[k]
            with Simulated(model, rest):
                float_experts = model(torch.tensor([prompt + [nxt]])).logits[0].numpy()
    finally:
        for k, w in saved.items():
            params[k].data = w
    assert np.abs(pre - ref[:n]).max() < 1e-4
    assert np.abs(step - ref[n]).max() < 1e-4
    assert np.abs(float_experts - ref).max() > 1e-3


def test_unknown_expert_gating_is_refused_before_tracing():
    """An experts module whose activation the op has no lowering for: one UserError line."""
    import transformers as T

    from tvm_llm.errors import UserError
    from tvm_llm.frontend.moe import use_tvm_experts

    cfg = T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, hidden_act="tanh")
    block = T.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg)
    with pytest.raises(UserError, match="activation 'tanh'"):
        use_tvm_experts(block)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_k"])
def test_quantized_expert_gemm_matches_its_reference(fmt):
    """The quantized grouped expert GEMM, scheduled by the CPU MoE rule, against numpy on
    the reference quantizer's fake-quantized experts (rows routed to different experts)."""
    import tvm

    from schedules.cpu import cpu_schedule_pass
    from tvm_llm.quantization import experts
    from tvm_llm.targets import get_target

    E, K, N = 4, 256, 48
    spec = get_target("llvm")
    target = spec.tvm_target()
    func = experts.moe_gemm_dequantize_func(E, N, K, fmt, "float32").with_attr("global_symbol", "main")
    with target:
        mod = cpu_schedule_pass()(tvm.IRModule({"main": func}))
        assert mod["main"].attrs.get("tirx.is_scheduled")
        lib = tvm.compile(mod, target=target)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((E, K, N)).astype("float32")
    stored = experts.quantize_experts_np(w, fmt)
    ref_w = experts.fake_quantize_experts(w, fmt)
    for rows in (1, 5):
        x = rng.standard_normal((rows, K)).astype("float32")
        ids = rng.integers(0, E, rows).astype("int64")
        y = tvm.runtime.tensor(np.zeros((rows, N), "float32"))
        lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(ids),
                    *[tvm.runtime.tensor(a) for a in stored], y)
        want = np.einsum("rk,rkn->rn", x, ref_w[ids])
        assert np.abs(y.numpy() - want).max() < 1e-4 * max(1.0, np.abs(want).max())
