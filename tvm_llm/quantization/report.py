"""The build report's quantization summary: weights per format and the bits per weight."""
from __future__ import annotations

from .plan import FLOAT, INTEGER_ACTIVATIONS, format_bits


def entry_layout(entry: dict) -> str:
    """The kernel layout of a report["quantized"] entry: the pass records "int8" / "int16"
    activations only for weights it stored in the "vnni" layout (lookups and weight-only:
    "rows")."""
    return "vnni" if entry.get("activations") in INTEGER_ACTIVATIONS else "rows"


def summarize(report: dict) -> dict:
    """`format_counts` (format -> weights, "float" included) and `bits_per_weight`: the bits
    the build stores per weight (scheme.stored_bits: every packed tensor of each weight's
    format in its layout) averaged over every weight the pass saw, float ones at 32 bits."""
    from .scheme import stored_bits

    counts: dict = {}
    bits = total = 0
    for entry in report.get("quantized", {}).values():
        fmt = entry["format"]
        N, K = entry["shape"]
        counts[fmt] = counts.get(fmt, 0) + 1
        bits += N * K * stored_bits(fmt, N, K, entry_layout(entry))
        total += N * K
    for N, K in report.get("kept_float", {}).values():
        counts[FLOAT] = counts.get(FLOAT, 0) + 1
        bits += N * K * format_bits(FLOAT)
        total += N * K
    return {"format_counts": counts, "bits_per_weight": round(bits / total, 4) if total else 0.0}


def stored_bytes(params: list, V: int, H: int, quantized: dict) -> tuple:
    """(bytes of every stored tensor but the embedding lookup table, bytes of the LM head) from a
    manifest's params (name, shape, dtype, nbytes) for a vocabulary V and hidden size H.

    The head is found by its exact layout: a quantized head (listed in `quantized`) by the
    (shape, dtype) list its format's packer makes (quantization/scheme.packed_shapes); a float
    head as a float (V, H) table or a GEMM-packed (V / PN, H, PN) copy of it, (V / PN, H / 2,
    PN, 2) where bfloat16 panels hold k pairs for vdpbf16ps (float CPU builds pack the head under
    a new name and keep the table for the lookup). The lookup table is any
    other tensor led by V rows (float (V, H), or quantized rows and their scales). When the
    head reads the table itself (one tensor), nothing is left to drop. Matching by shape
    rather than by count of elements: a decoder layer's packed tensors can hold exactly V rows'
    worth of elements (SmolLM2: gate_up's scales (3072, 18, 16), 3072 * 16 = V)."""
    import re

    import numpy as np

    remaining = list(params)

    def take(match) -> list:
        hits = [p for p in remaining if match(p)]
        for p in hits:
            remaining.remove(p)
        return hits

    # an untied model lists its 8-bit lookup table under embed_tokens too: the head is lm_head's
    fmt = (next((v for k, v in quantized.items() if "lm_head" in k), None)
           or next((v for k, v in quantized.items() if "embed_tokens" in k), None))
    if fmt is not None:
        from .formats import get_format
        from .scheme import packed_shapes

        layout = entry_layout(fmt)
        head = []
        for shape, dtype in packed_shapes(get_format(fmt["format"]), V, H, layout):
            hit = next((p for p in reversed(remaining)
                        if list(p["shape"]) == list(shape) and p["dtype"] == dtype), None)
            if hit is None:
                raise ValueError(f"the {fmt['format']} head's tensor {shape} {dtype} is not stored")
            remaining.remove(hit)
            head.append(hit)
    else:
        is_float = lambda p: p["dtype"].startswith(("float", "bfloat"))  # noqa: E731

        def is_packed_head(p) -> bool:
            """(V / PN, H, PN) panels, or (V / PN, H / 2, PN, 2) for vdpbf16ps's k pairs."""
            s = p["shape"]
            return len(s) in (3, 4) and is_float(p) and s[0] * s[2] == V and (
                (len(s) == 3 and s[1] == H) or (s[1] * s[3] == H and s[3] == 2))

        head = take(is_packed_head)
        if not head:  # the head reads the float table itself
            head = take(lambda p: is_float(p) and list(p["shape"]) == [V, H])[:1]
        if not head:
            raise ValueError("no float LM head of shape (V, H) or (V / PN, H, PN) among the params")
    table = take(lambda p: len(p["shape"]) >= 2 and p["shape"][0] == V)
    head_bytes = sum(p["nbytes"] for p in head)
    for p in head + table:  # self-check: the manifest's sizes are whole tensors of their dtype
        bits = int(re.match(r"[a-z]+(\d+)", p["dtype"]).group(1))
        if p["nbytes"] * 8 != int(np.prod(p["shape"])) * bits:
            raise ValueError(f"tensor {p['name']} {p['shape']} {p['dtype']}: {p['nbytes']} bytes")
    return sum(p["nbytes"] for p in params) - sum(p["nbytes"] for p in table), head_bytes
