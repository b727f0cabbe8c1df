"""What every graph pass here shares: which parameters are weights, and the module wrapper."""
from __future__ import annotations

import tvm
from tvm import relax


def weight_params(func: relax.Function) -> set:
    """The function's weight parameters: those after its "num_input" runtime inputs."""
    n = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs else len(func.params)
    return set(func.params[n:])


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
