"""CUDA schedule rules (sm_80+): tensor-core GEMM (ldmatrix + mma.sync) and decode GEMV.

`cuda_rules()` are tried in order before dlight's generic GPU rules; `cuda_schedule_passes`
is what CUDATarget.schedule_passes returns. The GEMM machinery, the kernel analysis and the
GEMV rule are target-neutral (schedules/gpu/); here are the mma.sync intrinsics and parameters.
"""
from __future__ import annotations

from schedules.gpu.tensor_core import TensorCoreConfig, TensorCoreMatmul


def _bind_store(sch, i, j):
    """Accumulator of mma.sync m16n8k16: lane = 4 (i % 8) + (j % 8) // 2,
    local = 4 (j // 8) + 2 (i // 8) + j % 2: loop over lanes (bound) and locals."""
    i_hi, i_lo = sch.split(i, factors=[2, 8])
    j_hi, j_mid, j_lo = sch.split(j, factors=[2, 4, 2])
    sch.reorder(i_lo, j_mid, j_hi, i_hi, j_lo)
    sch.bind(sch.fuse(i_lo, j_mid), "threadIdx.x")


def mma_config() -> TensorCoreConfig:
    """128x128 block tile, 2x2 warps of 64x64 (4x4 fragments of 16x16), K tile 32, the A and
    W tiles double-buffered in shared memory and filled by cp.async (needs the PassContext
    option tirx.use_async_copy, CUDATarget.pass_context_config)."""
    from . import intrinsics as I

    return TensorCoreConfig(
        target_kind="cuda", warp_size=32,
        intrinsics={"float16": (I.LDMATRIX_A, I.LDMATRIX_B_NT, I.MMA_NT_F32, I.FILL_F32)},
        layout_a=I.ldmatrix_layout, layout_b=I.ldmatrix_layout, layout_c=I.ldmatrix_layout,
        bind_store=_bind_store, shared_scope="shared.dyn", async_copy_stages=2,
        target_check=lambda target: _sm(target) >= 80)


def _sm(target) -> int:
    arch = str(target.attrs.get("arch", ""))
    digits = "".join(ch for ch in arch.replace("sm_", "") if ch.isdigit())
    return int(digits) if digits else 0


def cuda_rules(tensorize: bool = True, narrow: bool = True) -> list:
    """Our rules, most specific first. tensorize=False / narrow=False: the variants the CPU
    checks run (tests/gpu_verify.py)."""
    from schedules.gpu.gemv import DecodeGEMV

    return [TensorCoreMatmul(mma_config(), tensorize=tensorize, narrow=narrow),
            DecodeGEMV(warp_size=32, narrow=narrow)]


def cuda_schedule_passes() -> list:
    """Bounds annotation, then our rules and dlight's GPU fallbacks in one pass."""
    from schedules.gpu import gpu_schedule_passes

    return gpu_schedule_passes(cuda_rules())
