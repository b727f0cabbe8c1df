"""ROCm schedule rules (CDNA: gfx90a, gfx942): MFMA GEMM with 64x64 wavefront tiles, decode GEMV.

The GEMM is `schedules.gpu.tensor_core.TensorCoreMatmul` with MFMA parameters: 128x128
workgroup tiles of 2x2 wavefronts, each wavefront 64x64 = 4x4 MFMA 16x16 tiles (16
`v_mfma_f32_16x16x16_f16` per 16-wide K step, 32 per 32-wide K tile staged in LDS).
"""
from __future__ import annotations

from schedules.gpu.tensor_core import TensorCoreConfig, TensorCoreMatmul

MFMA_ARCHS = ("gfx90a", "gfx940", "gfx941", "gfx942", "gfx950")
MFMA_K32_I8_ARCHS = ("gfx940", "gfx941", "gfx942", "gfx950")


def _mcpu(target) -> str:
    return str(target.attrs.get("mcpu", ""))


def _bind_store(sch, i, j):
    """MFMA accumulator: lane = j + 16 (i // 4), local = i % 4."""
    i_hi, i_lo = sch.split(i, factors=[4, 4])
    sch.reorder(i_hi, j, i_lo)
    sch.bind(sch.fuse(i_hi, j), "threadIdx.x")


def mfma_config() -> TensorCoreConfig:
    """fp16 GEMM: 128x128 workgroup tile, 2x2 wavefronts of 64x64, K tile 32."""
    from . import intrinsics as I

    return TensorCoreConfig(
        target_kind="rocm", warp_size=64,
        intrinsics={"float16": (I.LOAD_F16, I.LOAD_F16, I.MFMA_F16_NT, I.FILL_F32)},
        layout_a=I.operand_layout, layout_b=I.operand_layout, layout_c=I.accumulator_layout,
        bind_store=_bind_store, shared_scope="shared",
        target_check=lambda target: _mcpu(target) in MFMA_ARCHS)


def mfma_i8_config() -> TensorCoreConfig:
    """int8 x int8 -> int32 GEMM with v_mfma_i32_16x16x32_i8 (gfx940+), K tile 64."""
    from . import intrinsics as I

    return TensorCoreConfig(
        target_kind="rocm", warp_size=64,
        intrinsics={"int8": (I.LOAD_I8_K32, I.LOAD_I8_K32, I.MFMA_I8_K32_NT, I.FILL_I32)},
        layout_a=I.operand_layout_k32, layout_b=I.operand_layout_k32,
        layout_c=I.accumulator_layout, bind_store=_bind_store, shared_scope="shared",
        frag_k=32, k_tile=64, target_check=lambda target: _mcpu(target) in MFMA_K32_I8_ARCHS)


def rocm_rules(tensorize: bool = True, narrow: bool = True) -> list:
    """Our rules, most specific first (tensorize/narrow=False: see tests/gpu_verify.py)."""
    from schedules.gpu.gemv import DecodeGEMV

    return [TensorCoreMatmul(mfma_config(), tensorize=tensorize, narrow=narrow),
            TensorCoreMatmul(mfma_i8_config(), tensorize=tensorize, narrow=narrow),
            DecodeGEMV(warp_size=64, narrow=narrow)]


def rocm_schedule_passes() -> list:
    """Bounds annotation, then our rules and dlight's GPU fallbacks in one pass."""
    from schedules.gpu import gpu_schedule_passes

    return gpu_schedule_passes(rocm_rules())
