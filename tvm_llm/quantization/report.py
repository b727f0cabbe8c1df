"""The build report's quantization summary: weights per format and the bits per weight."""
from __future__ import annotations

from .plan import FLOAT, format_bits


def summarize(report: dict) -> dict:
    """`format_counts` (format -> weights, "float" included) and `bits_per_weight` (the
    formats' stored bits averaged over every weight the pass saw, float ones at 32 bits)."""
    counts: dict = {}
    bits = total = 0
    for entry in report.get("quantized", {}).values():
        fmt = entry["format"]
        N, K = entry["shape"]
        counts[fmt] = counts.get(fmt, 0) + 1
        bits += N * K * format_bits(fmt, K)
        total += N * K
    for N, K in report.get("kept_float", {}).values():
        counts[FLOAT] = counts.get(FLOAT, 0) + 1
        bits += N * K * format_bits(FLOAT)
        total += N * K
    return {"format_counts": counts, "bits_per_weight": round(bits / total, 4) if total else 0.0}
