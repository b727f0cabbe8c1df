"""Route every attention layer of a transformers model through one custom torch op.

transformers lets a model's attention be swapped by name (AttentionInterface). We register
`tvm_paged`, which calls the torch custom op `tvm_llm::paged_attention`. torch.export keeps the
op as one node, and the Relax converter turns that node into the paged-KV-cache attention.
q/k arrive with RoPE already applied, so the cache never needs to know the rotary variant.

Attention features the cache kernels cannot compute are refused here, at trace time, with a
UserError: softcapping, sinks, and sliding windows shorter than the context.
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
        if kwargs.get("softcap") is not None:
            raise UserError(f"layer {layer} uses attention logit softcapping ({kwargs['softcap']}), "
                            "which the paged KV cache kernels cannot compute; this model is not supported")
        if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
            raise UserError(f"layer {layer} uses attention sinks, which the paged KV cache kernels "
                            "cannot compute; this model is not supported")
        window = kwargs.get("sliding_window")
        if window is not None and int(window) < self.context_window:
            raise UserError(f"layer {layer} uses a sliding attention window of {int(window)} tokens, "
                            f"shorter than the context window ({self.context_window}); build with "
                            f"--context-window {int(window)} or less")
        unknown = sorted(k for k, v in kwargs.items()
                         if v is not None and k not in _HARMLESS_KWARGS and k != "sliding_window")
        if unknown:
            raise UserError(f"layer {layer} passes attention options {unknown} that tvm_llm does not "
                            "know how to compute; this model is not supported")
        if dropout:
            raise UserError("attention dropout is on: export the model in eval mode")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        out = torch.ops.tvm_llm.paged_attention(query, key, value, int(layer), float(scaling))
        return out, None


def use_paged_attention(model, context_window: int) -> None:
    """Point `model` (and its sub-configs) at the tvm_paged attention implementation."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, AttentionGuard(context_window))
    configs = [model.config] + [c for c in vars(model.config).values()
                                if hasattr(c, "_attn_implementation")]
    for cfg in configs:
        cfg._attn_implementation = ATTN_IMPLEMENTATION
