"""AMX-BF16 GEMM (``tdpbf16ps``) for bfloat16 prefill: C[m, n] = sum_k f32(A[m, k]) * f32(W[n, k]).

AMX (Sapphire Rapids and later Intel server parts) computes on eight 2-D tile registers of up
to 16 rows x 64 bytes. ``tdpbf16ps dst, a, b`` adds to a 16 x 16 float32 tile the product of a
16 x 32 bfloat16 tile of A (row-major) and a 32 x 16 bfloat16 tile of B stored as 16 rows of
"k-pairs": row j holds, for each of the 16 columns, the bfloat16 values of k = 2j and 2j + 1
side by side. That is exactly the panel the GEMM rule already packs bfloat16 weights into for
``vdpbf16ps`` (:mod:`.bf16_dot`): ``Bp[N/PN, K/2, PN, 2]``. A B tile is therefore 16 rows of
64 bytes at row stride ``PN * 4`` bytes, read straight from the packed weight.

Why an imported LLVM function (the ``pragma_import_llvm`` mechanism of :mod:`.bf16_dot`): the
AMX intrinsics take tile numbers as immediates and have side effects on architectural tile
state (a tile configuration must be loaded first), which TIR cannot express; a small LLVM
function can. Why the intrinsics need AMX in the build's target (the GEMM rule only takes
this path on such a target, so kernels use the intrinsics, ``asm=False``), and why an inline
assembly form exists: TVM's import (``CodeGenLLVM::HandleImport``)
makes every imported function ``alwaysinline`` + ``available_externally`` (dropping
``noinline``), so the function's own ``"target-features"="+amx-tile,+amx-bf16"`` is lost when
it is inlined into the TVM function, whose features are the target's; on a CPU LLVM names
without AMX (this masked Sapphire-Rapids-class VM reports ``rocketlake``) the intrinsics then
abort the process at instruction selection ("LLVM ERROR: Cannot select: intrinsic
%llvm.x86.ldtilecfg"). A per-PrimFunc ``"target"`` attribute does not help (all llvm functions
are compiled as one host module with the build's target). LLVM's x86 assembler, though,
accepts every instruction under any CPU, so the same instructions as inline assembly build
with the target as it is (``asm=True``); the intrinsics form (``asm=False``) builds when the
module's target has ``+amx-tile,+amx-bf16`` (the host target has them where the CPU flags
and Linux allow AMX; :func:`with_amx` adds them). Same results; the intrinsics
form was ~8% faster (K=N=2048, M=512, 1 thread: 1006-1031 vs 928-940 GFLOP/s; LLVM unrolls
its K loop twice, not the asm one's).

The micro-kernel computes one 32 x 32 block of C over the whole K: four accumulator tiles
(tmm0-3), two A tiles (tmm4-5, rows 0-15 and 16-31) and two B tiles (tmm6-7, columns 0-15 and
16-31), four ``tdpbf16ps`` per 32 k. The tile configuration is built on the stack per call
with the block's *valid* row count, so rows past M are neither read from A nor written to C
(tdpbf16ps needs dst.rows == a.rows); with <= 16 valid rows only the top tiles are used.
The two B tiles have separate pointers, so a 32-column block may straddle two panels (PN a
multiple of 16, e.g. 48).

Use: a process must be granted AMX state first (:func:`tvm_llm.runtime.cpu_probe.
request_amx_permission`; the engine and the host target ask), or its first tile instruction
raises SIGILL.
"""
from __future__ import annotations

import tvm

from .common import has_feature

LLVM_FUNC = "tvm_llm_amx_bf16_32x32"
FEATURE = "amx-bf16"


def target_has_amx(target) -> bool:
    """Whether `target`'s CPU has AMX-BF16 tiles (amx-tile and amx-bf16): the condition of every
    AMX kernel choice (prefill matmuls, bfloat16 prefill attention scores)."""
    return all(has_feature(f, target) for f in (FEATURE, "amx-tile"))


BLOCK = 32  # rows and columns of C per call
KSTEP = 32  # k per tdpbf16ps (16 pairs = 64 bytes of an A row)


def _cfg_store(ty: str, val: str, off: int) -> str:
    return (f"  %p{off} = getelementptr i8, ptr %cfg, i64 {off}\n"
            f"  store {ty} {val}, ptr %p{off}\n")


def _op(asm: bool, op: str, *args) -> str:
    """One AMX instruction: an LLVM intrinsic call, or (asm) the same instruction as inline
    assembly (AT&T operand order), which LLVM's x86 assembler accepts under any target CPU."""
    if not asm:
        ty = {"ldtilecfg": "ptr", "tilerelease": "", "tilezero": "i8", "tdpbf16ps": "i8, i8, i8",
              "tileloadd64": "i8, ptr, i64", "tilestored64": "i8, ptr, i64"}[op].split(", ")
        ops = ", ".join(f"{t} {a}" for t, a in zip(ty, args))
        return f"  call void @llvm.x86.{op}({ops})\n"
    if op in ("tileloadd64", "tilestored64"):
        mem, t = f"(${{0:q}},${{1:q}},1)", f"%tmm{args[0]}"
        text = f"tileloadd {mem}, {t}" if op == "tileloadd64" else f"tilestored {t}, {mem}"
        return (f'  call void asm sideeffect "{text}", "r,r,~{{memory}}"'
                f"(ptr {args[1]}, i64 {args[2]})\n")
    if op == "ldtilecfg":
        return f'  call void asm sideeffect "ldtilecfg ($0)", "r,~{{memory}}"(ptr {args[0]})\n'
    text = {"tilerelease": "tilerelease", "tilezero": "tilezero %tmm{0}",
            "tdpbf16ps": "tdpbf16ps %tmm{2}, %tmm{1}, %tmm{0}"}[op].format(*args)
    return f'  call void asm sideeffect "{text}", ""()\n'


def scores_llvm_ir(rows: int, depth: int) -> str:
    """Three functions for a query tile's scores over blocks of `rows` keys (schedules/cpu/
    attention.py), S[t, l] = sum_d K[t, d] * Q[l, d] for 16 query lanes l and `depth` head-dim
    elements (a multiple of 32, at most 192), inline assembly (see above):

    * ``scores_func(rows, depth, "begin")(Qp)``: configure the tiles and load the tile's Q,
      Qp's 32-bit lanes (Qp[d / 2, l] holds Q[l, d] and Q[l, d + 1], rows of 64 bytes), as
      depth / 32 B tiles (tmm2, tmm3, ...) that stay for every block;
    * ``scores_func(rows, depth)(K, K row bytes, S)``: one block: K's rows (bfloat16, any row
      stride) as A tiles (tmm1, a 32-wide slice at a time), S (float32, rows of 16) the result
      (tmm0);
    * ``scores_func(rows, depth, "end")()``: release the tiles.

    Between begin and end the thread must run no other tile code."""
    chunks = depth // KSTEP
    assert depth % KSTEP == 0 and chunks <= 6, depth
    cfg = _cfg_store("i8", "1", 0)
    for t, (col, row) in enumerate([(64, rows), (64, rows)] + [(64, 16)] * chunks):
        cfg += _cfg_store("i16", str(col), 16 + 2 * t) + _cfg_store("i8", str(row), 48 + t)
    loads = "".join(f"  %qa{j} = getelementptr i8, ptr %q, i64 {1024 * j}\n"
                    + _op(True, "tileloadd64", 2 + j, f"%qa{j}", "64") for j in range(chunks))
    body = "".join(f"  %ka{j} = getelementptr i8, ptr %k, i64 {64 * j}\n"
                   + _op(True, "tileloadd64", 1, f"%ka{j}", "%ldk")
                   + _op(True, "tdpbf16ps", 0, 1, 2 + j) for j in range(chunks))
    name = scores_func(rows, depth)
    return f"""
define linkonce_odr void @{scores_func(rows, depth, "begin")}(ptr %q) {{
entry:
  %cfg = alloca [64 x i8], align 64
  call void @llvm.memset.p0.i64(ptr align 64 %cfg, i8 0, i64 64, i1 false)
{cfg}{_op(True, "ldtilecfg", "%cfg")}{loads}  ret void
}}
define linkonce_odr void @{name}(ptr %k, i64 %ldk, ptr %s) {{
entry:
{_op(True, "tilezero", 0)}{body}{_op(True, "tilestored64", 0, "%s", "64")}  ret void
}}
define linkonce_odr void @{scores_func(rows, depth, "end")}() {{
entry:
{_op(True, "tilerelease")}  ret void
}}
declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)
"""


def scores_func(rows: int, depth: int, part: str = "block") -> str:
    """The name of one of `scores_llvm_ir(rows, depth)`'s functions: "begin", "block", "end"."""
    return f"tvm_llm_amx_scores_{rows}x{depth}" + ("" if part == "block" else f"_{part}")


def _loop(asm: bool, name: str, acc: list, a_tiles: int) -> str:
    """The K loop of one variant: acc = [(dst, a, b)], A tiles tmm4(+5), B tiles tmm6, tmm7."""
    loads = "".join(f"  %{name}pa{i} = getelementptr i8, ptr %a{i}, i64 %{name}ao\n"
                    + _op(asm, "tileloadd64", 4 + i, f"%{name}pa{i}", "%lda")
                    for i in range(a_tiles))
    loads += "".join(f"  %{name}pb{i} = getelementptr i8, ptr %b{i}, i64 %{name}bo\n"
                     + _op(asm, "tileloadd64", 6 + i, f"%{name}pb{i}", "%ldb") for i in range(2))
    dots = "".join(_op(asm, "tdpbf16ps", d, a, b) for d, a, b in acc)
    zero = "".join(_op(asm, "tilezero", d) for d, _, _ in acc)
    store = "".join(_op(asm, "tilestored64", d, f"%c{d}", "%ldc") for d, _, _ in acc)
    return f"""{name}:
{zero}  br label %{name}loop
{name}loop:
  %{name}k = phi i64 [0, %{name}], [%{name}kn, %{name}loop]
  %{name}ao = shl i64 %{name}k, 6
  %{name}bo = mul i64 %{name}k, %bstep
{loads}{dots}  %{name}kn = add i64 %{name}k, 1
  %{name}more = icmp ult i64 %{name}kn, %ksteps
  br i1 %{name}more, label %{name}loop, label %{name}end
{name}end:
{store}  br label %exit
"""


def llvm_ir(asm: bool = True) -> str:
    """The micro-kernel @tvm_llm_amx_bf16_32x32(A, A row bytes, B cols 0-15, B cols 16-31,
    B row bytes, C, C row bytes, K / 32, valid rows 1..32), with AMX as inline assembly
    (asm=True) or as LLVM intrinsics (asm=False: the module's target must have +amx-tile,
    +amx-bf16, see :func:`with_amx`)."""
    # tiles: 0 C[0:16, 0:16], 1 C[0:16, 16:32], 2 C[16:32, 0:16], 3 C[16:32, 16:32],
    # 4 A[0:16, k:k+32], 5 A[16:32, k:k+32], 6 B[k-pairs, 0:16], 7 B[k-pairs, 16:32]
    cfg = _cfg_store("i8", "1", 0)
    for t, col in enumerate(["64", "64", "%cb1", "%cb1", "64", "%cb1", "64", "64"]):
        cfg += _cfg_store("i16", col, 16 + 2 * t)
    for t, row in enumerate(["%r0", "%r0", "%r1", "%r1", "%r0", "%r1", "16", "16"]):
        cfg += _cfg_store("i8", row, 48 + t)
    full = _loop(asm, "full", [(0, 4, 6), (1, 4, 7), (2, 5, 6), (3, 5, 7)], 2)
    half = _loop(asm, "half", [(0, 4, 6), (1, 4, 7)], 1)
    decls = "" if asm else """declare void @llvm.x86.ldtilecfg(ptr)
declare void @llvm.x86.tilerelease()
declare void @llvm.x86.tilezero(i8)
declare void @llvm.x86.tileloadd64(i8, ptr, i64)
declare void @llvm.x86.tilestored64(i8, ptr, i64)
declare void @llvm.x86.tdpbf16ps(i8, i8, i8)
"""
    return f"""
define linkonce_odr void @{LLVM_FUNC}(ptr %a0, i64 %lda, ptr %b0, ptr %b1, i64 %ldb, ptr %c0, i64 %ldc, i64 %ksteps, i64 %rows) #0 {{
entry:
  %cfg = alloca [64 x i8], align 64
  call void @llvm.memset.p0.i64(ptr align 64 %cfg, i8 0, i64 64, i1 false)
  %two = icmp ugt i64 %rows, 16
  %rows8 = trunc i64 %rows to i8
  %rest8 = sub i8 %rows8, 16
  %r0 = select i1 %two, i8 16, i8 %rows8
  %r1 = select i1 %two, i8 %rest8, i8 0
  %cb1 = select i1 %two, i16 64, i16 0
{cfg}{_op(asm, "ldtilecfg", "%cfg")}  %a16 = mul i64 %lda, 16
  %a1 = getelementptr i8, ptr %a0, i64 %a16
  %bstep = shl i64 %ldb, 4
  %c1 = getelementptr i8, ptr %c0, i64 64
  %c16 = mul i64 %ldc, 16
  %c2 = getelementptr i8, ptr %c0, i64 %c16
  %c3 = getelementptr i8, ptr %c2, i64 64
  br i1 %two, label %full, label %half
{full}{half}exit:
{_op(asm, "tilerelease")}  ret void
}}
declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)
{decls}attributes #0 = {{ nounwind "target-features"="+amx-tile,+amx-bf16" }}
"""


def with_amx(target: tvm.target.Target) -> tvm.target.Target:
    """target with +amx-tile,+amx-bf16 added to mattr (for the intrinsics form)."""
    cfg = dict(target.export())
    cfg["mattr"] = list(cfg.get("mattr", [])) + ["+amx-tile", "+amx-bf16"]
    return tvm.target.Target(cfg)


def amx_nest(A, Bp, C, m, asm: bool = False, row_chunk: int = 4) -> tvm.tirx.Stmt:
    """C (float32 [M, N]) = A (bfloat16 [M, K]) @ W^T for the packed weight
    Bp (bfloat16 [N/PN, K/2, PN, 2]), M = `m` symbolic: a parallel loop over (32-column blocks x
    32-row blocks), `row_chunk` row blocks inner so consecutive iterations of a thread reuse the
    weight block from cache; each iteration is one call of the AMX micro-kernel with the
    block's valid rows, min(32, M - 32 * mo). A and C may have leading unit dims (the model's
    [1, n, K]). Needs K % 32 == 0, N % 32 == 0, PN % 16 == 0, N % PN == 0.
    Built from TIR nodes, not TVMScript, so the GEMM rule can put it into a scheduled kernel
    whose buffers and M it must reuse (:mod:`.amx_prefill`)."""
    from tvm import tirx

    K, N, PN = (int(x) for x in (A.shape[-1], C.shape[-1], Bp.shape[2]))
    assert K % KSTEP == 0 and N % BLOCK == 0 and PN % 16 == 0 and N % PN == 0, (K, N, PN)
    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731
    m = tirx.Cast("int64", m) if m.ty.dtype != "int64" else m
    nb, rc = N // BLOCK, row_chunk
    mb = tirx.floordiv(m + i64(BLOCK - 1), i64(BLOCK))
    t = tirx.Var("t", "int64")
    row = tirx.floordiv(t, i64(nb * rc)) * i64(rc) + tirx.floormod(t, i64(rc))  # row block
    col = tirx.floormod(tirx.floordiv(t, i64(rc)), i64(nb)) * i64(BLOCK)  # first column

    def at(buf, *idx):
        lead = [i64(0)] * (len(buf.shape) - len(idx))
        return tirx.call_intrin("handle", "tirx.address_of", tirx.BufferLoad(buf, lead + list(idx)))

    def panel(n):
        return at(Bp, tirx.floordiv(n, i64(PN)), i64(0), tirx.floormod(n, i64(PN)), i64(0))

    call = tirx.call_extern(
        "void", LLVM_FUNC, at(A, row * i64(BLOCK), i64(0)), i64(K * 2),
        panel(col), panel(col + i64(16)), i64(PN * 4),
        at(C, row * i64(BLOCK), col), i64(N * 4), i64(K // KSTEP),
        tirx.min(i64(BLOCK), m - row * i64(BLOCK)))
    body = tirx.IfThenElse(row < mb, tirx.Evaluate(call), None)
    loop = tirx.For(t, i64(0), tirx.floordiv(mb + i64(rc - 1), i64(rc)) * i64(nb * rc),
                    tirx.ForKind.PARALLEL, body)
    return tirx.AttrStmt(tirx.IntImm("int32", 0), "pragma_import_llvm",
                         tvm.ir.StringImm(llvm_ir(asm)), loop)


def amx_bf16_matmul_func(K: int, N: int, PN: int = 32, asm: bool = False,
                         row_chunk: int = 4) -> tvm.tirx.PrimFunc:
    """The AMX product alone as a kernel (tests, bench): A [M, K] bfloat16, Bp, C [M, N]."""
    from tvm import tirx

    m = tirx.Var("m", "int64")
    A = tirx.decl_buffer((m, K), "bfloat16", "A")
    Bp = tirx.decl_buffer((N // PN, K // 2, PN, 2), "bfloat16", "Bp")
    C = tirx.decl_buffer((m, N), "float32", "C")
    body = amx_nest(A, Bp, C, m, asm, row_chunk)
    return tirx.PrimFunc([A, Bp, C], body).with_attr(
        {"global_symbol": "amx_bf16_matmul", "tirx.noalias": True})


def pack_weight(w, PN: int = 32):
    """numpy: W (bfloat16 [N, K]) -> Bp [N/PN, K/2, PN, 2] (what the GEMM rule's prepack makes)."""
    N, K = w.shape
    return w.reshape(N // PN, PN, K // 2, 2).transpose(0, 2, 1, 3).copy()
