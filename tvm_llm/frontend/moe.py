"""Route the experts of every mixture-of-experts block through one custom torch op.

transformers' MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss, ...) keep their
experts in one module decorated with `use_experts_implementation`: its forward takes the
tokens, each token's top-k expert ids and their routing weights, and dispatches by name through
`ExpertsInterface` (like attention through `AttentionInterface`). We register `tvm_experts`,
which calls the torch custom op `tvm_llm::moe_experts`. The router (softmax, top-k,
normalisation, as each model defines it) stays in the traced model code: it traces into plain
ops. The op becomes, in Relax (relax_import.moe_converter): tokens sorted by expert, two
grouped expert GEMMs whose weights are indexed by each row's expert id inside the kernel (a
decode step reads only the selected experts' weights), the gating between them, and the
routing-weighted sum over the k experts.

The op takes the weights in one canonical layout, (experts, in, out), with the gate half first
and the up half second; the layouts transformers stores (concatenated or interleaved gate/up,
transposed or not) are turned into it in the traced graph, weight-only work that the build folds
once (passes/fold_weights.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import UserError

EXPERTS_IMPLEMENTATION = "tvm_experts"

# gating functions the op computes between the two GEMMs; (gate, up) halves of the first GEMM
#   "<act>": act(gate) * up, for transformers' activation names below
#   "clamped_swiglu": gpt-oss's (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l)
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu", "relu")


def gate_torch(h: torch.Tensor, gating: str, alpha: float, limit: float) -> torch.Tensor:
    """The gating in torch (the op's eager body; the Relax lowering mirrors it)."""
    gate, up = h.chunk(2, dim=-1)
    if gating == "clamped_swiglu":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if gating == "silu":
        return torch.nn.functional.silu(gate) * up
    if gating == "gelu_pytorch_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    if gating == "gelu":
        return torch.nn.functional.gelu(gate) * up
    if gating == "relu":
        return torch.relu(gate) * up
    raise ValueError(gating)


@torch.library.custom_op("tvm_llm::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: Optional[torch.Tensor],
                down_bias: Optional[torch.Tensor], gating: str, alpha: float,
                limit: float) -> torch.Tensor:
    """x (t, h); top_k_index / top_k_weights (t, k); gate_up (e, h, 2i) [gate | up];
    down (e, i, h); biases (e, 2i) / (e, h) or None -> (t, h) = sum over k of
    weight * down(gating(x @ gate_up[expert] + b)) + b. Reference eager body (dense gather)."""
    idx = top_k_index.reshape(-1)
    xs = x.repeat_interleave(top_k_index.shape[1], dim=0)
    h = torch.bmm(xs.unsqueeze(1), gate_up[idx]).squeeze(1)
    if gate_up_bias is not None:
        h = h + gate_up_bias[idx]
    a = gate_torch(h, gating, alpha, limit)
    y = torch.bmm(a.unsqueeze(1), down[idx]).squeeze(1)
    if down_bias is not None:
        y = y + down_bias[idx]
    y = y * top_k_weights.reshape(-1, 1).to(y.dtype)
    return y.view(x.shape[0], -1, x.shape[1]).sum(dim=1).to(x.dtype)


@moe_experts.register_fake
def _moe_experts_fake(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                      gating, alpha, limit):
    return x.new_empty(x.shape)


def experts_gating(module) -> tuple[str, float, float]:
    """(gating name, alpha, limit) of an experts module, or a UserError naming what is unknown."""
    from transformers.integrations.moe import _default_apply_gate

    name = type(module).__name__
    if not getattr(module, "has_gate", True):
        raise UserError(f"experts module {name} has no gate projection (ungated experts); "
                        "tvm_llm computes gated experts only; this model is not supported")
    if getattr(module, "has_post_expert_norm", False):
        raise UserError(f"experts module {name} normalises each expert's output; tvm_llm does "
                        "not compute that; this model is not supported")
    own_gate = getattr(type(module), "_apply_gate", _default_apply_gate)
    if own_gate is not _default_apply_gate:
        if hasattr(module, "alpha") and hasattr(module, "limit") and not module.is_concatenated:
            return "clamped_swiglu", float(module.alpha), float(module.limit)
        raise UserError(f"experts module {name} defines its own gating function, which tvm_llm "
                        "does not know how to compute; this model is not supported")
    act = getattr(module.config, "hidden_act", None)
    if act not in GATED_ACTIVATIONS:
        raise UserError(f"experts module {name} uses activation {act!r}; tvm_llm's expert "
                        f"gating computes {', '.join(GATED_ACTIVATIONS)}; this model is not supported")
    return act, 0.0, 0.0


def canonical_weights(module):
    """(gate_up (e, h, 2i) gate half first, down (e, i, h), gate_up bias, down bias) of an
    experts module, as torch expressions of its parameters (traced, then folded at build time)."""
    gate_up, down = module.gate_up_proj, module.down_proj
    b1 = module.gate_up_proj_bias if getattr(module, "has_bias", False) else None
    b2 = module.down_proj_bias if getattr(module, "has_bias", False) else None
    if not module.is_transposed:  # (e, out, in) -> (e, in, out)
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if not module.is_concatenated:  # [g0, u0, g1, u1, ...] -> [g..., u...]
        gate_up = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1)
        if b1 is not None:
            b1 = torch.cat([b1[..., 0::2], b1[..., 1::2]], dim=-1)
    return gate_up, down, b1, b2


def tvm_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """The `tvm_experts` experts implementation: one call of tvm_llm::moe_experts."""
    if getattr(module, "_is_expert_parallel", False):
        raise UserError("expert parallelism is on; export the model on one device")
    gating, alpha, limit = experts_gating(module)
    gate_up, down, b1, b2 = canonical_weights(module)
    return torch.ops.tvm_llm.moe_experts(hidden_states, top_k_index, top_k_weights,
                                          gate_up, down, b1, b2, gating, alpha, limit)


def experts_modules(model) -> list:
    """The model's experts modules (those transformers dispatches through ExpertsInterface)."""
    return [m for m in model.modules()
            if hasattr(m, "gate_up_proj") and hasattr(m, "is_transposed") and hasattr(m, "has_gate")]


def use_tvm_experts(model) -> int:
    """Point `model` (and its sub-configs) at the tvm_experts implementation; return how many
    experts modules it has (0 for a dense model: nothing changes)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    found = experts_modules(model)
    if not found:
        return 0
    for m in found:
        experts_gating(m)  # refuse an unknown gating before tracing
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, tvm_experts_forward)
    configs = {id(model.config): model.config} if hasattr(model, "config") else {}
    for m in found:
        configs[id(m.config)] = m.config
    for cfg in list(configs.values()):
        for c in vars(cfg).values():
            if hasattr(c, "_experts_implementation"):
                configs[id(c)] = c
    for cfg in configs.values():
        cfg._experts_implementation = EXPERTS_IMPLEMENTATION
    return len(found)
