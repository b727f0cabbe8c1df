"""Checking GPU schedule rules on a machine without a GPU.

A rule built with `tensorize=False` keeps its whole loop structure (block tiles, warp tiles,
padding, predicates, fragment layouts, fused epilogue) while every block computes what the
tensor intrinsics' descriptions say. `build_serial_on_cpu` turns the GPU thread bindings into
plain loops and compiles the result for the host CPU: shared and warp buffers become ordinary
arrays, each thread's work runs in turn, and cooperative loads are merely repeated, so the
result equals the GPU's whenever the tiling is right. A wrong split, a missing tail predicate
or a bad index shows up as a wrong number.

Build the GEMM rule with `narrow=False` for these runs: serialised, its shared tiles are
compacted over the whole symbolic extent, which int32 index arithmetic cannot bound.
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
    """`func` with every thread-bound loop made a serial loop. Software pipelines stay (their
    double-buffered indexing is checked), with synchronous copies: the CPU has no cp.async."""

    def unbind(loop):
        annotations = {k: v for k, v in loop.annotations.items()
                       if k != "software_pipeline_async_stages"}
        if loop.kind == tirx.ForKind.THREAD_BINDING or len(annotations) != len(loop.annotations):
            kind = tirx.ForKind.SERIAL if loop.kind == tirx.ForKind.THREAD_BINDING else loop.kind
            return tirx.For(loop.loop_var, loop.min, loop.extent, kind, loop.body, None,
                            annotations)
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


def kv_cache_module(spec, dtype: str = "float16", num_layers: int = 2, num_heads: int = 4,
                    num_kv_heads: int = 2, head_dim: int = 64):
    """A module with one function, `create_paged_kv_cache`, that builds the paged KV cache
    (TVM's TIRPagedKVCache with the kernels the target spec replaces) as the frontend adds it
    to a model."""
    from tvm_llm.frontend.relax_import import AttentionShape, add_kv_cache_creation

    attn = AttentionShape(num_layers, num_heads, num_kv_heads, head_dim, head_dim,
                          [head_dim ** -0.5] * num_layers)
    return add_kv_cache_creation(tvm.IRModule(), attn, dtype, spec)


def build_with_target_spec(mod, spec):
    """Lower, schedule (spec.schedule_passes) and compile a Relax module as the build does."""
    from tvm import relax

    target = spec.tvm_target()
    with target, tvm.transform.PassContext(opt_level=3, config=spec.pass_context_config()):
        mod = tvm.transform.Sequential([
            relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR(),
            *spec.schedule_passes()])(mod)
        return tvm.compile(mod, target=target, tir_pipeline=spec.tir_pipeline())
