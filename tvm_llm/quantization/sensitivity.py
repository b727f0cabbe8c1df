"""Layer-wise sensitivity: which layers lose the most when quantized.

Each unit (a decoder layer's linears, or the LM head) is quantized on its own and the held-out
perplexity and the logits' cosine similarity are measured against the float model. Quantizing
is simulated inside transformers with the exact rounding of the build (scheme.fake_quantize_np:
the compiled kernels compute with the same dequantized values; W8A8 also rounds each linear's
input per token), so a sweep over every layer costs one float forward per layer, not a build.
The units with the largest loss are the candidates for `--keep-float`.

For QuantPlans (formats.py): `SimulatedPlan` is the same simulation with each weight in its
plan format (and per-32-block int8 activation rounding), and `fisher_units` the cheap estimate
the automatic mix (mix.py) uses instead of one forward per unit: a diagonal-Fisher loss
increase per stored matrix from one calibration pass with gradients.
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

    from ..frontend import load_model, read_config
    from ..perplexity import _nll, windows

    config = read_config(model_dir)
    model = load_model(model_dir, config, "float32").eval()
    tied = getattr(config.get_text_config(), "tie_word_embeddings", False)
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


# --------------------------------------------------------------------------------------------
# QuantPlan simulation (formats.py round trips) and the calibration-time sensitivity estimate
# --------------------------------------------------------------------------------------------
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


def round_input_blocks(_mod, args):
    """Forward pre-hook: the int8 per-32-block activation round trip of formats.py in torch."""
    import torch

    from .formats import ACTIVATION_BLOCK

    x = args[0]
    K = x.shape[-1]
    b = x.float().reshape(*x.shape[:-1], K // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    amax = b.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, torch.ones_like(amax)),
                      torch.zeros_like(amax))
    q = torch.clamp(torch.round(b * inv), -127, 127)
    return ((q * (amax / 127.0)).reshape(x.shape).to(x.dtype),) + tuple(args[1:])


class SimulatedPlan:
    """Context manager: the model's linears compute with their QuantPlan round trip (weights by
    formats.fake_quantize in the format the build gives their merged linear, with the plan's
    importance; inputs rounded per 32-block for int8 activations). `only`: weight names to
    quantize (default: all). The LM head must be untied first (untie_head)."""

    def __init__(self, model, plan, only=None):
        self.plan, self.saved, self.hooks = plan, [], []
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
            if self.plan.activations == "int8":
                self.hooks.append(mod.register_forward_pre_hook(round_input_blocks))
        return self

    def __exit__(self, *exc):
        for mod, w in self.saved:
            mod.weight.data = w
        for h in self.hooks:
            h.remove()


def fisher_units(model, calib, candidates: list, importance: dict | None = None,
                 exact: bool = False) -> list:
    """mix.Unit per stored matrix (merged q|k|v and gate|up, o_proj, down_proj, the LM head)
    with its estimated loss increase in each candidate format: sum E[g_i^2] E[x_k^2] dW_ik^2
    from a calibration with gradients (calibration.collect(..., gradients=True)). The LM head
    must be untied first if the build quantizes a copy of a tied embedding (untie_head).
    `exact`: round with the formats' own quantizers (importance-weighted); default: their
    round-to-nearest stand-in (calibration.fast_round_trip), ~50x cheaper on a whole model."""
    from concurrent.futures import ThreadPoolExecutor

    from .calibration import fast_round_trip
    from .formats import FORMATS, fake_quantize, host_threads
    from .mix import Unit

    linears = plan_linears(model)
    module_of = {id(m): n for n, m in model.named_modules()}
    jobs, seen = [], set()
    for name in linears:
        if name in seen:
            continue
        names = [n for n in merged_names(name) if n in linears]
        seen.update(names)
        mods = [linears[n] for n in names]
        stat_names = [module_of[id(m)] for m in mods]
        if any(s not in calib.out_grad_sq for s in stat_names) or stat_names[0] not in calib.stats:
            continue
        jobs.append((names, mods, stat_names))

    def unit(job):
        names, mods, stat_names = job
        W = np.concatenate([m.weight.detach().float().numpy() for m in mods])
        G = np.concatenate([calib.out_grad_sq[s] for s in stat_names]).astype(np.float64)
        X = calib.stats[stat_names[0]].mean_sq.astype(np.float64)
        imp = None if importance is None else importance.get(names[0])
        errors = {}
        for fmt in candidates:
            if not FORMATS[fmt].applies_to(*W.shape):
                errors[fmt] = 0.0
                continue
            wq = fake_quantize(W, fmt, imp) if exact else fast_round_trip(W, fmt)
            d = (W - wq).astype(np.float64)
            errors[fmt] = float(G @ (d * d) @ X)
        return Unit(tuple(names), W.shape, errors)

    # one unit per thread at a time (numpy's element-wise rounding is single-threaded and
    # releases the GIL); the units keep their order, each computed as it would be alone
    with ThreadPoolExecutor(min(len(jobs), host_threads()) or 1) as pool:
        return list(pool.map(unit, jobs))
