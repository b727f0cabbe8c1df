"""q4_k's scale search compiled for the build machine: the arithmetic of
formats.quantize_kquant_torch (the reference), one pass per block.

The torch search makes ~40 passes over (32, blocks) temporaries per row chunk: ~37-46 ns of
CPU per weight, the largest single cost of a q4 build (llama-1b: ~0.9 G weights). Here LANES
blocks at a time (one block per vector lane) are searched in registers and the core's L1:
every candidate's rounding, its three sums, the least-squares fit and its error, then the
second level's four code pairs.

Compiled once per process with TVM for the host CPU (runtime/cpu_probe.host_target: the
machine running the build, not necessarily the build's target). Float semantics follow the
torch form: float32 sums and fits, float64 errors, round half to even, ties to the earlier
candidate. Its sums over a block's 32 weights run in another order, so a code can differ where
two candidates tie within float rounding (tests/quantization/test_kquant_search.py bounds
that)."""
from __future__ import annotations

import threading

import numpy as np

GROUP = 32  # weights per block (formats.GROUP)
LANES = 16  # blocks per vector: one AVX-512 register of float32

_LOCK = threading.Lock()
_COMPILED: dict = {}  # (nmax, numerators, weighted) -> {"first": f, "second": f, "module": m}


def _kernels(nmax: int, candidates: int, weighted: bool):
    """TIR of the two levels for 4-bit codes in [0, nmax] and `candidates` inverse scales
    numer[c] / range (candidate 0 keeps the plain min/max grid's (range / nmax, min)).

    Blocks come in their natural layout x (blocks, 32) (row-major (N, K) weights) and go out
    as q (padded blocks, 32); each tile of LANES blocks is transposed on the stack so that a
    vector holds one weight of LANES blocks. `weighted`: importance per input channel
    imp (K/32, 32), block b's being imp[b % (K/32)]; without, the products by 1 are left out
    (exact either way)."""
    from tvm.script import tirx as T

    L = LANES
    NC = candidates
    fmax = T.float32(float(nmax))
    scratch = "global"  # stack arrays of a few vectors (LLVM keeps most in registers)

    def wt(w, j, i, value):  # value times the weight's importance
        return w[j, i] * value if weighted else value

    @T.macro
    def load_tile(X, IMP, xt, w, bo, nb, ng):
        for i in range(L):
            for j in range(GROUP):
                xt[j, i] = X[T.min(bo * L + i, nb - 1), j]
                if weighted:
                    w[j, i] = IMP[T.min(bo * L + i, nb - 1) % ng, j]

    @T.prim_func
    def kquant_first(x: T.handle, imp: T.handle, numer: T.handle, scale: T.handle,
                     minimum: T.handle):
        T.func_attr({"tirx.noalias": True})
        nb = T.int32()
        nbp = T.int32()
        ng = T.int32()
        X = T.match_buffer(x, (nb, GROUP), "float32")
        IMP = T.match_buffer(imp, (ng, GROUP), "float32")
        C = T.match_buffer(numer, (NC,), "float32")
        S = T.match_buffer(scale, (nbp,), "float32")
        M = T.match_buffer(minimum, (nbp,), "float32")
        for bo in range(nbp // L):
            xt = T.alloc_buffer((GROUP, L), "float32", scope=scratch)
            w = T.alloc_buffer((GROUP, L), "float32", scope=scratch)
            lo = T.alloc_buffer((L,), "float32", scope=scratch)
            hi = T.alloc_buffer((L,), "float32", scope=scratch)
            sw = T.alloc_buffer((L,), "float32", scope=scratch)
            sx = T.alloc_buffer((L,), "float32", scope=scratch)
            sxx = T.alloc_buffer((L,), "float32", scope=scratch)
            sl = T.alloc_buffer((L,), "float32", scope=scratch)
            sl2 = T.alloc_buffer((L,), "float32", scope=scratch)
            sxl = T.alloc_buffer((L,), "float32", scope=scratch)
            isc = T.alloc_buffer((L,), "float32", scope=scratch)
            q = T.alloc_buffer((L,), "float32", scope=scratch)
            d = T.alloc_buffer((L,), "float32", scope=scratch)
            m = T.alloc_buffer((L,), "float32", scope=scratch)
            err = T.alloc_buffer((L,), "float64", scope=scratch)
            best = T.alloc_buffer((L,), "float64", scope=scratch)
            bd = T.alloc_buffer((L,), "float32", scope=scratch)
            bm = T.alloc_buffer((L,), "float32", scope=scratch)
            load_tile(X, IMP, xt, w, bo, nb, ng)
            for i in T.vectorized(L):
                lo[i] = xt[0, i]
                hi[i] = xt[0, i]
                sw[i] = T.float32(0 if weighted else GROUP)
                sx[i] = T.float32(0)
                sxx[i] = T.float32(0)
            for j in range(GROUP):
                for i in T.vectorized(L):
                    lo[i] = T.min(lo[i], xt[j, i])
                    hi[i] = T.max(hi[i], xt[j, i])
                    if weighted:
                        sw[i] = sw[i] + w[j, i]
                    sx[i] = sx[i] + wt(w, j, i, xt[j, i])
                    sxx[i] = sxx[i] + wt(w, j, i, xt[j, i]) * xt[j, i]
            for i in T.vectorized(L):
                lo[i] = T.min(lo[i], T.float32(0))  # xmin: the minimum kept <= 0
                hi[i] = hi[i] - lo[i]  # the range
                best[i] = T.float64(np.inf)
                bd[i] = T.float32(0)
                bm[i] = lo[i]
            for c in range(NC):
                for i in T.vectorized(L):
                    isc[i] = C[c] / T.Select(hi[i] > T.float32(0), hi[i], T.float32(1))
                    sl[i] = T.float32(0)
                    sl2[i] = T.float32(0)
                    sxl[i] = T.float32(0)
                for j in range(GROUP):
                    for i in T.vectorized(L):
                        q[i] = T.min(T.round((xt[j, i] - lo[i]) * isc[i]), fmax)
                        sl[i] = sl[i] + wt(w, j, i, q[i])
                        sl2[i] = sl2[i] + wt(w, j, i, q[i]) * q[i]
                        sxl[i] = sxl[i] + wt(w, j, i, xt[j, i]) * q[i]
                for i in T.vectorized(L):
                    # the weighted least-squares (d, m) of x ~ d q + m; a positive m refits d
                    # alone with m = 0; candidate 0 keeps the grid's own (range / nmax, xmin)
                    d[i] = T.Select(sw[i] * sl2[i] - sl[i] * sl[i] > T.float32(0),
                                    (sw[i] * sxl[i] - sx[i] * sl[i])
                                    / (sw[i] * sl2[i] - sl[i] * sl[i]), hi[i] / fmax)
                    m[i] = T.Select(sw[i] * sl2[i] - sl[i] * sl[i] > T.float32(0),
                                    (sl2[i] * sx[i] - sl[i] * sxl[i])
                                    / (sw[i] * sl2[i] - sl[i] * sl[i]), lo[i])
                    d[i] = T.Select(m[i] > T.float32(0),
                                    T.Select(sl2[i] > T.float32(0), sxl[i] / sl2[i],
                                             T.float32(0)), d[i])
                    m[i] = T.Select(m[i] > T.float32(0), T.float32(0), m[i])
                    d[i] = T.max(d[i], T.float32(0))
                    d[i] = T.Select(c == 0, hi[i] / fmax, d[i])
                    m[i] = T.Select(c == 0, lo[i], m[i])
                    err[i] = (T.Cast("float64", sxx[i])
                              - T.float64(2) * T.Cast("float64", d[i]) * T.Cast("float64", sxl[i])
                              - T.float64(2) * T.Cast("float64", m[i]) * T.Cast("float64", sx[i])
                              + T.Cast("float64", d[i]) * T.Cast("float64", d[i])
                              * T.Cast("float64", sl2[i])
                              + T.float64(2) * T.Cast("float64", d[i]) * T.Cast("float64", m[i])
                              * T.Cast("float64", sl[i])
                              + T.Cast("float64", m[i]) * T.Cast("float64", m[i])
                              * T.Cast("float64", sw[i]))
                    bd[i] = T.Select(err[i] < best[i], d[i], bd[i])
                    bm[i] = T.Select(err[i] < best[i], m[i], bm[i])
                    best[i] = T.Select(err[i] < best[i], err[i], best[i])
            for i in T.vectorized(L):
                # a constant group (range 0): w = its value, <= 0 here, as the minimum
                S[bo * L + i] = T.Select(hi[i] == T.float32(0), T.Select(
                    xt[0, i] > T.float32(0), xt[0, i] / fmax, T.float32(0)), bd[i])
                M[bo * L + i] = T.float32(0) - T.Select(
                    hi[i] == T.float32(0), T.min(xt[0, i], T.float32(0)), bm[i])

    @T.prim_func
    def kquant_second(x: T.handle, imp: T.handle, dg: T.handle, mg: T.handle, sc0: T.handle,
                      mn0: T.handle, qout: T.handle, scout: T.handle, mnout: T.handle):
        T.func_attr({"tirx.noalias": True})
        nb = T.int32()
        nbp = T.int32()
        ng = T.int32()
        X = T.match_buffer(x, (nb, GROUP), "float32")
        IMP = T.match_buffer(imp, (ng, GROUP), "float32")
        DG = T.match_buffer(dg, (nbp,), "float32")
        MG = T.match_buffer(mg, (nbp,), "float32")
        SC0 = T.match_buffer(sc0, (nbp,), "float32")
        MN0 = T.match_buffer(mn0, (nbp,), "float32")
        Q = T.match_buffer(qout, (nbp, GROUP), "uint8")
        SC = T.match_buffer(scout, (nbp,), "uint8")
        MN = T.match_buffer(mnout, (nbp,), "uint8")
        for bo in range(nbp // L):
            xt = T.alloc_buffer((GROUP, L), "float32", scope=scratch)
            w = T.alloc_buffer((GROUP, L), "float32", scope=scratch)
            qt = T.alloc_buffer((GROUP, L), "uint8", scope=scratch)
            s = T.alloc_buffer((L,), "float32", scope=scratch)
            m = T.alloc_buffer((L,), "float32", scope=scratch)
            q = T.alloc_buffer((L,), "float32", scope=scratch)
            t = T.alloc_buffer((L,), "float32", scope=scratch)
            err = T.alloc_buffer((L,), "float32", scope=scratch)
            best = T.alloc_buffer((L,), "float32", scope=scratch)
            bsc = T.alloc_buffer((L,), "float32", scope=scratch)
            bmn = T.alloc_buffer((L,), "float32", scope=scratch)
            load_tile(X, IMP, xt, w, bo, nb, ng)
            for c in T.unroll(4):  # (scale code, minimum code) = floors + (c // 2, c % 2)
                for i in T.vectorized(L):
                    s[i] = DG[bo * L + i] * T.min(T.max(SC0[bo * L + i] + T.Cast(
                        "float32", c // 2), T.float32(0)), T.float32(63))
                    m[i] = MG[bo * L + i] * T.min(T.max(MN0[bo * L + i] + T.Cast(
                        "float32", c % 2), T.float32(0)), T.float32(63))
                    err[i] = T.float32(0)
                for j in range(GROUP):
                    for i in T.vectorized(L):
                        q[i] = T.min(T.max(T.round((xt[j, i] + m[i]) / T.Select(
                            s[i] > T.float32(0), s[i], T.float32(1))) * T.Select(
                            s[i] > T.float32(0), T.float32(1), T.float32(0)), T.float32(0)),
                            fmax)
                        t[i] = xt[j, i] - (q[i] * s[i] - m[i])
                        err[i] = err[i] + wt(w, j, i, t[i] * t[i])
                for i in T.vectorized(L):
                    bsc[i] = T.Select(c == 0 or err[i] < best[i], T.min(T.max(
                        SC0[bo * L + i] + T.Cast("float32", c // 2), T.float32(0)),
                        T.float32(63)), bsc[i])
                    bmn[i] = T.Select(c == 0 or err[i] < best[i], T.min(T.max(
                        MN0[bo * L + i] + T.Cast("float32", c % 2), T.float32(0)),
                        T.float32(63)), bmn[i])
                    best[i] = T.Select(c == 0 or err[i] < best[i], err[i], best[i])
            for i in T.vectorized(L):
                s[i] = DG[bo * L + i] * bsc[i]
                m[i] = MG[bo * L + i] * bmn[i]
                SC[bo * L + i] = T.Cast("uint8", bsc[i])
                MN[bo * L + i] = T.Cast("uint8", bmn[i])
            for j in range(GROUP):
                for i in T.vectorized(L):
                    qt[j, i] = T.Cast("uint8", T.min(T.max(T.round(
                        (xt[j, i] + m[i]) / T.Select(s[i] > T.float32(0), s[i], T.float32(1)))
                        * T.Select(s[i] > T.float32(0), T.float32(1), T.float32(0)),
                        T.float32(0)), fmax))
            for i in range(L):
                for j in range(GROUP):
                    Q[bo * L + i, j] = qt[j, i]

    return kquant_first, kquant_second


def compiled(nmax: int, numerators: tuple, weighted: bool) -> dict:
    """{"first": f, "second": f}: the two levels compiled for this machine (once per process
    and variant; thread-safe)."""
    key = (nmax, tuple(float(c) for c in numerators), weighted)
    with _LOCK:
        if key not in _COMPILED:
            import tvm

            from ..runtime.cpu_probe import host_target

            first, second = _kernels(nmax, len(key[1]), weighted)
            mod = tvm.IRModule({"kquant_first": first.with_attr("global_symbol", "kquant_first"),
                                "kquant_second": second.with_attr("global_symbol",
                                                                  "kquant_second")})
            ex = tvm.compile(mod, target=host_target())
            _COMPILED[key] = {"first": ex["kquant_first"], "second": ex["kquant_second"],
                              "module": ex}
        return _COMPILED[key]


def quantize_blocks(x: np.ndarray, importance: np.ndarray | None, N: int, K: int, nmax: int,
                    numerators: tuple, super_groups: int) -> dict:
    """q4_k's stored arrays (formats.WeightFormat.quantize's) of the blocks x (N * K/32, 32)
    float32 with importance per input channel (K,) or None; `super_groups` groups share a
    float16 super-scale."""
    import tvm

    weighted = importance is not None
    fns = compiled(nmax, numerators, weighted)
    NG = K // GROUP
    B = N * NG
    Bp = -(-B // LANES) * LANES
    dev = tvm.cpu()
    tensor = lambda a: tvm.runtime.tensor(a, dev)  # noqa: E731
    tx = tensor(np.ascontiguousarray(x, dtype=np.float32))
    timp = tensor(np.ones((1, GROUP), np.float32) if importance is None else
                  np.ascontiguousarray(importance, dtype=np.float32).reshape(NG, GROUP))
    ts, tm = tensor(np.empty(Bp, np.float32)), tensor(np.empty(Bp, np.float32))
    fns["first"](tx, timp, tensor(np.array(numerators, np.float32)), ts, tm)
    scale, minimum = ts.numpy()[:B].reshape(N, NG), tm.numpy()[:B].reshape(N, NG)

    # second level: float16 super-scales of the group scales and minimums, floor codes
    S, NS = super_groups, NG // super_groups
    d = (scale.reshape(N, NS, S).max(axis=2) / np.float32(63)).astype(np.float16)
    dmin = (minimum.reshape(N, NS, S).max(axis=2) / np.float32(63)).astype(np.float16)
    dg, mg, sc0, mn0 = (np.zeros(Bp, np.float32) for _ in range(4))
    dg[:B] = np.repeat(d.astype(np.float32), S, axis=1).reshape(-1)
    mg[:B] = np.repeat(dmin.astype(np.float32), S, axis=1).reshape(-1)
    one = np.float32(1)
    np.floor(scale.reshape(-1) / np.where(dg[:B] > 0, dg[:B], one), out=sc0[:B])
    np.floor(minimum.reshape(-1) / np.where(mg[:B] > 0, mg[:B], one), out=mn0[:B])
    tq = tensor(np.empty((Bp, GROUP), np.uint8))
    tsc, tmn = tensor(np.empty(Bp, np.uint8)), tensor(np.empty(Bp, np.uint8))
    fns["second"](tx, timp, *(tensor(a) for a in (dg, mg, sc0, mn0)), tq, tsc, tmn)
    return {"q": tq.numpy()[:B].reshape(N, K), "sc": tsc.numpy()[:B].reshape(N, NG),
            "mn": tmn.numpy()[:B].reshape(N, NG), "d": d, "dmin": dmin}
