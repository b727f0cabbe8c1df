"""CUDA target: arch choices, TVM target attributes, PTX in the exported library, sources."""
from __future__ import annotations

import os
import re
import struct

import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Small:
    @R.function
    def main(x: R.Tensor((1, "n", 64), "float16"), w: R.Tensor((128, 64), "float16")):
        R.func_attr({"tir_var_upper_bound": {"n": 256}})
        with R.dataflow():
            y = R.nn.silu(R.matmul(x, R.permute_dims(w)))
            R.output(y)
        return y


def test_arch_default_and_validation():
    from tvm_llm.errors import UserError
    from tvm_llm.targets import get_target

    spec = get_target("cuda")
    assert spec.arch == "sm_80" and spec.default_dtype == "float16" and spec.device_type == "cuda"
    assert get_target("cuda", arch="sm_90").hw_key() == "cuda-sm_90"
    with pytest.raises(UserError) as err:
        get_target("cuda", arch="sm_70")
    msg = str(err.value)
    assert "\n" not in msg and "sm_70" in msg and "sm_80" in msg and "sm_90" in msg


def test_tvm_target_has_what_dlight_and_metaschedule_need():
    from tvm_llm.targets import get_target

    spec = get_target("cuda", arch="sm_90")
    target = spec.tvm_target()
    assert target.kind.name == "cuda" and str(target.attrs["arch"]) == "sm_90"
    assert target.host.kind.name == "llvm"
    for key in ("max_threads_per_block", "max_shared_memory_per_block", "thread_warp_size",
                "max_num_threads"):
        assert int(target.attrs[key]) > 0, key
    assert int(target.attrs["thread_warp_size"]) == 32
    described = spec.describe()
    assert described["device_type"] == "cuda" and described["hw_key"] == "cuda-sm_90"


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
def built(tmp_path_factory):
    from gpu_verify import lower_for_scheduling
    from tvm_llm.targets import get_target

    spec = get_target("cuda", arch="sm_90")
    target = spec.tvm_target()
    with target, tvm.transform.PassContext(opt_level=3, config=spec.pass_context_config()):
        mod = tvm.transform.Sequential(spec.schedule_passes())(lower_for_scheduling(Small))
        ex = tvm.compile(mod, target=target, tir_pipeline=spec.tir_pipeline())
    out = tmp_path_factory.mktemp("cuda_small")
    path = str(out / "model.so")
    spec.export_library(ex, path)
    return spec, ex, path, out


def test_exported_library_carries_ptx_not_source(built):
    from tvm_llm.targets.cuda import parse_library_blob, read_library_blob, split_cuda_module

    spec, ex, path, _ = built
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


def test_emit_source_writes_cuda_ptx_and_host_asm(built):
    spec, ex, _, out = built
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
