"""schedules/cpu/pipeline.py: the build's CPU TIR pipeline keeps a register tile over 1 KiB on
the stack (LLVM then holds it in registers), where TVM's default pipeline makes it a workspace
allocation; the kernel's result is the same."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

import cpu_workloads as workloads
from schedules.cpu import cpu_rules
from schedules.cpu.gemm import GEMM
from schedules.cpu.pipeline import TILE_STACK_BYTES, cpu_tir_pipeline


def _build(pipeline, K=96, N=96, tile=(8, 3)):
    """A prefill linear over packed panels at register tile `tile` (8x3 x 16 floats: 1.5 KiB)."""
    from tvm.s_tir import dlight as dl

    target = workloads.host_target(2)
    mod = workloads.linear_suite([dict(name="f", K=K, N=N, mode="prefill")])
    rules = [GEMM(tile=tile) if isinstance(r, GEMM) else r for r in cpu_rules()]
    with target:
        mod = relax.transform.AttachAttrLayoutFreeBuffers()(mod)
        mod = dl.ApplyDefaultSchedule(*rules)(mod)
        mod = relax.transform.SplitLayoutRewritePreproc()(mod)
        mod = relax.transform.LiftTransformParams()(mod)
    ex = tvm.compile(mod, target=target, tir_pipeline=pipeline)
    return mod, ex


def _run(mod, ex, K=96, N=96, M=21):
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, M, K)).astype("float32")
    w = rng.standard_normal((N, K)).astype("float32")
    lifted = [str(g.name_hint) for g in mod.functions if str(g.name_hint).endswith("transform_params")]
    params = vm[lifted[0]]([tvm.runtime.tensor(w)])
    return vm["f"](tvm.runtime.tensor(x), *params).numpy(), x @ w.T


def test_tile_over_1kib_stays_on_the_stack():
    assert 8 * 3 * 16 * 4 <= TILE_STACK_BYTES
    mod, ours = _build(cpu_tir_pipeline())
    _, default = _build("default")
    asm_ours = ours.mod.imports[0].inspect_source("asm")
    asm_default = default.mod.imports[0].inspect_source("asm")
    assert "TVMBackendAllocWorkspace" in asm_default  # TVM's 1 KiB limit
    assert "TVMBackendAllocWorkspace" not in asm_ours
    got, ref = _run(mod, ours)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
