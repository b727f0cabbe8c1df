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


def _lowered_tiny(checkpoint, arch="llama"):
    from tvm_llm.config import BuildConfig
    from tvm_llm.front import lower

    return lower(checkpoint(arch), BuildConfig.create(context_window=64), log=lambda *a: None)


def test_chunked_transform_equals_whole(checkpoint):
    """The build's chunked weight transform (one chunk per output here, and one chunk for all)
    gives the arrays of running each lifted transform whole, in the same order; an output that
    is an input passed through is that input's own array (never copied)."""
    from tvm_llm.passes.fold_weights import _TransformPlan, transform_weights

    lowered = _lowered_tiny(checkpoint)
    transforms = lowered.weight_transforms
    assert len(transforms) == 2  # folding (q|k|v, gate|up concatenations), then packing
    params = lowered.imported.params
    expected = params
    for t in transforms:
        expected = _TransformPlan(t).run_whole(expected)
    for chunk_bytes in (1, 1 << 40):
        got = list(transform_weights(transforms, params, chunk_bytes=chunk_bytes))
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and g.shape == e.shape
            np.testing.assert_array_equal(g, e)
    plans = [_TransformPlan(t) for t in transforms]
    assert all(p.chunkable for p in plans)
    passed = [j for j in range(len(expected)) if j in plans[1].passthrough
              and plans[1].passthrough[j] in plans[0].passthrough]
    assert passed  # the norms' weights go through both transforms untouched
    got = list(transform_weights(transforms, params, chunk_bytes=1))
    for j in passed:
        assert got[j] is params[plans[0].passthrough[plans[1].passthrough[j]]]


def test_chunk_groups_consecutive_outputs():
    from tvm_llm.passes.fold_weights import _chunk

    assert _chunk([10, 10, 10, 10, 5], 20) == [[0, 1], [2, 3], [4]]
    assert _chunk([30, 1, 1], 20) == [[0], [1, 2]]
    assert _chunk([1, 2, 3], 1 << 30) == [[0, 1, 2]]


def test_save_weights_refuses_a_short_iterator(tmp_path):
    import pytest

    from tvm_llm.runtime import artifact

    arrays = iter([np.ones(3, np.float32)])
    with pytest.raises(ValueError):
        artifact.save_weights(str(tmp_path / "w.bin"), ["a", "b"], arrays)
