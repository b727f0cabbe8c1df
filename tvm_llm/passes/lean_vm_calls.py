"""LeanVMCalls: fewer host calls in the VM code of a step (shape builds and kills that do nothing).

After VMShapeLower a function whose shapes hold a symbolic variable (decode's batch size) builds
every shape it needs at run time, one `vm.builtin.make_shape` call per allocation or reshape,
though most are the same few shapes ((b, 1, hidden), (b, 1, ffn) ...): llama-110m's decode made
190 such calls a step for ~20 distinct shapes. And KillAfterLastUse ends each tensor's and
storage's life with `R.vm.kill_object`, which the VM runs as a `vm.builtin.null_value` call
(196 a step there). Each is a packed call of the VM's interpreter (~0.1 us with its argument
packing), on the step's critical path.

This pass, run after VMShapeLower:
- binds each repeated `make_shape` (same arguments, no write to the shape heap in between: a
  `match_shape` or shape function call resets what is known) to the first one's variable, which
  the VM's code generator turns into a register alias, not an instruction;
- drops tuple bindings nothing reads: a kernel with two outputs (FuseAddRMSNorm's) leaves
  `t = (out_a, out_b)` after CallTIRRewrite, its users read out_a and out_b directly, and the VM
  still built the tuple (`vm.builtin.make_tuple`, 23 a llama-110m decode step);
- in the functions named in `drop_kills` (decode by default), drops the kills: a kill only lets
  a storage return to the pool before the call ends; decode's activations are a few rows wide
  (its storages a few hundred KiB at most at the largest batch), and the VM releases them when
  the call returns anyway. Prefill keeps its kills: there a storage freed mid-call can be reused
  by a later allocation of the same call, which keeps its peak down.
"""
from __future__ import annotations

import tvm
from tvm import relax

MAKE_SHAPE = "vm.builtin.make_shape"
KILL = "relax.vm.kill_object"
ALLOC_HEAP = "vm.builtin.alloc_shape_heap"


def _extern_name(expr) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, relax.ExternFunc):
        return str(expr.op.global_symbol)
    return None


def _key(call: relax.Call):
    """What makes two make_shape calls equal: the heap variable and the constant arguments."""
    parts = []
    for a in call.args:
        if isinstance(a, tvm.tirx.IntImm):  # a constant argument (Relax's prim values are IntImm)
            parts.append(("i", str(a.ty), int(a.value)))
        elif isinstance(a, relax.Var):
            parts.append(("v", a))
        else:
            parts.append(None)
    return None if None in parts else tuple(parts)


def _touches(value, heap_vars: set) -> bool:
    """Whether `value` passes a shape heap to anything (it may write it)."""
    if not isinstance(value, relax.Call):
        return False
    args = list(value.args)
    for a in list(args):
        if isinstance(a, relax.Tuple):
            args.extend(a.fields)
    return any(isinstance(a, relax.Var) and a in heap_vars for a in args)


def rewrite_function(func: relax.Function, drop_kills: bool) -> tuple[relax.Function, dict]:
    """(the rewritten function, {"make_shape": calls merged, "kills": kills dropped,
    "tuples": unused tuple bindings dropped})."""
    if not isinstance(func.body, relax.SeqExpr):
        return func, {"make_shape": 0, "kills": 0, "tuples": 0}
    merged = kills = tuples = 0
    used = _used_vars(func.body)
    # shapes merged only where every use is a top-level binding's (no nested branch to rename)
    flat = not any(isinstance(b.value, (relax.If, relax.SeqExpr, relax.Function))
                   for block in func.body.blocks for b in block.bindings)
    blocks = []
    heap_vars: set = set()  # the shape heaps (alloc_shape_heap results)
    alias: dict = {}  # a repeated make_shape's variable -> the first one's
    for block in func.body.blocks:
        known: dict = {}  # make_shape key -> the variable holding that shape
        bindings = []
        for b in block.bindings:
            value = b.value if isinstance(b, relax.VarBinding) else None
            name = _extern_name(value)
            if drop_kills and isinstance(value, relax.Call) and getattr(value.op, "name", "") == KILL:
                kills += 1
                continue
            if isinstance(value, relax.Tuple) and b.var not in used:
                tuples += 1  # a kernel's output tuple read only through its items
                continue
            if name == MAKE_SHAPE:
                heap_vars.add(value.args[0])
                key = _key(value)
                if flat and key is not None and key in known:
                    alias[b.var] = known[key]  # its uses read the first one's register
                    merged += 1
                    continue
                if key is not None:
                    known[key] = b.var
            elif _extern_name(value.args[0] if _is_builtin_with_ctx(value) else None) == ALLOC_HEAP:
                heap_vars.add(b.var)
            elif value is not None and _touches(value, heap_vars):
                known.clear()  # the heap may have changed: shapes built before are stale
            elif value is None or isinstance(value, (relax.If, relax.SeqExpr)):
                known.clear()
            if alias and isinstance(b, relax.VarBinding):
                b = relax.VarBinding(b.var, _renamed(b.value, alias), b.span)
            elif alias and isinstance(b, relax.MatchCast):
                b = relax.MatchCast(b.var, _renamed(b.value, alias), b.ty, b.span)
            bindings.append(b)
        blocks.append(relax.BindingBlock(bindings) if not isinstance(block, relax.DataflowBlock)
                      else relax.DataflowBlock(bindings))
    if not merged and not kills and not tuples:
        return func, {"make_shape": 0, "kills": 0, "tuples": 0}
    body = relax.SeqExpr(blocks, _renamed(func.body.body, alias))
    new = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
    return new, {"make_shape": merged, "kills": kills, "tuples": tuples}


def _used_vars(body: relax.SeqExpr) -> set:
    """Variables read anywhere in `body` (binding values and the result)."""
    used = set()

    def visit(e):
        if isinstance(e, relax.Var):
            used.add(e)

    for block in body.blocks:
        for b in block.bindings:
            relax.analysis.post_order_visit(b.value, visit)
    relax.analysis.post_order_visit(body.body, visit)
    return used


def _renamed(expr, alias: dict):
    """`expr` (a variable, a tuple, or a call and its arguments) with the variables in `alias`
    renamed. (Binding `y = x` instead would not do: the VM's code generator emits that as a
    vm.builtin.copy call.)"""
    if not alias:
        return expr
    if isinstance(expr, relax.Var):
        return alias.get(expr, expr)
    if isinstance(expr, relax.Tuple):
        fields = [_renamed(f, alias) for f in expr.fields]
        if all(x.same_as(y) for x, y in zip(fields, expr.fields)):
            return expr
        return relax.Tuple(fields, expr.span)
    if isinstance(expr, relax.Call):
        args = [_renamed(a, alias) for a in expr.args]
        if all(x.same_as(y) for x, y in zip(args, expr.args)):
            return expr
        return relax.Call(expr.op, args, expr.attrs, expr.ty_args, expr.span, ret_ty=expr.ty)
    return expr


def _is_builtin_with_ctx(value) -> bool:
    return isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.call_builtin_with_ctx"


def LeanVMCalls(drop_kills=("decode",), report: dict | None = None) -> tvm.transform.Pass:
    """The module pass; `report` (a dict) receives per function what was merged and dropped."""

    def transform(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                new, counts = rewrite_function(func, gv.name_hint in drop_kills)
                mod[gv] = new
                if report is not None and any(counts.values()):
                    report[gv.name_hint] = counts
        return mod

    return tvm.transform.module_pass(transform, opt_level=0, name="LeanVMCalls")
