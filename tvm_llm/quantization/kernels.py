"""The quantized kernels' definitions, and the build-time weight quantizer.

* `quantize_weight` (a packed function registered as `tvm_llm.quantize_weight`): the
  QuantizeLinear pass emits a call to it on weights only, so the folding phase lifts it into the
  build-time weight transform, which runs the reference quantizer (formats.py, with the
  plan's importance for that weight; or takes its result computed early beside the passes,
  prequantize.py) and packs the result into the kernel layout (scheme.pack).
  The runtime never calls it.
* `dequantize_matmul`: weight-only, y = x @ dequantize(W)^T. The dequantize is a producer
  block of the matmul inside one PrimFunc, so the schedules (schedules/cpu/gemv.py, gemm.py and
  TVM's GPU rules) inline it into the matmul's inner loop: only the packed bytes are read.
* int8 activations: schedules/cpu/int8_act_matmul.py (a hand-written x86 kernel: VNNI, or
  vpmaddubsw without it).
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .formats import GROUP, WeightFormat, get_format
from .scheme import bytes_rows, pack, packed_shapes

QUANTIZE_FUNC = "tvm_llm.quantize_weight"
_EMITTED: dict = {}  # key -> (format name, K, (K,) importance or None), set by the pass


def record_weight(key: str, fmt: str, K: int, importance) -> None:
    """What the QuantizeLinear pass emitted a quantize_weight call for: weight `key`'s format,
    input features and importance (or None), read by the transform's quantizer and by
    prepare_quantizers."""
    _EMITTED[key] = (fmt, K, None if importance is None else np.asarray(importance, dtype=np.float32))


def prepare_quantizers() -> None:
    """Compile, on the calling thread, every search the emitted transforms' quantize_weight
    calls may run (WeightFormat.prepare): the build runs the transform on a second thread
    beside its codegen, and TVM's compiler must never run in two threads at once."""
    for fmt, K, importance in list(_EMITTED.values()):
        get_format(fmt).prepare(K, importance)


def _quantize_packed(w, fmt: str, layout: str, key: str):
    import tvm

    from . import prequantize

    f = get_format(str(fmt))
    try:  # a view: the float weight is read, never kept (a copy was 4.4 GB on llama-1b)
        w = np.from_dlpack(w)
        w.flags.writeable = False  # the transform's input: a quantizer must not write to it
    except (RuntimeError, TypeError, BufferError):  # bfloat16: numpy's DLPack lacks it
        w = w.numpy()
    _fmt, _K, importance = _EMITTED.get(str(key), (None, None, None))
    stored = prequantize.take(str(key), f.name, importance, w)  # quantized beside the passes
    if stored is None:
        stored = f.quantize(w, importance)
    arrays = pack(f, stored, str(layout))
    return [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays]


def register() -> None:
    import tvm_ffi

    tvm_ffi.register_global_func(QUANTIZE_FUNC, _quantize_packed, override=True)


register()


def stored_shapes(N: int, K: int, fmt: str, layout: str) -> list:
    return packed_shapes(get_format(fmt), N, K, layout)


def dequantize(stored: list, fmt: WeightFormat, K: int, dtype: str):
    """The (N, K) float weight of a "rows" layout as a producer stage (inlined by schedules)."""
    N = int(stored[0].shape[0])
    return te.compute((N, K), _rows_value(stored, fmt, dtype), name="dequantize")


def _rows_value(stored: list, fmt: WeightFormat, dtype: str):
    """value(n, k): element (n, k) of a "rows" layout weight, as `dtype`."""
    wq, scale = stored[0], stored[1]
    if fmt.bits == 8:
        def value(n, k):
            return wq[n, k].astype(dtype) * scale[n, k // GROUP].astype(dtype)
    elif fmt.kind == "sym":
        def value(n, k):
            # two's-complement nibbles: move the nibble to the top of an int32 and shift it
            # back arithmetically, which sign-extends it (two vector ops per 16 weights)
            byte = wq[n, k // GROUP, k % 16].astype("int32")
            up = tirx.Select(k % GROUP < 16, tirx.const(28, "int32"), tirx.const(24, "int32"))
            nib = (byte << up) >> tirx.const(28, "int32")
            return nib.astype(dtype) * scale[n, k // GROUP].astype(dtype)
    else:  # q4_1 and the k-quants: unsigned codes, w = q * scale + offset
        offset = stored[2]

        def code(n, k):
            if bytes_rows(fmt):  # q3_k / q5_k / q6_k: a byte per code
                return wq[n, k]
            byte = wq[n, k // GROUP, k % 16].astype("int32")
            down = tirx.Select(k % GROUP < 16, tirx.const(0, "int32"), tirx.const(4, "int32"))
            return (byte >> down) & tirx.const(15, "int32")

        def value(n, k):
            return code(n, k).astype(dtype) * scale[n, k // GROUP].astype(dtype) \
                + offset[n, k // GROUP].astype(dtype)
    return value


def dequantize_take(stored: list, fmt: WeightFormat, ids: te.Tensor, K: int, dtype: str):
    """out[..., k] = W[ids[...], k] of a "rows" layout table: an embedding lookup that
    dequantizes only the rows it reads."""
    value = _rows_value(stored, fmt, dtype)
    lead = [int(d) if isinstance(d, tirx.IntImm) else d for d in ids.shape]

    def body(*i):
        return value(ids[tuple(i[:-1])].astype("int64"), i[-1])

    return te.compute(lead + [K], body, name="take_dequantize")


def dequantize_matmul(x: te.Tensor, stored: list, fmt: WeightFormat, out_dtype: str | None = None):
    """y[..., n] = sum_k x[..., k] * dequantize(stored)[n, k]."""
    K = int(x.shape[-1])
    w = dequantize(stored, fmt, K, x.dtype)
    N = int(w.shape[0])
    k = te.reduce_axis((0, K), "k")
    lead = list(x.shape[:-1])
    out_dtype = out_dtype or x.dtype

    def body(*i):
        return te.sum((x[tuple(i[:-1]) + (k,)] * w[i[-1], k]).astype(out_dtype), axis=k)

    return te.compute(lead + [N], body, name="NT_matmul")
