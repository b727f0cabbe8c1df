"""schedules/cpu/mla_attention.py: the latent decode kernel against numpy attention."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.parametrize("heads,chunks", [(8, None), (6, 2)])
def test_latent_decode_kernel_matches_numpy(heads, chunks):
    import tvm

    from schedules.cpu.mla_attention import head_chunks, latent_decode_attention_func

    D, PAGE, scale = 40, 8, 0.3
    lengths = [3, 17, 8]                        # partial, multi-page and exactly-full last pages
    rng = np.random.default_rng(0)
    npages = [-(-n // PAGE) for n in lengths]
    order = rng.permutation(sum(npages) + 2)    # pages of the sequences scattered in the pool
    pages = rng.standard_normal((len(order), 2, 1, PAGE, D)).astype("float32")
    pages[:, 1] = rng.standard_normal(pages[:, 1].shape)  # garbage V plane: must be unread
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype("int32")
    values = order[:sum(npages)].astype("int32")
    last = np.array([(n - 1) % PAGE + 1 for n in lengths], "int32")
    q = rng.standard_normal((len(lengths), heads, D)).astype("float32")

    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    func = latent_decode_attention_func(heads, D, "float32", page_size=PAGE, chunks=chunks)
    f = tvm.compile(tvm.IRModule({"main": func}), target=target)["batch_decode_paged_kv_cpu"]
    dev = tvm.cpu()
    out = tvm.runtime.empty((len(lengths), heads, D), "float32", dev)
    lse = tvm.runtime.empty((len(lengths), heads), "float32", dev)
    zeros = tvm.runtime.tensor(np.zeros(len(lengths), "int32"), dev)
    f(*(tvm.runtime.tensor(a, dev) for a in (q, pages, indptr, values, last)), zeros, zeros,
      out, lse, 0, 1.0, 10000.0, scale)

    for b, n in enumerate(lengths):
        rows = pages[values[indptr[b]:indptr[b + 1]], 0, 0].reshape(-1, D)[:n]  # K plane
        s = q[b] @ rows.T * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        ref = (p / p.sum(-1, keepdims=True)) @ rows
        assert np.abs(out.numpy()[b] - ref).max() < 1e-5
        ref_lse = (np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)) / np.log(2)
        assert np.abs(lse.numpy()[b] - ref_lse).max() < 1e-4
    assert head_chunks(heads) == (4 if heads == 8 else 6)
    assert head_chunks(128) == 8 and head_chunks(16) == 4  # <= 16 heads per item
