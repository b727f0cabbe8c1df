"""Decode GEMV: y (m, N) = x (m, K) @ W (N, K)^T for a handful of rows (decode's batch).

Claims: a fused kernel whose single reduction is an NT matmul (fp16/bf16/fp32 inputs,
batch s = 1, static N and K) with few rows: M static <= `max_rows`, or symbolic with a
declared bound (`tir_var_upper_bound`, see analysis.AnnotateSymbolicBounds) <= `max_rows`.
Decode is bandwidth-bound on W: each weight element is read once, by one thread, with
16-byte vector loads, and used for every row.

Schedule (per thread block: `rows_per_block` output columns n, one per thread row):
  - accumulate in fp32; pad M to `m_tile` rows (symbolic m: zero rows, predicated stores),
    K to a multiple of lanes x vec;
  - threadIdx.x (a warp / wavefront) splits K in vec-element chunks, each thread keeps
    m_tile partial sums in registers (rfactor), a cross-lane reduction finishes the dot
    products; the epilogue runs on the reduced values.
"""
from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.dlight.gpu.matmul import auto_inline_consumers, auto_inline_producers, get_index_map

from .analysis import (find_matmul, narrow_indices, normalize_matmul, schedule_or_none,
                       symbolic_bound, widen_accumulator)


class DecodeGEMV(ScheduleRule):
    def __init__(self, warp_size: int = 32, rows_per_block: int = 4, vector_bytes: int = 16,
                 max_rows: int = 16, narrow: bool = True):
        self.narrow = narrow
        self.warp_size = warp_size
        self.rows_per_block = rows_per_block
        self.vector_bytes = vector_bytes
        self.max_rows = max_rows

    def _analyze(self, func, target):
        if not isinstance(func, tirx.PrimFunc) or "gpu" not in target.keys:
            return None
        if int(target.attrs.get("thread_warp_size", 32)) != self.warp_size:
            return None
        sch = s_tir.Schedule(func)
        mm = find_matmul(sch)
        if mm is None or not mm.k_contiguous or mm.a_dtype != mm.b_dtype:
            return None
        if mm.a_dtype not in ("float16", "bfloat16", "float32"):
            return None
        stmt = sch.get(mm.block)
        doms = [iv.dom.extent for iv in stmt.iter_vars]
        s_ext, m_ext, n_ext, k_ext = get_index_map(stmt)[0].map_shape(doms)
        if not all(isinstance(e, tirx.IntImm) for e in (s_ext, n_ext, k_ext)) or int(s_ext) != 1:
            return None
        rows = symbolic_bound(func, m_ext)
        if rows is None or rows > self.max_rows:
            return None
        if int(k_ext) % self._vec(mm.a_dtype):
            return None   # K must split into whole 16-byte vectors
        return mm, rows

    def _vec(self, dtype: str) -> int:
        return self.vector_bytes // (4 if dtype == "float32" else 2)

    def apply(self, func, target, _tunable):
        found = self._analyze(func, target)
        if found is None:
            return None
        return schedule_or_none(self._schedule, func, *found, name=type(self).__name__)

    def _schedule(self, func, mm, rows):
        func, _ = widen_accumulator(func, mm.name)
        sch = s_tir.Schedule(func)
        main = sch.get_sblock(mm.name)
        lanes, ts = self.warp_size, self.rows_per_block
        vec = self._vec(mm.a_dtype)            # elements per 16-byte load

        # normalise to C[S, I, J] += A[S, I, K] * B[S, J, K]
        normalize_matmul(sch, main)
        sch.pad_einsum(main, [1, rows, ts, lanes * vec])
        operands = [r.source for r in sch.get(main).reads[:2]]   # x (padded), W (maybe padded)

        batch, i, j, k = sch.get_loops(main)
        io, ii = sch.split(i, factors=[None, rows])
        j0, j1 = sch.split(j, factors=[None, ts])
        k0, k1, k2 = sch.split(k, factors=[None, lanes, vec])
        sch.reorder(batch, io, j0, j1, k1, k0, k2, ii)
        partial = sch.rfactor(k1, factor_axis=0)          # per-lane partial sums
        batch, io, j0, j1, k1, k0, k2, ii = sch.get_loops(partial)
        sch.bind(io, "blockIdx.y")
        sch.bind(j0, "blockIdx.x")
        sch.bind(j1, "threadIdx.y")
        sch.bind(k1, "threadIdx.x")
        sch.set_scope(partial, 0, "local")

        # W: one 16-byte vector per thread per step, reused for all rows; the m_tile rows of x
        # the same way (the padded copy: zeros past the last row)
        for buf in operands:
            producer = _producer_of(sch, partial, buf)
            if producer is None:
                index = [r.source.same_as(buf) for r in sch.get(partial).reads].index(True)
                producer = sch.cache_read(partial, index, "local")
            else:
                auto_inline_producers(sch, producer)
                sch.set_scope(producer, 0, "local")
            sch.compute_at(producer, k0)
            sch.vectorize(sch.get_loops(producer)[-1])
        sch.unroll(k2)
        sch.decompose_reduction(partial, k0)

        # cross-lane sum (every lane ends with all m_tile sums), then the epilogue per row
        auto_inline_consumers(sch, main)   # the copies out of the padded result fold away
        epilogue = sch.get_consumers(main)
        sch.reverse_compute_at(main, j1)
        if rows > 1:
            *_, lane, row = sch.get_loops(main)
            sch.reorder(row, lane)             # the reduced loop must be innermost
        else:   # one row: reverse_compute_at makes no loop of extent 1, the lanes' is last
            lane = sch.get_loops(main)[-1]
        sch.bind(lane, "threadIdx.x")
        sch.set_scope(main, 0, "local")
        for block in epilogue:
            sch.reverse_compute_at(block, j1)
        return s_tir.Schedule(narrow_indices(sch.mod["main"])) if self.narrow else sch


def _producer_of(sch, block, buf):
    """The block writing `buf` that `block` reads from, if `buf` is an intermediate."""
    for producer in sch.get_producers(block):
        if any(w.source.same_as(buf) for w in sch.get(producer).writes):
            return producer
    return None
