"""CPU schedule rules (LLVM: x86 AVX2/AVX-512, aarch64 NEON)."""


def cpu_schedule_pass(target_spec):
    """The TIR scheduling pass for a CPU target: our rules, then dlight's CPU fallbacks."""
    from tvm.s_tir import dlight as dl

    return dl.ApplyDefaultSchedule(dl.cpu.GEMV(), dl.cpu.Reduction())
