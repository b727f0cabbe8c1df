"""LLVM CPU targets: the host (with its real vector features) or a cross triple (aarch64)."""
from __future__ import annotations

import os

from . import register_target
from .base import TargetSpec
from ..errors import UserError

CROSS_TRIPLES = {"aarch64": "aarch64-linux-gnu", "x86_64": "x86_64-linux-gnu"}
# x86 CPU levels a build can target instead of the host's own CPU (code that runs on this
# host too): x86-64-v3 = AVX2 + FMA without AVX-512 or VNNI, x86-64-v4 = AVX-512 without VNNI
X86_LEVELS = ("x86-64-v3", "x86-64-v4", "haswell", "skylake-avx512")


def host_cpu_name() -> str:
    """LLVM's name for this CPU (e.g. znver4, sapphirerapids). TVM's "native" falls back to
    generic SSE code, so the build always names the CPU explicitly."""
    import tvm

    return str(tvm.target.codegen.llvm_get_system_cpu())


def default_num_threads() -> int:
    env = os.environ.get("TVM_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@register_target("llvm")
class LLVMTarget(TargetSpec):
    name = "llvm"
    default_dtype = "float32"
    device_type = "cpu"
    page_sizes = (8, 16, 32, 64, 128)  # schedules/cpu/attention.py PAGE_SIZES

    def __init__(self, arch: str | None = None, **options):
        super().__init__(arch=arch, **options)
        if arch not in (None, "native", "host") and arch not in CROSS_TRIPLES and arch not in X86_LEVELS:
            raise UserError(f"unknown --arch {arch!r} for llvm: use host (default) or one of "
                            f"{', '.join(CROSS_TRIPLES)}, {', '.join(X86_LEVELS)}")
        self.cross = arch in CROSS_TRIPLES and not arch.startswith(os.uname().machine)

    def tvm_target(self):
        import tvm

        if self.cross and self.arch == "aarch64":
            return tvm.target.Target({"kind": "llvm", "mtriple": CROSS_TRIPLES["aarch64"],
                                      "mattr": ["+neon"], "num-cores": default_num_threads()})
        cpu = self.arch if self.arch in X86_LEVELS else host_cpu_name()
        return tvm.target.Target({"kind": "llvm", "mtriple": f"{os.uname().machine}-linux-gnu",
                                  "mcpu": cpu, "num-cores": default_num_threads()})

    def vector_isa(self) -> str:
        """The widest SIMD the target has: avx512, avx2, neon or sse."""
        import tvm

        t = self.tvm_target()
        if "aarch64" in str(t.attrs.get("mtriple", "")):
            return "neon"
        for isa, feat in (("avx512", "avx512f"), ("avx2", "avx2")):
            if tvm.target.codegen.llvm_cpu_has_features(feat, t):
                return isa
        return "sse"

    def supports_int8_dot(self) -> bool:
        """AVX-512 VNNI (vpdpbusd), which the int8-activation kernels (schedules/cpu/int8_act_matmul.py) use."""
        import tvm

        t = self.tvm_target()
        return "aarch64" not in str(t.attrs.get("mtriple", "")) and bool(
            tvm.target.codegen.llvm_cpu_has_features("avx512vnni", t))

    def hw_key(self) -> str:
        arch = "aarch64" if self.cross and self.arch == "aarch64" else os.uname().machine
        return f"cpu-{arch}-{self.vector_isa()}"

    def schedule_passes(self) -> list:
        """Our CPU rules over row-major weights. (The GEMM rule can also use weights packed at
        build time — schedules/cpu/prepack.py — but TVM's SplitLayoutRewritePreproc fails on
        one of the imported model's kernels, so the build does not enable packing yet.)"""
        from schedules.cpu import cpu_schedule_pass

        return [cpu_schedule_pass(self)]

    def export_library(self, executable, path: str, workspace_dir: str | None = None) -> None:
        if self.cross:
            from .cross import cross_compiler

            executable.export_library(path, fcompile=cross_compiler(self.arch),
                                      workspace_dir=workspace_dir)
        else:
            executable.export_library(path, workspace_dir=workspace_dir)

    def emit_source(self, executable, out_dir: str) -> list[str]:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "host.s")
        with open(path, "w") as f:
            f.write(executable.mod.inspect_source("asm"))
        return [path]
