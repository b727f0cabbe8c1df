"""MergeParallelLinear: linears that read the same input become one matmul (horizontal fusion).

Q, K and V projections (and gate/up in gated MLPs) all multiply one activation by different
weights. One matmul over the concatenated weight reads the activation once and launches one
kernel instead of several, which matters most for decode GEMVs. Biases are merged the same way.
The weight concatenation is weight-only work: the folding phase lifts it out and runs it once
at build time, so the compiled functions receive the merged weight as a parameter.

Works on any imported graph: a group is every `matmul(x, permute_dims(W))` of one dataflow
block with the same `x`, where each W is a 2-D weight parameter with the same K and dtype.
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .common import linear_parts, relax_function_pass, weight_params


def _bias_of(var, uses: dict, bindings: dict, weights: set):
    """The binding var and bias B if `var`'s only use is add(var, B) with B a 1-D weight."""
    users = uses.get(var, [])
    if len(users) != 1:
        return None
    user = users[0]
    value = bindings[user]
    if not (isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.add"):
        return None
    a, b = value.args
    bias = b if a.same_as(var) else a if b.same_as(var) else None
    if bias is None or bias not in weights or len(bias.ty.shape) != 1:
        return None
    return user, bias


def _head_split(var, uses: dict, bindings: dict):
    """(reshape binding var, head dim) if `var`'s only use reshapes its last axis into
    (heads, head_dim) — how attention projections are consumed."""
    users = uses.get(var, [])
    if len(users) != 1:
        return None
    value = bindings[users[0]]
    if not (isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.reshape"):
        return None
    src_shape, dst_shape = list(var.ty.shape), list(value.ty.shape)
    if len(dst_shape) != len(src_shape) + 1:
        return None
    if not all(tvm_ffi.structural_equal(a, b) for a, b in zip(src_shape[:-1], dst_shape[:-2])):
        return None
    if not isinstance(dst_shape[-1], tvm.tirx.IntImm):
        return None
    return users[0], int(dst_shape[-1])


def find_groups(func: relax.Function, weights: set) -> list:
    """Groups of parallel linears. Each member is a dict: out (the var the rest of the graph
    reads), w, bias (or None), matmul (the matmul var), heads (reshape var, head dim) or None."""
    groups = []
    for block in func.body.blocks:
        if not isinstance(block, relax.DataflowBlock):
            continue
        bindings = {b.var: b.value for b in block.bindings}
        uses: dict = {}
        for b in block.bindings:
            for v in relax.analysis.free_vars(b.value):
                uses.setdefault(v, []).append(b.var)
        by_input: dict = {}
        for b in block.bindings:
            parts = linear_parts(b.value, weights, bindings)
            if parts is None:
                continue
            x, w = parts
            key = (x, int(w.ty.shape[1]), w.ty.dtype)
            by_input.setdefault(key, []).append((b.var, w))
        for members in by_input.values():
            if len(members) < 2:
                continue
            biases = [_bias_of(v, uses, bindings, weights) for v, _ in members]
            has_bias = all(biases)
            group = []
            for (v, w), bias in zip(members, biases):
                out = bias[0] if has_bias else v
                group.append({"matmul": v, "w": w, "bias": bias[1] if has_bias else None,
                              "out": out, "heads": _head_split(out, uses, bindings)})
            dims = {m["heads"][1] if m["heads"] else None for m in group}
            if len(dims) != 1 or None in dims:  # slice by heads only when all agree on head dim
                for m in group:
                    m["heads"] = None
            groups.append(group)
    return groups


@mutator
class _Merger(PyExprMutator):
    def __init__(self, mod, groups):
        super().__init__(mod)
        self.first = {g[0]["matmul"]: g for g in groups}
        self.dropped = {m["matmul"] for g in groups for m in g if m["out"] is not m["matmul"]}
        self.replaced = {}  # var -> expression that now computes it

    def visit_var_binding_(self, binding):
        group = self.first.get(binding.var)
        if group is not None:
            self._emit_merged(group, self.visit_expr(binding.value.args[0]),
                              binding.value.attrs.out_dtype)
        if binding.var in self.replaced:
            new = self.builder_.emit(self.replaced[binding.var])
            self.set_var_remap(binding.var, new)
            return
        if binding.var in self.dropped:
            return  # the un-biased matmul of a merged biased linear: no longer needed
        super().visit_var_binding_(binding)

    def _emit_merged(self, group, x, out_dtype):
        w = self.builder_.emit(relax.op.concat([m["w"] for m in group], axis=0))
        y = self.builder_.emit(relax.op.matmul(x, relax.op.permute_dims(w), out_dtype=out_dtype))
        if group[0]["bias"] is not None:
            b = self.builder_.emit(relax.op.concat([m["bias"] for m in group], axis=0))
            y = self.builder_.emit(relax.op.add(y, b))
        # One strided_slice per member, not a split: slices are injective, so FuseOps fuses
        # each into its consumer and the merged output is never copied apart. When every member
        # is reshaped into heads, reshape once (a free view) and slice along the head axis.
        if group[0]["heads"] is not None:
            dim = group[0]["heads"][1]
            shape = list(y.ty.shape)
            total = int(shape[-1]) // dim
            y = self.builder_.emit(relax.op.reshape(y, shape[:-1] + [total, dim]))
            axis, size_of, key = len(shape) - 1, (lambda m: int(m["w"].ty.shape[0]) // dim), "heads"
        else:
            axis, size_of, key = len(y.ty.shape) - 1, (lambda m: int(m["w"].ty.shape[0])), "out"
        start = 0
        for m in group:
            size = size_of(m)
            target = m["heads"][0] if key == "heads" else m["out"]
            self.replaced[target] = relax.op.strided_slice(y, axes=[axis], begin=[start],
                                                           end=[start + size])
            start += size
        if key == "heads":  # the per-member outputs before the head reshape are now unused
            self.dropped |= {m["out"] for m in group}


def rewrite_function(func: relax.Function, weights: set) -> tuple[relax.Function, int]:
    groups = find_groups(func, weights)
    if not groups:
        return func, 0
    mod = tvm.IRModule({"f": func})
    new = _Merger(mod, groups).visit_expr(func)
    return relax.analysis.remove_all_unused(new), len(groups)


def MergeParallelLinear() -> tvm.transform.Pass:
    """The module pass (a fresh Pass object each call, like TVM's own pass constructors)."""
    return relax_function_pass("MergeParallelLinear",
                               lambda f: rewrite_function(f, weight_params(f))[0])
