"""Quantize / dequantize: the numpy reference's error bounds, and the build's TE kernels
computing exactly the same stored values and matmul results."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, te

from schedules.cpu import cpu_schedule_pass, workloads
from tvm_llm.errors import UserError
from tvm_llm.passes.quantize_linear import emit_quantized_matmul
from tvm_llm.quantization import kernels
from tvm_llm.quantization.scheme import (QuantScheme, dequantize_np, pack_q4_np, parse_scheme,
                                         quantize_np, stored_np, unpack_q4_np)

Q8, Q4 = QuantScheme("q8"), QuantScheme("q4")
W8A8, W4A8 = QuantScheme("q8", activations="int8"), QuantScheme("q4", activations="int8")


def _weights(N=48, K=128, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((N, K)) * 0.05).astype("float32")
    w[3, 40:72] *= 30  # an outlier group
    w[5, :32] = 0.0  # an all-zero group
    return w


@pytest.mark.parametrize("scheme", [Q8, Q4, W8A8, QuantScheme("q4", group_size=64)])
def test_round_trip_error_is_within_half_a_step(scheme):
    w = _weights()
    q, s = quantize_np(w, scheme)
    G = scheme.group_for(w.shape[1])
    d = np.abs(s.astype(np.float32))[..., None].repeat(G, -1).reshape(w.shape)
    err = np.abs(dequantize_np(q, s, scheme) - w)
    lo, hi = (-127, 127) if scheme.bits == 8 else (-8, 7)
    assert q.min() >= lo and q.max() <= hi
    inside = (q > lo) & (q < hi)
    assert np.all(err[inside] <= 0.5 * d[inside] * (1 + 1e-5) + 1e-12)
    # q4 clips the far side of a group to +7: at most one step there
    assert np.all(err <= d * (1 + 1e-5) + 1e-12)
    assert np.all(np.isfinite(s)) and np.all(q[5, :32] == 0) if G == 32 else True
    rel = np.linalg.norm(err) / np.linalg.norm(w)
    assert rel < (0.01 if scheme.bits == 8 else 0.12), rel


def test_q4_largest_magnitude_maps_to_minus_eight():
    w = _weights()
    q, _ = quantize_np(w, Q4)
    g = w.reshape(w.shape[0], -1, 32)
    idx = np.abs(g).argmax(-1)
    qg = q.reshape(g.shape)
    picked = np.take_along_axis(qg, idx[..., None], -1)[..., 0]
    nonzero = np.abs(g).max(-1) > 0
    assert np.all(picked[nonzero] == -8)


def test_q4_pack_unpack_round_trip():
    q = np.random.default_rng(1).integers(-8, 8, size=(16, 96)).astype(np.int8)
    packed = pack_q4_np(q, 32)
    assert packed.shape == (16, 3, 16) and packed.dtype == np.uint8
    assert np.array_equal(unpack_q4_np(packed), q)


def _run_te(fn, inputs, out_count):
    ph = [te.placeholder(a.shape, str(a.dtype)) for a in inputs]
    outs = fn(*ph)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    func = te.create_prim_func(ph + outs[:out_count])
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in inputs]
    res = [tvm.runtime.empty([int(d) for d in o.shape], o.dtype, dev) for o in outs[:out_count]]
    lib["main"](*args, *res)
    return [r.numpy() for r in res]


@pytest.mark.parametrize("scheme", [Q8, Q4, W8A8, W4A8], ids=["q8", "q4", "w8a8", "w4a8"])
def test_build_time_quantize_kernel_equals_numpy_reference(scheme):
    w = _weights()
    want = stored_np(w, scheme)
    got = _run_te(lambda t: kernels.quantize_weight(t, scheme), [w], len(want))
    for g, e in zip(got, want):
        assert g.shape == e.shape and np.array_equal(g, e)


def test_w4a8_layout_holds_q_plus_8_in_vnni_tiles():
    w = _weights()
    q, _ = quantize_np(w, W4A8)
    wp, ws = stored_np(w, W4A8)
    # row 17 (tile 1, lane 1), input 32 + 4*3 + 2 (group 1, tile 3 = high nibble of chunk 1)
    assert (wp[1, 1, 1, 1 * 4 + 2] >> 4) == q[17, 32 + 14] + 8
    assert (wp[1, 1, 1, 1 * 4 + 2] & 15) == q[17, 32 + 10] + 8  # tile 2: low nibble
    assert ws.shape == (3, 4, 16)


def _scheduled_matmul(K, N, scheme, x_shape):
    """The pass's matmul kernel (x of x_shape, may be symbolic) scheduled by our CPU rules."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(x_shape), "float32"))
    ws = [relax.Var(f"w{i}", relax.TensorType(shape, dtype))
          for i, (shape, dtype) in enumerate(kernels.stored_shapes(N, K, scheme))]
    with bb.function("main", [x] + ws):
        with bb.dataflow():
            y = bb.emit(emit_quantized_matmul(bb, x, ws, scheme, K, N, "float32"))
            y = bb.emit(relax.op.nn.silu(y))  # an epilogue FuseOps fuses into the matmul
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    target = workloads.host_target(2)
    with target, tvm.transform.PassContext(opt_level=3):
        mod = workloads.lower_to_tir(bb.get())
        scheduled = cpu_schedule_pass()(mod)
        for gv, f in scheduled.functions_items():
            if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint:
                assert f.attrs and f.attrs.get("tirx.is_scheduled"), gv.name_hint
        ex = tvm.compile(scheduled, target=target)
    return relax.VirtualMachine(ex, tvm.cpu())


@pytest.mark.parametrize("scheme", [Q8, Q4, W8A8, W4A8], ids=["q8", "q4", "w8a8", "w4a8"])
@pytest.mark.parametrize("mode,rows", [("decode", 1), ("decode", 3), ("prefill", 7)])
def test_scheduled_quantized_matmul_matches_reference(scheme, mode, rows):
    K, N = 192, 80
    rng = np.random.default_rng(2)
    w = _weights(N, K)
    sym = tvm.tirx.Var("n", "int64")
    x_shape = (sym, 1, K) if mode == "decode" else (1, sym, K)
    vm = _scheduled_matmul(K, N, scheme, x_shape)
    x = rng.standard_normal((rows, 1, K) if mode == "decode" else (1, rows, K)).astype("float32")
    dev = tvm.cpu()
    got = vm["main"](tvm.runtime.tensor(x, dev),
                     *[tvm.runtime.tensor(a, dev) for a in stored_np(w, scheme)]).numpy()
    xr = x
    if scheme.activations == "int8":
        s = np.abs(x).max(-1, keepdims=True) / 127.0
        xr = np.clip(np.round(x / s), -127, 127) * s
    y = xr @ dequantize_np(*quantize_np(w, scheme), scheme).T
    ref = y / (1 + np.exp(-y))
    assert np.abs(got - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())


def test_parse_scheme_refuses_bad_combinations():
    assert parse_scheme(None) is None
    assert parse_scheme("q4", keep_float="0, lm_head").keep_float == ("0", "lm_head")
    for kwargs, text in [(dict(quantization="q3"), "unknown --quantization"),
                         (dict(quantization="q4", group_size=24), "power of two"),
                         (dict(quantization="q4", activations="int8", group_size=4), "multiple of 8"),
                         (dict(quantization=None, keep_float="0"), "need --quantization"),
                         (dict(quantization="q8", activations="int4"), "unknown --activations")]:
        with pytest.raises(UserError, match=text):
            parse_scheme(**kwargs)


def test_keep_float_matches_layer_indices_and_globs():
    s = parse_scheme("q4", keep_float="1,lm_head,*down_proj*")
    assert s.keeps_float(["model.layers.1.self_attn.q_proj.weight"])
    assert not s.keeps_float(["model.layers.11.self_attn.q_proj.weight"])
    assert s.keeps_float(["lm_head.weight"])
    assert s.keeps_float(["model.layers.0.mlp.down_proj.weight"])
    assert not s.keeps_float(["model.layers.0.mlp.up_proj.weight"])
