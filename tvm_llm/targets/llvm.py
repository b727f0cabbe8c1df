"""LLVM CPU targets: the host (with its real vector features), another CPU model (its LLVM
name, e.g. ``--arch sapphirerapids``: code for that CPU, built here, run there) or a cross
triple (aarch64, optionally ``aarch64:neoverse-v1``)."""
from __future__ import annotations

import functools
import os

from .registry import register_target
from .base import TargetSpec
from ..errors import UserError
from ..runtime.cpu_probe import (AMX_FLAGS, HOST_FLAG_FEATURES, host_cpu_flags,  # noqa: F401
                                 host_cpu_name, host_feature_attrs, host_target,
                                 request_amx_permission)

CROSS_TRIPLES = {"aarch64": "aarch64-linux-gnu", "x86_64": "x86_64-linux-gnu"}


def default_num_threads() -> int:
    env = os.environ.get("TVM_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def parse_arch(arch: str | None) -> tuple[str, str | None]:
    """(instruction-set architecture, LLVM CPU name or None for the host's / generic) of an
    --arch value: host (default), x86_64, aarch64, a CPU name (x86_64 implied unless LLVM only
    knows it for aarch64), or ARCH:CPU."""
    import tvm

    host = os.uname().machine
    if arch in (None, "", "native", "host"):
        return host, None
    isa, _, cpu = arch.partition(":")
    if isa in CROSS_TRIPLES:
        if not cpu:
            return isa, None
    elif not cpu:
        isa, cpu = None, arch
    else:
        isa = None
    candidates = [isa] if isa else [host] + [a for a in CROSS_TRIPLES if a != host]
    for cand in candidates:
        if cand in CROSS_TRIPLES and tvm.target.codegen.llvm_is_valid_cpu(cpu, CROSS_TRIPLES[cand]):
            return cand, cpu
    raise UserError(f"unknown --arch {arch!r} for llvm: use host (default), "
                    f"{', '.join(CROSS_TRIPLES)}, an LLVM CPU name (znver4, sapphirerapids, "
                    "skylake-avx512, haswell, ...) or ARCH:CPU (aarch64:neoverse-v1)")


def amx_status(target) -> dict:
    """AMX-BF16 availability for a build: the target CPU's LLVM feature (with it, bfloat16
    prefill matmuls run on AMX tiles: schedules/cpu/amx_prefill.py), and for the host the
    kernel's CPU flag and the permission request."""
    from schedules.cpu.common import has_feature

    status = {"llvm_feature": has_feature("amx-bf16", target)}
    if str(target.attrs.get("mcpu", "")) == host_cpu_name():
        status["cpu_flag"] = "amx_bf16" in host_cpu_flags()
        status["os_permission"] = request_amx_permission()[1]
    status["usable"] = bool(status["llvm_feature"] and status.get("cpu_flag")
                            and status.get("os_permission") == "granted")
    return status


def llvm_hw_key(target) -> str:
    """The tuning-log key of an llvm tvm Target: cpu-<arch>-<LLVM CPU name>-<widest SIMD>, e.g.
    cpu-x86_64-znver4-avx512, cpu-x86_64-sapphirerapids-avx512, cpu-aarch64-generic-neon.
    The CPU model is part of it because two CPUs with the same ISA differ in what a good
    schedule is (znver4 runs AVX-512 as 2x256-bit, sapphirerapids has two 512-bit FMA ports)."""
    from schedules.cpu.common import vector_isa

    triple = str(target.attrs.get("mtriple", "") or "")
    arch = triple.split("-")[0] if triple else os.uname().machine
    if arch == "arm64":
        arch = "aarch64"
    cpu = str(target.attrs.get("mcpu", "") or "") or "generic"
    if "+amx-tile" in [str(a) for a in target.attrs.get("mattr", []) or []]:
        cpu += "+amx"  # a masked model (an AMX Xeon named rocketlake): not that CPU's logs
    isa = "neon" if arch == "aarch64" else vector_isa(target)
    return f"cpu-{arch}-{cpu}-{'sse' if isa == 'generic' else isa}"


@functools.lru_cache(maxsize=None)
def _int8_act_template(fmt: str, K: int, out_dtype: str, act_bits: int, dot: str, prefetch: str,
                       burst: int | None):
    """The int8-activation kernel of one (format, K) with its N symbolic, made once per process:
    it is written in TVMScript, and parsing it took ~1-3 s per kernel (most of a q4 build's
    passes), while a model has only a few distinct K. PrimFuncs are immutable: sharing is safe."""
    from schedules.cpu.int8_act_matmul import int8_act_matmul_func

    from ..quantization.formats import get_format

    kw = {} if burst is None else {"decode_burst_lines": burst}
    return int8_act_matmul_func(get_format(fmt), K, None, out_dtype, act_bits, dot,
                                decode_prefetch=prefetch, **kw)


@functools.lru_cache(maxsize=None)
def _int8_act_kernel(fmt: str, K: int, N: int, out_dtype: str, act_bits: int, dot: str,
                     prefetch: str, burst: int | None):
    """The template specialized to N (milliseconds)."""
    from schedules.cpu.int8_act_matmul import specialize_n

    from ..quantization.formats import get_format

    return specialize_n(_int8_act_template(fmt, K, out_dtype, act_bits, dot, prefetch, burst),
                        get_format(fmt), K, N)


@register_target("llvm")
class LLVMTarget(TargetSpec):
    name = "llvm"
    default_dtype = "float32"
    device_type = "cpu"
    page_sizes = (8, 16, 32, 64, 128)  # schedules/cpu/attention.py PAGE_SIZES

    def __init__(self, arch: str | None = None, **options):
        super().__init__(arch=arch, **options)
        self.isa_arch, self.cpu = parse_arch(arch)

    def tir_pipeline(self):
        """TVM's default TIR pipeline plus register tiles of up to 2 KiB kept on the stack
        (schedules/cpu/pipeline.py): the GEMM tiles of CPUs with two 512-bit FMA ports."""
        from schedules.cpu.pipeline import cpu_tir_pipeline

        return cpu_tir_pipeline()

    def make_tvm_target(self):
        import tvm

        if self.isa_arch == "aarch64" and os.uname().machine != "aarch64":
            spec = {"kind": "llvm", "mtriple": CROSS_TRIPLES["aarch64"], "mattr": ["+neon"],
                    "num-cores": default_num_threads()}
            if self.cpu:
                spec["mcpu"] = self.cpu
            return tvm.target.Target(spec)
        if self.cpu is None and self.isa_arch == os.uname().machine:  # the host itself
            return host_target(default_num_threads())
        return tvm.target.Target({"kind": "llvm", "mtriple": f"{self.isa_arch}-linux-gnu",
                                  "mcpu": self.cpu or host_cpu_name(),
                                  "num-cores": default_num_threads()})

    def vector_isa(self) -> str:
        """The widest SIMD the target has: avx512, avx2, neon or sse (the rules' probe,
        schedules/cpu/common.py)."""
        from schedules.cpu.common import vector_isa

        isa = vector_isa(self.tvm_target())
        return "sse" if isa == "generic" else isa

    def int8_dot_isa(self) -> str | None:
        """The instructions of the int8-activation kernels' dot products on this CPU
        (schedules/cpu/int8_act_matmul.py DOT_ISAS): "vnni" (AVX-512 VNNI, vpdpbusd),
        "avx512bw" (AVX-512 without VNNI) or "avx2" (vpmaddubsw + vpmaddwd: Zen 2/3, Haswell to
        the client cores); None on other CPUs."""
        from schedules.cpu.common import has_feature, target_arch

        t = self.tvm_target()
        if target_arch(t) != "x86_64":
            return None
        if has_feature("avx512vnni", t):
            return "vnni"
        if has_feature("avx512bw", t):
            return "avx512bw"
        return "avx2" if has_feature("avx2", t) else None

    def supports_int8_dot(self) -> bool:
        """x86 CPUs with AVX2 or AVX-512 run the int8-activation kernels (int8_dot_isa)."""
        return self.int8_dot_isa() is not None

    def quantized_matmul_kernel(self, fmt: str, K: int, N: int, out_dtype: str, act_bits: int = 8):
        """The int8-activation kernel (schedules/cpu/int8_act_matmul.py), one per shape,
        activation width (8, or 16 as two int8 halves), dot-product instructions and the CPU's
        decode prefetch (schedules/cpu/microarch.py)."""
        from schedules.cpu.microarch import tile_row

        from ..errors import UserError

        dot = self.int8_dot_isa()
        if dot is None:
            raise UserError(f"this CPU target ({self.tvm_target()}) has no int8 dot-product instructions "
                            "(x86 with AVX2 or AVX-512): build with --activations float")
        from ..quantization.formats import get_format

        row, wf = tile_row(self.tvm_target()), get_format(fmt)
        return _int8_act_kernel(fmt, K, N, out_dtype, act_bits, dot,
                                row.int8_prefetch(wf.bits, wf.kind == "kquant"), row.int8_decode_burst_lines)

    def cache_kernels(self, kv_mod, attn, dtype: str, page_size: int) -> dict:
        """Our CPU attention kernels for any page size (TVM's are scalar and serial), see
        targets/attention.py; bfloat16 prefill scores on AMX tiles where the CPU has them (as
        the bfloat16 prefill matmuls, schedules/cpu/amx_prefill.py)."""
        from schedules.cpu.amx_bf16 import target_has_amx
        from schedules.cpu.common import num_cores

        from .attention import cpu_cache_kernels

        target = self.tvm_target()
        return cpu_cache_kernels(kv_mod, attn, dtype, page_size, threads=num_cores(target),
                                 amx=target_has_amx(target))

    def rule_grid(self, mod, only: str | None = None) -> list:
        from schedules.cpu.tile_grid import grid_schedules

        return grid_schedules(mod, self.tvm_target(), only)

    def tile_table_name(self) -> str:
        """The row of schedules/cpu/microarch.py the rules use for this CPU."""
        from schedules.cpu.microarch import tile_row

        return tile_row(self.tvm_target()).name

    def hw_key(self) -> str:
        return llvm_hw_key(self.tvm_target())

    def bf16_matmul_kernel(self) -> str:
        """How bfloat16 weight matmuls are computed for this CPU: "vdpbf16ps" where the target
        has AVX512-BF16 (znver4, cooperlake, sapphirerapids...; schedules/cpu/bf16_dot.py),
        else "widen+fma" (bf16 widened to fp32 in registers, float32 FMAs)."""
        from schedules.cpu.common import has_feature

        t = self.tvm_target()
        if "aarch64" not in str(t.attrs.get("mtriple", "")) and has_feature("avx512bf16", t):
            return "vdpbf16ps"
        return "widen+fma"

    def describe(self) -> dict:
        d = super().describe()
        t = self.tvm_target()
        if "aarch64" not in str(t.attrs.get("mtriple", "")):
            d["cpu_features"] = {"bf16_matmul": self.bf16_matmul_kernel(), "amx": amx_status(t),
                                 "int8_dot": self.int8_dot_isa()}
        return d

    def graph_passes(self) -> list:
        """bfloat16/float16 matmuls accumulate in float32 (the GEMM/GEMV rules then read the
        half-precision weight, half of float32's bytes, and widen it in registers); a residual
        add that no matmul epilogue takes is computed by the next RMSNorm's kernel."""
        from ..passes.accumulate_half_matmul import AccumulateHalfMatmulInFloat32
        from ..passes.fuse_add_rms_norm import FuseAddRMSNorm

        return [AccumulateHalfMatmulInFloat32(), FuseAddRMSNorm()]

    def schedule_passes(self) -> list:
        """Our CPU rules, with weights packed at build time: the build marks the model's
        weights layout-free, the GEMM rule then reads each NT weight as packed panels
        (schedules/cpu/gemm.py: 1.3-1.4x the row-major GEMV rule on prefill, faster decode
        too), and the packing is split out of the kernels and lifted into a second
        transform_params that the build runs once (schedules/cpu/prepack.py)."""
        from schedules.cpu import cpu_schedule_pass
        from schedules.cpu.fast_math import register_fast_exp
        from schedules.cpu.prepack import MarkWeightsLayoutFree, prepack_passes

        register_fast_exp()  # vector exp for SiLU and softmax instead of one expf per lane
        return [MarkWeightsLayoutFree(),
                cpu_schedule_pass(dequant_panel=self.dequantize_panel_prefill()),
                *prepack_passes()]

    def dequantize_panel_prefill(self) -> bool:
        """Whether weight-only quantized prefill dequantizes each weight panel once per call
        into a float buffer and runs the float GEMM micro-kernel on it
        (schedules/cpu/dequant_gemm.py) instead of dequantizing inside the row-major dot
        product for every 3 rows (schedules/cpu/gemv.py). Measured on x86 (x86-64-v3 code and
        znver4 code on this znver4 machine, 2 threads, 32-128 rows, machine shared): q8_0 and
        q4_k kernels went from 0.36-0.78x of the packed fp32 GEMM to 0.89-1.14x
        (scripts/bench_dequant_prefill.py). aarch64 keeps the dot product (the rule would
        compile there, but it was not measured on a NEON machine). Decode-shaped kernels keep
        the GEMV rule, and prefills of fewer than 8 rows take it inside the same kernel.
        Default int8-activation builds (VNNI CPUs) have no weight-only matmul: unchanged."""
        return self.isa_arch == "x86_64"

    def export_library(self, executable, path: str, workspace_dir: str | None = None) -> None:
        if self.isa_arch != os.uname().machine:
            from .cross import cross_compiler

            executable.export_library(path, fcompile=cross_compiler(self.isa_arch),
                                      workspace_dir=workspace_dir)
        else:
            executable.export_library(path, workspace_dir=workspace_dir)

    def emit_source(self, executable, out_dir: str) -> list[str]:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "host.s")
        with open(path, "w") as f:
            f.write(executable.mod.inspect_source("asm"))
        return [path]
