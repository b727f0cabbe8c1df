"""AccumulateHalfMatmulInFloat32: a bfloat16/float16 matmul sums in float32, rounds once.

A relax ``matmul`` of two bfloat16 tensors legalizes to a bfloat16 reduction: every partial
sum is rounded to 8 significant bits, K times per output (torch's CPU kernels accumulate in
float32 and round the result once). Rewritten as ``astype(matmul(x, w, out_dtype="float32"),
dtype)`` the kernel keeps a float32 accumulator (registers, in our CPU GEMM/GEMV rules: the
weight is read as bfloat16 and widened in registers, half of float32's bytes), and the cast
back becomes the matmul's epilogue after FuseOps. The CPU target runs it
(tvm_llm/targets/llvm.py); float32 models are untouched.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from .common import relax_function_pass

HALF = ("bfloat16", "float16")


def rewrite_function(func: relax.Function) -> relax.Function:
    x, w = wildcard(), wildcard()
    pattern = is_op("relax.matmul")(x, w)

    def rewrite(expr, m):
        a, b = m[x], m[w]
        dtype = str(expr.ty.dtype)
        if dtype not in HALF or str(a.ty.dtype) != dtype or str(b.ty.dtype) != dtype:
            return expr
        acc = relax.op.matmul(a, b, out_dtype="float32")
        return relax.op.astype(acc, dtype)

    return rewrite_call(pattern, rewrite, func)


def AccumulateHalfMatmulInFloat32() -> tvm.transform.Pass:
    """The module pass (a fresh Pass object each call)."""
    return relax_function_pass("AccumulateHalfMatmulInFloat32", rewrite_function)
