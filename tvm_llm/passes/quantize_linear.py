"""QuantizeLinear: every linear layer's weight is stored in the weight format its QuantPlan
gives it and multiplied by a quantized kernel.

Rewrites `matmul(x, permute_dims(W))`, W a weight (a parameter or weight-only expression such
as MergeParallelLinear's concatenation), into

    stored = call_pure_packed("tvm_llm.quantize_weight", W, format, layout, names)
    weight-only:      y = dequantize_matmul(x, *stored)     (dequantize inlined by schedules)
    int8 / int16 activations:
                      y = int8_act_matmul(x, *stored)       (the target's kernel: on CPU
                                                             schedules/cpu/int8_act_matmul.py,
                                                             x86 integer dot products, per-32-block
                                                             activation scales;
                                                             int16 as two int8 halves)

The quantize call reads only weights, so the folding phase lifts it into the build-time weight
transform: the numpy reference quantizer (quantization/formats.py, with the plan's importance
for these weights) runs once at build time and the model ships the packed arrays, never W.
The format of a merged linear (q|k|v, gate|up) is `plan.format_for(names)`; "float", a weight
the format cannot store, or a name matching `--keep-float` stays float (and keeps
FuseTransposeMatmul's plain NT matmul). Run after MergeParallelLinear and before
FuseTransposeMatmul.
The grouped expert GEMMs of MoE layers (call_tir of moe_gemm) get their stacked expert weights
quantized the same way, expert by expert (quantization/experts.py, weight-only).
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..quantization import kernels
from ..quantization.formats import get_format
from ..quantization.plan import FLOAT, INTEGER_ACTIVATIONS
from ..quantization.scheme import QuantScheme, vnni_applies
from .common import is_op, linear_parts, weight_params

FLOAT_DTYPES = ("float32", "float16", "bfloat16")


@mutator
class _Quantizer(PyExprMutator):
    def __init__(self, mod, scheme: QuantScheme, checkpoint_names: dict, report: dict,
                 target_spec=None):
        super().__init__(mod)
        self.scheme = scheme
        self.target_spec = target_spec
        self.checkpoint_names = checkpoint_names
        self.report = report
        self.weights: set = set()
        self.bindings: dict = {}
        self.embedding_tables: set = set()
        self.linear_weights: set = set()
        self.stored: dict = {}

    def start(self, func: relax.Function):
        self.weights = set(weight_params(func))
        self.bindings = {}
        self.embedding_tables = set()
        self.linear_weights = set()
        self.stored = {}  # (weight var, format, layout) -> emitted packed arrays (tied tables)
        bindings = {}

        def visit(e):
            if is_op(e, "relax.take"):
                self.embedding_tables.add(e.args[0])

        def collect(b):
            bindings[b.var] = b.value

        relax.analysis.post_order_visit(func, visit)
        for block in func.body.blocks:
            for b in block.bindings:
                collect(b)
        for value in bindings.values():
            parts = linear_parts(value, self.weights, bindings, through_astype=True)
            if parts is not None:
                self.linear_weights.add(parts[1])

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
            if v in self.embedding_tables and v in self.linear_weights:  # tied: also the LM head
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

    def _embedding(self, call):
        """The quantized lookup of a take from a weight table, or None (left as it is)."""
        table = call.args[0]
        if table not in self.weights or table not in self.embedding_tables:
            return None
        shape = list(table.ty.shape) if table.ty.shape is not None else []
        if len(shape) != 2 or not all(isinstance(d, tvm.tirx.IntImm) for d in shape) \
                or str(table.ty.dtype) not in FLOAT_DTYPES:
            return None
        if call.attrs.axis is not None and int(call.attrs.axis) != 0:
            return None
        N, K = int(shape[0]), int(shape[1])
        # a table the LM head multiplies too (tied) is stored twice: in the LM head's format and
        # kernel layout, and in the embedding's format for the lookups (rows layout)
        names = [n for n in self._source_names(table) if n != "lm_head.weight"]
        key = ",".join(names)
        fmt = FLOAT if self.scheme.keeps_float(names) else self.scheme.plan.embedding_format(names)
        layout = "rows"
        if fmt == FLOAT or not get_format(fmt).applies_to(N, K):
            self.report.setdefault("kept_float", {})[key] = [N, K]
            return None
        self.report.setdefault("quantized", {})[key] = {"shape": [N, K], "format": fmt,
                                                        "activations": "lookup"}
        stored = self._stored(table, self.visit_expr(table), fmt, layout, key, N, K)
        ids = self.visit_expr(call.args[1])
        f = get_format(fmt)
        return self.builder_.call_te(
            lambda i, *st: kernels.dequantize_take(list(st), f, i, K, str(table.ty.dtype)),
            ids, *stored, primfunc_name_hint=f"take_{fmt}")

    def _choice(self, names, N, K, int8_ok: bool):
        """(format, layout) of a linear's weight."""
        fmt = FLOAT if self.scheme.keeps_float(names) else self.scheme.plan.format_for(names)
        if fmt == FLOAT or not get_format(fmt).applies_to(N, K):
            return FLOAT, None
        integer = self.scheme.activations in INTEGER_ACTIVATIONS and vnni_applies(N, K) and int8_ok
        return fmt, ("vnni" if integer else "rows")

    def _stored(self, w, w_new, fmt, layout, key, N, K) -> list:
        cache = (w, fmt, layout)
        if cache not in self.stored:
            names = key.split(",")
            kernels.record_weight(key, fmt, K, self.scheme.plan.importance_for(names))
            self.stored[cache] = emit_quantize_weight(self.builder_, w_new, fmt, layout, key, N, K)
        return self.stored[cache]

    def _experts(self, call):
        """A MoE layer's grouped expert GEMM (frontend/moe_relax.py) with its stacked expert
        weight quantized (quantization/experts.py), or None (left float)."""
        from ..quantization import experts

        x, expert, w = call.args[1].fields
        if w not in self.weights or str(w.ty.dtype) not in FLOAT_DTYPES:
            return None
        E, K, N = (int(d) for d in w.ty.shape)
        names = self._source_names(w)
        key = ",".join(names)
        fmt = FLOAT if self.scheme.keeps_float(names) else self.scheme.plan.format_for(names)
        if fmt == FLOAT or not get_format(fmt).applies_to(N, K):
            self.report.setdefault("kept_float", {})[key] = [E * N, K]
            return None
        # shape: the experts' rows stacked, so the report's bits count every expert
        self.report.setdefault("quantized", {})[key] = {
            "shape": [E * N, K], "format": fmt, "activations": "float", "experts": E}
        bb = self.builder_
        if (w, fmt, "experts") not in self.stored:
            shapes = experts.stored_shapes(E, N, K, fmt)
            ty = relax.TupleType([relax.TensorType(sh, d) for sh, d in shapes])
            packed = bb.emit(relax.call_pure_packed(experts.QUANTIZE_EXPERTS_FUNC, self.visit_expr(w),
                                                    tvm.ir.StringImm(fmt), ty_args=ty))
            self.stored[(w, fmt, "experts")] = [bb.emit(relax.TupleGetItem(packed, i))
                                                for i in range(len(shapes))]
        stored = self.stored[(w, fmt, "experts")]
        dtype = str(x.ty.dtype)
        gv = bb.add_func(experts.moe_gemm_dequantize_func(E, N, K, fmt, dtype), f"moe_gemm_{fmt}")
        return bb.emit(relax.call_tir(gv, relax.Tuple([self.visit_expr(x), self.visit_expr(expert),
                                                       *stored]),
                                      out_ty=relax.TensorType([x.ty.shape[0], N], dtype)))

    def visit_call_(self, call):
        if is_op(call, "relax.call_tir") and call.args[0].name_hint.startswith("moe_gemm"):
            out = self._experts(call)
            return out if out is not None else super().visit_call_(call)
        if is_op(call, "relax.take"):
            out = self._embedding(call)
            return out if out is not None else super().visit_call_(call)
        parts = self._linear(call)
        if parts is None:
            return super().visit_call_(call)
        x, w, N, K = parts
        names = self._source_names(w)
        key = ",".join(names)
        fmt, layout = self._choice(names, N, K, x.ty.ndim == 3 and str(x.ty.dtype) == "float32")
        if fmt == FLOAT:
            self.report.setdefault("kept_float", {})[key] = [N, K]
            return super().visit_call_(call)
        self.report.setdefault("quantized", {})[key] = {
            "shape": [N, K], "format": fmt, "activations": self.scheme.activations if layout == "vnni" else "float"}
        bb = self.builder_
        x_new, w_new = self.visit_expr(x), self.visit_expr(w)
        out_dtype = call.attrs.out_dtype
        out_dtype = str(out_dtype) if out_dtype is not None and str(out_dtype) not in ("", "void") \
            else str(x.ty.dtype)
        stored = self._stored(w, w_new, fmt, layout, key, N, K)
        return emit_quantized_matmul(bb, x_new, stored, fmt, layout, K, N, out_dtype,
                                     self.target_spec, INTEGER_ACTIVATIONS.get(self.scheme.activations, 8))


def emit_quantize_weight(bb, w, fmt: str, layout: str, key: str, N: int, K: int) -> list:
    """The packed arrays of weight expression `w` (a build-time call of the numpy quantizer)."""
    shapes = kernels.stored_shapes(N, K, fmt, layout)
    ty = relax.TupleType([relax.TensorType(s, d) for s, d in shapes])
    stored = bb.emit(relax.call_pure_packed(kernels.QUANTIZE_FUNC, w, tvm.ir.StringImm(fmt),
                                            tvm.ir.StringImm(layout), tvm.ir.StringImm(key),
                                            ty_args=ty))
    return [bb.emit(relax.TupleGetItem(stored, i)) for i in range(len(shapes))]


def emit_quantized_matmul(bb, x, stored: list, fmt: str, layout: str, K: int, N: int,
                          out_dtype: str, target_spec=None, act_bits: int = 8):
    """The expression y = x @ W^T for a weight W held as `stored` (scheme.pack's arrays of
    format `fmt` in `layout`): what the pass emits, and what the kernel benchmark and tests
    build around the same kernels. The integer-activation ("vnni") kernel is the target's
    (`target_spec.quantized_matmul_kernel`), with `act_bits` 8 or 16 activations."""
    f = get_format(fmt)
    if layout == "vnni":
        if target_spec is None:
            raise ValueError("the int8-activation layout needs the target spec (its kernel)")
        kernel = target_spec.quantized_matmul_kernel(fmt, K, N, out_dtype, act_bits)
        gv = bb.add_func(kernel, f"{fmt}_a{act_bits}_matmul")
        shape = list(x.ty.shape)[:-1] + [N]
        return relax.call_tir(gv, relax.Tuple([x, *stored]),
                              out_ty=relax.TensorType(shape, out_dtype))
    return bb.call_te(lambda a, *st: kernels.dequantize_matmul(a, list(st), f, out_dtype),
                      x, *stored, primfunc_name_hint=f"{fmt}_matmul")


def quantize_module(mod: tvm.IRModule, scheme: QuantScheme, checkpoint_names: dict,
                    report: dict | None = None, target_spec=None) -> tvm.IRModule:
    report = {} if report is None else report
    q = _Quantizer(mod, scheme, checkpoint_names, report, target_spec)
    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and func.attrs is not None and "num_input" in func.attrs:
            q.start(func)
            new = q.visit_expr(func)
            q.builder_.update_func(gv, relax.analysis.remove_all_unused(new))
    return q.builder_.get()


def QuantizeLinear(scheme: QuantScheme, checkpoint_names: dict | None = None,
                   report: dict | None = None, target_spec=None) -> tvm.transform.Pass:
    """The module pass. `checkpoint_names` maps Relax parameter names to checkpoint names (for
    the plan, --keep-float and the report); `report` collects which weights were quantized;
    `target_spec` gives the int8-activation kernels (needed with activations int8)."""

    def transform(mod, _ctx):
        return quantize_module(mod, scheme, checkpoint_names or {}, report, target_spec)

    return tvm.transform.module_pass(transform, opt_level=0, name="QuantizeLinear")
