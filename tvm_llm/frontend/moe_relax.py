"""The traced `tvm_llm::moe_experts` op (frontend/moe.py) -> Relax.

For t tokens routed to k experts each (t*k rows):
  1. rows sorted by expert id (argsort of the flattened top-k ids): the rows of one expert are
     contiguous, so the grouped GEMM below reads each expert's weights for a run of rows;
  2. gate_up GEMM, gating (act(gate) * up, or gpt-oss's clamped swiglu), down GEMM: each is
     `moe_gemm` (below), one TIR kernel whose weight operand is the stacked (experts, in, out)
     tensor, indexed by each row's expert id *inside the kernel*: a decode step reads the
     weights of the selected experts only, never a dense matmul over all of them;
  3. rows back in token order, multiplied by their routing weights and summed over the k.

`moe_gemm` is plain TIR (no schedule); schedules/cpu/moe.py schedules it on CPU, dlight's GPU
fallback on CUDA/ROCm (tvm_llm/targets/ chooses). It is marked opaque so that FuseOps keeps it
one kernel the rules can recognise by its block name, MOE_GEMM_BLOCK.
"""
from __future__ import annotations

from ..errors import UserError

MOE_GEMM_BLOCK = "moe_gemm"
OPAQUE = 8  # relax OpPatternKind.kOpaque: never fused with neighbours


def moe_gemm_func(k_in: int, n_out: int, n_experts: int, x_dtype: str, w_dtype: str):
    """y[r, n] = sum_j x[r, j] * w[expert[r], j, n] for a symbolic number of rows r."""
    from tvm import te, tirx

    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731
    rows = tirx.Var("rows", "int64")
    x = te.placeholder((rows, i64(k_in)), x_dtype, name="x")
    expert = te.placeholder((rows,), "int64", name="expert")
    w = te.placeholder((i64(n_experts), i64(k_in), i64(n_out)), w_dtype, name="w")
    j = te.reduce_axis((i64(0), i64(k_in)), name="j")
    y = te.compute((rows, i64(n_out)),
                   lambda r, n: te.sum(x[r, j] * w[expert[r], j, n].astype(x_dtype), axis=j),
                   name=MOE_GEMM_BLOCK)
    func = te.create_prim_func([x, expert, w, y]).with_attr("op_pattern", OPAQUE)
    return func.without_attr("global_symbol")  # private: named by the module that adds it


def _gating(bb, h, gating: str, alpha: float, limit: float):
    from tvm import relax as rx

    inter = int(h.ty.shape[1]) // 2
    gate = bb.emit(rx.op.strided_slice(h, axes=[1], begin=[0], end=[inter]))
    up = bb.emit(rx.op.strided_slice(h, axes=[1], begin=[inter], end=[2 * inter]))
    dtype = str(h.ty.dtype)
    if gating == "clamped_swiglu":
        gate = bb.emit(rx.op.minimum(gate, rx.const(limit, dtype)))
        up = bb.emit(rx.op.clip(up, rx.prim_value(-limit), rx.prim_value(limit)))
        glu = bb.emit(rx.op.multiply(gate, rx.op.sigmoid(rx.op.multiply(gate, rx.const(alpha, dtype)))))
        return bb.emit(rx.op.multiply(rx.op.add(up, rx.const(1.0, dtype)), glu))
    act = {"silu": rx.op.nn.silu, "gelu": rx.op.nn.gelu, "gelu_pytorch_tanh": rx.op.nn.gelu_tanh,
           "relu": rx.op.nn.relu}.get(gating)
    if act is None:
        raise UserError(f"expert gating {gating!r} has no Relax lowering; this model is not supported")
    return bb.emit(rx.op.multiply(act(gate), up))


def moe_converter():
    """custom_convert_map entry for from_exported_program."""
    from tvm import relax as rx

    def convert(node, importer):
        bb = importer.block_builder
        env = importer.env
        x, idx, wts, gate_up, down = (env[a] for a in node.args[:5])
        b1 = env[node.args[5]] if node.args[5] is not None else None
        b2 = env[node.args[6]] if node.args[6] is not None else None
        gating, alpha, limit = node.args[7], float(node.args[8]), float(node.args[9])
        tokens, hidden = x.ty.shape
        top_k = int(idx.ty.shape[1])
        n_exp = int(gate_up.ty.shape[0])
        dtype = str(x.ty.dtype)
        rows = tokens * top_k

        flat = bb.emit(rx.op.reshape(idx, [rows]))
        if str(flat.ty.dtype) != "int64":
            flat = bb.emit(rx.op.astype(flat, "int64"))
        order = bb.emit(rx.op.argsort(flat, axis=0, descending=False, dtype="int64"))
        expert = bb.emit(rx.op.take(flat, order, axis=0))
        token = bb.emit(rx.op.floor_divide(order, rx.const(top_k, "int64")))
        xs = bb.emit(rx.op.take(x, token, axis=0))

        def gemm(inp, weight, bias):
            k_in, n_out = int(weight.ty.shape[1]), int(weight.ty.shape[2])
            gv = bb.add_func(moe_gemm_func(k_in, n_out, n_exp, dtype, str(weight.ty.dtype)),
                             f"moe_gemm_{k_in}x{n_out}")
            out = bb.emit(rx.call_tir(gv, [inp, expert, weight],
                                      out_ty=rx.TensorType([rows, n_out], dtype)))
            if bias is not None:
                sel = bb.emit(rx.op.take(bias, expert, axis=0))
                if str(sel.ty.dtype) != dtype:
                    sel = bb.emit(rx.op.astype(sel, dtype))
                out = bb.emit(rx.op.add(out, sel))
            return out

        h = gemm(xs, gate_up, b1)
        a = _gating(bb, h, gating, alpha, limit)
        y = gemm(a, down, b2)
        # rows back in token order (the inverse permutation), weighted, summed over the k
        inverse = bb.emit(rx.op.argsort(order, axis=0, descending=False, dtype="int64"))
        y = bb.emit(rx.op.take(y, inverse, axis=0))
        y = bb.emit(rx.op.reshape(y, [tokens, top_k, hidden]))
        w = wts if str(wts.ty.dtype) == dtype else bb.emit(rx.op.astype(wts, dtype))
        w = bb.emit(rx.op.reshape(w, [tokens, top_k, 1]))
        return bb.emit(rx.op.sum(rx.op.multiply(y, w), axis=[1]))

    return {"moe_experts.default": convert}
