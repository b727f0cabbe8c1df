"""AMX-BF16 GEMM kernel (schedules/cpu/amx_bf16.py): exact enough for every row count on a CPU
with AMX, and AMX instructions in its code on any x86 build machine."""
from __future__ import annotations

import numpy as np
import pytest
import tvm

from schedules.cpu import amx_bf16
from tvm_llm.targets import get_target
from cpu_workloads import amx_skip_reason


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
    reason = amx_skip_reason()
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


def _linear_with_residual(K, N):
    """y = x (bf16) @ w (bf16)^T + r (float32): a prefill linear with an epilogue, the shape the
    GEMM rule hands to the AMX path, its decode twin reading the same weight."""
    from tvm import relax

    import cpu_workloads as workloads

    bb = relax.BlockBuilder()
    n, b = tvm.tirx.Var("n", "int64"), tvm.tirx.Var("b", "int64")
    for name, shape in (("prefill", (1, n, K)), ("decode", (b, 1, K))):
        w = relax.Var("w", relax.TensorType((N, K), "bfloat16"))
        x = relax.Var("x", relax.TensorType(shape, "bfloat16"))
        r = relax.Var("r", relax.TensorType(shape[:2] + (N,), "float32"))
        with bb.function(name, [x, r, w], attrs={"num_input": 2}):
            with bb.dataflow():
                y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w), out_dtype="float32"))
                z = bb.emit_output(relax.op.add(y, r))
            bb.emit_func_output(z)
    return relax.transform.AttachAttrLayoutFreeBuffers()(workloads.lower_to_tir(bb.get()))


def _compile_model(target, K=256, N=512):
    from tvm import relax

    from schedules.cpu import cpu_schedule_pass
    from schedules.cpu.prepack import prepack_passes

    mod = _linear_with_residual(K, N)
    with target:
        mod = cpu_schedule_pass()(mod)
        for p in prepack_passes():
            mod = p(mod)
    ex = tvm.compile(mod, target=target)
    return mod, ex


def _kernels(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


def test_gemm_rule_puts_prefill_on_amx_and_decode_on_vdpbf16ps():
    """Compiled for sapphirerapids (AMX), not run: the prefill kernel calls the AMX block, the
    decode kernel stays the vdpbf16ps GEMV, and both read one packed weight (one prepack)."""
    target = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu",
                                "mcpu": "sapphirerapids", "num-cores": 2})
    mod, ex = _compile_model(target)
    kernels = _kernels(mod)
    amx = [k for k, f in kernels.items() if amx_bf16.LLVM_FUNC in f.script()]
    assert len(amx) == 1 and "decode" not in amx[0], amx
    assert len([k for k in kernels if k.endswith("_weight_prepack")]) == 1, sorted(kernels)
    code = "".join(m.inspect_source("asm") for m in [ex.mod, *ex.mod.imports] if m.kind == "llvm")
    assert code.count("tdpbf16ps") >= 6 and "vdpbf16ps" in code
    # the same build for an AVX512-BF16 CPU without AMX: no tile code at all
    _, ex4 = _compile_model(tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu",
                                               "mcpu": "znver4", "num-cores": 2}))
    code4 = "".join(m.inspect_source("asm") for m in [ex4.mod, *ex4.mod.imports]
                    if m.kind == "llvm")
    assert "tdpbf16ps" not in code4 and "vdpbf16ps" in code4


def test_amx_prefill_kernel_matches_numpy_with_its_epilogue():
    """The model-level kernel on this CPU (prefill on AMX with the residual add after it, decode
    on vdpbf16ps), for full, partial and single-row blocks, against numpy on the same bf16
    values (tolerance as test_amx_gemm_matches_numpy: float32 summation in another order)."""
    reason = amx_skip_reason()
    if reason:
        pytest.skip(reason)
    import ml_dtypes
    from tvm import relax

    import cpu_workloads as workloads

    K, N = 256, 512
    mod, ex = _compile_model(workloads.host_target(), K, N)
    assert any(amx_bf16.LLVM_FUNC in f.script() for f in _kernels(mod).values())
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(1)
    w = rng.standard_normal((N, K)).astype(ml_dtypes.bfloat16)
    wp = vm["transform_params"]([tvm.runtime.tensor(w)])
    for fn, shape in [("prefill", (1, m)) for m in (1, 7, 32, 45, 100)] + [("decode", (3, 1))]:
        x = rng.standard_normal(shape + (K,)).astype(ml_dtypes.bfloat16)
        r = rng.standard_normal(shape + (N,)).astype(np.float32)
        out = vm[fn](tvm.runtime.tensor(x), tvm.runtime.tensor(r), *wp).numpy()
        ref = x.astype(np.float32) @ w.astype(np.float32).T + r
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4, err_msg=f"{fn} {shape}")
