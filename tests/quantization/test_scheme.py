"""Quantized kernels: each format's kernel (weight-only "rows" layout and the int8-activation
VNNI kernel) computes what the numpy reference says, decode and prefill; scheme options."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import cpu_workloads as workloads
from schedules.cpu import cpu_schedule_pass
from tvm_llm.errors import UserError
from tvm_llm.passes.quantize_linear import emit_quantized_matmul
from tvm_llm.quantization import kernels
from tvm_llm.quantization.formats import FORMATS, fake_quantize_activation, super_groups
from tvm_llm.quantization.scheme import (FIELDS, kquant_pairs, pack_fields, pack_vnni, packed_shapes, parse_scheme,
                                         stored_bits, stored_np, unpack_fields, unpack_kquant_codes)
from tvm_llm.targets import get_target


def _weights(N=48, K=192, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((N, K)) * 0.05).astype("float32")
    w[3, 40:72] *= 30  # an outlier group
    w[5, :32] = 0.0  # an all-zero group
    return w


def _has_vnni():
    t = workloads.host_target(2)
    return bool(tvm.target.codegen.llvm_cpu_has_features("avx512vnni", t))


def _scheduled_matmul(K, N, fmt, layout, x_shape, target=None, kernels_out=None, act_bits=8, spec=None):
    """The pass's matmul kernel (x of x_shape, may be symbolic) scheduled by our CPU rules as
    an x86 build schedules it (weight-only prefill through the dequantize-panel GEMM);
    `kernels_out`, a dict, receives the scheduled PrimFuncs by name. `spec`: the target spec
    whose int8-activation kernel is used (default: this host's)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(x_shape), "float32"))
    ws = [relax.Var(f"w{i}", relax.TensorType(shape, dtype))
          for i, (shape, dtype) in enumerate(kernels.stored_shapes(N, K, fmt, layout))]
    with bb.function("main", [x] + ws):
        with bb.dataflow():
            y = bb.emit(emit_quantized_matmul(bb, x, ws, fmt, layout, K, N, "float32",
                                              spec or get_target("llvm"), act_bits))
            y = bb.emit(relax.op.nn.silu(y))  # an epilogue FuseOps fuses into the matmul
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    target = target or workloads.host_target(2)
    with target, tvm.transform.PassContext(opt_level=3):
        mod = workloads.lower_to_tir(bb.get())
        scheduled = cpu_schedule_pass(dequant_panel=True)(mod)
        for gv, f in scheduled.functions_items():
            if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint:
                assert f.attrs and f.attrs.get("tirx.is_scheduled"), gv.name_hint
                if kernels_out is not None:
                    kernels_out[gv.name_hint] = f
        ex = tvm.compile(scheduled, target=target)
    return relax.VirtualMachine(ex, tvm.cpu())


# (format, layout, activation bits of the vnni kernel); the k-quants of 3, 5 and 6 bits share
# q4_k's arithmetic and differ in their bit planes: each at 8 bits, q6_k in "rows" and at 16
KQ_STEPS = ("q3_k", "q5_k", "q6_k")
CORE = sorted(f for f in FORMATS if f not in KQ_STEPS)
CASES = [(f, "rows", 0) for f in CORE + ["q6_k"]] + [(f, "vnni", b) for f in CORE for b in (8, 16)] \
    + [(f, "vnni", 8) for f in KQ_STEPS] + [("q6_k", "vnni", 16)]


@pytest.mark.parametrize("fmt,layout,bits", CASES, ids=[f"{f}-{lay}{b or ''}" for f, lay, b in CASES])
def test_scheduled_quantized_matmul_matches_reference(fmt, layout, bits):
    if layout == "vnni" and not _has_vnni():
        pytest.skip("the int8-activation kernel needs AVX-512 VNNI on the host")
    K, N = 480, 48  # K = 480: 15 groups, q4_k super-blocks of 5 (an odd count of groups)
    rng = np.random.default_rng(2)
    w = _weights(N, K)
    f = FORMATS[fmt]
    st = f.quantize(w)
    wd = f.dequantize(st)
    arrays = stored_np(w, fmt, layout)
    for mode, rows in [("decode", 1), ("decode", 3), ("prefill", 9)]:  # 9: rows quantized in parallel
        sym = tvm.tirx.Var("n", "int64")
        x_shape = (sym, 1, K) if mode == "decode" else (1, sym, K)
        vm = _scheduled_matmul(K, N, fmt, layout, x_shape, act_bits=bits or 8)
        x = rng.standard_normal((rows, 1, K) if mode == "decode" else (1, rows, K)).astype("float32")
        x[..., 100] = 40.0  # an activation outlier: only its block's scale grows
        dev = tvm.cpu()
        got = vm["main"](tvm.runtime.tensor(x, dev), *[tvm.runtime.tensor(a, dev) for a in arrays]).numpy()
        xr = fake_quantize_activation(x, bits) if layout == "vnni" else x
        y = xr.astype(np.float64) @ wd.T.astype(np.float64)
        ref = y / (1 + np.exp(-y))
        assert np.abs(got - ref).max() < 1e-4 * max(1.0, np.abs(ref).max()), (mode, rows)
        if bits == 16:  # 16-bit activations: float activations' result within 2e-4
            yf = x.astype(np.float64) @ wd.T.astype(np.float64)
            assert np.abs(got - yf / (1 + np.exp(-yf))).max() < 2e-4 * np.abs(yf).max(), (mode, rows)


def test_kquant_decode_keeps_float_precision_where_a_massive_activation_cancels():
    """A k-quant row is d * sc * q - dmin * mn: where a group's weights sit far from zero its
    minimum term and its scale term are both large and cancel, and a massive activation (real
    models have them) makes them larger still. Decode computes the minimum term in integers
    (vpdpwssd over each super-block's xs * xsum): with one int16 per value (2^-16 of the
    super-block's largest) this output was 0.4% of its largest value off; the 30 bits kept hold float32's
    precision."""
    if not _has_vnni():
        pytest.skip("the int8-activation kernel needs AVX-512 VNNI on the host")
    K, N = 512, 32
    rng = np.random.default_rng(7)
    w = (-0.5 + 0.02 * rng.standard_normal((N, K))).astype("float32")
    w[:, 7] = 0.0  # the massive activation's weight: near zero, in a group of -0.5s
    f = FORMATS["q4_k"]
    wd = f.dequantize(f.quantize(w)).astype(np.float64)
    x = rng.standard_normal((1, 1, K)).astype("float32")
    x[..., 7] = 1e4
    vm = _scheduled_matmul(K, N, "q4_k", "vnni", (tvm.tirx.Var("n", "int64"), 1, K))
    dev = tvm.cpu()
    got = vm["main"](tvm.runtime.tensor(x, dev), *[tvm.runtime.tensor(a, dev) for a in stored_np(w, "q4_k", "vnni")])
    y = fake_quantize_activation(x, 8).astype(np.float64) @ wd.T
    ref = y / (1 + np.exp(-y))
    assert np.abs(wd[:, 7]).max() < 0.1  # next to its group's scale and minimum terms (~0.5 x 1e4) a small term
    assert np.abs(got.numpy() - ref).max() < 3e-4 * np.abs(ref).max(), np.abs(got.numpy() - ref).max()


# (LLVM CPU, its int8 dot-product instructions, format, activation bits): AVX2 every format at
# both widths, AVX-512 without VNNI the 8-bit (nibble-split) and the k-quant format
# (q5_k and q6_k: their int16 pairs widened every 4 and 2 tiles, not every 8)
NO_VNNI_CASES = [("x86-64-v3", "avx2", f, b) for f in CORE for b in (8, 16)] + \
    [("x86-64-v3", "avx2", "q6_k", 16), ("x86-64-v3", "avx2", "q5_k", 8)] + \
    [("skylake-avx512", "avx512bw", f, 8) for f in ("q8_0", "q4_k", "q6_k")]


@pytest.mark.parametrize("cpu,isa,fmt,bits", NO_VNNI_CASES, ids=[f"{i}-{f}-{b}" for _, i, f, b in NO_VNNI_CASES])
def test_int8_activation_kernels_without_vnni(cpu, isa, fmt, bits):
    """CPUs without VNNI run the same integer kernels on vpmaddubsw + vpmaddwd: exact integer
    sums, so the result is the numpy reference's, decode and batched rows (9: rows quantized in
    parallel); the generated code holds no vpdpbusd."""
    host = workloads.host_target(2)
    needs = "avx2" if isa == "avx2" else "avx512bw"
    if not tvm.target.codegen.llvm_cpu_has_features(needs, host):
        pytest.skip(f"the {cpu} code needs {needs} on the host to run")
    spec = get_target("llvm", arch=cpu)
    assert spec.int8_dot_isa() == isa and spec.supports_int8_dot()
    K, N = 480, 48
    w = _weights(N, K)
    f = FORMATS[fmt]
    wd = f.dequantize(f.quantize(w))
    dev = tvm.cpu()
    stored = [tvm.runtime.tensor(a, dev) for a in stored_np(w, fmt, "vnni")]
    target = tvm.target.Target(dict(spec.tvm_target().export(), **{"num-cores": 2}))
    funcs = {}
    vm = _scheduled_matmul(K, N, fmt, "vnni", (tvm.tirx.Var("n", "int64"), 1, K), target, funcs, bits, spec)
    script = "".join(fn.script() for fn in funcs.values())
    assert "vpdpbusd" not in script and script.count("pmadd") > 0
    rng = np.random.default_rng(5)
    for rows in (1, 3, 9):
        x = rng.standard_normal((rows, 1, K)).astype("float32")
        x[..., 100] = 40.0
        got = vm["main"](tvm.runtime.tensor(x, dev), *stored).numpy()
        y = fake_quantize_activation(x, bits).astype(np.float64) @ wd.T.astype(np.float64)
        ref = y / (1 + np.exp(-y))
        assert np.abs(got - ref).max() < 1e-4 * max(1.0, np.abs(ref).max()), rows


@pytest.mark.parametrize("cpu,fmt,prefetches", [
    ("znver4", "q4_k", {("0", "2")}), ("znver4", "q6_k", {("0", "2")}),
    ("znver4", "q4_0", {("c", "3")}), ("znver4", "q8_0", {("0", "2")}),
    ("znver5", "q4_k", {("c", "3")}), ("znver5", "q8_0", {("c", "3")}),
    ("sapphirerapids", "q4_k", {("c", "2")}), ("sapphirerapids", "q8_0", {("c", "3")}),
    ("skylake-avx512", "q4_k", {("c", "2")}),
    ("x86-64-v3", "q4_k", {("c", "2")})])
def test_decode_prefetch_follows_the_cpu_row(cpu, fmt, prefetches):
    """Batch-1 decode prefetches, PREFETCH_BYTES ahead, the first 64-byte chunk of each group
    into L2 (wp[nt, g + d, 0, 0], locality 2) with VNNI; every chunk (wp[nt, g + d, c, 0] in a
    loop over c) without VNNI (x86-64-v3, skylake-avx512), and every chunk into L1 (locality
    3) where the CPU's row in schedules/cpu/microarch.py says so (znver5; znver4 for q4_0 /
    q4_1 only, its k-quants the first chunk into L2; Intel Xeons with VNNI for 8-bit weights,
    their 4-bit weights every chunk into L2)."""
    import re

    f = get_target("llvm", arch=cpu).quantized_matmul_kernel(fmt, 480, 48, "float32", 16)
    decode = set(re.findall(r'"llvm\.prefetch", T\.address_of\(wp\[nt, u \* \d+ \+ j \+ \d+, (\w+), 0\]\), '
                            r'0, (\d), 1\)', f.script()))
    assert decode == prefetches, decode


@pytest.mark.parametrize("fmt", ["q3_k", "q4_k", "q6_k"])
def test_kquant_decode_statements_follow_the_cpu_row(fmt):
    """k-quant decode adds one group of a super-block per statement on znver4 (its row's
    int8_decode_burst_lines: 4 lines) and several on an Intel Xeon (the 24-line default): both
    kernels, compiled for this host, give the reference's result at batch 1."""
    if not _has_vnni():
        pytest.skip("the int8-activation kernel needs AVX-512 VNNI on the host")
    from schedules.cpu.microarch import tile_row

    rows = {cpu: tile_row(get_target("llvm", arch=cpu).tvm_target()) for cpu in ("znver4", "sapphirerapids")}
    assert rows["znver4"].int8_decode_burst_lines == 4
    assert rows["sapphirerapids"].int8_decode_burst_lines is None
    K, N = 512, 48  # two super-blocks of 8 groups: 8 statements each on znver4, fewer elsewhere
    w = _weights(N, K)
    wd = FORMATS[fmt].dequantize(FORMATS[fmt].quantize(w))
    dev = tvm.cpu()
    stored = [tvm.runtime.tensor(a, dev) for a in stored_np(w, fmt, "vnni")]
    x = np.random.default_rng(4).standard_normal((1, 1, K)).astype("float32")
    y = fake_quantize_activation(x, 8).astype(np.float64) @ wd.T.astype(np.float64)
    ref = y / (1 + np.exp(-y))
    for cpu in rows:
        vm = _scheduled_matmul(K, N, fmt, "vnni", (tvm.tirx.Var("n", "int64"), 1, K),
                               spec=get_target("llvm", arch=cpu))
        got = vm["main"](tvm.runtime.tensor(x, dev), *stored).numpy()
        assert np.abs(got - ref).max() < 1e-4 * max(1.0, np.abs(ref).max()), cpu


@pytest.mark.parametrize("fmt", ["q4_k", "q8_0"])
def test_weight_only_kernels_on_an_avx2_target(fmt):
    """Weight-only builds (--activations float) on CPUs without AVX-512 (x86-64-v3 code runs
    here too); such CPUs' defaults are the integer kernels (int8_dot_isa "avx2")."""
    from tvm_llm.targets import get_target

    spec = get_target("llvm", arch="x86-64-v3")
    assert spec.vector_isa() == "avx2" and spec.int8_dot_isa() == "avx2"
    assert spec.dequantize_panel_prefill()
    K, N = 256, 32
    w = _weights(N, K)
    wd = FORMATS[fmt].dequantize(FORMATS[fmt].quantize(w))
    dev = tvm.cpu()
    stored = [tvm.runtime.tensor(a, dev) for a in stored_np(w, fmt, "rows")]
    sym = tvm.tirx.Var("n", "int64")
    # decode (dequantize inlined in the dot product); prefill of 13 rows (the dequantize-panel
    # GEMM: two full 6-row tiles and a one-row tail) and of 3 rows (under DequantGEMM's
    # MIN_ROWS: the same kernel's dot-product branch)
    for x_shape, shapes in [((sym, 1, K), [(2, 1, K)]), ((1, sym, K), [(1, 13, K), (1, 3, K)])]:
        funcs = {}
        vm = _scheduled_matmul(K, N, fmt, "rows", x_shape, spec.tvm_target(), funcs)
        panel = any("T.parallel" in f.script() and 'T.sblock("dequantize")' in f.script()
                    for f in funcs.values())
        assert panel == (x_shape[1] is sym), x_shape  # prefill only dequantizes panels
        for rows in shapes:
            x = np.random.default_rng(3).standard_normal(rows).astype("float32")
            got = vm["main"](tvm.runtime.tensor(x, dev), *stored).numpy()
            y = x.astype(np.float64) @ wd.T
            ref = y / (1 + np.exp(-y))
            assert np.abs(got - ref).max() < 1e-4 * max(1.0, np.abs(ref).max()), rows


def test_vnni_layout_holds_unsigned_values_in_tiles():
    w = _weights()
    f = FORMATS["q4_0"]
    st = f.quantize(w)
    wp, d = pack_vnni(f, st)
    q = st["q"]
    # row 17 (tile 1, lane 1), input 32 + 4*3 + 2 (group 1, tile 3 = high nibble of chunk 1)
    assert (wp[1, 1, 1, 1 * 4 + 2] >> 4) == q[17, 32 + 14] + 8
    assert (wp[1, 1, 1, 1 * 4 + 2] & 15) == q[17, 32 + 10] + 8  # tile 2: low nibble
    assert d.shape == (3, 6, 16) and d.dtype == np.float16 and d[1, 1, 1] == st["d"][17, 1]
    f8 = FORMATS["q8_0"]
    st8 = f8.quantize(w)
    wp8 = pack_vnni(f8, st8)[0]
    assert wp8.shape == (3, 6, 8, 64) and wp8[1, 1, 3, 1 * 4 + 2] == int(st8["q"][17, 32 + 14]) + 128
    # q4_k: 6-bit sc and mn at 12 bits per group, in pairs of groups within a super-block (an odd
    # super-block, K = 96 and 480: its last pair padded with a zero group)
    fk = FORMATS["q4_k"]
    for K, pairs in ((96, 2), (256, 4), (480, 9), (576, 9)):
        stk = fk.quantize(_weights(48, K))
        arrays = pack_vnni(fk, stk)
        sl, mh = arrays[1], arrays[2]
        assert [(list(a.shape), str(a.dtype)) for a in arrays] == packed_shapes(fk, 48, K, "vnni")
        assert sl.shape == (3, pairs, 16) and mh.shape == (3, pairs, 32) and kquant_pairs(K) == pairs
        # (tiles, pairs, 16 rows [x 2]) -> (rows, pairs [, 2])
        sc, mn = unpack_kquant_codes(sl.transpose(0, 2, 1).reshape(48, -1),
                                     mh.reshape(3, pairs, 16, 2).transpose(0, 2, 1, 3).reshape(48, pairs, 2),
                                     super_groups(K), K // 32)
        assert np.array_equal(sc, stk["sc"]) and np.array_equal(mn, stk["mn"])
        assert stk["sc"].max() > 15 and stk["mn"].max() > 15  # the top bits are exercised
        # row 17 (tile 1, lane 1), group 1 (the odd one of pair 0): its scale's low nibble in sl's
        # high nibble, its minimum in mh's second byte of the row with the scale's top bits above
        assert sl[1, 0, 1] >> 4 == stk["sc"][17, 1] & 15
        assert mh[1, 0, 2 * 1 + 1] == stk["mn"][17, 1] | (stk["sc"][17, 1] >> 4) << 6
    # q3_k / q5_k / q6_k: the codes in fields of chunks (unpack_fields: what the kernel ORs back), the
    # same tile order; row 17, input 32 + 4*3 + 2 is tile 3's byte 1*4+2 of tile row 1, group 1
    for name, chunks in (("q3_k", 3), ("q5_k", 5), ("q6_k", 6)):
        fp = FORMATS[name]
        stp = fp.quantize(w)
        wpp = pack_vnni(fp, stp)[0]
        assert wpp.shape == (3, 6, chunks, 64) and wpp.dtype == np.uint8
        codes = unpack_fields(wpp, fp.bits)
        assert codes[1, 1, 3, 1 * 4 + 2] == stp["q"][17, 32 + 14] and codes.max() == stp["q"].max()
        assert np.array_equal(codes.reshape(3, 6, 8, 16, 4).transpose(0, 3, 1, 2, 4).reshape(48, 192), stp["q"])
        assert stp["q"].max() >= 1 << (fp.bits - 1)  # the top plane is exercised
    # every width's fields fill its chunks exactly: all-ones codes give all-ones chunks, and
    # any code comes back (no two fields share a bit)
    for bits in FIELDS:
        assert np.all(pack_fields(np.full((8, 64), (1 << bits) - 1, np.uint8), bits) == 255)
        codes = np.random.default_rng(bits).integers(0, 1 << bits, (2, 8, 64)).astype(np.uint8)
        assert np.array_equal(unpack_fields(pack_fields(codes, bits), bits), codes)
    assert stored_bits("q4_k", 48, 256, "vnni") == 4.5 and stored_bits("q4_k", 48, 256, "rows") == 6.0
    assert stored_bits("q6_k", 48, 256, "vnni") == 6.5 and stored_bits("q6_k", 48, 256, "rows") == 10.0
    assert stored_bits("q4_k", 48, 96, "vnni") == 4 + 2 * 3 * 8 / 96 + 32 / 96  # S = 3: 2 pairs, one padded
    assert stored_bits("q8_0", 48, 256, "vnni") == 8.5 and stored_bits("float", 48, 256, "rows") == 32


def test_parse_scheme_names_defaults_and_refusals():
    assert parse_scheme(None) is None
    assert parse_scheme("q4", keep_float="0, lm_head").keep_float == ("0", "lm_head")
    assert parse_scheme("q4").format == "q4_k" and parse_scheme("q8").format == "q8_0"
    assert parse_scheme("q4", int8_dot=True).activations == "int8"
    assert parse_scheme("q4_0", int8_dot=True).activations == "int16"  # exact names: float's accuracy
    assert parse_scheme("q4_0", int8_dot=True).tag == "q4_0_a16"
    assert parse_scheme("q4_0", activations="float", int8_dot=True).activations == "float"
    assert parse_scheme("q4").activations == parse_scheme("q4_0").activations == "float"  # no int8 dot products
    assert parse_scheme("q4_1", activations="int8").tag == "q4_1_a8"
    for kwargs, text in [(dict(quantization="q3"), "unknown --quantization"),
                         (dict(quantization="q4", group_size=64), "must be 32"),
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
