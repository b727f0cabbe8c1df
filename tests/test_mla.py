"""DeepSeek-V3 multi-head latent attention (tvm_llm/frontend/mla.py) against transformers.

Tiny random deepseek_v3 checkpoints with a low-rank query (q_lora_rank set) and DeepSeek-V3's
YaRN rotary scaling for the CPU numerics, in two variants, each test run on both: every layer
dense (first_k_dense_replace = layers), and DeepSeek-V3's layer mix (the first layer dense, the
next a mixture of experts: 8 routed experts top-2 picked within the best of 2 groups by a
sigmoid router with a score-correction bias, plus a shared expert; the router's unsorted
top-k, frontend/relax_import._topk_converter). A full-rank query (q_lora_rank None, the
V2-Lite shape) with plain RoPE for the GPU cross-compiles, so both query paths are imported
and built.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from test_end_to_end import check_against_transformers
from tiny_models import COMMON, VOCAB, make_tokenizer

LATENT, ROPE = 32, 8  # kv_lora_rank, qk_rope_head_dim


def _prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, size=n)]


# DeepSeek-V3's own rotary scaling (YaRN with mscale_all_dim: the softmax scale changes too)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


# DeepSeek-V3's layer mix, scaled down: dense first layer, then routed + shared experts
MOE = {"first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
       "n_group": 2, "topk_group": 1, "n_shared_experts": 1}


def _make(path, q_lora_rank, rope_parameters=None, moe=False):
    import transformers as T

    extra = {"rope_parameters": rope_parameters} if rope_parameters else {}
    dense = {"first_k_dense_replace": COMMON["num_hidden_layers"], "n_routed_experts": 4,
             "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}
    cfg = T.DeepseekV3Config(**extra, **{
        **COMMON, "num_key_value_heads": 4, "kv_lora_rank": LATENT, "q_lora_rank": q_lora_rank,
        "qk_rope_head_dim": ROPE, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "moe_intermediate_size": 32, **(MOE if moe else dense)})
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():  # the router's score correction (zero at init)
            if name.endswith("e_score_correction_bias"):
                b.add_(0.1 * torch.randn_like(b))
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(path)
    return path


@pytest.fixture(scope="module", params=["dense", "moe"])
def mla_checkpoint(request, tmp_path_factory):
    return _make(str(tmp_path_factory.mktemp(f"ck_deepseek_v3_{request.param}")), q_lora_rank=24,
                 rope_parameters=YARN, moe=request.param == "moe")


@pytest.fixture(scope="module")
def mla_built(tmp_path_factory, mla_checkpoint):
    import tvm_llm

    out = str(tmp_path_factory.mktemp("out_deepseek_v3") / "out")
    tvm_llm.build(mla_checkpoint, out, target="llvm", max_batch_size=4, prefill_chunk_size=64,
                  log=lambda *a: None)
    return out


@pytest.fixture(scope="module")
def mla_ref(mla_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(mla_checkpoint, attn_implementation="eager").eval()


def test_prefill_decode_logits_and_greedy_tokens_match_transformers(mla_built, mla_ref):
    from tvm_llm import Engine

    check_against_transformers(Engine(mla_built), mla_ref, _prompt(11, seed=1))


def test_ragged_batch_and_forked_samples_decode_like_each_prompt_alone(mla_built):
    from tvm_llm import Engine

    eng = Engine(mla_built)
    prompts = [_prompt(5, 2), _prompt(17, 3), _prompt(9, 4), _prompt(1, 5)]
    together = eng.generate_ids(prompts, max_new_tokens=12, ignore_eos=True)
    alone = [eng.generate_ids([p], max_new_tokens=12, ignore_eos=True)[0] for p in prompts]
    assert together == alone and all(len(t) == 12 for t in together)
    # two samples forked from a prompt's pages decode like the prompt alone
    forked = eng.generate_ids([prompts[1]], max_new_tokens=12, ignore_eos=True, n=2)
    assert forked == [[alone[1], alone[1]]]
    assert eng.cache.sequences == {}
    assert eng.cache.free_pages() == eng.cache.total_pages


def test_prefill_over_earlier_pages_matches_one_prefill(mla_built):
    """A prompt prefilled in chunks (its later chunks attend to its earlier pages), batched with
    a fresh prompt and with a one-token chunk, gives the logits of one whole prefill."""
    from tvm_llm import Engine

    eng = Engine(mla_built)
    a, b = _prompt(14, 8), _prompt(6, 9)
    sa, sb = eng.cache.add(), eng.cache.add()
    whole = eng.prefill([(sa, a), (sb, b)])
    eng.cache.remove(sa)
    eng.cache.remove(sb)
    sa, sb = eng.cache.add(), eng.cache.add()
    eng.prefill([(sa, a[:5])])
    eng.prefill([(sa, a[5:6])])                           # one-token chunk over earlier pages
    parts = eng.prefill([(sb, b), (sa, a[6:])])           # fresh + continued in one batch
    assert np.abs(parts[0] - whole[1]).max() < 1e-5
    assert np.abs(parts[1] - whole[0]).max() < 1e-5
    eng.cache.remove(sa)
    eng.cache.remove(sb)


def test_cache_stores_the_latent_row_not_full_heads(mla_built, mla_ref):
    """The page rows hold exactly transformers' normed latent and rotated k_pe of each token
    (kv_lora_rank + qk_rope_head_dim values per layer), and the plan sizes pages by that."""
    import tvm

    from tvm_llm import Engine

    eng = Engine(mla_built)
    manifest = json.load(open(os.path.join(mla_built, "manifest.json")))
    assert manifest["model"]["num_kv_heads"] == 1
    assert manifest["model"]["head_dim"] == LATENT + ROPE
    layers = mla_ref.config.num_hidden_layers
    assert manifest["memory"]["kv_cache"]["bytes_per_token"] == layers * 2 * (LATENT + ROPE) * 4
    full_heads = layers * mla_ref.config.num_attention_heads * (16 + ROPE + 16) * 4
    assert manifest["memory"]["kv_cache"]["bytes_per_token"] < full_heads

    prompt = _prompt(13, seed=7)
    sid = eng.cache.add()
    eng.prefill([(sid, prompt)])
    n = len(prompt)
    k = tvm.runtime.empty((layers, n, 1, LATENT + ROPE), "float32", eng.device)
    v = tvm.runtime.empty((layers, n, 1, LATENT + ROPE), "float32", eng.device)
    tvm.get_global_func("vm.builtin.attention_kv_cache_debug_get_kv")(eng.cache.handle, sid, 0, n, k, v)
    eng.cache.remove(sid)

    seen = {}
    for i, layer in enumerate(mla_ref.model.layers):  # record what transformers up-projects
        attn = layer.self_attn

        def record(latent, k_pe, attn=attn, i=i, orig=type(attn).expand_kv):
            seen[i] = torch.cat([latent, k_pe], dim=-1)[0, 0].numpy()
            return orig(attn, latent, k_pe)

        attn.expand_kv = record
    try:
        with torch.no_grad():
            mla_ref(torch.tensor([prompt]))
    finally:
        for layer in mla_ref.model.layers:
            del layer.self_attn.expand_kv
    rows = np.stack([seen[i] for i in range(layers)])  # (layers, n, L + R)
    assert np.abs(k.numpy()[:, :, 0] - rows).max() < 1e-5
    assert np.abs(v.numpy()[:, :, 0] - rows).max() < 1e-5


@pytest.mark.parametrize("target,arch", [("cuda", "sm_90"), ("rocm", "gfx942")])
def test_mla_model_cross_compiles_for_gpus(target, arch, tmp_path_factory):
    import tvm_llm

    ck = _make(str(tmp_path_factory.mktemp("ck_deepseek_v3_full_q")), q_lora_rank=None)
    m = tvm_llm.build(ck, str(tmp_path_factory.mktemp(f"out_{target}") / "out"), target=target,
                      arch=arch, max_batch_size=4, prefill_chunk_size=64, log=lambda *a: None)
    assert m["target"]["name"] == target and m["target"]["arch"] == arch
    assert m["model"]["num_kv_heads"] == 1 and m["model"]["head_dim"] == LATENT + ROPE


def test_complex_rotary_is_refused_in_one_line():
    """transformers' deepseek_v2 writes its rotary embedding with complex numbers (polar,
    view_as_complex), which Relax cannot hold: the import refuses such a graph with a UserError
    (exit 2 from the CLI). Checked on a three-op module: exporting deepseek_v2 itself takes ~20 s."""
    from tvm_llm.errors import UserError
    from tvm_llm.frontend.relax_import import to_relax

    class ComplexRotary(torch.nn.Module):
        def forward(self, x, angle):
            z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten(-2)

    ep = torch.export.export(ComplexRotary(), (torch.randn(3, 8), torch.randn(3, 4)))
    with pytest.raises(UserError, match="complex numbers .*deepseek_v2"):
        to_relax(ep, vocab_size=VOCAB)
