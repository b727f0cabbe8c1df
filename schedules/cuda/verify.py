"""Checking GPU schedule rules on a machine without a GPU.

A rule built with `tensorize=False` keeps its whole loop structure (block tiles, warp tiles,
padding, predicates, fragment layouts, fused epilogue) while every block computes what the
tensor intrinsics' descriptions say. `build_serial_on_cpu` turns the GPU thread bindings into
plain loops and compiles the result for the host CPU: shared and warp buffers become ordinary
arrays, each thread's work runs in turn, and cooperative loads are merely repeated, so the
result equals the GPU's whenever the tiling is right. A wrong split, a missing tail predicate
or a bad index shows up as a wrong number.
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx


def lower_for_scheduling(mod):
    """The build's lowering before scheduling: NT-matmul fusion, legalization, FuseOps/FuseTIR."""
    from tvm import relax

    return tvm.transform.Sequential([
        relax.transform.FuseTransposeMatmul(), relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
        relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)


def serialize_threads(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with every thread-bound loop made a serial loop."""

    def unbind(loop):
        if loop.kind == tirx.ForKind.THREAD_BINDING:
            return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, loop.body,
                            None, loop.annotations)
        return loop

    return tvm_ffi.structural_map(func, [(tirx.For, unbind)])


def build_serial_on_cpu(func: tirx.PrimFunc):
    """Compile a GPU-scheduled (untensorized) PrimFunc for the host CPU, threads serialised."""
    mod = tvm.IRModule({"main": serialize_threads(func).with_attr("global_symbol", "main")})
    return tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))


def run_on_cpu(func: tirx.PrimFunc, inputs: list, out_shapes: list, out_dtypes: list) -> list:
    """Run `func` (inputs then outputs, as in a call_tir kernel) on the CPU; return the outputs."""
    import numpy as np

    ex = build_serial_on_cpu(func)
    outs = [tvm.runtime.tensor(np.zeros(s, d)) for s, d in zip(out_shapes, out_dtypes)]
    ex["main"](*[tvm.runtime.tensor(a) for a in inputs], *outs)
    return [o.numpy() for o in outs]
