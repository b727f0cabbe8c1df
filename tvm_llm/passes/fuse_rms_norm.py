"""FuseRMSNorm: the elementwise RMSNorm an imported model spells out becomes one rms_norm op.

transformers writes RMSNorm as x * rsqrt(mean(x^2, -1) + eps), then a multiply by the weight.
As separate ops that is a reduction kernel plus two elementwise kernels and an intermediate;
`relax.nn.rms_norm` legalizes to one kernel. The weight multiply is folded in when it is the
only user and the other operand depends on weights alone (e.g. Gemma's 1 + w, which the folding
phase then computes at build time).
"""
from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from .common import relax_function_pass, weight_params


def _core_pattern():
    x, eps = wildcard(), is_const()
    square = is_op("relax.power")(x, is_const()) | is_op("relax.multiply")(x, x)
    mean = is_op("relax.mean")(square)
    inv = is_op("relax.rsqrt")(is_op("relax.add")(mean, eps))
    core = is_op("relax.multiply")(x, inv) | is_op("relax.multiply")(inv, x)
    return x, eps, square, mean, core


def _scalar(c: relax.Constant) -> float | None:
    arr = c.value.numpy()
    return float(arr) if arr.size == 1 else None


def rewrite_function(func: relax.Function, weight_vars: set) -> tuple[relax.Function, int]:
    x, eps, square, mean, core = _core_pattern()
    count = [0]

    def depends_on_weights_only(expr) -> bool:
        free = relax.analysis.free_vars(expr)
        return all(v in weight_vars for v in free) and bool(free)

    def valid(m) -> bool:
        sq = m[square]
        if sq.op.name == "relax.power" and _scalar(sq.args[1]) != 2.0:
            return False
        mean_call = m[mean]
        axes = [int(a) for a in mean_call.attrs.axis] if mean_call.attrs.axis is not None else []
        ndim = len(m[x].ty.shape)
        return axes in ([-1], [ndim - 1]) and bool(mean_call.attrs.keepdims) and _scalar(m[eps]) is not None

    def rewrite_core(expr, m):
        if not valid(m):
            return expr
        count[0] += 1
        hidden = m[x].ty.shape[-1]
        ones = relax.const(np.ones([int(hidden)], dtype=str(m[x].ty.dtype)))
        return relax.op.nn.rms_norm(m[x], ones, axes=[-1], epsilon=_scalar(m[eps]))

    func = rewrite_call(core, rewrite_core, func)

    # rms_norm(x, ones) * w  ->  rms_norm(x, w)   (w: any weight-only expression of shape (hidden,))
    normed = is_op("relax.nn.rms_norm")(wildcard(), is_const())
    w = wildcard()
    scaled = is_op("relax.multiply")(normed, w) | is_op("relax.multiply")(w, normed)

    def rewrite_scaled(expr, m):
        n, weight = m[normed], m[w]
        if not np.all(n.args[1].value.numpy() == 1) or not depends_on_weights_only(weight):
            return expr
        if len(weight.ty.shape) != 1 or not tvm_ffi.structural_equal(weight.ty.shape[0], n.ty.shape[-1]) \
                or weight.ty.dtype != n.ty.dtype:
            return expr
        return relax.op.nn.rms_norm(n.args[0], weight, axes=[-1], epsilon=float(n.attrs.epsilon))

    return rewrite_call(scaled, rewrite_scaled, func), count[0]



def FuseRMSNorm() -> tvm.transform.Pass:
    """The module pass (a fresh Pass object each call, like TVM's own pass constructors)."""
    return relax_function_pass("FuseRMSNorm",
                               lambda f: rewrite_function(f, weight_params(f))[0])
