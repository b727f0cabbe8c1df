"""Decode as CUDA Graphs: what TVM's RewriteCUDAGraph captures, and letting it capture decode.

`relax.transform.RewriteCUDAGraph` (run after StaticPlanBlockMemory, with the PassContext
option `relax.backend.use_cuda_graph`) lifts each *static region* of a function into its own
function that the VM runs through `vm.builtin.cuda_graph.run_or_capture`: captured on the
first call, replayed afterwards; the plan's storages move into one function called through
`vm.builtin.cuda_graph.get_cached_alloc`, so their addresses never change. A binding is
static when every argument is a weight (a parameter after `num_input`), a constant or a
tensor carved from a constant-size planned storage, and every symbolic shape variable it
uses is one the function names in `relax.rewrite_cuda_graph.capture_symbolic_vars`: then one
graph is captured per value of those variables. Calls to `vm.builtin.*` (the paged-KV
attention) and kernels that read a runtime input (the token ids, the positions) are not
captured; they end a region, and the kernels after them start the next one. Neither is the
last kernel (the LM head): the logits it writes are returned, so their storage is allocated
per call. A decode step of an L-layer model thus replays L + 2 graphs and launches L + 3
kernels outside them (token ids, positions, L attention calls, LM head).

Decode's only symbolic variable is the batch size, bounded by --max-batch-size, so
`CaptureDecodeBatch` names it: decode is captured once per batch size met (at most
max_batch_size graphs per region). Prefill's token count takes hundreds of values; its
functions are left uncaptured.
"""
from __future__ import annotations

import tvm
from tvm import relax

CAPTURE_ATTR = "relax.rewrite_cuda_graph.capture_symbolic_vars"
RUN_OR_CAPTURE = "vm.builtin.cuda_graph.run_or_capture"
GET_CACHED_ALLOC = "vm.builtin.cuda_graph.get_cached_alloc"


@tvm.transform.module_pass(opt_level=0, name="CaptureDecodeBatch")
class CaptureDecodeBatch:
    """Mark `functions`' bounded symbolic variables (their tir_var_upper_bound: decode's batch
    size) as ones a CUDA Graph may be captured for, one graph per value."""

    def __init__(self, functions=("decode",)):
        self.functions = tuple(functions)

    def transform_module(self, mod, _ctx):
        for gv, func in list(mod.functions_items()):
            if gv.name_hint not in self.functions or not isinstance(func, relax.Function):
                continue
            bounds = func.attrs.get("tir_var_upper_bound") if func.attrs else None
            if bounds:
                mod[gv] = func.with_attr(CAPTURE_ATTR, [str(k) for k in bounds.keys()])
        return mod


def captured_region(expr) -> str | None:
    """The name of the captured function `expr` replays, if it is a
    `call_builtin_with_ctx(run_or_capture, (region, args, index, shape))` call."""
    if not isinstance(expr, relax.Call) or getattr(expr.op, "name", "") != "relax.call_builtin_with_ctx":
        return None
    callee = expr.args[0]
    if not isinstance(callee, relax.ExternFunc) or str(callee.global_symbol) != RUN_OR_CAPTURE:
        return None
    return expr.args[1].fields[0].name_hint
