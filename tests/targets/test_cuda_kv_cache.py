"""TVM's paged KV cache kernels (attention, append, copy) build for our CUDA targets."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_paged_kv_cache_module_builds_for_cuda(arch):
    from schedules.cuda.verify import build_with_target_spec, kv_cache_module
    from tvm_llm.targets import get_target
    from tvm_llm.targets.cuda import _device_modules

    spec = get_target("cuda", arch=arch)
    ex = build_with_target_spec(kv_cache_module(spec.tvm_target(), "float16"), spec)
    (cuda,) = [m for m in _device_modules(ex.mod) if m.kind == "cuda"]
    src = cuda.inspect_source("cuda")
    assert src.count("__global__") >= 5            # the cache's attention and copy kernels
    if arch == "sm_90":                            # nvcc accepts them (one arch is enough)
        assert ".target sm_90" in spec.compile_ptx(src)
