"""CPU builds read the float linear weights as packed panels (schedules/cpu/gemm.py), packed
once at build time: the saved weights have the panel layout, and the logits still match
transformers (tests/test_end_to_end.py runs the same builds through every architecture)."""
from __future__ import annotations

import json
import os

from schedules.cpu import common
from schedules.cpu.gemm import packed_panel_width
from tvm_llm.targets import get_target


def test_float_linears_are_packed_at_build_time(built):
    out = built("llama")
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    shapes = {p["name"]: p["shape"] for p in manifest["params"]}
    packed = [s for s in shapes.values() if len(s) == 3]
    # q/k/v, o, gate/up, down per layer (merged linears) and the lm_head: all packed
    layers = manifest["model"]["num_layers"]
    assert len(packed) >= 4 * layers + 1, shapes
    target = get_target("llvm").tvm_target()
    lanes = common.vector_lanes(target)
    for no, k, pn in packed:
        assert pn % lanes == 0 and pn == packed_panel_width(target, no * pn, k)
    assert shapes["model.embed_tokens.weight"] == [manifest["model"]["vocab_size"],
                                                   manifest["model"]["num_heads"]
                                                   * manifest["model"]["head_dim"]]
