"""What the CUDA and ROCm rules share: the kernel analysis (`analysis.py`), the tensor-core
GEMM parameterised per target (`tensor_core.py`: mma.sync or MFMA), the decode GEMV
(`gemv.py`), the GPU scheduling passes and the TIR pipeline for warp-fragment schedules.
schedules/cuda and schedules/rocm hold only their intrinsics and configurations.
"""
from __future__ import annotations


def gpu_schedule_passes(rules: list) -> list:
    """Bounds annotation, then `rules` (ours, most specific first) and dlight's GPU
    fallbacks in one pass: every kernel ends up bound to threads."""
    from tvm.s_tir import dlight as dl

    from ..fallbacks import PassingOnFailure
    from .analysis import AnnotateSymbolicBounds

    fallbacks = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction()]
    return [AnnotateSymbolicBounds(),
            dl.ApplyDefaultSchedule(*rules, *map(PassingOnFailure, fallbacks),
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
