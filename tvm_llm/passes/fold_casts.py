"""FoldCasts: drop casts that change nothing, so they stop costing a kernel each.

A bfloat16/float16 model imported from torch is full of dtype round trips: the attention
output goes bfloat16 -> float32 -> (reshapes) -> bfloat16 before o_proj, and the residual
stream is cast float32 -> float32 before each norm. Each ``astype`` is its own kernel, and the
reshapes between them (opaque to FuseOps) keep them from fusing: a bfloat16 llama-110m decode
step ran 38 cast kernels. Two exact rewrites:

* ``astype(x, x.dtype)`` -> ``x``;
* ``astype(reshape*(astype(x, float32)), x.dtype)`` -> ``reshape*(x)`` when x is bfloat16 or
  float16 (widening to float32 and rounding back returns every value unchanged).
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from .common import relax_function_pass

EXACT_WIDENING = {"bfloat16": "float32", "float16": "float32"}


def rewrite_function(func: relax.Function) -> relax.Function:
    x = wildcard()

    def identity(expr, m):
        return m[x] if str(m[x].ty.dtype) == str(expr.ty.dtype) else expr

    func = rewrite_call(is_op("relax.astype")(x), identity, func)

    # astype(reshape^k(astype(inner, float32)), inner.dtype), k = 0..3
    inner = wildcard()
    widened = is_op("relax.astype")(inner)
    chains = [widened]
    for _ in range(3):
        chains.append(is_op("relax.reshape")(chains[-1], wildcard()))
    outer = is_op("relax.astype")(chains[0])
    for chain in chains[1:]:
        outer = outer | is_op("relax.astype")(chain)

    def round_trip(expr, m):
        src, dtype = m[inner], str(expr.ty.dtype)
        if str(src.ty.dtype) != dtype or EXACT_WIDENING.get(dtype) != str(m[widened].ty.dtype):
            return expr
        out = src  # the reshapes that matched, innermost first, over the narrow input
        for chain in chains[1:]:
            if chain not in m:
                break
            out = relax.op.reshape(out, m[chain].ty.shape)
        return out

    return rewrite_call(outer, round_trip, func)


def FoldCasts() -> tvm.transform.Pass:
    """The module pass (a fresh Pass object each call)."""
    return relax_function_pass("FoldCasts", rewrite_function)
