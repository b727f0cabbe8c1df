import numpy as np
import tvm
from tvm import relax
from tvm.script import relax as R

from relax_util import compile_and_run, op_names, random
from tvm_llm.passes.unflatten_linear import UnflattenLinear


@tvm.script.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((2, 5, 8), "float32"), w: R.Tensor((6, 8), "float32")):
        with R.dataflow():
            flat = R.reshape(x, R.shape([10, 8]))
            wt = R.permute_dims(w)
            y = R.matmul(flat, wt)
            out = R.reshape(y, R.shape([2, 5, 6]))
            R.output(out)
        return out


@tvm.script.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((2, 5, 8), "float32"), w: R.Tensor((6, 8), "float32")):
        with R.dataflow():
            out = R.matmul(x, R.permute_dims(w))
            R.output(out)
        return out


@tvm.script.ir_module
class Mismatched:  # the outer reshape does not restore x's leading shape: must not fire
    @R.function
    def main(x: R.Tensor((2, 5, 8), "float32"), w: R.Tensor((6, 8), "float32")):
        with R.dataflow():
            flat = R.reshape(x, R.shape([10, 8]))
            y = R.matmul(flat, R.permute_dims(w))
            out = R.reshape(y, R.shape([5, 2, 6]))
            R.output(out)
        return out


def test_before_after():
    after = relax.transform.CanonicalizeBindings()(UnflattenLinear()(Before))
    after = relax.transform.DeadCodeElimination()(after)
    tvm.ir.assert_structural_equal(after, Expected)


def test_does_not_fire_when_leading_shape_changes():
    after = UnflattenLinear()(Mismatched)
    assert op_names(after["main"]).count("relax.reshape") == 2


def test_numerics_on_vs_off():
    x, w = random((2, 5, 8), 1), random((6, 8), 2)
    off = compile_and_run(Before, "main", [x, w])
    on = compile_and_run(UnflattenLinear()(Before), "main", [x, w])
    np.testing.assert_allclose(on, off, atol=1e-5)
    np.testing.assert_allclose(on, x @ w.T, atol=1e-5)


@tvm.script.ir_module
class HalfInFloatOut:  # fp16 operands accumulated to fp32 (how the importer emits fp16 linears)
    @R.function
    def main(x: R.Tensor((2, 5, 8), "float16"), w: R.Tensor((6, 8), "float16")):
        with R.dataflow():
            flat = R.reshape(x, R.shape([10, 8]))
            y = R.matmul(flat, R.permute_dims(w), out_dtype="float32")
            out = R.reshape(y, R.shape([2, 5, 6]))
            R.output(out)
        return out


def test_keeps_the_output_dtype():
    after = UnflattenLinear()(HalfInFloatOut)["main"]
    assert op_names(after).count("relax.reshape") == 0
    assert after.ret_ty.dtype == "float32"


@tvm.script.ir_module
class CastFlatInput:  # a bfloat16 model's linear: float32 stream, flattened, rounded, matmul
    @R.function
    def main(x: R.Tensor((2, 5, 8), "float32"), w: R.Tensor((6, 8), "bfloat16")):
        with R.dataflow():
            flat = R.reshape(x, R.shape([10, 8]))
            xb = R.astype(flat, "bfloat16")
            y = R.matmul(xb, R.permute_dims(w), out_dtype="float32")
            out = R.reshape(y, R.shape([2, 5, 6]))
            R.output(out)
        return out


def test_sees_through_the_input_cast():
    import ml_dtypes

    after = UnflattenLinear()(CastFlatInput)
    ops = op_names(after["main"])
    assert ops.count("relax.reshape") == 0 and ops.count("relax.astype") == 1
    x = random((2, 5, 8), 1)
    w = random((6, 8), 2).astype(ml_dtypes.bfloat16)
    off = compile_and_run(CastFlatInput, "main", [x, w])
    on = compile_and_run(after, "main", [x, w])
    np.testing.assert_allclose(on, off, rtol=1e-6, atol=1e-6)
