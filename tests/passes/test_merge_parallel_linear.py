import numpy as np
import tvm
from tvm import relax
from tvm.script import relax as R

from relax_util import compile_and_run, op_names, random
from tvm_llm.passes.merge_parallel_linear import MergeParallelLinear


def _qkv_module(with_bias: bool, heads: bool):
    """x @ Wq^T, x @ Wk^T, x @ Wv^T (+ biases), optionally reshaped into heads of 4."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 3, 8], "float32"))
    ws = [relax.Var(n, relax.TensorType([r, 8], "float32")) for n, r in (("wq", 8), ("wk", 4), ("wv", 4))]
    bs = [relax.Var(n, relax.TensorType([r], "float32")) for n, r in (("bq", 8), ("bk", 4), ("bv", 4))]
    params = [x] + ws + (bs if with_bias else [])
    with bb.function("main", params, attrs={"num_input": 1}):
        with bb.dataflow():
            outs = []
            for w, b in zip(ws, bs):
                y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
                if with_bias:
                    y = bb.emit(relax.op.add(y, b))
                if heads:
                    y = bb.emit(relax.op.reshape(y, [1, 3, int(w.ty.shape[0]) // 4, 4]))
                outs.append(y)
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _inputs(with_bias):
    arrs = [random((1, 3, 8), 0), random((8, 8), 1), random((4, 8), 2), random((4, 8), 3)]
    if with_bias:
        arrs += [random((8,), 4), random((4,), 5), random((4,), 6)]
    return arrs


def _run_both(mod, with_bias):
    args = _inputs(with_bias)
    before = compile_and_run(mod, "main", args)
    after = compile_and_run(MergeParallelLinear()(mod), "main", args)
    for a, b in zip(after, before):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_before_after_structure_qkv():
    after = MergeParallelLinear()(_qkv_module(with_bias=False, heads=False))
    ops = op_names(after["main"])
    assert ops.count("relax.matmul") == 1
    assert ops.count("relax.concat") == 1  # the weights, lifted to build time by the folding phase
    assert ops.count("relax.strided_slice") == 3


def test_biases_are_merged_too():
    ops = op_names(MergeParallelLinear()(_qkv_module(with_bias=True, heads=False))["main"])
    assert ops.count("relax.matmul") == 1 and ops.count("relax.add") == 1
    assert ops.count("relax.concat") == 2


def test_heads_are_sliced_after_one_reshape():
    ops = op_names(MergeParallelLinear()(_qkv_module(with_bias=False, heads=True))["main"])
    assert ops.count("relax.reshape") == 1 and ops.count("relax.strided_slice") == 3


def test_numerics_on_vs_off():
    for with_bias in (False, True):
        for heads in (False, True):
            _run_both(_qkv_module(with_bias, heads), with_bias)


@tvm.script.ir_module
class DifferentInputs:  # two linears reading different activations: nothing to merge
    @R.function
    def main(x: R.Tensor((2, 8), "float32"), y: R.Tensor((2, 8), "float32"),
             w1: R.Tensor((4, 8), "float32"), w2: R.Tensor((4, 8), "float32")):
        R.func_attr({"num_input": 2})
        with R.dataflow():
            a = R.matmul(x, R.permute_dims(w1))
            b = R.matmul(y, R.permute_dims(w2))
            out = (a, b)
            R.output(out)
        return out


@tvm.script.ir_module
class ActivationRhs:  # the right operand is an activation, not a weight: not a linear
    @R.function
    def main(x: R.Tensor((2, 8), "float32"), k1: R.Tensor((4, 8), "float32"),
             k2: R.Tensor((4, 8), "float32")):
        R.func_attr({"num_input": 3})
        with R.dataflow():
            a = R.matmul(x, R.permute_dims(k1))
            b = R.matmul(x, R.permute_dims(k2))
            out = (a, b)
            R.output(out)
        return out


def test_does_not_fire_without_a_shared_input_or_weights():
    for mod in (DifferentInputs, ActivationRhs):
        tvm.ir.assert_structural_equal(MergeParallelLinear()(mod), mod)


def test_keeps_the_output_dtype():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([3, 8], "float16"))
    w1 = relax.Var("w1", relax.TensorType([4, 8], "float16"))
    w2 = relax.Var("w2", relax.TensorType([4, 8], "float16"))
    with bb.function("main", [x, w1, w2], attrs={"num_input": 1}):
        with bb.dataflow():
            a = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w1), out_dtype="float32"))
            b = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w2), out_dtype="float32"))
            out = bb.emit_output(relax.Tuple([a, b]))
        bb.emit_func_output(out)
    after = MergeParallelLinear()(bb.get())["main"]
    assert op_names(after).count("relax.matmul") == 1
    assert [f.dtype for f in after.ret_ty.fields] == ["float32", "float32"]
