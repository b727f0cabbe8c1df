"""Quantization schemes: what `--quantization`, `--activations` and `--keep-float` mean, and
the kernel layouts the stored arrays of a weight format are packed into.

Names (`--quantization`):
    q8_0, q4_0, q4_1, q3_k, q4_k, q5_k, q6_k
                            exactly that weight format for every linear (quantization/formats.py)
    q8                      our best 8-bit: q8_0
    q4                      our best 4-bit: q4_k (the automatic mix, when one is supplied as a
                            QuantPlan, puts sensitive weights at 8 bits)
Activations (`--activations`): "float" (weight-only: weights dequantized inside the matmul),
"int8" (inputs quantized with one scale per 32 inputs, integer dot products: AVX-512 VNNI, or
vpmaddubsw on AVX2 / AVX-512 without VNNI, schedules/cpu/int8_act_matmul.py) or "int16" (the
same kernel with each input block held at 16 bits, as two int8 halves: twice the dot products,
an input error <= 2^-16 of its block's max |x|, ~250x under int8's; measured on a real model,
the perplexity of float activations).
Left unset, where the target has int8 dot products (targets/: supports_int8_dot) q8 and q4
pick int8 and exact format names int16, so every format runs integer dot products there;
elsewhere all are float.

Kernel layouts (`pack`), packed from the canonical stored arrays of formats.WeightFormat.quantize:
    "rows"  weight-only (dequantize inlined into the GEMV/GEMM schedules): q8_0 q int8 (N, K);
            4-bit nibbles (N, K/32, 16) uint8 (byte j = element j low, element j + 16 high;
            q4_0 two's complement, q4_1/q4_k unsigned); q3_k / q5_k / q6_k q uint8 (N, K);
            float32 group scale (N, K/32) and, for q4_1 and the k-quants, float32 group offset
            (w = q * scale + offset). The group scale and offset of a k-quant are its d * sc
            and -dmin * mn, exact in float32.
    "vnni"  int8 / int16 activations: see schedules/cpu/int8_act_matmul.py. Group scales and offsets
            stay float16 (k-quants: 6-bit sc and mn packed at 12 bits per group, pack_kquant_codes,
            and float16 d, dmin per super-block), so this layout stores the formats' nominal bits
            (q4_k 4.5 for K a multiple of 256); "rows" stores q4_k at 6.0 (stored_bits).
            A group's 8 tiles of 16 rows take `bits` 64-byte chunks (vnni_chunks); FIELDS says
            where each code bit lies: whole codes where they fit, the rest in the chunks'
            spare top bits.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError
from .formats import FORMATS, GROUP, WeightFormat, get_format, kquant_group_params, super_groups
from .plan import ACTIVATIONS, FLOAT, INTEGER_ACTIVATIONS, QuantPlan

ALIASES = {"q8": "q8_0", "q4": "q4_k"}
SCHEMES = tuple(ALIASES) + tuple(FORMATS)
TILE_N = 16


@dataclass(frozen=True)
class QuantScheme:
    name: str  # the --quantization name
    group_size: int = GROUP
    activations: str = "float"  # "float" (weight-only) | "int8" | "int16" (integer dot products)
    keep_float: tuple = ()  # patterns: decoder layer indices ("3") or globs on weight names
    plan: QuantPlan | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.plan is None:
            object.__setattr__(self, "plan", QuantPlan(ALIASES.get(self.name, self.name), self.activations))

    @property
    def format(self) -> str:
        """The default weight format (plan.default_format)."""
        return self.plan.default_format

    @property
    def bits(self) -> int:
        return 32 if self.format == FLOAT else get_format(self.format).bits

    @property
    def tag(self) -> str:
        """Names kernels and builds: the default format, `_a8` / `_a16` with int8 / int16
        activations."""
        bits = INTEGER_ACTIVATIONS.get(self.activations)
        return self.format + (f"_a{bits}" if bits else "")

    def applies_to(self, K: int, N: int | None = None) -> bool:
        """Whether a (N, K) weight can be stored in the default format (else it stays float)."""
        return self.format != FLOAT and get_format(self.format).applies_to(N or 1, K)

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
        return {"scheme": self.name, "tag": self.tag, "format": self.format, "bits": self.bits,
                "group_size": GROUP, "activations": self.activations,
                "keep_float": list(self.keep_float), "plan": self.plan.describe()}


def parse_scheme(quantization: str | None, group_size: int = 32, activations: str | None = None,
                 keep_float=None, int8_dot: bool = False, plan: QuantPlan | None = None
                 ) -> QuantScheme | None:
    """The build's QuantScheme, or None for a float build; bad combinations are UserErrors.
    `int8_dot`: the target has int8 dot products (chooses the activations when `activations`
    is unset: int8 for q8 / q4, int16 for exact format names; float without). `plan`: a
    QuantPlan (calibration, automatic mix) to use instead of the plain one the name makes."""
    if activations is not None and activations not in ACTIVATIONS:
        raise UserError(f"unknown --activations {activations!r}: choose one of {', '.join(ACTIVATIONS)}")
    if quantization in (None, "", "none"):
        if activations not in (None, "float") or keep_float:
            raise UserError("--activations/--keep-float need --quantization (q8, q4 or a format name)")
        return None
    if quantization not in SCHEMES:
        raise UserError(f"unknown --quantization {quantization!r}: choose one of {', '.join(SCHEMES)}")
    if group_size != GROUP:
        raise UserError(f"--group-size must be {GROUP} (every format quantizes groups of {GROUP}), "
                        f"got {group_size!r}")
    if activations is None:
        activations = ("int8" if quantization in ALIASES else "int16") if int8_dot else "float"
    if isinstance(keep_float, str):
        keep_float = [p.strip() for p in keep_float.split(",") if p.strip()]
    if plan is not None:
        plan = QuantPlan(plan.default_format, activations, dict(plan.formats), dict(plan.importance))
    return QuantScheme(quantization, GROUP, activations, tuple(keep_float or ()), plan)


# --------------------------------------------------------------------------------------------
# kernel layouts
# --------------------------------------------------------------------------------------------
def pack_rows(fmt: WeightFormat, st: dict) -> list:
    """The weight-only kernel's tensors (module docstring, "rows")."""
    q = st["q"]
    N, K = q.shape
    NG = K // GROUP
    if fmt.kind == "sym":
        scale = st["d"].astype(np.float32)
        if fmt.bits == 8:
            return [q.astype(np.int8), scale]
        return [_nibbles_rows(q), scale]
    if fmt.kind == "asym":
        return [_nibbles_rows(q), st["d"].astype(np.float32), st["m"].astype(np.float32)]
    scale, minimum = kquant_group_params(st)
    codes = q.astype(np.uint8) if bytes_rows(fmt) else _nibbles_rows(q)
    return [codes, scale.reshape(N, NG), (-minimum).reshape(N, NG)]


def bytes_rows(fmt: WeightFormat) -> bool:
    """Whether the "rows" layout stores one byte per code: 8-bit formats and the k-quants
    whose codes are not 4-bit (q3_k, q5_k, q6_k); 4-bit codes are stored as nibbles."""
    return fmt.bits != 4


def _nibbles_rows(q: np.ndarray) -> np.ndarray:
    N, K = q.shape
    g = (q.astype(np.int16) & 15).astype(np.uint8).reshape(N, K // GROUP, GROUP)
    return np.ascontiguousarray(g[..., :16] | (g[..., 16:] << 4))


def pack_vnni(fmt: WeightFormat, st: dict) -> list:
    """The int8-activation kernel's tensors (schedules/cpu/int8_act_matmul.py)."""
    q = st["q"]
    N, K = q.shape
    NT, NG = N // TILE_N, K // GROUP
    if fmt.kind == "sym":
        u = (q.astype(np.int16) + (8 if fmt.bits == 4 else 128)).astype(np.uint8)
    else:
        u = q.astype(np.uint8)
    tiles = u.reshape(NT, TILE_N, NG, 8, 4).transpose(0, 2, 3, 1, 4).reshape(NT, NG, 8, 64)
    out = [np.ascontiguousarray(pack_fields(tiles, fmt.bits))]

    def per_tile(a):  # (N, G) -> (N/16, G, 16)
        return np.ascontiguousarray(a.reshape(NT, TILE_N, a.shape[1]).transpose(0, 2, 1))

    if fmt.kind == "kquant":
        sl, mh = pack_kquant_codes(st["sc"], st["mn"], super_groups(K))
        mh = np.ascontiguousarray(mh.reshape(NT, TILE_N, -1, 2).transpose(0, 2, 1, 3).reshape(NT, -1, 2 * TILE_N))
        return out + [per_tile(sl), mh, per_tile(st["d"]), per_tile(st["dmin"])]
    keys = {"sym": ["d"], "asym": ["d", "m"]}[fmt.kind]
    return out + [per_tile(st[k]) for k in keys]


def _code_fields(bits: int) -> tuple:
    """FIELDS[bits]: chunk c holds 8 // bits whole codes from bit 0 (tiles in chunk order);
    the tiles left over are split over the chunks' spare top bits, in chunk order, lowest
    code bits first."""
    per = 8 // bits
    tiles = [((c, s * bits, bits),) for c in range(bits) for s in range(per)]
    spare = [[c, per * bits] for c in range(bits) if per * bits < 8]  # (chunk, first free bit)
    while len(tiles) < 8:
        pieces, need = [], bits
        while need:
            c, pos = spare[0]
            w = min(need, 8 - pos)
            pieces.append((c, pos, w))
            need -= w
            if pos + w == 8:
                spare.pop(0)
            else:
                spare[0][1] = pos + w
        tiles.append(tuple(pieces))
    return tuple(tiles)


# where each code bit of a group's 8 tiles lies in the "vnni" layout, per code width: for tile
# t, FIELDS[bits][t] lists its pieces lowest bits first, each (chunk, bit position, width) in
# the group's `bits` chunks of 64 bytes (byte i of a chunk belongs to byte i of every tile).
# Codes lie whole where they fit (_code_fields), so that most tiles unpack with one mask, or
# one shift and a mask, and the rest OR 2-3 such fields; in bit planes (the nibbles, then the
# top bits) every tile took two fields and an OR. LLVM's AVX-512 code for q3_k unpacks a group
# in 15 vector instructions against 28 in planes; on an Intel Xeon (model 167), hot weights,
# one thread (scripts/bench_int8_kernel.py --threads 1 --clock cpu), decode ran q3_k 13-28%,
# q5_k 10-18% and q6_k 1-18% faster by linear. 3 bits: chunk 0 holds tiles 0 (bits 0-2) and 1
# (3-5), chunk 1 tiles 2, 3, chunk 2 tiles 4, 5; tile 6 is chunk 0's bits 6-7 and chunk 1's bit
# 6, tile 7 chunk 1's bit 7 and chunk 2's bits 6-7. 6 bits: tile c in chunk c's bits 0-5,
# tiles 6 and 7 in the top 2 bits of chunks 0-2 and 3-5. 4 bits: the nibbles.
FIELDS = {bits: _code_fields(bits) for bits in (3, 4, 5, 6, 8)}


def vnni_chunks(bits: int) -> int:
    """64-byte chunks per group of 32 and tile of 16 rows for codes of `bits` (= bits)."""
    return bits


def field_pieces(bits: int):
    """(tile, chunk, bit position, width, the piece's first bit in the code) of every piece
    of FIELDS[bits], tile by tile, lowest bits first."""
    for t, pieces in enumerate(FIELDS[bits]):
        shift = 0
        for c, pos, w in pieces:
            yield t, c, pos, w, shift
            shift += w


def pack_fields(tiles: np.ndarray, bits: int) -> np.ndarray:
    """(..., 8, 64) uint8 tiles of `bits`-bit codes -> (..., vnni_chunks(bits), 64) uint8, each
    code's bits where FIELDS puts them."""
    tiles = tiles.astype(np.uint8)
    chunks = np.zeros(tiles.shape[:-2] + (vnni_chunks(bits), 64), np.uint8)
    for t, c, pos, w, shift in field_pieces(bits):
        chunks[..., c, :] |= (((tiles[..., t, :] >> shift) & ((1 << w) - 1)) << pos).astype(np.uint8)
    return chunks


def unpack_fields(chunks: np.ndarray, bits: int) -> np.ndarray:
    """pack_fields' inverse: (..., vnni_chunks(bits), 64) -> (..., 8, 64) uint8 codes (the numpy
    statement of what the int8-activation kernel unpacks)."""
    tiles = np.zeros(chunks.shape[:-2] + (8, 64), np.uint8)
    for t, c, pos, w, shift in field_pieces(bits):
        tiles[..., t, :] |= (((chunks[..., c, :] >> pos) & ((1 << w) - 1)) << shift).astype(np.uint8)
    return tiles


def kquant_pairs(K: int) -> int:
    """Group pairs per row of a k-quant weight in the "vnni" layout: ceil(S / 2) per
    super-block of S groups (an odd S pads each super-block's last pair with a zero group, so
    that no pair spans two super-blocks' dmin)."""
    S = super_groups(K)
    return (K // GROUP // S) * ((S + 1) // 2)


def pack_kquant_codes(sc: np.ndarray, mn: np.ndarray, S: int) -> tuple:
    """A k-quant's 6-bit group scales and minimums (N, NG) at 12 bits per group, per pair of
    groups (g0, g1) = (2j, 2j + 1) of a super-block of S (kquant_pairs; an odd S pads g1 with
    zeros):
        sl (N, pairs) uint8     sc[g0] & 15 | (sc[g1] & 15) << 4
        mh (N, pairs, 2) uint8  mn[g] | (sc[g] >> 4) << 6 for g0, g1
    so that the kernel reads a pair's minimums as int16 pairs (mh zero-extended, masked to 6
    bits) for one int16 dot product (vpdpwssd) and each scale as an int32 lane in 2-3 shifts and
    masks (schedules/cpu/int8_act_matmul.py)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    if sc.max(initial=0) > 63 or mn.max(initial=0) > 63:
        raise ValueError("k-quant group codes must be 6-bit (0..63)")
    N, NG = sc.shape
    P = (S + 1) // 2

    def paired(a):  # (N, NG) -> (N, NG / S, P, 2), odd S padded with a zero group
        a = a.reshape(N, NG // S, S)
        if S % 2:
            a = np.concatenate([a, np.zeros((N, NG // S, 1), np.uint8)], axis=2)
        return a.reshape(N, NG // S * P, 2)

    sc2, mn2 = paired(sc), paired(mn)
    sl = (sc2[..., 0] & 15) | ((sc2[..., 1] & 15) << 4)
    mh = mn2 | ((sc2 >> 4) << 6)
    return np.ascontiguousarray(sl.astype(np.uint8)), np.ascontiguousarray(mh.astype(np.uint8))


def unpack_kquant_codes(sl: np.ndarray, mh: np.ndarray, S: int, NG: int) -> tuple:
    """(sc, mn) (N, NG) uint8 from pack_kquant_codes' (sl, mh): the numpy statement of what
    the int8-activation kernel unpacks."""
    N = sl.shape[0]
    P = (S + 1) // 2
    sc = np.stack([sl & 15, sl >> 4], axis=-1) | ((mh >> 6) << 4)
    mn = mh & 63

    def unpaired(a):  # (N, pairs, 2) -> (N, NG), the padding dropped
        return a.reshape(N, NG // S, 2 * P)[..., :S].reshape(N, NG)

    return unpaired(sc).astype(np.uint8), unpaired(mn).astype(np.uint8)


def vnni_applies(N: int, K: int) -> bool:
    return N % TILE_N == 0 and K % GROUP == 0


def layout_for(activations: str, N: int, K: int) -> str:
    """The kernel layout a build stores an (N, K) weight in (the QuantizeLinear pass's choice)."""
    return "vnni" if activations in INTEGER_ACTIVATIONS and vnni_applies(N, K) else "rows"


def stored_bits(fmt: str, N: int, K: int, layout: str) -> float:
    """Bits per weight an (N, K) weight takes as stored: every tensor `pack` makes for `fmt` in
    `layout` counted ("float": 32). This, not the format's nominal figure, is what the build
    report and the automatic mix count: e.g. q4_k is 4.5 in "vnni" (K a multiple of 256) but
    6.0 in "rows" (float32 group scales and offsets)."""
    if fmt == "float":
        return 32.0
    from ..memory.kv_budget import dtype_bytes

    shapes = packed_shapes(get_format(fmt), N, K, layout)
    return sum(int(np.prod(s)) * 8 * dtype_bytes(d) for s, d in shapes) / (N * K)


def pack(fmt: WeightFormat, st: dict, layout: str) -> list:
    return pack_vnni(fmt, st) if layout == "vnni" else pack_rows(fmt, st)


def packed_shapes(fmt: WeightFormat, N: int, K: int, layout: str) -> list:
    """(shape, dtype) of each tensor `pack` makes for an (N, K) weight."""
    NG = K // GROUP
    if layout == "vnni":
        NT = N // TILE_N
        out = [([NT, NG, vnni_chunks(fmt.bits), 64], "uint8")]
        if fmt.kind == "kquant":
            NS = NG // super_groups(K)
            NP = kquant_pairs(K)
            return out + [([NT, NP, TILE_N], "uint8"), ([NT, NP, 2 * TILE_N], "uint8")] \
                + [([NT, NS, TILE_N], "float16")] * 2
        return out + [([NT, NG, TILE_N], "float16")] * (1 if fmt.kind == "sym" else 2)
    first = ([N, K], "int8" if fmt.bits == 8 else "uint8") if bytes_rows(fmt) else ([N, NG, 16], "uint8")
    return [first] + [([N, NG], "float32")] * (1 if fmt.kind == "sym" else 2)


def stored_np(w: np.ndarray, fmt: str, layout: str, importance=None) -> list:
    """The arrays a build stores for weight w in format `fmt` and kernel `layout`."""
    f = get_format(fmt)
    return pack(f, f.quantize(w, importance), layout)


def fake_quantize_np(w: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """w after a quantize -> dequantize round trip in the scheme's default format."""
    from .formats import fake_quantize

    return fake_quantize(w, scheme.format)

