"""Quantized expert weights of mixture-of-experts layers (frontend/moe_relax.py's moe_gemm).

The stacked expert weight W (experts, K in, N out) is quantized expert by expert with the same
numpy reference quantizer as every linear (formats.py), each expert's W[e]^T (N, K) along K in
groups of 32, packed in the weight-only "rows" layout (scheme.pack_rows) and stacked:
q (E, N, ...), scales (E, N, K/32)[, offsets]. The kernel `moe_gemm_dequantize` dequantizes only
the rows' experts, inside the GEMM (the expert id is data, as in the float kernel): what it
computes with is fake_quantize(W[e]^T, fmt) for each expert e. Weight-only: int8 activations
are not applied to experts (their kernel is float x dequantized weight).
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .formats import get_format
from .kernels import _rows_value
from .scheme import pack, packed_shapes

QUANTIZE_EXPERTS_FUNC = "tvm_llm.quantize_experts"
MOE_GEMM_DEQUANTIZE_BLOCK = "moe_gemm_dequantize"


def quantize_experts_np(w: np.ndarray, fmt: str) -> list:
    """Packed arrays of the stacked (E, K, N) float weight, each stacked over the experts."""
    f = get_format(fmt)
    per_expert = [pack(f, f.quantize(np.ascontiguousarray(w[e].T)), "rows") for e in range(w.shape[0])]
    return [np.stack([arrays[i] for arrays in per_expert]) for i in range(len(per_expert[0]))]


def fake_quantize_experts(w: np.ndarray, fmt: str) -> np.ndarray:
    """What the compiled model computes with, for a stacked (E, K, N) weight (tests' oracle)."""
    from .formats import fake_quantize

    return np.stack([fake_quantize(np.ascontiguousarray(w[e].T), fmt).T for e in range(w.shape[0])])


def _quantize_packed(w, fmt):
    import tvm

    return [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in quantize_experts_np(w.numpy(), str(fmt))]


def register() -> None:
    import tvm_ffi

    tvm_ffi.register_global_func(QUANTIZE_EXPERTS_FUNC, _quantize_packed, override=True)


register()


def stored_shapes(E: int, N: int, K: int, fmt: str) -> list:
    return [((E,) + tuple(s), d) for s, d in packed_shapes(get_format(fmt), N, K, "rows")]


class _Expert:
    """A stacked packed array seen as one expert's array: t[e][idx] = t[(e,) + idx]."""

    def __init__(self, tensor, e):
        self.tensor, self.e = tensor, e

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        return self.tensor[(self.e,) + idx]


def moe_gemm_dequantize(x: te.Tensor, expert: te.Tensor, stored: list, fmt: str, out_dtype: str):
    """y[r, n] = sum_k x[r, k] * dequantize(stored)[expert[r], n, k]."""
    f = get_format(fmt)
    K = int(x.shape[1])
    N = int(stored[0].shape[1])
    k = te.reduce_axis((tirx.IntImm("int64", 0), tirx.IntImm("int64", K)), "k")

    def body(r, n):
        value = _rows_value([_Expert(t, expert[r]) for t in stored], f, out_dtype)
        return te.sum(x[r, k].astype(out_dtype) * value(n, k), axis=k)

    return te.compute((x.shape[0], tirx.IntImm("int64", N)), body, name=MOE_GEMM_DEQUANTIZE_BLOCK)


def moe_gemm_dequantize_func(E: int, N: int, K: int, fmt: str, dtype: str):
    """The PrimFunc (x, expert, *stored) -> y for a symbolic number of rows, marked opaque
    (never fused: the CPU MoE rule recognises it by its block name)."""
    rows = tirx.Var("rows", "int64")
    x = te.placeholder((rows, tirx.IntImm("int64", K)), dtype, name="x")
    expert = te.placeholder((rows,), "int64", name="expert")
    stored = [te.placeholder(s, d, name=f"stored{i}") for i, (s, d) in enumerate(stored_shapes(E, N, K, fmt))]
    y = moe_gemm_dequantize(x, expert, stored, fmt, dtype)
    func = te.create_prim_func([x, expert, *stored, y]).with_attr("op_pattern", 8)  # kOpaque
    return func.without_attr("global_symbol")
