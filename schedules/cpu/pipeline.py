"""The CPU TIR lowering pipeline: TVM's default one, with register tiles of up to
``TILE_STACK_BYTES`` kept on the stack.

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
"""
from __future__ import annotations

import tvm
from tvm import tirx

NAME = "tvm_llm_cpu"
TILE_STACK_BYTES = 2048  # 32 zmm registers x 64 B: no register tile is larger
_DISABLE_LOWER_BUILTIN = "disable_lower_builtin"  # tvm::tirx::transform::kDisableLowerTVMBuiltin


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


def _annotate(stmt, limit: int):
    """`stmt` with every small constant AllocBuffer annotated; the same object where nothing
    changed. TVM 0.27 has no Python statement mutator, so the statements that can hold an
    allocation after the default passes (loops, attributes, sequences, branches) are rebuilt
    here; any other statement holds none."""
    if isinstance(stmt, tirx.AllocBuffer):
        size = _stack_bytes(stmt.buffer)
        if size is None or size > limit or _DISABLE_LOWER_BUILTIN in stmt.annotations:
            return stmt
        notes = dict(stmt.annotations)
        notes[_DISABLE_LOWER_BUILTIN] = tirx.IntImm("bool", 1)
        return tirx.AllocBuffer(stmt.buffer, notes, stmt.span)
    if isinstance(stmt, tirx.SeqStmt):
        seq = [_annotate(s, limit) for s in stmt.seq]
        same = all(a.same_as(b) for a, b in zip(seq, stmt.seq))
        return stmt if same else tirx.SeqStmt(seq, stmt.span)
    if isinstance(stmt, tirx.For):
        body = _annotate(stmt.body, limit)
        return stmt if body.same_as(stmt.body) else tirx.For(
            stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body, stmt.thread_binding,
            stmt.annotations, stmt.step, stmt.span)
    if isinstance(stmt, tirx.AttrStmt):
        body = _annotate(stmt.body, limit)
        return stmt if body.same_as(stmt.body) else tirx.AttrStmt(
            stmt.node, stmt.attr_key, stmt.value, body, stmt.span)
    if isinstance(stmt, tirx.While):
        body = _annotate(stmt.body, limit)
        return stmt if body.same_as(stmt.body) else tirx.While(stmt.condition, body, stmt.span)
    if isinstance(stmt, tirx.IfThenElse):
        then = _annotate(stmt.then_case, limit)
        other = _annotate(stmt.else_case, limit) if stmt.else_case is not None else None
        if then.same_as(stmt.then_case) and (other is None or other.same_as(stmt.else_case)):
            return stmt
        return tirx.IfThenElse(stmt.condition, then, other, stmt.span)
    return stmt


def keep_tiles_on_stack(limit: int = TILE_STACK_BYTES):
    """A TIR pass annotating constant-size global allocations of at most `limit` bytes so that
    LowerTVMBuiltin leaves them on the stack (see the module docstring)."""

    def transform(func, _mod, _ctx):
        body = _annotate(func.body, limit)
        return func if body.same_as(func.body) else func.with_body(body)

    return tirx.transform.prim_func_pass(transform, opt_level=0, name="KeepTilesOnStack")


def cpu_tir_pipeline() -> str:
    """Register (once) and name the CPU pipeline: the default s_tir passes, then
    :func:`keep_tiles_on_stack`; host finalization as the default's."""
    from tvm.s_tir.pipeline import default_s_tir_pipeline
    from tvm.tirx.compilation_pipeline import register_tir_pipeline

    def pipeline():
        passes, finalize_host, finalize_device = default_s_tir_pipeline()
        return tvm.transform.Sequential([passes, keep_tiles_on_stack()]), finalize_host, finalize_device

    register_tir_pipeline(NAME, pipeline)
    return NAME
