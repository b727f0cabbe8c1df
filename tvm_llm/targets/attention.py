"""Our attention kernels in place of TVM's paged-KV-cache kernels, per target family.

TVM's CPU attention kernels are scalar and serial, and its GPU kernels know no per-layer
sliding windows, soft-caps or attention sinks; the kernels here (schedules/cpu/attention.py,
schedules/cpu/mla_attention.py) replace them under the names the cache calls. The targets
ask for them through `TargetSpec.cache_kernels`; the frontend installs what they return.
"""
from __future__ import annotations


def layer_table(attn):
    """The kernels' per-layer table (scales, windows, soft-caps, sinks) of a traced
    frontend.AttentionShape; None when no layer has an attention variant."""
    if not attn.variants:
        return None
    from schedules.cpu.attention import LayerTable

    rows = [attn.variants.get(i, (0, 0.0, None)) for i in range(attn.num_layers)]
    with_sinks = any(r[2] is not None for r in rows)
    no_sink = [-1e30] * attn.num_heads  # exp(-1e30) = 0: the layer has no sink
    return LayerTable(scales=tuple(attn.scales), windows=tuple(r[0] for r in rows),
                      softcaps=tuple(r[1] for r in rows),
                      sinks=tuple(tuple(r[2] if r[2] is not None else no_sink) for r in rows)
                      if with_sinks else None)


# TVM's own CPU cache kernels that lack the `tirx.noalias` attribute; each takes distinct
# buffers (the page pool and index arrays; merge_state_inplace's own and other partial states;
# the tree-attention kernels' q/k/v/output, never called by our runtime). Marked here because
# TVM's LLVM codegen of a module (TVM 0.27) drops the alias information of *other* functions'
# parallel loops when such a function is generated after them (order by name): with these
# last in the model's module, every kernel's buffers read as possibly aliased and the tiled
# prefill attention ran 1.4-1.6x slower than compiled alone (its accumulators not kept in
# registers). Measured: tiny model, ragged prefill kernel 2.75 -> 1.91 ms with the attribute.
TVM_KERNELS_WITHOUT_NOALIAS = ("batch_tree_attn", "tree_attn_paged_kv_cpu",
                               "merge_state_inplace_cpu", "copy_single_page_cpu",
                               "compact_kv_copy_cpu")


def cpu_cache_kernels(kv_mod, attn, dtype: str, page_size: int, threads: int = 16,
                      amx: bool = False) -> dict:
    """CPU: decode, ragged and paged prefill and the sliding-window page layout's kernels
    (ours, honouring the layer table), MLA's latent decode, the q/k/v split and K/V append
    (ours: no thread-pool fork at decode), and TVM's own page kernels (compaction; the append
    where ours do not apply) rebuilt for `page_size`-token pages.
    `threads`: the target's cores; the decode kernel splits a sequence's keys over threads
    only when there are fewer (sequence, KV head) items than that (on 2 cores, llama-110m's
    4 KV heads are never split: a split's second pass and workspace cost more than they gave).
    `amx`: the target has AMX-BF16, and bfloat16 prefill kernels take their scores from AMX
    tiles (schedules/cpu/attention.py `_query_tile_macros`)."""
    from schedules.cpu.attention import (decode_attention_func, prefill_paged_attention_func,
                                         prefill_ragged_attention_func)

    shape = (attn.num_kv_heads, attn.num_heads, attn.head_dim, dtype)
    table = layer_table(attn)
    kernels = {
        "batch_decode_paged_kv_cpu": decode_attention_func(*shape, page_size=page_size,
                                                           table=table, threads=threads),
        "batch_prefill_ragged_kv": prefill_ragged_attention_func(*shape, table=table, amx=amx),
        "batch_prefill_paged_kv_cpu": prefill_paged_attention_func(
            *shape, page_size=page_size, table=table, amx=amx),
        # the sliding-window layout's kernels run only in a model whose layers all slide (the
        # runtime enables the layout from the manifest's window): elsewhere their compact
        # forms stand in, never called (the vector kernels cost ~2 s of codegen for decode,
        # ~0.8 s of a tiny model's build for the paged prefill)
        "batch_prefill_paged_kv_cpu_sliding_window": prefill_paged_attention_func(
            *shape, page_size=page_size, table=table, sliding=True, amx=amx,
            vector=attn.sliding_window > 0),
        "batch_decode_paged_kv_cpu_sliding_window": decode_attention_func(
            *shape, page_size=page_size, table=table, sliding=True, threads=threads,
            vector=attn.sliding_window > 0),
    }
    if attn.latent:  # MLA: heads split over threads, values read from the K plane
        from schedules.cpu.mla_attention import latent_decode_attention_func

        kernels["batch_decode_paged_kv_cpu"] = latent_decode_attention_func(
            attn.num_heads, attn.head_dim, dtype, page_size=page_size)
    if page_size != 16:
        kernels.update(_cpu_page_kernels(attn, dtype, page_size))
    if attn.v_head_dim == attn.head_dim:  # (ours assume one row width for q, k and v)
        kernels.update(_cpu_copy_kernels(attn, dtype, page_size))
    names = {gv.name_hint for gv in kv_mod.get_global_vars()}
    for name in TVM_KERNELS_WITHOUT_NOALIAS:  # see the constant's comment
        if name in kernels or name in names:
            kernels[name] = (kernels.get(name) or kv_mod[name]).with_attr("tirx.noalias", True)
    return kernels


def _cpu_copy_kernels(attn, dtype: str, page_size: int) -> dict:
    """The q/k/v split (`fused_rope`) and the K/V append the cache runs in every layer before
    the attention kernel: ours copy rows as vectors on the calling thread at decode, where
    TVM's split forked the thread pool for a one-token copy (schedules/cpu/kv_append.py)."""
    from schedules.cpu.kv_append import split_qkv_func, transpose_append_func

    return {"fused_rope": split_qkv_func(attn.num_heads, attn.num_kv_heads, attn.head_dim, dtype),
            "tir_kv_cache_transpose_append": transpose_append_func(
                attn.num_kv_heads, attn.head_dim, dtype, page_size)}


def _cpu_page_kernels(attn, dtype: str, page_size: int) -> dict:
    """TVM's own CPU page kernels (append, compaction) for `page_size`-token pages. (The
    tree-attention kernel stays 16-token: speculative tree decoding is never used by our
    runtime.)"""
    from tvm.relax.frontend.nn.llm import _page_kernels as pk

    h_kv, d = attn.num_kv_heads, attn.head_dim
    kernels = {
        "tir_kv_cache_transpose_append": pk._kv_cache_transpose_append(h_kv, d, dtype, page_size),
        "compact_kv_copy_cpu": pk._compact_kv_copy_cpu(h_kv, d, dtype, page_size),
    }
    return {name: func.with_attr("global_symbol", name) for name, func in kernels.items()}


def gpu_variant_kernels(attn, dtype: str) -> dict:
    """GPU builds of a model with attention variants: our CPU kernels with their per-layer
    table, one GPU thread per (row, KV head) item (`for_gpu`), in place of TVM's decode, paged
    prefill and ragged prefill kernels (GPU pages hold 16 tokens)."""
    from schedules.cpu.attention import (decode_attention_func, for_gpu,
                                         prefill_paged_attention_func,
                                         prefill_ragged_attention_func)

    shape = (attn.num_kv_heads, attn.num_heads, attn.head_dim, dtype)
    table = layer_table(attn)
    kernels = {
        "batch_decode_paged_kv": decode_attention_func(*shape, 16, table, vector=False),
        "batch_decode_paged_kv_sliding_window": decode_attention_func(*shape, 16, table, True,
                                                                      vector=False),
        "batch_prefill_paged_kv": prefill_paged_attention_func(*shape, 16, table, vector=False),
        "batch_prefill_paged_kv_sliding_window": prefill_paged_attention_func(
            *shape, 16, table, True, vector=False),
        "batch_prefill_ragged_kv": prefill_ragged_attention_func(*shape, table, vector=False),
    }
    return {name: for_gpu(func).with_attr("global_symbol", name) for name, func in kernels.items()}
