"""What a module runs: Relax calls per operator, kernel launches per call of a function, and
what a call replays as device graphs (the build report's counts, tests and scripts/count_kernels.py)."""
from __future__ import annotations

import tvm
from tvm import relax

from .graph_capture import captured_region


def count_ops(mod) -> dict:
    """Relax calls per operator name (call_tir counts as its kernel kind) across the module."""
    counts: dict = {}

    def visit(expr):
        if isinstance(expr, relax.Call):
            op = expr.op
            name = getattr(op, "name", None) or getattr(op, "name_hint", None) or "call"
            counts[name] = counts.get(name, 0) + 1

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return counts


def kernels_per_call(mod, func_name: str, inside_graphs: bool = True) -> int:
    """Kernel launches one call of `func_name` makes in a finalized module: calls of PrimFuncs
    of the module plus the paged-attention packed calls (shape and memory builtins excluded),
    with those of the CUDA Graph regions it replays unless `inside_graphs` is False."""
    if func_name not in [gv.name_hint for gv in mod.get_global_vars()]:
        return 0
    prim = {gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    count = [0]

    def visit(expr):
        if not isinstance(expr, relax.Call):
            return
        op = expr.op
        region = captured_region(expr)
        if region is not None:
            count[0] += kernels_per_call(mod, region) if inside_graphs else 0
        elif isinstance(op, tvm.ir.GlobalVar) and op.name_hint in prim:
            if not op.name_hint.startswith(("shape_func", "compute_symbolic_expr")):  # host scalars
                count[0] += 1
        elif isinstance(op, relax.ExternFunc) and "attention" in str(op.global_symbol):
            count[0] += 1
        elif getattr(op, "name", "") in ("relax.call_tir", "relax.call_dps_packed"):
            callee = expr.args[0]
            name = getattr(callee, "name_hint", None) or str(getattr(callee, "global_symbol", ""))
            if not name.startswith("reshape"):  # lowered to a free view by RewriteDataflowReshape
                count[0] += 1

    relax.analysis.post_order_visit(mod[func_name], visit)
    return count[0]


def capture_summary(mod, func_name: str) -> dict:
    """What one call of `func_name` in a finalized module runs as graphs: the captured regions
    it replays, the kernels inside them, and the kernel launches left outside (reading a runtime
    input such as the token ids, or calling the paged-KV attention)."""
    regions = []

    def visit(expr):
        name = captured_region(expr)
        if name is not None:
            regions.append(name)

    if func_name in [gv.name_hint for gv in mod.get_global_vars()]:
        relax.analysis.post_order_visit(mod[func_name], visit)
    return {"regions": len(regions),
            "captured_kernels": sum(kernels_per_call(mod, r) for r in regions),
            "uncaptured_kernels": kernels_per_call(mod, func_name, inside_graphs=False)}
