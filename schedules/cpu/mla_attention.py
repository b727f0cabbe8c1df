"""Decode attention over a latent-attention (MLA) KV cache for CPUs.

An MLA model's cache (tvm_llm/frontend/mla.py) has one KV head whose row is the latent
(c | k_pe), L + R wide, written to both the K and the V plane; every query head attends over
it. The general decode kernel (attention.py) then has a single (sequence, KV head) item per
sequence: a batch-1 decode step runs all heads on one thread and reads each row twice (K and V).

This kernel, same signature and name (the runtime calls it unchanged):

* splits the query heads into `chunks` groups, so one sequence gives `chunks` parallel items
  (each re-reads the rows: the scores and the weighted sum do 2 x (heads per item) FMAs per
  value read, so the re-reading is cheap next to the compute);
* reads the values from the K plane, which holds the same row as the V plane, so each page is
  read once per item instead of twice.

The online-softmax steps are attention.py's (`_online_softmax_macros`).
"""
from __future__ import annotations

from tvm.script import tirx as T

from .attention import PAGE_SIZES, _lanes, _online_softmax_macros


def head_chunks(num_qo_heads: int, want: int = 4, max_heads: int = 16) -> int:
    """How many head groups a sequence's decode is split into: at least `want` (parallel work
    for a batch-1 step) and few enough heads per group that its G x PAGE score accumulators
    stay in registers (`max_heads`); the smallest such divisor of the heads."""
    for c in range(min(want, num_qo_heads), num_qo_heads + 1):
        if num_qo_heads % c == 0 and num_qo_heads // c <= max_heads:
            return c
    return num_qo_heads


def latent_decode_attention_func(num_qo_heads: int, head_dim: int, dtype: str,
                                 page_size: int = 16, chunks: int | None = None):
    """Replacement of `batch_decode_paged_kv_cpu` for a cache with one KV head whose K and V
    planes hold the same rows (the MLA layout). `head_dim`: the row width L + R."""
    if page_size not in PAGE_SIZES:
        raise ValueError(f"page_size {page_size} is not one of {PAGE_SIZES}")
    PAGE, H_qo, D = page_size, num_qo_heads, head_dim
    C = chunks or head_chunks(H_qo)
    if H_qo % C:
        raise ValueError(f"{H_qo} query heads cannot be split into {C} equal groups")
    G = H_qo // C
    L = _lanes(D)
    start, block, finish = _online_softmax_macros(G, D, L, dtype, None, H_qo)  # no variants

    @T.prim_func(check_well_formed=False)
    def latent_decode_attention(Q_handle: T.handle, pages_handle: T.handle,
                                page_table_indptr_handle: T.handle,
                                page_table_values_handle: T.handle, var_length_info: T.handle,
                                k_rope_pos_offset_handle: T.handle,
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
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, 1, PAGE, D), dtype)
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
        flat = T.decl_buffer((max_num_pages * 2 * PAGE * D,), dtype, data=pages.data)

        for bc in T.parallel(B * C):
            q = T.alloc_buffer((G, D), "float32", scope="local")
            o = T.alloc_buffer((G, D), "float32", scope="local")
            m = T.alloc_buffer((G,), "float32", scope="local")
            den = T.alloc_buffer((G,), "float32", scope="local")
            kt = T.alloc_buffer((D, PAGE), "float32", scope="local")
            s = T.alloc_buffer((G, PAGE), "float32", scope="local")
            mx = T.alloc_buffer((1,), "float32", scope="local")
            b = bc // C
            head0 = bc % C * G
            start(q, o, m, den, Q, b, head0, sm_scale)
            begin = page_table_indptr[b]
            npages = page_table_indptr[b + 1] - begin
            for p in range(npages):
                page = page_table_values[begin + p]
                ntok = T.Select(p == npages - 1, last_page_len[b], PAGE)
                k_base = page * 2 * PAGE * D  # the K plane, read for the values too
                # the page's rows transposed (D, PAGE): the scores of all G heads are then
                # broadcast FMAs over the page's tokens, G x PAGE accumulators
                for t in range(PAGE):
                    for d in range(D):
                        kt[d, t] = T.Select(t < ntok, T.Cast("float32", flat[k_base + t * D + d]),
                                            T.float32(0))
                for g in T.unroll(G):
                    for t in T.vectorized(PAGE):
                        s[g, t] = T.float32(0)
                for d in range(D):
                    for g in T.unroll(G):
                        for t in T.vectorized(PAGE):
                            s[g, t] = s[g, t] + q[g, d] * kt[d, t]
                for g in range(G):  # one online-softmax rescale per page
                    mx[0] = m[g]
                    for t in range(PAGE):
                        mx[0] = T.max(mx[0], T.Select(t < ntok, s[g, t], T.float32(-5e4)))
                    rescale = T.exp2(m[g] - mx[0])
                    den[g] = den[g] * rescale
                    for t in T.vectorized(PAGE):
                        s[g, t] = T.Select(t < ntok, T.exp2(s[g, t] - mx[0]), T.float32(0))
                    for t in range(PAGE):
                        den[g] = den[g] + s[g, t]
                    for d in T.vectorized(D):
                        o[g, d] = o[g, d] * rescale
                    m[g] = mx[0]
                for t in range(ntok):
                    for g in range(G):
                        for d in T.vectorized(D):
                            o[g, d] = o[g, d] + s[g, t] * T.Cast("float32", flat[k_base + t * D + d])
            finish(o, m, den, mx, output, lse, b, head0, False, sm_scale)

    return latent_decode_attention
