"""The paged KV cache's two per-layer copy kernels for CPUs: the split of the fused q|k|v rows
(`fused_rope`) and the append of the new K/V rows to their pages
(`tir_kv_cache_transpose_append`), same names and signatures as TVM's.

TVM's paged KV cache calls both in every layer before the attention kernel. At decode they
move a few kilobytes (one token), so their cost is the call, not the bytes: TVM's split ran as
a parallel loop (a thread-pool fork and join, ~3 us of a ~20 us layer on 2 threads, for 0.3 us
of copying) and its append as scalar stores. Here both copy D-element rows as vectors on the
calling thread, and fork only for a batch of at least PARALLEL_MIN_TOKENS tokens (prefill),
where the copy outweighs the fork.

The split keeps TVM's rotary path for `apply_rope` > 0 (our imports apply RoPE before the cache,
RopeMode.NONE, so the runtime passes 0; a cache made with RopeMode.NORMAL by
`frontend.relax_import.tir_paged_kv_cache(rope=True)` rotates with theta 10000, scale 1, over
the whole head, as TVM's kernel for those settings does).
"""
from __future__ import annotations

from tvm.script import tirx as T

PARALLEL_MIN_TOKENS = 32  # tokens below which a copy kernel stays on the calling thread


def split_qkv_func(num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: str,
                   rope_theta: float = 10000.0):
    """`fused_rope`: qkv (n, H_qo + 2 H_kv, D) -> q (n, H_qo, D), k, v (n, H_kv, D)."""
    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    half = D // 2

    @T.macro
    def copy_row(qkv, q, k, v, s):
        for h in range(H_qo):
            for d in T.vectorized(D):
                q[s, h, d] = qkv[s, h, d]
        for h in range(H_kv):
            for d in T.vectorized(D):
                k[s, h, d] = qkv[s, H_qo + h, d]
            for d in T.vectorized(D):
                v[s, h, d] = qkv[s, H_qo + H_kv + h, d]

    @T.macro
    def rotate_row(qkv, position_map, q, k, v, s):
        # TVM's llama rotary over the whole head: x * cos + rotate_half(x) * sin, in float32
        # (inlined expressions, no Bind: bfloat16 legalization retypes a bound value)
        for h in range(H_qo + H_kv):
            for d in range(D):
                freq = T.meta_var(T.Cast("float32", position_map[s]) / T.pow(
                    T.float32(rope_theta), T.Cast("float32", d * 2 % D) / T.float32(D)))
                rot = T.meta_var(T.Select(
                    d < half, -T.Cast("float32", qkv[s, h, T.min(d + half, D - 1)]),
                    T.Cast("float32", qkv[s, h, T.max(d - half, 0)])))
                val = T.meta_var(T.Cast(dtype, T.cos(freq) * T.Cast("float32", qkv[s, h, d])
                                        + T.sin(freq) * rot))
                if h < H_qo:
                    q[s, h, d] = val
                else:
                    k[s, h - H_qo, d] = val
        for h in range(H_kv):
            for d in T.vectorized(D):
                v[s, h, d] = qkv[s, H_qo + H_kv + h, d]

    @T.prim_func(check_well_formed=False)
    def fused_rope(var_qkv: T.handle, var_position_map: T.handle, var_q: T.handle,
                   var_k: T.handle, var_v: T.handle, apply_rope: T.int64):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True,
                     "global_symbol": "fused_rope"})  # replaces TVM's
        seq_len = T.int32()
        position_map_elem_offset = T.int32()
        qkv = T.match_buffer(var_qkv, (seq_len, H_qo + 2 * H_kv, D), dtype)
        position_map = T.match_buffer(var_position_map, (seq_len,), "int32",
                                      elem_offset=position_map_elem_offset)
        q = T.match_buffer(var_q, (seq_len, H_qo, D), dtype)
        k = T.match_buffer(var_k, (seq_len, H_kv, D), dtype)
        v = T.match_buffer(var_v, (seq_len, H_kv, D), dtype)
        if apply_rope > T.int64(0):
            for s in T.parallel(seq_len):
                rotate_row(qkv, position_map, q, k, v, s)
        elif seq_len >= PARALLEL_MIN_TOKENS:
            for s in T.parallel(seq_len):
                copy_row(qkv, q, k, v, s)
        else:
            for s in range(seq_len):
                copy_row(qkv, q, k, v, s)

    return fused_rope


def transpose_append_func(num_kv_heads: int, head_dim: int, dtype: str, page_size: int):
    """`tir_kv_cache_transpose_append`: k, v (n, H_kv, D) into pages (P, 2, H_kv, page, D) at
    the slots of position_map (-1: a token not stored)."""
    H_kv, D, PAGE = num_kv_heads, head_dim, page_size

    @T.macro
    def append_row(pages, k_data, v_data, position_map, t):
        pos: T.let = position_map[t]
        if pos != -1:
            for h in range(H_kv):
                for d in T.vectorized(D):
                    pages[pos // PAGE, 0, h, pos % PAGE, d] = k_data[t, h, d]
                for d in T.vectorized(D):
                    pages[pos // PAGE, 1, h, pos % PAGE, d] = v_data[t, h, d]

    @T.prim_func(check_well_formed=False)
    def tir_kv_cache_transpose_append(var_pages: T.handle, var_k_data: T.handle,
                                      var_v_data: T.handle, var_position_map: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True,
                     "global_symbol": "tir_kv_cache_transpose_append"})  # replaces TVM's
        ntoken = T.int64()
        num_pages = T.int64()
        pages_elem_offset = T.int64()
        position_map_elem_offset = T.int32()
        pages = T.match_buffer(var_pages, (num_pages, 2, H_kv, PAGE, D), dtype,
                               elem_offset=pages_elem_offset)
        k_data = T.match_buffer(var_k_data, (ntoken, H_kv, D), dtype)
        v_data = T.match_buffer(var_v_data, (ntoken, H_kv, D), dtype)
        position_map = T.match_buffer(var_position_map, (ntoken,), "int32",
                                      elem_offset=position_map_elem_offset)
        if ntoken >= T.int64(PARALLEL_MIN_TOKENS):
            for t in T.parallel(ntoken):
                append_row(pages, k_data, v_data, position_map, t)
        else:
            for t in range(ntoken):
                append_row(pages, k_data, v_data, position_map, t)

    return tir_kv_cache_transpose_append
