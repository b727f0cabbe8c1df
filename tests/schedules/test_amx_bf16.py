"""AMX-BF16 GEMM kernel (schedules/cpu/amx_bf16.py): exact enough for every row count on a CPU
with AMX, and AMX instructions in its code on any x86 build machine."""
from __future__ import annotations

import numpy as np
import pytest
import tvm

from schedules.cpu import amx_bf16
from tvm_llm.targets import get_target
from tvm_llm.targets.llvm import host_cpu_flags, request_amx_permission


def _amx_skip_reason():
    if "amx_bf16" not in host_cpu_flags():
        return "host CPU has no amx_bf16 flag in /proc/cpuinfo"
    granted, why = request_amx_permission()  # must precede the first tile instruction
    return None if granted else f"Linux refused AMX tile state (arch_prctl): {why}"


def _build(K, N, PN=32, asm=True, target=None):
    func = amx_bf16.amx_bf16_matmul_func(K, N, PN, asm=asm).with_attr("global_symbol", "main")
    target = target or get_target("llvm").tvm_target()
    return tvm.compile(tvm.IRModule({"main": func}), target=target)


@pytest.mark.parametrize("K,N,PN", [(768, 768, 32), (768, 2048, 32), (96, 96, 48)])
def test_amx_gemm_matches_numpy(K, N, PN):
    """Against numpy float32 of the same bfloat16 values. bf16 x bf16 products are exact in
    float32, so the only error is the float32 summation over K, whose order AMX does not
    document: |err| <= K * 2^-24 * (|A| @ |W|^T) holds for any order (the classic gamma_K
    bound on the float64-exact value), and a misplaced row, column or k-pair would be far
    outside it (errors of the size of the entries themselves)."""
    reason = _amx_skip_reason()
    if reason:
        pytest.skip(reason)
    import ml_dtypes

    ex = _build(K, N, PN)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((N, K)).astype(ml_dtypes.bfloat16)
    bp = tvm.runtime.tensor(amx_bf16.pack_weight(w, PN))
    wf = w.astype(np.float64)
    for M in (1, 5, 16, 17, 31, 32, 33, 128):
        a = rng.standard_normal((M, K)).astype(ml_dtypes.bfloat16)
        c = tvm.runtime.tensor(np.full((M, N), np.nan, np.float32))
        ex(tvm.runtime.tensor(a), bp, c)
        out = c.numpy()
        exact = a.astype(np.float64) @ wf.T
        bound = K * 2.0 ** -24 * (np.abs(a.astype(np.float64)) @ np.abs(wf).T)
        assert np.all(np.abs(out - exact) <= bound), f"M={M}"
        np.testing.assert_allclose(out, a.astype(np.float32) @ w.astype(np.float32).T,
                                   rtol=1e-4, atol=1e-4, err_msg=f"M={M}")


@pytest.mark.parametrize("asm", [True, False])
def test_amx_instructions_in_code(asm):
    """Compiled, not run: the host target as it is (LLVM calls masked CPUs rocketlake, no AMX)
    takes the inline-assembly form; the intrinsics form needs AMX in the module's target."""
    target = get_target("llvm").tvm_target()
    ex = _build(768, 64, asm=asm, target=target if asm else amx_bf16.with_amx(target))
    code = ex.mod.inspect_source("asm")
    assert code.count("tdpbf16ps") >= 6 and "ldtilecfg" in code and "tilerelease" in code
