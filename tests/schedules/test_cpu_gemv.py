"""CPU GEMV rule (row-major weights, decode): numerics, claims, aarch64 NEON code."""
from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax

import cpu_workloads as workloads
from schedules.cpu import cpu_schedule_pass
from schedules.cpu.gemv import GEMV
from cpu_workloads import host_target, reference_linear


# K not a multiple of the SIMD width (67, 100), N not of the row block (37, 100)
SPECS = [
    ("d_none", 64, 96, "decode", None),
    ("d_bias", 67, 37, "decode", "bias"),
    ("d_residual", 100, 100, "decode", "residual"),
    ("d_silu_mul", 72, 200, "decode", "silu_mul"),
    ("p_silu", 80, 96, "prefill", "silu"),
    ("p_none", 67, 37, "prefill", None),
]


@pytest.fixture(scope="module")
def gemv_vm():
    """The weights are not marked layout-free: every NT matmul goes to the GEMV rule."""
    mod = workloads.linear_suite([dict(name=n, K=k, N=nn, mode=m, epilogue=e)
                                  for n, k, nn, m, e in SPECS])
    target = host_target()
    with target:
        mod = cpu_schedule_pass()(mod)
    funcs = workloads.prim_funcs(mod)
    return relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu()), funcs


def test_all_kernels_scheduled(gemv_vm):
    _, funcs = gemv_vm
    assert funcs and all(bool(f.attrs.get("tirx.is_scheduled", False)) for f in funcs.values())
    assert not any("layout_rewrite_preproc" in f.script() for f in funcs.values())


@pytest.mark.parametrize("name,K,N,mode,epilogue", SPECS)
def test_numerics(gemv_vm, name, K, N, mode, epilogue):
    vm, _ = gemv_vm
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((N, K)).astype("float32")
    bias = rng.standard_normal((N,)).astype("float32")
    ms = (1, 3) if mode == "decode" else (1, 7, 129)
    for M in ms:
        xs = (M, 1, K) if mode == "decode" else (1, M, K)
        x = rng.standard_normal(xs).astype("float32")
        acts, weights, extra = [x], [w], None
        if epilogue == "bias":
            extra = bias
            weights.append(bias)
        elif epilogue in ("residual", "silu_mul"):
            extra = rng.standard_normal(xs[:-1] + (N,)).astype("float32")
            acts.append(extra)
        out = vm[name](*[tvm.runtime.tensor(a, dev) for a in acts + weights]).numpy()
        np.testing.assert_allclose(out, reference_linear(x, w, epilogue, extra), rtol=2e-4, atol=2e-3)


def test_claims():
    target = host_target()
    dec = workloads.single_prim_func(workloads.linear(64, 96, "decode", "residual"))
    assert GEMV().apply(dec, target, False) is not None
    add = workloads.single_prim_func(workloads.elementwise(64, op="add"))
    assert GEMV().apply(add, target, False) is None
    sm = workloads.single_prim_func(workloads.softmax(64))
    assert GEMV().apply(sm, target, False) is None
    nn = workloads.single_prim_func(workloads.linear(64, 96, "decode", None, layout="NN"))
    assert GEMV().apply(nn, target, False) is None  # (K, N) weights go to the GEMM rule


def test_symbolic_batch_decode_not_claimed_by_dlight():
    """The motivation: dlight's own CPU GEMV leaves a symbolic-batch decode matmul alone."""
    from tvm.s_tir import dlight as dl

    dec = workloads.single_prim_func(workloads.linear(64, 96, "decode", None))
    assert dl.cpu.GEMV().apply(dec, host_target(), False) is None
    assert GEMV().apply(dec, host_target(), False) is not None


def test_aarch64_neon_fmla():
    arm = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]})
    mod = workloads.linear_suite([dict(name="d", K=64, N=96, mode="decode", epilogue="bias")])
    with arm:
        mod = cpu_schedule_pass()(mod)
    assert all(bool(f.attrs.get("tirx.is_scheduled", False))
               for f in workloads.prim_funcs(mod).values())
    asm = tvm.compile(mod, target=arm).mod.imports[0].inspect_source("asm")
    assert len(re.findall(r"\bfmla\s+v\d+\.4s", asm)) >= 8
