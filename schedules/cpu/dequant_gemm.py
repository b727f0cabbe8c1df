"""Dequantize-panel GEMM rule: weight-only quantized prefill at the float GEMM's speed.

Claims
    PrimFuncs that are one weight-only quantized matmul ``C[m.., n] = sum_k A[m.., k] *
    dequantize(stored)[n, k]`` (tvm_llm/quantization/kernels.py ``dequantize_matmul``: a
    spatial ``dequantize`` block producing the (N, K) float weight from the packed arrays)
    plus injective epilogues, when the rows are a prefill's (not decode-shaped ``(b, 1, K)``;
    a static row count at least ``MIN_ROWS``) and N is a multiple of the panel width. Decode keeps :mod:`.gemv` (the dequantize inlined
    into a streaming dot product, which is bandwidth-bound and reads only the packed bytes).

Why
    With the dequantize inlined into the row-major dot product (:mod:`.gemv`), every weight
    is unpacked, converted and scaled once per ``Mr`` (3) rows of x: for a 128-token prefill
    that is ~40 dequantizations of each weight, about as many instructions as the FMAs
    themselves, so q8/q4 prefill ran at half the fp32 prefill on AVX2 (no integer dot
    products there to skip the conversion). Here, per panel of ``PN`` output columns (the
    parallel loop), the dequantize block writes the panel once into a ``K x PN`` float
    buffer in the packed-GEMM layout (``Bp[K, PN]``, 64 KiB per 1024 of K on AVX2: it stays
    in L2), and the :mod:`.gemm` micro-kernel (``Mr x PN`` register tile, broadcast A, FMA)
    runs every row block over it: one dequantization per weight per call, amortized over all
    the rows. The buffer is a per-iteration workspace of the parallel loop, so each thread has
    its own.

    The panel is written 8 x 8 blocks at a time: the dequantize computes 8 weight rows x 8 k
    into a 256-byte stack block (vectorized along k, where the packed bytes are contiguous),
    and :mod:`.transpose8` turns the block into 8 panel rows with 24 vector shuffles. Storing
    the dequantized k vector straight into the panel column (stride PN) was TVM's scalarized
    strided store, one extract + store per weight: 0.84-0.93x of fp32 instead of 0.92-1.0x.

Few rows: below ``MIN_ROWS`` (8) rows the one dequantization per weight costs more than the
dot product's one per 3 rows, so the kernel holds both: ``if rows >= MIN_ROWS`` the panel
GEMM, else the :mod:`.gemv` rule's kernel of the same PrimFunc (a one- or few-token prompt
runs as fast as before).

Measured (scripts/bench_dequant_prefill.py: znver4 host running x86-64-v3 code, 2 threads,
32-128 rows, llama-110m shapes, interleaved medians on a shared machine): q8_0 and q4_k
0.92-1.14x of the prepacked fp32 GEMM (the dot product: 0.36-0.78x); znver4 (AVX-512) code
0.89-0.94x (dot product 0.50-0.72x).

Where it applies is a per-target choice (tvm_llm/targets/llvm.py passes it to
:func:`schedules.cpu.cpu_rules`).
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.target import Target

from . import common, gemm, transpose8
from .gemv import GEMV

DEQUANTIZE_BLOCK = "dequantize"
# Below this many rows the panel's one dequantization per weight costs more than the dot
# product's one per 3 rows: measured on x86-64-v3 code (2 threads, llama-110m shapes) the
# panel kernel was 2-7x slower at 1 row and level with or faster than the dot product at 8.
MIN_ROWS = 8


class DequantGEMM(common.CPURule):
    """Weight-only quantized prefill: dequantize each weight panel once, then the GEMM tile."""

    def __init__(self, tile=None, min_rows: int = MIN_ROWS):
        """tile: optional (Mr, Nv) override. min_rows: fewer rows than this run the GEMV rule's
        kernel (dequantize inlined) inside the same kernel, chosen at run time."""
        self.tile = tile
        self.min_rows = min_rows

    def schedule(self, func: tirx.PrimFunc, target: Target):
        prepared = common.prepare_matmul(func, keep_producers=(DEQUANTIZE_BLOCK,))
        if prepared is None:
            return None
        sch, pat = prepared
        if not pat.b_transposed or pat.decode_like:
            return None
        if pat.m_static is not None and pat.m_static < self.min_rows:
            return None  # e.g. a prefill's last-token LM head: the GEMV rule's dot product
        main = sch.get_sblock(pat.block_name)
        producers = [p for p in sch.get_producers(main)
                     if common.block_name(sch, p) == DEQUANTIZE_BLOCK]
        if len(producers) != 1 or not common.is_spatial_block(sch, producers[0]):
            return None
        writes = sch.get(producers[0]).writes
        if len(writes) != 1 or not writes[0].source.same_as(pat.b_buffer):
            return None
        mr, nv = self.tile or gemm.gemm_tile(target, pat.N, pat.K, pat.dtype)
        pn = nv * common.vector_lanes(target, pat.dtype)
        if pat.N % pn != 0 or pn % transpose8.N != 0 or pat.K % transpose8.N != 0:
            return None
        try:
            panel = schedule_dequant_panel(sch, pat, target, (mr, nv))
        except Exception as err:  # pylint: disable=broad-except
            return common.rule_failed(self, func, err)
        if self.min_rows <= 1 or pat.m_static is not None:
            return panel
        try:
            return dispatch_by_rows(func, panel, target, pat, self.min_rows) or panel
        except Exception as err:  # pylint: disable=broad-except
            common.rule_failed(self, func, err)  # logged; the panel kernel for every M
            return panel


def dispatch_by_rows(func: tirx.PrimFunc, panel: s_tir.Schedule, target: Target,
                     pat: common.MatmulPattern, min_rows: int) -> s_tir.Schedule | None:
    """One kernel that runs `panel` when the rows (the product of the M extents) number at
    least `min_rows`, else the GEMV rule's kernel of the same PrimFunc; None when the GEMV rule
    does not take it. The GEMV kernel is scheduled from a copy of the PrimFunc with fresh
    variables (one function cannot define a variable twice) and its parameters are bound to
    the kernel's by ``match_buffer`` in the block around its branch."""
    few_func = s_tir.renew_defs(func)
    few = GEMV().schedule(few_func, target)
    if few is None:
        return None
    fa, fb = panel.mod["main"], few.mod["main"]
    ra, rb = fa.body.block, fb.body.block
    if len(fa.params) != len(fb.params):
        return None
    binds = []
    for pa, pb in zip(fa.params, fb.params):  # parameters are buffer variables
        whole = tvm.ir.TensorRegion(pa, [tvm.ir.Range.from_min_extent(0, d) for d in pa.ty.shape],
                                    tirx.stmt.BufferRegionType())
        binds.append(s_tir.MatchBufferRegion(pb, whole))
    reads = [m.source for m in binds[:-1]]
    writes = [binds[-1].source]
    branch = s_tir.SBlockRealize([], True, s_tir.SBlock(
        [], reads, writes, "few_rows", rb.body, alloc_buffers=list(rb.alloc_buffers),
        match_buffers=binds))
    rows = None
    for e in pat.m_extents:
        rows = e if rows is None else rows * e
    body = tirx.IfThenElse(rows >= tirx.const(min_rows, str(rows.ty.dtype)), ra.body, branch)
    root = s_tir.SBlock([], [], [], ra.name_hint, body, alloc_buffers=list(ra.alloc_buffers))
    return s_tir.Schedule(fa.with_body(s_tir.SBlockRealize([], True, root)))


def schedule_dequant_panel(sch: s_tir.Schedule, pat: common.MatmulPattern, target: Target,
                           tile) -> s_tir.Schedule:
    lanes = common.vector_lanes(target, pat.dtype)
    mr, nv = tile
    pn = nv * lanes
    dq = sch.get_sblock(DEQUANTIZE_BLOCK)
    # The float weight in the packed-panel layout the micro-kernel reads: Bp[N/PN, K, PN].
    sch.transform_layout(dq, ("write", 0), lambda n, k: (n // pn, k, n % pn))
    tr = transpose8.N
    # dequantize into row-major 8 x 8 blocks (contiguous along k), then transpose each block
    # into the panel with vector shuffles (transpose8)
    cp = sch.cache_write(dq, 0, "global")
    sch.transform_layout(dq, ("write", 0), lambda a, k, b: (a, b, k))
    sch = gemm.schedule_outer_product(sch, pat, target, pack=False, tile=tile,
                                      allow_bf16_dot=False)
    # decompose_reduction renamed the matmul block "<name>_update"
    no = sch.get_loops(sch.get_sblock(pat.block_name + "_update"))[0]
    sch.compute_at(cp, no, preserve_unit_loops=True)
    k_loop, n_loop = sch.get_loops(cp)[-2:]
    ko, ki = sch.split(k_loop, [None, tr])
    nb, ni = sch.split(n_loop, [None, tr])
    sch.reorder(ko, nb, ki, ni)
    sch.compute_at(dq, nb, preserve_unit_loops=True)
    _, kv = sch.split(sch.get_loops(dq)[-1], [None, tr])
    sch.vectorize(kv)
    sch.unroll(sch.get_loops(dq)[-3])
    idx = str(sch.get(ki).extent.ty.dtype)
    sch.tensorize(sch.blockize(ki), transpose8.intrin_name(idx))
    return sch
