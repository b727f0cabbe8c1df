"""FoldIdentityTake: take(x, [0, 1, ..., n-1], axis) over an axis of extent n is x itself.

Decode keeps the logits of every position (one per sequence), so the position gather that
prefill needs becomes a constant identity index there; removing it saves a kernel and a copy
of the hidden states per decode step.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from .common import relax_function_pass


def rewrite_function(func: relax.Function) -> tuple[relax.Function, int]:
    x, idx = wildcard(), is_const()
    pattern = is_op("relax.take")(x, idx)
    count = [0]

    def rewriter(expr, m):
        indices = m[idx].value.numpy()
        axis = int(expr.attrs.axis) if expr.attrs.axis is not None else None
        shape = m[x].ty.shape
        if axis is None or indices.ndim != 1:
            return expr
        extent = shape[axis]
        if not isinstance(extent, tvm.tirx.IntImm) or int(extent) != indices.size:
            return expr
        if not np.array_equal(indices, np.arange(indices.size)):
            return expr
        count[0] += 1
        return m[x]

    return rewrite_call(pattern, rewriter, func), count[0]


def FoldIdentityTake() -> tvm.transform.Pass:
    """The module pass (a fresh Pass object each call, like TVM's own pass constructors)."""
    return relax_function_pass("FoldIdentityTake", lambda f: rewrite_function(f)[0])
