"""GEMM rule: weight matmuls computed as outer products over a packed weight panel.

Claims
    Every PrimFunc that is one matmul ``C[m.., n] = sum_k A[m.., k] * B[.., ..]`` against a
    static 2-D float32 weight ``B`` plus injective prologue/epilogue blocks (bias, residual
    add, SiLU/GELU, multiply, reshape...), when the weight may change layout:

    * ``B`` is (N, K) (the NT matmul that ``FuseTransposeMatmul`` makes of every linear) and the
      build marked it as a weight (``layout_free_buffers``, set by
      ``relax.transform.AttachAttrLayoutFreeBuffers``), or the rule was built with
      ``prepack=True``: the kernel reads ``B`` packed as ``Bp[N/PN, K, PN]`` (see below);
    * ``B`` is (K, N) (an NN matmul): rows of ``B`` are already contiguous in n, no packing.

    M (the token dim ``n`` of prefill, or the batch ``b`` of decode) may be symbolic. With a
    row-major (N, K) weight that must not be repacked, :mod:`.gemv` claims the kernel instead.

Why the schedule is shaped so
    * Micro-kernel: an ``Mr x PN`` tile of C (``PN = Nv`` vectors of the target's widest SIMD)
      stays in registers while k runs: per k it loads ``Nv`` vectors of the packed panel and
      broadcasts ``Mr`` scalars of A, for ``Mr*Nv`` FMAs. The tile depends on the CPU model,
      not only the ISA (:mod:`.microarch`, which says which rows were measured and which are
      reasoned): znver4 4x3 when 48 divides N, else 7x2; Intel parts with two 512-bit FMA ports
      8x3 in float32 when 48 divides N, else 6x4 when 64 does, else 7x2 (bfloat16 always
      7x2); AVX2 4x3 when 24 divides N (znver3); NEON 6x4. The tile is a "global"-scope
      buffer, which TVM puts on the stack below 1 KiB and the build's TIR pipeline up to 2 KiB
      (:mod:`.pipeline`), and LLVM promotes to registers; a larger tile, a "local" one, or one
      over 1 KiB compiled with TVM's default pipeline becomes a TVMBackendAllocWorkspace
      buffer whose stores stay in the k loop (measured 3x slower). On one 512-bit FMA per
      cycle 12-14 accumulators run at ~95% of the peak; two per cycle (Intel) want more (8x3:
      24).
    * Packed weight ``Bp[N/PN, K, PN]``: one contiguous, sequential stream per panel for the
      micro-kernel and for decode; the panel (K x PN floats, <= 720 KB for K = 5632) is reused
      from L2 for every ``Mr``-row block of A, so no K blocking is needed on znver4 (K=5632
      runs at the same 109 GF/s/core as K=768). Where the CPU's row sets
      ``gemm_k_block_bytes`` (Intel) a larger panel runs in k blocks
      (:func:`_schedule_k_blocked`). On Intel Xeons the panel's lines are also prefetched into
      L1 2 KiB ahead of their loads (``gemm_prefetch_bytes`` of the CPU's row, inserted by
      :func:`.pipeline.row_tile_loops`): the L1 prefetchers alone run too close behind a
      kernel that eats a line every ~4 cycles. There the row tiles also prefetch the next
      panel into L2 while they compute, where two panels fit L2 (``gemm_next_panel_bytes``,
      :func:`.pipeline._next_panel_prefetched`): otherwise the first row tile of each panel
      waits on DRAM for the whole panel, at three lines per k step faster than a core's share
      of the bus (whole builds, same Xeon, 2 threads, scripts/ab_decode.py --prefill: llama-1b
      64 tokens 0.94x the time, llama-110m 128 tokens 0.94x). The packing is a separate
      "layout rewrite" block (``meta_schedule.layout_rewrite_preproc``) that
      ``relax.transform.SplitLayoutRewritePreproc``
      splits out and ``LiftTransformParams`` moves to build time (see :mod:`.prepack`). Packing
      on every call does not pay: n=128 K=N=2048 (1 thread) 14.6 ms packed-per-call vs 13.3 ms
      row-major (GEMV rule) vs 9.8 ms prepacked; it only wins from n ~ 512.
    * Parallel over N panels (each thread streams its own contiguous part of ``Bp``).
    * Symbolic M: rows are split by ``Mr`` and the row loop carries
      ``pragma_loop_partition_hint``, so TVM's LoopPartition emits a predicate-free main loop
      and a predicated tail. Decode (M = 1) runs only the tail: one row against each panel, a
      streaming GEMV over the packed weight (measured faster than a dedicated Mr=1 loop on
      znver4). Where the CPU's row asks for it (``gemm_decode_streams``, Intel, znver5 and
      AVX2: 4) a decode kernel instead walks that many neighbouring panels side by side, one
      row at a time: per k one broadcast of x and Nv FMAs on each panel, so several
      sequential weight streams are in flight per core (1.5-1.6x the bandwidth of one on
      emeraldrapids, 1.4-2.0x on znver3, 1.02-1.2x on znver5). The packed layout is the same
      as prefill's: both kernels read one weight.
    * bfloat16/float16 inputs without ``vdpbf16ps`` (AVX2, AVX-512 without BF16, aarch64):
      decode widens each weight vector in registers (free beside the memory traffic); prefill
      widens once (:func:`widens_once`): the activations into a float32 copy per call, each
      packed panel into a float32 ``K x PN`` workspace at the top of its parallel iteration,
      then the float32 micro-kernel (znver3, 2 threads: bf16 GEMM 106 -> 182 GFLOP/s at 128
      rows, float32 171 in the same run).
    * The epilogue is computed per tile right after its k loop (``reverse_compute_at``),
      vectorized, while the tile is still in registers; the tile buffer is remapped to
      ``[m % Mr, n % PN]`` last (``assume_injective_transform``) so its size stays constant
      with a symbolic M (TVM's buffer compaction cannot bound ``min(Mr, n - mo*Mr)``).

Measured (znver4, 1 thread, CPU time, scripts/bench_kernels.py --threads 1 --cpu-time):
    prefill n=128 106-111 GFLOP/s on all llama-110m/1b linear shapes (torch 1.2-1.5x slower);
    decode b=1 25-31 GB/s on llama-1b shapes, 0.76-0.99 of torch.sum's read bandwidth.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.target import Target

from . import amx_prefill, bf16_dot, common, microarch, pipeline

LAYOUT_REWRITE_ATTR = "meta_schedule.layout_rewrite_preproc"


def packed_panel_width(target: Target, N: int, K: int, dtype: str = "float32",
                       input_dtype: str | None = None) -> int:
    """PN, the number of output columns per packed panel (a multiple of the vector width)."""
    return gemm_tile(target, N, K, dtype, input_dtype)[1] * common.vector_lanes(target, dtype)


def uses_bf16_dot(target: Target, pat: common.MatmulPattern, pack: bool) -> bool:
    """Whether the kernel runs on ``vdpbf16ps`` (:mod:`.bf16_dot`): a bfloat16 weight packed at
    build time (the pair-interleaved panel is made there), bfloat16 activations, an even K and
    a target CPU with AVX512-BF16; the caller also requires N to be a multiple of the panel
    width (a partial panel puts a column predicate inside the 16-lane block, which cannot be
    tensorized; every LLM shape we build has N % 16 == 0, GPT-2's 50257-row vocabulary does
    not). Elsewhere (AVX2, AVX-512 without BF16, aarch64, row-major weights) bfloat16 is widened
    to float32 in registers and summed with float32 FMAs."""
    return (pack and pat.input_dtype == "bfloat16" and pat.dtype == "float32" and pat.K % 2 == 0
            and common.vector_isa(target) == "avx512" and common.vector_lanes(target) == 16
            and common.has_feature(bf16_dot.FEATURE, target))


def gemm_tile(target: Target, N: int, K: int, dtype: str = "float32", input_dtype: str | None = None):
    """(Mr, Nv): rows of A and SIMD vectors of C per register tile.

    Candidates come from the target CPU's row of :mod:`.microarch` (best first; a float32
    matmul tries the row's `gemm_float32` tiles first). Accumulators Mr*Nv fill most of the
    vector register file while the tile stays within the stack limit of the build's pipeline
    (:data:`.pipeline.TILE_STACK_BYTES`); PN = Nv * lanes prefers widths that divide N (no
    padded panel).
    """
    lanes = common.vector_lanes(target, dtype)
    elem = max(1, tvm.runtime.DataType(dtype).bits // 8)
    row = microarch.tile_row(target)
    cands = list(row.gemm)
    if dtype == "float32" and input_dtype in (None, "float32"):
        cands = list(row.gemm_float32) + cands
    limit = pipeline.TILE_STACK_BYTES // elem
    cands = [(mr, nv) for mr, nv in cands if mr * nv * lanes <= limit] or [(1, 1)]
    for mr, nv in cands:
        if N % (nv * lanes) == 0:
            return mr, nv
    return cands[0]


class GEMM(common.CPURule):
    """Weight matmul (prefill GEMM and decode GEMV) over a packed weight panel."""

    def __init__(self, prepack: str | bool = "auto", tile=None, bf16_dot: bool = True,
                 decode_streams=None):
        """prepack: "auto" packs NT weights the build marked layout-free; True packs every NT
        weight; False never packs (NT matmuls are then left to the GEMV rule).
        tile: optional (Mr, Nv) override, for experiments.
        bf16_dot: False keeps bfloat16 on widen-and-FMA even where vdpbf16ps exists (A/B runs)."""
        self.prepack = prepack
        self.tile = tile
        self.bf16_dot = bf16_dot
        self.decode_streams = decode_streams  # None: the CPU's row of microarch

    def schedule(self, func: tirx.PrimFunc, target: Target):
        prepared = common.prepare_matmul(func)
        if prepared is None:
            return None
        sch, pat = prepared
        pack = False
        if pat.b_transposed:
            # Only a function parameter can be packed at build time (SplitLayoutRewritePreproc).
            idx = common.param_index(func, pat.b_buffer)
            if self.prepack is True:
                pack = idx >= 0
            elif self.prepack == "auto":
                pack = idx >= 0 and idx in common.layout_free_indices(func)
            if not pack:
                return None
        try:
            return schedule_outer_product(sch, pat, target, pack, self.tile, self.bf16_dot,
                                          self.decode_streams)
        except Exception as err:  # pylint: disable=broad-except
            if not (self.bf16_dot and uses_bf16_dot(target, pat, pack)):
                return common.rule_failed(self, func, err)
            common.rule_failed(self, func, err)  # logged; the widen-and-FMA kernel follows
        # vdpbf16ps could not be tensorized here (an operand that is not a plain buffer
        # region): the same kernel on widen-and-FMA
        sch, pat = common.prepare_matmul(func)
        try:
            return schedule_outer_product(sch, pat, target, pack, self.tile, False,
                                          self.decode_streams)
        except Exception as err:  # pylint: disable=broad-except
            return common.rule_failed(self, func, err)


def decode_streams(target: Target, pat: common.MatmulPattern, pn: int, wanted=None) -> int:
    """How many packed panels one decode row walks at once (1 outside decode): the CPU row's
    `gemm_decode_streams` (or `wanted`), reduced until the panels divide N evenly and the
    groups of panels (the parallel iterations) share evenly over the cores or are many: with
    64-wide panels a 1280-wide matrix made 5 groups of 4 for 2 threads (3 + 2)."""
    if not (pat.decode_like or pat.m_static == 1):  # a decode step, or prefill's last-token logits
        return 1
    s = wanted or microarch.tile_row(target).gemm_decode_streams
    cores = common.num_cores(target)

    def uneven(s):
        groups = pat.N // (s * pn)
        return groups % cores != 0 and groups < 8 * cores

    while s > 1 and (pat.N % (s * pn) or (wanted is None and uneven(s))):
        s //= 2
    return max(1, s)


# A static row count below this keeps widening in registers (widens_once): at exactly 4 rows,
# one full tile, the copies measured ~12% slower (znver3, one core, CPU time); a prefill's row
# count is symbolic and always takes the copies
WIDEN_ONCE_MIN_ROWS = 8


def widens_once(pat: common.MatmulPattern, pack: bool, dot: bool, streams: int):
    """The activations' buffer when a bfloat16/float16 matmul summed with float32 FMAs (no
    vdpbf16ps) first widens its inputs into float32 copies, else None. The copies: the
    activations once per call, each packed weight panel once per parallel iteration (a K x PN
    workspace that stays in L2); the float32 micro-kernel then runs on them. Widening at every
    use costs a vpmovzxwd + vpslld per weight vector and a load + shift + broadcast per
    activation: on AVX2 (two FMA pipes beside two other vector pipes) more vector work than the
    FMAs themselves, and bfloat16 prefill ran at ~0.6 of float32 (scripts/bench_bf16_gemm.py).
    Prefill only (decode reads each weight once, and widening in registers is free beside the
    memory traffic), and only where the activations are a plain input of the matmul."""
    if not (pack and not dot and streams == 1 and pat.input_dtype in common.HALF_DTYPES):
        return None
    if pat.decode_like or (pat.m_static is not None and pat.m_static < WIDEN_ONCE_MIN_ROWS):
        return None
    return pat.a_buffer


def _float32_copy(sch: s_tir.Schedule, main, buffer):
    """A block copying `buffer` (a half-precision read of `main`) into a float32 buffer that
    `main` reads instead."""
    reads = [r.source for r in sch.get(main).reads]
    index = next(i for i, b in enumerate(reads) if b.same_as(buffer))
    copy = sch.cache_read(main, index, "global")
    sch.unsafe_set_dtype(copy, 0, "float32")
    return copy


def _schedule_float32_copies(sch: s_tir.Schedule, a_copy, b_copy, no, lanes: int):
    """The activations' copy before the GEMM, rows in parallel; each weight panel's copy at
    the start of its parallel iteration `no` (a per-thread workspace); both vectorized."""
    loops = sch.get_loops(a_copy)
    if len(loops) > 1:  # the rows (all loops but K's)
        sch.parallel(sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0])
    common.vectorize_innermost(sch, a_copy, lanes)
    sch.compute_at(b_copy, no, preserve_unit_loops=True)
    common.vectorize_innermost(sch, b_copy, lanes)


def pack_weight(sch: s_tir.Schedule, main, pat: common.MatmulPattern, pn: int, dot: bool):
    """The packed weight, written by a layout-rewrite block that the build lifts out: every
    kernel reading one weight (prefill, decode, AMX prefill) must pack it alike. Returns the
    packed buffer."""
    rw = sch.cache_read(main, pat.b_index, "global")
    sch.annotate(rw, LAYOUT_REWRITE_ATTR, True)
    pad = None if pat.N % pn == 0 else 0.0
    if dot:
        imap = lambda n, k: (n // pn, k // 2, n % pn, k % 2)  # noqa: E731
    elif pat.b_transposed:
        imap = lambda n, k: (n // pn, k, n % pn)  # noqa: E731
    else:
        imap = lambda k, n: (n // pn, k, n % pn)  # noqa: E731
    sch.transform_layout(main, ("read", pat.b_index), imap, pad_value=pad)
    rl = sch.get_loops(rw)
    if len(rl) >= 1:
        sch.parallel(rl[0])
    return sch.get(rw).writes[0].source


def _register_tiles(sch: s_tir.Schedule, pat: common.MatmulPattern, m_loops, n_loop, k_loop,
                    mr: int, nv: int, lanes: int, between=(), dot: bool = False):
    """The tiling no | between.. | mo | k | mr | nv | nl (| the k pair of vdpbf16ps): the rows
    fused and split by `mr` (a partition hint where `mr` may not divide them), N split into
    panels of `nv` vectors run in parallel, the tile's loops unrolled and its vector loop
    vectorized (tensorized instead with `dot`). Returns (no, mo, k_loop)."""
    m = sch.fuse(*m_loops) if len(m_loops) > 1 else m_loops[0]
    no, nvl, nl = sch.split(n_loop, [None, nv, lanes])
    mo, mri = sch.split(m, [None, mr])
    if dot:
        k_loop, kp = sch.split(k_loop, [None, 2])
        sch.reorder(no, *between, mo, k_loop, mri, nvl, nl, kp)
    else:
        sch.reorder(no, *between, mo, k_loop, mri, nvl, nl)
    if pat.m_static is None or pat.m_static % mr != 0:
        sch.annotate(mo, "pragma_loop_partition_hint", 1)
    sch.parallel(no)
    if not dot:
        sch.vectorize(nl)
    sch.unroll(nvl)
    sch.unroll(mri)
    return no, mo, k_loop


def _annotate_micro_kernel(sch: s_tir.Schedule, target: Target, mo, k_loop, panel: int):
    """Ask the CPU pipeline (pipeline.row_tile_loops) to finish the float32 micro-kernel: the
    partial row tile without branches, the panel prefetched into L1 ``gemm_prefetch_bytes``
    ahead, and the next panel (`panel` floats on) into L2 where it is small enough."""
    row = microarch.tile_row(target)
    sch.annotate(k_loop, pipeline.ROW_TILE_LOOP, True)
    if row.gemm_prefetch_bytes:
        sch.annotate(k_loop, pipeline.PREFETCH_AHEAD, row.gemm_prefetch_bytes)
    if panel * 4 <= row.gemm_next_panel_bytes:
        sch.annotate(mo, pipeline.NEXT_PANEL, panel)


def _tile_init(sch: s_tir.Schedule, block, k_loop):
    """The register tile's zeroing before `k_loop`, vectorized and unrolled."""
    init = sch.decompose_reduction(block, k_loop)
    il = sch.get_loops(init)
    sch.vectorize(il[-1])
    for lp in il[-3:-1]:
        sch.unroll(lp)


# the shortest k block worth its partial sums: a K with no divisor between this and the row's
# limit (a prime K, say) keeps the whole K
MIN_K_BLOCK = 256


def k_blocks(target: Target, pat: common.MatmulPattern, pn: int) -> int:
    """How many k blocks a float32 prefill GEMM runs in: the fewest that divide K and keep a
    block's slice of a packed panel (K/blocks x PN floats) within the CPU row's
    ``gemm_k_block_bytes``, blocks of at least MIN_K_BLOCK; 1 (whole K) where the row sets
    none, the panel fits, or no such division exists."""
    limit = microarch.tile_row(target).gemm_k_block_bytes
    if not limit or pat.K * pn * 4 <= limit:
        return 1
    for blocks in range(2, pat.K // MIN_K_BLOCK + 1):  # never pn blocks: the sum tells them apart
        if pat.K % blocks == 0 and pat.K // blocks * pn * 4 <= limit and blocks != pn:
            return blocks
    return 1


def _schedule_k_blocked(sch: s_tir.Schedule, pat: common.MatmulPattern, target: Target, main,
                        mr: int, nv: int, lanes: int, kb: int) -> s_tir.Schedule:
    """The float32 micro-kernel over `kb` k blocks: no | kb | mo | k | mr | nv | nl, each k
    block's partial tiles stored to a (kb, M, PN) buffer of the panel (TVM allocates it inside
    the parallel loop: a per-thread workspace, 512 KiB for llama-1b's down projection at a
    512-token chunk), then per panel the sum of the kb partials and the epilogue. With the
    whole K a panel (K x PN floats) and the activations' rows (M x K) both stream through L2
    for every row tile; llama-1b's down projection (K = 5632: 1.4 MiB panels, 1.4 MiB of
    activations at 64 rows) overflows a 2 MiB L2 so, and ran at 0.75-0.85 of the other
    linears' GFLOP/s. Its k blocks keep both within L2; summing the
    partials reads kb x M x PN floats a panel, little beside the panel itself."""
    pn = nv * lanes
    loops = sch.get_loops(main)
    m_loops = [loops[i] for i in pat.m_axes]
    n_loop, k_loop = loops[pat.n_axis], loops[pat.k_axis]
    sch.reorder(*m_loops, n_loop, k_loop)
    ko, ki = sch.split(k_loop, [kb, None])
    rf = sch.rfactor(ko, 0)  # the partial products of each k block: Crf[kb, M.., N]
    tile = sch.cache_write(rf, 0, "global")
    rl = sch.get_loops(rf)
    nm = len(pat.m_extents)
    no, mo, ki = _register_tiles(sch, pat, rl[:nm], rl[nm], rl[nm + 2], mr, nv, lanes,
                                 between=(rl[nm + 1],))
    sch.reverse_compute_at(tile, mo)
    _annotate_micro_kernel(sch, target, mo, ki, pat.K // kb * pn)  # a k block's panel slice
    _tile_init(sch, rf, ki)
    common.vectorize_innermost(sch, tile, lanes)
    # the sum of the k blocks' partial products, a panel at a time, then the epilogue
    sch.reverse_compute_at(main, no)
    ml = sch.get_loops(main)[1:]  # below no: the k blocks, the panel's columns, the rows
    ext = {i: common.loop_extent(sch, lp) for i, lp in enumerate(ml)}
    k_l = next(lp for i, lp in enumerate(ml) if ext[i] == kb)
    n_l = next(lp for i, lp in enumerate(ml) if ext[i] == pn)
    m_l = [lp for i, lp in enumerate(ml) if not (lp.same_as(k_l) or lp.same_as(n_l))]
    sch.reorder(*m_l, k_l, n_l)
    sinit = sch.decompose_reduction(main, k_l)  # the update's column loop: LLVM vectorizes it
    common.vectorize_innermost(sch, sinit, lanes)
    if pat.epilogue:
        epi = sch.get_sblock(pat.epilogue[0])
        sch.reverse_compute_at(epi, no)
        common.vectorize_innermost(sch, epi, lanes)

    def tile_map(*idx):
        return (common.m_flat_index(pat, idx[1:-1]) % mr, idx[-1] % pn)

    sch.transform_layout(rf, ("write", 0), tile_map, assume_injective_transform=True)
    return sch


def schedule_outer_product(sch: s_tir.Schedule, pat: common.MatmulPattern, target: Target,
                           pack: bool, tile=None, allow_bf16_dot: bool = True,
                           streams=None) -> s_tir.Schedule:
    lanes = common.vector_lanes(target, pat.dtype)
    mr, nv = tile or gemm_tile(target, pat.N, pat.K, pat.dtype, pat.input_dtype)
    pn = nv * lanes  # the packed panel's width: the same in every kernel reading the weight
    main = sch.get_sblock(pat.block_name)
    dot = allow_bf16_dot and uses_bf16_dot(target, pat, pack) and pat.N % pn == 0
    if dot and amx_prefill.usable(target, pat, pn, sch):
        return amx_prefill.schedule(sch, pat, target, pn,
                                    lambda s, blk: pack_weight(s, blk, pat, pn, dot=True))
    s = decode_streams(target, pat, pn, streams)
    if s > 1:  # decode: one row against s neighbouring panels (s weight streams in flight)
        mr, nv = 1, s * nv
    widen = widens_once(pat, pack, dot, s)  # the activations to widen, or None

    # 1. The weight: packed panels Bp[N/PN, K, PN] written by a layout-rewrite block; for
    #    vdpbf16ps Bp[N/PN, K/2, PN, 2] (the two k of a column side by side, one 32-bit lane).
    if pack:
        packed = pack_weight(sch, main, pat, pn, dot)
    if widen is not None:  # float32 copies that the FMAs read: activations, each weight panel
        a_f32 = _float32_copy(sch, main, widen)
        b_f32 = _float32_copy(sch, main, packed)

    kb = k_blocks(target, pat, pn) if (s == 1 and not dot and widen is None
                                        and not pat.decode_like) else 1
    if kb > 1:  # the panel and the activations' rows overflow L2: k blocks
        if pat.epilogue:
            sch.set_scope(main, 0, "global")
        return _schedule_k_blocked(sch, pat, target, main, mr, nv, lanes, kb)

    # 2. The accumulator tile: the epilogue's input, or a cache of the output.
    if pat.epilogue:
        epi = sch.get_sblock(pat.epilogue[0])
        sch.set_scope(main, 0, "global")
    else:
        epi = sch.cache_write(main, 0, "global")

    # 3. Tiling: no | mo | k | mr | nv | nl
    loops = sch.get_loops(main)
    n_iters = len(pat.m_extents) + 2
    if len(loops) != n_iters:
        raise ValueError("unexpected loop nest")
    m_loops = [loops[i] for i in pat.m_axes]
    n_loop, k_loop = loops[pat.n_axis], loops[pat.k_axis]
    sch.reorder(*m_loops, n_loop, k_loop)
    no, mo, k_loop = _register_tiles(sch, pat, m_loops, n_loop, k_loop, mr, nv, lanes, dot=dot)
    sch.reverse_compute_at(epi, mo)
    if widen is not None:
        _schedule_float32_copies(sch, a_f32, b_f32, no, lanes)

    if s == 1 and not dot and not pat.decode_like:  # the float32 micro-kernel (pipeline.py)
        _annotate_micro_kernel(sch, target, mo, k_loop, pat.K * pn)
    _tile_init(sch, main, k_loop)
    common.vectorize_innermost(sch, epi, lanes)

    # 4. Keep the tile at Mr x PN: the rows of one tile map onto the same Mr slots. Done last,
    #    as the mapping is not injective over the whole C (tiles reuse the buffer in turn).
    tw = nv * lanes  # the tile's width: pn, or s panels side by side in decode

    def tile_map(*idx):
        return (common.m_flat_index(pat, idx[:-1]) % mr, idx[-1] % tw)

    sch.transform_layout(main, ("write", 0), tile_map, assume_injective_transform=True)

    # 5. vdpbf16ps: the (16 columns x 2 k) inner block becomes one instruction. Blockized once
    #    first: that block takes the row predicate of a partial tile (symbolic M), which
    #    tensorize's comparator would otherwise hold against the intrinsic (unpredicated).
    if dot:
        inner = sch.get_loops(main)[-2]
        sch.blockize(inner)
        sch.tensorize(inner, bf16_dot.intrin_name(str(sch.get(inner).extent.ty.dtype)))
    return sch
