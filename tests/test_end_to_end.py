"""End-to-end numerics: every supported architecture against transformers on the same weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny_models import ARCHS, VOCAB

TOL = 1e-4


def _prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, size=n)]


def _engine(out):
    from tvm_llm import Engine

    return Engine(out)


def check_against_transformers(eng, ref_model, prompt, n_new=32, after_step=None, tol=TOL) -> list:
    """Prefill logits at every prompt position and each of `n_new - 1` decode steps within TOL
    of transformers (eager, on the same weights), the greedy tokens identical to its generate,
    and the engine's own greedy loop too. `after_step()` runs after each decode step (e.g. to
    read the cache's pages). `tol`: the logits' tolerance. Returns the greedy tokens."""
    sid = eng.cache.add()
    n = len(prompt)
    pre = eng.prefill_positions([sid], [n], np.array([prompt]), np.arange(n)[None], np.arange(n))[0]
    steps, tokens = [], [int(pre[-1].argmax())]
    for _ in range(n_new - 1):
        row = eng.decode_step([sid], [tokens[-1]])[0]
        steps.append(row)
        tokens.append(int(row.argmax()))
        if after_step is not None:
            after_step()
    eng.cache.remove(sid)
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt + tokens[:-1]])).logits[0].numpy()
        hf_tokens = ref_model.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, n:].tolist()
    assert np.abs(pre - ref[:n]).max() < tol
    for i, row in enumerate(steps):  # decode step i predicts position n + i
        assert np.abs(row - ref[n + i]).max() < tol, f"decode step {i}"
    assert tokens == hf_tokens
    # the engine's own greedy loop gives the same tokens
    assert eng.generate_ids([prompt], max_new_tokens=n_new, ignore_eos=True)[0] == hf_tokens
    return tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_decode_logits_and_greedy_tokens_match_transformers(arch, built, hf_model):
    check_against_transformers(_engine(built(arch)), hf_model(arch), _prompt(11, seed=1))


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_batch_decodes_like_each_prompt_alone(arch, built):
    eng = _engine(built(arch))
    prompts = [_prompt(5, 2), _prompt(17, 3), _prompt(9, 4)]
    together = eng.generate_ids(prompts, max_new_tokens=12, ignore_eos=True)
    alone = [eng.generate_ids([p], max_new_tokens=12, ignore_eos=True)[0] for p in prompts]
    assert together == alone
    assert all(len(t) == 12 for t in together)
    assert eng.cache.sequences == {}  # every sequence returned its pages
    assert eng.cache.free_pages() == eng.cache.total_pages


def test_float16_build_runs_with_a_float16_kv_cache(checkpoint, hf_model, tmp_path):
    """TVM's importer computes linears in float32 inside a float16 model; q/k/v are cast to the
    float16 cache on the way in (GPU builds default to float16, so this path must run)."""
    import tvm_llm

    out = str(tmp_path / "out16")
    tvm_llm.build(checkpoint("llama"), out, dtype="float16", max_batch_size=2,
                  prefill_chunk_size=64, log=lambda *a: None)
    eng = _engine(out)
    prompt = _prompt(11, seed=3)
    sid = eng.cache.add()
    n = len(prompt)
    pre = eng.prefill_positions([sid], [n], np.array([prompt]), np.arange(n)[None], np.arange(n))[0]
    step = eng.decode_step([sid], [int(pre[-1].argmax())])[0]
    eng.cache.remove(sid)
    with torch.no_grad():
        ref = hf_model("llama")(torch.tensor([prompt + [int(pre[-1].argmax())]])).logits[0].numpy()
    for got, want in ((pre, ref[:n]), (step, ref[n])):
        cos = float((got * want).sum() / np.sqrt((got * got).sum() * (want * want).sum()))
        assert cos > 0.999, cos


def test_float32_build_with_a_float16_kv_cache(checkpoint, hf_model, tmp_path):
    """`kv_dtype="float16"` on a float32 build (the CLI's q4 / q8 default): the cache's pages
    hold float16 (2 bytes per value in the manifest's memory plan), the logits stay within
    float16's rounding of transformers' float32 ones (K/V rounded: ~1e-3 of the logits' scale
    here, not the float32 cache's 1e-5) and the greedy tokens are the same."""
    import json

    import tvm_llm

    out = str(tmp_path / "kv16")
    tvm_llm.build(checkpoint("llama"), out, kv_dtype="float16", max_batch_size=2,
                  prefill_chunk_size=64, log=lambda *a: None)
    with open(f"{out}/manifest.json") as f:
        manifest = json.load(f)
    model, kv = manifest["model"], manifest["memory"]["kv_cache"]
    assert manifest["dtype"] == "float32" and manifest["kv_cache"]["dtype"] == "float16"
    assert kv["dtype"] == "float16"
    assert kv["bytes_per_token"] == 2 * model["num_layers"] * model["num_kv_heads"] * model["head_dim"] * 2
    eng = _engine(out)
    prompt = _prompt(23, seed=5)
    check_against_transformers(eng, hf_model("llama"), prompt, n_new=16, tol=3e-2)
    sid = eng.cache.add()
    n = len(prompt)
    pre = eng.prefill_positions([sid], [n], np.array([prompt]), np.arange(n)[None], np.arange(n))[0]
    eng.cache.remove(sid)
    with torch.no_grad():
        ref = hf_model("llama")(torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(pre - ref).max() > 10 * TOL  # the float16 rounding is really there
    # a fork shares the parent's float16 pages and copies its last one (the cache's copy
    # kernels take its dtype): both then decode alike
    parent = eng.cache.add()
    eng.prefill([(parent, prompt)])
    child = eng.cache.fork(parent)
    rows = [eng.decode_step([sid], [7])[0] for sid in (parent, child)]
    assert np.abs(rows[0] - rows[1]).max() < 1e-5


def test_import_converts_no_weight_to_tvm(checkpoint, monkeypatch):
    """The Relax import leaves the weights as they are (the build hands them to the weight
    transform itself): TVM's importer converts only buffers and constants, not one parameter
    (each conversion of a safetensors weight was a copy: 4.4 GB on llama-1b)."""
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    from tvm_llm.config import BuildConfig
    from tvm_llm.front import lower

    convert = ExportedProgramImporter._convert_pytorch_tensor_to_tvm
    converted = []

    def counting(tensor):
        converted.append(tensor.numel() * tensor.element_size())
        return convert(tensor)

    monkeypatch.setattr(ExportedProgramImporter, "_convert_pytorch_tensor_to_tvm",
                        staticmethod(counting))
    lowered = lower(checkpoint("llama"), BuildConfig.create(context_window=64), "import",
                    log=lambda *a: None)
    weight_bytes = sum(w.nbytes for w in lowered.imported.params)
    assert weight_bytes > 0 and lowered.imported.params
    assert sum(converted) < 0.01 * weight_bytes, (sum(converted), weight_bytes)
