"""q4_k's compiled scale search (quantization/kquant_search.py, what builds run) against its
torch reference (formats.quantize_kquant_torch): the same codes but for float-rounding ties,
the same squared rounding error, with and without importance weights."""
from __future__ import annotations

import numpy as np
import pytest

from tvm_llm.quantization import kquant_search
from tvm_llm.quantization.formats import (FORMATS, GROUP, kquant_numerators,
                                          quantize_kquant_torch, super_groups)


def _weights(N, K, seed):
    rng = np.random.default_rng(seed)
    # heavy-tailed columns, as real checkpoints have (a few input channels far larger)
    w = (rng.standard_normal((N, K)) * rng.exponential(1.0, (1, K))).astype(np.float32)
    w[0, :32] = -0.5  # a constant negative group
    w[1, 32:64] = 0.0  # an all-zero group
    w[2, 64:96] = 0.25  # a constant positive group
    w[3, 96:128] = np.abs(w[3, 96:128])  # all positive: the minimum clamps to 0
    return w


@pytest.mark.parametrize("N,K,weighted", [(37, 576, False), (37, 576, True), (64, 2048, False),
                                          (5, 96, True)])
def test_compiled_search_matches_torch(N, K, weighted):
    fmt = FORMATS["q4_k"]
    nmax = fmt.qrange[1]
    w = _weights(N, K, seed=N + K)
    x = w.reshape(N * (K // GROUP), GROUP)
    wt = imp = None
    if weighted:  # importance per input channel, shared by every row
        imp = np.random.default_rng(1).uniform(0.05, 4.0, K).astype(np.float32)
        wt = np.broadcast_to(imp.reshape(1, K // GROUP, GROUP), (N, K // GROUP, GROUP)).reshape(-1, GROUP)
    ref = quantize_kquant_torch(x, wt, N, K, nmax)
    got = kquant_search.quantize_blocks(x, imp, N, K, nmax, kquant_numerators(nmax),
                                        super_groups(K))
    assert {k: (v.dtype, v.shape) for k, v in got.items()} == \
        {k: (v.dtype, v.shape) for k, v in ref.items()}
    # float-rounding ties between candidates may pick another code: rare, and never worse
    for key in ("q", "sc", "mn"):
        assert np.mean(got[key] == ref[key]) > 0.99, key
    assert np.mean(got["d"] == ref["d"]) > 0.97 and np.mean(got["dmin"] == ref["dmin"]) > 0.97
    weight = 1.0 if wt is None else wt.reshape(N, K)
    err_got = np.sum(weight * (fmt.dequantize(got) - w) ** 2)
    err_ref = np.sum(weight * (fmt.dequantize(ref) - w) ** 2)
    assert err_got <= err_ref * 1.001, (err_got, err_ref)
    deq = fmt.dequantize(got)
    assert np.all(deq[1, 32:64] == 0)  # the zero group stays exactly zero
    # constant groups: one value (6-bit codes of the super-block's scales: within a few %)
    np.testing.assert_allclose(deq[0, :32], -0.5, rtol=0.05)
    np.testing.assert_allclose(deq[2, 64:96], 0.25, rtol=0.05)


def test_quantize_runs_the_compiled_search():
    """WeightFormat.quantize (every build's path) gives the compiled search's bytes, in row
    chunks on several threads as on one."""
    w = _weights(300, 256, seed=3)  # two row chunks
    f = FORMATS["q4_k"]
    nmax = f.qrange[1]
    direct = kquant_search.quantize_blocks(w.reshape(-1, GROUP), None, 300, 256, nmax,
                                           kquant_numerators(nmax), super_groups(256))
    for threads in (1, 2):
        got = f.quantize(w, threads=threads)
        for key in direct:
            assert np.array_equal(got[key], direct[key]), (threads, key)
