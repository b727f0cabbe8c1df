"""Kernel analysis shared by the GPU rules (schedules/cuda and schedules/rocm).

- `find_matmul`: the single reduction block of a fused kernel if it is a matmul
  C[S, I, J] += A[S, I, K] * B[S, J, K] (dlight's normalisation; B is W (N, K) for x @ W^T).
- `widen_accumulator`: make an fp16/bf16 matmul accumulate in fp32 (tensor cores and MFMA
  accumulate in fp32; so does torch), casting back where the result is read.
- `AnnotateSymbolicBounds`: copies each Relax function's `tir_var_upper_bound` onto the
  PrimFuncs it calls, so a rule can tell decode (batch <= 8) from prefill (n <= chunk).
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import get_index_map, get_reduction_blocks

from ..fallbacks import SCHEDULE_ERRORS, left_to_next_rule

BOUND_ATTR = "tir_var_upper_bound"


@dataclass
class Matmul:
    block: s_tir.schedule.SBlockRV
    name: str
    a_dtype: str
    b_dtype: str
    out_dtype: str
    k_contiguous: bool    # both operands are read along K in their innermost axis (x @ W^T)


def _load_of(expr):
    """The BufferLoad under an optional Cast, else None."""
    if isinstance(expr, tirx.Cast):
        expr = expr.value
    return expr if isinstance(expr, tvm.ir.TensorLoad) else None


def _product_operands(block: s_tir.SBlock):
    """(a, b) loads of a `C[...] = C[...] + a * b` block body, else None."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Add):
        return None
    acc, prod = store.value.a, store.value.b
    if not (isinstance(acc, tvm.ir.TensorLoad) and acc.source.same_as(store.buffer)):
        return None
    if not isinstance(prod, tirx.Mul):
        return None
    a, b = _load_of(prod.a), _load_of(prod.b)
    if a is None or b is None:
        return None
    return a, b


def find_matmul(sch: s_tir.Schedule) -> Matmul | None:
    """The kernel's matmul block if it has exactly one reduction and that is a plain GEMM."""
    blocks = sch.get_child_blocks(get_root_block(sch))
    reductions = get_reduction_blocks(sch, blocks)
    if not reductions:
        return None
    block = reductions[0]
    stmt = sch.get(block)
    operands = _product_operands(stmt)
    if operands is None or get_index_map(stmt) is None:
        return None
    a, b = operands
    reduce_vars = [iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]

    def k_innermost(load):
        last = load.indices[-1]
        return len(reduce_vars) == 1 and isinstance(last, tirx.Var) and last.same_as(reduce_vars[0])

    return Matmul(block, stmt.name_hint, str(a.source.dtype), str(b.source.dtype),
                  str(stmt.body.buffer.dtype), k_innermost(a) and k_innermost(b))


def normalize_matmul(sch: s_tir.Schedule, main) -> None:
    """Bring the matmul block `main` to C[S, I, J] += A[S, I, K] * B[S, J, K] (dlight's
    reindex: each operand through a reindex block, the block's iterators fused to S, I, J, K)."""
    reindex_a = sch.reindex(main, ("read", 0))
    reindex_b = sch.reindex(main, ("read", 1))
    reindex_c = sch.reindex(main, ("write", 0))
    matmul_map, a_map, b_map, c_map = get_index_map(sch.get(main))
    sch.transform_layout(reindex_a, ("write", 0), a_map)
    sch.transform_layout(reindex_b, ("write", 0), b_map)
    sch.transform_layout(reindex_c, ("read", 0), c_map)
    sch.transform_block_layout(main, matmul_map)


def widen_accumulator(func: tirx.PrimFunc, block_name: str, acc_dtype: str = "float32"):
    """`func` with the matmul block accumulating in `acc_dtype`; readers of its result get a
    cast back to the original dtype. Returns (func, whether anything changed)."""
    sch = s_tir.Schedule(func)
    block = sch.get_sblock(block_name)
    stmt = sch.get(block)
    if str(stmt.body.buffer.dtype) == acc_dtype:
        return func, False
    if any(stmt.body.buffer.same_as(param) for param in func.params):
        # the result is an output: accumulate into a new intermediate that is copied out
        sch.cache_write(block, 0, "global")
    sch.unsafe_set_dtype(block, 0, acc_dtype)  # retypes the buffer, casts at every access

    def rebuild(blk):
        if blk.name_hint != block_name:
            return blk
        store = blk.body
        a, b = _product_operands(stmt)
        acc = tirx.BufferLoad(store.buffer, store.indices)
        value = acc + tirx.Cast(acc_dtype, a) * tirx.Cast(acc_dtype, b)
        body = tirx.BufferStore(store.buffer, value, store.indices)
        init = tirx.BufferStore(blk.init.buffer, tirx.const(0, acc_dtype), blk.init.indices)
        return s_tir.SBlock(blk.iter_vars, blk.reads, blk.writes, blk.name_hint, body, init,
                            blk.alloc_buffers, blk.match_buffers, blk.annotations)

    return tvm_ffi.structural_map(sch.mod["main"], [(s_tir.SBlock, rebuild)]), True


def symbolic_bound(func: tirx.PrimFunc, expr) -> int | None:
    """Upper bound of a symbolic extent from the function's `tir_var_upper_bound` attribute
    (set by AnnotateSymbolicBounds): a product of bounded variables and constants."""
    bounds = func.attrs.get(BOUND_ATTR) if func.attrs is not None else None
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Var):
        if bounds is not None and expr.name in bounds:
            return int(bounds[expr.name])
        return None
    if isinstance(expr, tirx.Mul):
        a, b = symbolic_bound(func, expr.a), symbolic_bound(func, expr.b)
        return None if a is None or b is None else a * b
    if isinstance(expr, tirx.Cast):
        return symbolic_bound(func, expr.value)
    return None


@tvm.transform.module_pass(opt_level=0, name="AnnotateSymbolicBounds")
class AnnotateSymbolicBounds:
    """Give every PrimFunc the upper bounds of its symbolic shape variables, taken from the
    `tir_var_upper_bound` of the Relax functions that call it (the largest bound wins when
    several callers share a kernel)."""

    def transform_module(self, mod, _ctx):
        from tvm import relax

        found: dict = {}
        for _, func in mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs is None:
                continue
            bounds = func.attrs.get(BOUND_ATTR)
            if not bounds:
                continue
            bounds = {str(k): int(v) for k, v in bounds.items()}

            def visit(expr, bounds=bounds):
                if not (isinstance(expr, relax.Call) and expr.op.same_as(tvm.ir.Op.get("relax.call_tir"))):
                    return
                gvar = expr.args[0]
                prim = mod[gvar]
                if not isinstance(prim, tirx.PrimFunc):
                    return
                args = list(expr.args[1].fields) if hasattr(expr.args[1], "fields") else [expr.args[1]]
                out = list(expr.ty_args)
                out = [f for o in out for f in (o.fields if hasattr(o, "fields") else [o])]
                shapes = [getattr(a.ty, "shape", None) for a in args] + [getattr(o, "shape", None) for o in out]
                mapping = found.setdefault(gvar, {})
                # (a handle parameter, e.g. of TVM's sort kernels, has no shape: skipped)
                for buf_shape, shape in zip((getattr(p, "shape", None) or () for p in prim.params),
                                            shapes):
                    if shape is None or not hasattr(shape, "values"):
                        continue
                    for dim, rdim in zip(buf_shape, shape.values):
                        if isinstance(dim, tirx.Var) and isinstance(rdim, tirx.Var) and rdim.name in bounds:
                            mapping[dim.name] = max(mapping.get(dim.name, 0), bounds[rdim.name])

            relax.analysis.post_order_visit(func.body, visit)
        for gvar, mapping in found.items():
            if mapping:
                mod[gvar] = mod[gvar].with_attr(BOUND_ATTR, mapping)
        return mod


INT32_MAX = 2**31 - 1


def narrow_indices(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with int64 index arithmetic turned into int32 (TVM's ForceNarrowIndexToInt32)
    when every buffer provably has fewer than 2^31 elements (symbolic dims by their declared
    bounds); `func` unchanged otherwise. GPUs do int64 address math in several instructions."""
    for param in func.params:
        size = 1
        for dim in param.shape:
            bound = symbolic_bound(func, dim)
            if bound is None:
                return func
            size *= bound
        if size > INT32_MAX:
            return func
    mod = tvm.IRModule({"main": func})
    return tvm.tirx.transform.ForceNarrowIndexToInt32()(mod)["main"]


def check_thread_bound(sch: s_tir.Schedule) -> None:
    """Raise ValueError unless every top-level block runs under a blockIdx-bound loop (a GPU
    kernel cannot have host-side loops left over)."""
    for block in sch.get_child_blocks(get_root_block(sch)):
        tags = [str(sch.get(loop).thread_binding.thread_tag) for loop in sch.get_loops(block)
                if sch.get(loop).thread_binding is not None]
        if not any(tag.startswith("blockIdx") for tag in tags):
            raise ValueError(f"block {sch.get(block).name_hint} is not bound to GPU threads")


def schedule_or_none(schedule, func, *args, name: str):
    """Run a rule's scheduling; a kernel it claimed but cannot schedule (an epilogue that does
    not inline, say) is logged and left to the next rule instead of failing the build."""
    try:
        sch = schedule(func, *args)
        check_thread_bound(sch)
        return sch
    except SCHEDULE_ERRORS as err:
        return left_to_next_rule(name, func, err)
