"""Weight folding: every computation on weights alone runs once, at build time.

`LiftTransformParams` moves weight-only work (concatenations made by MergeParallelLinear,
Gemma's 1 + w, casts, layout packing from schedules) out of prefill and decode into one
`transform_params` function. `split_weight_transform` takes that function out of the module;
`apply_weight_transform` compiles it for the build host and runs it on the checkpoint's
weights. The compiled model then receives the transformed weights as parameters and performs
no weight transform on any call.
"""
from __future__ import annotations

import tvm
from tvm import relax

MODEL_FUNCTIONS = ("prefill", "decode", "hidden_states")
TRANSFORM = "transform_params"


def LiftWeightTransforms() -> tvm.transform.Pass:
    """One shared transform_params for prefill, decode and hidden_states (they take the same
    weights); those of them the module has (TVM's pass refuses a listed name it lacks)."""

    def transform(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        names = {gv.name_hint for gv in mod.get_global_vars()}
        present = [f for f in MODEL_FUNCTIONS if f in names]
        return relax.transform.LiftTransformParams(shared_transform=present)(mod)

    return tvm.transform.module_pass(transform, opt_level=0, name="LiftTransformParams")


def split_weight_transform(mod: tvm.IRModule):
    """(module without transform_params, module holding only transform_params, or None).

    When the lifted function only returns its input unchanged, there is nothing to run."""
    if TRANSFORM not in [gv.name_hint for gv in mod.get_global_vars()]:
        return mod, None
    func = mod[TRANSFORM]
    # PrimFuncs the transform calls (e.g. weight quantization) go with it; those only it
    # calls leave the model module.
    used_by_transform = _called_globals(func)
    used_by_model = set()
    for gv, f in mod.functions_items():
        if gv.name_hint != TRANSFORM and isinstance(f, relax.Function):
            used_by_model |= _called_globals(f)
    rest = tvm.IRModule({gv: f for gv, f in mod.functions_items()
                         if gv.name_hint != TRANSFORM
                         and not (gv.name_hint in used_by_transform - used_by_model)},
                        attrs=mod.attrs)
    if isinstance(func.body, relax.SeqExpr) and func.body.body.same_as(func.params[0]):
        return rest, None
    transform = {TRANSFORM: func}
    for gv, f in mod.functions_items():
        if gv.name_hint in used_by_transform:
            transform[gv] = f
    return rest, tvm.IRModule(transform)


def _called_globals(func) -> set:
    names = set()

    def visit(e):
        if isinstance(e, relax.GlobalVar):
            names.add(e.name_hint)

    relax.analysis.post_order_visit(func, visit)
    return names


def weight_param_names(mod: tvm.IRModule, checkpoint_names: dict) -> list:
    """Names of the (transformed) weight parameters of the model functions, in order: the
    checkpoint name for a weight passed through unchanged, `folded.<var>` for a computed one."""
    func = mod[MODEL_FUNCTIONS[0]]
    return [checkpoint_names.get(p.name, f"folded.{p.name}")
            for p in func.params[int(func.attrs["num_input"]):]]


def apply_weight_transform(transform_mod, weights: list) -> list:
    """Run transform_params on numpy `weights` on the build host; return numpy arrays."""
    if transform_mod is None:
        return weights
    import numpy as np

    from .known_warnings import run_filtering_stderr

    target = tvm.target.Target({"kind": "llvm"})
    with target:  # its LegalizeOps lowers takes too: without TVM's "Fast mode" lines
        ex = run_filtering_stderr(lambda: tvm.compile(transform_mod, target=target))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm[TRANSFORM]([_as_tvm(w) for w in weights])
    return [_as_numpy(t) for t in out]


def _as_tvm(array):
    """A TVM tensor over `array`'s own memory where TVM takes it (64-byte aligned, as torch
    allocates, and a dtype DLPack knows), else a copy: the weights are the build's largest
    data, and copying them in and out cost more than the transform itself."""
    import numpy as np

    array = np.ascontiguousarray(array)
    if array.ctypes.data % 64 == 0 and array.dtype.kind in "iufb":
        try:
            return tvm.runtime.from_dlpack(array)
        except (RuntimeError, TypeError, BufferError):
            pass
    return tvm.runtime.tensor(array, tvm.cpu())


def _as_numpy(tensor):
    """A numpy view of a host TVM tensor (a copy for dtypes numpy's DLPack lacks: bfloat16)."""
    import numpy as np

    try:
        return np.from_dlpack(tensor)
    except (RuntimeError, TypeError, BufferError):
        return tensor.numpy()
