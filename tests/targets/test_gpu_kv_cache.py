"""The paged KV cache's kernels (attention, append, copy) build for our GPU targets: CUDA
device code nvcc accepts, ROCm code objects linked for the named arch."""
from __future__ import annotations

import re

import pytest


def _cuda_checks(spec, ex, arch):
    from tvm_llm.targets.cuda import _device_modules

    (cuda,) = [m for m in _device_modules(ex.mod) if m.kind == "cuda"]
    src = cuda.inspect_source("cuda")
    assert src.count("__global__") >= 5            # the cache's attention and copy kernels
    if arch == "sm_90":                            # nvcc accepts them (one arch is enough)
        assert ".target sm_90" in spec.compile_ptx(src)


def _rocm_checks(spec, ex, arch):
    (hip,) = [m for m in ex.mod.imports[0].imports if m.kind == "hip"]
    asm = hip.inspect_source("asm")
    assert len(re.findall(r"^\s*\.amdhsa_kernel ", asm, re.M)) >= 5
    assert re.search(rf'\.amdgcn_target "amdgcn-amd-amdhsa-[\w-]*{arch}"', asm)


@pytest.mark.parametrize("kind,arch", [("cuda", "sm_80"), ("cuda", "sm_90"),
                                       ("rocm", "gfx90a"), ("rocm", "gfx942")])
def test_paged_kv_cache_module_builds_for_gpu(kind, arch):
    from gpu_verify import build_with_target_spec, kv_cache_module
    from tvm_llm.targets import get_target

    spec = get_target(kind, arch=arch)
    ex = build_with_target_spec(kv_cache_module(spec, "float16"), spec)
    {"cuda": _cuda_checks, "rocm": _rocm_checks}[kind](spec, ex, arch)
