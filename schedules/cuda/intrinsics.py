"""The CUDA tensor-core intrinsics our matmul rule tensorizes with: ldmatrix + mma.sync m16n8k16.

Registered under our own names on import. They follow TVM's `tensor_intrin.cuda` definitions
(same register layouts, same `ptx_legacy.ldmatrix` / `ptx_legacy.mma` builtins) but only the
four the NT fp16 GEMM needs: importing all of `tvm.s_tir.tensor_intrin` parses hundreds of
intrinsics and takes 30-50 s, which every CUDA build would pay.

Register layout of a 16x16 fp16 fragment in a warp (32 lanes x 8 values), for A (i, k), for
B stored as W (n, k) and for the fp32 accumulator (i, j): `ldmatrix_layout`.
"""
from __future__ import annotations

from tvm.runtime import convert
from tvm.script import tirx as T
from tvm.tirx import IntImm

from ..gpu import fragment_intrinsics as fragments

WARP = 32
FRAG = 16            # 16x16 fragments
LOCAL = FRAG * FRAG // WARP   # 8 values per lane

LDMATRIX_A = "tvm_llm.cuda.ldmatrix_a_f16"
LDMATRIX_B_NT = "tvm_llm.cuda.ldmatrix_b_nt_f16"
MMA_NT_F32 = "tvm_llm.cuda.mma_m16n8k16_f16f16f32_nt"
FILL_F32 = "tvm_llm.cuda.mma_fill_16x16_f32"


def ldmatrix_layout(i, j):
    """(row, col) of a 16x16 fragment -> (lane, local index) in mma.sync's register layout."""
    return 4 * (i % 8) + (j % 8) // 2, 4 * (j // 8) + (i // 8) * 2 + (j % 2)


def _ldmatrix(dtype: str, smem_offset, transpose_in_ldmatrix: bool):
    """Shared (16, 16) tile -> warp fragment; the tile's rows are i (A) or n (B as W[n, k])."""

    desc = fragments.load_desc(dtype, FRAG, WARP, LOCAL, ldmatrix_layout, "shared.dyn",
                               align=64, offset_factor=FRAG)

    @T.prim_func(s_tir=True)
    def impl(warp_handle: T.handle, shared_handle: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        shared = T.match_buffer(shared_handle, (FRAG, FRAG), dtype, align=64, offset_factor=FRAG,
                                scope="shared.dyn", strides=[s0, s1])
        warp = T.match_buffer(warp_handle, (WARP, LOCAL), dtype, align=64, offset_factor=FRAG,
                              scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:FRAG, 0:FRAG])
            T.writes(warp[0:WARP, 0:LOCAL])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(T.ptx_legacy.ldmatrix(
                    transpose_in_ldmatrix, 4, ".b16", warp.data,
                    warp.elem_offset + convert(LOCAL) * tx, shared.access_ptr("r"),
                    smem_offset(tx, s0), dtype=dtype))

    return desc, impl


def _a_offset(tx, stride):
    # lanes 0-15 give the row addresses of the left 8 columns, lanes 16-31 of the right 8
    return stride * (tx % 16) + 8 * (tx // 16)


def _b_nt_offset(tx, stride):
    # W[n, k] tile: lanes 0-7 rows 0-7 cols 0-7, 8-15 rows 0-7 cols 8-15, 16-31 rows 8-15
    return stride * 8 * (tx // 16) + stride * (tx % 8) + 8 * ((tx % 16) // 8)


def _mma_nt(in_dtype: str, out_dtype: str):
    """C (i, j) += A (i, k) * W (j, k) on 16x16x16 fragments: two mma.sync m16n8k16."""
    abbrv = {"float16": "fp16", "float32": "fp32"}

    desc = fragments.mma_desc(in_dtype, out_dtype, FRAG, WARP, LOCAL, LOCAL, ldmatrix_layout,
                              ldmatrix_layout, align=64, offset_factor=FRAG)

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, LOCAL), in_dtype, align=64, offset_factor=FRAG, scope="warp")
        B = T.match_buffer(b, (WARP, LOCAL), in_dtype, align=64, offset_factor=FRAG, scope="warp")
        C = T.match_buffer(c, (WARP, LOCAL), out_dtype, align=64, offset_factor=FRAG, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:LOCAL], A[0:WARP, 0:LOCAL], B[0:WARP, 0:LOCAL])
            T.writes(C[0:WARP, 0:LOCAL])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for half in T.unroll(2):   # columns 0-7, then 8-15 of the fragment
                    T.evaluate(T.ptx_legacy.mma(
                        "m16n8k16", "row", "col", abbrv[in_dtype], abbrv[in_dtype],
                        abbrv[out_dtype], A.data, A.elem_offset + tx * LOCAL,
                        B.data, B.elem_offset + tx * LOCAL + half * (LOCAL // 2),
                        C.data, C.elem_offset + tx * LOCAL + half * (LOCAL // 2),
                        False, dtype=out_dtype))

    return desc, impl


def _fill(dtype: str):
    zero = IntImm("int32", 0).astype(dtype)

    desc = fragments.fill_desc(dtype, WARP, LOCAL, ldmatrix_layout, zero)

    @T.prim_func(s_tir=True)
    def impl(a: T.handle) -> None:
        C = T.match_buffer(a, (WARP, LOCAL), dtype, scope="warp", offset_factor=1)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:LOCAL])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(T.cuda.mma_fill_legacy(LOCAL, C.data, C.elem_offset, dtype=dtype))

    return desc, impl


fragments.register(LDMATRIX_A, *_ldmatrix("float16", _a_offset, transpose_in_ldmatrix=False))
fragments.register(LDMATRIX_B_NT, *_ldmatrix("float16", _b_nt_offset, transpose_in_ldmatrix=False))
fragments.register(MMA_NT_F32, *_mma_nt("float16", "float32"))
fragments.register(FILL_F32, *_fill("float32"))
