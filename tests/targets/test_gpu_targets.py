"""GPU targets, CUDA and ROCm: arch choices and TVM target attributes (parametrized over
the target); CUDA: PTX in the exported library, nvcc as TVM's compile callback; ROCm: linking
without ROCm (LLD 22 from ziglang), device math without ocml (lowered to what the AMDGPU
backend emits inline), the code object in the exported library; both: sources."""
from __future__ import annotations

import os
import re
import struct

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te, tirx
from tvm.script import ir as I
from tvm.script import relax as R

EM_AMDGPU = 224


@I.ir_module
class Small:
    @R.function
    def main(x: R.Tensor((1, "n", 64), "float16"), w: R.Tensor((128, 64), "float16")):
        R.func_attr({"tir_var_upper_bound": {"n": 256}})
        with R.dataflow():
            y = R.nn.silu(R.matmul(x, R.permute_dims(w)))
            R.output(y)
        return y


def _build_small(kind, arch, out):
    """`Small` lowered, scheduled and compiled as the build does, exported to out/model.so."""
    from gpu_verify import lower_for_scheduling
    from tvm_llm.targets import get_target

    spec = get_target(kind, arch=arch)
    target = spec.tvm_target()
    with target, tvm.transform.PassContext(opt_level=3, config=spec.pass_context_config()):
        mod = tvm.transform.Sequential(spec.schedule_passes())(lower_for_scheduling(Small))
        ex = tvm.compile(mod, target=target, tir_pipeline=spec.tir_pipeline())
    path = str(out / "model.so")
    spec.export_library(ex, path)
    return spec, ex, path, out


# ------------------------------------------------------------------ both targets
@pytest.mark.parametrize("kind,default,other,bad,warp", [
    ("cuda", "sm_80", "sm_90", "sm_70", 32), ("rocm", "gfx942", "gfx90a", "gfx1100", 64)])
def test_arch_default_validation_and_tvm_target(kind, default, other, bad, warp):
    """The default arch, the one-line refusal of an unknown one, and the target attributes
    dlight and MetaSchedule need."""
    from tvm_llm.errors import UserError
    from tvm_llm.targets import get_target

    spec = get_target(kind)
    assert spec.arch == default and spec.default_dtype == "float16" and spec.device_type == kind
    assert spec.hw_key() == f"{kind}-{default}"
    assert get_target(kind, arch=other).hw_key() == f"{kind}-{other}"
    with pytest.raises(UserError) as err:
        get_target(kind, arch=bad)
    msg = str(err.value)
    assert "\n" not in msg and bad in msg and default in msg and other in msg
    target = spec.tvm_target()
    assert target.kind.name == kind and target.host.kind.name == "llvm"
    assert str(target.attrs["arch" if kind == "cuda" else "mcpu"]) == default
    for key in ("max_threads_per_block", "max_shared_memory_per_block", "thread_warp_size",
                "max_num_threads"):
        assert int(target.attrs[key]) > 0, key
    assert int(target.attrs["thread_warp_size"]) == warp
    described = spec.describe()
    assert described["device_type"] == kind and described["hw_key"] == f"{kind}-{default}"


# ------------------------------------------------------------------ CUDA
def test_blob_rewrite_replaces_source_with_ptx():
    from tvm_llm.targets.cuda import parse_library_blob, rewrite_cuda_modules, split_cuda_module

    def s(b):
        return struct.pack("<Q", len(b)) + b

    fmap = s(b"opaque function table") + struct.pack("<Q", 7)
    cuda = s(b"cuda") + fmap + s(b"extern \"C\" __global__ void k() {}")
    # import tree: module 0 (the host library) imports module 1 (CUDA)
    tree = struct.pack("<Q3Q", 3, 0, 1, 1) + struct.pack("<QQ", 1, 1)
    body = tree + s(b"_lib") + s(b"cuda") + s(cuda)
    blob = struct.pack("<Q", len(body)) + body
    out = rewrite_cuda_modules(blob, lambda src: "// ptx for " + src)
    mods = parse_library_blob(out)
    assert [k for k, _ in mods] == ["_lib", "cuda"]
    fmt, fmap2, code = split_cuda_module(mods[1][1])
    assert fmt == "ptx" and fmap2 == fmap
    assert code.rstrip(b"\0").decode().startswith("// ptx for extern")


@pytest.fixture(scope="module")
def cuda_built(tmp_path_factory):
    return _build_small("cuda", "sm_90", tmp_path_factory.mktemp("cuda_small"))


def test_exported_library_carries_ptx_not_source(cuda_built):
    from tvm_llm.targets.cuda import parse_library_blob, read_library_blob, split_cuda_module

    spec, ex, path, _ = cuda_built
    with open(path, "rb") as f:
        assert f.read(4) == b"\x7fELF"
    kinds = parse_library_blob(read_library_blob(path))
    cuda = [data for kind, data in kinds if kind == "cuda"]
    assert len(cuda) == 1
    fmt, _, code = split_cuda_module(cuda[0])
    ptx = code.decode().rstrip("\0")
    assert fmt == "ptx"
    assert re.search(r"^\.version \d+\.\d+", ptx, re.M) and re.search(r"^\.target sm_90", ptx, re.M)
    assert ".visible .entry" in ptx and "__global__" not in ptx
    # the in-memory module still has the CUDA source for inspection
    assert "__global__" in ex.mod.imports[0].imports[0].inspect_source("cuda")


def test_emit_source_writes_cuda_ptx_and_host_asm(cuda_built):
    spec, ex, _, out = cuda_built
    files = spec.emit_source(ex, str(out / "src"))
    names = sorted(os.path.basename(f) for f in files)
    assert names == ["device.cu", "device.ptx", "host.s"]
    cu = open(out / "src" / "device.cu").read()
    ptx = open(out / "src" / "device.ptx").read()
    assert "__global__" in cu and ".entry" in ptx
    assert "mma.sync" in ptx  # the 64-wide N is padded to a tensor-core tile: still mma
    assert "cp.async.cg.shared.global" in ptx and "cp.async.commit_group" in ptx  # sm_90 too


def test_compile_callback_is_nvcc_ptx():
    """The global CUDA compile callback (used where TVM compiles at build or load time) gives
    PTX from nvcc for the arch in scope, not NVRTC output."""
    from tvm_llm.targets import get_target

    get_target("cuda", arch="sm_90")
    src = 'extern "C" __global__ void add_one(float* x) { x[threadIdx.x] += 1.0f; }'
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
        ptx = bytes(tvm.get_global_func("tvm_callback_cuda_compile")(src)).decode()
    assert ptx.startswith("//") and ".target sm_90" in ptx and "add_one" in ptx


# ------------------------------------------------------------------ ROCm
def _math_kernel(dtype: str):
    """One elementwise kernel per math op an LLM uses (softmax, norms, SiLU, GELU, RoPE)."""
    from tvm_llm.targets.rocm import MATH_OPS

    a = te.placeholder((256,), dtype, name="a")
    b = te.placeholder((256,), dtype, name="b")

    def compute(op):
        if op == "pow":
            return te.compute((256,), lambda i: tirx.pow(a[i], b[i]), name="o_pow")
        if op == "exp10":
            return te.compute((256,), lambda i: tirx.call_intrin(dtype, "tirx.exp10", a[i]), name="o_exp10")
        return te.compute((256,), lambda i: getattr(tirx, op)(a[i]), name=f"o_{op}")

    outs = [compute(op) for op in MATH_OPS]
    return te.create_prim_func([a, b, *outs]), len(outs)


@pytest.mark.parametrize("arch", ["gfx90a", "gfx942"])
def test_math_kernels_link_without_device_libraries(arch):
    from tvm.s_tir import dlight as dl

    from tvm_llm.targets import get_target

    spec = get_target("rocm", arch=arch)
    target = spec.tvm_target()
    for dtype in ("float32", "float16"):
        func, _ = _math_kernel(dtype)
        with target:
            mod = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(tvm.IRModule({"main": func}))
        ex = tvm.compile(mod, target=target)   # links with --no-undefined: no ocml calls left
        dev = ex.mod.imports[0]
        asm = dev.inspect_source("asm")
        assert not re.search(r"s_swappc|s_call_b64|__ocml", asm)
        ops = set(re.findall(r"^\s*(v_(?:exp|log|rsq|sqrt|sin|cos)_f(?:16|32))", asm, re.M))
        assert {"v_exp_f32", "v_log_f32"} <= {o.replace("_f16", "_f32") for o in ops}
        assert any(o.startswith("v_rsq") for o in ops)   # rsqrt is one instruction


# --------------------------------------------------------------- numerics on the CPU
def _rocm_lowered_on_cpu(func):
    """Apply the rocm lowering rule of every math call (ours or TVM's) to `func`, with the
    AMDGPU-only intrinsic (llvm.amdgcn.rsq) replaced by its definition, so the CPU evaluates
    the very formulas the GPU kernels use."""
    from tvm.target import codegen

    rsq = codegen.llvm_lookup_intrinsic_id("llvm.amdgcn.rsq")
    pure = tvm.ir.Op.get("tirx.call_llvm_pure_intrin")

    def lower(call):
        op = call.op
        if isinstance(op, tvm.ir.Op) and op.name.startswith("tirx."):
            rule = op.get_attr("rocm.FLowerIntrinsic")
            if rule is not None and op.name not in ("tirx.call_llvm_pure_intrin",):
                new = rule(call)
                if new is not None and not new.same_as(call):
                    return new
        if op.same_as(pure) and int(call.args[0].value) == rsq:
            x = call.args[1]
            return tirx.const(1, str(x.ty)) / tirx.sqrt(x)
        return call

    func = tvm_ffi.structural_map(func, [(tvm.ir.Call, lower)])
    return tvm_ffi.structural_map(func, [(tvm.ir.Call, lower)])   # rsq introduced by the rules


REFERENCE = {
    "exp": np.exp, "exp2": np.exp2, "exp10": lambda x: np.power(10.0, x), "log": np.log,
    "log2": np.log2, "log10": np.log10, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x),
    "tanh": np.tanh, "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "sin": np.sin, "cos": np.cos,
}


def _erf(x):
    import math

    return np.vectorize(math.erf)(x)


def test_math_lowering_formulas_are_numerically_right():
    from tvm_llm.targets.rocm import MATH_OPS, install_rocm_toolchain

    install_rocm_toolchain()
    rng = np.random.default_rng(0)
    func, _ = _math_kernel("float32")
    ex = tvm.compile(tvm.IRModule({"main": _rocm_lowered_on_cpu(func).with_attr("global_symbol", "main")}),
                     target=tvm.target.Target({"kind": "llvm"}))
    a = np.concatenate([rng.uniform(-8, 8, 120), rng.uniform(-1e-3, 1e-3, 8),
                        [-3.0, -2.0, -1.0, 0.0, 0.5, 1.0, 2.0, 3.0], rng.uniform(0.01, 30, 120)]).astype("float32")
    b = np.concatenate([rng.integers(-4, 5, 128).astype("float32"), rng.uniform(-3, 3, 128)]).astype("float32")
    b[120:136] = [0, 0, 3, 2, 0, 1.5, -1, 2, 3, 0.5, 0, 2, 3, 1, 2, 3]
    outs = [tvm.runtime.tensor(np.zeros(256, "float32")) for _ in MATH_OPS]
    ex["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), *outs)
    x64, y64 = a.astype("float64"), b.astype("float64")
    positive = x64 > 0
    for op, out in zip(MATH_OPS, outs):
        got = out.numpy().astype("float64")
        with np.errstate(all="ignore"):
            if op == "pow":
                ref = np.power(x64, y64)
            elif op == "erf":
                ref = _erf(x64)
            else:
                ref = REFERENCE[op](x64)
        mask = positive if op in ("log", "log2", "log10", "sqrt", "rsqrt") else np.isfinite(ref)
        if op in ("exp", "exp2", "exp10", "pow"):
            mask &= np.abs(ref) < 1e30
        rel = np.abs(got[mask] - ref[mask]) / np.maximum(np.abs(ref[mask]), 1e-6)
        assert rel.max() < 2e-5 or np.abs(got[mask] - ref[mask]).max() < 2e-6, (op, rel.max())
        if op == "pow":   # negative bases: odd/even integral exponents, NaN otherwise
            assert np.isnan(got[(x64 < 0) & (np.floor(y64) != y64)]).all()
            assert got[np.where((a == -2.0) & (b == 3))[0]].tolist() in ([], [-8.0])
            assert (got[b == 0] == 1).all()


@pytest.fixture(scope="module")
def rocm_built(tmp_path_factory):
    return _build_small("rocm", "gfx942", tmp_path_factory.mktemp("rocm_small"))


def test_exported_library_holds_the_code_object(rocm_built):
    from tvm_llm.targets.cuda import parse_library_blob, read_library_blob, split_cuda_module

    _, _, path, _ = rocm_built
    modules = dict(parse_library_blob(read_library_blob(path)))
    assert "hip" in modules, list(modules)
    fmt, _, code = split_cuda_module(modules["hip"])   # same [fmt][fmap][code] layout
    assert fmt == "hsaco"
    assert code[:4] == b"\x7fELF" and struct.unpack_from("<H", code, 18)[0] == EM_AMDGPU
    assert b"amdhsa" in code


def test_emit_source_writes_amdgpu_assembly(rocm_built):
    spec, ex, _, out = rocm_built
    files = spec.emit_source(ex, str(out / "src"))
    names = {os.path.basename(f) for f in files}
    assert {"device.s", "host.s"} <= names
    asm = open(out / "src" / "device.s").read()
    assert ".amdhsa_kernel" in asm and "v_mfma_f32_16x16x16" in asm
