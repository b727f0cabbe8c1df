"""What every graph pass here shares: which parameters are weights, and the module wrapper."""
from __future__ import annotations

import tvm
from tvm import relax


def weight_params(func: relax.Function) -> set:
    """The function's weight parameters: those after its "num_input" runtime inputs."""
    n = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs else len(func.params)
    return set(func.params[n:])


def is_op(expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == name


def linear_parts(value, weights: set, bindings: dict, through_astype: bool = False):
    """(x, W) if `value` is matmul(x, permute_dims(W)) with W in `weights` and 2-D (the
    permute_dims may be bound to a variable of the same block). `through_astype` also accepts
    matmul(x, astype(permute_dims(W))), how TVM's importer writes a float16 model's linears."""
    if not is_op(value, "relax.matmul"):
        return None
    x, rhs = value.args
    rhs = bindings.get(rhs, rhs)
    if through_astype and is_op(rhs, "relax.astype"):
        rhs = bindings.get(rhs.args[0], rhs.args[0])
    if not is_op(rhs, "relax.permute_dims"):
        return None
    w = rhs.args[0]
    axes = rhs.attrs.axes
    if w not in weights or w.ty.shape is None or len(w.ty.shape) != 2:
        return None
    if axes is not None and [int(a) for a in axes] != [1, 0]:
        return None
    return x, w


def relax_function_pass(name: str, rewrite) -> tvm.transform.Pass:
    """A module pass applying `rewrite(func) -> func` to every Relax function of a copy of the
    module (the caller's module is never mutated)."""

    def transform(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                mod[gv] = rewrite(func)
        return mod

    return tvm.transform.module_pass(transform, opt_level=0, name=name)
