"""QuantPlan simulation in transformers: each linear computes with its plan format's round trip.

`SimulatedPlan` quantizes each weight as the build stores it (formats.fake_quantize, in the
format the build gives its merged linear, with the plan's importance) and, for int8 (int16)
activations, rounds each linear's input per 32-block (formats.py). The helpers name the
linears the build quantizes by their checkpoint weight names.
"""
from __future__ import annotations

from .plan import INTEGER_ACTIVATIONS

_MERGED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def merged_names(name: str) -> list:
    """Checkpoint weight names stored as one matrix with `name` by the build (q|k|v, gate|up)."""
    prefix, _, leaf = name.rpartition(".")
    if leaf == "weight":
        prefix, _, leaf = prefix.rpartition(".")
        suffix = ".weight"
    else:
        suffix = ""
    for group in _MERGED:
        if leaf in group:
            return [f"{prefix}.{m}{suffix}" for m in group]
    return [name]


def untie_head(model):
    """Give a tied LM head its own weight copy (the build quantizes the head and keeps the
    embedding table float); returns the head module."""
    import torch

    head = model.get_output_embeddings()
    if head is not None and head.weight is model.get_input_embeddings().weight:
        untied = torch.nn.Linear(head.in_features, head.out_features, bias=False)
        untied.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.set_output_embeddings(untied)
        return untied
    return head


def plan_linears(model) -> dict:
    """checkpoint weight name -> nn.Linear for every linear the build may quantize (decoder
    layers and the LM head; the head under "lm_head.weight")."""
    import torch

    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            out["lm_head.weight" if mod is model.get_output_embeddings() else f"{name}.weight"] = mod
    return out


def round_input_blocks(_mod, args, bits: int = 8):
    """Forward pre-hook: the 8 (or 16) bit per-32-block activation round trip of formats.py in
    torch."""
    import torch

    from .formats import ACTIVATION_BLOCK, ACTIVATION_QMAX

    Q = float(ACTIVATION_QMAX[bits])
    x = args[0]
    K = x.shape[-1]
    b = x.float().reshape(*x.shape[:-1], K // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    amax = b.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, Q / torch.where(amax > 0, amax, torch.ones_like(amax)),
                      torch.zeros_like(amax))
    q = torch.clamp(torch.round(b * inv), -Q, Q)
    return ((q * (amax / Q)).reshape(x.shape).to(x.dtype),) + tuple(args[1:])


class WeightSwap:
    """Base of the simulation context managers: keeps the weights it replaced (`saved`: module,
    original tensor) and the hooks it added, and restores both on exit."""

    def __init__(self):
        self.saved, self.hooks = [], []

    def __exit__(self, *exc):
        for mod, w in self.saved:
            mod.weight.data = w
        for h in self.hooks:
            h.remove()


class SimulatedPlan(WeightSwap):
    """Context manager: the model's linears compute with their QuantPlan round trip (weights by
    formats.fake_quantize in the format the build gives their merged linear, with the plan's
    importance; inputs rounded per 32-block for int8 activations). `only`: weight names to
    quantize (default: all). The LM head must be untied first (untie_head)."""

    def __init__(self, model, plan, only=None):
        super().__init__()
        self.plan = plan
        self.linears = {n: m for n, m in plan_linears(model).items() if only is None or n in only}

    def __enter__(self):
        import torch

        from .formats import FORMATS, fake_quantize
        from .plan import FLOAT

        for name, mod in self.linears.items():
            names = merged_names(name)
            fmt = self.plan.format_for(names)
            N, K = mod.weight.shape
            if fmt == FLOAT or not FORMATS[fmt].applies_to(N, K):
                continue
            w = mod.weight.detach()
            self.saved.append((mod, w.clone()))
            wq = fake_quantize(w.float().numpy(), fmt, self.plan.importance_for(names))
            mod.weight.data = torch.from_numpy(wq).to(w.dtype)
            bits = INTEGER_ACTIVATIONS.get(self.plan.activations)
            if bits:
                self.hooks.append(mod.register_forward_pre_hook(
                    lambda m, a, bits=bits: round_input_blocks(m, a, bits)))
        return self
