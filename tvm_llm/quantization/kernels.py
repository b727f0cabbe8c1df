"""Tensor-expression definitions of the quantized kernels (scheduled by schedules/<target>/).

* `quantize_weight`: float (N, K) weight -> stored form (runs once, at build time: the pass
  emits it on weights only, so the folding phase lifts it into the weight transform).
* `dequantize_matmul`: y = x @ dequantize(Wq)^T. The dequantize is a producer block of the
  matmul inside one PrimFunc, so schedules inline it into the matmul's inner loop: the float
  weight never exists in memory, only the packed bytes are read.
* `quantize_activation` + `int8_matmul`: W8A8. The input row is scaled to int8 (shifted to
  uint8 for VNNI's unsigned x signed dot product), multiplied with int8 weights stored in
  (N/16, K/4, 16, 4) tiles (one 64-byte VNNI operand per tile), accumulated in int32, then
  corrected for the +128 shift and rescaled to float.
"""
from __future__ import annotations

from tvm import te, tirx

from .scheme import QuantScheme

VNNI_N, VNNI_K = 16, 4  # one vpdpbusd: 16 int32 lanes, each summing 4 uint8 x int8 products


def _f32(e):
    return e.astype("float32")


def quantize_weight(w: te.Tensor, scheme: QuantScheme):
    """Stored form of a weight (N, K): q8 -> (int8 (N, K), scales (N, K/G));
    q4 -> (uint8 (N, K/G, G/2), scales); W8A8 -> (int8 (N/16, K/4, 16, 4), row scales (N,),
    int32 row sums (N,)); W4A8 -> (uint8 (N/16, K/G, G/8, 64), scales (N/16, K/G, 16))."""
    N, K = (int(s) for s in w.shape)
    G = scheme.group_for(K)
    NG = K // G
    r = te.reduce_axis((0, G), "r")
    if scheme.bits == 8:
        amax = te.compute((N, NG), lambda n, g: te.max(te.abs(_f32(w[n, g * G + r])), axis=r),
                          name="absmax")
        scale = te.compute((N, NG), lambda n, g: (amax[n, g] / 127.0).astype(scheme.scale_dtype),
                           name="scale")
        lo_q, hi_q = -127.0, 127.0
    else:
        hi = te.compute((N, NG), lambda n, g: te.max(_f32(w[n, g * G + r]), axis=r), name="wmax")
        r2 = te.reduce_axis((0, G), "r2")
        lo = te.compute((N, NG), lambda n, g: te.min(_f32(w[n, g * G + r2]), axis=r2), name="wmin")
        scale = te.compute((N, NG), lambda n, g: (
            tirx.Select(-lo[n, g] > hi[n, g], lo[n, g], hi[n, g]) / -8.0).astype(scheme.scale_dtype),
            name="scale")
        lo_q, hi_q = -8.0, 7.0

    def q_at(n, k):
        s = _f32(scale[n, k // G])
        v = te.nearbyint(_f32(w[n, k]) / tirx.Select(s != 0.0, s, tirx.const(1.0, "float32")))
        v = tirx.Select(s != 0.0, v, tirx.const(0.0, "float32"))
        return te.max(te.min(v, hi_q), lo_q)

    if scheme.tag == "w4a8":  # layout of schedules/cpu/w4a8_matmul.py
        def tile_byte(nt, g, c, e, t):  # tile t, byte e = i*4 + k -> q + 8 in [0, 15]
            n = nt * VNNI_N + e // 4
            return (q_at(n, g * G + t * 4 + e % 4) + 8.0).astype("int32")

        wp = te.compute((N // VNNI_N, NG, G // 8, 64),
                        lambda nt, g, c, e: (tile_byte(nt, g, c, e, 2 * c)
                                             | (tile_byte(nt, g, c, e, 2 * c + 1) << 4)).astype("uint8"),
                        name="weight_w4a8")
        ws = te.compute((N // VNNI_N, NG, VNNI_N), lambda nt, g, i: scale[nt * VNNI_N + i, g],
                        name="scale_w4a8")
        return wp, ws
    if scheme.activations == "int8":
        q = te.compute((N // VNNI_N, K // VNNI_K, VNNI_N, VNNI_K),
                       lambda no, ko, ni, ki: q_at(no * VNNI_N + ni, ko * VNNI_K + ki).astype("int8"),
                       name="weight_vnni")
        rk = te.reduce_axis((0, K), "rk")
        rowsum = te.compute((N,), lambda n: te.sum(q_at(n, rk).astype("int32"), axis=rk),
                            name="weight_rowsum")
        row_scale = te.compute((N,), lambda n: scale[n, 0], name="row_scale")
        return q, row_scale, rowsum
    if scheme.bits == 8:
        q = te.compute((N, K), lambda n, k: q_at(n, k).astype("int8"), name="weight_q8")
        return q, scale
    half = G // 2
    packed = te.compute(
        (N, NG, half),
        lambda n, g, j: (q_at(n, g * G + j).astype("int32") & 15
                         | ((q_at(n, g * G + j + half).astype("int32") & 15) << 4)).astype("uint8"),
        name="weight_q4")
    return packed, scale


def stored_shapes(N: int, K: int, scheme: QuantScheme) -> list:
    """(shape, dtype) of each tensor quantize_weight stores for an (N, K) weight."""
    return [([int(d) for d in t.shape], t.dtype)
            for t in quantize_weight(te.placeholder((N, K), "float32"), scheme)]


def dequantize(wq: te.Tensor, scale: te.Tensor, scheme: QuantScheme, K: int, dtype: str):
    """The (N, K) float weight as a producer stage (inlined into the matmul by the schedules)."""
    N = int(wq.shape[0])
    G = scheme.group_for(K)
    if scheme.bits == 8:
        def value(n, k):
            return wq[n, k].astype(dtype) * scale[n, k // G].astype(dtype)
    else:
        half = G // 2

        def value(n, k):
            # two's-complement nibbles: move the nibble to the top of an int32 and shift it
            # back arithmetically, which sign-extends it (two vector ops per 16 weights)
            byte = wq[n, k // G, k % half].astype("int32")
            up = tirx.Select(k % G < half, tirx.const(28, "int32"), tirx.const(24, "int32"))
            nib = (byte << up) >> tirx.const(28, "int32")
            return nib.astype(dtype) * scale[n, k // G].astype(dtype)
    return te.compute((N, K), value, name="dequantize")


def dequantize_matmul(x: te.Tensor, wq: te.Tensor, scale: te.Tensor, scheme: QuantScheme,
                      out_dtype: str | None = None):
    """y[..., n] = sum_k x[..., k] * dequantize(wq, scale)[n, k]."""
    K = int(x.shape[-1])
    w = dequantize(wq, scale, scheme, K, x.dtype)
    N = int(w.shape[0])
    k = te.reduce_axis((0, K), "k")
    lead = list(x.shape[:-1])
    out_dtype = out_dtype or x.dtype

    def body(*i):
        return te.sum((x[tuple(i[:-1]) + (k,)] * w[i[-1], k]).astype(out_dtype), axis=k)

    return te.compute(lead + [N], body, name="NT_matmul")


def quantize_activation(x: te.Tensor):
    """Per-row (token) dynamic int8: (x_u8 = round(x / s) + 128, s = max|x| / 127)."""
    K = int(x.shape[-1])
    lead = list(x.shape[:-1])
    k = te.reduce_axis((0, K), "k")
    amax = te.compute(lead, lambda *i: te.max(te.abs(_f32(x[tuple(i) + (k,)])), axis=k),
                      name="act_absmax")
    s = te.compute(lead, lambda *i: amax[i] / 127.0, name="act_scale")

    def q(*i):
        sc = s[tuple(i[:-1])]
        v = te.nearbyint(_f32(x[i]) / tirx.Select(sc != 0.0, sc, tirx.const(1.0, "float32")))
        v = tirx.Select(sc != 0.0, v, tirx.const(0.0, "float32"))
        return (te.max(te.min(v, 127.0), -127.0) + 128.0).astype("uint8")

    return te.compute(lead + [K], q, name="act_quantize"), s


def int8_matmul(xu: te.Tensor, xs: te.Tensor, wq: te.Tensor, ws: te.Tensor, rowsum: te.Tensor,
                out_dtype: str = "float32"):
    """y[..., n] = xs * ws[n] * (sum_k xu[..., k] * wq[n, k] - 128 * rowsum[n])."""
    K = int(xu.shape[-1])
    N = int(wq.shape[0]) * VNNI_N
    lead = list(xu.shape[:-1])
    k = te.reduce_axis((0, K), "k")

    def acc(*i):
        n = i[-1]
        return te.sum(xu[tuple(i[:-1]) + (k,)].astype("int32")
                      * wq[n // VNNI_N, k // VNNI_K, n % VNNI_N, k % VNNI_K].astype("int32"), axis=k)

    dot = te.compute(lead + [N], acc, name="int8_NT_matmul")

    def scaled(*i):
        n = i[-1]
        corr = dot[i] - rowsum[n] * 128
        return (corr.astype("float32") * xs[tuple(i[:-1])] * ws[n]).astype(out_dtype)

    return te.compute(lead + [N], scaled, name="int8_rescale")
