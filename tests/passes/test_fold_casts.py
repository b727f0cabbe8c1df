"""FoldCasts: identity casts and bfloat16 -> float32 -> bfloat16 round trips (through reshapes)
disappear; a narrowing cast that changes values stays."""
import ml_dtypes
import numpy as np
import tvm
from tvm.script import relax as R

from relax_util import compile_and_run, op_names
from tvm_llm.passes.fold_casts import FoldCasts


@tvm.script.ir_module
class Before:
    @R.function
    def main(a: R.Tensor((2, 3, 8), "bfloat16"), r: R.Tensor((2, 24), "float32")):
        with R.dataflow():
            wide = R.astype(a, "float32")
            flat = R.reshape(R.reshape(wide, R.shape([6, 8])), R.shape([2, 24]))
            back = R.astype(flat, "bfloat16")  # round trip: back == reshape(a)
            same = R.astype(r, "float32")  # identity
            kept = R.astype(same, "bfloat16")  # float32 -> bfloat16 rounds: stays
            out = R.tuple(back, kept)
            R.output(out)
        return out


def test_before_after():
    after = FoldCasts()(Before)
    ops = op_names(after["main"])
    assert ops.count("relax.astype") == 1  # only the rounding of r
    assert ops.count("relax.reshape") == 2


def test_numerics_unchanged():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3, 8)).astype(ml_dtypes.bfloat16)
    r = rng.standard_normal((2, 24)).astype("float32")
    before = compile_and_run(Before, "main", [a, r])
    after = compile_and_run(FoldCasts()(Before), "main", [a, r])
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x.view(np.uint16), y.view(np.uint16))
    np.testing.assert_array_equal(after[0].view(np.uint16), a.reshape(2, 24).view(np.uint16))
