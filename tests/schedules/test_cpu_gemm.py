"""CPU GEMM rule (packed weight panels): numerics on odd shapes, claims, build-time packing,
aarch64 NEON code."""
from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax

import cpu_workloads as workloads
from schedules.cpu import common, cpu_schedule_pass, prepack
from schedules.cpu.gemm import GEMM
from schedules.cpu.gemv import GEMV
from cpu_workloads import host_target, reference_linear


# (name, K, N, mode, epilogue): K/N not multiples of the tiles; N=100 needs a padded panel.
SPECS = [
    ("p_none", 72, 96, "prefill", None),
    ("p_bias", 64, 100, "prefill", "bias"),
    ("p_silu_mul", 80, 112, "prefill", "silu_mul"),
    ("d_residual", 64, 96, "decode", "residual"),
    ("d_silu", 72, 200, "decode", "silu"),
    ("t_none", 40, 48, "tokens", None),
]


@pytest.fixture(scope="module")
def packed_vm():
    """All SPECS in one module, weights marked layout-free, packing lifted to transform_params."""
    mod = workloads.linear_suite([dict(name=n, K=k, N=nn, mode=m, epilogue=e)
                                  for n, k, nn, m, e in SPECS])
    mod = relax.transform.AttachAttrLayoutFreeBuffers()(mod)
    target = host_target()
    with target:
        mod = cpu_schedule_pass()(mod)
        scheduled = workloads.prim_funcs(mod)
        mod = relax.transform.SplitLayoutRewritePreproc()(mod)
        mod = relax.transform.LiftTransformParams()(mod)
    ex = tvm.compile(mod, target=target)
    return relax.VirtualMachine(ex, tvm.cpu()), scheduled


def test_all_kernels_scheduled(packed_vm):
    _, funcs = packed_vm
    assert funcs and all(bool(f.attrs.get("tirx.is_scheduled", False)) for f in funcs.values())
    # the kernels carry the layout-rewrite block that SplitLayoutRewritePreproc splits out
    assert all(GEMM_MARK in f.script() for f in funcs.values())


GEMM_MARK = "meta_schedule.layout_rewrite_preproc"


@pytest.mark.parametrize("name,K,N,mode,epilogue", SPECS)
def test_packed_numerics(packed_vm, name, K, N, mode, epilogue):
    vm, _ = packed_vm
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((N, K)).astype("float32")
    bias = rng.standard_normal((N,)).astype("float32")
    ms = (1, 3, 8) if mode == "decode" else (1, 7, 129)
    for M in ms:
        xs = {"prefill": (1, M, K), "decode": (M, 1, K), "tokens": (M, K)}[mode]
        x = rng.standard_normal(xs).astype("float32")
        acts, weights, extra = [x], [w], None
        if epilogue == "bias":
            extra = bias
            weights.append(bias)
        elif epilogue in ("residual", "silu_mul"):
            extra = rng.standard_normal(xs[:-1] + (N,)).astype("float32")
            acts.append(extra)
        packed = vm[f"{name}_transform_params"]([tvm.runtime.tensor(a, dev) for a in weights])
        out = vm[name](*[tvm.runtime.tensor(a, dev) for a in acts], *packed).numpy()
        np.testing.assert_allclose(out, reference_linear(x, w, epilogue, extra), rtol=2e-4, atol=2e-3)


def test_claims():
    target = host_target()
    mod = workloads.linear(64, 96, "prefill", "bias")
    marked = relax.transform.AttachAttrLayoutFreeBuffers()(mod)
    f_marked = workloads.single_prim_func(marked)
    f_plain = workloads.single_prim_func(mod)
    assert GEMM().apply(f_marked, target, False) is not None
    # unmarked NT weight: the GEMM rule leaves it to GEMV (row-major), unless forced
    assert GEMM().apply(f_plain, target, False) is None
    assert GEMV().apply(f_plain, target, False) is not None
    assert GEMM(prepack=True).apply(f_plain, target, False) is not None
    add = workloads.single_prim_func(workloads.elementwise(64, op="add"))
    assert GEMM().apply(add, target, False) is None
    assert GEMV().apply(add, target, False) is None
    rms = workloads.single_prim_func(workloads.rms_norm(64))
    assert GEMM(prepack=True).apply(rms, target, False) is None


def test_nn_matmul_numerics():
    """x @ W with W stored (K, N): rows of W are contiguous in n, no packing needed."""
    target = host_target()
    mod = workloads.linear(48, 80, "prefill", "silu", layout="NN")
    with target:
        mod = cpu_schedule_pass()(mod)
    assert all(bool(f.attrs.get("tirx.is_scheduled", False))
               for f in workloads.prim_funcs(mod).values())
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 80)).astype("float32")
    for M in (1, 7, 129):
        x = rng.standard_normal((1, M, 48)).astype("float32")
        out = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
        np.testing.assert_allclose(out, reference_linear(x, w.T, "silu", None), rtol=2e-4, atol=2e-3)


def test_shared_prepack_between_prefill_and_decode():
    """Prefill and decode take the same weight: one packed copy in one transform_params."""
    K, N = 64, 96
    bb = relax.BlockBuilder()
    for name, mode in (("prefill", "prefill"), ("decode", "decode")):
        x = relax.Var("x", relax.TensorType(workloads._x_shape(mode, K), "float32"))
        w = relax.Var("w", relax.TensorType((N, K), "float32"))
        with bb.function(name, [x, w], attrs={"num_input": 1}):
            with bb.dataflow():
                out = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
            bb.emit_func_output(out)
    mod = workloads.lower_to_tir(bb.get())
    mod = relax.transform.AttachAttrLayoutFreeBuffers()(mod)
    target = host_target()
    with target:
        mod = cpu_schedule_pass()(mod)
        mod = tvm.transform.Sequential(prepack.prepack_passes())(mod)
    tp = mod["transform_params"]
    assert len(tp.ret_ty.fields) == 1  # one packed weight, shared
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    rng = np.random.default_rng(2)
    w = rng.standard_normal((N, K)).astype("float32")
    packed = vm["transform_params"]([tvm.runtime.tensor(w)])
    x = rng.standard_normal((1, 5, K)).astype("float32")
    np.testing.assert_allclose(vm["prefill"](tvm.runtime.tensor(x), *packed).numpy(), x @ w.T,
                               rtol=2e-4, atol=2e-3)
    x = rng.standard_normal((2, 1, K)).astype("float32")
    np.testing.assert_allclose(vm["decode"](tvm.runtime.tensor(x), *packed).numpy(), x @ w.T,
                               rtol=2e-4, atol=2e-3)


def test_target_features():
    host = host_target()
    arm = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]})
    avx2 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell"})
    skx = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu",
                             "mcpu": "skylake-avx512"})
    assert common.vector_isa(arm) == "neon" and common.vector_lanes(arm) == 4
    assert common.vector_isa(avx2) == "avx2" and common.vector_lanes(avx2) == 8
    assert common.vector_isa(skx) == "avx512" and common.vector_lanes(skx) == 16
    assert common.vector_isa(host) in ("avx512", "avx2", "sse")


def test_aarch64_neon_fmla():
    arm = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]})
    mod = workloads.linear_suite([dict(name="p", K=64, N=96, mode="prefill", epilogue="silu"),
                                  dict(name="d", K=64, N=96, mode="decode", epilogue="bias")])
    mod = relax.transform.AttachAttrLayoutFreeBuffers()(mod)
    with arm:
        mod = cpu_schedule_pass()(mod)
    assert all(bool(f.attrs.get("tirx.is_scheduled", False))
               for f in workloads.prim_funcs(mod).values())
    mod = relax.transform.SplitLayoutRewritePreproc()(mod)
    ex = tvm.compile(mod, target=arm)
    asm = ex.mod.imports[0].inspect_source("asm")
    assert len(re.findall(r"\bfmla\s+v\d+\.4s", asm)) >= 16


@pytest.mark.skipif(not tvm.target.codegen.llvm_cpu_has_features("avx2", host_target()),
                    reason="host cannot run AVX2 code")
def test_avx2_target_numerics():
    """The same rules on an AVX2-only target (8 lanes, 16 registers): packed and row-major."""
    target = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell",
                                "num-cores": 2})
    mod = workloads.linear_suite([dict(name="p", K=72, N=100, mode="prefill", epilogue="silu"),
                                  dict(name="d", K=72, N=100, mode="decode", epilogue=None)])
    rng = np.random.default_rng(3)
    w = rng.standard_normal((100, 72)).astype("float32")
    for marked in (True, False):
        m = relax.transform.AttachAttrLayoutFreeBuffers()(mod) if marked else mod
        with target:
            m = cpu_schedule_pass()(m)
            assert all(bool(f.attrs.get("tirx.is_scheduled", False))
                       for f in workloads.prim_funcs(m).values())
            m = relax.transform.SplitLayoutRewritePreproc()(m)
            m = relax.transform.LiftTransformParams()(m)
        vm = relax.VirtualMachine(tvm.compile(m, target=target), tvm.cpu())
        for name, xs, epi in (("p", (1, 129, 72), "silu"), ("d", (3, 1, 72), None)):
            x = rng.standard_normal(xs).astype("float32")
            wp = (vm[f"{name}_transform_params"]([tvm.runtime.tensor(w)]) if marked
                  else [tvm.runtime.tensor(w)])
            out = vm[name](tvm.runtime.tensor(x), *wp).numpy()
            np.testing.assert_allclose(out, reference_linear(x, w, epi, None), rtol=2e-4, atol=2e-3)


# --------------------------------------------------------------------------- bfloat16 weights

BF16_SPECS = [("bp_none", 72, 96, "prefill", None), ("bp_bias", 64, 100, "prefill", "bias"),
              ("bd_residual", 64, 96, "decode", "residual"), ("bd_silu", 72, 200, "decode", "silu")]


def _assert_bf16_linear(out, x, w, epilogue, extra, msg: str):
    """`out` of a bfloat16 linear equals numpy on the same bf16 inputs, summed in float64: the
    kernel rounds the float32 sum to bf16, then the epilogue rounds again."""
    y = (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32).astype(x.dtype)
    ref = reference_linear(y.astype(np.float64), np.eye(w.shape[0]), epilogue,
                           None if extra is None else extra.astype(np.float64))
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=2e-2, atol=2e-2, err_msg=msg)


def _bf16_suite(specs, layout_free: bool = True):
    """The bfloat16 linears of `specs` (AccumulateHalfMatmulInFloat32: float32 sums), their
    weights marked layout-free (packed at build time) unless `layout_free` is False."""
    from tvm_llm.passes.accumulate_half_matmul import AccumulateHalfMatmulInFloat32

    mod = workloads.linear_suite([dict(name=n, K=k, N=nn, mode=m, epilogue=e, dtype="bfloat16")
                                  for n, k, nn, m, e in specs],
                                 graph_passes=[AccumulateHalfMatmulInFloat32()])
    return relax.transform.AttachAttrLayoutFreeBuffers()(mod) if layout_free else mod


@pytest.mark.parametrize("prepack_weights", [True, False], ids=["packed", "row_major"])
def test_bfloat16_linear_equals_numpy(prepack_weights):
    """A bfloat16 linear (AccumulateHalfMatmulInFloat32: float32 sum, one rounding) through the
    GEMM rule (weight packed at build time, still bfloat16) or the GEMV rule (row-major
    bfloat16 weight) equals numpy on the same bf16-rounded inputs, summed in float64."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    mod = _bf16_suite(BF16_SPECS, layout_free=prepack_weights)
    target = host_target()
    with target:
        mod = cpu_schedule_pass(prepack="auto" if prepack_weights else False)(mod)
        funcs = workloads.prim_funcs(mod)
        mod = relax.transform.SplitLayoutRewritePreproc()(mod)
        mod = relax.transform.LiftTransformParams()(mod)
    matmuls = {k: f for k, f in funcs.items() if "matmul" in k}
    assert matmuls and all(bool(f.attrs.get("tirx.is_scheduled", False)) for f in matmuls.values())
    assert all((GEMM_MARK in f.script()) == prepack_weights for f in matmuls.values())
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    dev = tvm.cpu()
    rng = np.random.default_rng(1)
    for name, K, N, mode, epilogue in BF16_SPECS:
        w = rng.standard_normal((N, K)).astype(bf16)
        bias = rng.standard_normal((N,)).astype(bf16)
        for M in ((1, 3) if mode == "decode" else (1, 9)):
            xs = {"prefill": (1, M, K), "decode": (M, 1, K)}[mode]
            x = rng.standard_normal(xs).astype(bf16)
            acts, weights, extra = [x], [w], None
            if epilogue == "bias":
                extra = bias
                weights.append(bias)
            elif epilogue == "residual":
                extra = rng.standard_normal(xs[:-1] + (N,)).astype(bf16)
                acts.append(extra)
            if prepack_weights:
                weights = vm[f"{name}_transform_params"]([tvm.runtime.tensor(a, dev) for a in weights])
                assert str(weights[0].dtype) == "bfloat16"  # packed, still 2 bytes per weight
            else:
                weights = [tvm.runtime.tensor(a, dev) for a in weights]
            out = vm[name](*[tvm.runtime.tensor(a, dev) for a in acts], *weights).numpy()
            assert out.dtype == bf16
            _assert_bf16_linear(out, x, w, epilogue, extra, f"{name} M={M}")


def _matmul_reads(func) -> dict:
    """{block name: dtypes of the buffers it reads} for the matmul blocks of `func`."""
    sch = tvm.s_tir.Schedule(func)
    blocks = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    return {b.name_hint: {str(r.source.dtype) for r in b.reads}
            for b in blocks if "matmul" in b.name_hint}


def _update_reads(spec, mcpu: str) -> set:
    """The dtypes the matmul's accumulating block reads, one bfloat16 linear on `mcpu`."""
    with tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": mcpu,
                            "num-cores": 2}):
        (func,) = workloads.prim_funcs(cpu_schedule_pass()(_bf16_suite([spec]))).values()
    return set().union(*(v for k, v in _matmul_reads(func).items() if "_update" in k))


@pytest.mark.skipif(not tvm.target.codegen.llvm_cpu_has_features("avx2", host_target()),
                    reason="host cannot run AVX2 code")
def test_bfloat16_prefill_widens_once_on_avx2():
    """Without vdpbf16ps (an AVX2 target), a bfloat16 prefill's FMAs read float32 copies (the
    activations widened once per call, each packed weight panel once per parallel iteration)
    while decode widens in registers; on an AVX512-BF16 CPU the prefill keeps its bfloat16
    operands (vdpbf16ps). The weight stays stored as bfloat16. Numerics equal numpy on the
    same bf16 inputs, including a padded panel (N = 100) and row counts around the tile."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    specs = [("p", 72, 96, "prefill", None), ("pp", 64, 100, "prefill", "bias"),
             ("d", 72, 96, "decode", None)]
    assert _update_reads(specs[0], "haswell") == {"float32"}
    assert _update_reads(specs[1], "haswell") == {"float32"}
    assert "bfloat16" in _update_reads(specs[2], "haswell")
    assert "bfloat16" in _update_reads(specs[0], "sapphirerapids")
    target = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell",
                                "num-cores": 2})
    with target:
        mod = cpu_schedule_pass()(_bf16_suite(specs))
        mod = relax.transform.SplitLayoutRewritePreproc()(mod)
        mod = relax.transform.LiftTransformParams()(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    dev = tvm.cpu()
    rng = np.random.default_rng(5)
    for name, K, N, mode, epilogue in specs:
        w = rng.standard_normal((N, K)).astype(bf16)
        bias = rng.standard_normal((N,)).astype(bf16)
        weights = [w] + ([bias] if epilogue == "bias" else [])
        wp = vm[f"{name}_transform_params"]([tvm.runtime.tensor(a, dev) for a in weights])
        assert str(wp[0].dtype) == "bfloat16"
        for M in ((1, 2) if mode == "decode" else (1, 3, 4, 9, 130)):
            x = rng.standard_normal((1, M, K) if mode == "prefill" else (M, 1, K)).astype(bf16)
            out = vm[name](tvm.runtime.tensor(x, dev), *wp).numpy()
            _assert_bf16_linear(out, x, w, epilogue, None if epilogue is None else bias,
                                f"{name} M={M}")


# (name, K, N, mode, epilogue) run in k blocks: the host CPU's row given a small block limit
K_BLOCKED = [
    ("k_none", 600, 96, "prefill", None),
    ("k_residual", 512, 100, "prefill", "residual"),
    ("k_silu_mul", 640, 112, "tokens", "silu_mul"),
]


def test_k_blocked_gemm_equals_numpy(monkeypatch):
    """A float32 prefill GEMM whose panel exceeds the CPU row's gemm_k_block_bytes runs in k
    blocks (partial tiles summed per panel, then the epilogue): equal to numpy for full and
    partial row tiles, padded panels and epilogues, compiled with the build's TIR pipeline."""
    import dataclasses

    from schedules.cpu import gemm, microarch
    from schedules.cpu.pipeline import cpu_tir_pipeline

    row = microarch.tile_row
    monkeypatch.setattr(microarch, "tile_row",
                        lambda t: dataclasses.replace(row(t), gemm_k_block_bytes=16 << 10))
    monkeypatch.setattr(gemm, "MIN_K_BLOCK", 16)  # small shapes, many blocks
    target = host_target()
    one = workloads.linear_suite([dict(name="k", K=600, N=96, mode="prefill")])
    pat = common.prepare_matmul(next(iter(workloads.prim_funcs(one).values())))[1]
    assert gemm.k_blocks(target, pat, 48) == 8  # 600 / 8 x 48 x 4 B <= 16 KiB
    mod = workloads.linear_suite([dict(name=n, K=k, N=nn, mode=m, epilogue=e)
                                  for n, k, nn, m, e in K_BLOCKED])
    mod = relax.transform.AttachAttrLayoutFreeBuffers()(mod)
    with target:
        mod = cpu_schedule_pass()(mod)
        assert all("_rf" in f.script() for f in workloads.prim_funcs(mod).values()), \
            "not k-blocked"
        mod = relax.transform.SplitLayoutRewritePreproc()(mod)
        mod = relax.transform.LiftTransformParams()(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, target=target, tir_pipeline=cpu_tir_pipeline()),
                              tvm.cpu())
    dev, rng = tvm.cpu(), np.random.default_rng(1)
    for name, K, N, mode, epilogue in K_BLOCKED:
        w = rng.standard_normal((N, K)).astype("float32")
        packed = vm[f"{name}_transform_params"]([tvm.runtime.tensor(w, dev)])
        for M in (1, 7, 40):
            xs = (1, M, K) if mode == "prefill" else (M, K)
            x = rng.standard_normal(xs).astype("float32")
            extra = None if epilogue is None else rng.standard_normal(xs[:-1] + (N,)).astype("float32")
            acts = [x] + ([extra] if extra is not None else [])
            out = vm[name](*[tvm.runtime.tensor(a, dev) for a in acts], *packed).numpy()
            np.testing.assert_allclose(out, reference_linear(x, w, epilogue, extra),
                                       rtol=2e-4, atol=2e-3, err_msg=f"{name} M={M}")
