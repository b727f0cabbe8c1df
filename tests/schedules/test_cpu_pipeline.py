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


def test_partial_row_tile_runs_without_branches():
    """A symbolic M leaves a partial last row tile (21 rows = two 8-row tiles and 5 rows).
    After the pipeline, neither k loop of the micro-kernel (full tiles, partial tile) holds a
    branch: the partial tile's rows past n read x as 0 (row_tile_loops); the result is exact
    for every row count, one row included."""
    from tvm import tirx
    from tvm.s_tir.pipeline import default_s_tir_pipeline
    from tvm.tirx.compilation_pipeline import register_tir_pipeline

    from schedules.cpu import pipeline

    seen = []

    def record(func, _mod, _ctx):
        seen.append(func)
        return func

    def probe():
        passes, host, device = default_s_tir_pipeline()
        return tvm.transform.Sequential([
            passes, pipeline.keep_tiles_on_stack(), pipeline.row_tile_loops(),
            tirx.transform.prim_func_pass(record, opt_level=0, name="Record")]), host, device

    register_tir_pipeline("tvm_llm_cpu_probe", probe)
    mod, ex = _build("tvm_llm_cpu_probe")
    k_loops = []

    def visit(st):
        if isinstance(st, tirx.For) and int(getattr(st.extent, "value", 0)) == 96:
            k_loops.append([type(s).__name__ for s in getattr(st.body, "seq", [st.body])])
        return st

    for func in seen:
        if "prepacked" in str(func.attrs.get("global_symbol", "")):
            pipeline._rewrite(func.body, visit)
    assert len(k_loops) == 2, k_loops  # the full tiles' loop and the partial tile's
    for body in k_loops:
        assert "IfThenElse" not in body and body.count("BufferStore") == 24, body
    for m in (21, 1, 8, 5):
        got, ref = _run(mod, ex, M=m)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
