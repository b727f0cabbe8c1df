"""bfloat16 weight matmuls on vdpbf16ps (schedules/cpu/bf16_dot.py): the kernel's exact
numerics, the instruction in the code for an AVX512-BF16 CPU and not for an AVX2 one, and the
target's CPU-feature probe (bf16 kernel choice, AMX check)."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from schedules.cpu import cpu_schedule_pass
import cpu_workloads as workloads
from tvm_llm.targets.llvm import LLVMTarget, host_cpu_flags

K, N = 64, 96  # N a multiple of the panel width (48 on znver4), K even


def _bf16_linear_f32_out():
    """y (float32) = x (bf16) @ w (bf16)^T, the matmul AccumulateHalfMatmulInFloat32 leaves."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((1, n, K), "bfloat16"))
    w = relax.Var("w", relax.TensorType((N, K), "bfloat16"))
    with bb.function("main", [x, w], attrs={"num_input": 1}):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w), out_dtype="float32"))
        bb.emit_func_output(y)
    return relax.transform.AttachAttrLayoutFreeBuffers()(workloads.lower_to_tir(bb.get()))


def _compile(target):
    mod = _bf16_linear_f32_out()
    with target:
        mod = cpu_schedule_pass()(mod)
        mod = relax.transform.SplitLayoutRewritePreproc()(mod)
        mod = relax.transform.LiftTransformParams()(mod)
    ex = tvm.compile(mod, target=target)
    asm = "".join(m.inspect_source("asm") for m in [ex.mod, *ex.mod.imports] if m.kind == "llvm")
    return ex, asm


def _x86(mcpu):
    return tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": mcpu,
                              "num-cores": 2})


def _without_amx(target):
    """The target with AMX switched off: an AMX CPU runs bf16 prefill on tiles
    (test_amx_bf16.py), and this file is about the vdpbf16ps kernel."""
    spec = {k: v for k, v in dict(target.export()).items() if k not in ("tag", "keys")}
    spec["mattr"] = list(spec.get("mattr", [])) + ["-amx-tile", "-amx-bf16", "-amx-int8"]
    return tvm.target.Target(spec)


def dpbf16ps_reference(x, w):
    """numpy model of vdpbf16ps summing x @ w.T: per pair of k, the odd product is added first,
    then the even one, each addition rounded to float32 (bf16 x bf16 products are exact in
    float32). Denormals, which the instruction flushes, do not occur with these inputs."""
    a, b = x.astype(np.float32), w.astype(np.float32)
    acc = np.zeros((a.shape[0], b.shape[0]), np.float32)
    for j in range(a.shape[1] // 2):
        for k in (2 * j + 1, 2 * j):
            acc = acc + np.outer(a[:, k], b[:, k]).astype(np.float32)
    return acc


@pytest.mark.skipif("avx512_bf16" not in host_cpu_flags(), reason="host has no AVX512-BF16")
def test_kernel_equals_numpy_model_of_the_instruction():
    import ml_dtypes

    ex, asm = _compile(_without_amx(workloads.host_target()))
    assert asm.count("vdpbf16ps") >= 12  # one 4x3 (or 7x2) register tile at least
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(0)
    w = rng.standard_normal((N, K)).astype(ml_dtypes.bfloat16)
    wp = vm["main_transform_params"]([tvm.runtime.tensor(w)])
    for n in (13, 1):  # full tiles and a partial one; decode's single row
        x = rng.standard_normal((1, n, K)).astype(ml_dtypes.bfloat16)
        out = vm["main"](tvm.runtime.tensor(x), *wp).numpy()[0]
        np.testing.assert_array_equal(out, dpbf16ps_reference(x[0], w), err_msg=f"n={n}")
        # and it is a float32-accumulated dot product: within float32 rounding of float64
        exact = x[0].astype(np.float64) @ w.astype(np.float64).T
        np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-4)


def test_vdpbf16ps_only_where_the_cpu_has_it():
    """Compiled, not run: znver4 and sapphirerapids (AVX512-BF16) get vdpbf16ps; an AVX2 part
    (x86-64-v3) and AVX-512 without BF16 (skylake-avx512) widen bf16 and use float32 FMAs."""
    for mcpu in ("znver4", "sapphirerapids"):
        _, asm = _compile(_without_amx(_x86(mcpu)))
        assert asm.count("vdpbf16ps") >= 12, mcpu
    for mcpu in ("x86-64-v3", "skylake-avx512"):
        _, asm = _compile(_x86(mcpu))
        assert "vdpbf16ps" not in asm, mcpu
        assert "vfmadd" in asm and "vpmovzxwd" in asm, mcpu


def test_target_probe_reports_bf16_kernel_and_amx():
    host = LLVMTarget(None).describe()["cpu_features"]
    flags = host_cpu_flags()
    assert host["bf16_matmul"] == ("vdpbf16ps" if "avx512_bf16" in flags else "widen+fma")
    amx = host["amx"]
    assert amx["cpu_flag"] == ("amx_bf16" in flags)
    assert amx["os_permission"] == "granted" or amx["os_permission"].startswith("refused")
    if "amx_bf16" not in flags:  # Linux refuses the tile state on a CPU without AMX
        assert amx["os_permission"] != "granted" and not amx["usable"]
    assert LLVMTarget("x86-64-v3").describe()["cpu_features"]["bf16_matmul"] == "widen+fma"
    spr = LLVMTarget("sapphirerapids").describe()["cpu_features"]
    assert spr["bf16_matmul"] == "vdpbf16ps" and spr["amx"]["llvm_feature"]
