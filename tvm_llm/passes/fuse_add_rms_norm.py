"""FuseAddRMSNorm: a residual add and the RMSNorm that reads it become one kernel, two outputs.

A pre-norm decoder layer computes ``h = x + sublayer(x)`` and then ``rms_norm(h)``; ``h`` is
also the next residual. Where the add cannot ride in the producing matmul's epilogue (FuseOps
does that for our scheduled matmuls), it is a kernel of its own that writes ``h`` only for the
norm kernel to read it back. Here both are computed by one PrimFunc, ``add_rms_norm``, that
writes ``h`` (the residual) and the normalized row in one pass over the row.

Fires when the rms_norm's input is an ``add`` with other users (the residual) and neither
operand is made by something FuseOps would fuse the add into: a ``relax.matmul`` or a
``call_tir`` of an unscheduled (fusable) PrimFunc. Hand-written kernels (int8-activation
matmuls, marked ``tirx.is_scheduled``) and packed calls (attention) leave the add alone, so
this is where it fires; float builds keep the add in the matmul epilogue.
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, topi
from tvm.relax.expr_functor import PyExprMutator, mutator

from .common import is_op


def add_rms_norm_te(a, b, weight, axes, epsilon):
    """TE: (h, rms_norm(h) * weight) with h = a + b."""
    h = topi.add(a, b)
    return [h, topi.nn.rms_norm(h, weight, axis=axes, epsilon=epsilon)]


def _fusable_producer(mod: tvm.IRModule, value, values: dict) -> bool:
    """Whether FuseOps would put an add consuming `value` into `value`'s kernel (looking
    through reshapes and casts, which fuse too)."""
    while is_op(value, "relax.reshape") or is_op(value, "relax.astype"):
        value = values.get(value.args[0])
    if is_op(value, "relax.matmul"):
        return True
    if is_op(value, "relax.call_tir"):
        callee = value.args[0]
        if isinstance(callee, tvm.ir.GlobalVar) and callee in mod.get_global_vars():
            func = mod[callee]
            attrs = func.attrs if func.attrs is not None else {}
            return not bool(attrs.get("tirx.is_scheduled", False))
    return False


def find_pairs(func: relax.Function, mod: tvm.IRModule) -> dict:
    """{add var: rms_norm binding var} for the adds this pass fuses: same-shape operands (no
    broadcast), neither made by a kernel the add would otherwise fuse into."""
    values = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    order = {var: i for i, var in enumerate(values)}
    pairs = {}
    for var, value in values.items():
        if not is_op(value, "relax.nn.rms_norm"):
            continue
        src = value.args[0]
        add = values.get(src)
        if not is_op(add, "relax.add") or src in pairs:
            continue
        a, b = add.args
        shapes = [getattr(o.ty, "shape", None) for o in (a, b)]
        if None in shapes or not tvm_ffi.structural_equal(shapes[0], shapes[1]):
            continue
        if any(_fusable_producer(mod, values.get(o), values) for o in (a, b)):
            continue
        weight = value.args[1]  # the fused kernel runs where the add was: its weight must exist
        if order.get(weight, -1) > order[src]:  # there (Gemma's 1 + w is computed after the add)
            continue
        pairs[src] = var
    return pairs


@mutator
class _Fuser(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod_ = mod
        self.pairs = {}
        self.values = {}
        self.count = 0

    def run(self, func: relax.Function, pairs: dict) -> relax.Function:
        self.pairs = pairs
        self.values = {b.var: b.value for blk in func.body.blocks for b in blk.bindings}
        self.norm_of = {}  # rms_norm var -> fused tuple var
        return self.visit_expr(func)

    def visit_var_binding_(self, binding):
        var, value = binding.var, binding.value
        if var in self.pairs:
            norm = self.values[self.pairs[var]]
            a, b = (self.visit_expr(x) for x in value.args)
            weight = self.visit_expr(norm.args[1])
            axes = [int(x) for x in norm.attrs.axes]
            fused = self.builder_.emit(self.builder_.call_te(
                add_rms_norm_te, a, b, weight, axes, float(norm.attrs.epsilon),
                primfunc_name_hint="add_rms_norm"))
            h = self.builder_.emit(relax.TupleGetItem(fused, 0))
            self.set_var_remap(var, h)
            self.norm_of[self.pairs[var]] = fused
            self.count += 1
            return
        if var in self.norm_of:
            n = self.builder_.emit(relax.TupleGetItem(self.norm_of[var], 1))
            self.set_var_remap(var, n)
            return
        super().visit_var_binding_(binding)


def fuse_module(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    fuser = _Fuser(mod)
    for gv, func in list(mod.functions_items()):
        if not (isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr)):
            continue
        pairs = find_pairs(func, mod)
        if pairs:  # functions with nothing to fuse stay as they are
            new = fuser.run(func, pairs)
            fuser.builder_.update_func(gv, new)
    return fuser.builder_.get(), fuser.count


def FuseAddRMSNorm() -> tvm.transform.Pass:
    """The module pass (a fresh Pass object each call)."""
    return tvm.transform.module_pass(lambda mod, _ctx: fuse_module(mod)[0], opt_level=0,
                                     name="FuseAddRMSNorm")
