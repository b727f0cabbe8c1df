"""One tensor-core GEMM schedule for NVIDIA mma.sync and AMD MFMA, parameterised per target.

Claims: a fused kernel whose single reduction is C[s, i, j] += A[s, i, k] * W[j, k] with
fp16 inputs (int8 with the ROCm int8 config), both read along K in their innermost axis
(W stored (N, K): x @ W^T after FuseTransposeMatmul), batch s = 1, static N and K (the
weight), and M static >= `min_m` or symbolic (prefill's token count n) unless its declared
bound says it is a decode batch (the GEMV rule's). Elementwise epilogues fused after the
matmul (bias, residual add, activation, cast) are computed from the accumulator registers.

Schedule (block tile BM x BN, warps_m x warps_n warps each frags_m x frags_n 16x16 fragments):
  - accumulate in fp32 (`widen_accumulator`), normalise to [S, I, J, K] (dlight's reindex);
  - pad M, N, K to the block tile (`pad_einsum`: symbolic n reads zeros past the end and the
    write-back is predicated);
  - per K tile: A and W tiles -> shared memory (vectorised, padded rows against bank
    conflicts), each warp loads 16x16 fragments into registers (ldmatrix / MFMA layout) and
    runs frags_m x frags_n tensor-core ops per 16-wide K step;
  - the warp's accumulators go straight to global memory through the epilogue, each lane
    writing the elements its registers hold (no shared-memory round trip, so the 64 KiB LDS
    of a CDNA workgroup suffices).

The scheduled kernel's index arithmetic is narrowed to int32 when the declared bounds allow
(`narrow`; analysis.narrow_indices).

`tensorize=False` keeps every step but the four `tensorize` calls: the blocks then compute
exactly what the intrinsics' descriptions say, which the CPU tests run (serialised) to check
tiling, padding, predicates, accumulation and the fused epilogue numerically. The register
layouts themselves are checked against the PTX ISA / CDNA documents in the tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.dlight.gpu.matmul import auto_inline_consumer_chain, auto_inline_producers, get_index_map

from .analysis import (find_matmul, narrow_indices, normalize_matmul, schedule_or_none,
                       symbolic_bound, widen_accumulator)


@dataclass(frozen=True)
class TensorCoreConfig:
    target_kind: str                 # "cuda" | "rocm"
    warp_size: int
    # in dtype -> (load A, load W, mma, fill) intrinsic names
    intrinsics: dict
    layout_a: Callable               # (i, k) of a 16 x frag_k A fragment -> (lane, local)
    layout_b: Callable               # (j, k) of a W fragment -> (lane, local)
    layout_c: Callable               # (i, j) of the 16x16 accumulator -> (lane, local)
    bind_store: Callable             # (sch, i16 loop, j16 loop) -> binds the lane loop
    shared_scope: str = "shared"
    warps_m: int = 2
    warps_n: int = 2
    frags_m: int = 4                 # 16x16 fragments per warp along M: warp tile 64
    frags_n: int = 4
    frag_k: int = 16
    k_tile: int = 32                 # K elements staged in shared memory per step
    vector_bytes: int = 16           # global -> shared copy width
    min_m: int = 64                  # static M below this is left to GEMV-like rules
    decode_max: int = 16             # symbolic M bounded by this is a decode batch: not ours
    pad_row: int = 8                 # shared row padding (elements) against bank conflicts
    # global -> shared copies issued asynchronously (cp.async, sm_80+) this many K tiles ahead
    # of the tensor-core work (2: double buffering); 0 copies synchronously each K step
    async_copy_stages: int = 0
    target_check: Callable = field(default=lambda target: True)

    @property
    def block_m(self):
        return self.warps_m * self.frags_m * 16

    @property
    def block_n(self):
        return self.warps_n * self.frags_n * 16


def _as_int(expr):
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


class TensorCoreMatmul(ScheduleRule):
    """dlight ScheduleRule: the GEMM schedule above for `config`."""

    def __init__(self, config: TensorCoreConfig, tensorize: bool = True, narrow: bool = True):
        self.config = config
        self.tensorize = tensorize
        self.narrow = narrow

    # ------------------------------------------------------------ claiming
    def claims(self, func: tirx.PrimFunc, target) -> bool:
        return self._analyze(func, target) is not None

    def _analyze(self, func, target):
        cfg = self.config
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != cfg.target_kind:
            return None
        if not cfg.target_check(target):
            return None
        sch = s_tir.Schedule(func)
        mm = find_matmul(sch)
        if mm is None or not mm.k_contiguous:   # x @ W^T with W (N, K) only
            return None
        if mm.a_dtype != mm.b_dtype or mm.a_dtype not in cfg.intrinsics:
            return None
        acc = _accumulator_dtype(mm.a_dtype)
        if mm.out_dtype not in ((acc,) if acc == "int32" else ("float16", "bfloat16", "float32")):
            return None
        maps = get_index_map(sch.get(mm.block))
        stmt = sch.get(mm.block)
        s_ext, m_ext, n_ext, k_ext = _fused_extents(stmt, maps[0])
        if _as_int(s_ext) != 1 or _as_int(n_ext) is None or _as_int(k_ext) is None:
            return None
        if _as_int(n_ext) < 16 or _as_int(k_ext) < cfg.frag_k:
            return None
        if _as_int(k_ext) % (cfg.vector_bytes // _dtype_bytes(mm.a_dtype)):
            return None   # rows must split into whole 16-byte vectors (padding is per row)
        m_static = _as_int(m_ext)
        if m_static is not None and m_static < cfg.min_m:
            return None
        if m_static is None:
            bound = symbolic_bound(func, m_ext)
            if bound is not None and bound <= cfg.decode_max:
                return None
        return mm

    # ------------------------------------------------------------ schedule
    def apply(self, func, target, _tunable):
        mm = self._analyze(func, target)
        if mm is None:
            return None
        return schedule_or_none(self._schedule, func, mm, name=type(self).__name__)

    def _schedule(self, func, mm):
        cfg = self.config
        func, _ = widen_accumulator(func, mm.name, _accumulator_dtype(mm.a_dtype))
        sch = s_tir.Schedule(func)
        main = sch.get_sblock(mm.name)
        load_a, load_b, mma, fill = cfg.intrinsics[mm.a_dtype]

        # 1. normalise to C[S, I, J] += A[S, I, K] * B[S, J, K]
        normalize_matmul(sch, main)

        # 2. pad to whole block tiles (symbolic n included)
        sch.pad_einsum(main, [1, cfg.block_m, cfg.block_n, cfg.k_tile])

        # 3. 16x16xfrag_k tensor-core blocks, tiled over warps and the block grid
        batch, i, j, k = sch.get_loops(main)
        i, i_tc = sch.split(i, factors=[None, 16])
        j, j_tc = sch.split(j, factors=[None, 16])
        k, k_tc = sch.split(k, factors=[None, cfg.frag_k])
        sch.reorder(i, j, k, i_tc, j_tc, k_tc)
        block_outer = sch.blockize(i_tc)
        block_inner = main

        i0, i1, i2 = sch.split(i, factors=[None, cfg.warps_m, cfg.frags_m])
        j0, j1, j2 = sch.split(j, factors=[None, cfg.warps_n, cfg.frags_n])
        k0, k1 = sch.split(k, factors=[None, cfg.k_tile // cfg.frag_k])
        sch.reorder(batch, j0, i0, i1, j1, k0, k1, i2, j2)
        sch.bind(j0, "blockIdx.x")
        sch.bind(i0, "blockIdx.y")
        warp = sch.fuse(i1, j1)
        sch.bind(warp, "threadIdx.y")
        num_warps = cfg.warps_m * cfg.warps_n

        # 4. A and W tiles -> shared memory, one vector per thread per step
        def fetch_to_shared(index):
            block = sch.cache_read(block_outer, index, cfg.shared_scope)
            sch.compute_at(block, k0)
            vec = cfg.vector_bytes // _dtype_bytes(mm.a_dtype)
            fused = sch.fuse(*sch.get_loops(block)[-2:])
            _, ty, tx, v = sch.split(fused, factors=[None, num_warps, cfg.warp_size, vec])
            sch.bind(ty, "threadIdx.y")
            sch.bind(tx, "threadIdx.x")
            sch.vectorize(v)
            if cfg.pad_row:
                sch.storage_align(block, 0, axis=-2, factor=16, offset=cfg.pad_row)
            return block

        a_shared = fetch_to_shared(0)
        b_shared = fetch_to_shared(1)
        auto_inline_producers(sch, a_shared)
        auto_inline_producers(sch, b_shared)

        # 5. fragments in registers ("warp" scope: lane x local) and the accumulator
        a_warp = sch.cache_read(block_outer, 0, "warp")
        b_warp = sch.cache_read(block_outer, 1, "warp")
        sch.compute_at(a_warp, k1)
        sch.compute_at(b_warp, k1)
        c_warp = sch.cache_write(block_outer, 0, "warp")
        sch.reverse_compute_at(c_warp, warp)

        fk = cfg.frag_k
        for block, layout, cols in ((a_warp, cfg.layout_a, fk), (b_warp, cfg.layout_b, fk),
                                    (block_outer, cfg.layout_c, 16)):
            shape = sch.get(block).writes[0].source.shape
            sch.transform_layout(block, ("write", 0),
                                 _fragment_map(layout, 16, cols, len(shape), str(shape[-1].ty)))

        # 6. epilogue: everything after the matmul is computed where the accumulator is stored
        auto_inline_consumer_chain(sch, c_warp)
        loops = sch.get_loops(c_warp)
        ii, jj = loops[-2:]
        io, ii = sch.split(ii, factors=[None, 16])
        jo, ji = sch.split(jj, factors=[None, 16])
        sch.reorder(io, jo, ii, ji)
        cfg.bind_store(sch, ii, ji)

        # 7. zero the accumulator before the K loop
        block_init = sch.decompose_reduction(block_outer, k0)
        init_inner = sch.get_child_blocks(block_init)[0]

        # 8. double buffering: the K loop's body is [A copy, W copy, fragment loads + mma];
        # the copies of tile k + 1 (stage 0, async) run while tile k is multiplied (stage 1)
        if cfg.async_copy_stages >= 2:
            sch.annotate(k0, "software_pipeline_stage", [0, 0, cfg.async_copy_stages - 1])
            sch.annotate(k0, "software_pipeline_order", [0, 1, 2])
            sch.annotate(k0, "software_pipeline_async_stages", [0])

        loop_a = _tile_fragment(sch, a_warp, 16, fk)
        loop_b = _tile_fragment(sch, b_warp, 16, fk)
        if self.tensorize:
            sch.tensorize(loop_a, load_a)
            sch.tensorize(loop_b, load_b)
            sch.tensorize(sch.get_loops(block_inner)[-3], mma)
            sch.tensorize(sch.get_loops(init_inner)[-2], fill)
        return s_tir.Schedule(narrow_indices(sch.mod["main"])) if self.narrow else sch


def _dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}[dtype]


def _accumulator_dtype(in_dtype: str) -> str:
    return "int32" if in_dtype.startswith(("int", "uint")) else "float32"


def _fused_extents(stmt: s_tir.SBlock, matmul_map):
    """Extents of the normalised S, I, J, K axes of a matmul block."""
    doms = [iv.dom.extent for iv in stmt.iter_vars]
    shape = matmul_map.map_shape(doms)
    return tuple(shape)


def _fragment_map(layout, rows: int, cols: int, ndim: int, index_dtype: str):
    """Index map (..., r, c) -> (..., r // rows, c // cols, lane, local) of a warp buffer."""

    def fmap(*idx):
        *outer, r, c = idx
        lane, local = layout(r % rows, c % cols)
        return (*outer, r // rows, c // cols, lane, local)

    return tirx.IndexMap.from_func(fmap, ndim=ndim, index_dtype=index_dtype)


def _tile_fragment(sch, block, rows: int, cols: int):
    """Split a fragment copy into (rows x cols) tiles; returns the loop to tensorize."""
    a, b = sch.get_loops(block)[-2:]
    a0, a1 = sch.split(a, factors=[None, rows])
    b0, b1 = sch.split(b, factors=[None, cols])
    sch.reorder(a0, b0, a1, b1)
    return a1
