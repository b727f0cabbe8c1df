"""CPU schedule rules (LLVM: x86 AVX2/AVX-512, aarch64 NEON).

Rules, tried in order (the first that claims a PrimFunc schedules it):

* :class:`.gemm.GEMM`: weight matmuls over a packed weight panel (prefill GEMM and decode GEMV)
  when the build lets the weight change layout (``layout_free_buffers``), and NN matmuls;
* :class:`.moe.MoEGemm`: the grouped expert GEMM of mixture-of-experts layers (weights indexed
  by each row's expert id);
* :class:`.gemv.GEMV`: NT weight matmuls over the row-major (N, K) weight;
* :class:`.reduction.RowReduction`: RMSNorm / LayerNorm / softmax (row reductions + elementwise);
* :class:`.elementwise.Elementwise`: injective kernels (RoPE, adds, casts, transposes, take);
* then dlight's CPU ``GEMV`` and ``Reduction`` as fallbacks.

Int8-activation matmuls are hand-written kernels (:mod:`.int8_act_matmul`), marked scheduled.
"""


def cpu_rules(prepack="auto"):
    from tvm.s_tir import dlight as dl

    from .elementwise import Elementwise
    from .gemm import GEMM
    from .gemv import GEMV
    from .moe import MoEGemm
    from .reduction import RowReduction

    return [MoEGemm(), GEMM(prepack=prepack), GEMV(), RowReduction(), Elementwise(),
            dl.cpu.GEMV(), dl.cpu.Reduction()]


def cpu_schedule_pass(prepack="auto"):
    """The TIR scheduling pass for a CPU target: our rules, then dlight's CPU fallbacks.

    Run it inside ``with target:`` (the rules read the target from the context or the
    PrimFunc's "target" attribute: everything is derived from the tvm Target).
    """
    from tvm.s_tir import dlight as dl

    return dl.ApplyDefaultSchedule(*cpu_rules(prepack))
