"""CUDA schedule rules (sm_80+): tensor-core GEMM (ldmatrix + mma.sync) and decode GEMV.

`cuda_rules()` are tried in order before dlight's generic GPU rules; `cuda_schedule_passes`
is what CUDATarget.schedule_passes returns. The GEMM machinery (`tensor_core.py`), the
kernel analysis (`analysis.py`) and the GEMV rule (`gemv.py`) are target-neutral; the ROCm
rules reuse them with MFMA parameters.
"""
from __future__ import annotations

from .analysis import AnnotateSymbolicBounds
from .tensor_core import TensorCoreConfig, TensorCoreMatmul


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
    checks run (schedules.cuda.verify)."""
    from .gemv import DecodeGEMV

    return [TensorCoreMatmul(mma_config(), tensorize=tensorize, narrow=narrow),
            DecodeGEMV(warp_size=32, narrow=narrow)]


def cuda_schedule_passes(target_spec=None) -> list:
    """Bounds annotation, then our rules and dlight's GPU fallbacks in one pass: every kernel
    ends up bound to threads."""
    from tvm.s_tir import dlight as dl

    return [AnnotateSymbolicBounds(),
            dl.ApplyDefaultSchedule(*cuda_rules(), dl.gpu.Matmul(), dl.gpu.GEMV(),
                                    dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
                                    dl.gpu.Fallback())]


def tensor_core_tir_pipeline() -> str:
    """Name of the TIR pipeline for GPU builds with warp-fragment schedules: TVM's s_tir
    pipeline with LowerWarpMemory run three times on the device side (it lowers one "warp"
    allocation per scope per run: accumulator, A and W fragments)."""
    import tvm
    from tvm.s_tir.pipeline import default_s_tir_pipeline
    from tvm.tirx.compilation_pipeline import register_tir_pipeline

    name = "tvm_llm_warp_fragments"

    def pipeline():
        passes, finalize_host, _ = default_s_tir_pipeline()

        def finalize_device():
            T = tvm.tirx.transform
            return tvm.transform.Sequential([T.LowerWarpMemory()] * 3 +
                                            [T.StmtSimplify(), T.LowerIntrin()])

        return passes, finalize_host, finalize_device

    register_tir_pipeline(name, pipeline)
    return name
