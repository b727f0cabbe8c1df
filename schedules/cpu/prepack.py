"""Build integration of packed weights (the GEMM rule's ``Bp[N/PN, K, PN]`` layout).

The GEMM rule packs a weight only when the build marked it layout-free: the kernel then
starts with a "layout rewrite" block (annotated ``meta_schedule.layout_rewrite_preproc``) that
copies W into the packed buffer. Run per call, that copy would triple decode's memory traffic,
so the build must move it to build time (tvm_llm/targets/llvm.py runs these steps):

1. before the scheduling pass (after FuseTIR): :class:`MarkWeightsLayoutFree` marks the
   PrimFunc parameters that are model weights (Relax function parameters past
   ``num_input``), attribute ``layout_free_buffers`` (TVM's AttachAttrLayoutFreeBuffers, in
   place and for our rules' kernels only). Without it the rules never repack (decode then
   uses the GEMV rule over the row-major weight; prefill too, slower than packed);
2. the scheduling pass (``cpu_schedule_pass``);
3. after it, :func:`prepack_passes`: :class:`SplitLayoutRewritePreprocAnyBody` (TVM's
   SplitLayoutRewritePreproc on the kernels with a layout-rewrite block only; splits each
   kernel into ``<kernel>_weight_prepack`` + ``<kernel>_prepacked`` and calls both from
   Relax), :class:`DedupPrimFuncs` (prefill's and decode's prepack functions of the same
   weight are identical: give them one GlobalVar), then :func:`LiftPackedWeights`
   (LiftTransformParams shared by the model functions) — the packing becomes part of one
   ``transform_params`` and the model functions take the packed weights;
4. run that ``transform_params`` once at build time (after the one from the folding phase,
   i.e. on its outputs) and save its outputs as the model's weights. The original row-major
   weight is then dead: packing does not double the weights' memory.

Packed layouts depend on the target's vector width (PN = 48/64 floats on AVX-512, 16 on
AVX2/NEON): weights are packed for the target they were built for.
"""
from __future__ import annotations

import tvm
from tvm import relax, tirx


def prepack_passes() -> list:
    """Relax passes to run right after the scheduling pass so the packing is lifted out of the
    model functions into a shared ``transform_params`` (what CPU builds run)."""
    return [SplitLayoutRewritePreprocAnyBody(), DedupPrimFuncs(), LiftPackedWeights(),
            DropSplitOriginals()]


@tvm.transform.module_pass(opt_level=0, name="AttachAttrLayoutFreeBuffers")
class MarkWeightsLayoutFree:
    """Marks the kernel parameters that receive model weights (``layout_free_buffers``: what
    TVM's AttachAttrLayoutFreeBuffers does), for the kernels our rules schedule only, and in
    place: TVM's pass copies and renames kernels, and its copy of the hand-written W4A8 kernel
    no longer compiled ("variables are used, but are not passed in as API arguments").
    Weights are the Relax parameters past ``num_input``; a kernel called from several places
    gets the positions that hold a weight at every call."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        from tvm import s_tir  # pylint: disable=import-outside-toplevel

        call_tir = tvm.ir.Op.get("relax.call_tir")
        marks: dict = {}
        for _, func in mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs is None \
                    or "num_input" not in func.attrs:
                continue
            weights = set(func.params[int(func.attrs["num_input"]):])

            def visit(expr, weights=weights):
                if isinstance(expr, relax.Call) and expr.op.same_as(call_tir):
                    args = expr.args[1].fields if isinstance(expr.args[1], relax.Tuple) else []
                    idx = {i for i, a in enumerate(args) if a in weights}
                    gv = expr.args[0]
                    marks[gv] = idx if gv not in marks else marks[gv] & idx

            relax.analysis.post_order_visit(func.body, visit)
        out = mod
        for gv, idx in marks.items():
            func = mod[gv] if gv in mod.get_global_vars() else None
            if not isinstance(func, tirx.PrimFunc) or not idx:
                continue
            if bool((func.attrs or {}).get("tirx.is_scheduled", False)) \
                    or not isinstance(func.body, s_tir.SBlockRealize):
                continue  # hand-written: our rules do not schedule it
            if out is mod:
                out = mod.clone()
            out.update_func(gv, func.with_attr("layout_free_buffers",
                                               [tvm.tirx.IntImm("int32", i) for i in sorted(idx)]))
        return out


def LiftPackedWeights(model_functions=("prefill", "decode", "hidden_states")):
    """LiftTransformParams shared by those of `model_functions` the module has; nothing when
    it has none (a lone kernel scheduled for measurement: TVM's pass fails on an empty list)."""

    def transform(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        names = {gv.name_hint for gv in mod.get_global_vars()}
        present = [f for f in model_functions if f in names]
        if not present:
            return mod
        return relax.transform.LiftTransformParams(shared_transform=present)(mod)

    return tvm.transform.module_pass(transform, opt_level=0, name="LiftTransformParams")


@tvm.transform.module_pass(opt_level=0, name="SplitLayoutRewritePreproc")
class SplitLayoutRewritePreprocAnyBody:
    """TVM's SplitLayoutRewritePreproc on the kernels that have a layout-rewrite block only:
    TVM's pass walks every PrimFunc and fails on those whose body is not a root block with
    compute blocks under it (the paged KV cache's hand-written TIR, our attention kernels).
    The others leave the module for the pass and come back unchanged."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        keep, aside = {}, {}
        for gv, f in mod.functions_items():
            if isinstance(f, tirx.PrimFunc) and "meta_schedule.layout_rewrite_preproc" not in f.script():
                aside[gv] = f
            else:
                keep[gv] = f
        if len(aside) == len([f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]):
            return mod  # nothing to split
        out = relax.transform.SplitLayoutRewritePreproc()(tvm.IRModule(keep, attrs=mod.attrs))
        for gv, f in aside.items():
            out[gv] = f
        return out


@tvm.transform.module_pass(opt_level=0, name="DedupPrimFuncs")
class DedupPrimFuncs:
    """Replace structurally equal PrimFuncs by one GlobalVar (calls are redirected), so that
    identical weight-packing calls in several Relax functions become one shared expression."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        import tvm_ffi  # pylint: disable=import-outside-toplevel

        prims = [(gv, f) for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
        canon: list = []
        remap = {}
        for gv, f in sorted(prims, key=lambda p: p[0].name_hint):
            body = f.without_attr("global_symbol") if f.attrs and "global_symbol" in f.attrs else f
            for cgv, cbody in canon:
                if tvm_ffi.structural_equal(body, cbody):
                    remap[gv] = cgv
                    break
            else:
                canon.append((gv, body))
        if not remap:
            return mod

        @relax.expr_functor.mutator
        class _Redirect(relax.PyExprMutator):
            def visit_call_(self, call):  # pylint: disable=arguments-renamed
                call = super().visit_call_(call)
                if call.args and isinstance(call.args[0], tvm.ir.GlobalVar) and call.args[0] in remap:
                    args = [remap[call.args[0]]] + list(call.args[1:])
                    return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)
                return call

        new_funcs = {}
        for gv, f in mod.functions_items():
            if gv in remap:
                continue
            if isinstance(f, relax.Function):
                f = _Redirect().visit_expr(f)
            new_funcs[gv] = f
        return tvm.IRModule(new_funcs, attrs=mod.attrs)


@tvm.transform.module_pass(opt_level=0, name="DropSplitOriginals")
class DropSplitOriginals:
    """Remove each kernel that SplitLayoutRewritePreproc split (``<k>`` beside
    ``<k>_prepacked``) once no Relax function refers to it any more. TVM's pass leaves the
    original in the module, so codegen compiled a dead copy of every packed matmul, packing
    loop included; with bfloat16 weights on vdpbf16ps that copy does not even compile (its
    packed panel is a bfloat16 buffer allocated inside the kernel, which TVM's
    BF16ComputeLegalize turns into float32 storage under the instruction's bf16 operands)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        names = {gv.name_hint for gv in mod.get_global_vars()}
        used = set()

        def visit(expr):
            if isinstance(expr, tvm.ir.GlobalVar):
                used.add(expr.name_hint)

        for _, f in mod.functions_items():
            if isinstance(f, relax.Function):
                relax.analysis.post_order_visit(f.body, visit)
        dead = [gv for gv, f in mod.functions_items()
                if isinstance(f, tirx.PrimFunc) and f"{gv.name_hint}_prepacked" in names
                and gv.name_hint not in used]
        if not dead:
            return mod
        return tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv not in dead},
                            attrs=mod.attrs)
