"""Shape buckets: static copies of the symbolic kernels, and the run-time dispatch to them.

MetaSchedule tunes static kernels only (a symbolic extent aborts the whole run), while the
model's kernels are symbolic in the prefill length n and the decode batch b. A *bucket* names
one static size of one entry function, e.g. ``decode:b=1`` or ``prefill:n=128``.

:func:`specialize_buckets` rewrites a lowered module (after the pipeline's "lowering" phase):

* for each bucket it adds a private copy of the entry function with the size bound
  (``decode__b1``), in which every ``call_tir`` whose kernel becomes fully static calls a
  static copy of that kernel (``NT_matmul__b1``, attribute ``tvm_llm.shape_bucket``), if
  `keep` wants it; the other calls keep the generic kernel;
* the entry function itself starts with ``if b == 1: return decode__b1(...)`` (one branch per
  kept bucket) and keeps its original body as the last ``else``.

So correctness never depends on the bucket: any other size runs the original body with the
generic (hand-scheduled) kernels, and inside a bucket an untuned kernel is the generic one.
The tuner calls it with ``keep=all static kernels`` and tunes those; the build calls it with
``keep=has a record in the log``, so only buckets that the log covers get a copy.
"""
from __future__ import annotations

from dataclasses import dataclass

BUCKET_ATTR = "tvm_llm.shape_bucket"
DEFAULT_BUCKETS = ("decode:b=1", "decode:b=4", "prefill:n=32", "prefill:n=128", "prefill:n=512")


@dataclass(frozen=True)
class Bucket:
    func: str  # entry function: "decode", "prefill"
    values: tuple  # ((role or var name, int), ...)

    @staticmethod
    def parse(text: str) -> "Bucket":
        """'decode:b=1', 'prefill:n=128' (several sizes: 'prefill:n=128,m=1')."""
        func, sep, rest = str(text).partition(":")
        values = []
        for item in rest.split(",") if sep else []:
            name, eq, value = item.partition("=")
            if not eq or not name.strip() or not value.strip().isdigit() or int(value) < 1:
                values = []
                break
            values.append((name.strip(), int(value)))
        if not func.strip() or not values:
            raise ValueError(f"bad shape bucket {text!r}: expected FUNC:VAR=SIZE, e.g. decode:b=1 "
                             "or prefill:n=128")
        return Bucket(func.strip(), tuple(values))

    def __str__(self) -> str:
        return f"{self.func}:" + ",".join(f"{k}={v}" for k, v in self.values)

    @property
    def tag(self) -> str:
        """Suffix of the names of the copies: b1, n128_m1."""
        return "_".join(f"{k}{v}" for k, v in self.values)


def parse_buckets(items) -> list[Bucket]:
    out = []
    for item in items:
        for part in str(item).split():
            b = part if isinstance(part, Bucket) else Bucket.parse(part)
            if b not in out:
                out.append(b)
    return out


def role_vars(func_name: str, func) -> dict:
    """Names a bucket may use for the symbolic sizes of `func`: the roles b (decode batch),
    n (prefill tokens), m (prefill logit rows), and every symbolic var by its own name."""
    from tvm import relax, tirx

    roles = {v.name: v for v in relax.analysis.defined_symbolic_vars(func)}

    def dim(param_name, axis):
        for p in func.params:
            if p.name == param_name and isinstance(p.ty, relax.TensorType) and p.ty.shape is not None:
                shape = p.ty.shape.values if hasattr(p.ty.shape, "values") else p.ty.shape
                if len(shape) > axis and isinstance(shape[axis], tirx.Var):
                    return shape[axis]
        return None

    named = {"decode": {"b": ("input_ids", 0)},
             "prefill": {"n": ("input_ids", 1), "m": ("logit_positions", 0)}}
    for role, (param, axis) in named.get(func_name, {}).items():
        var = dim(param, axis)
        if var is not None:
            roles[role] = var
    return roles


def upper_bound(func, var) -> int | None:
    bounds = (func.attrs or {}).get("tir_var_upper_bound") or {}
    for k, v in bounds.items():
        if str(k) == var.name:
            return int(v)
    return None


def _is_static_buffer(p) -> bool:
    from tvm import tirx

    return all(isinstance(d, tirx.IntImm) for d in p.shape)


def _dtype(v) -> str:
    """dtype of a scalar tirx Var or expression (`.dtype` is reserved for buffer vars)."""
    ty = getattr(v, "ty", None)
    return str(ty.dtype) if ty is not None and hasattr(ty, "dtype") else str(v.dtype)


def is_static(prim) -> bool:
    """True when every buffer of `prim` has a constant shape and it has no scalar params."""
    from tvm.tirx.buffer import BufferType

    for p in prim.params:
        if not isinstance(p.ty, BufferType) or not _is_static_buffer(p):
            return False
    return True


def specialize_kernel(prim, arg_types):
    """A static copy of `prim` for the tensor types of its call_tir arguments (inputs, then
    outputs), or None when some size stays unknown (a size given only by an expression)."""
    import tvm
    from tvm import relax, tirx
    from tvm.tirx.buffer import BufferType

    params = list(prim.params)
    if len(params) != len(arg_types) or not all(isinstance(p.ty, BufferType) for p in params):
        return None
    binding, new_buffers = {}, {}
    for p, ty in zip(params, arg_types):
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            return None
        shape = list(ty.shape.values)
        if len(shape) != len(p.shape) or not all(isinstance(d, tirx.IntImm) for d in shape):
            return None
        if _is_static_buffer(p):
            continue
        if not all(isinstance(d, (tirx.Var, tirx.IntImm)) for d in p.shape):
            continue  # bound through another buffer, or left symbolic (checked below)
        dims = []
        for d, value in zip(p.shape, shape):
            if isinstance(d, tirx.Var):
                if d.name in binding and binding[d.name] != int(value):
                    return None
                binding[d.name] = int(value)
                dims.append(tirx.const(int(value), _dtype(d)))
            else:
                dims.append(d)
        new_buffers[p] = tirx.decl_buffer(dims, p.dtype, name=p.name, elem_offset=p.elem_offset,
                                          data_alignment=p.data_alignment,
                                          offset_factor=p.offset_factor)
    if not new_buffers:
        return None
    try:
        out = prim.specialize(new_buffers)
    except (tvm.TVMError, TypeError, ValueError):
        return None
    return out if is_static(out) else None


def _call_tir_parts(call):
    """(kernel GlobalVar, argument exprs, output types) of a relax.call_tir, else None."""
    from tvm import relax

    if not isinstance(call, relax.Call) or getattr(call.op, "name", "") != "relax.call_tir":
        return None
    if len(call.args) > 2:  # tir_vars: leave such calls generic
        return None
    gv, args = call.args[0], call.args[1]
    if not isinstance(args, relax.Tuple):
        return None
    out = call.ty_args[0]
    outs = list(out.fields) if isinstance(out, relax.TupleType) else [out]
    return gv, list(args.fields), outs


def specialize_buckets(mod, buckets, keep=None, log=None):
    """Add bucket copies and the dispatch to `mod` (see the module docstring).

    keep(kernel: PrimFunc) -> bool decides which static kernels are used (default: all).
    Returns (module, info): info lists, per bucket that got a copy, the static kernels it calls
    as {"bucket", "function", "kernels": {static name: generic name}}; buckets that do not
    apply (unknown function or size name, size above the function's bound) are reported
    through `log` and skipped."""
    from tvm import relax, tirx

    keep = keep or (lambda prim: True)
    log = log or (lambda *a: None)
    by_func: dict = {}
    for b in buckets:
        by_func.setdefault(b.func, []).append(b)
    bb = relax.BlockBuilder(mod)
    names = {gv.name_hint for gv in mod.get_global_vars()}
    made: dict = {}  # (generic name, argument types) -> static GlobalVar or None
    info = []

    for func_name, fbuckets in by_func.items():
        if func_name not in names or not isinstance(mod[func_name], relax.Function):
            log(f"shape bucket {fbuckets[0]}: no function {func_name!r} in the module; skipped")
            continue
        func = mod[func_name]
        roles = role_vars(func_name, func)
        cases = []
        for b in fbuckets:
            binding, ok = {}, True
            for role, value in b.values:
                var = roles.get(role)
                if var is None:
                    log(f"shape bucket {b}: {func_name} has no symbolic size {role!r} "
                        f"(has {', '.join(sorted(roles)) or 'none'}); skipped")
                    ok = False
                    break
                ub = upper_bound(func, var)
                if ub is not None and value > ub:
                    log(f"shape bucket {b}: {role}={value} exceeds the build's bound {ub}; skipped")
                    ok = False
                    break
                binding[var] = value
            if not ok:
                continue
            clone, kernels = _bucket_copy(bb, func, b, binding, keep, made)
            if not kernels:
                continue
            gv = bb.add_func(clone, f"{func_name}__{b.tag}")
            cond = None
            for var, value in binding.items():
                term = tirx.EQ(var, tirx.const(value, _dtype(var)))
                cond = term if cond is None else tirx.And(cond, term)
            # the copy's types in terms of this function's own vars, for the casts at the call
            view = func.bind_symbolic_vars({var: tirx.const(v, _dtype(var)) for var, v in binding.items()})
            cases.append((cond, gv, view, b))
            info.append({"bucket": str(b), "function": gv.name_hint, "kernels": kernels})
        if cases:
            bb.update_func(bb.get().get_global_var(func_name), _dispatch(func, cases))
    return relax.transform.Normalize()(bb.finalize()), info


def _bucket_copy(bb, func, bucket, binding, keep, made):
    """The entry function with the bucket's sizes bound, its call_tirs retargeted to static
    kernels; returns (function, {static kernel name: generic name})."""
    import tvm
    from tvm import relax

    fresh = relax.utils.copy_with_new_vars(func)  # a function's params must be its own vars
    values = {var.name: v for var, v in binding.items()}
    # bound sizes become constants; the others get vars of their own (no var in two functions)
    bound = fresh.bind_symbolic_vars({
        v: (tvm.tirx.const(values[v.name], _dtype(v)) if v.name in values
            else tvm.tirx.Var(v.name, _dtype(v)))
        for v in relax.analysis.defined_symbolic_vars(fresh)})
    attrs = {k: v for k, v in (bound.attrs or {}).items()
             if k not in ("global_symbol", "tir_var_upper_bound", "tir_var_lower_bound")}
    kernels = {}

    @relax.expr_functor.mutator
    class Retarget(relax.PyExprMutator):
        def visit_call_(self, call):  # noqa: N802 (TVM's visitor naming)
            call = super().visit_call_(call)
            parts = _call_tir_parts(call)
            if parts is None:
                return call
            gv, args, outs = parts
            prim = bb.get()[gv] if isinstance(gv, tvm.ir.GlobalVar) else None
            if not isinstance(prim, tvm.tirx.PrimFunc) or is_static(prim):
                return call
            if relax.analysis.has_reshape_pattern(prim):
                return call  # becomes a free view (RewriteDataflowReshape): nothing to tune
            types = [a.ty for a in args] + outs
            key = (gv.name_hint, tuple(str(t) for t in types))
            if key not in made:
                static = specialize_kernel(prim, types)
                made[key] = None
                if static is not None:
                    static = static.with_attr(BUCKET_ATTR, str(bucket))
                    if keep(static):
                        made[key] = bb.add_func(static, f"{gv.name_hint}__{bucket.tag}")
            new_gv = made[key]
            if new_gv is None:
                return call
            kernels[new_gv.name_hint] = gv.name_hint
            return relax.Call(call.op, [new_gv] + list(call.args[1:]), call.attrs, call.ty_args)

    body = Retarget(bb.get()).visit_expr(bound.body)
    clone = relax.Function(bound.params, body, bound.ret_ty, bound.is_pure,
                           attrs=tvm.ir.make_node("ir.DictAttrs", **attrs) if attrs else None)
    return clone, kernels


def _dispatch(func, cases):
    """`func` whose body first checks each case's condition and calls its copy."""
    from tvm import relax, tirx

    body = func.body
    for cond, gv, clone, bucket in reversed(cases):  # clone: the copy's signature
        bindings, args = [], []
        for p, cp in zip(func.params, clone.params):
            if tvm_structural_equal(p.ty, cp.ty):
                args.append(p)
            else:
                v = relax.Var(f"{p.name}_{bucket.tag}", cp.ty)
                bindings.append(relax.MatchCast(v, p, cp.ty))
                args.append(v)
        r = relax.Var(f"out_{bucket.tag}", clone.ret_ty)
        bindings.append(relax.VarBinding(r, relax.Call(gv, args)))
        out = relax.Var(f"ret_{bucket.tag}", func.ret_ty)
        bindings.append(relax.MatchCast(out, r, func.ret_ty))
        then = relax.SeqExpr([relax.BindingBlock(bindings)], out)
        res = relax.Var("ret", func.ret_ty)
        cond_expr = relax.prim_value(cond)
        body = relax.SeqExpr([relax.BindingBlock([relax.VarBinding(
            res, relax.If(cond_expr, then, body))])], res)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, attrs=func.attrs)


def tvm_structural_equal(a, b) -> bool:
    import tvm_ffi

    return bool(tvm_ffi.structural_equal(a, b))
