"""MoE rule: the grouped expert GEMM of mixture-of-experts layers (tvm_llm/frontend/moe_relax.py).

Claims
    PrimFuncs whose block is ``moe_gemm_dequantize`` (quantized experts, dot products over the
    (N, K) rows of each expert; see schedule_moe_gemm_dequantize), and those whose one block is
    ``moe_gemm``: ``y[r, n] = sum_j x[r, j] * W[e[r], j, n]``, the
    rows r sorted by their expert id e[r] (symbolic count), W the stacked (experts, in, out)
    weights. Decode has batch * top_k rows, prefill tokens * top_k.

Why the schedule is shaped so
    * Only the rows' experts are read: the expert id is data (``e[r]``), loaded once per row;
      the kernel never touches the weights of an expert no row selected.
    * Parallel over blocks of ``NB`` output columns (static N): each thread streams its column
      block of the selected experts' weights, ``NB`` contiguous values per input row j.
    * Per row, ``NB`` accumulators (a few vector registers) over the whole j loop; each loaded
      weight vector is one FMA with the broadcast x[r, j].
    * Rows of one expert are consecutive (sorted), so in prefill the same expert's column block
      is re-read from cache for every row of that expert, not from memory: a grouped GEMM.
"""
from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from . import common
from .gemm import LAYOUT_REWRITE_ATTR

MOE_GEMM_BLOCK = "moe_gemm"  # the block name tvm_llm/frontend/moe_relax.py gives the kernel
# quantized experts (tvm_llm/quantization/experts.py): y[r, n] = sum_k x[r, k] * deq(e[r], n, k)
MOE_GEMM_DEQUANTIZE_BLOCK = "moe_gemm_dequantize"
DEQUANT_ROWS = 4  # weight rows (outputs) per step: independent streams sharing one x load


def moe_column_block(target: Target, n: int, dtype: str = "float32") -> int:
    """Output columns per accumulator tile: up to 4 vector registers' worth dividing n."""
    lanes = common.vector_lanes(target, dtype)
    return common.pow2_divisor(n, 4 * lanes)


class MoEGemm(common.CPURule):
    """The moe_gemm kernel: column-block parallel, register accumulators per row."""

    def schedule(self, func: tirx.PrimFunc, target: Target):
        sch = s_tir.Schedule(func)
        try:
            block = sch.get_sblock(MOE_GEMM_DEQUANTIZE_BLOCK)
        except common.ScheduleError:  # no such block: not the quantized expert GEMM
            block = None
        if block is not None:
            try:
                return schedule_moe_gemm_dequantize(sch, block, target)
            except Exception as err:  # pylint: disable=broad-except
                return common.rule_failed(self, func, err)
        try:
            block = sch.get_sblock(MOE_GEMM_BLOCK)
        except common.ScheduleError:  # no such block: not an expert GEMM
            return None
        pack = WEIGHT_PARAM in common.layout_free_indices(func)
        return schedule_moe_gemm(sch, block, target, pack)


WEIGHT_PARAM = 2  # moe_gemm(x, expert, w, y)


def _read_index(sch: s_tir.Schedule, block) -> int:
    """Position of the weight among the block's reads (the buffer moe_relax names "w")."""
    for i, region in enumerate(sch.get(block).reads):
        if region.source.name == "w":
            return i
    raise ValueError("moe_gemm reads no weight buffer")


def schedule_moe_gemm(sch: s_tir.Schedule, block, target: Target, pack: bool) -> s_tir.Schedule:
    r, n, j = sch.get_loops(block)
    n_ext = common.loop_extent(sch, n)
    out_dtype = str(sch.get(block).writes[0].source.dtype)
    nb = moe_column_block(target, n_ext, out_dtype)
    if pack and nb > 1:
        # W[e, j, n] read as Wp[e, n / nb, j, n % nb]: each thread's column block of an expert is
        # one contiguous stream (row-major, it is nb values every N; the strided stream ran at
        # a quarter of the bandwidth). The build runs this layout rewrite once (prepack.py).
        w_read = _read_index(sch, block)
        rw = sch.cache_read(block, w_read, "global")
        sch.annotate(rw, LAYOUT_REWRITE_ATTR, True)
        sch.transform_layout(block, ("read", w_read),
                             lambda e, k, c: (e, c // nb, k, c % nb))
        sch.parallel(sch.get_loops(rw)[0])
    no, ni = sch.split(n, [None, nb])
    sch.reorder(no, r, j, ni)
    sch.parallel(no)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, r)
    if nb > 1:
        sch.vectorize(ni)
        sch.vectorize(sch.get_loops(acc)[-1])
    init = sch.decompose_reduction(block, j)
    if nb > 1:
        sch.vectorize(sch.get_loops(init)[-1])
    # the accumulator tile is one row's nb columns: a static stack buffer LLVM keeps in registers
    sch.transform_layout(block, ("write", 0), lambda vr, vn: (vn % nb,),
                         assume_injective_transform=True)
    return sch


def schedule_moe_gemm_dequantize(sch: s_tir.Schedule, block, target: Target) -> s_tir.Schedule:
    """Quantized experts, stored per expert as (N, K) rows grouped along K: dot products.
    Per row of x, DEQUANT_ROWS weight rows at a time, K split into vector lanes of partial
    sums (rfactor), the lanes summed at the end; parallel over blocks of weight rows. The
    packed bytes of a lane vector are loaded, widened and scaled in registers."""
    r, n, k = sch.get_loops(block)
    n_ext, k_ext = common.loop_extent(sch, n), common.loop_extent(sch, k)
    lanes = common.pow2_divisor(k_ext, common.vector_lanes(target, "float32"))
    nr = common.pow2_divisor(n_ext, DEQUANT_ROWS)
    no, ni = sch.split(n, [None, nr])
    ko, ki = sch.split(k, [None, lanes])
    sch.reorder(no, r, ko, ni, ki)
    rf = sch.rfactor(ki, factor_axis=0)
    no, r, ko, ni, ki = sch.get_loops(rf)
    sch.reverse_compute_at(block, r)
    sch.parallel(no)
    sch.vectorize(ki)
    sch.unroll(ni)
    init = sch.decompose_reduction(rf, ko)
    sch.vectorize(sch.get_loops(init)[-1])
    # partial sums: [nr, lanes] per (block of weight rows, row of x), a stack tile
    sch.transform_layout(rf, ("write", 0), lambda v_ki, v_r, v_n: (v_n % nr, v_ki),
                         assume_injective_transform=True)
    return sch
