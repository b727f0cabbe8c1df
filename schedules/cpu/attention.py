"""Attention over the paged KV cache for CPUs: hand-scheduled replacements for TVM's decode
kernel and its ragged prefill kernel (attention among a prefill's new tokens).

TVM's CPU kernel (`batch_decode_paged_kv_cpu`) runs every (sequence, head) on one thread with scalar loops and rescales the
output after every single token: on llama-110m it took 1.6 ms of a 4 ms W4A8 decode step (12
layers, ~190 cached tokens). This kernel keeps TVM's signature (the runtime's paged KV cache
calls it unchanged) and:

* runs (sequence, KV head) pairs in parallel; the query heads sharing a KV head (GQA) are
  handled together, so each K/V page is read from memory once per group;
* works a page at a time (the build's page size, 8 to 128 tokens): one dot product per token
  vectorized over the head dim, one online-softmax rescale per page instead of per token,
  then the weighted V rows;
* requires the rotary embedding to be applied before the cache (our import uses
  RopeMode.NONE, see tvm_llm/frontend/relax_import.py); rotary_mode is ignored.
"""
from __future__ import annotations

import math

from tvm.script import tirx as T

PAGE_SIZES = (8, 16, 32, 64, 128)  # page sizes the kernels are built for (tokens per page)
LOG2E = math.log2(math.e)


def _lanes(D: int) -> int:
    for lanes in (16, 8, 4, 2):
        if D % lanes == 0:
            return lanes
    return 1


def _online_softmax_macros(G: int, D: int, L: int, dtype: str):
    """The per-(row, KV head) attention steps both kernels share, as TVMScript macros over
    local buffers q (G, D), o (G, D), m (G,), den (G,), s (block,), part (L,), mx (1,):

    * start: load the G query rows (pre-scaled by sm_scale * log2 e), zero the state;
    * block: score `ntok` keys (vectorized dot products), one online-softmax rescale, add the
      weighted value rows; keys and values are read through flat views of the cache, token t
      at `base + t * stride` (the paged cache and the ragged K/V lay tokens out differently);
    * finish: normalize, write the output rows and their log2-sum-exp.
    """

    @T.macro
    def start(q, o, m, den, Q, q_row, q_head0, sm_scale):
        for g in range(G):
            for d in T.vectorized(D):
                q[g, d] = T.Cast("float32", Q[q_row, q_head0 + g, d]) * (sm_scale * T.float32(LOG2E))
                o[g, d] = T.float32(0)
            m[g] = T.float32(-5e4)
            den[g] = T.float32(0)

    @T.macro
    def block(q, o, m, den, s, part, mx, K, V, k_base, v_base, stride, ntok):
        for g in range(G):
            mx[0] = m[g]
            for t in range(ntok):
                for l in T.vectorized(L):
                    part[l] = T.float32(0)
                for d0 in range(D // L):
                    for l in T.vectorized(L):
                        part[l] = part[l] + q[g, d0 * L + l] * T.Cast(
                            "float32", K[k_base + t * stride + d0 * L + l])
                s[t] = T.float32(0)
                for l in range(L):
                    s[t] = s[t] + part[l]
                mx[0] = T.max(mx[0], s[t])
            rescale = T.exp2(m[g] - mx[0])
            den[g] = den[g] * rescale
            for d in T.vectorized(D):
                o[g, d] = o[g, d] * rescale
            for t in range(ntok):
                e = T.exp2(s[t] - mx[0])
                den[g] = den[g] + e
                for d in T.vectorized(D):
                    o[g, d] = o[g, d] + e * T.Cast("float32", V[v_base + t * stride + d])
            m[g] = mx[0]

    @T.macro
    def finish(o, m, den, out, lse, q_row, q_head0):
        for g in range(G):
            inv = T.Select(den[g] > T.float32(0), T.float32(1) / den[g], T.float32(0))
            for d in T.vectorized(D):
                out[q_row, q_head0 + g, d] = T.Cast(dtype, o[g, d] * inv)
            lse[q_row, q_head0 + g] = T.Select(den[g] > T.float32(0), m[g] + T.log2(den[g]), m[g])

    return start, block, finish


def decode_attention_func(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str,
                          page_size: int = 16):
    """`page_size`: tokens per KV page; the kernel is compiled for one (the cache's pages
    buffer is matched with that extent, so another page size is a run-time shape error)."""
    if page_size not in PAGE_SIZES:
        raise ValueError(f"page_size {page_size} is not one of {PAGE_SIZES}")
    PAGE = page_size
    H_kv, H_qo, D = num_kv_heads, num_qo_heads, head_dim
    G = H_qo // H_kv
    L = _lanes(D)
    start, block, finish = _online_softmax_macros(G, D, L, dtype)

    @T.prim_func(check_well_formed=False)
    def decode_attention(Q_handle: T.handle, pages_handle: T.handle,
                         page_table_indptr_handle: T.handle, page_table_values_handle: T.handle,
                         var_length_info: T.handle, k_rope_pos_offset_handle: T.handle,
                         q_rope_position_handle: T.handle, output_handle: T.handle,
                         lse_handle: T.handle, rotary_mode: T.int32, rope_scale: T.float32,
                         rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True,
                     "global_symbol": "batch_decode_paged_kv_cpu"})  # replaces TVM's
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        Q = T.match_buffer(Q_handle, (B, H_qo, D), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, H_kv, PAGE, D), dtype)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32",
                                           elem_offset=page_indptr_elem_offset)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32",
                                           elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (B, H_qo, D), dtype)
        lse = T.match_buffer(lse_handle, (B, H_qo), "float32")
        last_page_len = T.match_buffer(var_length_info, (B,), "int32",
                                       elem_offset=length_info_elem_offset)
        flat = T.decl_buffer((max_num_pages * 2 * H_kv * PAGE * D,), dtype, data=pages.data)

        for bh in T.parallel(B * H_kv):
            q = T.alloc_buffer((G, D), "float32", scope="local")
            o = T.alloc_buffer((G, D), "float32", scope="local")
            m = T.alloc_buffer((G,), "float32", scope="local")
            den = T.alloc_buffer((G,), "float32", scope="local")
            s = T.alloc_buffer((PAGE,), "float32", scope="local")
            part = T.alloc_buffer((L,), "float32", scope="local")
            mx = T.alloc_buffer((1,), "float32", scope="local")
            b = bh // H_kv
            hk = bh % H_kv
            start(q, o, m, den, Q, b, hk * G, sm_scale)
            begin = page_table_indptr[b]
            npages = page_table_indptr[b + 1] - begin
            for p in range(npages):
                page = page_table_values[begin + p]
                ntok = T.Select(p == npages - 1, last_page_len[b], PAGE)
                k_base = ((page * 2 + 0) * H_kv + hk) * PAGE * D
                v_base = ((page * 2 + 1) * H_kv + hk) * PAGE * D
                block(q, o, m, den, s, part, mx, flat, flat, k_base, v_base, D, ntok)
            finish(o, m, den, output, lse, b, hk * G)

    return decode_attention


def prefill_ragged_attention_func(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str):
    """Replacement for TVM's `tir_attention_prefill_ragged_cpu` (attention among the new tokens
    of a prefill, several sequences packed in one ragged batch), same signature.

    TVM's kernel is serial and scalar and scores every key, masked or not: 63% of a 128-token
    llama-110m W4A8 prefill, 87% at 512 tokens. Here each (query row, KV head) item scores only
    its causal prefix, 16 keys at a time with one online-softmax rescale per block, vectorized
    over the head dim; items run in parallel, rows paired from both ends of the ragged batch
    (row j with row n-1-j) so that threads get equal causal work.
    """
    H_kv, H_qo, D = num_kv_heads, num_qo_heads, head_dim
    G = H_qo // H_kv
    L = _lanes(D)
    BLK = 16
    start, block, finish = _online_softmax_macros(G, D, L, dtype)

    @T.prim_func(check_well_formed=False)
    def prefill_ragged_attention(var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle,
                                 var_v: T.handle, var_kv_indptr: T.handle,
                                 var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle,
                                 var_output: T.handle, var_lse: T.handle, causal: T.int32,
                                 rotary_mode: T.int32, rope_scale: T.float32,
                                 rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True,
                     "global_symbol": "batch_prefill_ragged_kv"})  # replaces TVM's
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q = T.match_buffer(var_q, (qo_len, H_qo, D), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32",
                                  elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (kv_len, H_kv, D), dtype)
        v = T.match_buffer(var_v, (kv_len, H_kv, D), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32",
                                   elem_offset=kv_indptr_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        output = T.match_buffer(var_output, (qo_len, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (qo_len, H_qo), "float32")
        k_flat = T.decl_buffer((kv_len * H_kv * D,), dtype, data=k.data)
        v_flat = T.decl_buffer((kv_len * H_kv * D,), dtype, data=v.data)

        for item in T.parallel((qo_len + 1) // 2 * 2 * H_kv):
            qbuf = T.alloc_buffer((G, D), "float32", scope="local")
            o = T.alloc_buffer((G, D), "float32", scope="local")
            m = T.alloc_buffer((G,), "float32", scope="local")
            den = T.alloc_buffer((G,), "float32", scope="local")
            s = T.alloc_buffer((BLK,), "float32", scope="local")
            part = T.alloc_buffer((L,), "float32", scope="local")
            mx = T.alloc_buffer((1,), "float32", scope="local")
            seq = T.alloc_buffer((1,), "int32", scope="local")
            pair = item // (2 * H_kv)
            hk = item % H_kv
            # row j and row n-1-j of the pair (the odd middle row is done once)
            row = T.Select(item // H_kv % 2 == 0, pair, qo_len - 1 - pair)
            if item // H_kv % 2 == 0 or qo_len - 1 - pair != pair:
                seq[0] = 0
                for bb in range(batch_size):
                    if q_indptr[bb] <= row:
                        seq[0] = bb
                b = seq[0]
                q_idx = row - q_indptr[b]
                n_kv = kv_indptr[b + 1] - kv_indptr[b]
                n_q = q_indptr[b + 1] - q_indptr[b]
                limit = T.Select(causal > 0, T.min(n_kv, n_kv - n_q + q_idx + 1), n_kv)
                start(qbuf, o, m, den, q, row, hk * G, sm_scale)
                for blk in range((limit + BLK - 1) // BLK):
                    base = ((kv_indptr[b] + blk * BLK) * H_kv + hk) * D
                    block(qbuf, o, m, den, s, part, mx, k_flat, v_flat, base, base, H_kv * D,
                          T.min(BLK, limit - blk * BLK))
                finish(o, m, den, output, lse, row, hk * G)

    return prefill_ragged_attention
