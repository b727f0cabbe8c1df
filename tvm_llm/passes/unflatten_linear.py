"""UnflattenLinear: reshape(x, 2-D) -> matmul(., W^T) -> reshape(back) becomes one N-D matmul.

The torch importer flattens every linear's input to 2-D and reshapes the result back. The two
reshapes sit between a matmul and its neighbours and stop FuseOps from fusing epilogues (bias,
activation, residual add) into the matmul kernel. A matmul broadcasts over leading axes, so the
flattening is unnecessary: drop it when the outer reshape restores the input's leading shape.
A half-precision model casts the flat input (reshape -> astype -> matmul): the cast is kept,
on the unflattened input.
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from .common import relax_function_pass


def _leading_dims_equal(a, b) -> bool:
    return len(a) == len(b) and all(tvm_ffi.structural_equal(x, y) for x, y in zip(a[:-1], b[:-1]))


def rewrite_function(func: relax.Function) -> tuple[relax.Function, int]:
    x, w = wildcard(), wildcard()
    flat = is_op("relax.reshape")(x, wildcard())
    cast = is_op("relax.astype")(flat)  # a bfloat16 model rounds the flat input first
    wt = is_op("relax.permute_dims")(w)
    mm = is_op("relax.matmul")(flat | cast, wt)
    pattern = is_op("relax.reshape")(mm, wildcard())
    count = [0]

    def rewriter(expr, matches):
        src = matches[x]
        in_shape, out_shape = list(src.ty.shape), list(expr.ty.shape)
        if len(in_shape) < 3 or not _leading_dims_equal(in_shape, out_shape):
            return expr
        count[0] += 1
        if cast in matches:  # astype commutes with the reshape
            src = relax.op.astype(src, matches[cast].ty.dtype)
        return relax.op.matmul(src, matches[wt], out_dtype=matches[mm].attrs.out_dtype)

    return rewrite_call(pattern, rewriter, func), count[0]


def UnflattenLinear() -> tvm.transform.Pass:
    """The module pass (a fresh Pass object each call, like TVM's own pass constructors)."""
    return relax_function_pass("UnflattenLinear", lambda f: rewrite_function(f)[0])
