"""The interface every target implements."""
from __future__ import annotations

import os


class TargetSpec:
    """One compilation target. Subclasses fill in the pieces that differ."""

    name = "base"
    default_dtype = "float32"
    device_type = "cpu"  # tvm device name used by the runtime: "cpu", "cuda", "rocm"
    # KV page sizes (tokens) whose attention kernels the build can compile: TVM's GPU kernels
    # take 16; the CPU target rebuilds its page kernels for any of 8..128
    page_sizes = (16,)

    def __init__(self, arch: str | None = None, **options):
        self.arch = arch
        self.options = options
        self._tvm_target = None

    def check_page_size(self, page_size) -> None:
        """Refuse, at build time, a KV page size this target's kernels cannot take."""
        from ..errors import UserError

        if page_size not in self.page_sizes:
            sizes = ", ".join(map(str, self.page_sizes))
            raise UserError(f"--page-size {page_size!r} is not supported for target {self.name}: "
                            f"use one of {sizes} (tokens per KV cache page)")

    def tvm_target(self):
        """The tvm.target.Target to compile for, made once per spec (every phase of a build
        asks for it; the CPU target probes LLVM for the host CPU each time it is made)."""
        if self._tvm_target is None:
            self._tvm_target = self.make_tvm_target()
        return self._tvm_target

    def make_tvm_target(self):
        """Build the tvm.target.Target (called once, by tvm_target)."""
        raise NotImplementedError

    def hw_key(self) -> str:
        """Names the hardware for tuning logs, e.g. cpu-x86_64-avx512, cuda-sm_90, rocm-gfx942."""
        raise NotImplementedError

    def schedule_passes(self) -> list:
        """TIR scheduling passes run after fusion (our rules first, then generic fallbacks)."""
        return []

    def cache_kernels(self, kv_mod, attn, dtype: str, page_size: int) -> dict:
        """{kernel name: PrimFunc} to put in place of TVM's paged-KV-cache kernels of the same
        name in `kv_mod` (the cache's module, before the model's functions join it). `attn`
        is the traced frontend.AttentionShape. GPU default: TVM's kernels, except for models
        with attention variants (per-layer windows, soft-caps, sinks), which TVM's GPU
        kernels do not know: ours, one GPU thread per (row, KV head) (targets/attention.py)."""
        if not attn.variants:
            return {}
        from .attention import gpu_variant_kernels

        return gpu_variant_kernels(attn, dtype)

    def quantized_matmul_kernel(self, fmt: str, K: int, N: int, out_dtype: str, act_bits: int = 8):
        """The hand-written PrimFunc y = x @ W^T of a weight stored in format `fmt` with int8
        (act_bits 8) or int16 (16) activations (the "vnni" layout), or an error where the
        target has none."""
        from ..errors import UserError

        raise UserError(f"target {self.name} has no int8-activation matmul kernels: "
                        "build with --activations float")

    def rule_grid(self, mod, only: str | None = None) -> list:
        """[(label, Schedule)]: our matmul rules' schedules of the static kernel `mod` at each
        tile the tuner measures (tvm_llm/tune/rule_grid.py); [] where the target has none."""
        return []

    def tile_table_name(self) -> str | None:
        """Name of the register-tile table the rules use for this target, None if none."""
        return None

    def graph_passes(self) -> list:
        """Relax passes of this target run in the fusion phase, after linear merging and
        quantization and before FuseTransposeMatmul (graph rewrites its kernels want)."""
        return []

    def supports_int8_dot(self) -> bool:
        """Whether W8A8 (--activations int8) has int8 dot-product instructions to run on."""
        return False

    def tir_pipeline(self):
        """Name of a custom TIR lowering pipeline, or None for TVM's default."""
        return None

    def pass_context_config(self) -> dict:
        """Extra tvm.transform.PassContext config for this target's compile."""
        return {}

    def graph_capture_passes(self) -> list:
        """Relax passes, run after the static memory plan, that rewrite parts of the functions
        for replay as device graphs (CUDA Graphs); none where the runtime has no graphs."""
        return []

    def export_library(self, executable, path: str, workspace_dir: str | None = None) -> None:
        """Link the compiled module into a shared library at `path`; object files go to
        `workspace_dir` (the build's own temporary directory)."""
        executable.export_library(path, workspace_dir=workspace_dir)

    def emit_source(self, executable, out_dir: str) -> list[str]:
        """Write the generated code (assembly / CUDA / PTX) under out_dir; return the files."""
        os.makedirs(out_dir, exist_ok=True)
        return []

    def describe(self) -> dict:
        """What the manifest records about the target."""
        return {"name": self.name, "arch": self.arch, "tvm_target": str(self.tvm_target()),
                "hw_key": self.hw_key(), "device_type": self.device_type}
