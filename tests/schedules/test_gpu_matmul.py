"""GPU rules, CUDA and ROCm: the tensor-core GEMM (ldmatrix + mma.sync; MFMA with 64x64
wavefront tiles, int8 16x16x32 on gfx942) for prefill, the GEMV for decode.

No GPU here: the rules' claims, generated PTX and AMDGPU assembly are checked, and each rule's
loop structure is run on the CPU with thread bindings serialised and the tensor intrinsics
left as their plain descriptions (tests/gpu_verify.py), against numpy. The tests both targets
share are parametrized over the target; the rest are each target's own.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import te
from tvm.script import ir as I
from tvm.script import relax as R

K, N = 80, 320   # neither a multiple of the 32-wide K tile nor of the 128-wide N tile
ARCHS = {"cuda": "sm_80", "rocm": "gfx942"}

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


def _spec(kind):
    from tvm_llm.targets import get_target

    return get_target(kind, arch=ARCHS[kind])


def _rules(kind, **options):
    """(tensor-core GEMM rule, decode GEMV rule) of the target."""
    if kind == "cuda":
        from schedules.cuda import cuda_rules

        gemm, gemv = cuda_rules(**options)
    else:
        from schedules.rocm import rocm_rules

        gemm, _, gemv = rocm_rules(**options)
    return gemm, gemv


@pytest.fixture(scope="module")
def spec():
    return _spec("cuda")


@pytest.fixture(scope="module")
def rocm_spec():
    return _spec("rocm")


@pytest.fixture(scope="module")
def kernels():
    """{"prefill"|"decode": the fused matmul PrimFunc}, bounds annotated as the build does."""
    from gpu_verify import lower_for_scheduling
    from schedules.gpu.analysis import AnnotateSymbolicBounds

    mod = AnnotateSymbolicBounds()(lower_for_scheduling(Model))
    found = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint:
            kind = "decode" if "b" in str(func.attrs.get("tir_var_upper_bound", {})) else "prefill"
            found[kind] = func
    assert set(found) == {"prefill", "decode"}, list(mod.get_global_vars())
    return found


# ------------------------------------------------------------------ both targets
@pytest.mark.parametrize("kind", ["cuda", "rocm"])
def test_rules_claim_prefill_gemm_and_decode_gemv(kind, kernels):
    tensor_core, gemv = _rules(kind)
    target = _spec(kind).tvm_target()
    assert tensor_core.claims(kernels["prefill"], target)
    assert not tensor_core.claims(kernels["decode"], target)   # b <= 8: decode
    with target:
        assert gemv.apply(kernels["decode"], target, False) is not None
        assert gemv.apply(kernels["prefill"], target, False) is None  # n <= 512: not a GEMV


@pytest.mark.parametrize("kind,n", [(k, n) for k in ("cuda", "rocm") for n in (1, 77, 300)])
def test_tensor_core_schedule_numerics_on_cpu(kind, kernels, n):
    from gpu_verify import run_on_cpu

    rule, _ = _rules(kind, tensorize=False, narrow=False)
    target = _spec(kind).tvm_target()
    with target:
        sch = rule.apply(kernels["prefill"], target, False)
    rng = np.random.default_rng(n)
    x = rng.standard_normal((1, n, K)).astype("float16")
    w = rng.standard_normal((N, K)).astype("float16")
    r = rng.standard_normal((1, n, N)).astype("float16")
    (out,) = run_on_cpu(sch.mod["main"], [x, w, r], [(1, n, N)], ["float16"])
    y = (x.astype("float32") @ w.astype("float32").T).astype("float16")   # fp32 accumulation
    ref = (_silu(y.astype("float32")).astype("float16") + r).astype("float32")
    np.testing.assert_allclose(out.astype("float32"), ref, rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("kind,b", [("cuda", 1), ("cuda", 3), ("cuda", 8), ("rocm", 2),
                                    ("rocm", 8)])
def test_gemv_schedule_numerics_on_cpu(kind, kernels, b):
    from gpu_verify import run_on_cpu

    _, rule = _rules(kind)
    target = _spec(kind).tvm_target()
    with target:
        sch = rule.apply(kernels["decode"], target, False)
    rng = np.random.default_rng(b)
    x = rng.standard_normal((b, 1, K)).astype("float16")
    w = rng.standard_normal((N, K)).astype("float16")
    r = rng.standard_normal((b, 1, N)).astype("float16")
    (out,) = run_on_cpu(sch.mod["main"], [x, w, r], [(b, 1, N)], ["float16"])
    ref = ((x.astype("float32") @ w.astype("float32").T).astype("float16") + r).astype("float32")
    np.testing.assert_allclose(out.astype("float32"), ref, rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("kind", ["cuda", "rocm"])
def test_gemv_schedules_a_decode_of_one_row(kind):
    """A build with max_batch_size 1 bounds decode's batch by 1: the GEMV has a single row, for
    which reverse_compute_at makes no row loop (the rule failed on it, and dlight's generic
    fallback ran the model's weight matmuls at 80-420 GB/s on an H200)."""
    from gpu_verify import lower_for_scheduling, run_on_cpu
    from schedules.gpu.analysis import AnnotateSymbolicBounds

    one_row = tvm.IRModule({"decode": Model["decode"].with_attr("tir_var_upper_bound", {"b": 1})})
    mod = AnnotateSymbolicBounds()(lower_for_scheduling(one_row))
    (func,) = [f for gv, f in mod.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint]
    _, rule = _rules(kind)
    target = _spec(kind).tvm_target()
    with target:
        sch = rule.apply(func, target, False)
    assert sch is not None
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 1, K)).astype("float16")
    w = rng.standard_normal((N, K)).astype("float16")
    r = rng.standard_normal((1, 1, N)).astype("float16")
    (out,) = run_on_cpu(sch.mod["main"], [x, w, r], [(1, 1, N)], ["float16"])
    ref = ((x.astype("float32") @ w.astype("float32").T).astype("float16") + r).astype("float32")
    np.testing.assert_allclose(out.astype("float32"), ref, rtol=4e-3, atol=4e-3)


# ------------------------------------------------------------------ CUDA
def test_tensor_core_rule_needs_sm80(kernels):
    from schedules.cuda import cuda_rules

    old = tvm.target.Target({"kind": "cuda", "arch": "sm_75", "host": {"kind": "llvm"}})
    assert not cuda_rules()[0].claims(kernels["prefill"], old)


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


# ------------------------------------------------------------------ ROCm
def test_int8_rule_leaves_fp16_matmuls_to_the_mfma_rule(rocm_spec, kernels):
    from schedules.rocm import rocm_rules

    assert not rocm_rules()[1].claims(kernels["prefill"], rocm_spec.tvm_target())


def test_wavefront_tile_is_64x64(rocm_spec, kernels):
    """2x2 wavefronts of 64 lanes per workgroup; each wavefront runs 4x4 MFMA 16x16 per
    16-wide K step (a 64x64 output tile) and 2 K steps per 32-wide LDS tile."""
    from schedules.rocm import rocm_rules

    target = rocm_spec.tvm_target()
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


def test_int8_mfma_k32_emits_v_mfma_i32_16x16x32_i8(rocm_spec):
    from schedules.rocm import rocm_rules

    target = rocm_spec.tvm_target()
    with target:
        sch = rocm_rules()[1].apply(_int8_kernel(), target, False)
    mod = tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")})
    with tvm.transform.PassContext(opt_level=3, config=rocm_spec.pass_context_config()):
        ex = tvm.compile(mod, target=target, tir_pipeline=rocm_spec.tir_pipeline())
    asm = ex.mod.imports[0].inspect_source("asm")
    ops = re.findall(r"^\s*(v_mfma_\w+)", asm, re.M)
    assert ops and set(ops) == {"v_mfma_i32_16x16x32_i8"}
    assert len(ops) % 16 == 0


def test_int8_mfma_k32_not_on_gfx90a():
    from schedules.rocm import rocm_rules
    from tvm_llm.targets import get_target

    target = get_target("rocm", arch="gfx90a").tvm_target()
    assert not rocm_rules()[1].claims(_int8_kernel(), target)


def test_int8_schedule_numerics_on_cpu(rocm_spec):
    from gpu_verify import run_on_cpu
    from schedules.rocm import rocm_rules

    with rocm_spec.tvm_target():
        sch = rocm_rules(tensorize=False, narrow=False)[1].apply(_int8_kernel(), rocm_spec.tvm_target(), False)
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
