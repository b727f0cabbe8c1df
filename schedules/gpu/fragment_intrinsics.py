"""What a warp-level tensor-core intrinsic computes (its TensorIntrin description), shared by
the CUDA (ldmatrix + mma.sync) and ROCm (MFMA) intrinsics: a 16-row tile copied into per-lane
registers, the fragment multiply-accumulate C (i, j) += A (i, k) * W (j, k), and the
accumulator fill. Each target passes its register layouts ((row, col) -> (lane, local)) and
buffer declarations; the implementations (the target's instructions) stay in
schedules/cuda/intrinsics.py and schedules/rocm/intrinsics.py.
"""
from __future__ import annotations

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T
from tvm.tirx import Cast


def load_desc(dtype: str, cols: int, lanes: int, per_lane: int, layout, scope: str,
              align: int = -1, offset_factor: int = 1):
    """(16, cols) tile in `scope` memory -> (lanes, per_lane) registers along `layout`."""

    @T.prim_func(s_tir=True)
    def desc(reg_handle: T.handle, mem_handle: T.handle) -> None:
        mem = T.match_buffer(mem_handle, (16, cols), dtype, align=align,
                             offset_factor=offset_factor, scope=scope)
        reg = T.match_buffer(reg_handle, (lanes, per_lane), dtype, align=align,
                             offset_factor=offset_factor, scope="warp")
        with T.sblock("root"):
            T.reads(mem[0:16, 0:cols])
            T.writes(reg[0:lanes, 0:per_lane])
            for ax0, ax1 in T.grid(16, cols):
                with T.sblock("shared_warp"):
                    v0, v1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(mem[v0, v1])
                    lane, local = T.meta_var(layout(v0, v1))
                    T.writes(reg[lane, local])
                    reg[lane, local] = mem[v0, v1]

    return desc


def mma_desc(in_dtype: str, acc_dtype: str, k_dim: int, lanes: int, per_lane: int,
             acc_per_lane: int, layout, acc_layout, align: int = -1, offset_factor: int = 1):
    """C (i, j) += A (i, k) * W (j, k) on 16 x 16 x k_dim register fragments; operands along
    `layout`, the accumulator along `acc_layout`."""

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (lanes, per_lane), in_dtype, align=align,
                           offset_factor=offset_factor, scope="warp")
        B = T.match_buffer(b, (lanes, per_lane), in_dtype, align=align,
                           offset_factor=offset_factor, scope="warp")
        C = T.match_buffer(c, (lanes, acc_per_lane), acc_dtype, align=align,
                           offset_factor=offset_factor, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:lanes, 0:acc_per_lane], A[0:lanes, 0:per_lane], B[0:lanes, 0:per_lane])
            T.writes(C[0:lanes, 0:acc_per_lane])
            for i, j, k in T.grid(16, 16, k_dim):
                with T.sblock("C"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    tc, lc = T.meta_var(acc_layout(vi, vj))
                    ta, la = T.meta_var(layout(vi, vk))
                    tb, lb = T.meta_var(layout(vj, vk))
                    T.reads(C[tc, lc], A[ta, la], B[tb, lb])
                    T.writes(C[tc, lc])
                    C[tc, lc] += Cast(acc_dtype, A[ta, la]) * Cast(acc_dtype, B[tb, lb])

    return desc


def fill_desc(dtype: str, lanes: int, acc_per_lane: int, acc_layout, zero):
    """Every element of a 16x16 accumulator fragment set to `zero`."""

    @T.prim_func(s_tir=True)
    def desc(a: T.handle) -> None:
        C = T.match_buffer(a, (lanes, acc_per_lane), dtype, scope="warp")
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:lanes, 0:acc_per_lane])
            for i0, i1 in T.grid(16, 16):
                with T.sblock("C_warp"):
                    i, j = T.axis.remap("SS", [i0, i1])
                    lane, local = T.meta_var(acc_layout(i, j))
                    T.reads()
                    T.writes(C[lane, local])
                    C[lane, local] = zero

    return desc


def register(name: str, desc, impl) -> None:
    """Register a TensorIntrin once (importing a module twice must not fail)."""
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, desc, impl)
