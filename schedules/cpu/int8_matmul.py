"""W8A8 rule: int8 x int8 -> int32 weight matmuls on AVX-512 VNNI (vpdpbusd).

Claims
    PrimFuncs built from tvm_llm/quantization/kernels.int8_matmul: a reduction block
    ``int8_NT_matmul`` (uint8 activations x int8 weights stored in (N/16, K/4, 16, 4) tiles,
    int32 accumulation) followed by its float rescale and any fused injective epilogue
    (residual add, SiLU x up, ...). Decode (x: (b, 1, K)) and prefill (x: (1, n, K)).

Why the schedule is shaped so
    * One vpdpbusd multiplies 4 activation bytes (broadcast) with a 64-byte weight tile and
      adds 16 int32 lanes: the weight layout was chosen at build time so each tile is one
      aligned zmm load, streamed in order.
    * Parallel over tiles of 16 output rows; per row of x, the K loop accumulates into a
      16-lane register tile, then the rescale and the epilogue run on those 16 outputs.
    * The tile is tensorized with our VNNI intrinsic (TVM's own passes LLVM 22 the wrong
      operand types).
"""
from __future__ import annotations

from tvm import tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.script import tirx as T
from tvm.target import Target

from . import common

MAIN = "int8_NT_matmul"
VNNI_INTRIN = "tvm_llm_dot_16x4_u8i8i32_vnni"


# TVM's own dot_16x4_vnni passes <16 x i32> operands; LLVM 22's vpdpbusd.512 takes <64 x i8>
# (the module fails verification), so this is the same tile with the new signature.
@T.prim_func(s_tir=True)
def _dot_16x4_desc(A: T.Buffer((4,), "uint8", offset_factor=1),
                   B: T.Buffer((16, 4), "int8", offset_factor=1),
                   C: T.Buffer((16,), "int32", offset_factor=1)) -> None:
    with T.sblock("root"):
        T.reads(C[0:16], A[0:4], B[0:16, 0:4])
        T.writes(C[0:16])
        for i in T.serial(0, 16):
            for k in T.serial(0, 4):
                with T.sblock("update"):
                    vi, vk = T.axis.remap("SR", [i, k])
                    C[vi] = C[vi] + T.cast(A[vk], "int32") * T.cast(B[vi, vk], "int32")


@T.prim_func(s_tir=True)
def _dot_16x4_vnni(A: T.Buffer((4,), "uint8", offset_factor=1),
                   B: T.Buffer((16, 4), "int8", offset_factor=1),
                   C: T.Buffer((16,), "int32", offset_factor=1)) -> None:
    with T.sblock("root"):
        T.reads(C[0:16], A[0:4], B[0:16, 0:4])
        T.writes(C[0:16])
        a_i32 = T.reinterpret(A.vload([0], "uint8x4"), dtype="int32")
        a_u8x64 = T.reinterpret(T.broadcast(a_i32, 16), dtype="uint8x64")
        C[T.ramp(T.int32(0), 1, 16)] = T.call_llvm_pure_intrin(
            "int32x16", "llvm.x86.avx512.vpdpbusd.512", C.vload([0], dtype="int32x16"),
            a_u8x64, B.vload([0, 0], dtype="int8x64"))


def _register():
    from tvm.s_tir import TensorIntrin

    try:
        TensorIntrin.get(VNNI_INTRIN)
    except Exception:  # pylint: disable=broad-except
        TensorIntrin.register(VNNI_INTRIN, _dot_16x4_desc, _dot_16x4_vnni)


_register()


def _find(sch, prefix):
    for b in common.root_blocks(sch):
        if common.block_name(sch, b).startswith(prefix):
            return b
    return None


class Int8Matmul(ScheduleRule):
    """vpdpbusd tiles for the W8A8 matmul, and the per-token activation quantization."""

    def is_target_available(self, target: Target) -> bool:
        return common.is_llvm_cpu(target) and common._has("avx512vnni", target)

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            from tvm import s_tir

            sch = s_tir.Schedule(func)
            if _find(sch, "act_absmax") is not None:
                return schedule_activation_quantize(sch, target)
            if _find(sch, MAIN) is None:
                return None
            return schedule_int8_matmul(sch)
        except Exception:  # pylint: disable=broad-except
            return None


def schedule_int8_matmul(sch):
    main = _find(sch, MAIN)
    # Inline every epilogue block but the last into its consumer.
    for _ in range(8):
        rest = [b for b in common.root_blocks(sch) if not common.block_name(sch, b).startswith(MAIN)]
        inner = [b for b in rest if sch.get_consumers(b)]
        if not inner:
            break
        sch.compute_inline(inner[0])
    rest = [b for b in common.root_blocks(sch) if not common.block_name(sch, b).startswith(MAIN)]
    if len(rest) != 1:
        raise ValueError("unexpected blocks")
    epi = rest[0]
    loops = sch.get_loops(main)
    *m_loops, n_loop, k_loop = loops
    m = sch.fuse(*m_loops) if len(m_loops) > 1 else m_loops[0]
    no, ni = sch.split(n_loop, [None, 16])
    ko, ki = sch.split(k_loop, [None, 4])
    sch.reorder(no, m, ko, ni, ki)
    sch.parallel(no)
    sch.set_scope(main, 0, "global")
    sch.reverse_compute_at(epi, m)
    n_axes = len(m_loops) + 1

    def tile(*idx):  # the int32 accumulator lives per (row tile, row of x): 16 lanes
        return (idx[n_axes - 1] % 16,)

    sch.transform_layout(main, ("write", 0), tile, assume_injective_transform=True)
    init = sch.decompose_reduction(main, ko)
    sch.vectorize(sch.get_loops(init)[-1])
    update = sch.get_sblock(MAIN + "_update") if _has_block(sch, MAIN + "_update") else main
    sch.tensorize(sch.get_loops(update)[-2], VNNI_INTRIN)
    common.vectorize_innermost(sch, epi, 16)
    return sch


def schedule_activation_quantize(sch, target):
    """Rows in parallel; the abs-max in vector lanes (rfactor), the rounding vectorized."""
    lanes = common.vector_lanes(target)
    amax = _find(sch, "act_absmax")
    scale = _find(sch, "act_scale")
    quant = _find(sch, "act_quantize")
    *rows, k = sch.get_loops(amax)
    K = common.loop_extent(sch, k)
    if K is not None and K % lanes == 0:
        ko, ki = sch.split(k, [None, lanes])
        rf = sch.rfactor(ki, factor_axis=len(rows))
        sch.vectorize(sch.get_loops(rf)[-1])
    for blk in (scale, quant):
        loops = sch.get_loops(blk)
        if len(loops) > 1:
            sch.parallel(sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0])
    common.vectorize_innermost(sch, quant, lanes)
    return sch


def _has_block(sch, name) -> bool:
    try:
        sch.get_sblock(name)
        return True
    except Exception:  # pylint: disable=broad-except
        return False
