"""NVIDIA GPUs (sm_80 and newer): tensor-core schedules, nvcc -> PTX at build time.

TVM 0.27 keeps a CUDA module's *source* in the compiled artifact and compiles it when the
library loads (NVRTC, or nvcc with TVM_CUDA_COMPILE_MODE=nvcc): a deployment machine would
need a CUDA compiler. `export_library` here instead packs the device modules itself
(`fpack_imports`): it serialises the import tree with `runtime.ModulePackImportsToTensor`,
compiles every CUDA module still in source form to PTX with nvcc (the `[fmt][fmap][code]`
layout of a CUDA module's bytes, tvm/src/backend/cuda/runtime/cuda_module.cc), and embeds the
rewritten blob with `codegen.codegen_blob`. The runtime's `ffi.Module.load_from_bytes.cuda`
then loads PTX with cuModuleLoadData: no compiler on the deployment machine.

On a machine whose TVM loads the CUDA runtime (a GPU box), `tvm.compile` already compiles the
source through the global `tvm_callback_cuda_compile`; this module overrides that callback
with nvcc -> PTX, so the blob holds PTX in both cases (and NVRTC/cuda-bindings is not needed).
"""
from __future__ import annotations

import os
import re
import struct

from .registry import register_target
from .gpu import GPUTargetSpec, host_target
from ..errors import UserError

# arch -> (shared memory a block may use, bytes; what the schedules may plan for)
CUDA_ARCHS = {
    "sm_80": 163 * 1024,   # A100
    "sm_86": 99 * 1024,    # RTX 30xx / A10
    "sm_89": 99 * 1024,    # L4 / RTX 40xx
    "sm_90": 227 * 1024,   # H100 / H200
}
DEFAULT_ARCH = "sm_80"


@register_target("cuda")
class CUDATarget(GPUTargetSpec):
    name = "cuda"
    device_type = "cuda"
    archs = CUDA_ARCHS
    default_arch = DEFAULT_ARCH

    def __init__(self, arch: str | None = None, **options):
        super().__init__(arch=arch, **options)
        install_compile_callback(self.arch)

    def make_tvm_target(self):
        import tvm

        return tvm.target.Target({
            "kind": "cuda", "arch": self.arch, "host": host_target(),
            "max_threads_per_block": 1024, "max_num_threads": 1024, "thread_warp_size": 32,
            # static __shared__ limit: dlight plans within it; our rules use shared.dyn
            "max_shared_memory_per_block": 49152, "registers_per_block": 65536,
        })

    def schedule_passes(self) -> list:
        from schedules.cuda import cuda_schedule_passes

        return cuda_schedule_passes()

    def pass_context_config(self) -> dict:
        # CSE hoists threadIdx.x out of warp-buffer indices, which LowerWarpMemory then rejects;
        # RewriteCUDAGraph does nothing unless use_cuda_graph is set; use_async_copy turns the
        # tensor-core GEMM's pipelined shared-memory copies into cp.async (InjectPTXAsyncCopy)
        return {"tirx.disable_cse_tir": True, "relax.backend.use_cuda_graph": cuda_graphs_enabled(),
                "tirx.use_async_copy": True}

    def graph_capture_passes(self) -> list:
        """Decode's static regions become CUDA Graphs, one per batch size
        (tvm_llm/passes/graph_capture.py). TVM_LLM_CUDA_GRAPH=0 builds without them."""
        from tvm import relax

        from ..passes.graph_capture import CaptureDecodeBatch

        if not cuda_graphs_enabled():
            return []
        return [CaptureDecodeBatch(), relax.transform.RewriteCUDAGraph()]

    def describe(self) -> dict:
        return {**super().describe(), "device_type": self.device_type, "device_code": "ptx",
                "graph_capture": "cuda_graph" if cuda_graphs_enabled() else "off"}

    # ------------------------------------------------------------------ export
    def export_library(self, executable, path: str, workspace_dir: str | None = None) -> None:
        executable.export_library(path, fpack_imports=_ptx_packer(self),
                                  workspace_dir=workspace_dir)

    def emit_source(self, executable, out_dir: str) -> list[str]:
        os.makedirs(out_dir, exist_ok=True)
        written = []
        for i, dev in enumerate(m for m in _device_modules(executable.mod) if m.kind == "cuda"):
            suffix = "" if i == 0 else str(i)
            cu = dev.inspect_source("cuda") or dev.inspect_source("")
            ptx = dev.inspect_source("ptx") or self.compile_ptx(cu)
            for name, text in ((f"device{suffix}.cu", cu), (f"device{suffix}.ptx", ptx)):
                written.append(_write(os.path.join(out_dir, name), text))
        host = _host_module(executable.mod)
        if host is not None:
            written.append(_write(os.path.join(out_dir, "host.s"), host.inspect_source("asm")))
        return written

    def compile_ptx(self, source: str) -> str:
        return compile_ptx(source, self.arch)


def cuda_graphs_enabled() -> bool:
    """Decode as CUDA Graphs unless the environment says TVM_LLM_CUDA_GRAPH=0 (an A/B switch
    for the first runs on a GPU)."""
    return os.environ.get("TVM_LLM_CUDA_GRAPH", "1") != "0"


# ---------------------------------------------------------------------- nvcc
def compile_ptx(source: str, arch: str) -> str:
    """CUDA source -> PTX text for `arch` with nvcc (TVM's flags: -O3, fast math); NVRTC
    (the cuda-bindings package) where there is no nvcc."""
    import shutil

    import tvm
    from tvm.support import nvcc

    with tvm.target.Target({"kind": "cuda", "arch": arch}):
        if shutil.which("nvcc"):
            ptx = nvcc.compile_cuda(source, target_format="ptx", arch=arch, compiler="nvcc")
        else:
            try:
                ptx = nvcc.compile_cuda(source, target_format="ptx", arch=arch, compiler="nvrtc")
            except ImportError as err:
                raise UserError("neither nvcc nor NVRTC found: install the CUDA toolkit (nvcc "
                                "on PATH) or `pip install cuda-bindings` to build for "
                                "--target cuda") from err
    return bytes(ptx).decode()


_CALLBACK_ARCH = {"arch": DEFAULT_ARCH}


def install_compile_callback(arch: str) -> None:
    """Make TVM compile CUDA source to PTX with nvcc wherever it compiles (at build time on a
    machine with the CUDA runtime, or when a source-form module loads)."""
    import tvm_ffi

    _CALLBACK_ARCH["arch"] = arch

    def tvm_callback_cuda_compile(code, *_):
        import tvm

        current = tvm.target.Target.current(allow_none=True)
        target_arch = str(current.attrs.get("arch", "")) if current is not None else ""
        if not target_arch.startswith("sm_"):
            dev = tvm.cuda(0)
            target_arch = ("sm_" + dev.compute_version.replace(".", "") if dev.exist
                           else _CALLBACK_ARCH["arch"])
        return bytearray(compile_ptx(code, target_arch).encode())

    import tvm  # noqa: F401  (registers TVM's default callback first, so ours overrides it)

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", tvm_callback_cuda_compile,
                                 override=True)


# --------------------------------------------------------- the packed blob
def _read_u64(buf: bytes, offset: int) -> tuple[int, int]:
    return struct.unpack_from("<Q", buf, offset)[0], offset + 8


def _pack_str(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def parse_library_blob(blob: bytes) -> list[tuple[str, bytes | None]]:
    """[(kind, module bytes)] in the order of tvm-ffi's library binary (ProcessLibraryBin):
    <nbytes u64> <indptr vec> <child vec> then per module <kind str> [<bytes>]."""
    nbytes, offset = _read_u64(blob, 0)
    if nbytes != len(blob) - 8:
        raise ValueError("not a TVM library blob (size header mismatch)")
    for _ in range(2):  # import tree: row pointers, child indices
        count, offset = _read_u64(blob, offset)
        offset += 8 * count
    modules = []
    while offset < len(blob):
        size, offset = _read_u64(blob, offset)
        kind = blob[offset:offset + size].decode()
        offset += size
        data = None
        if kind != "_lib":
            size, offset = _read_u64(blob, offset)
            data = blob[offset:offset + size]
            offset += size
        modules.append((kind, data))
    return modules


def split_cuda_module(data: bytes) -> tuple[str, bytes, bytes]:
    """A device module's bytes ([fmt][function map][code], CUDA and ROCm alike) ->
    (fmt, serialized function map, code). The function map is kept opaque: the code is the
    last field, the first length prefix that spans exactly to the end (the map holds only
    small counts and short names, never such a length)."""
    size, offset = _read_u64(data, 0)
    fmt = data[offset:offset + size].decode()
    offset += size
    for start in range(offset, len(data) - 7):
        if struct.unpack_from("<Q", data, start)[0] == len(data) - start - 8:
            return fmt, data[offset:start], data[start + 8:]
    raise ValueError("malformed device module bytes")


def rewrite_cuda_modules(blob: bytes, compile_fn) -> bytes:
    """The blob with every CUDA module in source form ("cuda") replaced by ("ptx", compile_fn(src))."""
    nbytes, offset = _read_u64(blob, 0)
    head_end = offset
    for _ in range(2):
        count, head_end = _read_u64(blob, head_end)
        head_end += 8 * count
    out = [blob[8:head_end]]
    for kind, data in parse_library_blob(blob):
        out.append(_pack_str(kind.encode()))
        if data is None:
            continue
        if kind == "cuda":
            fmt, fmap, code = split_cuda_module(data)
            if fmt == "cuda":
                ptx = compile_fn(code.decode()).encode()
                data = _pack_str(b"ptx") + fmap + _pack_str(ptx + b"\0")
        out.append(_pack_str(data))
    body = b"".join(out)
    return struct.pack("<Q", len(body)) + body


def _ptx_packer(spec: CUDATarget):
    """An `fpack_imports` for export_library that embeds PTX instead of CUDA source."""

    def fpack_imports(mod, is_system_lib, prefix, workspace_dir):
        import tvm

        blob = tvm.get_global_func("runtime.ModulePackImportsToTensor")(mod).numpy().tobytes()
        blob = rewrite_cuda_modules(blob, spec.compile_ptx)
        host = _host_module(mod)
        llvm_target = host.get_function("_get_target_string")()
        obj = tvm.get_global_func("codegen.codegen_blob")(blob, is_system_lib, llvm_target, prefix)
        path = os.path.join(workspace_dir, f"{prefix}devc.o")
        obj.write_to_file(path)
        return path

    return fpack_imports


def read_library_blob(so_path: str) -> bytes:
    """The packed device-module blob embedded in an exported library (for inspection/tests)."""
    import ctypes

    import tvm

    name = tvm.get_global_func("runtime.ModuleImportsBlobName")()
    lib = ctypes.CDLL(so_path, mode=os.RTLD_LAZY | getattr(os, "RTLD_LOCAL", 0))
    addr = ctypes.addressof(ctypes.c_char.in_dll(lib, name))
    nbytes = struct.unpack("<Q", ctypes.string_at(addr, 8))[0]
    return ctypes.string_at(addr, 8 + nbytes)


def _device_modules(mod) -> list:
    found, stack, seen = [], [mod], set()
    while stack:
        m = stack.pop()
        for sub in m.imports:
            if id(sub) not in seen:
                seen.add(id(sub))
                if sub.kind not in ("llvm", "library", "static_library"):
                    found.append(sub)
                stack.append(sub)
    return found


def _host_module(mod):
    if mod.kind == "llvm":
        return mod
    for m in mod._collect_dso_modules():
        if m.kind == "llvm":
            return m
    return None


def _write(path: str, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    return path


def count_instructions(ptx: str) -> dict:
    """Tensor-core and async-copy instruction counts in PTX (reported by tests and gpu_check)."""
    pats = {"mma.sync": r"\bmma\.sync\.aligned\.m16n8k16", "ldmatrix": r"\bldmatrix\.sync",
            "wmma": r"\bwmma\.mma", "wgmma": r"\bwgmma\.mma_async",
            "cp.async": r"\bcp\.async\.c[ag]\.shared\.global",
            "cp.async.commit_group": r"\bcp\.async\.commit_group",
            "cp.async.wait_group": r"\bcp\.async\.wait_group"}
    return {k: len(re.findall(p, ptx)) for k, p in pats.items()}
