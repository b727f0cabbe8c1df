"""Elementwise / injective rule: RoPE, residual adds, SiLU*mul, casts, transposes, reshapes,
concats, the embedding ``take``.

Claims
    PrimFuncs whose blocks are all spatial (no reduction iter). Chains of blocks are inlined
    into their consumer first (an expensive block read by several consumers, e.g. an ``exp``,
    stays materialized), then every remaining block is scheduled on its own.

Why the schedule is shaped so
    * The innermost loop follows the output's contiguous axis: it is split by the SIMD width
      (the largest power of two dividing a static extent, so the vector loop has no predicate)
      and vectorized; loads that are strided in that axis (transposes, the RoPE rotate-half
      gather) become gathers/shuffles, stores stay contiguous.
    * The remaining loops are fused and run in parallel when the kernel is large enough
      (symbolic token extents, or >= 16K elements); a decode-size kernel (one token per
      sequence: shape (b, 1, ...)) stays on the calling thread, where a thread-pool launch
      would cost more than the work.
"""
from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from . import common
from .reduction import inline_spatial_producers

PARALLEL_MIN_ELEMENTS = 16384


class Elementwise(common.CPURule):
    """Injective kernels: vectorized innermost axis, parallel outer axes."""

    def schedule(self, func: tirx.PrimFunc, target: Target):
        try:
            sch = s_tir.Schedule(func)
            blocks = common.root_blocks(sch)
        except Exception as err:  # pylint: disable=broad-except
            return common.rule_failed(self, func, err)
        if not common.all_simple_blocks(sch, blocks):
            return None
        if any(not common.is_spatial_block(sch, b) for b in blocks):
            return None
        try:
            inline_spatial_producers(sch)
            lanes = common.vector_lanes(target)
            for name in [common.block_name(sch, b) for b in common.root_blocks(sch)]:
                schedule_injective_block(sch, sch.get_sblock(name), lanes)
        except Exception as err:  # pylint: disable=broad-except
            return common.rule_failed(self, func, err)
        return sch


def schedule_injective_block(sch: s_tir.Schedule, block, lanes: int):
    loops = sch.get_loops(block)
    if not loops:
        return
    exts = [common.loop_extent(sch, lp) for lp in loops]
    inner = loops[-1]
    vec = None
    if exts[-1] is not None:
        width = common.pow2_divisor(exts[-1], lanes)
        if width > 1:
            if width == exts[-1]:
                vec = inner
                outer_loops = loops[:-1]
            else:
                io, vec = sch.split(inner, [None, width])
                outer_loops = loops[:-1] + [io]
        else:
            outer_loops = loops
    else:
        outer_loops = loops
    static = 1
    symbolic = False
    for e in exts:
        if e is None:
            symbolic = True
        else:
            static *= e
    if outer_loops:
        fused = sch.fuse(*outer_loops) if len(outer_loops) > 1 else outer_loops[0]
        if static >= PARALLEL_MIN_ELEMENTS or (symbolic and not common.decode_shaped(exts)):
            sch.parallel(fused)
    if vec is not None:
        sch.vectorize(vec)
