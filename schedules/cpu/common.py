"""Shared pieces of the CPU rules: what the target's SIMD looks like, and the matmul matcher.

Everything about the machine is derived from the tvm Target (never from the build host):
the vector ISA from LLVM's feature query, the vector width from the ISA. `llvm_get_vector_width`
is not used on x86: for a generic x86 triple it reports 512 bits even without AVX-512.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

# What a schedule primitive raises when it refuses (compute_inline of a block that cannot be
# inlined, get_sblock of a name the kernel does not have): an expected "not this way".
ScheduleError = s_tir.schedule.ScheduleError

_log = logging.getLogger("tvm_llm.schedules")


def rule_failed(rule, func, err: Exception) -> None:
    """A rule that matched a kernel but failed to schedule it leaves the kernel to the next rule
    (dlight's fallbacks): correct, but slower. With TVM_LLM_DEBUG=1 each such failure is
    printed (rule, kernel, error), so a broken rule cannot hide behind the fallbacks; it is
    logged at debug level otherwise. Returns None (what the rule returns)."""
    name = rule if isinstance(rule, str) else type(rule).__name__
    kernel = str(func.attrs.get("global_symbol", "?")) if getattr(func, "attrs", None) else "?"
    first = (str(err).strip().splitlines() or [""])[-1][:200]
    msg = f"[tvm-llm] rule {name} did not schedule {kernel}: {type(err).__name__}: {first}"
    if os.environ.get("TVM_LLM_DEBUG") == "1":
        print(msg, flush=True)
    else:
        _log.debug(msg)
    return None

TensorLoad = tvm.ir.expr.TensorLoad

# TVM keeps a "global"-scope buffer of constant size on the stack when it is smaller than this
# (runtime::kMaxStackAlloca); anything larger, and every "local"-scope buffer, becomes a
# TVMBackendAllocWorkspace call. Register tiles must stay stack buffers: LLVM promotes a small
# alloca to registers, but never a workspace pointer (its stores stay in the inner loop).
MAX_STACK_BYTES = 1024


# --------------------------------------------------------------------------------------------
# Target description
# --------------------------------------------------------------------------------------------
def prefetch_l2(address, locality: int = 2):
    """A software prefetch of the 64-byte line at `address` into L2 (llvm.prefetch: read,
    locality 2, data cache; locality 3 prefetches into L1 as well), as a TIR expression to
    T.evaluate: the kernels that stream weights or KV pages ahead of their compute share this
    one spelling."""
    return tirx.call_llvm_intrin("void", "llvm.prefetch", address, tirx.const(0, "int32"),
                                 tirx.const(locality, "int32"), tirx.const(1, "int32"))


def is_llvm_cpu(target: Target | None) -> bool:
    return target is not None and target.kind.name == "llvm"


class CPURule(ScheduleRule):
    """Base of the CPU schedule rules: available on LLVM CPU targets, and `apply` hands a
    PrimFunc on such a target to `schedule(func, target)` (a Schedule, or None: not this
    rule's kernel, or it failed and logged through rule_failed)."""

    def is_target_available(self, target: Target) -> bool:
        return is_llvm_cpu(target)

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        return self.schedule(func, target)

    def schedule(self, func: tirx.PrimFunc, target: Target):
        raise NotImplementedError


def has_feature(feature: str, target: Target) -> bool:
    """Whether LLVM says the target's CPU has `feature` (e.g. avx512f, avx512vnni); False for
    a feature name LLVM does not know for the target's architecture."""
    try:
        return bool(tvm.target.codegen.llvm_cpu_has_features(feature, target))
    except (RuntimeError, ValueError):  # TVM's error for a target LLVM cannot describe
        return False


def target_arch(target: Target) -> str:
    triple = str(target.attrs.get("mtriple", "") or "")
    if triple.startswith(("aarch64", "arm64")):
        return "aarch64"
    if triple.startswith(("arm", "thumb")):
        return "arm"
    if triple.startswith(("riscv",)):
        return "riscv"
    return "x86_64" if not triple or triple.startswith(("x86_64", "i686", "i386")) else triple


def vector_isa(target: Target) -> str:
    """avx512, avx2, sse, neon or generic."""
    arch = target_arch(target)
    if arch == "x86_64":
        if has_feature("avx512f", target):
            return "avx512"
        if has_feature("avx2", target):
            return "avx2"
        return "sse"
    if arch in ("aarch64", "arm"):
        return "neon"
    return "generic"


def vector_bits(target: Target) -> int:
    isa = vector_isa(target)
    if isa == "avx512":
        return 512
    if isa == "avx2":
        return 256
    if isa in ("sse", "neon"):
        return 128
    try:
        bits = int(tvm.target.codegen.llvm_get_vector_width(target))
    except (RuntimeError, ValueError):  # TVM's error for a target LLVM cannot describe
        bits = -1
    return bits if bits > 0 else 128


def vector_lanes(target: Target, dtype: str = "float32") -> int:
    bits = tvm.runtime.DataType(dtype).bits
    return max(1, vector_bits(target) // bits)


def num_cores(target: Target) -> int:
    n = target.attrs.get("num-cores", None)
    try:
        n = int(n)
    except (TypeError, ValueError):
        n = 0
    return n if n > 0 else 1


# --------------------------------------------------------------------------------------------
# Small schedule helpers
# --------------------------------------------------------------------------------------------
def const_int(expr) -> int | None:
    if isinstance(expr, int):
        return expr
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    return None


def loop_extent(sch: s_tir.Schedule, loop) -> int | None:
    return const_int(sch.get(loop).extent)


def decode_shaped(extents) -> bool:
    """Loop extents of a decode step's kernel: a symbolic batch followed by a unit sequence
    axis, e.g. (b, 1, 768). Its b is small (usually 1), so such kernels run on the calling
    thread: a thread-pool launch per tiny kernel costs more than the work (about a hundred of
    them run per token) and stalls the step whenever a worker was descheduled."""
    for a, b in zip(extents, extents[1:]):
        if a is None and b == 1:
            return True
    return False


def m_flat_index(pat, idx):
    """Row-major flattening of the M indices `idx` of a matmul's C (pattern `pat`)."""
    flat = None
    for pos, ext in zip(idx, pat.m_extents):
        flat = pos if flat is None else flat * ext + pos
    return flat


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n."""
    v = 1
    while v * 2 <= cap and n % (v * 2) == 0:
        v *= 2
    return v


def vectorize_innermost(sch: s_tir.Schedule, block, lanes: int, unroll_rest: int = 0):
    """Split the block's innermost loop by the vector width and vectorize it.

    Static extents that the width does not divide use the largest power-of-two divisor, so the
    vector loop never carries a predicate (a predicated vector loop is scalarized by TVM).
    """
    loops = sch.get_loops(block)
    if not loops:
        return
    inner = loops[-1]
    ext = loop_extent(sch, inner)
    if ext is None:
        _, vec = sch.split(inner, [None, lanes])
        sch.vectorize(vec)
        return
    width = pow2_divisor(ext, lanes)
    if width <= 1:
        return
    if width == ext:
        sch.vectorize(inner)
        return
    outer, vec = sch.split(inner, [None, width])
    sch.vectorize(vec)
    if unroll_rest and ext // width <= unroll_rest:
        sch.unroll(outer)


def tensor_intrin(name: str, make) -> str:
    """`name`, with the tensor intrinsic ``make()`` returns (desc, impl) registered under it on
    first use (TVM's registry refuses a second registration of a name)."""
    if s_tir.TensorIntrin.get(name, allow_missing=True) is None:
        s_tir.TensorIntrin.register(name, *make())
    return name


def block_name(sch: s_tir.Schedule, block) -> str:
    return sch.get(block).name_hint


def is_reduction_block(sch: s_tir.Schedule, block) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars)


def is_spatial_block(sch: s_tir.Schedule, block) -> bool:
    stmt = sch.get(block)
    return stmt.init is None and all(iv.iter_type == tirx.IterVar.DataPar for iv in stmt.iter_vars)


def root_blocks(sch: s_tir.Schedule):
    return list(sch.get_child_blocks(sch.get_sblock("root")))


def is_simple_block(sch: s_tir.Schedule, block) -> bool:
    """A block as LegalizeOps/FuseTIR make them: it has iter vars (not an opaque block such as
    the KV-cache attention kernels), sits alone in its own loop nest of one loop per iter var.
    Only such blocks carry the dependence information that makes our loop transformations
    (parallel, vectorize, compute_at) valid."""
    stmt = sch.get(block)
    if not stmt.iter_vars:
        return False
    if any(iv.iter_type not in (tirx.IterVar.DataPar, tirx.IterVar.CommReduce)
           for iv in stmt.iter_vars):
        return False
    loops = sch.get_loops(block)
    if len(loops) != len(stmt.iter_vars):
        return False
    if loops and len(sch.get_child_blocks(loops[0])) != 1:
        return False
    return True


def all_simple_blocks(sch: s_tir.Schedule, blocks=None) -> bool:
    blocks = root_blocks(sch) if blocks is None else blocks
    return bool(blocks) and all(is_simple_block(sch, b) for b in blocks)


def _buffer_loads(expr):
    loads = []

    def visit(e):
        if isinstance(e, TensorLoad):
            loads.append(e)
            for i in e.indices:
                visit(i)
        elif isinstance(e, tirx.Cast):
            visit(e.value)
        elif hasattr(e, "a") and hasattr(e, "b"):
            visit(e.a)
            visit(e.b)
        elif hasattr(e, "args"):
            for a in e.args:
                visit(a)
        elif hasattr(e, "condition") and hasattr(e, "true_value"):
            visit(e.condition)
            visit(e.true_value)
            visit(e.false_value)
        elif hasattr(e, "value") and not isinstance(e, (tirx.IntImm,)) and hasattr(e.value, "dtype"):
            visit(e.value)

    visit(expr)
    return loads


def _strip_cast(e):
    while isinstance(e, tirx.Cast):
        e = e.value
    return e


# --------------------------------------------------------------------------------------------
# Matmul matcher
# --------------------------------------------------------------------------------------------
HALF_DTYPES = ("bfloat16", "float16")


@dataclass
class MatmulPattern:
    """A block computing C[m..., n] += A[m..., k] * B[n, k] (NT) or B[k, n] (NN).

    B is a 2-D buffer of static shape (a weight); A and C share the leading "M" dims, which
    may be symbolic (the token or batch dim). N and K are static.
    """

    block_name: str
    a_index: int  # index of A in the block's reads
    b_index: int  # index of B in the block's reads
    b_buffer: object
    b_transposed: bool  # True: B is (N, K) (x @ W^T); False: B is (K, N)
    m_axes: list  # positions (in block iter order) of the M iters
    n_axis: int
    k_axis: int
    m_extents: list  # PrimExpr extents of the M iters
    N: int
    K: int
    dtype: str  # the accumulator's (C's) dtype, which the kernel computes in
    epilogue: list = field(default_factory=list)  # remaining injective consumer block names
    input_dtype: str = ""  # A's and B's dtype: dtype, or bfloat16/float16 widened to float32
    a_buffer: object = None  # A as the block reads it; None when a prologue computes it

    @property
    def decode_like(self) -> bool:
        """x: (b, 1, K) with symbolic b: a decode step (b is small, usually 1)."""
        return (len(self.m_extents) >= 2 and const_int(self.m_extents[-1]) == 1
                and self.m_static is None)

    @property
    def m_static(self) -> int | None:
        total = 1
        for e in self.m_extents:
            c = const_int(e)
            if c is None:
                return None
            total *= c
        return total


def match_matmul_block(sch: s_tir.Schedule, block) -> MatmulPattern | None:
    stmt = sch.get(block)
    ivs = list(stmt.iter_vars)
    red = [i for i, iv in enumerate(ivs) if iv.iter_type == tirx.IterVar.CommReduce]
    spa = [i for i, iv in enumerate(ivs) if iv.iter_type == tirx.IterVar.DataPar]
    if len(red) != 1 or len(spa) + 1 != len(ivs) or len(spa) < 2 or stmt.init is None:
        return None
    if len(stmt.writes) != 1 or not isinstance(stmt.body, tirx.BufferStore):
        return None
    store = stmt.body
    value = store.value
    if not isinstance(value, tirx.Add):
        return None
    k_var = ivs[red[0]].var
    spatial_vars = [ivs[i].var for i in spa]
    # C indices: exactly the spatial iters, in order
    if len(store.indices) != len(spa) or any(
        not (isinstance(ix, tirx.Var) and ix.same_as(v)) for ix, v in zip(store.indices, spatial_vars)
    ):
        return None
    acc, prod = _strip_cast(value.a), _strip_cast(value.b)
    if not (isinstance(acc, TensorLoad) and acc.source.same_as(store.buffer)):
        acc, prod = _strip_cast(value.b), _strip_cast(value.a)
    if not (isinstance(acc, TensorLoad) and acc.source.same_as(store.buffer)):
        return None
    if not isinstance(prod, tirx.Mul):
        return None
    lhs, rhs = _strip_cast(prod.a), _strip_cast(prod.b)
    if not (isinstance(lhs, TensorLoad) and isinstance(rhs, TensorLoad)):
        return None
    n_var = spatial_vars[-1]

    def is_var(e, v):
        return isinstance(e, tirx.Var) and e.same_as(v)

    def as_b(load):
        if len(load.indices) != 2 or len(load.source.shape) != 2:
            return None
        if any(const_int(s) is None for s in load.source.shape):
            return None
        i0, i1 = load.indices
        if is_var(i0, n_var) and is_var(i1, k_var):
            return True
        if is_var(i0, k_var) and is_var(i1, n_var):
            return False
        return None

    def as_a(load):
        idx = list(load.indices)
        if not idx or not is_var(idx[-1], k_var):
            return False
        m_vars = spatial_vars[:-1]
        lead = idx[:-1]
        # A's leading indices: the M iters in order (A may omit leading unit dims)
        if len(lead) > len(m_vars):
            return False
        offset = len(m_vars) - len(lead)
        for j, ix in enumerate(lead):
            if not is_var(ix, m_vars[offset + j]):
                return False
        for j in range(offset):
            if const_int(ivs[spa[j]].dom.extent) != 1:
                return False
        return True

    b_load = a_load = None
    b_trans = None
    for cand_b, cand_a in ((rhs, lhs), (lhs, rhs)):
        t = as_b(cand_b)
        if t is not None and as_a(cand_a):
            b_load, a_load, b_trans = cand_b, cand_a, t
            break
    if b_load is None:
        return None
    reads = [r.source for r in stmt.reads]

    def read_index(buf):
        for i, r in enumerate(reads):
            if r.same_as(buf):
                return i
        return -1

    a_idx, b_idx = read_index(a_load.source), read_index(b_load.source)
    if a_idx < 0 or b_idx < 0 or a_idx == b_idx:
        return None
    dtypes = {str(store.buffer.dtype), str(a_load.source.dtype), str(b_load.source.dtype)}
    input_dtype = str(b_load.source.dtype)
    if len(dtypes) != 1:
        # half-precision inputs accumulated in float32 (what AccumulateHalfMatmulInFloat32
        # makes of a bfloat16/float16 linear): the kernel computes in float32
        if not (str(store.buffer.dtype) == "float32" and input_dtype in HALF_DTYPES
                and str(a_load.source.dtype) == input_dtype):
            return None
        dtypes = {"float32"}
    b_shape = [const_int(s) for s in b_load.source.shape]
    N, K = (b_shape[0], b_shape[1]) if b_trans else (b_shape[1], b_shape[0])
    if const_int(ivs[spa[-1]].dom.extent) != N or const_int(ivs[red[0]].dom.extent) != K:
        return None
    return MatmulPattern(
        block_name=stmt.name_hint,
        a_index=a_idx,
        b_index=b_idx,
        b_buffer=b_load.source,
        b_transposed=b_trans,
        m_axes=spa[:-1],
        n_axis=spa[-1],
        k_axis=red[0],
        m_extents=[ivs[i].dom.extent for i in spa[:-1]],
        N=N,
        K=K,
        dtype=dtypes.pop(),
        input_dtype=input_dtype,
        a_buffer=a_load.source,
    )


def prepare_matmul(func: tirx.PrimFunc, dtypes=("float32",), allow_computed_b: bool = False,
                   keep_producers: tuple = ()):
    """Match a (fused) weight matmul and normalize its epilogue.

    Returns (sch, pattern) with the schedule's injective prologue blocks inlined into the
    matmul and the injective epilogue chain inlined into its last block, or None if the
    function is not one matmul over a static 2-D weight plus injective blocks.
    `allow_computed_b`: also accept a weight computed by an inlined prologue (a quantized
    weight's dequantize); the pattern's b_index is then -1 (nothing to repack).
    `keep_producers`: names of prologue blocks left as they are (not inlined), e.g. the
    dequantize that :mod:`.dequant_gemm` computes into a panel buffer.
    """
    if not isinstance(func, tirx.PrimFunc):
        return None
    try:
        sch = s_tir.Schedule(func)
        blocks = root_blocks(sch)
    except Exception as err:  # pylint: disable=broad-except
        return rule_failed("prepare_matmul", func, err)
    if not all_simple_blocks(sch, blocks):
        return None
    reductions = [b for b in blocks if is_reduction_block(sch, b)]
    if len(reductions) != 1:
        return None
    main = reductions[0]
    pattern = match_matmul_block(sch, main)
    if pattern is None or pattern.dtype not in dtypes:
        return None
    main_name = pattern.block_name
    others = [b for b in blocks if block_name(sch, b) != main_name]
    if any(not is_spatial_block(sch, b) for b in others):
        return None
    # Prologue: blocks producing the matmul's inputs get inlined into it.
    for _ in range(len(others) + 1):
        producers = [p for p in sch.get_producers(sch.get_sblock(main_name))
                     if block_name(sch, p) not in keep_producers]
        if not producers:
            break
        progress = False
        for p in producers:
            try:
                sch.compute_inline(p)
                progress = True
            except ScheduleError:  # not inlinable: another producer may be
                pass
        if not progress:
            return None
    # Epilogue: inline every consumer block but the last into its consumers.
    for _ in range(len(others) + 1):
        rest = [b for b in root_blocks(sch)
                if block_name(sch, b) != main_name and block_name(sch, b) not in keep_producers]
        if len(rest) <= 1:
            break
        progress = False
        for b in rest:
            if not sch.get_consumers(b):
                continue  # an output block: keep
            try:
                sch.compute_inline(b)
                progress = True
                break
            except ScheduleError:  # not inlinable: try the next block
                continue
        if not progress:
            break
    # Inlined prologues change the block's read list: find A and B again by buffer.
    reads = [r.source for r in sch.get(sch.get_sblock(main_name)).reads]
    b_pos = [i for i, r in enumerate(reads) if r.same_as(pattern.b_buffer)]
    if len(b_pos) != 1 and not allow_computed_b:
        return None  # the weight itself came from a fused producer (cast, dequantize, ...)
    pattern.b_index = b_pos[0] if len(b_pos) == 1 else -1
    again = match_matmul_block(sch, sch.get_sblock(main_name))
    pattern.a_buffer = again.a_buffer if again is not None else None
    rest = [b for b in root_blocks(sch)
            if block_name(sch, b) != main_name and block_name(sch, b) not in keep_producers]
    if len(rest) > 1:
        return None
    if rest:
        consumers = sch.get_consumers(sch.get_sblock(main_name))
        if len(consumers) != 1 or block_name(sch, consumers[0]) != block_name(sch, rest[0]):
            return None
        pattern.epilogue = [block_name(sch, rest[0])]
    return sch, pattern


def layout_free_indices(func: tirx.PrimFunc) -> set:
    """Parameter positions the build marked as weights (relax.transform.AttachAttrLayoutFreeBuffers)."""
    attrs = func.attrs
    if attrs is None or "layout_free_buffers" not in attrs:
        return set()
    return {int(i) for i in attrs["layout_free_buffers"]}


def param_index(func: tirx.PrimFunc, buffer) -> int:
    for i, p in enumerate(func.params):
        if p.same_as(buffer):
            return i
    return -1
