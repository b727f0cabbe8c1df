"""MFMA intrinsics (CDNA2 gfx90a, CDNA3 gfx942) for our NT GEMM rule, registered on import.

fp16 and int8 only: a bf16 variant (mfma.f32.16x16x16bf16.1k on <4 x i16>) is not here yet:
TVM's BF16 legalization widens the bf16 fragments to fp32 before the operands are reinterpreted.

TVM's `tensor_intrin.rocm` describes B as (K, N) and reads A one element at a time; ours take
both operands as (rows, K) tiles, x (i, k) and W (n, k), and load each lane's K run with one
vector read. Layouts (lane in 0..63, local register index):

- 16x16x16 f16 operands: row r, k -> lane r + 16 (k // 4), local k % 4
- 16x16x32 i8 operands (gfx940+): row r, k -> lane r + 16 (k // 8), local k % 8
- 16x16 accumulator (f32 or i32): i, j -> lane j + 16 (i // 4), local i % 4

`v_mfma_i32_16x16x32_i8` exists from gfx940 on (TVM's 16x16x16 i8 form is gone there and
LLVM aborts selecting it).
"""
from __future__ import annotations

from tvm.script import tirx as T
from tvm.tirx import IntImm

from ..gpu import fragment_intrinsics as fragments

WAVE = 64

LOAD_F16 = "tvm_llm.rocm.mfma_load_16x16_f16"
MFMA_F16_NT = "tvm_llm.rocm.mfma_f32_16x16x16_f16_nt"
FILL_F32 = "tvm_llm.rocm.mfma_fill_16x16_f32"
LOAD_I8_K32 = "tvm_llm.rocm.mfma_load_16x32_i8"
MFMA_I8_K32_NT = "tvm_llm.rocm.mfma_i32_16x16x32_i8_nt"
FILL_I32 = "tvm_llm.rocm.mfma_fill_16x16_i32"


def operand_layout(r, k):
    """16x16 f16 operand tile (row, k) -> (lane, local)."""
    return r + 16 * (k // 4), k % 4


def operand_layout_k32(r, k):
    """16x32 int8 operand tile (row, k) -> (lane, local)."""
    return r + 16 * (k // 8), k % 8


def accumulator_layout(i, j):
    """16x16 accumulator (i, j) -> (lane, local)."""
    return j + 16 * (i // 4), i % 4


def _load(dtype: str, k_dim: int, layout):
    per_lane = 16 * k_dim // WAVE

    desc = fragments.load_desc(dtype, k_dim, WAVE, per_lane, layout, "shared")

    @T.prim_func(s_tir=True)
    def impl(reg_handle: T.handle, mem_handle: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        mem = T.match_buffer(mem_handle, (16, k_dim), dtype, align=64, offset_factor=1,
                             scope="shared", strides=[s0, s1])
        reg = T.match_buffer(reg_handle, (WAVE, per_lane), dtype, align=64, offset_factor=1,
                             scope="warp")
        with T.sblock("root"):
            T.reads(mem[0:16, 0:k_dim])
            T.writes(reg[0:WAVE, 0:per_lane])
            tx = T.env_thread("threadIdx.x")
            T.launch_thread(tx, WAVE)
            # each lane reads its contiguous run of K (LLVM merges these into one ds_read)
            for local in T.unroll(per_lane):
                reg[tx, local] = mem[tx % 16, (tx // 16) * per_lane + local]

    return desc, impl


def _mfma(in_dtype: str, acc_dtype: str, k_dim: int, layout, llvm_name: str, arg_dtype):
    per_lane = 16 * k_dim // WAVE

    desc = fragments.mma_desc(in_dtype, acc_dtype, k_dim, WAVE, per_lane, 4, layout,
                              accumulator_layout)

    def operand(buf, tx):
        vec = buf[tx, T.ramp(0, 1, per_lane)]
        return vec if arg_dtype is None else T.call_intrin(arg_dtype, "tirx.reinterpret", vec)

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WAVE, per_lane), in_dtype, offset_factor=1, scope="warp")
        B = T.match_buffer(b, (WAVE, per_lane), in_dtype, offset_factor=1, scope="warp")
        C = T.match_buffer(c, (WAVE, 4), acc_dtype, offset_factor=1, scope="warp")
        with T.sblock("root"):
            T.reads(A[0:WAVE, 0:per_lane], B[0:WAVE, 0:per_lane], C[0:WAVE, 0:4])
            T.writes(C[0:WAVE, 0:4])
            tx = T.env_thread("threadIdx.x")
            T.launch_thread(tx, WAVE)
            C[tx, T.ramp(0, 1, 4)] = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id(llvm_name), operand(A, tx), operand(B, tx),
                C[tx, T.ramp(0, 1, 4)],
                T.int32(0), T.int32(0), T.int32(0), dtype=f"{acc_dtype}x4")

    return desc, impl


def _fill(dtype: str):
    zero = IntImm("int32", 0).astype(dtype)

    desc = fragments.fill_desc(dtype, WAVE, 4, accumulator_layout, zero)

    @T.prim_func(s_tir=True)
    def impl(a: T.handle) -> None:
        C = T.match_buffer(a, (WAVE, 4), dtype, scope="warp", offset_factor=1)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WAVE, 0:4])
            tx = T.env_thread("threadIdx.x")
            T.launch_thread(tx, WAVE)
            for local in range(4):
                C[tx, local] = zero

    return desc, impl


fragments.register(LOAD_F16, *_load("float16", 16, operand_layout))
fragments.register(MFMA_F16_NT, *_mfma("float16", "float32", 16, operand_layout,
                             "llvm.amdgcn.mfma.f32.16x16x16f16", None))
fragments.register(FILL_F32, *_fill("float32"))
fragments.register(LOAD_I8_K32, *_load("int8", 32, operand_layout_k32))
fragments.register(MFMA_I8_K32_NT, *_mfma("int8", "int32", 32, operand_layout_k32,
                                "llvm.amdgcn.mfma.i32.16x16x32.i8", "int64"))
fragments.register(FILL_I32, *_fill("int32"))
