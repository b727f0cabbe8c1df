"""The CPU TIR lowering pipeline: TVM's default one, with register tiles of up to
``TILE_STACK_BYTES`` kept on the stack, and the micro-kernel loops the rules annotate
finished (partial row tiles without branches, software prefetch).

TVM's LowerTVMBuiltin keeps a constant-size "global" buffer on the stack only below
``runtime::kMaxStackAlloca`` (1 KiB, :data:`.common.MAX_STACK_BYTES`); a larger one becomes a
TVMBackendAllocWorkspace call, whose pointer LLVM cannot promote to registers, so a GEMM tile's
stores stay in the k loop (measured 3x slower). 1 KiB is 15 AVX-512 accumulators: enough for
CPUs with one 512-bit FMA per cycle (znver4), not for those with two (Intel Xeons, znver5),
whose best micro-kernels keep 24-28 accumulators in registers (C micro-kernels of 12x2 / 14x2 /
8x3 AVX-512 tiles ran at 1.08-1.13x the 7x2 tile's GFLOP/s on an Intel Xeon, 1 thread).
LowerTVMBuiltin leaves an allocation annotated ``disable_lower_builtin`` alone, and LLVM's
code generator then makes it an alloca at the function's entry; :func:`keep_tiles_on_stack`
annotates every constant-size global allocation of at most TILE_STACK_BYTES so, after the
default passes and before the host finalization that runs LowerTVMBuiltin.

Software prefetch: the packed GEMM's micro-kernel reads its weight panel (K x PN floats, 96-288
KiB) from L2 for every row tile, three or four 64-byte lines per k step, about one line per 4
cycles on a CPU with two FMA ports; the L1 hardware prefetchers run only a line or two ahead of
that, less than L2's latency. Where the CPU's row asks for it (microarch.TileRow.
gemm_prefetch_bytes) the rule annotates the k loop with :data:`PREFETCH_AHEAD` and
:func:`row_tile_loops` puts a prefetcht0 of each panel line that many bytes ahead beside its
load. TVM's schedule has no prefetch primitive; the pass works on the lowered loop, where the
panel's vector loads are plain ``Ramp`` loads. The row tiles of a panel also bring the next
panel into L2 while they compute (:func:`_next_panel_prefetched`), where the CPU's row allows
it for panels of that size (``gemm_next_panel_bytes``).

Partial row tiles: a symbolic M (prefill's tokens) leaves a last row tile of fewer than Mr rows,
which TVM's LoopPartition gives a ``row < n`` branch around each row's FMAs inside the k loop;
LLVM then kept the tile out of registers and that one tile took ~3x a full one (llama-1b
linears at 64 tokens, 6x4 tiles: a 4-row tail made the kernel 16-24% slower than 66 tokens).
:func:`row_tile_loops` turns the branches into guarded loads of x (0 past n), so all Mr rows
run unconditionally on registers and only the epilogue, outside the k loop, keeps the
predicate (same Xeon, whole llama-1b float32 build, scripts/ab_decode.py --prefill 64: 0.970 /
0.942x the time, both load orders).
"""
from __future__ import annotations

import tvm
from tvm import tirx

from . import common

NAME = "tvm_llm_cpu"
TILE_STACK_BYTES = 2048  # 32 zmm registers x 64 B: no register tile is larger
_DISABLE_LOWER_BUILTIN = "disable_lower_builtin"  # tvm::tirx::transform::kDisableLowerTVMBuiltin
# A loop annotation (bytes): the rules ask :func:`row_tile_loops` to prefetch each vector
# stream the loop reads this far ahead
PREFETCH_AHEAD = "tvm_llm.prefetch_ahead"
# A loop annotation (elements of one packed panel, K x PN): the row-tile loop whose k loop
# :func:`row_tile_loops` makes prefetch the next panel into L2 (see
# :func:`_next_panel_prefetched`)
NEXT_PANEL = "tvm_llm.next_panel"
# ... spread over at most this many times R row tiles (each prefetching one line every this
# many k steps; a 64-token prefill has 8 row tiles of 8x3, 11 of 6x4), over all of a call's
# row tiles where it has fewer (:func:`next_panel_line`). Kernels on an Intel Xeon, 2 threads,
# cold weights (scripts/ab_prefill_kernels.py), llama-1b qkv / gate_up at 64 rows, spread 1
# -> 4 over a fixed 4R tiles: 269 / 259 -> 296 / 284 GFLOP/s (2 and 3 alike); at 128 rows 313
# / 307 -> 328 / 353; without the prefetch (other runs) 230 / 236-240 at 64 rows. A 64-token
# prefill's 11 tiles of 6x4 had covered only 11/16 of the next panel so; spread over the 11,
# 10 interleaved rounds at 64 rows, qkv / o / gate_up / down 294 / 283 / 286 / 288 -> 304 /
# 304 / 296 / 299 GFLOP/s against spreading over the largest power of two times R tiles the
# call has (8), and the whole 64-token llama-1b prefill (scripts/ab_decode.py --prefill 64,
# three builds interleaved) took 0.965x the time of that (rounds 0.933-0.997), which itself
# took 1.000x the fixed 4R's. The C copy of the kernel (scripts/bench_gemm_ceiling.py, cold,
# 60 rows) agreed: over all 10 tiles 305 GFLOP/s, 8 tiles 297, 16 (the fixed 4R) 290.
NEXT_PANEL_SPREAD = 4
# A loop annotation: the k loop of a register-tile micro-kernel, whose partial row tile
# (symbolic M) :func:`row_tile_loops` computes without branches
ROW_TILE_LOOP = "tvm_llm.row_tile_loop"


def _stack_bytes(buffer) -> int | None:
    """Bytes of a constant-size "global" buffer, None for any other."""
    if buffer.scope() not in ("", "global") or not buffer.shape:
        return None
    n = 1
    for e in buffer.shape:
        if not isinstance(e, tirx.IntImm):
            return None
        n *= int(e.value)
    return n * buffer.dtype.bits * buffer.dtype.lanes // 8


def _rewrite(stmt, fn):
    """`stmt` with `fn` applied to every statement in it, children before their parent; the
    same object where nothing changed. TVM 0.27 has no Python statement mutator, so the
    statements that can hold others after the default passes (loops, attributes, sequences,
    branches) are rebuilt here; `fn` sees each of them once their children are done."""
    if isinstance(stmt, tirx.SeqStmt):
        seq = [_rewrite(s, fn) for s in stmt.seq]
        if not all(a.same_as(b) for a, b in zip(seq, stmt.seq)):
            stmt = tirx.SeqStmt(seq, stmt.span)
    elif isinstance(stmt, tirx.For):
        body = _rewrite(stmt.body, fn)
        if not body.same_as(stmt.body):
            stmt = tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body,
                            stmt.thread_binding, stmt.annotations, stmt.step, stmt.span)
    elif isinstance(stmt, tirx.AttrStmt):
        body = _rewrite(stmt.body, fn)
        if not body.same_as(stmt.body):
            stmt = tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, body, stmt.span)
    elif isinstance(stmt, tirx.While):
        body = _rewrite(stmt.body, fn)
        if not body.same_as(stmt.body):
            stmt = tirx.While(stmt.condition, body, stmt.span)
    elif isinstance(stmt, tirx.IfThenElse):
        then = _rewrite(stmt.then_case, fn)
        other = _rewrite(stmt.else_case, fn) if stmt.else_case is not None else None
        if not (then.same_as(stmt.then_case) and (other is None or other.same_as(stmt.else_case))):
            stmt = tirx.IfThenElse(stmt.condition, then, other, stmt.span)
    return fn(stmt)


def _on_stack(stmt, limit: int):
    """A small constant AllocBuffer annotated to stay on the stack; any other statement as is."""
    if not isinstance(stmt, tirx.AllocBuffer):
        return stmt
    size = _stack_bytes(stmt.buffer)
    if size is None or size > limit or _DISABLE_LOWER_BUILTIN in stmt.annotations:
        return stmt
    notes = dict(stmt.annotations)
    notes[_DISABLE_LOWER_BUILTIN] = tirx.IntImm("bool", 1)
    return tirx.AllocBuffer(stmt.buffer, notes, stmt.span)


def _is_vector_load(expr) -> bool:
    """A buffer load of a vector: a Ramp as its last index."""
    return (isinstance(expr, tvm.ir.expr.TensorLoad) and bool(expr.indices)
            and isinstance(expr.indices[-1], tirx.Ramp))


def _vector_loads(expr, out: list) -> list:
    """The vector loads in `expr`, in evaluation order."""
    if isinstance(expr, tvm.ir.expr.TensorLoad):
        if _is_vector_load(expr):
            out.append(expr)
        return out
    subs = [getattr(expr, f, None) for f in ("a", "b", "value", "condition", "true_value",
                                              "false_value")]
    for sub in subs + list(getattr(expr, "args", None) or ()):
        if isinstance(sub, tirx.Expr):
            _vector_loads(sub, out)
    return out


def _prefetched(stmt):
    """A loop annotated PREFETCH_AHEAD with, before each statement of its body that first
    reads a vector of another buffer than the one it writes, a prefetch (into L1) of the line
    that many bytes further on. Only a body that is a plain sequence is changed: the full
    tiles' loop, and the partial tile's once :func:`_unpredicated` has taken its branches out."""
    ahead = stmt.annotations.get(PREFETCH_AHEAD) if isinstance(stmt, tirx.For) else None
    if ahead is None or not isinstance(stmt.body, tirx.SeqStmt):
        return stmt
    body, seen = [], set()
    for st in stmt.body.seq:
        loads = _vector_loads(st.value, []) if isinstance(st, tirx.BufferStore) else []
        for ld in loads:
            key = (str(ld.source.data), str(ld.indices[-1].base))
            if ld.source.same_as(st.buffer) or key in seen:
                continue
            seen.add(key)
            base = ld.indices[-1].base
            step = tirx.const(int(ahead) * 8 // ld.source.dtype.bits, str(base.ty))
            line = tirx.BufferLoad(ld.source, list(ld.indices[:-1]) + [base + step])
            body.append(tirx.Evaluate(common.prefetch_l2(tirx.address_of(line), locality=3)))
        body.append(st)
    notes = {k: v for k, v in stmt.annotations.items() if k != PREFETCH_AHEAD}  # done once
    return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, tirx.SeqStmt(body),
                    stmt.thread_binding, notes, stmt.step, stmt.span)


def _panel_load(stmt):
    """(index of the loop body's statement, the first vector load of it) that reads another
    buffer than the one the statement writes: the panel's first vector of a k step."""
    for i, st in enumerate(stmt.body.seq):
        if isinstance(st, tirx.BufferStore):
            for ld in _vector_loads(st.value, []):
                if not ld.source.same_as(st.buffer):
                    return i, ld
    return None, None


def next_panel_line(mo, k, tiles, rows: int, K: int):
    """The line of the next panel that row tile `mo` of a call's `tiles` prefetches at k step
    `k` (PrimExprs of one integer type; `rows` = R, the panel's lines per k step; `K` k
    steps): the panel's R K lines are shared evenly among its first T = min(tiles, R x
    NEXT_PANEL_SPREAD) row tiles, P = ceil(R K / T) lines each (at most K: one a k step), row
    tile ``mo`` taking lines ``(mo % T) P + k P / K``. T is chosen at run time (M is
    symbolic), so that a call with fewer row tiles still covers the whole panel (from R tiles
    on); at R x NEXT_PANEL_SPREAD tiles or more it is one line every NEXT_PANEL_SPREAD k steps
    per tile. A line past the panel (the rounding up) names its last line instead."""
    c = lambda v: tirx.const(v, str(k.ty))  # noqa: E731
    used = tirx.max(tirx.min(tiles, c(rows * NEXT_PANEL_SPREAD)), c(1))  # T
    per = tirx.min(tirx.floordiv(c(rows * K) + used - c(1), used), c(K))  # P
    line = tirx.floormod(mo, used) * per + tirx.floordiv(k * per, c(K))
    return tirx.min(line, c(rows * K - 1))


def _next_panel_prefetched(stmt):
    """A row-tile loop annotated NEXT_PANEL whose k loop also prefetches (into L2) one line of
    the next packed panel, :func:`next_panel_line` of it: the call's first min(row tiles, R x
    NEXT_PANEL_SPREAD) row tiles share the panel evenly (R: the panel's lines per k step;
    neighbouring k steps that name the same line prefetch it once more, from L2). Without it
    the first row tile of a panel reads the panel from DRAM, three or four lines per k step,
    faster than one core's share of the memory bus, while the other row tiles reread it from
    L2 with the bus idle; spread so, the next panel's stream overlaps the row tiles' compute.
    A prefill of fewer than R row tiles leaves the rest of the next panel to that panel's
    first row tile."""
    panel = stmt.annotations.get(NEXT_PANEL) if isinstance(stmt, tirx.For) else None
    if panel is None:
        return stmt
    notes = {k: v for k, v in stmt.annotations.items() if k != NEXT_PANEL}
    seq = list(stmt.body.seq) if isinstance(stmt.body, tirx.SeqStmt) else [stmt.body]
    for j, kl in enumerate(seq):
        if not (isinstance(kl, tirx.For) and isinstance(kl.body, tirx.SeqStmt)
                and isinstance(kl.extent, tirx.IntImm)):
            continue
        at, ld = _panel_load(kl)
        if ld is None:
            continue
        k, K, base = kl.loop_var, int(kl.extent.value), ld.indices[-1].base
        per_line = 512 // ld.source.dtype.bits  # elements in a 64-byte line
        pn = int(panel) // K
        rows = max(1, pn // per_line)  # R
        ity = str(base.ty)
        mo = tirx.Cast(ity, stmt.loop_var) if str(stmt.loop_var.ty) != ity else stmt.loop_var
        c = lambda v: tirx.const(v, ity)  # noqa: E731
        kk = tirx.Cast(ity, k) if str(k.ty) != ity else k
        tiles = tirx.Cast(ity, stmt.extent) if str(stmt.extent.ty) != ity else stmt.extent
        line = next_panel_line(mo, kk, tiles, rows, K)
        idx = base + c(int(panel)) - kk * c(pn) + line * c(per_line)  # the next panel's line
        target = tirx.BufferLoad(ld.source, list(ld.indices[:-1]) + [idx])
        hint = tirx.Evaluate(common.prefetch_l2(tirx.address_of(target), locality=2))
        body = list(kl.body.seq)
        body.insert(at, hint)
        seq[j] = tirx.For(kl.loop_var, kl.min, kl.extent, kl.kind, tirx.SeqStmt(body),
                          kl.thread_binding, kl.annotations, kl.step, kl.span)
        break
    body = tirx.SeqStmt(seq) if len(seq) > 1 else seq[0]
    return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body,
                    stmt.thread_binding, notes, stmt.step, stmt.span)


def _guarded(expr, cond):
    """`expr` (tile + broadcast(x) * panel terms) with each scalar load guarded by `cond`
    (0 where it is false); None for an expression of another shape."""
    if isinstance(expr, tvm.ir.expr.TensorLoad):
        if _is_vector_load(expr):
            return expr
        return tirx.if_then_else(cond, expr, tirx.const(0, str(expr.ty)))
    if isinstance(expr, (tirx.Add, tirx.Mul)):
        a, b = _guarded(expr.a, cond), _guarded(expr.b, cond)
        if a is None or b is None:
            return None
        return type(expr)(a, b)
    if isinstance(expr, tirx.Broadcast):
        v = _guarded(expr.value, cond)
        return None if v is None else tirx.Broadcast(v, expr.lanes)
    return None


def _const_index(idx) -> bool:
    base = idx.base if isinstance(idx, tirx.Ramp) else idx
    return isinstance(base, tirx.IntImm)


def _unpredicated(stmt):
    """A loop annotated ROW_TILE_LOOP with its row predicates (``if row < n: tile[i] +=
    x[row] * panel``: the partial row tile of a symbolic M) turned into loads of x guarded by
    them (0 for a row past n), so every FMA runs, the tile stays in registers and the loop
    has no branch around them; the rows past n are never stored (the epilogue keeps its
    predicate). Unchanged unless every predicated statement is such a tile update."""
    if not (isinstance(stmt, tirx.For) and ROW_TILE_LOOP in (stmt.annotations or {})):
        return stmt
    seq = list(stmt.body.seq) if isinstance(stmt.body, tirx.SeqStmt) else [stmt.body]
    out = []
    for st in seq:
        if not (isinstance(st, tirx.IfThenElse) and st.else_case is None):
            out.append(st)
            continue
        then = st.then_case
        inner = list(then.seq) if isinstance(then, tirx.SeqStmt) else [then]
        new = []
        for s2 in inner:
            if isinstance(s2, tirx.BufferStore) and all(_const_index(i) for i in s2.indices):
                v = _guarded(s2.value, st.condition)
                if v is None:
                    return stmt
                new.append(tirx.BufferStore(s2.buffer, v, s2.indices))
            elif isinstance(s2, tirx.Bind):
                new.append(s2)
            else:
                return stmt
        out.extend(new)
    notes = {k: v for k, v in stmt.annotations.items() if k != ROW_TILE_LOOP}  # done once
    return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, tirx.SeqStmt(out),
                    stmt.thread_binding, notes, stmt.step, stmt.span)


def row_tile_loops():
    """A TIR pass over the loops the rules annotated: the partial row tile without branches
    (:data:`ROW_TILE_LOOP`, :func:`_unpredicated`), then a software prefetch of each vector
    stream the loop reads (:data:`PREFETCH_AHEAD`, :func:`_prefetched`) and of the next
    packed panel (:data:`NEXT_PANEL`, :func:`_next_panel_prefetched`)."""

    def transform(func, _mod, _ctx):
        body = _rewrite(func.body,
                        lambda st: _next_panel_prefetched(_prefetched(_unpredicated(st))))
        return func if body.same_as(func.body) else func.with_body(body)

    return tirx.transform.prim_func_pass(transform, opt_level=0, name="RowTileLoops")


def keep_tiles_on_stack(limit: int = TILE_STACK_BYTES):
    """A TIR pass annotating constant-size global allocations of at most `limit` bytes so that
    LowerTVMBuiltin leaves them on the stack (see the module docstring)."""

    def transform(func, _mod, _ctx):
        body = _rewrite(func.body, lambda st: _on_stack(st, limit))
        return func if body.same_as(func.body) else func.with_body(body)

    return tirx.transform.prim_func_pass(transform, opt_level=0, name="KeepTilesOnStack")


def cpu_tir_pipeline() -> str:
    """Register (once) and name the CPU pipeline: the default s_tir passes, then
    :func:`keep_tiles_on_stack`; host finalization as the default's."""
    from tvm.s_tir.pipeline import default_s_tir_pipeline
    from tvm.tirx.compilation_pipeline import register_tir_pipeline

    def pipeline():
        passes, finalize_host, finalize_device = default_s_tir_pipeline()
        return (tvm.transform.Sequential([passes, keep_tiles_on_stack(), row_tile_loops()]),
                finalize_host, finalize_device)

    register_tir_pipeline(NAME, pipeline)
    return NAME
