"""The paged KV cache's per-layer copy kernels for CPUs (schedules/cpu/kv_append.py): the q/k/v
split and the K/V append, against numpy, below and above the token count where they fork the
thread pool (one decode token; a batch of 40 > PARALLEL_MIN_TOKENS), in float32 and bfloat16
(copies: bit-exact). The split's rotary path (apply_rope = 1, a cache made with RopeMode.NORMAL)
is checked against TVM's own kernel for those settings and a float64 rotary."""
from __future__ import annotations

import numpy as np
import pytest

H_QO, H_KV, D, PAGE = 6, 2, 32, 8


def _t(a, dtype="float32"):
    import tvm

    a = np.asarray(a, "float32") if dtype != "int32" else a
    if dtype == "bfloat16":
        import ml_dtypes

        a = a.astype(ml_dtypes.bfloat16)
    return tvm.runtime.tensor(np.ascontiguousarray(a), tvm.cpu())


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def kernels(request):
    import tvm

    from schedules.cpu.kv_append import split_qkv_func, transpose_append_func
    from tvm_llm.targets.llvm import LLVMTarget

    dtype = request.param
    mod = tvm.IRModule({"fused_rope": split_qkv_func(H_QO, H_KV, D, dtype),
                        "append": transpose_append_func(H_KV, D, dtype, PAGE)
                        .with_attr("global_symbol", "append")})
    return dtype, tvm.compile(mod, target=LLVMTarget().tvm_target())


@pytest.mark.parametrize("n", [1, 40])
def test_split_and_append_copy_exactly(kernels, n):
    dtype, ex = kernels
    rng = np.random.default_rng(n)
    qkv = _t(rng.standard_normal((n, H_QO + 2 * H_KV, D)), dtype)
    q, k, v = (_t(np.zeros((n, h, D)), dtype) for h in (H_QO, H_KV, H_KV))
    ex["fused_rope"](qkv, _t(np.arange(n, dtype="int32"), "int32"), q, k, v, 0)
    src = qkv.numpy()
    assert np.array_equal(q.numpy(), src[:, :H_QO])
    assert np.array_equal(k.numpy(), src[:, H_QO:H_QO + H_KV])
    assert np.array_equal(v.numpy(), src[:, H_QO + H_KV:])

    pages0 = rng.standard_normal((n // PAGE + 3, 2, H_KV, PAGE, D))
    pages = _t(pages0, dtype)
    before = pages.numpy().copy()
    slots = rng.permutation((n // PAGE + 3) * PAGE)[:n].astype("int32")
    slots[n // 2] = -1  # a token the cache does not store
    ex["append"](pages, k, v, _t(slots, "int32"))
    want = before.copy()
    for t, s in enumerate(slots):
        if s != -1:
            want[s // PAGE, 0, :, s % PAGE] = k.numpy()[t]
            want[s // PAGE, 1, :, s % PAGE] = v.numpy()[t]
    assert np.array_equal(pages.numpy(), want)


def test_split_rotary_matches_tvm_and_float64():
    import tvm
    from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map

    from schedules.cpu.kv_append import split_qkv_func
    from tvm_llm.targets.llvm import LLVMTarget

    target = LLVMTarget().tvm_target()
    ours = tvm.compile(tvm.IRModule({"main": split_qkv_func(H_QO, H_KV, D, "float32")
                                     .with_attr("global_symbol", "main")}), target=target)["main"]
    tvms = tvm.compile(tvm.IRModule({"main": llama_rope_with_position_map(
        10000, 1, D, H_QO, H_KV, "float32", {}, D).with_attr("global_symbol", "main")}),
        target=target)["main"]
    n = 5
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, H_QO + 2 * H_KV, D)).astype("float32")
    pos = np.array([0, 3, 17, 200, 1500], "int32")
    outs = []
    for f in (ours, tvms):
        q, k, v = (_t(np.zeros((n, h, D))) for h in (H_QO, H_KV, H_KV))
        f(_t(x), _t(pos, "int32"), q, k, v, 1)
        outs.append(np.concatenate([q.numpy(), k.numpy(), v.numpy()], axis=1))
    # float64 rotary: x * cos(p w_i) + rotate_half(x) * sin(p w_i), w_i = theta^(-2i/D)
    xr = x[:, :H_QO + H_KV].astype("float64")
    ang = pos[:, None, None] * 10000.0 ** (-(np.arange(D) * 2 % D) / D)
    rot = np.concatenate([-xr[..., D // 2:], xr[..., :D // 2]], axis=-1)
    want = np.concatenate([xr * np.cos(ang) + rot * np.sin(ang), x[:, H_QO + H_KV:]], axis=1)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=2e-4)  # float32 angles up to 1500
