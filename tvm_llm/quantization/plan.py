"""QuantPlan: which format each weight of a build is stored in.

A plan has a default format, a per-weight table (checkpoint weight name -> format name or
"float") and optional per-input-channel importance for the importance-weighted rounding
(quantization/formats.py). The CLI makes a plain plan from `--quantization NAME`; calibration
and the automatic mix (quantization/mix.py) make richer ones. The QuantizeLinear pass asks
`format_for(names)` for each linear (a merged q|k|v or gate|up linear has several names).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from .formats import FORMATS, get_format

FLOAT = "float"
EMBEDDING_FORMAT = "q8_0"  # an untied embedding table not listed in the plan
ACTIVATIONS = ("float", "int8", "int16")
# activations the integer ("vnni" layout) kernels take, and their bits per value: int16 is held as two
# int8 halves (schedules/cpu/int8_act_matmul.py), so it runs where int8 dot products do
INTEGER_ACTIVATIONS = {"int8": 8, "int16": 16}
FLOAT_BITS = 32


def format_bits(fmt: str, K: int | None = None) -> float:
    """The format's nominal bits per weight ("float": 32): ranks formats; the bits a build
    stores in a given kernel layout are scheme.stored_bits."""
    return float(FLOAT_BITS) if fmt == FLOAT else get_format(fmt).bits_per_weight(K)


@dataclass(frozen=True)
class QuantPlan:
    default_format: str
    activations: str = "float"
    formats: Mapping[str, str] = field(default_factory=dict)
    importance: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self):
        for fmt in [self.default_format, *self.formats.values()]:
            if fmt != FLOAT and fmt not in FORMATS:
                raise ValueError(f"unknown weight format {fmt!r}: one of {FLOAT}, {', '.join(FORMATS)}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"unknown activations {self.activations!r}: one of {', '.join(ACTIVATIONS)}")

    def format_of(self, name: str) -> str:
        return self.formats.get(name, self.default_format)

    def format_for(self, names: list) -> str:
        """The format of a linear made of the weights `names` (merged linears are stored as
        one matrix): the one with the most bits among theirs."""
        fmts = [self.format_of(n) for n in names] or [self.default_format]
        return max(fmts, key=lambda f: (format_bits(f), f))

    def embedding_format(self, names: list) -> str:
        """Format of an (untied) embedding table: listed in `formats`, else 8-bit (its rows are
        only looked up; 8 bits keep them near exact at a quarter of float32)."""
        listed = [self.formats[n] for n in names if n in self.formats]
        return max(listed, key=lambda f: (format_bits(f), f)) if listed else EMBEDDING_FORMAT

    def importance_for(self, names: list):
        """(K,) importance of a linear made of `names`, or None. The merged weights of q|k|v and
        gate|up share their input, so any of the names' importance applies to all."""
        for n in names:
            if n in self.importance:
                return np.asarray(self.importance[n], dtype=np.float32)
        return None

    def bits_per_weight(self, shapes: dict) -> float:
        """Average stored bits per weight over the weights in `shapes` (name -> (N, K)),
        each in its own format (float counts 32 bits)."""
        total_bits = total = 0
        for name, shape in shapes.items():
            N, K = (int(s) for s in shape)
            fmt = self.format_of(name)
            if fmt != FLOAT and not get_format(fmt).applies_to(N, K):
                fmt = FLOAT
            total_bits += N * K * format_bits(fmt, K)
            total += N * K
        return total_bits / total if total else 0.0

    def describe(self) -> dict:
        counts: dict = {}
        for fmt in self.formats.values():
            counts[fmt] = counts.get(fmt, 0) + 1
        return {"default_format": self.default_format, "activations": self.activations,
                "overrides": counts, "importance": len(self.importance)}
