"""Row-reduction rule: RMSNorm, LayerNorm, softmax (and other "reduce the last axis of each row,
then elementwise" kernels).

Claims
    PrimFuncs made only of blocks that share the same leading "row" iters (the token/batch
    dims, symbolic or not) and either reduce over one trailing axis (``SS..R``: sum of
    squares, mean, variance, max, sum of exp) or map it (``SS..S``: normalize, scale, exp),
    plus row-only blocks (``rsqrt`` of the mean). Elementwise helpers without the row dims
    (the cast of the norm weight) are inlined. Anything else is left to the next rule.

Why the schedule is shaped so
    * One thread handles whole rows (parallel over the fused row loop), and every stage of a
      row is computed under that loop (``compute_at``), so a row is read from memory once and
      stays in L1/L2 between the reduction and the elementwise pass.
    * The reduction axis is split into SIMD lanes and ``rfactor``-ed: each lane accumulates a
      partial sum/max in a vector register; the lanes are combined once per row. Without that,
      the reduction is a scalar dependency chain (LLVM may not reassociate float adds).
    * Elementwise stages are vectorized along the row (contiguous).
    * Cheap producers (casts, squares) are inlined; an expensive producer with several consumers
      (softmax's exp) stays materialized per row instead of being recomputed.
"""
from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from . import common

_EXPENSIVE = ("exp", "log", "tanh", "sigmoid", "erf", "pow", "sqrt", "rsqrt", "sin", "cos")


def _is_expensive(sch, block) -> bool:
    text = sch.get(block).body.script() if hasattr(sch.get(block).body, "script") else ""
    return any(f"T.{fn}(" in text for fn in _EXPENSIVE)


def inline_spatial_producers(sch: s_tir.Schedule, keep_expensive_multi_use: bool = True):
    """Inline spatial blocks into their consumers (and output copies/casts into their
    producers) until nothing changes. Returns nothing; the schedule is updated in place."""

    def producer(blk) -> bool:
        if not common.is_spatial_block(sch, blk):
            return False
        consumers = sch.get_consumers(blk)
        if not consumers:
            return False
        return not (keep_expensive_multi_use and len(consumers) > 1 and _is_expensive(sch, blk))

    _inline_one_at_a_time(sch, 64, producer, sch.compute_inline)

    # Output blocks that merely copy/cast a spatial producer: fold them into the producer.
    def output_copy(blk) -> bool:
        if sch.get_consumers(blk) or not common.is_spatial_block(sch, blk):
            return False
        producers = sch.get_producers(blk)
        if len(producers) != 1 or not common.is_spatial_block(sch, producers[0]):
            return False
        return len(sch.get_consumers(producers[0])) == 1

    _inline_one_at_a_time(sch, 8, output_copy, sch.reverse_compute_inline)


def _inline_one_at_a_time(sch, rounds: int, eligible, inline) -> None:
    """Up to `rounds` times: inline the first root block that is `eligible` and that `inline`
    accepts (blocks change after each inline, so the scan starts over); stop when none is."""
    for _ in range(rounds):
        for blk in common.root_blocks(sch):
            if not eligible(blk):
                continue
            try:
                inline(blk)
                break
            except common.ScheduleError:  # not inlinable
                continue
        else:
            break


def _row_signature(sch, block, nrows):
    ivs = list(sch.get(block).iter_vars)
    return [iv.dom.extent for iv in ivs[:nrows]]


def _same_extents(a, b) -> bool:
    if len(a) != len(b):
        return False
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    return all(tvm_ffi.structural_equal(x, y) for x, y in zip(a, b))


class RowReduction(common.CPURule):
    """Per-row reductions followed by elementwise ops (norms, softmax)."""

    def schedule(self, func: tirx.PrimFunc, target: Target):
        try:
            return self._apply(func, target)
        except Exception as err:  # pylint: disable=broad-except
            return common.rule_failed(self, func, err)

    def _apply(self, func, target):
        sch = s_tir.Schedule(func)
        blocks = common.root_blocks(sch)
        if not common.all_simple_blocks(sch, blocks):
            return None
        if not any(common.is_reduction_block(sch, b) for b in blocks):
            return None
        # Every reduction: a single trailing reduce iter.
        for b in blocks:
            ivs = list(sch.get(b).iter_vars)
            kinds = [iv.iter_type for iv in ivs]
            if tirx.IterVar.CommReduce in kinds:
                if kinds.count(tirx.IterVar.CommReduce) != 1 or kinds[-1] != tirx.IterVar.CommReduce:
                    return None
            elif any(k != tirx.IterVar.DataPar for k in kinds):
                return None
        if any(common.match_matmul_block(sch, b) is not None for b in blocks):
            return None
        inline_spatial_producers(sch)
        blocks = common.root_blocks(sch)
        # (an output that is also read, e.g. h of add+norm, counts as a stage: see step 3)
        outputs = [b for b in blocks if not sch.get_consumers(b)]
        if len(outputs) != 1:
            return None
        out = outputs[0]
        out_ivs = list(sch.get(out).iter_vars)
        if not common.is_spatial_block(sch, out) or len(out_ivs) < 2:
            return None
        nrows = len(out_ivs) - 1
        rows_sig = _row_signature(sch, out, nrows)
        names = [common.block_name(sch, b) for b in blocks]
        for b in blocks:
            ivs = list(sch.get(b).iter_vars)
            if len(ivs) not in (nrows, nrows + 1):
                return None
            if not _same_extents(_row_signature(sch, b, nrows), rows_sig):
                return None
        lanes = common.vector_lanes(target)

        # 1. rfactor the reductions over SIMD lanes (before any compute_at).
        rf_names = {}
        for name in names:
            b = sch.get_sblock(name)
            if not common.is_reduction_block(sch, b):
                continue
            k = sch.get_loops(b)[-1]
            ext = common.loop_extent(sch, k)
            L = common.pow2_divisor(ext, lanes) if ext is not None else 1
            if L <= 1:
                continue
            _, ki = sch.split(k, [None, L])
            rf = sch.rfactor(ki, factor_axis=0)
            rf_names[name] = common.block_name(sch, rf)

        # 2. Rows of the output block: fused, parallel; its row tail vectorized.
        out = sch.get_sblock(common.block_name(sch, out))
        loops = sch.get_loops(out)
        row_exts = [common.loop_extent(sch, lp) for lp in loops[:nrows]]
        row = sch.fuse(*loops[:nrows]) if nrows > 1 else loops[0]
        if not common.decode_shaped(row_exts):  # a decode step's few rows: calling thread
            sch.parallel(row)
        common.vectorize_innermost(sch, out, lanes)

        # 3. Every other stage computed per row, in reverse order.
        order = []
        for name in names:
            if name == common.block_name(sch, out):
                continue
            if name in rf_names:
                order.append(rf_names[name])
            order.append(name)
        at_root = []  # stages that write an output too (add+norm's residual): own loop nest
        for name in reversed(order):
            try:
                sch.compute_at(sch.get_sblock(name), row, preserve_unit_loops=True)
            except common.ScheduleError:
                if not common.is_spatial_block(sch, sch.get_sblock(name)):
                    raise
                at_root.append(name)
        for name in at_root:
            b = sch.get_sblock(name)
            loops = sch.get_loops(b)
            rows = sch.fuse(*loops[:nrows]) if nrows > 1 else loops[0]
            if not common.decode_shaped(row_exts):
                sch.parallel(rows)

        # 4. Vectorize each stage along the row.
        for name in order:
            b = sch.get_sblock(name)
            if name in rf_names.values():
                # loops under the row: (lane, unit row loops..., k_outer) -> (k_outer, lane)
                lp = sch.get_loops(b)[1:]
                lane, ko = lp[0], lp[-1]
                sch.reorder(ko, lane)
                sch.vectorize(lane)
                init = sch.decompose_reduction(b, ko)
                sch.vectorize(sch.get_loops(init)[-1])
            elif name in rf_names:
                sch.unroll(sch.get_loops(b)[1])  # lane combine
            elif common.is_spatial_block(sch, b):
                common.vectorize_innermost(sch, b, lanes)
        return sch
