"""An 8 x 8 float32 transpose as a tensor intrinsic: 8 vector loads, 24 two-vector shuffles
(the unpack / shufps / 128-bit-lane-permute ladder), 8 vector stores.

TVM scalarizes a vector store with a non-unit stride into one extract and one scalar store
per lane, and LLVM did not turn the unrolled scalar stores of a transposing copy back into
vectors; written as explicit two-operand ``T.Shuffle`` s, each stage is one AVX instruction.
:mod:`.dequant_gemm` uses it to turn the dequantized weight rows (contiguous along k) into the
packed panel (contiguous along the output columns).
"""
from __future__ import annotations

import tvm
from tvm.script import tirx as T

from .common import tensor_intrin

N = 8
INTRIN_NAME = "tvm_llm_transpose_8x8_f32"


def _column(A, j: int, c):
    """Column j of the 8 x 8 block A (as an 8-lane vector), through the shuffle ladder."""
    rows = [A.vload([c(r), c(0)], "float32x8") for r in range(N)]

    def sh(x, y, idx):
        return T.Shuffle([x, y], [c(i) for i in idx])

    lo, hi = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
    # stage 1: interleave row pairs (vunpcklps / vunpckhps)
    t = []
    for p in range(0, N, 2):
        t += [sh(rows[p], rows[p + 1], lo), sh(rows[p], rows[p + 1], hi)]
    # stage 2: pairs of pairs (vshufps): u[4q + 2h + s] holds columns (2h + s) and (2h + s + 4)
    # of rows 4q .. 4q + 3
    even, odd = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    u = []
    for q in range(2):
        for h in range(2):
            a, b = t[4 * q + h], t[4 * q + 2 + h]
            u += [sh(a, b, even), sh(a, b, odd)]
    # stage 3: 128-bit halves (vperm2f128): column j = rows 0-3 then rows 4-7
    m = j % 4
    half = [0, 1, 2, 3, 8, 9, 10, 11] if j < 4 else [4, 5, 6, 7, 12, 13, 14, 15]
    return sh(u[m], u[4 + m], half)


def _intrin(index_dtype: str):
    def c(v):
        return tvm.tirx.IntImm(index_dtype, v)

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle) -> None:
        sa = T.int64() if index_dtype == "int64" else T.int32()
        sb = T.int64() if index_dtype == "int64" else T.int32()
        A = T.match_buffer(a, (c(N), c(N)), "float32", strides=[sa, c(1)], offset_factor=1)
        B = T.match_buffer(b, (c(N), c(N)), "float32", strides=[sb, c(1)], offset_factor=1)
        with T.sblock("root"):
            T.reads(A[c(0):c(N), c(0):c(N)])
            T.writes(B[c(0):c(N), c(0):c(N)])
            for i in T.serial(c(0), c(N)):
                for j in T.serial(c(0), c(N)):
                    with T.sblock("transpose"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        B[vi, vj] = A[vj, vi]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle) -> None:
        sa = T.int64() if index_dtype == "int64" else T.int32()
        sb = T.int64() if index_dtype == "int64" else T.int32()
        A = T.match_buffer(a, (c(N), c(N)), "float32", strides=[sa, c(1)], offset_factor=1)
        B = T.match_buffer(b, (c(N), c(N)), "float32", strides=[sb, c(1)], offset_factor=1)
        with T.sblock("root"):
            T.reads(A[c(0):c(N), c(0):c(N)])
            T.writes(B[c(0):c(N), c(0):c(N)])
            B[c(0), T.ramp(c(0), c(1), N)] = _column(A, 0, c)
            B[c(1), T.ramp(c(0), c(1), N)] = _column(A, 1, c)
            B[c(2), T.ramp(c(0), c(1), N)] = _column(A, 2, c)
            B[c(3), T.ramp(c(0), c(1), N)] = _column(A, 3, c)
            B[c(4), T.ramp(c(0), c(1), N)] = _column(A, 4, c)
            B[c(5), T.ramp(c(0), c(1), N)] = _column(A, 5, c)
            B[c(6), T.ramp(c(0), c(1), N)] = _column(A, 6, c)
            B[c(7), T.ramp(c(0), c(1), N)] = _column(A, 7, c)

    return desc, impl


def intrin_name(index_dtype: str = "int64") -> str:
    """The name of the intrinsic for index_dtype, registered on first use."""
    return tensor_intrin(f"{INTRIN_NAME}_{index_dtype}", lambda: _intrin(index_dtype))
