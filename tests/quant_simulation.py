"""The tests' own simulation of a quantized build inside transformers, driven by the build's
report (an oracle independent of tvm_llm.quantization.sensitivity): each weight the manifest
lists computes with its format's fake-quantized weight, and int8-activation linears round
their inputs per 32-block."""
from __future__ import annotations

import torch

from tvm_llm.quantization.formats import fake_quantize, fake_quantize_activation
from tvm_llm.quantization.plan import INTEGER_ACTIVATIONS
from tvm_llm.quantization.simulation import WeightSwap


class Simulated(WeightSwap):
    """Context manager: every weight the build's report lists computes, inside transformers,
    with the fake-quantized weight of its format (and int8-rounded inputs where the build uses
    int8 activations)."""

    def __init__(self, model, quantized):
        super().__init__()
        self.model, self.quantized = model, quantized or {}

    def __enter__(self):
        done = set()
        modules = dict(self.model.named_modules())
        for key, entry in self.quantized.items():
            for name in key.split(","):
                mod = modules[name.rsplit(".weight", 1)[0]]
                if id(mod.weight) not in done:  # a tied table is one tensor: quantized once
                    done.add(id(mod.weight))
                    self.saved.append((mod, mod.weight.data))
                    w = mod.weight.detach().float().numpy()
                    mod.weight.data = torch.from_numpy(fake_quantize(w, entry["format"]))
                bits = INTEGER_ACTIVATIONS.get(entry["activations"])
                if bits and isinstance(mod, torch.nn.Linear):
                    self.hooks.append(mod.register_forward_pre_hook(
                        lambda _m, a, bits=bits: (torch.from_numpy(fake_quantize_activation(a[0].numpy(), bits)),)
                        + a[1:]))
        return self
