"""The plain CPU attention kernels (schedules/cpu/attention.py, no per-layer table) against a
numpy softmax attention, at head dims that take the dot product's lane folding through its
several widths (64: four 16-lane slices; 24: three 8-lane slices) and lengths that end in a
partial page or block (the exponentials' scalar path) as well as exact multiples of it (the
vector path), with GQA (two query heads per KV head).

The ragged prefill is a query-tile GEMM (16 (row, head) pairs a tile, 16-key blocks): its cases
put tiles across sequence boundaries, partial tiles and blocks, blocks inside every lane's
causal range and diagonal ones, GQA groups that do not divide the tile (3 heads a KV head), and
rows whose keys begin before the queries (a chunk continuing cached tokens). Tolerances: fp32
within 2e-6 absolute and 1e-5 relative of a float64 numpy attention (the kernel's exp is
accurate to ~1e-7 relative; outputs are O(1)); bfloat16 within one bfloat16 rounding of the
output (2^-8 relative) plus the float32 error, against numpy on the same bf16-rounded inputs."""
from __future__ import annotations

import numpy as np
import pytest

H_KV, H_QO, PAGE, SCALE = 2, 4, 16, 0.2


def _t(a):
    import tvm

    return tvm.runtime.tensor(np.ascontiguousarray(a), tvm.cpu())


def _attend(q, k, v):
    """q (H_QO, D) of the sequence's last position over keys k, v (n, H_KV, D), in float64."""
    q, k, v = (np.asarray(a, "float64") for a in (q, k, v))
    g = q.shape[0] // k.shape[1]
    out = np.empty_like(q)
    for h in range(q.shape[0]):
        s = k[:, h // g] @ q[h] * SCALE
        p = np.exp(s - s.max())
        out[h] = p @ v[:, h // g] / p.sum()
    return out


@pytest.fixture(scope="module", params=[64, 24])
def kernels(request):
    import tvm

    from schedules.cpu.attention import decode_attention_func, prefill_ragged_attention_func
    from tvm_llm.targets.llvm import LLVMTarget

    d = request.param
    target = LLVMTarget().tvm_target()
    funcs = {"decode": decode_attention_func(H_KV, H_QO, d, "float32", PAGE),
             "ragged": prefill_ragged_attention_func(H_KV, H_QO, d, "float32")}
    return d, {k: tvm.compile(tvm.IRModule({"main": f}), target=target)["main"]
               for k, f in funcs.items()}


@pytest.mark.parametrize("lengths", [(37, 16), (1, 48)])
def test_decode_matches_numpy(kernels, lengths):
    d, funcs = kernels
    rng = np.random.default_rng(len(lengths) + lengths[0])
    n_pages = sum(-(-n // PAGE) for n in lengths) + 2
    pages = rng.standard_normal((n_pages, 2, H_KV, PAGE, d)).astype("float32")
    free = list(rng.permutation(n_pages))
    indptr, values, last, want = [0], [], [], []
    q = rng.standard_normal((len(lengths), H_QO, d)).astype("float32")
    for b, n in enumerate(lengths):
        k, v = (rng.standard_normal((n, H_KV, d)).astype("float32") for _ in range(2))
        ids = [int(free.pop()) for _ in range(-(-n // PAGE))]
        for t in range(n):
            pages[ids[t // PAGE], 0, :, t % PAGE] = k[t]
            pages[ids[t // PAGE], 1, :, t % PAGE] = v[t]
        values += ids
        indptr.append(len(values))
        last.append((n - 1) % PAGE + 1)
        want.append(_attend(q[b], k, v))
    B = len(lengths)
    out, lse = np.zeros((B, H_QO, d), "float32"), np.zeros((B, H_QO), "float32")
    out_t, lse_t = _t(out), _t(lse)
    funcs["decode"](_t(q), _t(pages), _t(np.array(indptr, "int32")),
                    _t(np.array(values, "int32")), _t(np.array(last, "int32")),
                    _t(np.zeros(B, "int32")), _t(np.array(lengths, "int32") - 1), out_t, lse_t,
                    0, 1.0, 1e4, SCALE)
    np.testing.assert_allclose(out_t.numpy(), np.stack(want), rtol=1e-4, atol=1e-5)


def test_ragged_prefill_matches_numpy(kernels):
    """Two sequences in one ragged batch, 21 and 32 tokens: every row's causal prefix, blocks
    of 16 keys full and partial."""
    d, funcs = kernels
    rng = np.random.default_rng(7)
    lengths = (21, 32)
    n = sum(lengths)
    q = rng.standard_normal((n, H_QO, d)).astype("float32")
    k, v = (rng.standard_normal((n, H_KV, d)).astype("float32") for _ in range(2))
    ind = np.array([0, lengths[0], n], "int32")
    pos = np.concatenate([np.arange(m) for m in lengths]).astype("int32")
    out_t, lse_t = _t(np.zeros((n, H_QO, d), "float32")), _t(np.zeros((n, H_QO), "float32"))
    funcs["ragged"](_t(q), _t(ind), _t(k), _t(v), _t(ind), _t(pos), _t(np.zeros(2, "int32")),
                    out_t, lse_t, 1, 0, 1.0, 1e4, SCALE)
    want = np.stack([_attend(q[r], k[ind[b]:r + 1], v[ind[b]:r + 1])
                     for b in range(2) for r in range(ind[b], ind[b + 1])])
    np.testing.assert_allclose(out_t.numpy(), want, rtol=1e-5, atol=2e-6)


def _paged_case(h_kv, h_qo, d, page, lengths, seed):
    """Sequences of `lengths` cached tokens in shuffled pages whose unwritten slots hold NaN
    (a kernel that reads one, or weights one by 0, returns NaN); -> (kernel args, want), the
    want from a float64 softmax attention."""
    rng = np.random.default_rng(seed)
    n_pages = sum(-(-n // page) for n in lengths) + 2
    pages = np.full((n_pages, 2, h_kv, page, d), np.nan, "float32")
    free = list(rng.permutation(n_pages))
    indptr, values, last, want = [0], [], [], []
    q = rng.standard_normal((len(lengths), h_qo, d)).astype("float32")
    for b, n in enumerate(lengths):
        k, v = (rng.standard_normal((n, h_kv, d)).astype("float32") for _ in range(2))
        ids = [int(free.pop()) for _ in range(-(-n // page))]
        for t in range(n):
            pages[ids[t // page], 0, :, t % page] = k[t]
            pages[ids[t // page], 1, :, t % page] = v[t]
        values += ids
        indptr.append(len(values))
        last.append((n - 1) % page + 1)
        want.append(_attend(q[b], k, v))
    B = len(lengths)
    args = [_t(q), _t(pages), _t(np.array(indptr, "int32")), _t(np.array(values, "int32")),
            _t(np.array(last, "int32")), _t(np.zeros(B, "int32")),
            _t(np.array(lengths, "int32") - 1), _t(np.zeros((B, h_qo, d), "float32")),
            _t(np.zeros((B, h_qo), "float32")), 0, 1.0, 1e4, SCALE]
    return args, np.stack(want)


@pytest.mark.parametrize("h_kv,h_qo,d,page,threads,lengths", [
    (4, 12, 64, 16, 2, (129,)),      # llama-110m's groups of 3, 4 items on 2 cores: no split
    (2, 6, 32, 16, 16, (77, 5)),     # groups of 3 split over 16 cores: chunks end mid-page
    (4, 32, 64, 32, 2, (200,)),      # llama-1b's groups of 8, 32-token pages (two 16-key blocks)
    (12, 12, 32, 8, 2, (40, 1)),     # MHA, 8-token pages (8-key blocks), a 1-token sequence
    (1, 2, 24, 16, 4, (21,)),        # 8-lane products (head dim 24), MQA split over 4 cores
])
def test_decode_blocks_split_and_gqa_match_float64(h_kv, h_qo, d, page, threads, lengths):
    """The decode kernel's 16-key blocks (scores summed by the shuffle merge tree), partial
    last blocks (clamped rows, masked), GQA groups, and the context split merged on the
    calling thread, against a float64 attention at float32 tolerance."""
    import tvm

    from schedules.cpu.attention import decode_attention_func
    from tvm_llm.targets.llvm import LLVMTarget

    func = tvm.compile(tvm.IRModule({"main": decode_attention_func(
        h_kv, h_qo, d, "float32", page, threads=threads)}),
        target=LLVMTarget().tvm_target())["main"]
    args, want = _paged_case(h_kv, h_qo, d, page, lengths, seed=sum(lengths) + threads)
    func(*args)
    np.testing.assert_allclose(args[7].numpy(), want, rtol=1e-5, atol=2e-6)


@pytest.fixture(scope="module")
def tiled():
    """Ragged prefill kernels at a GQA group of 3 (fp32) and in bfloat16 (groups of 2)."""
    import tvm

    from schedules.cpu.attention import prefill_ragged_attention_func
    from tvm_llm.targets.llvm import LLVMTarget

    target = LLVMTarget().tvm_target()
    return {key: tvm.compile(tvm.IRModule({"main": prefill_ragged_attention_func(*key)}),
                             target=target)["main"]
            for key in [(1, 3, 32, "float32"), (2, 4, 64, "bfloat16")]}


def _ragged_case(func, h_kv, h_qo, d, dtype, n_q, n_kv, seed):
    """Sequences with n_q[b] new queries over n_kv[b] keys (the last n_q[b] keys are the
    queries' own tokens: a chunk after n_kv - n_q cached ones), causal; -> (got, want)."""
    rng = np.random.default_rng(seed)
    cast = (lambda a: a.astype("float32")) if dtype == "float32" else (
        lambda a: a.astype(__import__("ml_dtypes").bfloat16))
    q = cast(rng.standard_normal((sum(n_q), h_qo, d)))
    k, v = (cast(rng.standard_normal((sum(n_kv), h_kv, d))) for _ in range(2))
    q_ind = np.concatenate([[0], np.cumsum(n_q)]).astype("int32")
    kv_ind = np.concatenate([[0], np.cumsum(n_kv)]).astype("int32")
    pos = np.concatenate([np.arange(c - n, c) for n, c in zip(n_q, n_kv)]).astype("int32")
    out_t = _t(cast(np.zeros((sum(n_q), h_qo, d))))
    lse_t = _t(np.zeros((sum(n_q), h_qo), "float32"))
    func(_t(q), _t(q_ind), _t(k), _t(v), _t(kv_ind), _t(pos), _t(np.zeros(len(n_q), "int32")),
         out_t, lse_t, 1, 0, 1.0, 1e4, SCALE)
    f32 = (lambda a: np.asarray(a, "float32"))
    want = np.stack([_attend(f32(q[q_ind[b] + i]), f32(k[kv_ind[b]:kv_ind[b] + c - n + i + 1]),
                             f32(v[kv_ind[b]:kv_ind[b] + c - n + i + 1]))
                     for b, (n, c) in enumerate(zip(n_q, n_kv)) for i in range(n)])
    return f32(out_t.numpy()), want


@pytest.mark.parametrize("n_q,n_kv", [((37, 5, 70), (37, 5, 70)),  # prompts from scratch
                                      ((19, 1, 40), (49, 17, 40))])  # chunks after cached keys
def test_ragged_prefill_tile_edges_gqa3(tiled, n_q, n_kv):
    """Groups of 3 heads: tiles of 16 (row, head) pairs start mid-row and mid-sequence."""
    got, want = _ragged_case(tiled[(1, 3, 32, "float32")], 1, 3, 32, "float32", n_q, n_kv, 11)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_ragged_prefill_bfloat16(tiled):
    got, want = _ragged_case(tiled[(2, 4, 64, "bfloat16")], 2, 4, 64, "bfloat16", (23, 41),
                             (30, 41), 12)
    np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=2e-3)


def _paged_prefill_case(func, page, n_cached, n_new, offsets, causal, seed, h_kv=1, h_qo=3,
                        d=32, dtype="float32"):
    """Sequences whose keys lie in pages (n_cached[b] + n_new[b] of them when `causal`: the new
    tokens' own keys already appended, each row seeing its causal prefix; else the n_cached[b]
    cached keys, all visible), from physical slot offsets[b] of their first page (the
    sliding-window layout; 0 elsewhere); unused slots hold NaN, which no output may see.
    -> (output, lse, reference output, reference lse) with lse in log2 units; with a bfloat16
    `dtype` the reference sees the same bfloat16-rounded inputs."""
    rng = np.random.default_rng(seed)
    wire = "float32" if dtype == "float32" else __import__("ml_dtypes").bfloat16
    n_keys = [c + (n if causal else 0) for c, n in zip(n_cached, n_new)]
    keys = [rng.standard_normal((2, n, h_kv, d)).astype(wire).astype("float32") for n in n_keys]
    q = rng.standard_normal((sum(n_new), h_qo, d)).astype(wire).astype("float32")
    n_pages = sum(-(-(o + n) // page) for o, n in zip(offsets, n_keys)) + 3
    pages = np.full((n_pages, 2, h_kv, page, d), np.nan, "float32")
    free = list(rng.permutation(n_pages))
    indptr, values, info = [0], [], [[], [], []]
    for kv, off in zip(keys, offsets):
        n = off + kv.shape[1]
        ids = [int(free.pop()) for _ in range(-(-n // page))]
        for t in range(kv.shape[1]):
            pages[ids[(off + t) // page], :, :, (off + t) % page] = kv[:, t]
        values += ids
        indptr.append(len(values))
        info[0].append((n - 1) % page + 1 if ids else 0)
        info[1].append(off)
        info[2].append(0)
    sliding = any(offsets)
    length_info = np.array(info if sliding else info[0], "int32")
    q_indptr = np.concatenate([[0], np.cumsum(n_new)]).astype("int32")
    q_pos = np.concatenate([np.arange(c, c + n) for c, n in zip(n_cached, n_new)]).astype("int32")
    out_t = _t(np.zeros((sum(n_new), h_qo, d), wire))
    lse_t = _t(np.zeros((sum(n_new), h_qo), "float32"))
    func(_t(q.astype(wire)), _t(q_indptr), _t(pages.astype(wire)), _t(np.array(indptr, "int32")),
         _t(np.array(values or [0], "int32")), _t(length_info),
         _t(np.zeros(len(n_new), "int32")), _t(q_pos), out_t, lse_t, int(causal), 0, 1.0, 1e4,
         SCALE)
    want, want_lse = np.zeros(q.shape), np.full(q.shape[:2], -np.inf)
    for b, (kv, n) in enumerate(zip(keys, n_new)):
        for i in range(n):
            row = q_indptr[b] + i
            seen = kv.shape[1] - n + i + 1 if causal else kv.shape[1]
            if seen == 0:  # no keys: output 0, lse -inf
                continue
            k, v = (np.asarray(a[:seen], "float64") for a in kv)
            for h in range(h_qo):
                s = k[:, h // (h_qo // h_kv)] @ q[row, h] * SCALE
                p = np.exp(s - s.max())
                want[row, h] = p @ v[:, h // (h_qo // h_kv)] / p.sum()
                want_lse[row, h] = (s.max() + np.log(p.sum())) / np.log(2)
    return out_t.numpy().astype("float32"), lse_t.numpy(), want, want_lse


def _paged_kernel(page, dtype="float32", sliding=False):
    """The CPU paged prefill for one KV head and 3 query heads of dim 32, compiled."""
    import tvm

    from schedules.cpu.attention import prefill_paged_attention_func
    from tvm_llm.targets.llvm import LLVMTarget

    func = prefill_paged_attention_func(1, 3, 32, dtype, page, sliding=sliding)
    return tvm.compile(tvm.IRModule({"main": func}), target=LLVMTarget().tvm_target())["main"]


@pytest.mark.parametrize("page", [8, 16, 32])
@pytest.mark.parametrize("causal", [0, 1])
def test_tiled_paged_prefill_matches_numpy(page, causal):
    """The CPU paged prefill's query tiles (16 (row, head) pairs of one sequence, GQA groups of
    3 that do not divide a tile): several tiles a sequence, a sequence with no cached page,
    key counts that end inside a page and inside a block; with `causal`, the new rows' own
    keys in the pages (diagonal blocks masked lane by lane). Pages left unwritten hold NaN."""
    func = _paged_kernel(page)
    n_cached, n_new = (45, 0, 70), (11, 6, 23)
    got, lse, want, want_lse = _paged_prefill_case(func, page, n_cached, n_new, (0, 0, 0),
                                                   causal, seed=page + causal)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    seen = np.isfinite(want_lse)  # rows with keys (the second sequence has none uncausally)
    np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=1e-5, atol=1e-5)


def test_tiled_paged_prefill_in_the_sliding_window_layout():
    """Kept keys from slot `offset` of the first page on (TVM's sliding-window layout): logical
    key t at physical slot t + offset, the slots before it never read."""
    func = _paged_kernel(16, sliding=True)
    got, lse, want, want_lse = _paged_prefill_case(func, 16, (21, 9), (7, 12), (5, 13), 0,
                                                   seed=3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_tiled_paged_prefill_bfloat16():
    """bfloat16 pages: each block's K and V rows are widened to float32 once, then the float32
    tile (within one bfloat16 rounding of the output)."""
    func = _paged_kernel(16, "bfloat16")
    got, lse, want, want_lse = _paged_prefill_case(func, 16, (45, 0, 70), (11, 6, 23),
                                                   (0, 0, 0), 1, seed=5, dtype="bfloat16")
    np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=2e-3)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page,sliding,causal", [(8, False, 1), (16, False, 0), (32, False, 1),
                                                 (16, True, 0)])
def test_amx_scores_paged_prefill_bfloat16(page, sliding, causal):
    """bfloat16 paged prefill with AMX scores (whole key blocks on tdpbf16ps, clamped blocks
    on FMAs): the same answers as the float reference, NaN in unwritten slots never seen."""
    from cpu_workloads import amx_skip_reason

    reason = amx_skip_reason()
    if reason:
        pytest.skip(reason)
    import tvm

    from schedules.cpu.attention import prefill_paged_attention_func
    from tvm_llm.targets.llvm import LLVMTarget

    func = prefill_paged_attention_func(1, 3, 32, "bfloat16", page, sliding=sliding, amx=True)
    func = tvm.compile(tvm.IRModule({"main": func}), target=LLVMTarget().tvm_target())["main"]
    offsets = (5, 13, 0) if sliding else (0, 0, 0)
    got, lse, want, want_lse = _paged_prefill_case(func, page, (45, 0, 70), (11, 6, 23),
                                                   offsets, causal, seed=page + 7,
                                                   dtype="bfloat16")
    np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=2e-3)
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=1e-5, atol=1e-5)


def test_amx_scores_ragged_prefill_bfloat16():
    from cpu_workloads import amx_skip_reason

    reason = amx_skip_reason()
    if reason:
        pytest.skip(reason)
    import tvm

    from schedules.cpu.attention import prefill_ragged_attention_func
    from tvm_llm.targets.llvm import LLVMTarget

    func = tvm.compile(tvm.IRModule({"main": prefill_ragged_attention_func(
        2, 4, 64, "bfloat16", amx=True)}), target=LLVMTarget().tvm_target())["main"]
    got, want = _ragged_case(func, 2, 4, 64, "bfloat16", (23, 41, 70), (30, 41, 70), 13)
    np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=2e-3)


def test_cache_kernels_take_amx_scores_only_on_amx_targets():
    """Compiled, not run: a sapphirerapids build's bfloat16 prefill kernels hold tile
    instructions (configured once a query tile, released after it); a znver4 build's (AVX512-BF16,
    no AMX) and a float32 build's hold none."""
    import tvm

    from schedules.cpu.amx_bf16 import target_has_amx
    from schedules.cpu.attention import prefill_ragged_attention_func

    def asm(mcpu, dtype):
        target = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu",
                                    "mcpu": mcpu, "num-cores": 2})
        func = prefill_ragged_attention_func(2, 4, 64, dtype, amx=target_has_amx(target))
        return tvm.compile(tvm.IRModule({"main": func}), target=target).mod.inspect_source("asm")

    code = asm("sapphirerapids", "bfloat16")
    assert "tdpbf16ps" in code and "ldtilecfg" in code and "tilerelease" in code
    for mcpu, dtype in (("znver4", "bfloat16"), ("sapphirerapids", "float32")):
        assert "tdpbf16ps" not in asm(mcpu, dtype), (mcpu, dtype)
