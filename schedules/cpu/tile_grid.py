"""The tuner's search space over our matmul rules: one schedule per register tile of the
target CPU's row of :mod:`.microarch` (tvm_llm/tune/rule_grid.py measures them)."""
from __future__ import annotations

from . import common, microarch
from .gemm import GEMM
from .gemv import GEMV, gemv_tile


def grid_schedules(mod, target, only: str | None = None) -> list:
    """[(label, Schedule)] of the static kernel `mod` ("main") under our matmul rules, one per
    tile of the target's microarch row (only the point labelled `only`, if given); [] when no
    matmul rule claims it."""
    func = mod["main"]
    if not common.is_llvm_cpu(target):
        return []
    row = microarch.tile_row(target)
    out, seen = [], set()
    with target:
        if GEMM().apply(func, target, False) is not None:
            points = [("GEMM", t, GEMM(tile=t)) for t in dict.fromkeys(row.gemm_float32 + row.gemm)]
        elif GEMV().apply(func, target, False) is not None:
            prepared = common.prepare_matmul(func, allow_computed_b=True)
            pat = prepared[1]
            _, _, lanes = gemv_tile(target, pat.N, pat.K, pat.dtype, pat.decode_like)
            tiles = row.gemv_decode if pat.decode_like else row.gemv_prefill
            points = [("GEMV", t, GEMV(tile=(t[0], t[1], lanes))) for t in tiles
                      if pat.N % t[1] == 0
                      and t[0] * t[1] * lanes * 4 < common.MAX_STACK_BYTES]
        else:
            return []
        for kind, tile, rule in points:
            label = f"{kind} {tile[0]}x{tile[1]}"
            if label in seen or (only is not None and label != only):
                continue
            sch = rule.apply(func, target, False)
            if sch is None:
                continue
            seen.add(label)
            out.append((label, sch))
    return out
