"""Route every attention layer of a transformers model through one custom torch op.

transformers lets a model's attention be swapped by name (AttentionInterface). We register
`tvm_paged`, which calls the torch custom op `tvm_llm::paged_attention`. torch.export keeps the
op as one node, and the Relax converter turns that node into the paged-KV-cache attention.
q/k arrive with RoPE already applied, so the cache never needs to know the rotary variant.

Layers with attention variants (a sliding window shorter than the context, logit soft-capping,
attention sinks) call `tvm_llm::paged_attention_variant` instead, which carries them to the
converter (tvm_llm/frontend/relax_import.py) and on to the CPU kernels' per-layer tables.
Options the kernels cannot compute are refused here, at trace time, with a UserError.
"""
from __future__ import annotations

import torch

from ..errors import UserError

ATTN_IMPLEMENTATION = "tvm_paged"

# kwargs transformers passes that carry no attention semantics the cache must honour
_HARMLESS_KWARGS = {"position_ids", "use_cache", "cache_position", "output_attentions",
                    "position_embeddings", "is_causal", "cu_seq_lens_q", "cu_seq_lens_k",
                    "max_length_q", "max_length_k", "output_hidden_states",
                    "output_router_logits"}  # MoE models: the router logits output (unused)


def check_attention_call(layer: int, kwargs: dict, dropout: float, known=frozenset()) -> None:
    """Refuse, at trace time, an attention call whose options the kernels would ignore: keyword
    arguments beyond the harmless ones and `known`, or dropout (a model not in eval mode)."""
    unknown = sorted(k for k, v in kwargs.items()
                     if v is not None and k not in _HARMLESS_KWARGS and k not in known)
    if unknown:
        raise UserError(f"layer {layer} passes attention options {unknown} that tvm_llm does not "
                        "know how to compute; this model is not supported")
    if dropout:
        raise UserError("attention dropout is on: export the model in eval mode")


@torch.library.custom_op("tvm_llm::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                    scale: float) -> torch.Tensor:
    """q: (b, nh, s, d), k/v: (b, nkv, s, d) in HF layout -> (b, s, nh, dv).

    The eager body is plain causal attention over the current chunk; it only runs when the
    traced model is executed in torch (export itself uses the fake implementation)."""
    nh, nkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(1, 2).contiguous()


@paged_attention.register_fake
def _paged_attention_fake(q, k, v, layer_id, scale):
    b, nh, s, _ = q.shape
    return q.new_empty((b, s, nh, v.shape[-1]))


@torch.library.custom_op("tvm_llm::paged_attention_variant", mutates_args=())
def paged_attention_variant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                            scale: float, window: int, softcap: float,
                            sinks: torch.Tensor) -> torch.Tensor:
    """paged_attention for a layer with variants: `window` (0: none; key j visible to query i
    when i - j < window), `softcap` (0: none; scores = softcap * tanh(scores / softcap), after
    scaling), `sinks` (one logit per query head joining the softmax denominator; an empty
    tensor for none). The eager body is the reference computation over the current chunk."""
    nh, nkv, s = q.shape[1], k.shape[1], q.shape[2]
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    i = torch.arange(s).view(-1, 1)
    j = torch.arange(s).view(1, -1)
    visible = (j <= i) & ((i - j < window) if window else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks.numel():
        sink = sinks.reshape(1, nh, 1, 1).expand(q.shape[0], nh, s, 1).to(scores.dtype)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v).transpose(1, 2).contiguous()


@paged_attention_variant.register_fake
def _paged_attention_variant_fake(q, k, v, layer_id, scale, window, softcap, sinks):
    b, nh, s, _ = q.shape
    return q.new_empty((b, s, nh, v.shape[-1]))


class AttentionGuard:
    """Checks each traced attention call against what the paged cache can compute."""

    def __init__(self, context_window: int):
        self.context_window = context_window

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise UserError(f"attention module {type(module).__name__} has no layer_idx: this "
                            "architecture is not supported by the generic importer")
        variant = _layer_variant(layer, self.context_window, kwargs)
        check_attention_call(layer, kwargs, dropout, known=_VARIANT_KWARGS)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        if variant is not None:
            window, softcap, sinks = variant
            out = torch.ops.tvm_llm.paged_attention_variant(query, key, value, int(layer),
                                                            float(scaling), window, softcap, sinks)
            return out, None
        out = torch.ops.tvm_llm.paged_attention(query, key, value, int(layer), float(scaling))
        return out, None

# attention variants transformers passes as keyword arguments (see _layer_variant)
_VARIANT_KWARGS = {"sliding_window", "softcap", "s_aux"}


def _layer_variant(layer: int, context_window: int, kwargs: dict):
    """(window, softcap, sinks) of a layer with attention variants, or None for plain causal
    attention. A window at least as long as the context never slides: plain attention."""
    if kwargs.get("sinks") is not None:
        raise UserError(f"layer {layer} passes attention sinks as `sinks`, a form tvm_llm does not "
                        "know (gpt-oss passes `s_aux`); this model is not supported")
    window = kwargs.get("sliding_window")
    window = int(window) if window is not None and int(window) < context_window else 0
    softcap = kwargs.get("softcap")
    softcap = float(softcap) if softcap else 0.0
    if softcap < 0:
        raise UserError(f"layer {layer}: attention softcap {softcap} is negative")
    sinks = kwargs.get("s_aux")
    if sinks is None and not window and not softcap:
        return None
    if sinks is None:
        sinks = torch.zeros(0)
    return window, softcap, sinks


def use_paged_attention(model, context_window: int) -> None:
    """Point `model` (and its sub-configs) at the tvm_paged attention implementation."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, AttentionGuard(context_window))
    configs = [model.config] + [c for c in vars(model.config).values()
                                if hasattr(c, "_attn_implementation")]
    for cfg in configs:
        cfg._attn_implementation = ATTN_IMPLEMENTATION
