"""Automatic mixed precision under a bits-per-weight budget.

Each *unit* is one matrix the build stores (a merged q|k|v or gate|up linear, o_proj, down_proj
of each layer, the LM head). Its sensitivity to a format f is the estimated loss increase of
rounding it alone (calibration-time Fisher estimate, sensitivity.fisher_errors):

    err(u, f) = sum_{i,k} E[g_i^2] E[x_k^2] (W - Q_f(W))_{ik}^2

with g the loss gradient at the linear's output and x its input over the calibration text
(the diagonal of the Fisher information, factored per output row and input column). The mix
starts every unit at the cheapest candidate format and repeatedly upgrades the unit whose
next step buys the largest error reduction per added bit, while the average bits per weight
stays within the budget. Steps that do not fit are skipped and the search goes on with the
others, so the budget is filled greedily and never exceeded.

Bits per weight are counted over the weights the budget names (`count`):
    "all"   every linear the build quantizes, the LM head included; a tied embedding table is
            counted once, as the LM head (the build stores the head quantized; the embedding
            lookup reads one row per token and is not part of this figure);
    "body"  the decoder layers' linears only (the LM head left out).
Each unit's bits are what the build stores for it (scheme.stored_bits: every packed tensor of
the format in the kernel layout the build's `activations` give it), so the budget bounds the
bytes on disk; `activations` None counts the formats' nominal bits (formats.bits_per_weight).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError

COUNTS = ("all", "body")
HEAD = "lm_head.weight"


@dataclass
class Unit:
    names: tuple  # checkpoint weight names stored as this one matrix
    shape: tuple  # (N, K) of the stored matrix
    errors: dict  # format -> estimated loss increase

    @property
    def size(self) -> int:
        return int(self.shape[0]) * int(self.shape[1])

    @property
    def label(self) -> str:
        first = self.names[0].rsplit(".weight", 1)[0]
        if len(self.names) == 1:
            return first
        return first.rsplit(".", 1)[0] + "." + "|".join(n.rsplit(".", 2)[-2] for n in self.names)


def counted(units: list, count: str) -> list:
    if count not in COUNTS:
        raise UserError(f"unknown bits-per-weight count {count!r}: one of {', '.join(COUNTS)}")
    return [u for u in units if count == "all" or HEAD not in u.names]


def unit_bits(u: Unit, fmt: str, activations: str | None = None) -> float:
    """Stored bits per weight of unit u in `fmt` (module docstring)."""
    if activations is None:
        from .plan import format_bits

        return format_bits(fmt, u.shape[1])
    from .scheme import layout_for, stored_bits

    N, K = (int(s) for s in u.shape)
    return stored_bits(fmt, N, K, layout_for(activations, N, K))


def average_bits(units: list, choice: dict, count: str = "all", activations: str | None = None) -> float:
    """Average stored bits per weight of `choice` (unit label -> format) over the counted units."""
    us = counted(units, count)
    total = sum(u.size for u in us)
    return sum(u.size * unit_bits(u, choice[u.label], activations) for u in us) / total if total else 0.0


def choose(units: list, candidates: list, budget: float, count: str = "all",
           activations: str | None = None) -> dict:
    """unit label -> format: the greedy error-per-bit upgrade path within `budget` bits per
    weight (averaged over the counted units; uncounted units get the best candidate)."""
    def bits(u, f):
        return unit_bits(u, f, activations)

    us = counted(units, count)
    total = sum(u.size for u in us)
    choice = {}
    for u in units:
        ordered = sorted(candidates, key=lambda f: (bits(u, f), u.errors[f]))
        # keep the lower convex hull of (bits, error): each upgrade must buy error reduction
        hull = []
        for f in ordered:
            if hull and u.errors[f] >= u.errors[hull[-1]]:
                continue
            while len(hull) >= 2:
                (f1, f2) = hull[-2], hull[-1]
                s12 = (u.errors[f1] - u.errors[f2]) / max(bits(u, f2) - bits(u, f1), 1e-9)
                s23 = (u.errors[f2] - u.errors[f]) / max(bits(u, f) - bits(u, f2), 1e-9)
                if s23 >= s12:
                    hull.pop()
                else:
                    break
            hull.append(f)
        u.hull = hull
        choice[u.label] = hull[0] if u in us else hull[-1]
    cheapest = sum(u.size * bits(u, choice[u.label]) for u in us)
    if total and cheapest / total > budget + 1e-9:
        raise UserError(f"--bits-per-weight {budget:g} is below the cheapest mix "
                        f"({cheapest / total:.3f} bits per weight); raise it")
    spent = cheapest
    step = {u.label: 0 for u in us}
    while True:
        best = None
        for u in us:
            i = step[u.label]
            if i + 1 >= len(u.hull):
                continue
            f0, f1 = u.hull[i], u.hull[i + 1]
            extra = u.size * (bits(u, f1) - bits(u, f0))
            if spent + extra > budget * total + 1e-6:
                continue
            rate = (u.errors[f0] - u.errors[f1]) / max(extra, 1e-9)
            if best is None or rate > best[0]:
                best = (rate, u, extra)
        if best is None:
            return choice
        _, u, extra = best
        step[u.label] += 1
        choice[u.label] = u.hull[step[u.label]]
        spent += extra


def to_formats(units: list, choice: dict) -> dict:
    """checkpoint weight name -> format (what QuantPlan.formats takes)."""
    return {n: choice[u.label] for u in units for n in u.names}


def format_mix(units: list, choice: dict, default: str, activations: str | None = None) -> str:
    """The build report's lines: formats and their share, bits per weight counted both ways."""
    from collections import Counter

    sizes = Counter()
    for u in units:
        sizes[choice[u.label]] += u.size
    total = sum(sizes.values())
    shares = ", ".join(f"{f} {100 * s / total:.1f}%" for f, s in sizes.most_common())
    others = [u.label for u in units if choice[u.label] != default]
    lines = [f"mix: {shares} of the quantized weights; {average_bits(units, choice, 'all', activations):.3f} "
             f"stored bits per weight over all linears incl. the LM head (a tied embedding counted "
             f"once), {average_bits(units, choice, 'body', activations):.3f} over the decoder layers only"]
    if others:
        lines.append(f"  not {default}: " + ", ".join(f"{lbl} ({choice[lbl]})" for lbl in others))
    return "\n".join(lines)
