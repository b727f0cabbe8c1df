import numpy as np
import tvm
from tvm.script import relax as R

from relax_util import compile_and_run, op_names, random
from tvm_llm.passes.fuse_rms_norm import FuseRMSNorm


@tvm.script.ir_module
class Spelled:  # how transformers' LlamaRMSNorm arrives from the importer
    @R.function
    def main(x: R.Tensor((2, 3, 16), "float32"), w: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            sq = R.power(x, R.const(2.0, "float32"))
            var = R.mean(sq, axis=[-1], keepdims=True)
            inv = R.rsqrt(R.add(var, R.const(1e-6, "float32")))
            normed = R.multiply(x, inv)
            out = R.multiply(w, normed)
            R.output(out)
        return out


@tvm.script.ir_module
class GemmaStyle:  # weight is (1 + w): a weight-only expression, folded into the op
    @R.function
    def main(x: R.Tensor((2, 3, 16), "float32"), w: R.Tensor((16,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            sq = R.multiply(x, x)
            var = R.mean(sq, axis=[2], keepdims=True)
            normed = R.multiply(x, R.rsqrt(R.add(var, R.const(1e-6, "float32"))))
            out = R.multiply(normed, R.add(R.const(1.0, "float32"), w))
            R.output(out)
        return out


@tvm.script.ir_module
class NotANorm:  # mean over the wrong axis and a cube: must not fire
    @R.function
    def main(x: R.Tensor((2, 3, 16), "float32")):
        with R.dataflow():
            a = R.mean(R.power(x, R.const(2.0, "float32")), axis=[1], keepdims=True)
            b = R.multiply(x, R.rsqrt(R.add(a, R.const(1e-6, "float32"))))
            c = R.mean(R.power(x, R.const(3.0, "float32")), axis=[-1], keepdims=True)
            d = R.multiply(b, R.rsqrt(R.add(c, R.const(1e-6, "float32"))))
            R.output(d)
        return d


def test_before_after_one_rms_norm_with_the_weight():
    after = FuseRMSNorm()(Spelled)["main"]
    ops = op_names(after)
    assert ops == ["relax.nn.rms_norm"]
    assert after.body.blocks[0].bindings[-1].value.args[1].same_as(after.params[1])


def test_gemma_weight_expression_is_folded_in():
    ops = op_names(FuseRMSNorm()(GemmaStyle)["main"])
    assert ops.count("relax.nn.rms_norm") == 1 and "relax.rsqrt" not in ops


def test_does_not_fire_on_other_reductions():
    assert "relax.nn.rms_norm" not in op_names(FuseRMSNorm()(NotANorm)["main"])


def test_numerics_on_vs_off():
    x, w = random((2, 3, 16), 0), random((16,), 1)
    for mod in (Spelled, GemmaStyle):
        off = compile_and_run(mod, "main", [x, w])
        on = compile_and_run(FuseRMSNorm()(mod), "main", [x, w])
        np.testing.assert_allclose(on, off, atol=1e-5)
    x = random((2, 3, 16), 2)
    np.testing.assert_allclose(compile_and_run(FuseRMSNorm()(NotANorm), "main", [x]),
                               compile_and_run(NotANorm, "main", [x]), atol=1e-5)
