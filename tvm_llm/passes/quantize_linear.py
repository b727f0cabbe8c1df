"""QuantizeLinear: every linear layer's weight is stored quantized and dequantized inside
its matmul (weight-only q8/q4), or the linear runs int8 x int8 (W8A8).

Rewrites `matmul(x, permute_dims(W))`, W a weight (a parameter or weight-only expression such
as MergeParallelLinear's concatenation), into

    weight-only:  Wq, s = quantize_weight(W);      y = dequantize_matmul(x, Wq, s)
    W8A8:         Wq, s, r = quantize_weight(W);   xu, xs = quantize_activation(x)
                  y = int8_matmul(xu, xs, Wq, s, r)
    W4A8:         Wp, s = quantize_weight(W);      y = w4a8_matmul(x, Wp, s)  (CPU VNNI kernel,
                  schedules/cpu/w4a8_matmul.py, which quantizes x itself)

`quantize_weight` reads only weights, so the folding phase lifts it into the build-time
weight transform: the model ships Wq and s, never W. The dequantize is a producer block of the
matmul PrimFunc, which the schedule rules inline, so a decode step reads the packed bytes only.
Linears whose checkpoint names match `--keep-float` stay float (and keep FuseTransposeMatmul's
plain NT matmul). Run after MergeParallelLinear (so Q/K/V are quantized as one matrix) and
before FuseTransposeMatmul.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..quantization import kernels
from ..quantization.scheme import QuantScheme
from .common import is_op, linear_parts, weight_params

FLOAT_DTYPES = ("float32", "float16", "bfloat16")


@mutator
class _Quantizer(PyExprMutator):
    def __init__(self, mod, scheme: QuantScheme, checkpoint_names: dict, report: dict):
        super().__init__(mod)
        self.scheme = scheme
        self.checkpoint_names = checkpoint_names
        self.report = report
        self.weights: set = set()
        self.bindings: dict = {}
        self.embedding_tables: set = set()

    def start(self, func: relax.Function):
        self.weights = set(weight_params(func))
        self.bindings = {}
        self.embedding_tables = set()

        def visit(e):
            if is_op(e, "relax.take"):
                self.embedding_tables.add(e.args[0])

        relax.analysis.post_order_visit(func, visit)

    def visit_var_binding_(self, binding):
        self.bindings[binding.var] = binding.value
        free = relax.analysis.free_vars(binding.value)
        if free and all(v in self.weights for v in free):
            self.weights.add(binding.var)
        super().visit_var_binding_(binding)

    def _source_names(self, w) -> list:
        """Checkpoint names of the parameters a weight expression reads."""
        names, todo, seen = [], [w], set()
        while todo:
            v = todo.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in self.bindings:
                todo.extend(relax.analysis.free_vars(self.bindings[v]))
                continue
            names.append(self.checkpoint_names.get(v.name, v.name))
            if v in self.embedding_tables:
                names.append("lm_head.weight")
        return sorted(set(names))

    def _linear(self, call):
        parts = linear_parts(call, self.weights, self.bindings, through_astype=True)
        if parts is None:
            return None
        x, w = parts
        if str(w.ty.dtype) not in FLOAT_DTYPES or str(x.ty.dtype) not in FLOAT_DTYPES:
            return None
        shape = list(w.ty.shape)
        if not all(isinstance(d, tvm.tirx.IntImm) for d in shape):
            return None
        return x, w, int(shape[0]), int(shape[1])

    def visit_call_(self, call):
        parts = self._linear(call)
        if parts is None:
            return super().visit_call_(call)
        x, w, N, K = parts
        names = self._source_names(w)
        key = ",".join(names)
        ok = self.scheme.applies_to(K, N) and (self.scheme.tag != "w4a8" or (
            x.ty.ndim == 3 and str(x.ty.dtype) == "float32"))
        if not ok or self.scheme.keeps_float(names):
            self.report.setdefault("kept_float", {})[key] = [N, K]
            return super().visit_call_(call)
        self.report.setdefault("quantized", {})[key] = [N, K]
        bb = self.builder_
        x_new, w_new = self.visit_expr(x), self.visit_expr(w)
        out_dtype = call.attrs.out_dtype
        out_dtype = str(out_dtype) if out_dtype is not None and str(out_dtype) not in ("", "void") \
            else str(x.ty.dtype)
        scheme = self.scheme
        stored = bb.emit(bb.call_te(lambda w: kernels.quantize_weight(w, scheme), w_new,
                                    primfunc_name_hint=f"quantize_weight_{scheme.tag}"))
        parts = [bb.emit(relax.TupleGetItem(stored, i)) for i in range(len(stored.ty.fields))]
        return emit_quantized_matmul(bb, x_new, parts, scheme, K, N, out_dtype)


def emit_quantized_matmul(bb, x, stored: list, scheme: QuantScheme, K: int, N: int,
                          out_dtype: str):
    """The expression y = x @ W^T for a weight W held as `stored` (the tensors
    quantization.kernels.quantize_weight makes of it): what the pass emits, and what the
    kernel benchmark and tests build around the same kernels."""
    tag = scheme.tag
    if tag == "w4a8":
        from schedules.cpu.w4a8_matmul import w4a8_matmul_func

        gv = bb.add_func(w4a8_matmul_func(K, N, scheme.group_size, out_dtype), "w4a8_matmul")
        shape = list(x.ty.shape)[:-1] + [N]
        return relax.call_tir(gv, relax.Tuple([x, stored[0], stored[1]]),
                              out_ty=relax.TensorType(shape, out_dtype))
    if scheme.activations == "int8":
        act = bb.emit(bb.call_te(kernels.quantize_activation, x,
                                 primfunc_name_hint="quantize_activation"))
        xu, xs = bb.emit(relax.TupleGetItem(act, 0)), bb.emit(relax.TupleGetItem(act, 1))
        return bb.call_te(lambda *a: kernels.int8_matmul(*a, out_dtype=out_dtype), xu, xs,
                          *stored, primfunc_name_hint="int8_matmul")
    return bb.call_te(lambda a, q, s: kernels.dequantize_matmul(a, q, s, scheme, out_dtype),
                      x, stored[0], stored[1], primfunc_name_hint=f"{tag}_matmul")


def quantize_module(mod: tvm.IRModule, scheme: QuantScheme, checkpoint_names: dict,
                    report: dict | None = None) -> tvm.IRModule:
    report = {} if report is None else report
    q = _Quantizer(mod, scheme, checkpoint_names, report)
    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and func.attrs is not None and "num_input" in func.attrs:
            q.start(func)
            new = q.visit_expr(func)
            q.builder_.update_func(gv, relax.analysis.remove_all_unused(new))
    return q.builder_.get()


def QuantizeLinear(scheme: QuantScheme, checkpoint_names: dict | None = None,
                   report: dict | None = None) -> tvm.transform.Pass:
    """The module pass. `checkpoint_names` maps Relax parameter names to checkpoint names (for
    --keep-float and the report); `report` collects which weights were quantized or kept."""

    def transform(mod, _ctx):
        return quantize_module(mod, scheme, checkpoint_names or {}, report)

    return tvm.transform.module_pass(transform, opt_level=0, name="QuantizeLinear")
