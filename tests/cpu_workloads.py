"""Small Relax workloads with the kernels the LLM build produces, for tests and benchmarks.

Each builder returns an IRModule after the same passes the build runs before scheduling
(FuseTransposeMatmul, LegalizeOps, AnnotateTIROpPattern, FoldConstant, FuseOps, FuseTIR).
"""
from __future__ import annotations

import tvm
from tvm import relax, tirx

EPILOGUES = (None, "bias", "silu", "gelu", "residual", "silu_mul")


def host_target(num_cores: int = 2) -> tvm.target.Target:
    """This machine's CPU as the build names it (tvm_llm.targets.llvm: its LLVM name plus the
    features its flags add or remove; TVM's "native" falls back to generic SSE)."""
    from tvm_llm.targets.llvm import LLVMTarget

    spec = dict(LLVMTarget(None).tvm_target().export())
    spec["num-cores"] = num_cores
    return tvm.target.Target({k: v for k, v in spec.items() if k not in ("tag", "keys")})


def amx_skip_reason() -> str | None:
    """Why AMX tile code cannot run here (None: it can). Asks Linux for the tile state, which
    must precede the process's first tile instruction."""
    from tvm_llm.targets.llvm import host_cpu_flags, request_amx_permission

    if "amx_bf16" not in host_cpu_flags():
        return "host CPU has no amx_bf16 flag in /proc/cpuinfo"
    granted, why = request_amx_permission()
    return None if granted else f"Linux refused AMX tile state (arch_prctl): {why}"


def reference_linear(x, w, epilogue, extra):
    """numpy result of the `linear` workload: x @ w.T followed by `epilogue`."""
    import numpy as np

    y = x @ w.T
    if epilogue == "bias":
        y = y + extra
    elif epilogue == "residual":
        y = extra + y
    elif epilogue == "silu":
        y = y / (1 + np.exp(-y))
    elif epilogue == "silu_mul":
        y = y / (1 + np.exp(-y)) * extra
    return y


def lower_to_tir(mod: tvm.IRModule) -> tvm.IRModule:
    seq = tvm.transform.Sequential([
        relax.transform.FuseTransposeMatmul(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ])
    return seq(mod)


def _x_shape(mode, K):
    if mode == "decode":
        return (tirx.Var("b", "int64"), 1, K)
    if mode == "prefill":
        return (1, tirx.Var("n", "int64"), K)
    if mode == "tokens":
        return (tirx.Var("n", "int64"), K)
    return tuple(mode) + (K,)


def _emit_linear(bb, name, K, N, mode="prefill", epilogue=None, dtype="float32", layout="NT",
                 weights_as_params=True):
    xs = _x_shape(mode, K)
    x = relax.Var("x", relax.TensorType(xs, dtype))
    ws = (N, K) if layout == "NT" else (K, N)
    w = relax.Var("w", relax.TensorType(ws, dtype))
    acts, weights = [x], [w]
    extra = None
    if epilogue == "bias":
        extra = relax.Var("bias", relax.TensorType((N,), dtype))
        weights.append(extra)
    elif epilogue in ("residual", "silu_mul"):
        extra = relax.Var("r", relax.TensorType(xs[:-1] + (N,), dtype))
        acts.append(extra)
    attrs = {"num_input": len(acts)} if weights_as_params else None
    with bb.function(name, acts + weights, attrs=attrs):
        with bb.dataflow():
            wt = relax.op.permute_dims(w) if layout == "NT" else w
            y = relax.op.matmul(x, wt)
            if epilogue == "bias":
                y = relax.op.add(y, extra)
            elif epilogue == "silu":
                y = relax.op.nn.silu(y)
            elif epilogue == "gelu":
                y = relax.op.nn.gelu(y)
            elif epilogue == "residual":
                y = relax.op.add(extra, y)
            elif epilogue == "silu_mul":
                y = relax.op.multiply(relax.op.nn.silu(y), extra)
            out = bb.emit_output(y)
        bb.emit_func_output(out)


def linear(K: int, N: int, mode="prefill", epilogue=None, dtype="float32", layout="NT",
           weights_as_params=True) -> tvm.IRModule:
    """y = epilogue(x @ W^T), W of shape (N, K) (layout "NT") or x @ W, W (K, N) ("NN").

    mode: "prefill" x=(1, n, K); "decode" x=(b, 1, K); "tokens" x=(n, K); or a static tuple of
    leading dims. With weights_as_params, main gets num_input (activations, including the
    residual, come first) so AttachAttrLayoutFreeBuffers marks only the weights.
    """
    return linear_suite([dict(name="main", K=K, N=N, mode=mode, epilogue=epilogue, dtype=dtype,
                              layout=layout, weights_as_params=weights_as_params)])


def linear_suite(specs, graph_passes=()) -> tvm.IRModule:
    """Several linear functions in one module (one compile): specs are dicts of _emit_linear's
    arguments, each with a distinct "name". `graph_passes` run on the Relax module before
    lowering (e.g. a target's graph_passes())."""
    bb = relax.BlockBuilder()
    for spec in specs:
        _emit_linear(bb, **spec)
    mod = bb.get()
    for p in graph_passes:
        mod = p(mod)
    return lower_to_tir(mod)


def rms_norm(hidden: int, mode="prefill", dtype="float32", eps=1e-5) -> tvm.IRModule:
    xs = _x_shape(mode, hidden)
    x = relax.Var("x", relax.TensorType(xs, dtype))
    g = relax.Var("g", relax.TensorType((hidden,), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, g]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.rms_norm(x, g, axes=[-1], epsilon=eps))
        bb.emit_func_output(out)
    return lower_to_tir(bb.get())


def layer_norm(hidden: int, mode="prefill", dtype="float32", eps=1e-5) -> tvm.IRModule:
    xs = _x_shape(mode, hidden)
    x = relax.Var("x", relax.TensorType(xs, dtype))
    g = relax.Var("g", relax.TensorType((hidden,), dtype))
    b = relax.Var("b", relax.TensorType((hidden,), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, g, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.layer_norm(x, g, b, axes=[-1], epsilon=eps))
        bb.emit_func_output(out)
    return lower_to_tir(bb.get())


def softmax(width: int, mode="prefill", dtype="float32") -> tvm.IRModule:
    xs = _x_shape(mode, width)
    x = relax.Var("x", relax.TensorType(xs, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.softmax(x, axis=-1))
        bb.emit_func_output(out)
    return lower_to_tir(bb.get())


def elementwise(hidden: int, mode="prefill", op="add", dtype="float32") -> tvm.IRModule:
    xs = _x_shape(mode, hidden)
    x = relax.Var("x", relax.TensorType(xs, dtype))
    y = relax.Var("y", relax.TensorType(xs, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        with bb.dataflow():
            if op == "add":
                r = relax.op.add(x, y)
            elif op == "silu_mul":
                r = relax.op.multiply(relax.op.nn.silu(x), y)
            else:
                raise ValueError(op)
            out = bb.emit_output(r)
        bb.emit_func_output(out)
    return lower_to_tir(bb.get())


def prim_funcs(mod: tvm.IRModule):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def single_prim_func(mod: tvm.IRModule) -> tirx.PrimFunc:
    fs = prim_funcs(mod)
    if len(fs) != 1:
        raise ValueError(f"expected one PrimFunc, got {sorted(fs)}")
    return next(iter(fs.values()))
