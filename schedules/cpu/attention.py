"""Attention over the paged KV cache for CPUs: hand-scheduled replacements for TVM's decode
kernel and its ragged prefill kernel (attention among a prefill's new tokens).

TVM's CPU kernel (`batch_decode_paged_kv_cpu`) runs every (sequence, head) on one thread with scalar loops and rescales the
output after every single token: on llama-110m it took 1.6 ms of a 4 ms W4A8 decode step (12
layers, ~190 cached tokens). The decode kernel here keeps TVM's signature (the runtime's paged
KV cache calls it unchanged) and:

* runs (sequence, KV head) pairs in parallel; the query heads sharing a KV head (GQA) are
  handled together, so each K/V page is read from memory once per group;
* scores 16 keys at a time as one vector: each key's products over the head dim in 16-lane
  FMAs, then the 16 keys' lanes summed by a merge tree of shuffles (15 two-shuffle merges for
  16 keys, where a horizontal sum per key took 4 shuffle-and-adds each); one online-softmax
  rescale and one vector of exponentials (no libm call per key) per block; each output row
  rewritten once per block as a single expression (nothing accumulated through memory);
* with fewer (sequence, KV head) items than the target's cores (batch 1, few KV heads, many
  cores), splits each sequence's keys into page-aligned chunks attended in parallel and
  merged by their maxima on the calling thread; with enough items (llama-110m's and
  llama-1b's 4 KV heads on 2 cores) there is one parallel pass and no workspace;
* keeps its scratch on the stack, not in TVM's workspace pool (see SCRATCH): a call costs its
  keys and one parallel fork (groups whose query rows reach 1 KiB, llama-1b's 8 heads of 64,
  still take their query and output rows from the pool, two allocations per item);
* requires the rotary embedding to be applied before the cache (our import uses
  RopeMode.NONE, see tvm_llm/frontend/relax_import.py); rotary_mode is ignored.

Per-layer attention variants (`LayerTable`): sliding windows, logit soft-capping (Gemma 2) and
attention sinks (gpt-oss). The cache calls one kernel for every layer and hands it only the
`sm_scale` our import passed for that layer, so a model with variants passes a *layer code*
there instead, -(layer + 1), and the kernels look the layer's scale, window, soft-cap and sink
logits up in tables compiled into them. Masks are by position (query position minus key
position < window, as transformers' sliding masks), so they are exact whatever the cache keeps;
a sink joins the softmax denominator once per query row, in the one partial kernel whose keys
contain the query's own token (the cache merges partial results by their log-sum-exp).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import tirx
from tvm.script import tirx as T

from . import amx_bf16
from .common import prefetch_l2
from .fast_math import fast_exp_expr

PAGE_SIZES = (8, 16, 32, 64, 128)  # page sizes the kernels are built for (tokens per page)
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclass(frozen=True)
class LayerTable:
    """Per-layer attention settings compiled into the kernels (see the module docstring).

    scales: softmax scale per layer; windows: sliding window per layer in tokens (0: full
    attention; key visible when query position - key position < window); softcaps: logit
    soft-cap per layer (0: none; score = cap * tanh(score / cap), after scaling); sinks: per
    layer, one sink logit per query head (natural log domain), or None for a model without."""

    scales: tuple
    windows: tuple
    softcaps: tuple
    sinks: tuple | None = None

    @property
    def has_window(self) -> bool:
        return any(w > 0 for w in self.windows)

    @property
    def has_softcap(self) -> bool:
        return any(c > 0 for c in self.softcaps)


def _lookup(index, values, dtype: str):
    """values[index] as a balanced tree of Selects (tables are small: layers, layers x heads)."""
    def node(lo, hi):
        if hi - lo == 1:
            return tirx.const(values[lo], dtype)
        mid = (lo + hi) // 2
        return tirx.Select(index < mid, node(lo, mid), node(mid, hi))

    return node(0, len(values))


def _layer(sm_scale):
    """The layer a call is for, from the layer code -(layer + 1) passed as sm_scale."""
    return T.Cast("int32", T.float32(0.5) - sm_scale) - 1


# A layer without variants passes its plain (positive) scale even in a model with a table.

def _scale2(table, sm_scale):
    """The call's softmax scale times log2 e (scores are kept in the log2 domain)."""
    plain = sm_scale * T.float32(LOG2E)
    if table is None:
        return plain
    return T.Select(sm_scale < T.float32(0), _lookup(
        _layer(sm_scale), [float(s) * LOG2E for s in table.scales], "float32"), plain)


def _window(table, sm_scale):
    if table is None or not table.has_window:
        return tirx.const(0, "int32")
    return T.Select(sm_scale < T.float32(0), _lookup(
        _layer(sm_scale), [int(w) for w in table.windows], "int32"), 0)


def _cap2(table, sm_scale):  # 0: no soft-cap
    return T.Select(sm_scale < T.float32(0), _lookup(
        _layer(sm_scale), [float(c) * LOG2E for c in table.softcaps], "float32"), T.float32(0))


def _sink2(table, sm_scale, head, num_qo_heads):  # -1e30: no sink (adds exp2(-1e30) = 0)
    flat = [float(v) * LOG2E for row in table.sinks for v in row]
    return T.Select(sm_scale < T.float32(0), _lookup(
        _layer(sm_scale) * num_qo_heads + head, flat, "float32"), T.float32(-1e30))


def _window_start(window, q_pos, k_pos0):
    """First logical key index a query at `q_pos` sees when key t sits at position k_pos0 + t."""
    return T.Select(window > 0, T.max(q_pos - window + 1 - k_pos0, 0), 0)


def _exp2(x):
    """2^x as vector-friendly arithmetic (schedules/cpu/fast_math.py), not a libm call per key."""
    return fast_exp_expr(x * T.float32(LN2), "float32")


def _dot(q, g, K, base, D: int, L: int, vector: bool = True):
    """q[g, :] . K[base : base + D] as one expression: L-lane products summed over the head
    dim in vector registers, then the lanes folded in halves (log2 L shuffles and adds; a
    serial sum of the lanes chained L dependent scalar adds per key). `vector=False`: a
    scalar sum (GPU builds, whose codegen has no wide vector types)."""
    if not vector:
        acc = None
        for d in range(D):
            term = q[g, d] * tirx.Cast("float32", K[base + d])
            acc = term if acc is None else acc + term
        return acc
    vec = f"float32x{L}" if L > 1 else "float32"
    acc = None
    for d0 in range(D // L):
        k = K.vload([base + d0 * L], f"{K.dtype}x{L}" if L > 1 else K.dtype)
        if K.dtype != "float32":
            k = tirx.Cast(vec, k)
        term = q.vload([g, d0 * L], vec) * k
        acc = term if acc is None else acc + term
    n = L
    while n > 1:
        h = n // 2
        acc = (tirx.Shuffle([acc], [tirx.const(i, "int32") for i in range(h)])
               + tirx.Shuffle([acc], [tirx.const(i, "int32") for i in range(h, n)]))
        n = h
    return acc


def _lanes(D: int) -> int:
    for lanes in (16, 8, 4, 2):
        if D % lanes == 0:
            return lanes
    return 1


def _online_softmax_macros(G: int, D: int, L: int, dtype: str, table: LayerTable | None,
                           H_qo: int, vector: bool = True):
    """The per-(row, KV head) attention steps the kernels share, as TVMScript macros over
    local buffers q (G, D), o (G, D), m (G,), den (G,), s (block,), part (L,), mx (1,):

    * start: load the G query rows (pre-scaled by the layer's scale * log2 e), zero the state;
    * block: score `ntok` keys (vectorized dot products, soft-capped where the layer says so),
      one online-softmax rescale, add the weighted value rows; keys and values are read
      through flat views of the cache, token t at `base + t * stride` (the paged cache and the
      ragged K/V lay tokens out differently); callers pass only the keys the masks let through;
    * finish: add the layer's sink logits to the denominators when `add_sink` (models with
      sinks only), normalize, write the output rows and their log2-sum-exp.
    """
    capped = table is not None and table.has_softcap
    sinks = table is not None and table.sinks is not None
    scope = SCRATCH if vector else "local"  # scalars: stack on CPUs (see SCRATCH), GPU registers

    @T.macro
    def start(q, o, m, den, Q, q_row, q_head0, sm_scale):
        for g in range(G):
            for d in T.vectorized(D):
                q[g, d] = T.Cast("float32", Q[q_row, q_head0 + g, d]) * _scale2(table, sm_scale)
                o[g, d] = T.float32(0)
            m[g] = T.float32(-5e4)
            den[g] = T.float32(0)

    @T.macro
    def block(q, o, m, den, s, part, mx, K, V, k_base, v_base, stride, ntok, sm_scale):
        for g in range(G):
            for t in range(ntok):
                if capped:
                    s[t] = T.Select(_cap2(table, sm_scale) > T.float32(0),
                                    _cap2(table, sm_scale) * T.tanh(
                                        _dot(q, g, K, k_base + t * stride, D, L, vector)
                                        / _cap2(table, sm_scale)),
                                    _dot(q, g, K, k_base + t * stride, D, L, vector))
                else:
                    s[t] = _dot(q, g, K, k_base + t * stride, D, L, vector)
            mx[0] = m[g]
            for t in range(ntok):
                mx[0] = T.max(mx[0], s[t])
            rescale = _held("float32", _exp2(m[g] - mx[0]), scope)
            den[g] = den[g] * rescale
            for d in T.vectorized(D):
                o[g, d] = o[g, d] * rescale
            if ntok == s.shape[0]:  # a full block: the exponentials as one vector
                for t in T.vectorized(s.shape[0]):
                    s[t] = _exp2(s[t] - mx[0])
            else:
                for t in range(ntok):
                    s[t] = _exp2(s[t] - mx[0])
            for t in range(ntok):
                den[g] = den[g] + s[t]
            # value rows: each L-lane slice of the output row stays in a register over the keys
            for t in range(ntok):
                for d in T.vectorized(D):
                    o[g, d] = o[g, d] + s[t] * T.Cast("float32", V[v_base + t * stride + d])
            m[g] = mx[0]

    @T.macro
    def finish(o, m, den, mx, out, lse, q_row, q_head0, add_sink, sm_scale):
        for g in range(G):
            if sinks:
                if add_sink:
                    mx[0] = T.max(m[g], _sink2(table, sm_scale, q_head0 + g, H_qo))
                    den[g] = den[g] * T.exp2(m[g] - mx[0]) + T.exp2(
                        _sink2(table, sm_scale, q_head0 + g, H_qo) - mx[0])
                    for d in T.vectorized(D):
                        o[g, d] = o[g, d] * T.exp2(m[g] - mx[0])
                    m[g] = mx[0]
            inv = _held("float32", T.Select(den[g] > T.float32(0), T.float32(1) / den[g],
                                            T.float32(0)), scope)
            for d in T.vectorized(D):
                out[q_row, q_head0 + g, d] = T.Cast(dtype, o[g, d] * inv)
            lse[q_row, q_head0 + g] = T.Select(den[g] > T.float32(0), m[g] + T.log2(den[g]), m[g])

    return start, block, finish


def _kv_rows(page, kv: int, hk, H_kv: int, PAGE: int, D: int):
    """Flat offset, in the cache's page pool (pages, 2, H_kv, PAGE, D), of the first key (kv 0)
    or value (kv 1) row of KV head hk in `page`."""
    return ((page * 2 + kv) * H_kv + hk) * PAGE * D


def _over_pages_macro(block, PAGE: int, H_kv: int, D: int, scope: str = "local"):
    """Attention of one (query row, KV head) item over a sequence's pages, keys of logical index
    in [t_lo, t_hi) only. Logical key t lies at physical slot t + offset of the page list
    (offset 0, except in the cache's sliding-window layout, where the slid-out slots of the
    first page precede it; our runtime enables sliding windows with no attention-sink tokens).
    `scope`: where its index scalars live (SCRATCH on CPUs, see there)."""

    @T.macro
    def over_pages(q, o, m, den, s, part, mx, flat, page_values, begin, npages, last, offset,
                   t_lo, t_hi, hk, sm_scale):
        for p in range(npages):
            page = _held("int32", page_values[begin + p], scope)
            ntok = _held("int32", T.Select(p == npages - 1, last, PAGE), scope)
            lo = _held("int32", T.max(p * PAGE, t_lo + offset), scope)
            hi = _held("int32", T.min(p * PAGE + ntok, t_hi + offset), scope)
            if hi > lo:
                k_base = _held("int32", _kv_rows(page, 0, hk, H_kv, PAGE, D) + (lo - p * PAGE) * D,
                               scope)
                v_base = _held("int32", _kv_rows(page, 1, hk, H_kv, PAGE, D) + (lo - p * PAGE) * D,
                               scope)
                block(q, o, m, den, s, part, mx, flat, flat, k_base, v_base, D, hi - lo, sm_scale)

    return over_pages


@T.macro
def sequence_of_row(seq, q_indptr, batch_size, row):
    """seq[0] = the sequence whose query rows (q_indptr) hold packed row `row` (prefill)."""
    seq[0] = 0
    for bb in range(batch_size):
        if q_indptr[bb] <= row:
            seq[0] = bb


def _length_shape(batch, sliding: bool):
    """The cache's length info: last page lengths, or (sliding layout) rows of last page
    length, window offset in the first page, attention-sink length."""
    return (3, batch) if sliding else (batch,)


def _last_page_len(length_info, b, sliding: bool):
    return length_info[0, b] if sliding else length_info[b]


def _window_offset(length_info, b, npages, sliding: bool):
    return T.Select(npages > 0, length_info[1, b], 0) if sliding else 0


def _owns_sink(table, sliding: bool, n_keys, k_pos0, q_pos):
    """Whether this partial adds the sink: it holds the query's own key (the last one), which a
    sliding-window layout never does (the cache attends the new tokens in the ragged kernel)."""
    if table is None or table.sinks is None or sliding:
        return False
    return tirx.all(n_keys > 0, k_pos0 + n_keys - 1 == q_pos)


# Scratch memory of the CPU decode and tiled ragged prefill kernels. TVM's LowerTVMBuiltin
# keeps an allocation on the stack only when its scope is "global" and it is under 1 KiB; a
# "local" one, whatever its size, becomes a TVMBackendAllocWorkspace / FreeWorkspace pair
# through the runtime's workspace pool, run each time the parallel body runs. TVMScript's
# `x = expr` makes such a one-element "local" buffer too: the decode kernel had 19 pairs per
# (sequence, KV head) item (the pool's functions took ~40% of the samples of a tiny model's
# decode attention), the tiled ragged prefill 58 per tile. So per-item buffers are "global"
# (stack arrays), and the scalars that feed indices are held in one-element "global" buffers
# (`_held`); an immutable `x: T.let = expr` instead made s_tir's CompactBufferAllocation
# analyse the nested min/max index expressions (one kernel's compile 0.9 -> 3.9 s); values
# that feed no index (rescales, P rows) are `T.let`.
SCRATCH = "global"


def _held(dtype: str, value, scope: str = SCRATCH):
    """`name = _held(dtype, expr)` in TVMScript: expr stored in a one-element stack buffer and
    read back as `name` (see SCRATCH). GPU builds of the shared macros pass "local" (registers:
    what a plain `name = expr` gives)."""
    held = T.alloc_scalar(dtype, scope=scope)
    T.buffer_store(held.scalar.source, value, [0])
    return held


TB_MAX = 16  # keys scored together in the CPU decode kernel: one float32x16 vector of scores


def _vec_exp2_n(x, lanes: int):
    """2^x of a float32 vector expression of `lanes` lanes (the fast exp)."""
    return fast_exp_expr(x * tirx.Broadcast(tirx.const(LN2, "float32"), lanes),
                         f"float32x{lanes}")


def _fold(v, lanes: int, op):
    """v's lanes combined with `op` (max or +) by halves: log2(lanes) shuffles, a scalar."""
    n = lanes
    while n > 1:
        h = n // 2
        v = op(tirx.Shuffle([v], [tirx.const(i, "int32") for i in range(h)]),
               tirx.Shuffle([v], [tirx.const(i, "int32") for i in range(h, n)]))
        n = h
    return v


def _transpose_sum(vecs, L: int):
    """[v_0 .. v_{n-1}], each L lanes whose sum is key t's score, -> one n-lane vector of the
    n sums in key order. Pairs are merged level by level: the two inputs' lanes of each key
    halve (lane j added to lane j + run/2 of its run) and sit side by side, so n keys take
    n - 1 merges of two shuffles and an add (n horizontal sums took n log2 L)."""
    level = [(v, L, L) for v in vecs]  # (vector, lanes, lanes per key)
    while len(level) > 1:
        merged = []
        for (a, n, run), (b, _, _) in zip(level[0::2], level[1::2]):
            if run == 1:  # one lane per key already: concatenate
                merged.append((tirx.Shuffle([a, b], [tirx.const(i, "int32")
                                                     for i in range(2 * n)]), 2 * n, 1))
                continue
            lo = [j for j in range(n) if j % run < run // 2]
            hi = [j for j in range(n) if j % run >= run // 2]
            pick = (lambda idx: tirx.Shuffle([a, b], [tirx.const(i, "int32")
                                                      for i in idx + [n + j for j in idx]]))
            merged.append((pick(lo) + pick(hi), n, run // 2))
        level = merged
    v, n, run = level[0]
    while run > 1:  # fewer keys than lanes: fold each key's remaining lanes
        lo = [j for j in range(n) if j % run < run // 2]
        hi = [j for j in range(n) if j % run >= run // 2]
        v = (tirx.Shuffle([v], [tirx.const(i, "int32") for i in lo])
             + tirx.Shuffle([v], [tirx.const(i, "int32") for i in hi]))
        n, run = n // 2, run // 2
    return v


def _vector_decode_func(H_kv: int, H_qo: int, D: int, dtype: str, PAGE: int,
                        table: LayerTable | None, sliding: bool, threads: int):
    """The CPU decode kernel (see `decode_attention_func`): keys in blocks of TB (16) with the
    G query heads of a KV group together.

    Per block and query head, the TB scores are one vector: each key's L-lane products over
    the head dim (D / L vector FMAs) are summed across keys and lanes at once by
    `_transpose_sum` (TB - 1 two-shuffle merges, against TB log2 L shuffles and adds for
    TB separate horizontal sums); the block's maximum, exponentials (one vector) and sum
    update the online softmax once; then each output row is rewritten as one expression,
    o * rescale + sum_t p_t V_t over the block (two partial sums), so nothing accumulates
    through memory (inside a whole model's module LLVM may not know the buffers apart).
    Every block reads its key and value rows clamped into its valid keys [lo, hi) and masks
    the scores and weights of the others (a partial last page, a chunk or window edge; never
    reading a slot the cache has not written: its junk may be NaN). One code path for full and
    partial blocks: as fast as a separate unmasked one (the clamps are scalar work beside the
    vector work) and half the code to compile.

    Parallel items are (sequence, KV head) pairs; with fewer than `threads` of them (batch 1,
    few KV heads) each sequence's keys are split into ceil(threads / items) page-aligned
    chunks, attended in parallel, and merged by their maxima afterwards on the calling thread
    (a second parallel pass cost more than the merge: a fork and join).

    In a model's decode step K and V come from memory (the layer's weights streamed through
    the caches since the last step), and a head's keys of one page are a 4 KiB run, too
    short for the hardware prefetchers; so at each page every line of the next page's key and
    value rows of the head is prefetched into L2 (`prefetch_page`). Measured on the 2-core
    AMD EPYC (znver4): the kernel alone, cold (`scripts/bench_attention.py --kv-heads 4
    --cold --baseline 713f17e`, llama-110m heads), 1.15-1.4x faster at 64-512 cached tokens and
    batch 1 and 4 (150 tokens: 34.5 -> 26.7 us); hot 0.93x (the prefetch instructions);
    prefetching 2 or 4 pages ahead measured the same as 1. Whole q4 builds
    (`scripts/ab_decode.py`, 2 threads, 20 and 16 rounds): llama-110m decode step 0.89x at
    300 cached tokens, llama-1b 0.97x at 128. Logits are bitwise those without it.

    Inside a model step the call costs more than alone (stop 43, same CPU, llama-1b q4 build,
    scripts/profile_decode.py): ~21 us a layer at 16 cached tokens where the kernel alone,
    cold keys, takes 5.8 us (bench_attention.py --cold), ~38 us at 96 against 19.7; the same
    wherever the build prefetched its weight stream with prefetchnta. Items run one after
    another on the calling thread (no fork) made it slower still (35 us at 16 tokens). The
    kernel alone with a 64 MiB sweep between calls, as the weights stream between two layers,
    1 thread: 24.3 us at 16 tokens against 6.3 with only its keys cold, 46.7 against 24.6 at 96:
    the ~20 us are the call starting with nothing cached, not its work: with its code warmed
    by a call on other buffers just before, 14.7 us at 16 tokens (37.7 at 96), so about half is
    fetching the kernel's own instructions (~10 KiB) and half its query, page table and output;
    the step's other small kernels pay the same way. Building without TVM's argument
    asserts (PassContext "tirx.disable_assert": each kernel's FFI wrapper 4-9 KiB -> 0.1-0.3 KiB,
    model.so 1.27 -> 0.58 MB) stepped llama-1b q4 in 1.004 / 0.985x the time: not the wrappers."""
    G = H_qo // H_kv
    L = _lanes(D)
    TB = min(PAGE, TB_MAX)
    SUBS = PAGE // TB
    NEG = -5e4  # a masked score (log2 domain): below any real one, exp2 of it is 0 in float32
    capped = table is not None and table.has_softcap
    start, _, finish = _online_softmax_macros(G, D, L, dtype, table, H_qo, True)
    R = tirx.Ramp(0, 1, TB)
    RD = tirx.Ramp(0, 1, D)
    symbol = "batch_decode_paged_kv_cpu" + ("_sliding_window" if sliding else "")
    split = threads > H_kv

    # the group's heads unrolled when few (G <= 4: 8% faster than a loop at llama-110m's 3);
    # a loop for more (llama-1b's 8: the unrolled kernel compiled in 3.3 s CPU, the loop 1.2)
    heads = T.unroll if G <= 4 else T.serial

    def n_chunks(batch):  # chunks per (sequence, KV head) item when they are split
        return T.ceildiv(threads, batch * H_kv)

    def bcast(x, n=TB):
        return tirx.Broadcast(x, n)

    def item_scratch():
        """A parallel item's scratch (q, o, m, den, sp, st): stack arrays (see SCRATCH)."""
        return tuple(T.alloc_buffer(shape, "float32", scope=SCRATCH)
                     for shape in ((G, D), (G, D), (G,), (G,), (G, TB), (2,)))

    def sequence_keys(page_table_indptr, length_info, b):
        """(first page-table entry, pages, offset, keys) of sequence b, each held (_held)."""
        begin = _held("int32", page_table_indptr[b])
        npages = _held("int32", page_table_indptr[b + 1] - begin)
        offset = _held("int32", _window_offset(length_info, b, npages, sliding))
        n_keys = _held("int32", T.Select(npages > 0, (npages - 1) * PAGE
                                   + _last_page_len(length_info, b, sliding) - offset, 0))
        return begin, npages, offset, n_keys

    def row(base, t, lo, hi):
        """Flat offset of key t of the block at `base`, clamped into the valid keys [lo, hi)."""
        return base + T.min(T.max(t, lo), hi - 1) * D

    def scores(q, g, flat, kb, lo, hi):
        """The block's TB scores of query head g, one TB-lane vector."""
        vecs = []
        for t in range(TB):
            r = row(kb, t, lo, hi)
            acc = None
            for d0 in range(D // L):
                k = flat.vload([r + d0 * L], f"{dtype}x{L}")
                if dtype != "float32":
                    k = tirx.Cast(f"float32x{L}", k)
                term = q.vload([g, d0 * L], f"float32x{L}") * k
                acc = term if acc is None else acc + term
            vecs.append(acc)
        return _transpose_sum(vecs, L)

    def values(o, sp, g, flat, vb, lo, hi, rescale):
        """o[g] * rescale + sum_t p_t V_t over the block, as one D-lane expression."""
        parts = [o.vload([g, 0], f"float32x{D}") * bcast(rescale, D), None]
        for t in range(TB):
            v = flat.vload([row(vb, t, lo, hi)], f"{dtype}x{D}")
            if dtype != "float32":
                v = tirx.Cast(f"float32x{D}", v)
            term = bcast(sp[g, t], D) * v
            parts[t % 2] = term if parts[t % 2] is None else parts[t % 2] + term
        return parts[0] + parts[1]

    @T.macro
    def block(q, o, m, den, sp, st, flat, kb, vb, lo, hi, sm_scale):
        """Keys [lo, hi) of the TB-key block whose first key row is at kb (values at vb)."""
        # inlined (T.meta_var): a Bind of a bool vector fails codegen
        inside = T.meta_var(tirx.all(R >= bcast(lo), R < bcast(hi)))
        for g in heads(G):
            sp[g, R] = scores(q, g, flat, kb, lo, hi)
            if capped:
                sp[g, R] = T.Select(bcast(_cap2(table, sm_scale) > T.float32(0)),
                                    bcast(_cap2(table, sm_scale)) * T.tanh(
                                        sp[g, R] / bcast(T.max(_cap2(table, sm_scale),
                                                               T.float32(1e-30)))),
                                    sp[g, R])
            sp[g, R] = T.Select(inside, sp[g, R], bcast(T.float32(NEG)))
            st[0] = T.max(m[g], _fold(sp[g, R], TB, T.max))  # the new maximum
            st[1] = _exp2(m[g] - st[0])  # the rescale of what was summed so far
            sp[g, R] = T.Select(inside, _vec_exp2_n(sp[g, R] - bcast(st[0]), TB),
                                bcast(T.float32(0)))
            den[g] = den[g] * st[1] + _fold(sp[g, R], TB, lambda a, b: a + b)
            m[g] = st[0]
            o[g, RD] = values(o, sp, g, flat, vb, lo, hi, st[1])

    line = 512 // tvm.DataType(dtype).bits  # elements per 64-byte cache line

    @T.macro
    def prefetch_page(flat, page, hk):
        """Every line of the KV head's key and value rows in `page` into L2 (the next page,
        fetched while this one is attended)."""
        for kv in T.unroll(2):
            for i in T.serial(PAGE * D // line):
                T.evaluate(prefetch_l2(T.address_of(flat[_kv_rows(page, kv, hk, H_kv, PAGE, D)
                                                         + i * line])))

    @T.macro
    def over_pages(q, o, m, den, sp, st, flat, page_values, begin, offset, t_lo, t_hi, hk,
                   sm_scale):
        """Keys [t_lo, t_hi) of a sequence (logical key t at physical slot t + offset)."""
        if t_hi > t_lo:
            end = _held("int32", T.ceildiv(t_hi + offset, PAGE))  # past the last page
            for p in T.serial((t_lo + offset) // PAGE, end):
                page = _held("int32", page_values[begin + p])
                if p + 1 < end:
                    prefetch_page(flat, page_values[begin + p + 1], hk)
                lo = _held("int32", T.max(t_lo + offset - p * PAGE, 0))
                hi = _held("int32", T.min(t_hi + offset - p * PAGE, PAGE))
                for sub in range(SUBS):
                    kb = _held("int32", _kv_rows(page, 0, hk, H_kv, PAGE, D) + sub * TB * D)
                    vb = _held("int32", _kv_rows(page, 1, hk, H_kv, PAGE, D) + sub * TB * D)
                    if hi > sub * TB and lo < sub * TB + TB:
                        block(q, o, m, den, sp, st, flat, kb, vb, T.max(lo - sub * TB, 0),
                              T.min(hi - sub * TB, TB), sm_scale)

    @T.prim_func(check_well_formed=False)
    def decode_attention(Q_handle: T.handle, pages_handle: T.handle,
                         page_table_indptr_handle: T.handle, page_table_values_handle: T.handle,
                         var_length_info: T.handle, k_rope_pos_offset_handle: T.handle,
                         q_rope_position_handle: T.handle, output_handle: T.handle,
                         lse_handle: T.handle, rotary_mode: T.int32, rope_scale: T.float32,
                         rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True,
                     "global_symbol": symbol})  # replaces TVM's
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        Q = T.match_buffer(Q_handle, (B, H_qo, D), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, H_kv, PAGE, D), dtype)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32",
                                           elem_offset=page_indptr_elem_offset)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32",
                                           elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (B, H_qo, D), dtype)
        lse = T.match_buffer(lse_handle, (B, H_qo), "float32")
        length_info = T.match_buffer(var_length_info, _length_shape(B, sliding), "int32",
                                     elem_offset=length_info_elem_offset)
        flat = T.decl_buffer((max_num_pages * 2 * H_kv * PAGE * D,), dtype, data=pages.data)

        # every thread has a (sequence, KV head) item (always with threads <= H_kv): no split
        if not split or B * H_kv >= threads:
            for bh in T.parallel(B * H_kv):
                q, o, m, den, sp, st = item_scratch()
                mx = T.alloc_buffer((1,), "float32", scope=SCRATCH)
                b = _held("int32", bh // H_kv)
                hk = _held("int32", bh % H_kv)
                start(q, o, m, den, Q, b, hk * G, sm_scale)
                begin, npages, offset, n_keys = sequence_keys(page_table_indptr, length_info, b)
                t_lo = _held("int32", _window_start(_window(table, sm_scale), q_rope_position[b],
                                              k_rope_pos_offset[b]))
                over_pages(q, o, m, den, sp, st, flat, page_table_values, begin, offset, t_lo,
                           n_keys, hk, sm_scale)
                finish(o, m, den, mx, output, lse, b, hk * G,
                       _owns_sink(table, sliding, n_keys, k_rope_pos_offset[b],
                                  q_rope_position[b]), sm_scale)
        else:
            # few items: each sequence's keys in C page-aligned chunks attended in parallel
            state = T.alloc_buffer((B * H_kv * n_chunks(B), G, D + 2), "float32")
            for item in T.parallel(B * H_kv * n_chunks(B)):
                q, o, m, den, sp, st = item_scratch()
                bh = _held("int32", item // n_chunks(B))
                c = _held("int32", item % n_chunks(B))
                b = _held("int32", bh // H_kv)
                hk = _held("int32", bh % H_kv)
                start(q, o, m, den, Q, b, hk * G, sm_scale)
                begin, npages, offset, n_keys = sequence_keys(page_table_indptr, length_info, b)
                chunk = _held("int32", T.ceildiv(n_keys, n_chunks(B) * PAGE) * PAGE)
                t_lo = _held("int32", T.max(_window_start(
                    _window(table, sm_scale), q_rope_position[b], k_rope_pos_offset[b]), c * chunk))
                over_pages(q, o, m, den, sp, st, flat, page_table_values, begin, offset, t_lo,
                           T.min(n_keys, c * chunk + chunk), hk, sm_scale)
                for g in range(G):
                    for d in T.vectorized(D):
                        state[item, g, d] = o[g, d]
                    state[item, g, D] = m[g]
                    state[item, g, D + 1] = den[g]
            for bh in range(B * H_kv):  # the merge, on the calling thread (no second fork)
                o = T.alloc_buffer((G, D), "float32", scope=SCRATCH)
                m = T.alloc_buffer((G,), "float32", scope=SCRATCH)
                den = T.alloc_buffer((G,), "float32", scope=SCRATCH)
                mx = T.alloc_buffer((1,), "float32", scope=SCRATCH)
                b = _held("int32", bh // H_kv)
                hk = _held("int32", bh % H_kv)
                for g in range(G):
                    m[g] = T.float32(NEG)
                    for c in range(n_chunks(B)):
                        m[g] = T.max(m[g], state[bh * n_chunks(B) + c, g, D])
                    den[g] = T.float32(0)
                    for d in T.vectorized(D):
                        o[g, d] = T.float32(0)
                    for c in range(n_chunks(B)):
                        mx[0] = _exp2(state[bh * n_chunks(B) + c, g, D] - m[g])
                        den[g] = den[g] + mx[0] * state[bh * n_chunks(B) + c, g, D + 1]
                        for d in T.vectorized(D):
                            o[g, d] = o[g, d] + mx[0] * state[bh * n_chunks(B) + c, g, d]
                npages = _held("int32", page_table_indptr[b + 1] - page_table_indptr[b])
                n_keys = _held("int32", T.Select(npages > 0, (npages - 1) * PAGE
                                           + _last_page_len(length_info, b, sliding)
                                           - _window_offset(length_info, b, npages, sliding), 0))
                finish(o, m, den, mx, output, lse, b, hk * G,
                       _owns_sink(table, sliding, n_keys, k_rope_pos_offset[b],
                                  q_rope_position[b]), sm_scale)

    return decode_attention


def decode_attention_func(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str,
                          page_size: int = 16, table: LayerTable | None = None,
                          sliding: bool = False, vector: bool = True, threads: int = 16):
    """`page_size`: tokens per KV page; the kernel is compiled for one (the cache's pages
    buffer is matched with that extent, so another page size is a run-time shape error).
    `table`: per-layer variants (a layer code in sm_scale). `sliding`: the kernel for the
    cache's sliding-window page layout (`batch_decode_paged_kv_cpu_sliding_window`).
    `vector=False`: no CPU vector expressions (a GPU build, see `for_gpu`): one item a thread,
    the per-token loop below. `threads`: the cores the CPU kernel is built for (the target's
    num-cores); with fewer (sequence, KV head) items than that, keys are split over threads."""
    if page_size not in PAGE_SIZES:
        raise ValueError(f"page_size {page_size} is not one of {PAGE_SIZES}")
    PAGE = page_size
    H_kv, H_qo, D = num_kv_heads, num_qo_heads, head_dim
    if vector:
        return _vector_decode_func(H_kv, H_qo, D, dtype, PAGE, table, sliding, threads)
    G = H_qo // H_kv
    L = _lanes(D)
    start, block, finish = _online_softmax_macros(G, D, L, dtype, table, H_qo, vector)
    over_pages = _over_pages_macro(block, PAGE, H_kv, D)
    symbol = "batch_decode_paged_kv_cpu" + ("_sliding_window" if sliding else "")

    @T.prim_func(check_well_formed=False)
    def decode_attention(Q_handle: T.handle, pages_handle: T.handle,
                         page_table_indptr_handle: T.handle, page_table_values_handle: T.handle,
                         var_length_info: T.handle, k_rope_pos_offset_handle: T.handle,
                         q_rope_position_handle: T.handle, output_handle: T.handle,
                         lse_handle: T.handle, rotary_mode: T.int32, rope_scale: T.float32,
                         rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True,
                     "global_symbol": symbol})  # replaces TVM's
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        Q = T.match_buffer(Q_handle, (B, H_qo, D), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, H_kv, PAGE, D), dtype)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32",
                                           elem_offset=page_indptr_elem_offset)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32",
                                           elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (B, H_qo, D), dtype)
        lse = T.match_buffer(lse_handle, (B, H_qo), "float32")
        length_info = T.match_buffer(var_length_info, _length_shape(B, sliding), "int32",
                                     elem_offset=length_info_elem_offset)
        flat = T.decl_buffer((max_num_pages * 2 * H_kv * PAGE * D,), dtype, data=pages.data)

        for bh in T.parallel(B * H_kv):  # one item a GPU thread (see for_gpu)
            q = T.alloc_buffer((G, D), "float32", scope="local")
            o = T.alloc_buffer((G, D), "float32", scope="local")
            m = T.alloc_buffer((G,), "float32", scope="local")
            den = T.alloc_buffer((G,), "float32", scope="local")
            s = T.alloc_buffer((PAGE,), "float32", scope="local")
            part = T.alloc_buffer((L,), "float32", scope="local")
            mx = T.alloc_buffer((1,), "float32", scope="local")
            b = bh // H_kv
            hk = bh % H_kv
            start(q, o, m, den, Q, b, hk * G, sm_scale)
            begin = page_table_indptr[b]
            npages = page_table_indptr[b + 1] - begin
            last = _last_page_len(length_info, b, sliding)
            offset = _window_offset(length_info, b, npages, sliding)
            n_keys = T.Select(npages > 0, (npages - 1) * PAGE + last - offset, 0)
            t_lo = _window_start(_window(table, sm_scale), q_rope_position[b],
                                 k_rope_pos_offset[b])
            over_pages(q, o, m, den, s, part, mx, flat, page_table_values, begin, npages,
                       last, offset, t_lo, n_keys, hk, sm_scale)
            finish(o, m, den, mx, output, lse, b, hk * G,
                   _owns_sink(table, sliding, n_keys, k_rope_pos_offset[b],
                              q_rope_position[b]), sm_scale)

    return decode_attention


def prefill_paged_attention_func(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str,
                                 page_size: int = 16, table: LayerTable | None = None,
                                 sliding: bool = False, vector: bool = True, amx: bool = False):
    """Replacement for TVM's `batch_prefill_paged_kv_cpu` (and its `_sliding_window` variant):
    the new tokens of a prefill attending to their sequences' cached pages (a prompt continued,
    a prefix shared by a fork), same signature. CPU: query tiles as in the ragged prefill
    (`_tiled_paged_attention_func`; the per-row form before, with a horizontal sum per key, ran
    512 new tokens over 512 cached at 86-93 GFLOP/s on llama-110m's heads, 218 now).
    `vector=False`: items are (query row, KV head), in parallel, no CPU vector expressions (a
    GPU build, see `for_gpu`). `amx`: as in `prefill_ragged_attention_func`."""
    if page_size not in PAGE_SIZES:
        raise ValueError(f"page_size {page_size} is not one of {PAGE_SIZES}")
    PAGE = page_size
    H_kv, H_qo, D = num_kv_heads, num_qo_heads, head_dim
    symbol = "batch_prefill_paged_kv_cpu" + ("_sliding_window" if sliding else "")
    if vector:  # CPU: the query-tile GEMM form
        return _tiled_paged_attention_func(H_kv, H_qo, D, dtype, PAGE, table, sliding, symbol,
                                           amx)
    G = H_qo // H_kv
    L = _lanes(D)
    start, block, finish = _online_softmax_macros(G, D, L, dtype, table, H_qo, vector)
    scope = "local"  # GPU: registers
    over_pages = _over_pages_macro(block, PAGE, H_kv, D, scope)

    @T.prim_func(check_well_formed=False)
    def prefill_paged_attention(var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle,
                                var_page_indptr: T.handle, var_page_values: T.handle,
                                var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
                                var_q_rope_position: T.handle, var_output: T.handle,
                                var_lse: T.handle, causal: T.int32, rotary_mode: T.int32,
                                rope_scale: T.float32, rope_theta: T.float32,
                                sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True,
                     "global_symbol": symbol})  # replaces TVM's
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        q = T.match_buffer(var_q, (total_len, H_qo, D), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32",
                                  elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, H_kv, PAGE, D), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32",
                                     elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32",
                                     elem_offset=page_values_elem_offset)
        length_info = T.match_buffer(var_length_info, _length_shape(batch_size, sliding), "int32",
                                     elem_offset=length_info_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(var_output, (total_len, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (total_len, H_qo), "float32")
        flat = T.decl_buffer((max_num_pages * 2 * H_kv * PAGE * D,), dtype, data=pages.data)

        for item in T.parallel(total_len * H_kv):
            qbuf = T.alloc_buffer((G, D), "float32", scope=scope)
            o = T.alloc_buffer((G, D), "float32", scope=scope)
            m = T.alloc_buffer((G,), "float32", scope=scope)
            den = T.alloc_buffer((G,), "float32", scope=scope)
            s = T.alloc_buffer((PAGE,), "float32", scope=scope)
            part = T.alloc_buffer((L,), "float32", scope=scope)
            mx = T.alloc_buffer((1,), "float32", scope=scope)
            seq = T.alloc_buffer((1,), "int32", scope=scope)
            row = _held("int32", item // H_kv, scope)
            hk = _held("int32", item % H_kv, scope)
            sequence_of_row(seq, q_indptr, batch_size, row)
            b = _held("int32", seq[0], scope)
            n_q = _held("int32", q_indptr[b + 1] - q_indptr[b], scope)
            begin = _held("int32", page_indptr[b], scope)
            npages = _held("int32", page_indptr[b + 1] - begin, scope)
            last = _held("int32", _last_page_len(length_info, b, sliding), scope)
            offset = _held("int32", _window_offset(length_info, b, npages, sliding), scope)
            n_keys = _held("int32", T.Select(npages > 0, (npages - 1) * PAGE + last - offset, 0),
                           scope)
            t_hi = _held("int32", T.Select(
                causal > 0, T.min(n_keys, n_keys - n_q + row - q_indptr[b] + 1), n_keys), scope)
            t_lo = _held("int32", _window_start(
                _window(table, sm_scale), q_rope_position[row], k_rope_pos_offset[b]), scope)
            start(qbuf, o, m, den, q, row, hk * G, sm_scale)
            over_pages(qbuf, o, m, den, s, part, mx, flat, page_values, begin, npages, last,
                       offset, t_lo, t_hi, hk, sm_scale)
            finish(o, m, den, mx, output, lse, row, hk * G,
                   _owns_sink(table, sliding, t_hi, k_rope_pos_offset[b], q_rope_position[row]),
                   sm_scale)

    return prefill_paged_attention


def prefill_ragged_attention_func(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str,
                                  table: LayerTable | None = None, vector: bool = True,
                                  amx: bool = False):
    """Replacement for TVM's `tir_attention_prefill_ragged_cpu` (attention among the new tokens
    of a prefill, several sequences packed in one ragged batch), same signature.

    TVM's kernel is serial and scalar and scores every key, masked or not: 63% of a 128-token
    llama-110m W4A8 prefill, 87% at 512 tokens. Here each (query row, KV head) item scores only
    its causal prefix (within the layer's window), 16 keys at a time with one online-softmax
    rescale per block, vectorized over the head dim; items run in parallel, rows paired from
    both ends of the ragged batch (row j with row n-1-j) so that threads get equal causal work.
    The query's own token is always among these keys, so the sink (if any) is added here.
    `vector=False`: no CPU vector expressions (a GPU build, see `for_gpu`). `amx`: bfloat16
    scores on AMX tiles where every key of a block may be read (`_query_tile_macros`).
    """
    if vector:  # CPU: the query-tile GEMM form
        return _tiled_ragged_attention_func(num_kv_heads, num_qo_heads, head_dim, dtype, table,
                                            amx)
    H_kv, H_qo, D = num_kv_heads, num_qo_heads, head_dim
    G = H_qo // H_kv
    L = _lanes(D)
    BLK = 16
    start, block, finish = _online_softmax_macros(G, D, L, dtype, table, H_qo, vector)
    sinks = table is not None and table.sinks is not None

    @T.prim_func(check_well_formed=False)
    def prefill_ragged_attention(var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle,
                                 var_v: T.handle, var_kv_indptr: T.handle,
                                 var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle,
                                 var_output: T.handle, var_lse: T.handle, causal: T.int32,
                                 rotary_mode: T.int32, rope_scale: T.float32,
                                 rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True,
                     "global_symbol": "batch_prefill_ragged_kv"})  # replaces TVM's
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q = T.match_buffer(var_q, (qo_len, H_qo, D), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32",
                                  elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (kv_len, H_kv, D), dtype)
        v = T.match_buffer(var_v, (kv_len, H_kv, D), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32",
                                   elem_offset=kv_indptr_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        output = T.match_buffer(var_output, (qo_len, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (qo_len, H_qo), "float32")
        k_flat = T.decl_buffer((kv_len * H_kv * D,), dtype, data=k.data)
        v_flat = T.decl_buffer((kv_len * H_kv * D,), dtype, data=v.data)

        for item in T.parallel((qo_len + 1) // 2 * 2 * H_kv):
            qbuf = T.alloc_buffer((G, D), "float32", scope="local")
            o = T.alloc_buffer((G, D), "float32", scope="local")
            m = T.alloc_buffer((G,), "float32", scope="local")
            den = T.alloc_buffer((G,), "float32", scope="local")
            s = T.alloc_buffer((BLK,), "float32", scope="local")
            part = T.alloc_buffer((L,), "float32", scope="local")
            mx = T.alloc_buffer((1,), "float32", scope="local")
            seq = T.alloc_buffer((1,), "int32", scope="local")
            pair = item // (2 * H_kv)
            hk = item % H_kv
            # row j and row n-1-j of the pair (the odd middle row is done once)
            row = T.Select(item // H_kv % 2 == 0, pair, qo_len - 1 - pair)
            if item // H_kv % 2 == 0 or qo_len - 1 - pair != pair:
                sequence_of_row(seq, q_indptr, batch_size, row)
                b = seq[0]
                q_idx = row - q_indptr[b]
                n_kv = kv_indptr[b + 1] - kv_indptr[b]
                n_q = q_indptr[b + 1] - q_indptr[b]
                limit = T.Select(causal > 0, T.min(n_kv, n_kv - n_q + q_idx + 1), n_kv)
                # key j sits at position k_rope_pos_offset[b] + j, the query at q_rope_position
                first = T.min(_window_start(_window(table, sm_scale), q_rope_position[row],
                                            k_rope_pos_offset[b]), limit)
                start(qbuf, o, m, den, q, row, hk * G, sm_scale)
                for blk in range((limit - first + BLK - 1) // BLK):
                    base = ((kv_indptr[b] + first + blk * BLK) * H_kv + hk) * D
                    block(qbuf, o, m, den, s, part, mx, k_flat, v_flat, base, base, H_kv * D,
                          T.min(BLK, limit - first - blk * BLK), sm_scale)
                finish(o, m, den, mx, output, lse, row, hk * G, sinks, sm_scale)

    return prefill_ragged_attention


QT = 16  # (row, head) pairs per query tile: one float32x16 vector, a pair a lane
KB = 16  # keys per block of a query tile at most (the block binds P[0..15] by name)


def _vec_exp2(x):
    """2^x of a float32x16 vector expression (the fast exp, schedules/cpu/fast_math.py)."""
    return fast_exp_expr(x * tirx.Broadcast(tirx.const(LN2, "float32"), QT), f"float32x{QT}")


def _query_tile_macros(D: int, kb: int, dtype: str, table: LayerTable | None, H_qo: int,
                       amx: bool = False):
    """The steps the query-tile kernels (ragged and paged prefill) share, over scratch buffers
    qt / ot (D, QT): Q^T pre-scaled and O^T unnormalized; s (KB, QT): scores, then P; st (4,
    QT): running max, denominator, rescale, new max; rng (2, QT): each lane's logical keys
    [lo, hi):

    * block: kb keys whose rows lie `stride` elements apart from k_base / v_base (logical key
      index t0 + t): scores d outer on kb register accumulators (one Q^T[d] load serves every
      key; each key element is one FMA with an embedded broadcast), soft-capped where the layer
      says so, one lane-wise online-softmax rescale (balanced max and sum trees), the weighted
      value rows. `masked`: some lane's range does not hold all kb keys; `clamped`: only its
      keys [valid[0], valid[1]) may be read (the rest are masked and read a readable key's row
      instead: unwritten slots may hold anything, and 0 x NaN is NaN; clamping costs LLVM the
      constant-stride addresses, so only such a block does it);
    * finish_lane: the lane's sink (when `add_sink`), normalization, its output row and lse;
    * load_lane / empty_lane / zero_tile: a tile's setup (end_tile after its blocks);
      tile_block: `block` in the form (no mask, masked, clamped) a block's keys need.

    Half-precision K and V (bfloat16, float16) are widened to float32 once per block into the
    scratch `kv32`, as vectors: read in place, every key element of a block was a scalar load,
    shift and broadcast (Intel Xeon model 167, 2 threads, llama-110m heads, bfloat16: ragged
    512 tokens 116 -> 190 GFLOP/s, 128 tokens 91 -> 137; paged, 512 over 512 or 1536
    cached, 129-134 -> 216-218, as fast as float32).

    `amx` (bfloat16, a CPU with AMX-BF16 that lets the process use it, D a multiple of 32, see
    targets/llvm.py): a block whose keys may all be read takes its scores from AMX tiles
    (schedules/cpu/amx_bf16.py `scores_llvm_ir`: K's rows as they lie in the page or the
    ragged batch against the tile's Q pairs, one tdpbf16ps per 32 head-dim elements), which
    frees the vector ports for the rest; qt then holds each lane's Q as bfloat16 pairs in
    32-bit lanes (rows 0..D/2-1, unscaled: a scaled Q rounded back to bfloat16 would lose
    bits), the scale multiplies the block's scores after, and a clamped block (the end of the
    keys) widens those pairs back to float32 for its FMAs. The bfloat16 products are exact in
    float32: the scores differ from the FMA form's only in the order of additions.
    """
    capped = table is not None and table.has_softcap
    sinks = table is not None and table.sinks is not None
    convert = dtype != "float32"  # bfloat16 / float16 K and V: widened per block (kv32)
    tiles = amx and dtype == "bfloat16" and D % amx_bf16.KSTEP == 0 and kb in (8, 16)
    qt_dtype = "int32" if tiles else "float32"  # Q^T: bfloat16 pairs' bits, or float32
    R = tirx.Ramp(0, 1, QT)

    def bcast(x):
        return tirx.Broadcast(x, QT)

    def inside(rng, t):
        """Lane mask of logical key t: lo <= t < hi."""
        return tirx.all(bcast(t) >= rng[0, R], bcast(t) < rng[1, R])

    def key(base, t, stride, valid, clamped):
        """Flat index of the block's key t's row; clamped into the block's readable keys
        [valid[0], valid[1]) where some are not."""
        return base + (T.max(T.min(t, valid[1] - 1), valid[0]) if clamped else t) * stride

    def tree(values, op):
        """op over `values` as a balanced tree (log2 depth: no kb-long dependency chain)."""
        while len(values) > 1:
            values = [op(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                      for i in range(0, len(values), 2)]
        return values[0]

    def q_pair(qt, d2, odd: bool):
        """Q^T[2 d2 + odd] as float32 lanes, widened from the bfloat16 pair in row d2 (tiles)."""
        pair = qt[d2, R]
        bits = (tirx.bitwise_and(pair, tirx.Broadcast(tirx.const(-65536, "int32"), QT)) if odd
                else tirx.shift_left(pair, tirx.Broadcast(tirx.const(16, "int32"), QT)))
        return T.reinterpret(bits, dtype=f"float32x{QT}")

    def weighted_values(ot, p, rescale, v_flat, rows, kv32, d):
        """O^T[d] * rescale + sum_t P[t] * V[t, d], as one expression (two partial sums)."""
        parts = [ot[d, R] * rescale, None]
        for t in range(kb):
            term = p[t] * bcast(kv32[1, t * D + d] if convert else v_flat[rows[t] + d])
            parts[t % 2] = term if parts[t % 2] is None else parts[t % 2] + term
        return parts[0] + parts[1]

    @T.macro
    def block(qt, ot, s, st, rng, k_flat, v_flat, t0, k_base, v_base, stride, valid,
              sm_scale, masked, clamped, kv32):
        if convert:  # the block's K (for FMAs) and V rows widened to float32 once, as vectors
            for t in T.unroll(kb):
                if not tiles or clamped:
                    for d in T.vectorized(D):
                        kv32[0, t * D + d] = T.Cast("float32", k_flat[
                            key(k_base, t, stride, valid, clamped) + d])
                for d in T.vectorized(D):
                    kv32[1, t * D + d] = T.Cast("float32", v_flat[
                        key(v_base, t, stride, valid, clamped) + d])
        if tiles and not clamped:  # every key readable: the scores from AMX tiles
            with T.attr(0, "pragma_import_llvm", amx_bf16.scores_llvm_ir(kb, D)):
                T.evaluate(T.call_extern(
                    "void", amx_bf16.scores_func(kb, D), T.address_of(k_flat[k_base]),
                    T.Cast("int64", stride * 2), T.address_of(s[0, 0])))
        else:
            for t in T.unroll(kb):
                s[t, R] = bcast(T.float32(0))
            if tiles:  # a clamped block: FMAs on the pairs widened back
                for d2 in T.unroll(D // 2):
                    for t in T.unroll(kb):
                        s[t, R] = (s[t, R] + q_pair(qt, d2, False) * bcast(kv32[0, t * D + d2 * 2])
                                   + q_pair(qt, d2, True) * bcast(kv32[0, t * D + d2 * 2 + 1]))
            else:
                for d in T.unroll(D):  # d outer: each Q^T[d] load serves every key of the block
                    for t in T.unroll(kb):
                        s[t, R] = s[t, R] + qt[d, R] * bcast(
                            kv32[0, t * D + d] if convert
                            else k_flat[key(k_base, t, stride, valid, clamped) + d])
        if tiles:  # Q^T is unscaled there
            for t in T.unroll(kb):
                s[t, R] = s[t, R] * bcast(_scale2(table, sm_scale))
        if capped:
            for t in T.unroll(kb):
                s[t, R] = T.Select(bcast(_cap2(table, sm_scale) > T.float32(0)),
                                   bcast(_cap2(table, sm_scale)) * T.tanh(
                                       s[t, R] / bcast(T.max(_cap2(table, sm_scale),
                                                             T.float32(1e-30)))),
                                   s[t, R])
        if masked:  # the new running maximum
            st[3, R] = tree([st[0, R]] + [T.Select(inside(rng, t0 + t), s[t, R],
                                                   bcast(T.float32(-5e4))) for t in range(kb)],
                            T.max)
        else:
            st[3, R] = tree([st[0, R]] + [s[t, R] for t in range(kb)], T.max)
        st[2, R] = _vec_exp2(st[0, R] - st[3, R])  # rescale of what was summed so far
        st[0, R] = st[3, R]
        for t in T.unroll(kb):
            if masked:
                s[t, R] = T.Select(inside(rng, t0 + t), _vec_exp2(s[t, R] - st[3, R]),
                                   bcast(T.float32(0)))
            else:
                s[t, R] = _vec_exp2(s[t, R] - st[3, R])
        st[1, R] = st[1, R] * st[2, R] + tree([s[t, R] for t in range(kb)], lambda a, b: a + b)
        # P and the rescale bound to values (registers over the loop over d, not kb reloads
        # per row: the stores to O^T might alias `s` as far as LLVM knows); with kb < 16 the
        # names past kb - 1 repeat P[0] and are never used
        p0: T.let = s[0, R]
        p1: T.let = s[1 % kb, R]
        p2: T.let = s[2 % kb, R]
        p3: T.let = s[3 % kb, R]
        p4: T.let = s[4 % kb, R]
        p5: T.let = s[5 % kb, R]
        p6: T.let = s[6 % kb, R]
        p7: T.let = s[7 % kb, R]
        p8: T.let = s[8 % kb, R]
        p9: T.let = s[9 % kb, R]
        p10: T.let = s[10 % kb, R]
        p11: T.let = s[11 % kb, R]
        p12: T.let = s[12 % kb, R]
        p13: T.let = s[13 % kb, R]
        p14: T.let = s[14 % kb, R]
        p15: T.let = s[15 % kb, R]
        rescale: T.let = st[2, R]
        for d in range(D):
            ot[d, R] = weighted_values(
                ot, (p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15),
                rescale, v_flat, [key(v_base, t, stride, valid, clamped) for t in range(kb)],
                kv32, d)

    @T.macro
    def finish_lane(st, ot, output, lse, lane, row, head, add_sink, sm_scale):
        st[2, lane] = T.float32(1)
        if sinks:
            if add_sink:  # the query's own token is among these keys: its sink is added here
                st[3, lane] = T.max(st[0, lane], _sink2(table, sm_scale, head, H_qo))
                st[1, lane] = st[1, lane] * T.exp2(st[0, lane] - st[3, lane]) + T.exp2(
                    _sink2(table, sm_scale, head, H_qo) - st[3, lane])
                st[2, lane] = T.exp2(st[0, lane] - st[3, lane])
                st[0, lane] = st[3, lane]
        inv: T.let = T.Select(st[1, lane] > T.float32(0), st[2, lane] / st[1, lane],
                              T.float32(0))
        for d in range(D):
            output[row, head, d] = T.Cast(dtype, ot[d, lane] * inv)
        lse[row, head] = T.Select(st[1, lane] > T.float32(0),
                                  st[0, lane] + T.log2(st[1, lane]), st[0, lane])

    @T.macro
    def load_lane(qt, rng, lim, q, lane, row, head, lo, hi, sm_scale):
        """Lane `lane` holds (row, head), whose keys are [lo, hi): its Q^T column, its range,
        and the tile's limits lim (min lo, max hi, max lo, min hi)."""
        rng[0, lane] = lo
        rng[1, lane] = hi
        lim[0] = T.min(lim[0], lo)
        lim[1] = T.max(lim[1], hi)
        lim[2] = T.max(lim[2], lo)
        lim[3] = T.min(lim[3], hi)
        if tiles:  # the lane's Q as bfloat16 pairs, unscaled
            for d2 in range(D // 2):
                qt[d2, lane] = T.reinterpret(q.vload([row, head, d2 * 2], "bfloat16x2"),
                                             dtype="int32")
        else:
            for d in range(D):
                qt[d, lane] = T.Cast("float32", q[row, head, d]) * _scale2(table, sm_scale)

    @T.macro
    def empty_lane(qt, rng, lane):
        """A lane past the last row: no keys, its output never written."""
        rng[0, lane] = 0
        rng[1, lane] = 0
        for d in range(D // 2 if tiles else D):
            qt[d, lane] = T.Cast(qt_dtype, 0)

    @T.macro
    def zero_tile(ot, st, qt):
        """The tile's accumulators zeroed (and with `tiles`, its Q loaded into AMX tiles, which
        `end_tile` releases)."""
        for d in range(D):
            ot[d, R] = bcast(T.float32(0))
        st[0, R] = bcast(T.float32(-5e4))
        st[1, R] = bcast(T.float32(0))
        if tiles:
            with T.attr(0, "pragma_import_llvm", amx_bf16.scores_llvm_ir(kb, D)):
                T.evaluate(T.call_extern("void", amx_bf16.scores_func(kb, D, "begin"),
                                         T.address_of(qt[0, 0])))

    @T.macro
    def end_tile():
        if tiles:
            with T.attr(0, "pragma_import_llvm", amx_bf16.scores_llvm_ir(kb, D)):
                T.evaluate(T.call_extern("void", amx_bf16.scores_func(kb, D, "end")))

    @T.macro
    def tile_block(qt, ot, s, st, rng, k_flat, v_flat, t0, k_base, v_base, stride, valid,
                   lo_max, hi_min, readable, sm_scale, kv32):
        """`block` in the form its keys need: inside every lane's range (no mask), some lane's
        range ends inside (masked), or some key may not be read (`readable` false: clamped)."""
        if t0 >= lo_max and t0 + kb <= hi_min:
            block(qt, ot, s, st, rng, k_flat, v_flat, t0, k_base, v_base, stride, valid,
                  sm_scale, False, False, kv32)
        elif readable:
            block(qt, ot, s, st, rng, k_flat, v_flat, t0, k_base, v_base, stride, valid,
                  sm_scale, True, False, kv32)
        else:
            block(qt, ot, s, st, rng, k_flat, v_flat, t0, k_base, v_base, stride, valid,
                  sm_scale, True, True, kv32)

    # the widened rows' scratch (its elements: 8 KiB at D = 64); float32 blocks read K, V in place
    return (block, finish_lane, load_lane, empty_lane, zero_tile, end_tile, tile_block,
            (2, KB * D) if convert else (1, 1), qt_dtype)


def _tiled_ragged_attention_func(H_kv: int, H_qo: int, D: int, dtype: str,
                                 table: LayerTable | None, amx: bool = False):
    """The ragged prefill as query-tile GEMMs (CPU): see `prefill_ragged_attention_func`.

    The (query row, query head) pairs of one KV head, flattened row-major (the G heads of a
    GQA group side by side), are cut into tiles of QT = 16; each tile is one float32x16 vector
    per head-dim element (lane l: the tile's l-th pair), so that over a block of KB keys

        S[t] = sum_d Q^T[d] * broadcast(K[t, d])          (KB accumulators, a GEMM with the
                                                           query rows in the vector lanes)
        m, den, rescale: lane-wise online softmax         (no horizontal reduction at all)
        O^T[d] = O^T[d] * rescale + sum_t P[t] * broadcast(V[t, d])

    and every K/V element read is used for 16 query rows (`_query_tile_macros`). Each lane
    carries its own key range [lo, hi) (its sequence in the ragged batch, the causal limit, the
    layer's window); the tile walks the union of its lanes' ranges and masks only the blocks
    that are not inside every lane's range (the diagonal, the window's edge, a sequence
    boundary inside the tile). Tiles run in parallel, paired from both ends of the batch (tile
    j with tile n-1-j in consecutive items) so that a thread's share of the causal work is
    even. Intel Xeon model 167, 2 threads, llama-110m heads (12 / 4 KV, D 64), scripts/
    bench_attention.py --only prefill --kv-heads 4 --baseline: 128 tokens 130 -> 158 GFLOP/s,
    512 tokens 154-160 -> 200-207 against scores as one expression per key (Q^T reloaded for
    every key), 16-long max / sum chains and clamped rows in every masked block."""
    G = H_qo // H_kv
    (_, finish_lane, load_lane, empty_lane, zero_tile, end_tile, tile_block,
     kv32_shape, qt_dtype) = _query_tile_macros(D, KB, dtype, table, H_qo, amx)

    @T.prim_func(check_well_formed=False)
    def prefill_ragged_attention(var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle,
                                 var_v: T.handle, var_kv_indptr: T.handle,
                                 var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle,
                                 var_output: T.handle, var_lse: T.handle, causal: T.int32,
                                 rotary_mode: T.int32, rope_scale: T.float32,
                                 rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True,
                     "global_symbol": "batch_prefill_ragged_kv"})  # replaces TVM's
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q = T.match_buffer(var_q, (qo_len, H_qo, D), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32",
                                  elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (kv_len, H_kv, D), dtype)
        v = T.match_buffer(var_v, (kv_len, H_kv, D), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32",
                                   elem_offset=kv_indptr_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        output = T.match_buffer(var_output, (qo_len, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (qo_len, H_qo), "float32")
        k_flat = T.decl_buffer((kv_len * H_kv * D,), dtype, data=k.data)
        v_flat = T.decl_buffer((kv_len * H_kv * D,), dtype, data=v.data)

        for item in T.parallel(T.ceildiv(qo_len * G, QT) * H_kv):
            qt = T.alloc_buffer((D, QT), qt_dtype, scope=SCRATCH)  # Q^T (see the macros)
            ot = T.alloc_buffer((D, QT), "float32", scope=SCRATCH)  # O^T, unnormalized
            s = T.alloc_buffer((KB, QT), "float32", scope=SCRATCH)  # scores, then P
            kv32 = T.alloc_buffer(kv32_shape, "float32", scope=SCRATCH)  # K, V rows widened
            st = T.alloc_buffer((4, QT), "float32", scope=SCRATCH)  # max, den, rescale, new max
            rng = T.alloc_buffer((2, QT), "int32", scope=SCRATCH)  # each lane's keys [lo, hi)
            lim = T.alloc_buffer((4,), "int32", scope=SCRATCH)  # min lo, max hi, max lo, min hi
            seq = T.alloc_buffer((1,), "int32", scope=SCRATCH)
            n_tiles = _held("int32", T.ceildiv(qo_len * G, QT))
            pair = _held("int32", item % n_tiles)  # KV head by KV head (see the paged kernel)
            hk = _held("int32", item // n_tiles)
            tile = _held("int32", T.Select(pair % 2 == 0, pair // 2, n_tiles - 1 - pair // 2))
            lim[0] = kv_len
            lim[1] = 0
            lim[2] = 0
            lim[3] = kv_len
            for lane in range(QT):
                if tile * QT + lane < qo_len * G:
                    row = _held("int32", (tile * QT + lane) // G)
                    head = _held("int32", hk * G + (tile * QT + lane) % G)
                    sequence_of_row(seq, q_indptr, batch_size, row)
                    n_kv = _held("int32", kv_indptr[seq[0] + 1] - kv_indptr[seq[0]])
                    n_q = _held("int32", q_indptr[seq[0] + 1] - q_indptr[seq[0]])
                    limit = _held("int32", T.Select(
                        causal > 0, T.min(n_kv, n_kv - n_q + row - q_indptr[seq[0]] + 1), n_kv))
                    first = _held("int32", T.min(_window_start(
                        _window(table, sm_scale), q_rope_position[row], k_rope_pos_offset[seq[0]]),
                        limit))
                    load_lane(qt, rng, lim, q, lane, row, head, kv_indptr[seq[0]] + first,
                              kv_indptr[seq[0]] + limit, sm_scale)
                else:  # past the batch's last row
                    empty_lane(qt, rng, lane)
            zero_tile(ot, st, qt)
            kmin = _held("int32", lim[0])  # bound once: scalars, not reloads of `lim` in the block
            kmax = _held("int32", lim[1])
            lo_max = _held("int32", lim[2])
            hi_min = _held("int32", lim[3])
            for blk in range(T.ceildiv(kmax - kmin, KB)):
                t0 = _held("int32", kmin + blk * KB)
                base = _held("int32", (t0 * H_kv + hk) * D)
                # a block running past the batch's last key is clamped
                tile_block(qt, ot, s, st, rng, k_flat, v_flat, t0, base, base, H_kv * D,
                           (0, kv_len - t0), lo_max, hi_min, t0 + KB <= kv_len, sm_scale, kv32)
            end_tile()
            for lane in range(QT):
                if tile * QT + lane < qo_len * G:
                    finish_lane(st, ot, output, lse, lane, (tile * QT + lane) // G,
                                hk * G + (tile * QT + lane) % G, True, sm_scale)

    return prefill_ragged_attention


def _tiled_paged_attention_func(H_kv: int, H_qo: int, D: int, dtype: str, PAGE: int,
                                table: LayerTable | None, sliding: bool, symbol: str,
                                amx: bool = False):
    """The paged prefill as query-tile GEMMs (CPU): see `prefill_paged_attention_func`.

    The ragged kernel's tiles (`_tiled_ragged_attention_func`), cut per sequence (a tile's
    lanes share one page list): tile items are numbered over the batch's sequences in order,
    each sequence taking ceil(rows x G / QT) of them. A tile walks the pages that hold its
    lanes' keys in blocks of min(KB, PAGE) keys, which never straddle a page, so a block's key
    rows are D elements apart; the block past the sequence's last key reads its rows clamped
    (the rest of the last page is not written). Lanes hold logical key ranges (the causal
    limit, the layer's window); in the sliding-window layout logical key t sits at physical
    slot t + offset of the page list."""
    G = H_qo // H_kv
    kb = min(KB, PAGE)
    (_, finish_lane, load_lane, empty_lane, zero_tile, end_tile, tile_block,
     kv32_shape, qt_dtype) = _query_tile_macros(D, kb, dtype, table, H_qo, amx)

    @T.prim_func(check_well_formed=False)
    def prefill_paged_attention(var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle,
                                var_page_indptr: T.handle, var_page_values: T.handle,
                                var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
                                var_q_rope_position: T.handle, var_output: T.handle,
                                var_lse: T.handle, causal: T.int32, rotary_mode: T.int32,
                                rope_scale: T.float32, rope_theta: T.float32,
                                sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True,
                     "global_symbol": symbol})  # replaces TVM's
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        q = T.match_buffer(var_q, (total_len, H_qo, D), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32",
                                  elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, H_kv, PAGE, D), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32",
                                     elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32",
                                     elem_offset=page_values_elem_offset)
        length_info = T.match_buffer(var_length_info, _length_shape(batch_size, sliding), "int32",
                                     elem_offset=length_info_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(var_output, (total_len, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (total_len, H_qo), "float32")
        flat = T.decl_buffer((max_num_pages * 2 * H_kv * PAGE * D,), dtype, data=pages.data)

        # every sequence's tiles (at most one partial tile a sequence), KV head by KV head: a
        # thread's tiles then share their keys (a KV head's 1536 cached keys are 786 KiB of K
        # and V in float32; all 4 of llama-110m's overflow a 2 MiB L2)
        for item in T.parallel((T.ceildiv(total_len * G, QT) + batch_size) * H_kv):
            qt = T.alloc_buffer((D, QT), qt_dtype, scope=SCRATCH)  # Q^T (see the macros)
            ot = T.alloc_buffer((D, QT), "float32", scope=SCRATCH)  # O^T, unnormalized
            s = T.alloc_buffer((KB, QT), "float32", scope=SCRATCH)  # scores, then P
            kv32 = T.alloc_buffer(kv32_shape, "float32", scope=SCRATCH)  # K, V rows widened
            st = T.alloc_buffer((4, QT), "float32", scope=SCRATCH)  # max, den, rescale, new max
            rng = T.alloc_buffer((2, QT), "int32", scope=SCRATCH)  # each lane's keys [lo, hi)
            lim = T.alloc_buffer((4,), "int32", scope=SCRATCH)  # min lo, max hi, max lo, min hi
            where = T.alloc_buffer((3,), "int32", scope=SCRATCH)  # sequence, its tile, tiles before
            slots = _held("int32", T.ceildiv(total_len * G, QT) + batch_size)  # tiles a KV head
            tile = _held("int32", item % slots)
            hk = _held("int32", item // slots)
            where[0] = -1
            where[1] = 0
            where[2] = 0
            for bb in range(batch_size):
                n_tiles = _held("int32", T.ceildiv((q_indptr[bb + 1] - q_indptr[bb]) * G, QT))
                if where[0] < 0 and tile < where[2] + n_tiles:
                    where[0] = bb
                    where[1] = tile - where[2]
                where[2] = where[2] + n_tiles
            if where[0] >= 0:
                b = _held("int32", where[0])
                tin = _held("int32", where[1])
                n_q = _held("int32", q_indptr[b + 1] - q_indptr[b])
                begin = _held("int32", page_indptr[b])
                npages = _held("int32", page_indptr[b + 1] - begin)
                last = _held("int32", _last_page_len(length_info, b, sliding))
                offset = _held("int32", _window_offset(length_info, b, npages, sliding))
                n_keys = _held("int32", T.Select(npages > 0, (npages - 1) * PAGE + last - offset,
                                                 0))
                lim[0] = n_keys
                lim[1] = 0
                lim[2] = 0
                lim[3] = n_keys
                for lane in range(QT):
                    if tin * QT + lane < n_q * G:
                        row = _held("int32", q_indptr[b] + (tin * QT + lane) // G)
                        head = _held("int32", hk * G + (tin * QT + lane) % G)
                        hi = _held("int32", T.Select(
                            causal > 0, T.min(n_keys, n_keys - n_q + row - q_indptr[b] + 1),
                            n_keys))
                        lo = _held("int32", T.min(_window_start(
                            _window(table, sm_scale), q_rope_position[row], k_rope_pos_offset[b]),
                            hi))
                        load_lane(qt, rng, lim, q, lane, row, head, lo, hi, sm_scale)
                    else:  # past the sequence's last row
                        empty_lane(qt, rng, lane)
                zero_tile(ot, st, qt)
                kmin = _held("int32", lim[0])
                kmax = _held("int32", lim[1])
                lo_max = _held("int32", lim[2])
                hi_min = _held("int32", lim[3])
                if kmax > kmin:
                    first = _held("int32", (kmin + offset) // kb)  # blocks of physical slots
                    for blk in range(T.ceildiv(kmax + offset, kb) - first):
                        slot = _held("int32", (first + blk) * kb)
                        page = _held("int32", page_values[begin + slot // PAGE])
                        t0 = _held("int32", slot - offset)  # logical index of its first key
                        k_base = _held("int32", _kv_rows(page, 0, hk, H_kv, PAGE, D)
                                       + slot % PAGE * D)
                        v_base = _held("int32", _kv_rows(page, 1, hk, H_kv, PAGE, D)
                                       + slot % PAGE * D)
                        # readable: logical keys >= 0 (not slid out) and below n_keys (written)
                        tile_block(qt, ot, s, st, rng, flat, flat, t0, k_base, v_base, D,
                                   (T.max(-t0, 0), n_keys - t0), lo_max, hi_min,
                                   t0 >= 0 and t0 + kb <= n_keys, sm_scale, kv32)
                end_tile()
                for lane in range(QT):
                    if tin * QT + lane < n_q * G:
                        row = _held("int32", q_indptr[b] + (tin * QT + lane) // G)
                        finish_lane(st, ot, output, lse, lane, row,
                                    hk * G + (tin * QT + lane) % G,
                                    _owns_sink(table, sliding, rng[1, lane],
                                               k_rope_pos_offset[b], q_rope_position[row]),
                                    sm_scale)

    return prefill_paged_attention


def for_gpu(func, threads: int = 64):
    """The same kernel for a GPU: its parallel loop over items becomes blocks of `threads`
    threads, one item per thread, and vector loops become serial ones. Correct, not fast: it
    serves models whose attention variants TVM's GPU kernels cannot compute (per-layer tables:
    windows by position, soft-caps, sinks), under the names of the kernels it replaces.
    The kernel must be built with `vector=False` (GPU codegen has no 16-lane float type)."""
    import tvm
    import tvm_ffi

    shuffles = []
    tvm_ffi.structural_map(func, [(tirx.Shuffle, lambda n: shuffles.append(n) or n)])
    if shuffles:
        raise ValueError("for_gpu: build the attention kernel with vector=False")

    def serial(loop):
        if loop.kind == tirx.ForKind.VECTORIZED:
            return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, loop.body,
                            None, loop.annotations)
        return loop

    def bind(loop):
        if loop.kind != tirx.ForKind.PARALLEL:
            return loop
        bx, tx = tirx.Var("bx", "int32"), tirx.Var("tx", "int32")
        blocks = (loop.extent + threads - 1) // threads
        body = tirx.SeqStmt([tirx.Bind(loop.loop_var, bx * threads + tx),
                             tirx.IfThenElse(loop.loop_var < loop.extent, loop.body, None)])
        inner = tirx.For(tx, 0, threads, tirx.ForKind.THREAD_BINDING, body, tirx.IterVar(
            tvm.ir.Range(0, threads), tx, tirx.IterVar.ThreadIndex, "threadIdx.x"))
        return tirx.For(bx, 0, blocks, tirx.ForKind.THREAD_BINDING, inner, tirx.IterVar(
            tvm.ir.Range(0, blocks), bx, tirx.IterVar.ThreadIndex, "blockIdx.x"))

    func = tvm_ffi.structural_map(func, [(tirx.For, serial)])
    return tvm_ffi.structural_map(func, [(tirx.For, bind)])
