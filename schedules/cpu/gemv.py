"""GEMV rule: weight matmuls that read the weight in its row-major (N, K) layout.

Claims
    PrimFuncs that are one NT matmul ``C[m.., n] = sum_k A[m.., k] * W[n, k]`` against a static
    2-D float32 weight (plus injective prologue/epilogue blocks), i.e. every linear layer after
    ``FuseTransposeMatmul``, when the weight is *not* repacked (the :mod:`.gemm` rule takes it
    when the build marks the weight layout-free). Also quantized weights: the dequantize
    producer (tvm_llm/quantization/kernels.py) is inlined, so each lane vector of packed bytes
    is loaded, widened, scaled and multiplied in registers. Decode ``x: (b, 1, K)`` with symbolic b is the
    case it is shaped for; prefill (symbolic n) also runs correctly through it. TVM's dlight CPU
    GEMV matches nothing once the batch is symbolic.

Why the schedule is shaped so
    * Bandwidth bound: every weight row is streamed once, contiguously, by one thread. The K
      loop is split into SIMD lanes and ``rfactor``-ed, so each (row of x, row of W) pair keeps
      a vector of partial sums; the lanes are summed once per output at the end.
    * ``Nr`` weight rows are read together (``Nr`` independent streams and accumulator chains,
      one load of x shared by all of them), for ``Mr`` rows of x at a time: decode batches and
      prefill reuse each loaded weight vector ``Mr`` times from registers.
    * Parallel over blocks of weight rows: each thread streams a contiguous part of W.
    * Symbolic M: rows of x are split by ``Mr``; the row loop carries
      ``pragma_loop_partition_hint`` so the main loop is predicate-free; decode b=1 runs the
      tail only (one row of x against ``Nr`` rows of W).
    * Partial sums and the output tile are "global"-scope buffers of < 1 KiB (stack, promoted to
      registers by LLVM); the epilogue runs per tile right after the lane reduction.

Measured (znver4, 1 thread, CPU time, scripts/bench_kernels.py --threads 1 --cpu-time):
    decode b=1 on llama-1b shapes 20-24 GB/s (0.65-0.78 of torch.sum's read bandwidth; torch's
    own linear 17-20 GB/s); prefill n=128 ~80 GFLOP/s. The packed layout of :mod:`.gemm` is
    faster on both (one sequential stream instead of 8, no lane reduction): 25-31 GB/s and
    ~110 GFLOP/s, so a build should prepack (see :mod:`.prepack`); this rule is the fallback.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.target import Target

from . import common, microarch


def gemv_tile(target: Target, N: int, K: int, dtype: str = "float32", decode_like: bool = False):
    """(Mr, Nr, L): rows of x, rows of W, and K lanes per step.

    Candidates from the target CPU's row of :mod:`.microarch`. Decode-shaped kernels
    (x: (b, 1, K)) use one row of x against 8 weight rows: the common b = 1 runs a clean loop
    (no predicated row tail) with 8 independent streams. Prefill on znver4 uses 3 x 4 (12
    accumulators, 7 loads per 12 FMAs). Measured on znver4, 1 thread: decode 1x8 ~= torch.sum
    bandwidth, 2x6 -15%; prefill n=128 3x4 80 GF/s, 2x6 74, 1x8 45.
    """
    lanes = common.vector_lanes(target, dtype)
    L = common.pow2_divisor(K, lanes)
    row = microarch.tile_row(target)
    cands = row.gemv_decode if decode_like else row.gemv_prefill
    elem = max(1, tvm.runtime.DataType(dtype).bits // 8)
    limit = (common.MAX_STACK_BYTES - 1) // elem
    for mr, nr in cands:
        if mr * nr * L <= limit and N % nr == 0:
            return mr, nr, L
    return 1, 1, L


class GEMV(common.CPURule):
    """NT weight matmul over the row-major weight: lane-split dot products, rows streamed."""

    def __init__(self, tile=None):
        self.tile = tile

    def schedule(self, func: tirx.PrimFunc, target: Target):
        prepared = common.prepare_matmul(func, allow_computed_b=True)
        if prepared is None:
            return None
        sch, pat = prepared
        if not pat.b_transposed:
            return None
        try:
            return schedule_dot_product(sch, pat, target, self.tile)
        except Exception as err:  # pylint: disable=broad-except
            return common.rule_failed(self, func, err)


def schedule_dot_product(sch: s_tir.Schedule, pat: common.MatmulPattern, target: Target,
                         tile=None) -> s_tir.Schedule:
    mr, nr, L = tile or gemv_tile(target, pat.N, pat.K, pat.dtype, pat.decode_like)
    main = sch.get_sblock(pat.block_name)
    if pat.epilogue:
        epi = sch.get_sblock(pat.epilogue[0])
        sch.set_scope(main, 0, "global")
    else:
        epi = None

    loops = sch.get_loops(main)
    if len(loops) != len(pat.m_extents) + 2:
        raise ValueError("unexpected loop nest")
    m_loops = [loops[i] for i in pat.m_axes]
    n_loop, k_loop = loops[pat.n_axis], loops[pat.k_axis]
    sch.reorder(*m_loops, n_loop, k_loop)
    m = sch.fuse(*m_loops) if len(m_loops) > 1 else m_loops[0]
    no, nri = sch.split(n_loop, [None, nr])
    mo, mri = sch.split(m, [None, mr])
    ko, ki = sch.split(k_loop, [None, L])
    sch.reorder(no, mo, ko, mri, nri, ki)
    rf = sch.rfactor(ki, factor_axis=0)
    no, mo, ko, mri, nri, ki = sch.get_loops(rf)
    sch.reverse_compute_at(main, mo)
    if epi is not None:
        sch.reverse_compute_at(epi, mo)
    m_static = pat.m_static
    if m_static is None or m_static % mr != 0:
        sch.annotate(mo, "pragma_loop_partition_hint", 1)
    sch.parallel(no)
    if L > 1:
        sch.vectorize(ki)
    sch.unroll(nri)
    sch.unroll(mri)
    init = sch.decompose_reduction(rf, ko)
    il = sch.get_loops(init)
    if L > 1:
        sch.vectorize(il[-1])
    for lp in il[-3:-1]:
        sch.unroll(lp)
    # Lane sum (and the epilogue): unrolled, one output per (row, weight row).
    for lp in sch.get_loops(main)[2:]:
        sch.unroll(lp)
    if epi is not None:
        common.vectorize_innermost(sch, epi, max(1, min(nr, common.vector_lanes(target))))

    # Register tiles: partial sums [Mr, Nr, L]; the epilogue's input [Mr, Nr].
    def rf_map(*idx):
        return (common.m_flat_index(pat, idx[1:-1]) % mr, idx[-1] % nr, idx[0])

    sch.transform_layout(rf, ("write", 0), rf_map, assume_injective_transform=True)
    if epi is not None:
        def c_map(*idx):
            return (common.m_flat_index(pat, idx[:-1]) % mr, idx[-1] % nr)

        sch.transform_layout(main, ("write", 0), c_map, assume_injective_transform=True)
    return sch
