"""CUDA rules: tensor-core GEMM (ldmatrix + mma.sync) for prefill, GEMV for decode.

No GPU here: the rules' claims and generated PTX are checked, and each rule's loop structure
is run on the CPU with thread bindings serialised and the tensor intrinsics left as their
plain descriptions (tests/gpu_verify.py), against numpy.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

K, N = 80, 320   # neither a multiple of the 32-wide K tile nor of the 128-wide N tile


@I.ir_module
class Model:
    @R.function
    def prefill(x: R.Tensor((1, "n", 80), "float16"), w: R.Tensor((320, 80), "float16"),
                r: R.Tensor((1, "n", 320), "float16")):
        R.func_attr({"tir_var_upper_bound": {"n": 512}})
        with R.dataflow():
            y = R.matmul(x, R.permute_dims(w))
            z = R.add(R.nn.silu(y), r)
            R.output(z)
        return z

    @R.function
    def decode(x: R.Tensor(("b", 1, 80), "float16"), w: R.Tensor((320, 80), "float16"),
               r: R.Tensor(("b", 1, 320), "float16")):
        R.func_attr({"tir_var_upper_bound": {"b": 8}})
        with R.dataflow():
            y = R.matmul(x, R.permute_dims(w))
            z = R.add(y, r)
            R.output(z)
        return z


def _silu(v):
    return v / (1 + np.exp(-v))


@pytest.fixture(scope="module")
def spec():
    from tvm_llm.targets import get_target

    return get_target("cuda", arch="sm_80")


@pytest.fixture(scope="module")
def kernels(spec):
    """{"prefill"|"decode": the fused matmul PrimFunc}, bounds annotated as the build does."""
    from schedules.gpu.analysis import AnnotateSymbolicBounds
    from gpu_verify import lower_for_scheduling

    mod = AnnotateSymbolicBounds()(lower_for_scheduling(Model))
    found = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint:
            kind = "decode" if "b" in str(func.attrs.get("tir_var_upper_bound", {})) else "prefill"
            found[kind] = func
    assert set(found) == {"prefill", "decode"}, list(mod.get_global_vars())
    return found


def test_rules_claim_prefill_gemm_and_decode_gemv(spec, kernels):
    from schedules.cuda import cuda_rules

    tensor_core, gemv = cuda_rules()
    target = spec.tvm_target()
    assert tensor_core.claims(kernels["prefill"], target)
    assert not tensor_core.claims(kernels["decode"], target)   # b <= 8: decode
    with target:
        assert gemv.apply(kernels["decode"], target, False) is not None
        assert gemv.apply(kernels["prefill"], target, False) is None  # n <= 512: not a GEMV


def test_tensor_core_rule_needs_sm80(kernels):
    from schedules.cuda import cuda_rules

    old = tvm.target.Target({"kind": "cuda", "arch": "sm_75", "host": {"kind": "llvm"}})
    assert not cuda_rules()[0].claims(kernels["prefill"], old)


@pytest.mark.parametrize("n", [1, 77, 300])
def test_tensor_core_schedule_numerics_on_cpu(spec, kernels, n):
    from schedules.cuda import cuda_rules
    from gpu_verify import run_on_cpu

    rule = cuda_rules(tensorize=False, narrow=False)[0]
    with spec.tvm_target():
        sch = rule.apply(kernels["prefill"], spec.tvm_target(), False)
    rng = np.random.default_rng(n)
    x = rng.standard_normal((1, n, K)).astype("float16")
    w = rng.standard_normal((N, K)).astype("float16")
    r = rng.standard_normal((1, n, N)).astype("float16")
    (out,) = run_on_cpu(sch.mod["main"], [x, w, r], [(1, n, N)], ["float16"])
    y = (x.astype("float32") @ w.astype("float32").T).astype("float16")   # fp32 accumulation
    ref = (_silu(y.astype("float32")).astype("float16") + r).astype("float32")
    np.testing.assert_allclose(out.astype("float32"), ref, rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("b", [1, 3, 8])
def test_gemv_schedule_numerics_on_cpu(spec, kernels, b):
    from schedules.cuda import cuda_rules
    from gpu_verify import run_on_cpu

    rule = cuda_rules()[1]
    with spec.tvm_target():
        sch = rule.apply(kernels["decode"], spec.tvm_target(), False)
    rng = np.random.default_rng(b)
    x = rng.standard_normal((b, 1, K)).astype("float16")
    w = rng.standard_normal((N, K)).astype("float16")
    r = rng.standard_normal((b, 1, N)).astype("float16")
    (out,) = run_on_cpu(sch.mod["main"], [x, w, r], [(b, 1, N)], ["float16"])
    ref = ((x.astype("float32") @ w.astype("float32").T).astype("float16") + r).astype("float32")
    np.testing.assert_allclose(out.astype("float32"), ref, rtol=4e-3, atol=4e-3)


def test_fragment_layout_matches_ptx_isa():
    """mma.sync m16n8k16 .f16 A and .f32 C fragments (PTX ISA, "Matrix Fragments for
    mma.m16n8k16"): thread t = 4 groupID + threadID_in_group holds a_i at row groupID
    (+8 for i in 2,3,6,7), col 2 threadID_in_group + i % 2 (+8 for i >= 4); the 16x16
    accumulator is two n8 halves (locals 0-3 and 4-7) of c_i at row groupID (+8 for i >= 2)."""
    from schedules.cuda.intrinsics import ldmatrix_layout

    seen = set()
    for t in range(32):
        g, tig = t // 4, t % 4
        for i in range(8):
            a_row = g + 8 * ((i // 2) % 2)
            a_col = 2 * tig + i % 2 + 8 * (i // 4)
            assert ldmatrix_layout(a_row, a_col) == (t, i)
            half, c = i // 4, i % 4
            c_row, c_col = g + 8 * (c // 2), 8 * half + 2 * tig + c % 2
            assert ldmatrix_layout(c_row, c_col) == (t, i)
            seen.add((a_row, a_col))
    assert len(seen) == 256


@pytest.fixture(scope="module")
def compiled(spec, tmp_path_factory):
    """The model built as the build does for sm_80, exported with PTX."""
    from gpu_verify import lower_for_scheduling

    target = spec.tvm_target()
    with target, tvm.transform.PassContext(opt_level=3, config=spec.pass_context_config()):
        mod = tvm.transform.Sequential(spec.schedule_passes())(lower_for_scheduling(Model))
        ex = tvm.compile(mod, target=target, tir_pipeline=spec.tir_pipeline())
    out = tmp_path_factory.mktemp("cuda_model")
    spec.export_library(ex, str(out / "model.so"))
    return ex, str(out / "model.so")


def test_every_kernel_is_bound_to_threads(compiled):
    from tvm_llm.targets.cuda import _device_modules

    ex, _ = compiled
    cuda = [m for m in _device_modules(ex.mod) if m.kind == "cuda"]
    src = cuda[0].inspect_source("cuda")
    assert src.count("__global__") >= 2
    assert "threadIdx.x" in src


def test_exported_ptx_uses_mma_sync_and_ldmatrix(spec, compiled):
    from tvm_llm.targets.cuda import count_instructions, parse_library_blob, read_library_blob, \
        split_cuda_module

    _, path = compiled
    (data,) = [d for kind, d in parse_library_blob(read_library_blob(path)) if kind == "cuda"]
    fmt, _, code = split_cuda_module(data)
    assert fmt == "ptx"
    ptx = code.decode().rstrip("\0")
    assert re.search(r"^\.target sm_80", ptx, re.M)
    counts = count_instructions(ptx)
    # 2x2 warps x (4x4 fragments x 2 mma.sync) per 16-wide K step, 2 steps per K tile
    assert counts["mma.sync"] >= 64 and counts["mma.sync"] % 32 == 0, counts
    assert counts["ldmatrix"] >= 16 and counts["ldmatrix"] % 8 == 0, counts
    # double buffering: A and W tiles fetched by cp.async (16-byte, zero-filled past the
    # edges), one commit group per K tile, waits that leave the next tile in flight
    assert counts["cp.async"] >= 4, counts
    assert counts["cp.async.commit_group"] >= 2 and counts["cp.async.wait_group"] >= 2, counts
    assert re.search(r"cp\.async\.wait_group 1;", ptx), "no wait that keeps one tile in flight"


def _te_matmul(k: int, nt: bool = True, m=None):
    from tvm import te

    m = m if m is not None else tvm.tirx.Var("n", "int64")
    x = te.placeholder((1, m, k), "float16", name="x")
    w = te.placeholder((256, k) if nt else (k, 256), "float16", name="w")
    r = te.reduce_axis((0, k), name="k")
    y = te.compute((1, m, 256), lambda b, i, j: te.sum(
        x[b, i, r] * (w[j, r] if nt else w[r, j]), axis=r), name="y")
    return te.create_prim_func([x, w, y])


def test_rules_leave_other_matmuls_to_dlight(spec):
    """Not claimed: W stored (K, N) (read across K), K not a whole number of 16-byte vectors,
    a small static M (a GEMV's)."""
    from schedules.cuda import cuda_rules

    tensor_core, gemv = cuda_rules()
    target = spec.tvm_target()
    assert tensor_core.claims(_te_matmul(128), target)
    assert not tensor_core.claims(_te_matmul(128, nt=False), target)
    assert not tensor_core.claims(_te_matmul(84), target)
    assert not tensor_core.claims(_te_matmul(128, m=4), target)
    with target:
        assert gemv.apply(_te_matmul(128, m=4), target, False) is not None
        assert gemv.apply(_te_matmul(84, m=4), target, False) is None


def test_scheduled_kernels_run_inside_the_relax_vm(kernels):
    """The rules' kernels keep the calling convention Relax expects (the GEMV's indices
    narrowed to int32 included): the whole module runs in the VM on the CPU, threads serialised."""
    from tvm import relax

    from schedules.cuda import cuda_rules
    from schedules.gpu.analysis import AnnotateSymbolicBounds
    from gpu_verify import lower_for_scheduling, serialize_threads
    from tvm_llm.targets import get_target

    target = get_target("cuda").tvm_target()
    mod = AnnotateSymbolicBounds()(lower_for_scheduling(Model))
    tensor_core, _ = cuda_rules(tensorize=False, narrow=False)
    _, gemv = cuda_rules()
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint:
            with target:
                sch = tensor_core.apply(func, target, False) or gemv.apply(func, target, False)
            mod[gv] = serialize_threads(sch.mod["main"]).with_attr("tirx.is_scheduled", True)
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"})), tvm.cpu())
    rng = np.random.default_rng(5)
    w = rng.standard_normal((N, K)).astype("float16")
    for fn, rows in (("prefill", (1, 37)), ("decode", (3, 1))):
        x = rng.standard_normal((*rows, K)).astype("float16")
        r = rng.standard_normal((*rows, N)).astype("float16")
        out = vm[fn](*(tvm.runtime.tensor(a) for a in (x, w, r))).numpy().astype("float32")
        y = (x.astype("float32") @ w.astype("float32").T).astype("float16").astype("float32")
        ref = (_silu(y) if fn == "prefill" else y) + r.astype("float32")
        np.testing.assert_allclose(out, ref, rtol=5e-3, atol=5e-3)
