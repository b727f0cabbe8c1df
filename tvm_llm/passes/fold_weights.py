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
    return list(transform_weights([transform_mod], weights))


CHUNK_BYTES = 256 << 20


def transform_weights(transforms: list, weights: list, chunk_bytes: int = CHUNK_BYTES):
    """An iterator over the weights after every transform in `transforms` (applied in order),
    in output order, computed a chunk of about `chunk_bytes` of outputs at a time as it is
    consumed. Every transform is compiled before this returns, on the caller's thread: the
    iterator itself only runs compiled code, so another thread may consume it while this one
    compiles (the build writes the weights beside its codegen; TVM's compiler is never run
    in two threads at once).

    Why chunks: run whole, a transform holds every input (aligned copies), every intermediate
    and every output at once, and the build then writes them all: llama-1b fp32 peaked at
    13.4 GB for 4.4 GB of weights, and its first touches of that memory (~3 M page faults)
    cost more system time than the transform's own work. Chunk by chunk, each output is
    computed from only the inputs it depends on, handed on (the build writes it), and dropped,
    so the next chunk reuses the same memory. Outputs that are an input passed through are
    never copied. Each transform is compiled once, one Relax function per chunk."""
    weights = list(weights)
    plans = [_TransformPlan(t) for t in transforms if t is not None]
    if not plans:
        return iter(weights)
    if not all(p.chunkable for p in plans):  # a transform reads its parameter tuple whole
        for plan in plans:
            weights = plan.run_whole(weights)
        return iter(weights)
    chunks = _chunk(plans[-1].output_bytes, chunk_bytes)
    # per chunk, per transform (last first): the outputs it must give, from which inputs
    needs = []
    for outputs in chunks:
        levels, want = [], outputs
        for plan in reversed(plans):
            inputs = sorted(set().union(*(plan.deps[j] for j in want)))
            levels.append((want, inputs))
            want = inputs
        needs.append(levels[::-1])
    runners = [plan.compile([levels[k] for levels in needs]) for k, plan in enumerate(plans)]
    return _run_chunks(runners, needs, chunks, weights)


def _run_chunks(runners: list, needs: list, chunks: list, weights: list):
    """transform_weights' iterator: per chunk, each transform's compiled runner in turn."""
    for c, levels in enumerate(needs):
        values = {i: weights[i] for i in levels[0][1]}
        for run in runners:
            values = run(c, values)
        for j in chunks[c]:
            yield values.pop(j)


def _chunk(sizes: list, chunk_bytes: int) -> list:
    """Consecutive output indices grouped so that each group holds about chunk_bytes."""
    chunks, current, total = [], [], 0
    for j, size in enumerate(sizes):
        current.append(j)
        total += size
        if total >= chunk_bytes:
            chunks.append(current)
            current, total = [], 0
    if current:
        chunks.append(current)
    return chunks


class _TransformPlan:
    """One lifted transform_params: which inputs each output reads, which outputs are an input
    passed through, and how to build a function computing a subset of the outputs."""

    def __init__(self, mod):
        self.mod = mod
        func = mod[TRANSFORM]
        self.output_bytes = [_static_bytes(f) for f in func.ret_ty.fields]
        graph = _dataflow(func)
        self.chunkable = graph is not None
        if graph is None:
            return
        self.deps, self.passthrough = graph

    def run_whole(self, weights: list) -> list:
        vm = _compile(self.mod)
        out = vm[TRANSFORM]([_as_tvm(w) for w in weights])
        return [_as_numpy(t) for t in out]

    def compile(self, needs: list):
        """runner(chunk, {input index: array}) -> {output index: array} for each chunk's
        (outputs, inputs) in `needs`; the functions of all chunks compiled in one module."""
        functions, computed = {}, []
        for c, (outputs, inputs) in enumerate(needs):
            todo = [j for j in outputs if j not in self.passthrough]
            computed.append(todo)
            if todo:
                name = f"{TRANSFORM}_{c}"
                functions[name] = _subset(self.mod[TRANSFORM], todo, inputs).with_attr(
                    "global_symbol", name)
        vm = None
        if functions:
            others = {gv: f for gv, f in self.mod.functions_items() if gv.name_hint != TRANSFORM}
            vm = _compile(tvm.IRModule({**others, **functions}))

        def run(c, values):
            outputs, inputs = needs[c]
            out = {j: values[self.passthrough[j]] for j in outputs if j in self.passthrough}
            if computed[c]:
                results = vm[f"{TRANSFORM}_{c}"]([_as_tvm(values[i]) for i in inputs])
                out.update(zip(computed[c], (_as_numpy(t) for t in results)))
            return out

        return run


def _compile(mod):
    from .known_warnings import run_filtering_stderr

    target = tvm.target.Target({"kind": "llvm"})
    with target:  # its LegalizeOps lowers takes too: without TVM's "Fast mode" lines
        ex = run_filtering_stderr(lambda: tvm.compile(mod, target=target))
    return relax.VirtualMachine(ex, tvm.cpu())


def _static_bytes(ty) -> int:
    """Bytes of a weight of static shape (a symbolic one counts as 0: it cannot be sized)."""
    n = 1
    for d in ty.shape.values:
        if not isinstance(d, tvm.tirx.IntImm):
            return 0
        n *= int(d)
    return n * tvm.DataType(str(ty.dtype.dtype)).bits // 8


def _bindings(func):
    return [b for block in func.body.blocks for b in block.bindings]


def _output_fields(func):
    """The expressions of the returned tuple (the body is a tuple, or a var bound to one)."""
    body = func.body.body
    if isinstance(body, relax.Var):
        for b in _bindings(func):
            if b.var.same_as(body):
                body = b.value
                break
    return list(body.fields) if isinstance(body, relax.Tuple) else None


def _dataflow(func):
    """(deps: output -> set of input indices, passthrough: output -> input index), or None
    when the function uses its parameter tuple other than by field (then it runs whole)."""
    param = func.params[0]
    deps, source = {}, {}

    def reads(expr) -> set | None:
        if isinstance(expr, relax.TupleGetItem) and expr.tuple_value.same_as(param):
            return {int(expr.index)}
        out = set()
        for v in relax.analysis.free_vars(expr):
            if v.same_as(param):
                return None
            out |= deps.get(v, set())
        return out

    for b in _bindings(func):
        if not isinstance(b, relax.VarBinding):
            return None
        r = reads(b.value)
        if r is None:
            return None
        deps[b.var] = r
        if isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value.same_as(param):
            source[b.var] = int(b.value.index)
    fields = _output_fields(func)
    if fields is None:
        return None
    out_deps, passthrough = [], {}
    for j, f in enumerate(fields):
        r = reads(f)
        if r is None:
            return None
        out_deps.append(r)
        if isinstance(f, relax.Var) and f in source:
            passthrough[j] = source[f]
        elif isinstance(f, relax.TupleGetItem) and f.tuple_value.same_as(param):
            passthrough[j] = int(f.index)
    return out_deps, passthrough


def _subset(func, outputs: list, inputs: list):
    """A copy of `func` that takes only the fields `inputs` of its parameter tuple (in that
    order) and returns only its outputs `outputs`: the bindings they need, nothing else."""
    func = relax.utils.copy_with_new_vars(func)
    param = func.params[0]
    fields = _output_fields(func)
    position = {i: k for k, i in enumerate(inputs)}
    new_param = relax.Var("params", relax.TupleType(
        [param.ty.fields[i] for i in inputs]))
    needed = set()
    for j in outputs:
        needed |= set(relax.analysis.free_vars(fields[j]))
    blocks = []
    for block in reversed(func.body.blocks):
        kept = []
        for b in reversed(block.bindings):
            if b.var not in needed:
                continue
            needed |= set(relax.analysis.free_vars(b.value))
            value = b.value
            if isinstance(value, relax.TupleGetItem) and value.tuple_value.same_as(param):
                value = relax.TupleGetItem(new_param, position[int(value.index)])
            kept.append(relax.VarBinding(b.var, value))
        blocks.append((block, kept[::-1]))
    blocks = blocks[::-1]
    result = relax.Var("out", relax.TupleType(
        [func.ret_ty.fields[j] for j in outputs]))
    out_binding = relax.VarBinding(result, relax.Tuple([fields[j] for j in outputs]))
    new_blocks = []
    for k, (block, kept) in enumerate(blocks):
        if k == len(blocks) - 1:
            kept = kept + [out_binding]
        make = relax.DataflowBlock if isinstance(block, relax.DataflowBlock) else relax.BindingBlock
        if kept:
            new_blocks.append(make(kept))
    return relax.Function([new_param], relax.SeqExpr(new_blocks, result),
                          result.ty, func.is_pure, func.attrs)


def _as_tvm(array):
    """A TVM tensor over `array`'s own memory where TVM takes it (64-byte aligned and a dtype
    DLPack knows), else a copy: the weights are the build's largest data, and copying them in
    and out cost more than the transform itself. Weights read from safetensors sit 32 bytes off
    TVM's alignment; torch makes their aligned copy (64-byte aligned, ~2.4x faster than
    tvm.runtime.tensor's copy here: 4.4 GB of llama-1b, ~9 s -> ~4 s)."""
    import numpy as np

    array = np.ascontiguousarray(array)
    if array.dtype.kind in "iufb":
        if array.ctypes.data % 64:
            import torch

            array = torch.from_numpy(array).clone().numpy()
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
