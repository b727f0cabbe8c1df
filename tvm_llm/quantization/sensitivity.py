"""Layer-wise sensitivity: which layers lose the most when quantized.

Each unit (a decoder layer's linears, or the LM head) is quantized on its own and the held-out
perplexity and the logits' cosine similarity are measured against the float model. Quantizing
is simulated inside transformers with the exact rounding of the build (scheme.fake_quantize_np:
the compiled kernels compute with the same dequantized values; W8A8 also rounds each linear's
input per token), so a sweep over every layer costs one float forward per layer, not a build.
The units with the largest loss are the candidates for `--keep-float`.

For QuantPlans (formats.py) the same simulation with each weight in its plan format is
simulation.SimulatedPlan; the automatic mix's cheap estimate is calibration.fisher_units.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import numpy as np

from .scheme import QuantScheme, fake_quantize_np


@dataclass
class SensitivityRow:
    unit: str
    weights: int
    perplexity: float
    cosine: float


@dataclass
class SensitivityReport:
    scheme: QuantScheme
    float_perplexity: float
    all_perplexity: float
    all_cosine: float
    rows: list = field(default_factory=list)
    tokens: int = 0

    def format(self) -> str:
        base = self.float_perplexity

        def pct(p):
            return f"{(p / base - 1) * 100:+.2f}%"

        group = "per row" if self.scheme.tag == "w8a8" else f"group {self.scheme.group_size}"
        lines = [f"sensitivity to {self.scheme.tag} ({group}), perplexity over {self.tokens} tokens",
                 f"  float32                      ppl {base:9.3f}",
                 f"  everything quantized         ppl {self.all_perplexity:9.3f}  {pct(self.all_perplexity):>8}"
                 f"  logits cosine {self.all_cosine:.5f}",
                 f"  {'only this unit quantized':<26} {'weights':>9} {'ppl':>9} {'change':>8} {'cosine':>9}"]
        for r in sorted(self.rows, key=lambda r: -r.perplexity):
            lines.append(f"  {r.unit:<26} {r.weights:>9,} {r.perplexity:9.3f} {pct(r.perplexity):>8} "
                         f"{r.cosine:9.5f}")
        worst = max(self.rows, key=lambda r: r.perplexity) if self.rows else None
        if worst is not None:
            hint = worst.unit.replace("layer ", "") if worst.unit.startswith("layer ") else "lm_head"
            lines.append(f"  most sensitive: {worst.unit}  (keep it float with --keep-float {hint})")
        return "\n".join(lines)


def _units(model) -> dict:
    """unit name -> list of nn.Linear modules (those the build quantizes: weight (N, K))."""
    import torch

    units: dict = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        m = re.search(r"(?:^|\.)(?:layers|h|layer|blocks)\.(\d+)\.", name)
        unit = f"layer {int(m.group(1))}" if m else ("lm_head" if "lm_head" in name else name)
        units.setdefault(unit, []).append((name, mod))
    return units


class _Quantized:
    """Context manager: the given linears compute with fake-quantized weights (and inputs)."""

    def __init__(self, linears, scheme: QuantScheme):
        self.linears = [(n, m) for n, m in linears  # the linears the build would quantize
                        if scheme.applies_to(m.weight.shape[1], m.weight.shape[0])
                        and not scheme.keeps_float([n])]
        self.scheme = scheme
        self.saved, self.hooks = [], []

    def __enter__(self):
        import torch

        for _, mod in self.linears:
            w = mod.weight.detach()
            self.saved.append(w.clone())
            mod.weight.data = torch.from_numpy(fake_quantize_np(w.float().numpy(), self.scheme)).to(w.dtype)
            if self.scheme.activations == "int8":
                self.hooks.append(mod.register_forward_pre_hook(_round_input))
        return self

    def __exit__(self, *exc):
        for (_, mod), w in zip(self.linears, self.saved):
            mod.weight.data = w
        for h in self.hooks:
            h.remove()


def _round_input(_mod, args):
    import torch

    x = args[0]
    s = x.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(s > 0, torch.clamp(torch.round(x / torch.where(s > 0, s, 1)), -127, 127), 0)
    return (q * s,) + tuple(args[1:])


def sensitivity(model_dir: str, scheme: QuantScheme, text: str, window: int = 256,
                max_windows: int | None = None, log=print) -> SensitivityReport:
    import torch
    from tokenizers import Tokenizer

    from ..config import BuildConfig
    from ..front import lower
    from ..perplexity import _nll, windows

    lowered = lower(model_dir, BuildConfig.create(dtype="float32"), "load",
                    log=lambda *a: None)
    model = lowered.model.eval()
    tied = getattr(lowered.checkpoint.text_config, "tie_word_embeddings", False)
    ids = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(text).ids
    wins = windows(ids, window, max_windows)
    batch = torch.tensor([w[:-1] for w in wins])
    targets = np.asarray([w[1:] for w in wins])

    def run():
        with torch.no_grad():
            logits = torch.cat([model(batch[i:i + 8]).logits for i in range(0, len(batch), 8)])
        logits = logits.float().numpy()
        nll = sum(_nll(lg, t) for lg, t in zip(logits, targets)) / targets.size
        return float(np.exp(nll)), logits

    def cosine(a, b):
        return float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))

    log(f"[tvm-llm] float32 perplexity over {targets.size} tokens")
    base, ref = run()
    units = _units(model)
    if tied and "lm_head" in units:  # the build quantizes a copy; the embedding stays float
        (name, head), = units["lm_head"]
        untied = torch.nn.Linear(head.in_features, head.out_features, bias=False)
        untied.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.set_output_embeddings(untied)
        units["lm_head"] = [(name, untied)]
    every = [lin for lins in units.values() for lin in lins]
    log(f"[tvm-llm] all {len(every)} linears quantized")
    with _Quantized(every, scheme):
        all_ppl, all_logits = run()
    report = SensitivityReport(scheme, base, all_ppl, cosine(ref, all_logits), tokens=int(targets.size))
    for unit, lins in units.items():
        log(f"[tvm-llm] {unit} quantized alone")
        with _Quantized(lins, scheme) as q:
            ppl, logits = run()
        report.rows.append(SensitivityRow(unit, sum(m.weight.numel() for _, m in q.linears), ppl,
                                          cosine(ref, logits)))
    return report
