"""Architectures with attention variants, end to end against transformers (fp32, eager):
Gemma 2 (logit soft-capping, a window on every other layer), Gemma 3 text (2 local : 1 global
layers, windows), Mistral with a window shorter than the context (every layer slides, so the
cache releases the pages behind the window), and the whole gpt-oss model (a sliding and a full
layer, attention sinks, mixture-of-experts blocks, YaRN rotary scaling: the pieces of
frontend/attention.py and frontend/moe.py together). Windows are 4 or 8 tokens and generations run
past four windows, so the windows really slide. Built once per module with 8-token pages."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

import tiny_models
from test_end_to_end import check_against_transformers
from tiny_models import VOCAB

ARCHS = ("gemma2", "gemma3_text", "mistral_sw", "gpt_oss")
WINDOW = {"gemma2": 4, "gemma3_text": 4, "mistral_sw": 8, "gpt_oss": 4}
PAGE = 8


@pytest.fixture(scope="module")
def variant_builds(tmp_path_factory, checkpoint):
    made = {}

    def get(arch):
        if arch not in made:
            import tvm_llm

            out = str(tmp_path_factory.mktemp(f"variant_{arch}") / "out")
            tvm_llm.build(checkpoint(arch), out, target="llvm", max_batch_size=4,
                          prefill_chunk_size=64, page_size=PAGE, log=lambda *a: None)
            made[arch] = out
        return made[arch]

    return get


def _prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, size=n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_tokens_and_pages_over_four_windows(arch, variant_builds, hf_model):
    """Prefill logits at every position and every decode step within 1e-4 of transformers,
    32 greedy tokens identical; pages in use per step: bounded by the window when every layer
    slides (mistral), the whole sequence's when full-attention layers need it (gemma, gpt-oss)."""
    from tvm_llm import Engine

    eng, ref_model = Engine(variant_builds(arch)), hf_model(arch)
    window = WINDOW[arch]
    prompt, n_new = _prompt(11, seed=1), 32
    assert len(prompt) + n_new > 4 * window
    pages = []
    check_against_transformers(eng, ref_model, prompt, n_new,
                               after_step=lambda: pages.append(eng.cache.used_pages()))
    print(f"{arch}: pages in use after each decode step: {pages}")
    lengths = range(len(prompt) + 1, len(prompt) + n_new)
    if arch == "mistral_sw":  # the cache keeps the window only
        assert max(pages) <= math.ceil(window / PAGE) + 1 < math.ceil(max(lengths) / PAGE)
    else:  # full layers keep every token: the pages follow the length
        assert pages == [math.ceil(length / PAGE) for length in lengths]


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_batch_decodes_like_each_prompt_alone(arch, variant_builds):
    from tvm_llm import Engine

    eng = Engine(variant_builds(arch))
    prompts = [_prompt(5, 2), _prompt(17, 3), _prompt(9, 4)]
    together = eng.generate_ids(prompts, max_new_tokens=12, ignore_eos=True)
    alone = [eng.generate_ids([p], max_new_tokens=12, ignore_eos=True)[0] for p in prompts]
    assert together == alone
    assert eng.cache.sequences == {}
    assert eng.cache.free_pages() == eng.cache.total_pages


def test_sliding_window_samples_are_prefilled_not_forked(variant_builds):
    """A sliding-window cache keeps only the window, so samples of one prompt cannot share its
    pages: each is prefilled on its own, and greedy samples equal the single generation."""
    from tvm_llm import Engine

    eng = Engine(variant_builds("mistral_sw"))
    prompt = _prompt(13, 5)
    one = eng.generate_ids([prompt], max_new_tokens=10, ignore_eos=True)[0]
    both = eng.generate_ids([prompt], max_new_tokens=10, ignore_eos=True, n=2)
    assert both == [[one, one]]
    with pytest.raises(ValueError, match="keep only their window"):
        sid = eng.cache.add()
        try:
            eng.cache.fork(sid)
        finally:
            eng.cache.remove(sid)


@pytest.mark.parametrize("kind,arch", [("cuda", "sm_90"), ("rocm", "gfx942")])
def test_variant_attention_kernels_cross_compile(kind, arch):
    """The GPU attention kernels with a per-layer table holding every variant (windows,
    soft-caps, sinks) compile for CUDA sm_90 and ROCm gfx942, and a GPU build's cache module
    takes them in place of TVM's kernels. (Their numerics are checked on the CPU with threads
    serialised: tests/schedules/test_cpu_attention_variants.py.)"""
    import tvm

    from schedules.cpu.attention import (LayerTable, decode_attention_func, for_gpu,
                                         prefill_paged_attention_func,
                                         prefill_ragged_attention_func)
    from tvm_llm.frontend.relax_import import AttentionShape, add_kv_cache_creation
    from tvm_llm.targets import get_target
    from tvm_llm.targets.cuda import _device_modules

    spec = get_target(kind, arch=arch)
    target = spec.tvm_target()
    table = LayerTable((0.25, 0.25), (4, 0), (50.0, 0.0), ((0.5, -1.0, 2.0, 0.0), (1.0,) * 4))
    shape = (2, 4, 16, "float16")
    kernels = [decode_attention_func(*shape, 16, table, vector=False),  # (sliding: same code)
               prefill_paged_attention_func(*shape, 16, table, vector=False),
               prefill_ragged_attention_func(*shape, table, vector=False)]
    funcs = {f"k{i}": for_gpu(f).with_attr("global_symbol", f"k{i}") for i, f in enumerate(kernels)}
    with target, tvm.transform.PassContext(opt_level=3, config=spec.pass_context_config()):
        lib = tvm.compile(tvm.IRModule(funcs), target=target, tir_pipeline=spec.tir_pipeline())
    (device,) = _device_modules(lib.mod)
    source = device.inspect_source("asm" if kind == "rocm" else "cuda")
    assert all(f"k{i}" in source for i in range(len(kernels)))  # every kernel in device code
    attn = AttentionShape(2, 4, 2, 16, 16, [0.25, 0.25], {0: (4, 50.0, None)})
    mod = add_kv_cache_creation(tvm.IRModule(), attn, "float16", spec)
    decode = mod["batch_decode_paged_kv"]
    assert decode.attrs["global_symbol"] == "batch_decode_paged_kv"
    assert "sm_scale < T.float32(0.0)" in decode.script()  # ours: the layer code is looked up


def test_gpt_oss_cross_compiles_for_cuda(checkpoint, tmp_path):
    """The whole gpt-oss model (sinks, windows, experts) builds for CUDA sm_90: its device code
    holds the grouped expert GEMMs and the paged attention kernels. (Not run: no GPU here.)"""
    import glob

    import tvm_llm

    out = str(tmp_path / "out")
    m = tvm_llm.build(checkpoint("gpt_oss"), out, target="cuda", arch="sm_90", max_batch_size=4,
                      prefill_chunk_size=64, emit_source=True, log=lambda *a: None)
    assert m["target"]["name"] == "cuda" and m["target"]["arch"] == "sm_90"
    assert m["model"]["model_type"] == "gpt_oss"
    device = [f for f in glob.glob(os.path.join(out, "source", "*")) if "host" not in f]
    code = "".join(open(f, errors="replace").read() for f in device)
    assert "moe_gemm" in code and "batch_decode_paged_kv" in code


def test_cache_module_is_made_once_and_each_build_gets_its_own_copy():
    """The paged KV cache's module is made once per (target, attention shape, dtype, page
    size) in a process: a second build of the same shape shares its kernels (the same IR
    objects) but gets its own module, so one build's functions never reach another's; a
    different page size gets kernels of its own."""
    import tvm
    from tvm import relax as rx

    from tvm_llm.frontend.relax_import import AttentionShape, add_kv_cache_creation
    from tvm_llm.targets import get_target

    spec = get_target("llvm")
    attn = AttentionShape(2, 4, 2, 16, 16, [0.25, 0.25])
    first = add_kv_cache_creation(tvm.IRModule(), attn, "float32", spec, page_size=16)
    bb = rx.BlockBuilder()
    with bb.function("model_only", []):
        bb.emit_func_output(rx.const(1, "int32"))
    second = add_kv_cache_creation(bb.get(), attn, "float32", spec, page_size=16)
    assert second["batch_decode_paged_kv_cpu"].same_as(first["batch_decode_paged_kv_cpu"])
    assert "model_only" in {gv.name_hint for gv in second.get_global_vars()}
    assert "model_only" not in {gv.name_hint for gv in first.get_global_vars()}
    third = add_kv_cache_creation(tvm.IRModule(), attn, "float32", spec)
    assert "model_only" not in {gv.name_hint for gv in third.get_global_vars()}
    other = add_kv_cache_creation(tvm.IRModule(), attn, "float32", spec, page_size=32)
    assert not other["batch_decode_paged_kv_cpu"].same_as(first["batch_decode_paged_kv_cpu"])
