"""dlight's generic rules, after ours, pass a kernel on when they fail on it (schedules/fallbacks.py).

The kernel is the one transformers 5.17 traces for the rotary embedding: a batched matmul whose
reduction has extent 1, which dlight's GEMV claims on CPUs and GPUs and then fails on (it asserts
a reduction loop). Without the wrapper, building it raised AssertionError on both targets.
"""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from gpu_verify import build_with_target_spec


@I.ir_module
class OuterProduct:
    @R.function
    def main(a: R.Tensor(("b", 32, 1), "float32"), p: R.Tensor(("b", 1, 1), "float32")):
        R.func_attr({"tir_var_upper_bound": {"b": 4}})
        with R.dataflow():
            y = R.matmul(a, p)
            R.output(y)
        return y


@pytest.mark.parametrize("kind", ["llvm", "cuda"])
def test_a_matmul_with_a_unit_reduction_builds(kind):
    from tvm_llm.targets import get_target

    spec = get_target(kind, arch="sm_80") if kind == "cuda" else get_target(kind)
    ex = build_with_target_spec(OuterProduct, spec)
    if kind != "llvm":
        return   # compiled to PTX: no GPU here to run it
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 32, 1)).astype("float32")
    p = rng.standard_normal((3, 1, 1)).astype("float32")
    vm = tvm.relax.VirtualMachine(ex, tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(p)).numpy()
    np.testing.assert_allclose(got, a * p, rtol=1e-6)
