"""TVM's paged KV cache kernels (attention, append, copy) build and link for our ROCm targets."""
from __future__ import annotations

import re

import pytest


@pytest.mark.parametrize("arch", ["gfx90a", "gfx942"])
def test_paged_kv_cache_module_builds_for_rocm(arch):
    from schedules.cuda.verify import build_with_target_spec, kv_cache_module
    from tvm_llm.targets import get_target

    spec = get_target("rocm", arch=arch)
    ex = build_with_target_spec(kv_cache_module(spec.tvm_target(), "float16"), spec)
    (hip,) = [m for m in ex.mod.imports[0].imports if m.kind == "hip"]
    asm = hip.inspect_source("asm")
    assert len(re.findall(r"^\s*\.amdhsa_kernel ", asm, re.M)) >= 5
    assert re.search(rf'\.amdgcn_target "amdgcn-amd-amdhsa-[\w-]*{arch}"', asm)
