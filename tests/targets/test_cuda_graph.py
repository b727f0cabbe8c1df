"""Decode as CUDA Graphs: a tiny Llama cross-built for sm_90 (no GPU here to run it).

The finalized decode replays captured regions through vm.builtin.cuda_graph.run_or_capture
(one graph per batch size) and gets its planned storages from get_cached_alloc; only the
kernels reading runtime inputs, the paged-KV attention calls and the LM head stay outside. Prefill (a
token count with hundreds of values) is not captured.
"""
from __future__ import annotations

import json
import os

import pytest

LAYERS = 2  # tests/tiny_models.py's Llama


@pytest.fixture(scope="module")
def cuda_build(checkpoint, tmp_path_factory):
    import tvm_llm

    out = str(tmp_path_factory.mktemp("cuda_graph") / "out")
    tvm_llm.build(checkpoint("llama"), out, target="cuda", arch="sm_90", max_batch_size=4,
                  prefill_chunk_size=64, context_window=128, log=lambda *a: None)
    with open(os.path.join(out, "manifest.json")) as f:
        return out, json.load(f)


def test_decode_is_captured_per_region_between_attention_calls(cuda_build):
    _, manifest = cuda_build
    total = manifest["report"]["phases"][-1]
    capture = total["decode_graph_capture"]
    # the embedding lookup; the RoPE tables and the first layer up to its attention; then one
    # region after each layer's attention call
    assert capture["regions"] == LAYERS + 2, capture
    # outside: the kernels reading the token ids and the positions, one attention per layer,
    # and the LM head (it writes the returned logits, allocated per call)
    assert capture["uncaptured_kernels"] == LAYERS + 3, capture
    assert capture["captured_kernels"] > 4 * capture["uncaptured_kernels"], capture
    assert capture["captured_kernels"] + capture["uncaptured_kernels"] == total["decode_kernels"]
    assert manifest["target"]["graph_capture"] == "cuda_graph"


def test_library_calls_the_graph_capture_builtins(cuda_build):
    out, _ = cuda_build
    with open(os.path.join(out, "model.so"), "rb") as f:
        lib = f.read()
    # the VM bytecode names the packed functions it calls
    assert b"vm.builtin.cuda_graph.run_or_capture" in lib
    assert b"vm.builtin.cuda_graph.get_cached_alloc" in lib
    assert b"decode_cuda_graph_capture" in lib
    assert b"prefill_cuda_graph_capture" not in lib


def test_llvm_and_rocm_do_not_capture():
    """TVM 0.27's runtime has CUDA Graph builtins only (no hipGraph counterpart)."""
    from tvm_llm.targets import get_target

    assert get_target("llvm").graph_capture_passes() == []
    assert get_target("rocm").graph_capture_passes() == []
    assert "relax.backend.use_cuda_graph" not in get_target("rocm").pass_context_config()


def test_environment_switches_graphs_off(monkeypatch):
    from tvm_llm.targets import get_target

    assert len(get_target("cuda").graph_capture_passes()) == 2
    monkeypatch.setenv("TVM_LLM_CUDA_GRAPH", "0")
    spec = get_target("cuda")
    assert spec.graph_capture_passes() == []
    assert spec.pass_context_config()["relax.backend.use_cuda_graph"] is False
    assert spec.describe()["graph_capture"] == "off"
