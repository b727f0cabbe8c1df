"""The vectorizable float32 exp (schedules/cpu/fast_math.py): no scalar expf calls left in a
vectorized kernel, and exp / sigmoid / SiLU as accurate as numpy's in float64."""
from __future__ import annotations

import re

import numpy as np
import tvm
from tvm.script import tirx as T

from schedules.cpu import fast_math
from cpu_workloads import host_target


def _kernel(dtype):
    @T.prim_func
    def f(a: T.Buffer((4096,), dtype), e: T.Buffer((4096,), dtype), s: T.Buffer((4096,), dtype)):
        for io in range(256):
            for ii in T.vectorized(16):
                e[io * 16 + ii] = T.exp(a[io * 16 + ii])
                s[io * 16 + ii] = a[io * 16 + ii] * T.sigmoid(a[io * 16 + ii])
    return f


def _run(dtype, a):
    lib = tvm.compile(_kernel(dtype), target=host_target())
    bufs = [tvm.runtime.tensor(v) for v in (a, np.zeros_like(a), np.zeros_like(a))]
    lib(*bufs)
    asm = lib.mod.inspect_source("asm") if hasattr(lib, "mod") else lib.inspect_source("asm")
    return bufs[1].numpy(), bufs[2].numpy(), asm


def test_vector_exp_and_silu_are_accurate_and_call_no_expf():
    fast_math.register_fast_exp()
    a = np.linspace(-86, 86, 4096).astype("float32")
    a[:4] = [np.nan, -np.inf, np.inf, 0.0]
    e, s, asm = _run("float32", a)
    assert not re.search(r"call\s.*\bexpf", asm)  # TVM's own lowering: one call per lane
    x = a[4:].astype(np.float64)
    ref = np.exp(x)
    assert (np.abs(e[4:] - ref) / ref).max() < 2.5e-7  # about 2 ulp of float32
    np.testing.assert_allclose(s[4:], x / (1 + np.exp(-x)), rtol=3e-7, atol=1e-30)
    assert np.isnan(e[0]) and np.isnan(s[0])  # NaN in, NaN out
    assert 0 <= e[1] < 1.2e-38 and 2e38 < e[2] < 3e38 and e[3] == 1.0  # clamped, never NaN


def test_float64_keeps_the_exact_exp():
    fast_math.register_fast_exp()
    a = np.linspace(-700, 700, 4096)
    e, s, _ = _run("float64", a)
    np.testing.assert_allclose(e, np.exp(a), rtol=1e-15)
