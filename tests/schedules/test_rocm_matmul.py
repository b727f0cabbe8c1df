"""ROCm rules: MFMA GEMM with 64x64 wavefront tiles (fp16, int8 16x16x32 on gfx942), decode GEMV.

No GPU here: claims, schedule structure and AMDGPU assembly are checked, and each rule's loop
structure runs on the CPU with threads serialised and intrinsics left as their descriptions.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import te
from tvm.script import ir as I
from tvm.script import relax as R

K, N = 80, 320


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

    return get_target("rocm", arch="gfx942")


@pytest.fixture(scope="module")
def kernels():
    from schedules.gpu.analysis import AnnotateSymbolicBounds
    from gpu_verify import lower_for_scheduling

    mod = AnnotateSymbolicBounds()(lower_for_scheduling(Model))
    found = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint:
            kind = "decode" if "b" in str(func.attrs.get("tir_var_upper_bound", {})) else "prefill"
            found[kind] = func
    assert set(found) == {"prefill", "decode"}
    return found


def test_rules_claim_prefill_gemm_and_decode_gemv(spec, kernels):
    from schedules.rocm import rocm_rules

    mfma, mfma_i8, gemv = rocm_rules()
    target = spec.tvm_target()
    assert mfma.claims(kernels["prefill"], target)
    assert not mfma.claims(kernels["decode"], target)
    assert not mfma_i8.claims(kernels["prefill"], target)       # fp16: not the int8 rule's
    with target:
        assert gemv.apply(kernels["decode"], target, False) is not None
        assert gemv.apply(kernels["prefill"], target, False) is None


def test_wavefront_tile_is_64x64(spec, kernels):
    """2x2 wavefronts of 64 lanes per workgroup; each wavefront runs 4x4 MFMA 16x16 per
    16-wide K step (a 64x64 output tile) and 2 K steps per 32-wide LDS tile."""
    from schedules.rocm import rocm_rules

    target = spec.tvm_target()
    with target:
        sch = rocm_rules()[0].apply(kernels["prefill"], target, False)
    loops = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock("NT_matmul_o_update"))]
    threads = {str(lp.thread_binding.thread_tag): lp.extent for lp in loops
               if lp.thread_binding is not None}
    serial = [int(lp.extent) for lp in loops if lp.thread_binding is None and isinstance(lp.extent, tvm.tirx.IntImm)]
    assert int(threads["threadIdx.y"]) == 4              # 2 x 2 wavefronts
    assert serial[-3:] == [2, 4, 4]                      # K steps per LDS tile, 4x4 MFMA tiles
    text = sch.mod.script()
    assert text.count("llvm.amdgcn.mfma.f32.16x16x16f16") == 1
    assert re.search(r'T\.launch_thread\("threadIdx\.x", (T\.int64\()?64\b', text)  # 64-lane waves


@pytest.mark.parametrize("n", [1, 77, 300])
def test_mfma_schedule_numerics_on_cpu(spec, kernels, n):
    from gpu_verify import run_on_cpu
    from schedules.rocm import rocm_rules

    with spec.tvm_target():
        sch = rocm_rules(tensorize=False, narrow=False)[0].apply(kernels["prefill"], spec.tvm_target(), False)
    rng = np.random.default_rng(n)
    x = rng.standard_normal((1, n, K)).astype("float16")
    w = rng.standard_normal((N, K)).astype("float16")
    r = rng.standard_normal((1, n, N)).astype("float16")
    (out,) = run_on_cpu(sch.mod["main"], [x, w, r], [(1, n, N)], ["float16"])
    y = (x.astype("float32") @ w.astype("float32").T).astype("float16")
    ref = (_silu(y.astype("float32")).astype("float16") + r).astype("float32")
    np.testing.assert_allclose(out.astype("float32"), ref, rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("b", [2, 8])
def test_gemv_schedule_numerics_on_cpu(spec, kernels, b):
    from gpu_verify import run_on_cpu
    from schedules.rocm import rocm_rules

    with spec.tvm_target():
        sch = rocm_rules()[2].apply(kernels["decode"], spec.tvm_target(), False)
    rng = np.random.default_rng(b)
    x = rng.standard_normal((b, 1, K)).astype("float16")
    w = rng.standard_normal((N, K)).astype("float16")
    r = rng.standard_normal((b, 1, N)).astype("float16")
    (out,) = run_on_cpu(sch.mod["main"], [x, w, r], [(b, 1, N)], ["float16"])
    ref = ((x.astype("float32") @ w.astype("float32").T).astype("float16") + r).astype("float32")
    np.testing.assert_allclose(out.astype("float32"), ref, rtol=4e-3, atol=4e-3)


def test_fragment_layouts_match_mfma_operand_layout():
    """CDNA MFMA 16x16 layouts (AMD matrix instruction calculator): for 16x16x16 f16 lane l
    holds A[l % 16][4 (l // 16) + v] and B[4 (l // 16) + v][l % 16] (v < 4); 16x16x32 i8 the
    same with 8 (l // 16) + v (v < 8); the accumulator D[4 (l // 16) + v][l % 16]."""
    from schedules.rocm.intrinsics import accumulator_layout, operand_layout, operand_layout_k32

    for lane in range(64):
        for v in range(4):
            assert operand_layout(lane % 16, 4 * (lane // 16) + v) == (lane, v)  # A (i, k), W (n, k)
            assert accumulator_layout(4 * (lane // 16) + v, lane % 16) == (lane, v)
        for v in range(8):
            assert operand_layout_k32(lane % 16, 8 * (lane // 16) + v) == (lane, v)


def _int8_kernel(m=96, n=192, k=160):
    a = te.placeholder((1, m, k), "int8", name="A")
    w = te.placeholder((n, k), "int8", name="W")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((1, m, n), lambda b, i, j: te.sum(a[b, i, r].astype("int32") * w[j, r].astype("int32"), axis=r), name="C")
    return te.create_prim_func([a, w, c])


def test_int8_mfma_k32_emits_v_mfma_i32_16x16x32_i8(spec):
    from schedules.rocm import rocm_rules

    target = spec.tvm_target()
    with target:
        sch = rocm_rules()[1].apply(_int8_kernel(), target, False)
    mod = tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")})
    with tvm.transform.PassContext(opt_level=3, config=spec.pass_context_config()):
        ex = tvm.compile(mod, target=target, tir_pipeline=spec.tir_pipeline())
    asm = ex.mod.imports[0].inspect_source("asm")
    ops = re.findall(r"^\s*(v_mfma_\w+)", asm, re.M)
    assert ops and set(ops) == {"v_mfma_i32_16x16x32_i8"}
    assert len(ops) % 16 == 0


def test_int8_mfma_k32_not_on_gfx90a():
    from schedules.rocm import rocm_rules
    from tvm_llm.targets import get_target

    target = get_target("rocm", arch="gfx90a").tvm_target()
    assert not rocm_rules()[1].claims(_int8_kernel(), target)


def test_int8_schedule_numerics_on_cpu(spec):
    from gpu_verify import run_on_cpu
    from schedules.rocm import rocm_rules

    with spec.tvm_target():
        sch = rocm_rules(tensorize=False, narrow=False)[1].apply(_int8_kernel(), spec.tvm_target(), False)
    rng = np.random.default_rng(0)
    a = rng.integers(-128, 128, (1, 96, 160)).astype("int8")
    w = rng.integers(-128, 128, (192, 160)).astype("int8")
    (out,) = run_on_cpu(sch.mod["main"], [a, w], [(1, 96, 192)], ["int32"])
    np.testing.assert_array_equal(out, a.astype("int32") @ w.astype("int32").T)


@pytest.mark.parametrize("arch", ["gfx90a", "gfx942"])
def test_model_assembly_uses_mfma(arch, tmp_path):
    from gpu_verify import lower_for_scheduling
    from tvm_llm.targets import get_target

    spec = get_target("rocm", arch=arch)
    target = spec.tvm_target()
    with target, tvm.transform.PassContext(opt_level=3, config=spec.pass_context_config()):
        mod = tvm.transform.Sequential(spec.schedule_passes())(lower_for_scheduling(Model))
        ex = tvm.compile(mod, target=target, tir_pipeline=spec.tir_pipeline())
    files = spec.emit_source(ex, str(tmp_path))
    asm = open(tmp_path / "device.s").read()
    ops = re.findall(r"^\s*(v_mfma_\w+)", asm, re.M)
    # gfx90a spells it v_mfma_f32_16x16x16f16, gfx942 v_mfma_f32_16x16x16_f16
    assert ops and all(re.fullmatch(r"v_mfma_f32_16x16x16_?f16", op) for op in ops), set(ops)
    assert len(ops) % 16 == 0                          # 4x4 per wavefront per K step
    assert "host.s" in [f.rsplit("/", 1)[-1] for f in files]
