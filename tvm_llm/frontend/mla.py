"""Multi-head latent attention (DeepSeek-V2/V3 MLA) with the compressed latent in the KV cache.

What transformers gives us. An MLA layer projects each token to a latent `c` (kv_lora_rank
wide, RMS-normed) and a decoupled key part `k_pe` (qk_rope_head_dim wide, shared by all heads,
rotated by the model's RoPE). Its `expand_kv(c, k_pe)` then up-projects `c` with `kv_b_proj`
into per-head keys (nope part, with `k_pe` appended) and values, and only those full K/V reach
the AttentionInterface. Routing that call alone would cache full K/V, which MLA exists to avoid.

The seam we use. `expand_kv` is the one method where transformers goes from the latent to full
K/V, so `use_latent_attention` replaces it, per attention module, by the identity: the
attention interface then receives the latent and `k_pe` in place of K and V, and our interface
(`tvm_mla`) calls one custom op, `tvm_llm::mla_attention(q, c, k_pe, kv_b_proj.weight, ...)`.
Everything else stays the model's own code and weights, traced: the q path (q_proj or
q_a_proj → q_a_layernorm → q_b_proj), kv_a_proj_with_mqa, kv_a_layernorm, the model's RoPE
(plain or interleaved) and its softmax scale (with the YaRN mscale), o_proj after the op.

The lowering (weight absorption). With W = kv_b_proj.weight viewed as per head
[W_UK (nope × L); W_UV (v × L)], a head's score is q_nope·(W_UK c) + q_pe·k_pe =
(W_UKᵀ q_nope | q_pe)·(c | k_pe), and its output is W_UV (Σ p c). So every head attends over
the same cached row (c | k_pe) of width L + R with the absorbed query (W_UKᵀ q_nope | q_pe), and
the per-head latent output is projected by W_UV afterwards. The W_UK / W_UV slices are
weight-only and folded at build time. The cache stores (c | k_pe): one "KV head" of width
L + R (the page tensor's last dim), not num_heads × (qk + v) values.

Why TVM's `mla` cache kind is not used (yet). TVM 0.27's runtime computes an MLA prefill as a
ragged self-attention over the new tokens plus a cross-attention over the pages, merged by
log-sum-exp; but its CrossAttention skips the kernel when no sequence of the batch has earlier
pages and leaves the output and LSE buffers unwritten (a fresh prompt merges garbage), and a
prefill whose sequences all append one token runs with the pages already holding that token
(self plus cross would count it twice). Neither case is visible to the compiled graph. The
cache's `mha` kind with one KV head of width L + R and the attention kernels we already use
(ours on CPU, TVM's on CUDA/ROCm) handle both cases and forks correctly; its cost is that the
page keeps the row twice (the K and the V plane, 2 (L + R) values per token and layer). The
V plane's last R columns (k_pe) are attended too and dropped before W_UV. On CPU the decode
kernel (schedules/cpu/mla_attention.py) reads the values from the K plane. Prefill also runs
in the absorbed form: at DeepSeek-V3's sizes that is ~3.5x the attention FLOPs of attending
with up-projected K/V over the new tokens (a later optimization), but one cache path.

deepseek_v2 has the same `expand_kv` seam, but its transformers RoPE computes with complex
numbers, which the importer refuses (relax_import._refuse_complex_ops); deepseek_v3 imports.
"""
from __future__ import annotations

import types

import torch

from ..errors import UserError
from .attention import check_attention_call

MLA_IMPLEMENTATION = "tvm_mla"


@torch.library.custom_op("tvm_llm::mla_attention", mutates_args=())
def mla_attention(q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, w_kv_b: torch.Tensor,
                  layer_id: int, scale: float, nope_dim: int, v_dim: int) -> torch.Tensor:
    """q: (b, nh, s, nope + R) (q_pe rotated), latent: (b, 1, s, L) (normed), k_pe: (b, 1, s, R)
    (rotated), w_kv_b: (nh * (nope + v), L) -> (b, s, nh, v).

    The eager body is causal attention over the current chunk computed the way transformers
    does (up-projected K/V); torch.export uses the fake implementation."""
    b, nh, s, _ = q.shape
    kv = torch.nn.functional.linear(latent, w_kv_b).view(b, s, nh, nope_dim + v_dim).transpose(1, 2)
    k_nope, v = kv.split([nope_dim, v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.expand(b, nh, s, k_pe.shape[-1])], dim=-1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(1, 2).contiguous()


@mla_attention.register_fake
def _mla_attention_fake(q, latent, k_pe, w_kv_b, layer_id, scale, nope_dim, v_dim):
    b, nh, s, _ = q.shape
    return q.new_empty((b, s, nh, v_dim))


def is_mla_module(module) -> bool:
    """An attention module of the DeepSeek MLA shape (transformers' deepseek_v2 / deepseek_v3)."""
    return all(hasattr(module, a) for a in ("kv_b_proj", "kv_lora_rank", "qk_nope_head_dim",
                                            "v_head_dim", "expand_kv"))


def _latent_passthrough(self, latent, k_pe):
    """Replaces expand_kv: K/V stay the latent and the rotated k_pe (see the module doc)."""
    return latent, k_pe


def _mla_interface(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention interface of MLA layers: (q, latent, k_pe) -> tvm_llm::mla_attention."""
    layer = getattr(module, "layer_idx", None)
    if layer is None or not getattr(module, "_tvm_latent_kv", False):
        raise UserError(f"attention module {type(module).__name__} is not a latent-attention layer "
                        "tvm_llm prepared; this architecture is not supported")
    check_attention_call(layer, kwargs, dropout)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = torch.ops.tvm_llm.mla_attention(query, key, value, module.kv_b_proj.weight, int(layer),
                                          float(scaling), int(module.qk_nope_head_dim),
                                          int(module.v_head_dim))
    return out, None


def use_latent_attention(model) -> bool:
    """If `model` has MLA attention modules: make them pass the latent to the attention
    interface and point the model at `tvm_mla`. Returns whether it did."""
    from transformers import AttentionInterface

    modules = [m for m in model.modules() if is_mla_module(m)]
    if not modules:
        return False
    for m in modules:
        if m.kv_b_proj.bias is not None:
            raise UserError("kv_b_proj has a bias, which weight absorption cannot fold; this MLA "
                            "variant is not supported")
        m.expand_kv = types.MethodType(_latent_passthrough, m)
        m._tvm_latent_kv = True
    AttentionInterface.register(MLA_IMPLEMENTATION, _mla_interface)
    configs = [model.config] + [c for c in vars(model.config).values()
                                if hasattr(c, "_attn_implementation")]
    for cfg in configs:
        cfg._attn_implementation = MLA_IMPLEMENTATION
    return True


def mla_converters(layers: dict, cache_var, cache_dtype: str | None = None) -> dict:
    """Relax converter of tvm_llm::mla_attention: absorbed query, the latent row (c | k_pe) as
    one KV head of the paged cache (K and V planes), attention, then W_UV per head.
    Records (num_heads, 1, L + R, L + R, scale, "latent") for the layer in `layers`, like the
    standard attention converter, so the cache is created for one KV head of the latent width
    (and the CPU build takes schedules/cpu/mla_attention.py's decode kernel)."""
    from tvm import relax as rx

    def convert(node, importer):
        bb = importer.block_builder
        q, latent, k_pe, w = (importer.env[a] for a in node.args[:4])
        layer_id, scale = int(node.args[4]), float(node.args[5])
        nope, vd = int(node.args[6]), int(node.args[7])
        b, nh, s, _ = q.ty.shape
        lat, rope = int(latent.ty.shape[3]), int(k_pe.ty.shape[3])
        nh_i, width = int(nh), lat + rope
        layers[layer_id] = (nh_i, 1, width, width, scale, "latent")
        dtype = str(cache_dtype or q.ty.dtype)

        def cast(t, dt):
            return t if str(t.ty.dtype) == dt else bb.emit(rx.op.astype(t, dt))

        # W: (nh * (nope + v), L) -> W_UK (nh, nope, L), W_UV^T (nh, L, v); weight-only (folded)
        w3 = bb.emit(rx.op.reshape(w, [nh_i, nope + vd, lat]))
        w_uk = bb.emit(rx.op.strided_slice(w3, axes=[1], begin=[0], end=[nope]))
        w_uv_t = bb.emit(rx.op.permute_dims(
            rx.op.strided_slice(w3, axes=[1], begin=[nope], end=[nope + vd]), [0, 2, 1]))
        q_nope = bb.emit(rx.op.strided_slice(q, axes=[3], begin=[0], end=[nope]))
        q_pe = bb.emit(rx.op.strided_slice(q, axes=[3], begin=[nope], end=[nope + rope]))
        q_abs = bb.emit(rx.op.matmul(q_nope, cast(w_uk, str(q_nope.ty.dtype))))  # (b, nh, s, L)
        q_row = bb.emit(rx.op.concat([q_abs, cast(q_pe, str(q_abs.ty.dtype))], axis=3))
        kv_row = bb.emit(rx.op.concat([latent, cast(k_pe, str(latent.ty.dtype))], axis=3))
        q_row, kv_row = cast(q_row, dtype), cast(kv_row, dtype)
        q_row = bb.emit(rx.op.permute_dims(q_row, [0, 2, 1, 3]))    # (b, s, nh, L + R)
        kv_row = bb.emit(rx.op.permute_dims(kv_row, [0, 2, 1, 3]))  # (b, s, 1, L + R)
        qkv = bb.emit(rx.op.concat([q_row, kv_row, kv_row], axis=2))
        qkv = bb.emit(rx.op.reshape(qkv, [b * s, nh_i + 2, width]))
        out = bb.emit(rx.call_dps_packed(
            "vm.builtin.attention_kv_cache_attention_with_fused_qkv",
            [cache_var, rx.prim_value(layer_id), rx.prim_value(scale), qkv],
            out_ty=rx.TensorType([b * s, nh_i, width], dtype)))
        o_lat = bb.emit(rx.op.strided_slice(out, axes=[2], begin=[0], end=[lat]))  # (b*s, nh, L)
        o_lat = cast(o_lat, str(q.ty.dtype))
        o_lat = bb.emit(rx.op.permute_dims(o_lat, [1, 0, 2]))                      # (nh, b*s, L)
        o = bb.emit(rx.op.matmul(o_lat, cast(w_uv_t, str(o_lat.ty.dtype))))       # (nh, b*s, v)
        o = bb.emit(rx.op.permute_dims(o, [1, 0, 2]))
        return bb.emit(rx.op.reshape(o, [b, s, nh_i, vd]))

    return {"mla_attention.default": convert}
