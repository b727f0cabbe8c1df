"""Quantization schemes: what `--quantization`, `--group-size`, `--activations` and
`--keep-float` mean, and the numpy reference of the exact rounding the build performs.

Weight-only schemes (symmetric, one float16 scale per group of `group_size` consecutive
weights along K of each output row):

    q8  int8 in [-127, 127], scale = max|w| / 127
    q4  4-bit in [-8, 7], scale = w_absmax_signed / -8 (the largest-magnitude weight maps to
        -8 exactly, so all 16 levels are used); two weights per byte

With `--activations int8` the linear inputs are quantized per token at run time (one scale
per row, max|x| / 127) and the matmul multiplies integers with AVX-512 VNNI (vpdpbusd):
    q8 -> W8A8: int8 weights with one scale per output row (group = all of K): the int32
          accumulation spans the whole row;
    q4 -> W4A8: the q4 weights above (same groups and rounding); each group's int32 sum is
          scaled by its weight scale in float (schedules/cpu/w4a8_matmul.py).

The numpy functions here are the reference the kernels are tested against and what the
sensitivity analysis uses to fake-quantize weights inside transformers.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

import numpy as np

from ..errors import UserError

SCHEMES = ("q8", "q4")
ACTIVATIONS = ("float", "int8")
BITS = {"q8": 8, "q4": 4}
QMAX = {"q8": 127, "q4": 7}


@dataclass(frozen=True)
class QuantScheme:
    name: str  # "q8" | "q4"
    group_size: int = 32
    activations: str = "float"  # "float" (weight-only) | "int8" (W8A8)
    keep_float: tuple = ()  # patterns: decoder layer indices ("3") or globs on weight names

    @property
    def bits(self) -> int:
        return BITS[self.name]

    @property
    def scale_dtype(self) -> str:
        """float32: a scale is broadcast straight from memory inside the GEMV's inner loop (a
        float16 scale costs a convert and a shuffle per 16 weights, which made q4 compute
        bound); it adds 4 bytes per group of 32 (q4 0.625 bytes/weight, q8 1.125)."""
        return "float32"

    @property
    def tag(self) -> str:
        """q8, q4, w8a8 or w4a8: names kernels and builds."""
        if self.activations == "int8":
            return "w8a8" if self.bits == 8 else "w4a8"
        return self.name

    def group_for(self, K: int) -> int:
        """Group size used for a weight with K input features."""
        return K if self.tag == "w8a8" else self.group_size

    def applies_to(self, K: int, N: int | None = None) -> bool:
        """Whether a (N, K) weight can be stored in this scheme (else it stays float)."""
        G = self.group_for(K)
        if K % G or (self.bits == 4 and G % 2):
            return False
        if self.activations == "int8" and N is not None:  # 16-row VNNI tiles, 4-byte steps
            return N % 16 == 0 and K % 4 == 0 and (self.bits == 8 or G % 8 == 0)
        return True

    def keeps_float(self, names: list) -> bool:
        """True when any of the checkpoint weight names behind a linear matches --keep-float."""
        for pat in self.keep_float:
            for name in names:
                if pat.isdigit():
                    if re.search(rf"(^|\.)(layers|h|layer|blocks)\.{int(pat)}\.", name):
                        return True
                elif fnmatch.fnmatch(name, pat) or fnmatch.fnmatch(name, f"*{pat}*"):
                    return True
        return False

    def describe(self) -> dict:
        return {"scheme": self.name, "tag": self.tag, "bits": self.bits, "group_size": self.group_size,
                "activations": self.activations, "keep_float": list(self.keep_float),
                "scale_dtype": self.scale_dtype}


def parse_scheme(quantization: str | None, group_size: int = 32, activations: str | None = None,
                 keep_float=None) -> QuantScheme | None:
    """The build's QuantScheme, or None for a float build; bad combinations are UserErrors."""
    activations = activations or "float"
    if activations not in ACTIVATIONS:
        raise UserError(f"unknown --activations {activations!r}: choose one of {', '.join(ACTIVATIONS)}")
    if quantization in (None, "", "none"):
        if activations != "float" or keep_float:
            raise UserError("--activations/--keep-float need --quantization q8 or q4")
        return None
    if quantization not in SCHEMES:
        raise UserError(f"unknown --quantization {quantization!r}: choose one of {', '.join(SCHEMES)}")
    if not isinstance(group_size, int) or group_size < 2 or group_size & (group_size - 1):
        raise UserError(f"--group-size must be a power of two >= 2, got {group_size!r}")
    if activations == "int8" and quantization == "q4" and group_size % 8:
        raise UserError("--activations int8 with q4 needs --group-size a multiple of 8")
    if isinstance(keep_float, str):
        keep_float = [p.strip() for p in keep_float.split(",") if p.strip()]
    return QuantScheme(quantization, group_size, activations, tuple(keep_float or ()))


# --------------------------------------------------------------------------------------------
# numpy reference (same rounding as the TE kernels in quantization/kernels.py)
# --------------------------------------------------------------------------------------------
def quantize_np(w: np.ndarray, scheme: QuantScheme):
    """(q, scale): q int8 of w's shape (N, K), scale (N, K // group) float16 (float32 for
    W8A8). Dequantized weight = q * scale, group-wise."""
    w = np.asarray(w, dtype=np.float32)
    N, K = w.shape
    G = scheme.group_for(K)
    g = w.reshape(N, K // G, G)
    if scheme.bits == 8:
        scale = np.abs(g).max(axis=-1) / 127.0
    else:
        hi, lo = g.max(axis=-1), g.min(axis=-1)
        scale = np.where(-lo > hi, lo, hi) / -8.0
    scale = scale.astype(scheme.scale_dtype)
    s = scale.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s != 0, np.round(g / np.where(s != 0, s, 1)), 0)
    lo_q, hi_q = (-127, 127) if scheme.bits == 8 else (-8, 7)
    q = np.clip(q, lo_q, hi_q).astype(np.int8).reshape(N, K)
    return q, scale


def dequantize_np(q: np.ndarray, scale: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    N, K = q.shape
    G = scheme.group_for(K)
    return (q.reshape(N, K // G, G).astype(np.float32)
            * scale.astype(np.float32)[..., None]).reshape(N, K)


def pack_q4_np(q: np.ndarray, group: int) -> np.ndarray:
    """(N, K) values in [-8, 7] -> (N, K // group, group // 2) uint8: in each group, byte j holds
    element j (low nibble) and element j + group/2 (high nibble), as two's-complement nibbles.
    A SIMD load of consecutive bytes then yields consecutive weights with two shifts."""
    N, K = q.shape
    g = (q.astype(np.int16) & 15).astype(np.uint8).reshape(N, K // group, group)
    half = group // 2
    return (g[..., :half] | (g[..., half:] << 4)).astype(np.uint8)


def unpack_q4_np(packed: np.ndarray) -> np.ndarray:
    N, ng, half = packed.shape
    lo = ((packed & 15).astype(np.int16) ^ 8) - 8
    hi = ((packed >> 4).astype(np.int16) ^ 8) - 8
    return np.concatenate([lo, hi], axis=-1).astype(np.int8).reshape(N, ng * half * 2)


def pack_w4a8_np(q: np.ndarray, scale: np.ndarray, group: int):
    """(wp, ws) in the W4A8 kernel's layout (schedules/cpu/w4a8_matmul.py): 16-row tiles,
    per group G/8 chunks of 64 bytes holding two VNNI tiles (low / high nibbles) of q + 8."""
    N, K = q.shape
    NT, NG = N // 16, K // group
    u = (q.astype(np.int16) + 8).astype(np.uint8)
    tiles = u.reshape(NT, 16, NG, group // 4, 4).transpose(0, 2, 3, 1, 4).reshape(NT, NG, group // 4, 64)
    wp = (tiles[:, :, 0::2, :] | (tiles[:, :, 1::2, :] << 4)).astype(np.uint8)
    ws = scale.reshape(NT, 16, NG).transpose(0, 2, 1).astype(np.float32)
    return np.ascontiguousarray(wp), np.ascontiguousarray(ws)


def pack_w8a8_np(q: np.ndarray, scale: np.ndarray):
    """(tiles, row scales, row sums) of the W8A8 kernel: (N/16, K/4, 16, 4) int8 tiles."""
    N, K = q.shape
    tiles = q.reshape(N // 16, 16, K // 4, 4).transpose(0, 2, 1, 3)
    return (np.ascontiguousarray(tiles), scale.reshape(N).astype(np.float32),
            q.astype(np.int32).sum(axis=1, dtype=np.int32))


def stored_np(w: np.ndarray, scheme: QuantScheme) -> list:
    """The arrays a build stores for weight w (what quantization/kernels.quantize_weight makes)."""
    q, s = quantize_np(w, scheme)
    if scheme.tag == "w8a8":
        return list(pack_w8a8_np(q, s))
    if scheme.tag == "w4a8":
        return list(pack_w4a8_np(q, s, scheme.group_size))
    return [pack_q4_np(q, scheme.group_size) if scheme.bits == 4 else q, s]


def fake_quantize_np(w: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """w after a quantize -> dequantize round trip (what the compiled model computes with)."""
    q, scale = quantize_np(w, scheme)
    return dequantize_np(q, scale, scheme)


def quantized_bytes(N: int, K: int, scheme: QuantScheme) -> int:
    G = scheme.group_for(K)
    scale_bytes = 2 if scheme.activations == "float" else 4
    return N * K * scheme.bits // 8 + N * (K // G) * scale_bytes
