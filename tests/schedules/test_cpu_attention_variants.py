"""The CPU paged-attention kernels with per-layer variants (sliding windows, logit soft-capping,
attention sinks) against the reference op, kernel by kernel: decode over pages, ragged prefill,
paged prefill merged with ragged prefill by log-sum-exp (as the cache merges them), and the
cache's sliding-window page layout. The reference op itself is checked against transformers'
gpt-oss eager attention (sinks) and Gemma 2's (soft-capping, window)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

H_KV, H_QO, D, PAGE = 2, 4, 16, 8
SCALES = (0.3, 0.25)
WINDOWS = (5, 0)  # layer 0 slides (window 5), layer 1 attends to everything
CAPS = (2.0, 0.0)  # layer 0 soft-caps its scores at 2
SINKS = ((0.5, -1.0, 2.0, 0.0), (1.5, 0.25, -0.5, 3.0))


@pytest.fixture(scope="module")
def kernels():
    import tvm

    from schedules.cpu.attention import (LayerTable, decode_attention_func,
                                         prefill_paged_attention_func,
                                         prefill_ragged_attention_func)

    table = LayerTable(SCALES, WINDOWS, CAPS, SINKS)
    target = tvm.target.Target({"kind": "llvm"})
    funcs = {
        "decode": decode_attention_func(H_KV, H_QO, D, "float32", PAGE, table),
        "decode_sliding": decode_attention_func(H_KV, H_QO, D, "float32", PAGE, table, sliding=True),
        "paged": prefill_paged_attention_func(H_KV, H_QO, D, "float32", PAGE, table),
        "ragged": prefill_ragged_attention_func(H_KV, H_QO, D, "float32", table),
    }
    return {k: tvm.compile(tvm.IRModule({"main": f}), target=target)["main"] for k, f in funcs.items()}


@pytest.fixture(scope="module")
def gpu_kernels():
    """The GPU form of the kernels (for_gpu: one thread per item), threads serialised to run
    on the CPU: the code CUDA/ROCm builds of models with variants compile."""
    import tvm

    from schedules.cpu.attention import (LayerTable, decode_attention_func, for_gpu,
                                         prefill_paged_attention_func,
                                         prefill_ragged_attention_func)
    from gpu_verify import build_serial_on_cpu

    table = LayerTable(SCALES, WINDOWS, CAPS, SINKS)
    funcs = {"decode": decode_attention_func(H_KV, H_QO, D, "float32", PAGE, table, vector=False),
             "paged": prefill_paged_attention_func(H_KV, H_QO, D, "float32", PAGE, table,
                                                   vector=False),
             "ragged": prefill_ragged_attention_func(H_KV, H_QO, D, "float32", table,
                                                     vector=False)}
    del tvm
    return {k: build_serial_on_cpu(for_gpu(f))["main"] for k, f in funcs.items()}


def _reference(q, k, v, layer):
    """(s, H_QO, D) outputs of the reference op over one whole sequence (all rows causal)."""
    out = torch.ops.tvm_llm.paged_attention_variant(
        torch.tensor(q).permute(1, 0, 2)[None], torch.tensor(k).permute(1, 0, 2)[None],
        torch.tensor(v).permute(1, 0, 2)[None], layer, SCALES[layer], WINDOWS[layer],
        CAPS[layer], torch.tensor(SINKS[layer]))
    return out[0].numpy()


def _t(a):
    import tvm

    return tvm.runtime.tensor(np.ascontiguousarray(a), tvm.cpu())


def _pages(seqs, offsets, rng, n_pages=32):
    """Scatter each sequence's k/v (from physical slot `offset` of its first page) into random
    pages; -> pages, page indptr, page values, last page lengths."""
    pages = rng.standard_normal((n_pages, 2, H_KV, PAGE, D)).astype("float32")  # junk elsewhere
    free = list(rng.permutation(n_pages))
    indptr, values, last = [0], [], []
    for (k, v), off in zip(seqs, offsets):
        n = off + len(k)
        ids = [int(free.pop()) for _ in range(-(-n // PAGE))]
        for t in range(len(k)):
            slot = off + t
            pages[ids[slot // PAGE], 0, :, slot % PAGE] = k[t]
            pages[ids[slot // PAGE], 1, :, slot % PAGE] = v[t]
        values += ids
        indptr.append(len(values))
        last.append((n - 1) % PAGE + 1)
    return pages, np.array(indptr, "int32"), np.array(values, "int32"), np.array(last, "int32")


def _merge(o1, l1, o2, l2):
    """Merge two partial attentions by their log2-sum-exp (what the cache does)."""
    m = np.maximum(l1, l2)
    w1, w2 = np.exp2(l1 - m)[..., None], np.exp2(l2 - m)[..., None]
    return (o1 * w1 + o2 * w2) / (w1 + w2)


def _seq(n, rng):
    return [rng.standard_normal((n, h, D)).astype("float32") for h in (H_QO, H_KV, H_KV)]


def test_reference_op_matches_transformers_gpt_oss_sinks_and_gemma2_softcap():
    import transformers.models.gemma2.modeling_gemma2 as g2
    import transformers.models.gpt_oss.modeling_gpt_oss as oss

    import tvm_llm.frontend.attention  # noqa: F401  (registers the op)

    rng = np.random.default_rng(0)
    q, k, v = (torch.tensor(rng.standard_normal((1, h, 9, D)), dtype=torch.float32)
               for h in (H_QO, H_KV, H_KV))
    sinks = torch.tensor(SINKS[1])
    module = torch.nn.Module()
    module.num_key_value_groups, module.training, module.sinks = H_QO // H_KV, False, sinks
    causal = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    want, _ = oss.eager_attention_forward(module, q, k, v, causal, scaling=0.25)
    got = torch.ops.tvm_llm.paged_attention_variant(q, k, v, 1, 0.25, 0, 0.0, sinks)
    assert (got - want).abs().max() < 1e-5
    i, j = torch.arange(9)[:, None], torch.arange(9)[None]
    window_mask = torch.where((j <= i) & (i - j < 4), 0.0, float("-inf"))[None, None]
    want, _ = g2.eager_attention_forward(module, q, k, v, window_mask, scaling=0.25, softcap=3.0)
    got = torch.ops.tvm_llm.paged_attention_variant(q, k, v, 0, 0.25, 4, 3.0, torch.zeros(0))
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("layer", [0, 1])
def test_decode_over_pages_with_the_query_in_the_cache(kernels, layer):
    _check_decode(kernels, layer)


def test_gpu_form_of_the_kernels(gpu_kernels):
    _check_decode(gpu_kernels, 0)
    _check_prefill(gpu_kernels, 0)


def _check_decode(kernels, layer):
    rng = np.random.default_rng(1 + layer)
    lengths = (13, 3, 20)
    seqs = [_seq(n, rng) for n in lengths]
    pages, indptr, values, last = _pages([(k, v) for _, k, v in seqs], [0] * 3, rng)
    q = np.stack([s[0][-1] for s in seqs])
    out, lse = np.zeros((3, H_QO, D), "float32"), np.zeros((3, H_QO), "float32")
    out_t, lse_t = _t(out), _t(lse)
    kernels["decode"](_t(q), _t(pages), _t(indptr), _t(values), _t(last), _t(np.zeros(3, "int32")),
                      _t(np.array(lengths, "int32") - 1), out_t, lse_t, 0, 1.0, 1e4,
                      float(-(layer + 1)))
    for b, (qs, k, v) in enumerate(seqs):
        want = _reference(qs, k, v, layer)[-1]
        assert np.abs(out_t.numpy()[b] - want).max() < 1e-5, f"sequence {b}"


@pytest.mark.parametrize("layer", [0, 1])
def test_ragged_prefill_then_paged_prefill_merged(kernels, layer):
    """Prompts continued: cached tokens in pages (paged prefill kernel) and the new tokens among
    themselves (ragged kernel); the sink is added once, by the ragged kernel."""
    _check_prefill(kernels, layer)


def _check_prefill(kernels, layer):
    rng = np.random.default_rng(3 + layer)
    cached, new = (9, 0, 17), (6, 4, 3)
    seqs = [_seq(c + n, rng) for c, n in zip(cached, new)]
    pages, indptr, values, last = _pages([(k[:c], v[:c]) for (_, k, v), c in zip(seqs, cached)],
                                         [0] * 3, rng)
    q = np.concatenate([s[0][c:] for s, c in zip(seqs, cached)])
    k_new = np.concatenate([s[1][c:] for s, c in zip(seqs, cached)])
    v_new = np.concatenate([s[2][c:] for s, c in zip(seqs, cached)])
    q_indptr = np.concatenate([[0], np.cumsum(new)]).astype("int32")
    q_pos = np.concatenate([np.arange(c, c + n) for c, n in zip(cached, new)]).astype("int32")
    total = sum(new)
    o1, l1, o2, l2 = (_t(np.zeros(s, "float32")) for s in
                      ((total, H_QO, D), (total, H_QO), (total, H_QO, D), (total, H_QO)))
    code = float(-(layer + 1))
    kernels["ragged"](_t(q), _t(q_indptr), _t(k_new), _t(v_new), _t(q_indptr), _t(q_pos),
                      _t(np.array(cached, "int32")), o1, l1, 1, 0, 1.0, 1e4, code)
    kernels["paged"](_t(q), _t(q_indptr), _t(pages), _t(indptr), _t(values), _t(last),
                     _t(np.zeros(3, "int32")), _t(q_pos), o2, l2, 0, 0, 1.0, 1e4, code)
    got = _merge(o1.numpy(), l1.numpy(), o2.numpy(), l2.numpy())
    for b, ((qs, k, v), c) in enumerate(zip(seqs, cached)):
        want = _reference(qs, k, v, layer)[c:]
        rows = got[q_indptr[b]:q_indptr[b + 1]]
        assert np.abs(rows - want).max() < 1e-5, f"sequence {b}"


def test_decode_in_the_sliding_window_page_layout(kernels):
    """TVM's sliding-window layout: a sequence keeps its last tokens from slot `offset` of its
    first page on; the new token is attended by the ragged kernel, the kept ones by decode."""
    rng = np.random.default_rng(7)
    layer, kept, offsets, total = 0, (6, 5), (3, 7), (40, 6)
    seqs = [_seq(n, rng) for n in total]
    pages, indptr, values, last = _pages(
        [(k[n - 1 - c:n - 1], v[n - 1 - c:n - 1]) for (_, k, v), c, n in zip(seqs, kept, total)],
        offsets, rng)
    info = np.stack([last, np.array(offsets, "int32"), np.zeros(2, "int32")]).astype("int32")
    q = np.stack([s[0][-1] for s in seqs])
    k_new = np.stack([s[1][-1] for s in seqs])
    v_new = np.stack([s[2][-1] for s in seqs])
    # the cache's positions: kept tokens at 0..kept-1, the new token at `kept`
    o1, l1, o2, l2 = (_t(np.zeros(s, "float32")) for s in ((2, H_QO, D), (2, H_QO)) * 2)
    code = float(-(layer + 1))
    ind = np.arange(3, dtype="int32")
    kernels["ragged"](_t(q), _t(ind[:3]), _t(k_new), _t(v_new), _t(ind[:3]),
                      _t(np.array(kept, "int32")), _t(np.array(kept, "int32")), o1, l1, 1, 0,
                      1.0, 1e4, code)
    kernels["decode_sliding"](_t(q), _t(pages), _t(indptr), _t(values), _t(info),
                              _t(np.zeros(2, "int32")), _t(np.array(kept, "int32")), o2, l2, 0,
                              1.0, 1e4, code)
    got = _merge(o1.numpy(), l1.numpy(), o2.numpy(), l2.numpy())
    for b, (qs, k, v) in enumerate(seqs):
        want = _reference(qs, k, v, layer)[-1]
        assert np.abs(got[b] - want).max() < 1e-5, f"sequence {b}"
