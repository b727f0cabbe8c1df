"""Dequantize-panel GEMM rule: weight-only quantized prefill at the float GEMM's speed.

Claims
    PrimFuncs that are one weight-only quantized matmul ``C[m.., n] = sum_k A[m.., k] *
    dequantize(stored)[n, k]`` (tvm_llm/quantization/kernels.py ``dequantize_matmul``: a
    spatial ``dequantize`` block producing the (N, K) float weight from the packed arrays)
    plus injective epilogues, when the rows are a prefill's (not decode-shaped ``(b, 1, K)``)
    and N is a multiple of the panel width. Decode keeps :mod:`.gemv` (the dequantize inlined
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

    The dequantize loop runs along k (contiguous packed bytes, vectorized) and stores each
    vector into the panel column (stride PN): about one scalar store per weight, once per
    call, against M/lanes vector FMAs per weight in the GEMM.

Where it applies is a per-target choice (tvm_llm/targets/llvm.py passes it to
:func:`schedules.cpu.cpu_rules`).
"""
from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from . import common, gemm

DEQUANTIZE_BLOCK = "dequantize"


class DequantGEMM(common.CPURule):
    """Weight-only quantized prefill: dequantize each weight panel once, then the GEMM tile."""

    def __init__(self, tile=None):
        self.tile = tile

    def schedule(self, func: tirx.PrimFunc, target: Target):
        prepared = common.prepare_matmul(func, keep_producers=(DEQUANTIZE_BLOCK,))
        if prepared is None:
            return None
        sch, pat = prepared
        if not pat.b_transposed or pat.decode_like or pat.m_static is not None:
            return None
        main = sch.get_sblock(pat.block_name)
        producers = [p for p in sch.get_producers(main)
                     if common.block_name(sch, p) == DEQUANTIZE_BLOCK]
        if len(producers) != 1 or not common.is_spatial_block(sch, producers[0]):
            return None
        writes = sch.get(producers[0]).writes
        if len(writes) != 1 or not writes[0].source.same_as(pat.b_buffer):
            return None
        mr, nv = self.tile or gemm.gemm_tile(target, pat.N, pat.K, pat.dtype)
        if pat.N % (nv * common.vector_lanes(target, pat.dtype)) != 0:
            return None
        try:
            return schedule_dequant_panel(sch, pat, target, (mr, nv))
        except Exception as err:  # pylint: disable=broad-except
            return common.rule_failed(self, func, err)


def schedule_dequant_panel(sch: s_tir.Schedule, pat: common.MatmulPattern, target: Target,
                           tile) -> s_tir.Schedule:
    lanes = common.vector_lanes(target, pat.dtype)
    mr, nv = tile
    pn = nv * lanes
    dq = sch.get_sblock(DEQUANTIZE_BLOCK)
    # The float weight in the packed-panel layout the micro-kernel reads: Bp[N/PN, K, PN].
    sch.transform_layout(dq, ("write", 0), lambda n, k: (n // pn, k, n % pn))
    sch = gemm.schedule_outer_product(sch, pat, target, pack=False, tile=tile,
                                      allow_bf16_dot=False)
    # decompose_reduction renamed the matmul block "<name>_update"
    no = sch.get_loops(sch.get_sblock(pat.block_name + "_update"))[0]
    # One panel per iteration of the parallel loop, dequantized before its row blocks.
    sch.compute_at(sch.get_sblock(DEQUANTIZE_BLOCK), no, preserve_unit_loops=True)
    dq = sch.get_sblock(DEQUANTIZE_BLOCK)
    n_loop, k_loop = sch.get_loops(dq)[-2:]
    width = common.pow2_divisor(pat.K, lanes)
    if width > 1:
        # blocks of `width` columns x `width` k: each column's k vector is loaded and widened
        # once; the unrolled columns store into consecutive panel addresses, which LLVM
        # turns into an in-register transpose (vector stores instead of one per weight)
        n_o, n_i = sch.split(n_loop, [None, width])
        k_o, k_i = sch.split(k_loop, [None, width])
        sch.reorder(n_o, k_o, n_i, k_i)
        sch.unroll(n_i)
        sch.vectorize(k_i)
    return sch
