"""CPU schedule rules (LLVM: x86 AVX2/AVX-512, aarch64 NEON).

Rules, tried in order (the first that claims a PrimFunc schedules it):

* :class:`.moe.MoEGemm`: the grouped expert GEMM of mixture-of-experts layers (weights indexed
  by each row's expert id);
* :class:`.gemm.GEMM`: weight matmuls over a packed weight panel (prefill GEMM and decode GEMV)
  when the build lets the weight change layout (``layout_free_buffers``), and NN matmuls;
* :class:`.dequant_gemm.DequantGEMM` (where the target asks for it: ``dequant_panel``):
  weight-only quantized prefill, each weight panel dequantized once into a float buffer and
  multiplied by the GEMM micro-kernel;
* :class:`.gemv.GEMV`: NT weight matmuls over the row-major (N, K) weight;
* :class:`.reduction.RowReduction`: RMSNorm / LayerNorm / softmax (row reductions + elementwise);
* :class:`.elementwise.Elementwise`: injective kernels (RoPE, adds, casts, transposes, take);
* then dlight's CPU ``GEMV`` and ``Reduction`` as fallbacks.

Int8-activation matmuls are hand-written kernels (:mod:`.int8_act_matmul`), marked scheduled.
"""


def cpu_rules(prepack="auto", dequant_panel: bool = False):
    """The rule list. `dequant_panel`: weight-only quantized prefill through
    :class:`.dequant_gemm.DequantGEMM` (the target's choice: TargetSpec.dequantize_panel_prefill);
    otherwise the GEMV rule takes it with the dequantize inlined."""
    from tvm.s_tir import dlight as dl

    from ..fallbacks import PassingOnFailure
    from .elementwise import Elementwise
    from .gemm import GEMM
    from .gemv import GEMV
    from .moe import MoEGemm
    from .reduction import RowReduction

    from .dequant_gemm import DequantGEMM

    panel = [DequantGEMM()] if dequant_panel else []
    return [MoEGemm(), GEMM(prepack=prepack), *panel, GEMV(), RowReduction(), Elementwise(),
            *map(PassingOnFailure, (dl.cpu.GEMV(), dl.cpu.Reduction()))]


def cpu_schedule_pass(prepack="auto", dequant_panel: bool = False):
    """The TIR scheduling pass for a CPU target: our rules, then dlight's CPU fallbacks.

    Run it inside ``with target:`` (the rules read the target from the context or the
    PrimFunc's "target" attribute: everything is derived from the tvm Target).
    """
    from tvm.s_tir import dlight as dl

    return dl.ApplyDefaultSchedule(*cpu_rules(prepack, dequant_panel))
