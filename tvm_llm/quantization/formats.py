"""Weight formats: what each quantized format stores, and its numpy reference quantizer.

Every format quantizes a weight (N, K) along K (the reduction axis) in groups of 32 weights:

    q8_0  int8 q in [-127, 127], one float16 scale d per group:          w = d * q      (8.5 bits)
    q4_0  4-bit q in [-8, 7], one float16 scale d per group:             w = d * q      (4.5 bits)
    q4_1  4-bit q in [0, 15], float16 scale d and offset m per group:    w = d * q + m  (5.0 bits)
    q4_k  4-bit q in [0, 15] in super-blocks of up to 8 groups (256 weights): each group has a
          6-bit scale sc and a 6-bit minimum mn, each super-block two float16 super-scales:
                                                                w = d * sc * q - dmin * mn  (4.5 bits)
          (a K that is not a multiple of 256 uses the largest super-block of <= 8 groups that
          divides it, e.g. 6 groups for K = 576, 4.54 bits)
    q3_k  q4_k's layout with 3-bit q in [0, 7]                                       (3.5 bits)
    q5_k  q4_k's layout with 5-bit q in [0, 31]                                      (5.5 bits)
    q6_k  q4_k's layout with 6-bit q in [0, 63]                                      (6.5 bits)
          (q5_k / q6_k: the automatic mix's steps when its budget counts the LM head,
          calibration.MIX_CANDIDATES; q3_k by name only)

`quantize(w, importance)` chooses each group's scale (and minimum) by a small search that
minimizes the importance-weighted squared rounding error sum_k imp[k] (w[n, k] - w_q[n, k])^2,
imp[k] >= 0 one value per input channel (e.g. the mean of x_k^2 over a calibration text; None =
uniform). The stored arrays returned here are canonical (one value per element, unpacked); the
build packs exactly these into each kernel's layout (quantization/kernels.py), so what the
compiled model computes with is `dequantize(quantize(w))` = `fake_quantize(w, fmt)`.

Int8 activations (`--activations int8`) are quantized at run time with one scale per 32
consecutive input features per token (ACTIVATION_BLOCK): `fake_quantize_activation` is their
round trip, the same arithmetic as the kernels (x * (127 / max|x|), round half to even).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

GROUP = 32
ACTIVATION_BLOCK = 32


def host_threads() -> int:
    """CPU cores this process may run on: the threads for numpy work at build time."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


SUPER_GROUPS = 8  # q4_k: groups per super-block (256 weights) when K allows
# rows quantized at once: the scale search makes ~20 passes over its temporaries, which at 256
# rows stay in the CPU caches (1.4-1.7x faster than 4096 rows; rows are independent: same result)
_ROW_CHUNK = 256


def super_groups(K: int) -> int:
    """Groups per q4_k super-block for a weight with K input features."""
    ng = K // GROUP
    return next(s for s in range(SUPER_GROUPS, 0, -1) if ng % s == 0)


@dataclass(frozen=True)
class WeightFormat:
    name: str
    kind: str  # "sym" (d * q), "asym" (d * q + m), "kquant" (d * sc * q - dmin * mn)
    bits: int  # bits of each quantized weight
    description: str = ""

    # ---------------------------------------------------------------------------------------
    def bits_per_weight(self, K: int | None = None) -> float:
        """The format's bits per weight, scales and minimums included (K: input features, for
        q4_k whose super-block depends on it; None = a multiple of 256). The int8-activation
        layout stores exactly this (q4_k's 6-bit codes packed at 12 bits per group; an odd group
        count pads half a byte per row); the weight-only layout stores more (float32 group
        parameters): what a build stores is scheme.stored_bits."""
        if self.kind == "sym":
            return self.bits + 16 / GROUP
        if self.kind == "asym":
            return self.bits + 32 / GROUP
        s = SUPER_GROUPS if K is None else super_groups(K)
        return self.bits + 12 / GROUP + 32 / (GROUP * s)

    def applies_to(self, N: int, K: int) -> bool:
        """Whether an (N, K) weight can be stored in this format (else it stays float)."""
        return N >= 1 and K >= GROUP and K % GROUP == 0

    @property
    def qrange(self) -> tuple:
        if self.kind == "sym":
            return -(1 << (self.bits - 1)) + (self.bits == 8), (1 << (self.bits - 1)) - 1
        return 0, (1 << self.bits) - 1

    # ---------------------------------------------------------------------------------------
    def quantize(self, w: np.ndarray, importance: np.ndarray | None = None,
                 threads: int | None = None) -> dict:
        """Stored arrays of w (N, K) float32 (canonical layout, see the module docstring):
        sym: q int8 (N, K), d float16 (N, K/32); asym: q uint8, d, m float16 (N, K/32);
        kquant: q uint8 (N, K), sc, mn uint8 (N, K/32) in [0, 63], d, dmin float16 (N, K/256).
        `threads`: threads for the row chunks (default: the cores this process may use)."""
        w = np.asarray(w, dtype=np.float32)
        if w.ndim != 2 or not self.applies_to(*w.shape):
            raise ValueError(f"{self.name}: weight of shape {w.shape} needs 2 dims and K % {GROUP} == 0")
        N, K = w.shape
        imp = _importance(importance, K)
        chunks = [w[r:r + _ROW_CHUNK] for r in range(0, N, _ROW_CHUNK)]
        threads = host_threads() if threads is None else threads
        # rows are independent: chunks in `threads` threads (numpy and torch release the GIL),
        # one torch thread each (q4_k's search is in torch), the same bytes in any case
        with one_torch_thread():
            if len(chunks) == 1 or threads <= 1:
                parts = [self._quantize_rows(c, imp) for c in chunks]
            else:
                with ThreadPoolExecutor(min(len(chunks), threads)) as pool:
                    parts = list(pool.map(lambda c: self._quantize_rows(c, imp), chunks))
        return {key: np.concatenate([p[key] for p in parts], axis=0) for key in parts[0]}

    def prepare(self, K: int, importance: np.ndarray | None = None) -> None:
        """Compile, on the calling thread, the search that quantize() runs for weights of K
        inputs with this importance (q4_k's kquant_search; nothing for the numpy formats):
        prequantize calls it so its background thread never runs TVM's compiler."""
        if self.kind == "kquant":
            from .kquant_search import compiled

            nmax = self.qrange[1]
            weighted = not importance_is_uniform(_importance(importance, K))
            compiled(nmax, kquant_numerators(nmax), weighted)

    def dequantize(self, stored: dict) -> np.ndarray:
        q = stored["q"]
        N, K = q.shape
        g = q.reshape(N, K // GROUP, GROUP).astype(np.float32)
        if self.kind == "sym":
            out = g * stored["d"].astype(np.float32)[..., None]
        elif self.kind == "asym":
            out = g * stored["d"].astype(np.float32)[..., None] + stored["m"].astype(np.float32)[..., None]
        else:
            scale, minimum = kquant_group_params(stored)
            out = g * scale[..., None] - minimum[..., None]
        return out.reshape(N, K).astype(np.float32)

    # ---------------------------------------------------------------------------------------
    def _quantize_rows(self, w: np.ndarray, imp: np.ndarray) -> dict:
        N, K = w.shape
        NG = K // GROUP
        x = w.reshape(N * NG, GROUP)
        uniform = importance_is_uniform(imp)
        lo, hi = self.qrange
        if self.kind == "kquant":  # compiled for this machine (kquant_search.py)
            from .kquant_search import quantize_blocks

            return quantize_blocks(x, None if uniform else imp, N, K, hi,
                                   kquant_numerators(hi), super_groups(K))
        # uniform importance: no weights at all (multiplying by 1 is exact, so the same bytes
        # come out; the searches below make ~25 passes over their (rows, 32) temporaries)
        wt = None if uniform else \
            np.broadcast_to(imp.reshape(1, NG, GROUP), (N, NG, GROUP)).reshape(N * NG, GROUP)
        if self.kind == "sym" and self.bits == 8 and wt is None:
            q, d = _absmax_symmetric(x, hi)
            return {"q": q.astype(np.int8).reshape(N, K),
                    "d": d.astype(np.float16).reshape(N, NG)}
        if self.kind == "sym":
            q, d = _search_symmetric(x, wt, lo, hi)
            return {"q": q.astype(np.int8).reshape(N, K),
                    "d": d.astype(np.float16).reshape(N, NG)}
        q, d, m = _search_asymmetric(x, wt, hi)
        return {"q": q.astype(np.uint8).reshape(N, K), "d": d.astype(np.float16).reshape(N, NG),
                "m": m.astype(np.float16).reshape(N, NG)}


def kquant_group_params(stored: dict):
    """(scale, minimum) float32 (N, K/32) of a q4_k weight: w = scale * q - minimum."""
    N, NG = stored["sc"].shape
    S = NG // stored["d"].shape[1]
    d = np.repeat(stored["d"].astype(np.float32), S, axis=1)
    dmin = np.repeat(stored["dmin"].astype(np.float32), S, axis=1)
    return d * stored["sc"].astype(np.float32), dmin * stored["mn"].astype(np.float32)


def _importance(importance, K: int) -> np.ndarray:
    """Per-input-channel weights of the squared error, normalized to mean 1, with a floor so
    a group whose channels all have zero importance still gets a sensible (uniform) fit."""
    if importance is None:
        return np.ones(K, np.float32)
    imp = np.asarray(importance, dtype=np.float64).reshape(-1)
    if imp.shape != (K,) or not np.all(np.isfinite(imp)) or np.any(imp < 0):
        raise ValueError(f"importance must be {K} finite values >= 0, got shape {imp.shape}")
    mean = imp.mean()
    imp = imp / mean if mean > 0 else np.ones(K)
    return (imp + 1e-4).astype(np.float32)


def importance_is_uniform(imp: np.ndarray) -> bool:
    return bool(np.all(imp == imp[0]))


def _wsum(wt, *factors):
    """Per row: sum_k wt[k] * factors[0][k] * ... (wt None: uniform weights, left out). By
    np.einsum: for rows of 32 it is ~4x faster than ndarray.sum(axis=1) (measured, numpy 2.4),
    and it multiplies without temporaries."""
    ops = factors if wt is None else (wt,) + factors
    return np.einsum(",".join(["ij"] * len(ops)) + "->i", *ops)


def _absmax_symmetric(x, hi):
    """q8_0 without importance: d = max|x| / 127 (float16), q = round(x / d). The error search
    lowers the squared error but moves the largest weights, which cost more: measured on
    SmolLM2-135M (LICENSE.txt, 8 x 256 tokens) absmax +0.2% perplexity, the search +0.9%."""
    d = (np.abs(x).max(axis=1) / hi).astype(np.float16).astype(np.float32)
    q = np.clip(np.round(x / np.where(d > 0, d, 1)[:, None]), -hi, hi)
    return q.astype(np.float32), d


def _search_symmetric(x, wt, lo, hi):
    """Per row of x (blocks, 32): q in [lo, hi] and scale d minimizing sum wt (x - d q)^2
    over candidate inverse scales around the abs-max one (d refit by weighted least squares
    for each candidate's rounding). Returns (q, d float16-exact float32)."""
    amax_i = np.argmax(np.abs(x), axis=1)
    mx = np.take_along_axis(x, amax_i[:, None], axis=1)[:, 0]  # signed largest magnitude
    if lo == -hi:  # symmetric range: the sign of the largest weight does not matter
        mx = np.abs(mx)
    # the largest magnitude maps to the extreme level of its own sign side: lo for q4_0
    # (-8 uses all 16 levels), +-hi for q8_0 (symmetric range)
    nmax = np.float32(-lo) if lo != -hi else np.float32(hi)
    best_err = np.full(x.shape[0], np.inf, np.float32)
    best_q = np.zeros(x.shape, np.float32)
    best_d = np.zeros(x.shape[0], np.float32)
    steps = range(-9, 10) if hi < 127 else range(-4, 5)
    safe = np.where(mx != 0, mx, 1).astype(np.float32)
    sign = np.float32(-1) if lo != -hi else np.float32(1)
    for i in steps:
        iscale = sign * (nmax + np.float32(0.1 * i)) / safe
        q = np.clip(np.round(x * iscale[:, None]), lo, hi)
        sl2 = _wsum(wt, q, q)
        d = np.where(sl2 > 0, _wsum(wt, x, q) / np.where(sl2 > 0, sl2, 1), 0)
        d = d.astype(np.float16).astype(np.float32)
        err = _wsum(wt, (x - d[:, None] * q) ** 2)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        np.copyto(best_q, q, where=better[:, None])
        best_d = np.where(better, d, best_d)
    zero = mx == 0
    best_q[zero] = 0
    best_d[zero] = 0
    return best_q, best_d


def _search_asymmetric(x, wt, nmax):
    """Per row of x: q in [0, nmax], scale d >= 0 and offset m minimizing
    sum wt (x - (d q + m))^2: candidate scales around (max - min) / nmax, each rounding refit
    by weighted least squares for (d, m). Returns (q, d, m) float32 (d, m not yet rounded)."""
    xmin, xmax = x.min(axis=1), x.max(axis=1)
    rng = xmax - xmin
    safe = np.where(rng > 0, rng, 1).astype(np.float32)
    sw = np.full(x.shape[0], x.shape[1], np.float32) if wt is None else wt.sum(axis=1)
    xc = x - xmin[:, None]  # (the same for every candidate)
    sx = _wsum(wt, x)
    # each candidate's error from the row sums it already has (no pass over the weights):
    # sum wt (x - d q - m)^2 = Sxx - 2 d Sxq - 2 m Sx + d^2 Sqq + 2 d m Sq + m^2 Sw, in float64
    sxx, sx64, sw64 = _wsum(wt, x, x).astype(np.float64), sx.astype(np.float64), sw.astype(np.float64)
    best_err = np.full(x.shape[0], np.inf, np.float64)
    best_iscale = np.zeros(x.shape[0], np.float32)  # the winner's rounding, redone at the end
    best_d = np.zeros(x.shape[0], np.float32)
    best_m = xmin.astype(np.float32).copy()
    q = np.empty_like(x)

    def rounding(iscale, out):
        np.multiply(xc, iscale[:, None], out=out)
        return np.clip(np.round(out, out=out), 0, nmax, out=out)

    for i in [None] + list(range(0, 21)):
        if i is None:  # the plain min/max grid
            d, m = rng / nmax, xmin
            iscale = np.float32(nmax) / safe
        else:
            iscale = (np.float32(-1 + 0.1 * i) + nmax) / safe
        rounding(iscale, q)
        sl, sl2, sxl = _wsum(wt, q), _wsum(wt, q, q), _wsum(wt, x, q)
        if i is not None:  # the rounding's least-squares (d, m)
            det = sw * sl2 - sl * sl
            ok = det > 0
            det = np.where(ok, det, 1)
            d = np.where(ok, (sw * sxl - sx * sl) / det, rng / nmax)
            m = np.where(ok, (sl2 * sx - sl * sxl) / det, xmin)
            d = np.maximum(d, 0)
        d64, m64 = d.astype(np.float64), m.astype(np.float64)
        err = (sxx - 2 * d64 * sxl - 2 * m64 * sx64 + d64 * d64 * sl2 + 2 * d64 * m64 * sl
               + m64 * m64 * sw64)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_iscale = np.where(better, iscale, best_iscale)
        best_d = np.where(better, d, best_d).astype(np.float32)
        best_m = np.where(better, m, best_m).astype(np.float32)
    best_q = rounding(best_iscale, q)
    flat = rng == 0  # constant group: q = 0, w = m
    best_q[flat] = 0
    best_d = np.where(flat, 0, best_d)
    best_m = np.where(flat, x[:, 0], best_m)
    return best_q, best_d.astype(np.float32), best_m.astype(np.float32)


# q4_k's first-level search: inverse scales (nmax - 1 + 0.1 i) / (max - min) for these i (and
# the plain min/max grid). Every other step of q4_1's 21 (i = 0..20): the second level re-rounds
# the weights against 6-bit codes of the chosen (d, m), and on llama-110m's weights the final
# squared rounding error came out 0.17% above the 21-step search's, at ~60% of its CPU time
KQUANT_STEPS = tuple(range(0, 21, 2))


def kquant_numerators(nmax: int) -> tuple:
    """q4_k's candidate inverse scales as numerators over a block's range, float32: the plain
    grid's nmax, then nmax - 1 + 0.1 i for i in KQUANT_STEPS."""
    return (np.float32(nmax),) + tuple(np.float32(np.float32(-1 + 0.1 * i) + nmax)
                                       for i in KQUANT_STEPS)


_TORCH_THREADS = {"users": 0, "before": None}
_TORCH_THREADS_LOCK = threading.Lock()


@contextmanager
def one_torch_thread():
    """torch's intra-op threads set to 1 while Python threads each run their own torch work
    (one candidate scaling or one chunk of rows per core): single-threaded ops in two Python
    threads cost ~2.5x less CPU than two-thread ops competing (measured on the 2-core build
    machine: 512 x 768 x 1024 sgemm 9 ms of CPU on one thread, 24 ms on two; numpy's OpenBLAS
    cannot be limited at run time, torch can). torch.set_num_threads is process-wide, so the
    setting is counted: the last block to leave restores the count from before the first."""
    import torch

    with _TORCH_THREADS_LOCK:
        if _TORCH_THREADS["users"] == 0:
            _TORCH_THREADS["before"] = torch.get_num_threads()
            torch.set_num_threads(1)
        _TORCH_THREADS["users"] += 1
    try:
        yield
    finally:
        with _TORCH_THREADS_LOCK:
            _TORCH_THREADS["users"] -= 1
            if _TORCH_THREADS["users"] == 0:
                torch.set_num_threads(_TORCH_THREADS["before"])


def quantize_kquant_torch(x, wt, N: int, K: int, nmax: int) -> dict:
    """The reference form of q4_k's search (the build runs kquant_search's compiled one, ~10x
    less CPU; tests compare the two). q4_k's stored arrays for the blocks x (N * K/32, 32):
    the first-level (d, m) search
    (_search_asymmetric's arithmetic with the minimum kept <= 0, over KQUANT_STEPS) and the
    6-bit second level (super-block scales, floor/ceil codes, the weights re-rounded).

    In torch on the transposed blocks (32, blocks): every element-wise op and every sum over a
    block's 32 weights runs along contiguous rows of blocks, where numpy broadcast one
    per-block scalar over 32 elements at a time (with 21 steps: ~2.5x less CPU than the
    numpy search it replaced; its sums were added in another order, so ~0.3% of the codes
    differed from it on random weights: ties within float rounding)."""
    import torch

    X = torch.from_numpy(np.ascontiguousarray(x.T))  # (32, blocks)
    Wt = None if wt is None else torch.from_numpy(np.ascontiguousarray(wt.T))
    tmp = torch.empty_like(X)

    def wsum(*factors):  # per block: sum over its 32 weights of wt * factors[0] * ...
        if len(factors) == 1 and Wt is None:
            return factors[0].sum(dim=0)
        if factors[0] is tmp:  # (only alone: tmp * wt in place)
            return tmp.mul_(Wt).sum(dim=0)
        torch.mul(factors[0], factors[1] if Wt is None else Wt, out=tmp)
        for f in factors[1 if Wt is not None else 2:]:
            tmp.mul_(f)
        return tmp.sum(dim=0)

    xmin = torch.clamp(X.amin(dim=0), max=0)
    rng = X.amax(dim=0) - xmin
    safe = torch.where(rng > 0, rng, 1)
    sw = torch.full_like(rng, X.shape[0]) if Wt is None else Wt.sum(dim=0)
    xc = X - xmin  # >= 0: only the upper clip can bite
    sx = wsum(X)
    sxx, sx64, sw64 = wsum(X, X).double(), sx.double(), sw.double()
    q = torch.empty_like(X)
    numerators = kquant_numerators(nmax)
    # one rounding and three sums over the weights per candidate; the least-squares fit, the
    # error and the choice once for all candidates on (candidates, blocks) arrays
    iscale = torch.empty((len(numerators), X.shape[1]))
    sl, sl2, sxl = (torch.empty_like(iscale) for _ in range(3))
    for c, numerator in enumerate(numerators):
        iscale[c] = numerator / safe
        torch.mul(xc, iscale[c], out=q)
        torch.clamp_(torch.round_(q), max=nmax)
        sl[c], sl2[c], sxl[c] = wsum(q), wsum(q, q), wsum(X, q)
    det = sw * sl2 - sl * sl
    ok = det > 0
    det = torch.where(ok, det, 1)
    d = torch.where(ok, (sw * sxl - sx * sl) / det, rng / nmax)
    m = torch.where(ok, (sl2 * sx - sl * sxl) / det, xmin)
    pos = m > 0  # the minimum kept <= 0: a fit of d alone
    d = torch.where(pos, torch.where(sl2 > 0, sxl / torch.where(sl2 > 0, sl2, 1), 0), d)
    m = torch.where(pos, 0, m)
    d = torch.clamp(d, min=0)
    d[0], m[0] = rng / nmax, xmin  # the plain grid keeps its own (d, m)
    d64, m64 = d.double(), m.double()
    err = (sxx - 2 * d64 * sxl - 2 * m64 * sx64 + d64 * d64 * sl2 + 2 * d64 * m64 * sl
           + m64 * m64 * sw64)
    err = torch.nan_to_num(err, nan=float("inf"))
    best_err, pick = err.min(dim=0, keepdim=True)  # ties: the first (earlier) candidate
    found = best_err[0] < float("inf")
    best_d = torch.where(found, d.gather(0, pick)[0], 0)
    best_m = torch.where(found, m.gather(0, pick)[0], xmin)
    flat = rng == 0  # constant group: w = m (<= 0), or a positive one by the scale
    x0 = X[0]
    scale = torch.where(flat, torch.where(x0 > 0, x0 / nmax, 0), best_d).view(N, K // GROUP)
    minimum = -torch.where(flat, torch.clamp(x0, max=0), best_m).view(N, K // GROUP)

    # second level: 6-bit codes of the group scales and minimums against float16 super-scales
    S = super_groups(K)
    NS = K // GROUP // S

    def super_scale(v):
        return (v.view(N, NS, S).amax(dim=2) / 63).half()

    d, dmin = super_scale(scale), super_scale(minimum)
    dg = d.float().repeat_interleave(S, dim=1).reshape(-1)
    mg = dmin.float().repeat_interleave(S, dim=1).reshape(-1)
    sc0 = torch.floor(scale.reshape(-1) / torch.where(dg > 0, dg, 1))
    mn0 = torch.floor(minimum.reshape(-1) / torch.where(mg > 0, mg, 1))
    # each group picks the neighbouring 6-bit codes of its scale and minimum (floor or ceil
    # of each) whose re-rounded weights have the least weighted error

    def rerounded(sc, mn):  # q of the codes (sc, mn), into `q`; (s, m) per block
        s, m = dg * sc, mg * mn
        torch.add(X, m, out=q)
        q.div_(torch.where(s > 0, s, 1)).round_()
        q.mul_(s > 0).clamp_(0, nmax)
        return s, m

    codes, errs = [], []
    for dsc in (0, 1):
        for dmn in (0, 1):
            sc, mn = torch.clamp(sc0 + dsc, 0, 63), torch.clamp(mn0 + dmn, 0, 63)
            s, m = rerounded(sc, mn)
            torch.mul(q, s, out=tmp)  # x - (s q - m)
            tmp.sub_(m)
            torch.sub(X, tmp, out=tmp)
            codes.append((sc, mn))
            errs.append(wsum(tmp.square_()))
    best_err, sc, mn = errs[0], *codes[0]
    for err, (c_sc, c_mn) in zip(errs[1:], codes[1:]):  # ties: the first
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        sc, mn = torch.where(better, c_sc, sc), torch.where(better, c_mn, mn)
    rerounded(sc, mn)
    return {"q": q.T.to(torch.uint8).numpy().reshape(N, K), "sc": sc.to(torch.uint8).numpy().reshape(N, -1),
            "mn": mn.to(torch.uint8).numpy().reshape(N, -1), "d": d.numpy(), "dmin": dmin.numpy()}


FORMATS: dict = {f.name: f for f in (
    WeightFormat("q8_0", "sym", 8, "int8, one float16 scale per 32 weights (8.5 bits/weight)"),
    WeightFormat("q4_0", "sym", 4, "4-bit symmetric, one float16 scale per 32 (4.5 bits/weight)"),
    WeightFormat("q4_1", "asym", 4, "4-bit, float16 scale and minimum per 32 (5.0 bits/weight)"),
    WeightFormat("q4_k", "kquant", 4, "4-bit, 6-bit scale and minimum per 32, float16 super-scales "
                                      "per 256 (4.5 bits/weight)"),
    WeightFormat("q3_k", "kquant", 3, "3-bit, q4_k's scales and minimums (3.5 bits/weight)"),
    WeightFormat("q5_k", "kquant", 5, "5-bit, q4_k's scales and minimums (5.5 bits/weight)"),
    WeightFormat("q6_k", "kquant", 6, "6-bit, q4_k's scales and minimums (6.5 bits/weight)"),
)}


def get_format(name: str) -> WeightFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r}: one of {', '.join(FORMATS)}") from None


def fake_quantize(w: np.ndarray, fmt: str, importance: np.ndarray | None = None) -> np.ndarray:
    """dequantize(quantize(w)): the weight a build computes with (for simulation)."""
    f = get_format(fmt)
    return f.dequantize(f.quantize(w, importance))


ACTIVATION_QMAX = {8: 127, 16: 127 * 256}  # |q| bound per block: int8, or int8 halves hi * 256 + lo


def quantize_activation(x: np.ndarray, bits: int = 8):
    """(q (..., K), s float32 (..., K/32)): x ~= q * s block-wise; the kernels' arithmetic
    (s = max|x| / Q per block of 32, q = round_half_even(x * (Q / max|x|)), Q = 127 for 8 bits;
    16 bits: Q = 127 * 256, q int32, which the kernel holds as int8 halves q = hi * 256 + lo)."""
    Q = ACTIVATION_QMAX[bits]
    x = np.asarray(x, dtype=np.float32)
    K = x.shape[-1]
    if K % ACTIVATION_BLOCK:
        raise ValueError(f"int8 activations need K % {ACTIVATION_BLOCK} == 0, got K = {K}")
    b = x.reshape(x.shape[:-1] + (K // ACTIVATION_BLOCK, ACTIVATION_BLOCK))
    amax = np.abs(b).max(axis=-1)
    inv = np.where(amax > 0, np.float32(Q) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.round(b * inv[..., None]), -Q, Q).astype(np.int8 if bits == 8 else np.int32)
    return q.reshape(x.shape), (amax / np.float32(Q)).astype(np.float32)


def fake_quantize_activation(x: np.ndarray, bits: int = 8) -> np.ndarray:
    """x after the activation round trip of the integer kernels (per 32-block scales)."""
    q, s = quantize_activation(x, bits)
    K = q.shape[-1]
    b = q.reshape(q.shape[:-1] + (K // ACTIVATION_BLOCK, ACTIVATION_BLOCK)).astype(np.float32)
    return (b * s[..., None]).reshape(q.shape).astype(np.float32)
