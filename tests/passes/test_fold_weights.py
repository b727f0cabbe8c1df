import numpy as np
import tvm
from tvm import relax
from tvm.script import relax as R

from relax_util import compile_and_run, op_names, random
from tvm_llm.passes.fold_weights import (LiftWeightTransforms, apply_weight_transform,
                                         split_weight_transform)


@tvm.script.ir_module
class Model:
    @R.function
    def prefill(x: R.Tensor((2, 8), "float32"), w1: R.Tensor((4, 8), "float32"),
                w2: R.Tensor((4, 8), "float32"), g: R.Tensor((8,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            w = R.concat((w1, w2), axis=0)
            g1 = R.add(g, R.const(1.0, "float32"))
            y = R.matmul(R.multiply(x, g1), R.permute_dims(w))
            R.output(y)
        return y

    @R.function
    def decode(x: R.Tensor((1, 8), "float32"), w1: R.Tensor((4, 8), "float32"),
               w2: R.Tensor((4, 8), "float32"), g: R.Tensor((8,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            w = R.concat((w1, w2), axis=0)
            g1 = R.add(g, R.const(1.0, "float32"))
            y = R.matmul(R.multiply(x, g1), R.permute_dims(w))
            R.output(y)
        return y


@tvm.script.ir_module
class NothingToFold:  # weights used as they are
    @R.function
    def prefill(x: R.Tensor((2, 8), "float32"), w: R.Tensor((8, 4), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            y = R.matmul(x, w)
            R.output(y)
        return y

    @R.function
    def decode(x: R.Tensor((1, 8), "float32"), w: R.Tensor((8, 4), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            y = R.matmul(x, w)
            R.output(y)
        return y


def _weights():
    return [random((4, 8), 1), random((4, 8), 2), random((8,), 3)]


def test_weight_only_work_leaves_the_model_functions():
    mod, transform = split_weight_transform(LiftWeightTransforms()(Model))
    assert transform is not None and "transform_params" not in [g.name_hint for g in mod.get_global_vars()]
    for name in ("prefill", "decode"):
        ops = op_names(mod[name])
        assert "relax.concat" not in ops and "relax.add" not in ops, ops
        assert len(mod[name].params) == 1 + 2  # x, merged weight, 1 + g


def test_nothing_to_fold_gives_no_transform():
    mod, transform = split_weight_transform(LiftWeightTransforms()(NothingToFold))
    assert transform is None
    assert len(mod["prefill"].params) == 2


def test_numerics_folded_vs_unfolded():
    x, weights = random((2, 8), 0), _weights()
    expected = compile_and_run(Model, "prefill", [x] + weights)
    mod, transform = split_weight_transform(LiftWeightTransforms()(Model))
    folded = apply_weight_transform(transform, weights)
    got = compile_and_run(mod, "prefill", [x] + folded)
    np.testing.assert_allclose(got, expected, atol=1e-5)
