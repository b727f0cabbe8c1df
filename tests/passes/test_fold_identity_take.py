import numpy as np
import tvm
from tvm.script import relax as R

from relax_util import compile_and_run, op_names, random
from tvm_llm.passes.fold_identity_take import FoldIdentityTake


@tvm.script.ir_module
class Identity:
    @R.function
    def main(x: R.Tensor((4, 3, 8), "float32")):
        with R.dataflow():
            y = R.take(x, R.const(np.arange(3, dtype="int64")), axis=1)
            z = R.add(y, y)
            R.output(z)
        return z


@tvm.script.ir_module
class Gather:  # a real gather (last position only): must stay
    @R.function
    def main(x: R.Tensor((4, 3, 8), "float32")):
        with R.dataflow():
            y = R.take(x, R.const(np.array([2], dtype="int64")), axis=1)
            z = R.add(y, y)
            R.output(z)
        return z


def test_before_after():
    assert op_names(FoldIdentityTake()(Identity)["main"]) == ["relax.add"]


def test_keeps_real_gathers():
    assert "relax.take" in op_names(FoldIdentityTake()(Gather)["main"])


def test_numerics_on_vs_off():
    x = random((4, 3, 8))
    for mod in (Identity, Gather):
        np.testing.assert_allclose(compile_and_run(FoldIdentityTake()(mod), "main", [x]),
                                   compile_and_run(mod, "main", [x]), atol=1e-6)
