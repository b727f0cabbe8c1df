"""Shape buckets: static kernel copies and the run-time dispatch (no tuning involved)."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax

from toy import Toy
from tvm_llm.tune.buckets import (BUCKET_ATTR, Bucket, is_static, parse_buckets,
                                  specialize_buckets)


def test_bucket_parse_and_print():
    assert str(Bucket.parse("decode:b=1")) == "decode:b=1"
    b = Bucket.parse(" prefill : n=128 , m=1 ")
    assert (b.func, b.values, b.tag) == ("prefill", (("n", 128), ("m", 1)), "n128_m1")
    assert parse_buckets(["decode:b=1 decode:b=4", "decode:b=1"]) == [
        Bucket("decode", (("b", 1),)), Bucket("decode", (("b", 4),))]
    for bad in ("decode", "decode:", "decode:b", "decode:b=0", ":b=1", "decode:b=x"):
        with pytest.raises(ValueError, match="bad shape bucket"):
            Bucket.parse(bad)


def test_copy_and_dispatch_are_added():
    mod, info = specialize_buckets(Toy, parse_buckets(["decode:b=1", "decode:b=4"]))
    assert [i["function"] for i in info] == ["decode__b1", "decode__b4"]
    assert info[0]["kernels"] == {"nt_matmul__b1": "nt_matmul", "relu__b1": "relu"}
    k = mod["nt_matmul__b1"]
    assert is_static(k) and str(k.attrs[BUCKET_ATTR]) == "decode:b=1"
    assert not is_static(mod["nt_matmul"])  # the generic kernel stays for other sizes
    relax.analysis.well_formed(mod)
    text = mod["decode"].script()
    assert "b == 1" in text and "b == 4" in text and "decode__b1" in text


def test_keep_and_unusable_buckets():
    said = []
    mod, info = specialize_buckets(Toy, parse_buckets(["decode:b=1"]), keep=lambda f: False,
                                   log=said.append)
    assert info == [] and tvm_ffi.structural_equal(mod["decode"], Toy["decode"])
    mod, info = specialize_buckets(
        Toy, parse_buckets(["decode:b=16", "decode:q=1", "prefill:n=8"]), log=said.append)
    assert info == []
    assert any("exceeds the build's bound 8" in m for m in said)
    assert any("has no symbolic size 'q'" in m for m in said)
    assert any("no function 'prefill'" in m for m in said)


def _run(mod, b):
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    called = []

    def instrument(func, name, before, ret, *args):
        if before:
            called.append(str(name))
        return 0

    vm.set_instrument(tvm_ffi.convert(instrument))
    rng = np.random.default_rng(b)
    x = rng.standard_normal((b, 32)).astype("float32")
    w = rng.standard_normal((64, 32)).astype("float32")
    out = vm["decode"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    np.testing.assert_allclose(out, np.maximum(x @ w.T, 0), rtol=1e-5, atol=1e-5)
    return called


def test_dispatch_runs_the_copy_only_inside_the_bucket():
    mod, _ = specialize_buckets(Toy, parse_buckets(["decode:b=1", "decode:b=4"]))
    assert "nt_matmul__b1" in _run(mod, 1)
    assert "nt_matmul__b4" in _run(mod, 4)
    called = _run(mod, 3)  # outside every bucket: the generic kernels
    assert "nt_matmul" in called and not any("__b" in c for c in called)
