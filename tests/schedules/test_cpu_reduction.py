"""CPU row-reduction (RMSNorm, LayerNorm, softmax) and elementwise rules: numerics, claims,
a whole Llama-style block scheduled by cpu_schedule_pass, aarch64 NEON code."""
from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

import cpu_workloads as workloads
from schedules.cpu import cpu_schedule_pass
from schedules.cpu.elementwise import Elementwise
from schedules.cpu.reduction import RowReduction
from cpu_workloads import host_target


def rms(x, g):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g


def layer_norm(x, g, b):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + b


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def rope_module(heads=4, dim=64):
    """RoPE as the importer emits it: cos/sin of position x inv_freq, rotate-half, mul-add,
    then the transpose to (b, h, s, d)."""
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((1, n, heads, dim), "float32"))
    pos = relax.Var("pos", relax.TensorType((n,), "float32"))
    invf = relax.Var("invf", relax.TensorType((dim // 2,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, pos, invf]):
        with bb.dataflow():
            fr = relax.op.multiply(relax.op.reshape(pos, (n, 1)), relax.op.reshape(invf, (1, dim // 2)))
            emb = relax.op.concat([fr, fr], axis=-1)
            cos = relax.op.reshape(relax.op.cos(emb), (1, n, 1, dim))
            sin = relax.op.reshape(relax.op.sin(emb), (1, n, 1, dim))
            x1 = relax.op.strided_slice(x, axes=[3], begin=[0], end=[dim // 2])
            x2 = relax.op.strided_slice(x, axes=[3], begin=[dim // 2], end=[dim])
            rot = relax.op.concat([relax.op.negative(x2), x1], axis=-1)
            y = relax.op.add(relax.op.multiply(x, cos), relax.op.multiply(rot, sin))
            out = bb.emit_output(relax.op.permute_dims(y, [0, 2, 1, 3]))
        bb.emit_func_output(out)
    return workloads.lower_to_tir(bb.get())


def take_module(vocab=100, hidden=64):
    n = tirx.Var("n", "int64")
    ids = relax.Var("ids", relax.TensorType((1, n), "int32"))
    emb = relax.Var("emb", relax.TensorType((vocab, hidden), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [ids, emb]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.take(emb, ids, axis=0))
        bb.emit_func_output(out)
    return workloads.lower_to_tir(bb.get())


def compile_scheduled(mod, target=None):
    target = target or host_target()
    with target:
        mod = cpu_schedule_pass()(mod)
    funcs = workloads.prim_funcs(mod)
    assert all(bool(f.attrs.get("tirx.is_scheduled", False)) for f in funcs.values()), \
        [k for k, f in funcs.items() if not f.attrs.get("tirx.is_scheduled", False)]
    return relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())


def run(vm, *args):
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


@pytest.mark.parametrize("hidden", [64, 100, 768])
def test_norms_and_softmax(hidden):
    rng = np.random.default_rng(0)
    g = rng.standard_normal((hidden,)).astype("float32")
    b = rng.standard_normal((hidden,)).astype("float32")
    vm_rms = compile_scheduled(workloads.rms_norm(hidden))
    vm_ln = compile_scheduled(workloads.layer_norm(hidden, "decode"))
    vm_sm = compile_scheduled(workloads.softmax(hidden))
    for n in (1, 7, 129):
        x = rng.standard_normal((1, n, hidden)).astype("float32")
        np.testing.assert_allclose(run(vm_rms, x, g), rms(x, g), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(run(vm_sm, x), softmax(x), rtol=1e-4, atol=1e-6)
        xd = x.reshape(n, 1, hidden)
        np.testing.assert_allclose(run(vm_ln, xd, g, b), layer_norm(xd, g, b), rtol=1e-4, atol=1e-4)


def test_softmax_vocab_decode():
    rng = np.random.default_rng(1)
    vm = compile_scheduled(workloads.softmax(32000, "decode"))
    x = (rng.standard_normal((3, 1, 32000)) * 4).astype("float32")
    np.testing.assert_allclose(run(vm, x), softmax(x), rtol=1e-4, atol=1e-7)


def test_elementwise_kernels():
    rng = np.random.default_rng(2)
    vm_rope = compile_scheduled(rope_module())
    vm_take = compile_scheduled(take_module())
    vm_sm = compile_scheduled(workloads.elementwise(768, op="silu_mul"))
    invf = (1.0 / 10000 ** (np.arange(0, 64, 2) / 64)).astype("float32")
    for n in (1, 7, 129):
        x = rng.standard_normal((1, n, 4, 64)).astype("float32")
        pos = np.arange(n).astype("float32")
        fr = pos[:, None] * invf[None]
        e = np.concatenate([fr, fr], -1)
        c, s = np.cos(e)[None, :, None], np.sin(e)[None, :, None]
        rot = np.concatenate([-x[..., 32:], x[..., :32]], -1)
        np.testing.assert_allclose(run(vm_rope, x, pos, invf), (x * c + rot * s).transpose(0, 2, 1, 3),
                                   rtol=1e-5, atol=1e-5)
        ids = rng.integers(0, 100, (1, n)).astype("int32")
        emb = rng.standard_normal((100, 64)).astype("float32")
        np.testing.assert_allclose(run(vm_take, ids, emb), emb[ids])
        a = rng.standard_normal((1, n, 768)).astype("float32")
        bb = rng.standard_normal((1, n, 768)).astype("float32")
        np.testing.assert_allclose(run(vm_sm, a, bb), a / (1 + np.exp(-a)) * bb, rtol=1e-5, atol=1e-6)


def test_claims():
    target = host_target()
    rms_f = workloads.single_prim_func(workloads.rms_norm(64))
    add_f = workloads.single_prim_func(workloads.elementwise(64, op="add"))
    mm_f = workloads.single_prim_func(workloads.linear(64, 96, "prefill", None))
    assert RowReduction().apply(rms_f, target, False) is not None
    assert RowReduction().apply(add_f, target, False) is None
    assert RowReduction().apply(mm_f, target, False) is None
    assert Elementwise().apply(add_f, target, False) is not None
    assert Elementwise().apply(rms_f, target, False) is None
    assert Elementwise().apply(mm_f, target, False) is None


def test_opaque_blocks_left_alone():
    """Hand-written kernels with opaque blocks (the KV-cache attention) carry no dependence
    information: no rule may parallelize or vectorize their loops."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def opaque(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "float32")):
        for i in range(16):
            with T.sblock("o"):
                T.reads(a[i])
                T.writes(b[i])
                b[i] = a[i] * T.float32(2.0)

    target = host_target()
    assert Elementwise().apply(opaque, target, False) is None
    assert RowReduction().apply(opaque, target, False) is None


def test_llama_block_fully_scheduled():
    """RMSNorm -> q (bias) / gate,up (SiLU*mul) / down (+residual), softmax: every kernel of
    the lowered block is claimed by one of our rules."""
    hidden, inter = 64, 176
    n = tirx.Var("n", "int64")
    tt = relax.TensorType
    x = relax.Var("x", tt((1, n, hidden), "float32"))
    params = [relax.Var(nm, tt(sh, "float32")) for nm, sh in
              [("wq", (96, hidden)), ("bq", (96,)), ("wg", (inter, hidden)), ("wu", (inter, hidden)),
               ("wd", (hidden, inter)), ("g", (hidden,))]]
    wq, bq, wg, wu, wd, g = params
    bb = relax.BlockBuilder()
    with bb.function("main", [x] + params, attrs={"num_input": 1}):
        with bb.dataflow():
            h = bb.emit(relax.op.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5))
            q = bb.emit(relax.op.add(relax.op.matmul(h, relax.op.permute_dims(wq)), bq))
            a = bb.emit(relax.op.nn.silu(relax.op.matmul(h, relax.op.permute_dims(wg))))
            u = bb.emit(relax.op.multiply(a, relax.op.matmul(h, relax.op.permute_dims(wu))))
            d = bb.emit(relax.op.add(x, relax.op.matmul(u, relax.op.permute_dims(wd))))
            sm = bb.emit(relax.op.nn.softmax(q, axis=-1))
            out = bb.emit_output(relax.Tuple([d, sm]))
        bb.emit_func_output(out)
    mod = workloads.lower_to_tir(bb.get())
    for marked in (False, True):
        m = relax.transform.AttachAttrLayoutFreeBuffers()(mod) if marked else mod
        with host_target():
            m = cpu_schedule_pass()(m)
        funcs = workloads.prim_funcs(m)
        assert len(funcs) >= 5
        assert all(bool(f.attrs.get("tirx.is_scheduled", False)) for f in funcs.values())


def test_aarch64_neon_fmla():
    arm = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]})
    mod = workloads.rms_norm(64)
    with arm:
        mod = cpu_schedule_pass()(mod)
    asm = tvm.compile(mod, target=arm).mod.imports[0].inspect_source("asm")
    assert re.search(r"\bfmla\s+v\d+\.4s", asm)
