"""AMX prefill: a bfloat16 weight matmul of symbolic M (prefill) on AMX tiles (:mod:`.amx_bf16`),
where the target CPU has AMX-BF16 (Sapphire Rapids and later Xeons).

The GEMM rule hands such a kernel here instead of scheduling its vdpbf16ps outer product:
* the weight is packed exactly as for the decode kernel (``Bp[N/PN, K/2, PN, 2]``, vdpbf16ps's
  pair layout, which is AMX's B-tile layout too), so prefill and decode read one packed weight
  that the build makes once;
* the product is not a scheduled TIR block: once the packing and the epilogue are scheduled,
  the matmul's loop nest is replaced by the AMX nest (a parallel loop of 32 x 32 blocks of C,
  each one micro-kernel call over the whole K with the block's valid row count);
* with an epilogue (residual add, bias, SiLU...), C is a float32 workspace and the epilogue
  runs after the product as its own vectorized, parallel loop: AMX accumulates in tile
  registers, where no epilogue can run.
Measured (scripts/bench_amx_gemm.py, Xeon with AMX shown as rocketlake, 1 thread): the product
650-940 GFLOP/s against ~100 for the vdpbf16ps outer product on llama-110m/1b shapes.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.target import Target

from . import amx_bf16, common


def usable(target: Target, pat: common.MatmulPattern, pn: int, sch: s_tir.Schedule) -> bool:
    """Whether the kernel takes the AMX path: AMX-BF16 in the target, bfloat16 A and B with a
    float32 C, a prefill (symbolic M, not a decode step), 16-column-aligned panels, N and K
    multiples of 32, and A a plain kernel parameter (no prologue computes it in the kernel)."""
    if not amx_bf16.target_has_amx(target):
        return False
    if pat.input_dtype != "bfloat16" or pat.dtype != "float32" or not pat.b_transposed:
        return False
    if pat.decode_like or pat.m_static is not None:
        return False
    if pn % 16 or pat.N % pn or pat.N % amx_bf16.BLOCK or pat.K % amx_bf16.KSTEP:
        return False
    a = sch.get(sch.get_sblock(pat.block_name)).reads[pat.a_index].source
    return common.param_index(sch.mod["main"], a) >= 0 and common.const_int(a.shape[-1]) == pat.K


def schedule(sch: s_tir.Schedule, pat: common.MatmulPattern, target: Target, pn: int,
             pack_weight) -> s_tir.Schedule:
    """`pack_weight(sch, main)`: the GEMM rule's packing of the weight (shared with decode)."""
    main = sch.get_sblock(pat.block_name)
    pack_weight(sch, main)
    lanes = common.vector_lanes(target)
    if pat.epilogue:
        sch.set_scope(main, 0, "global")  # C: a float32 workspace the epilogue reads
    for name in pat.epilogue:
        epi = sch.get_sblock(name)
        loops = sch.get_loops(epi)
        if len(loops) >= 2:
            sch.parallel(sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0])
        common.vectorize_innermost(sch, epi, lanes)
    blk = sch.get(main)
    a_buf, bp_buf = blk.reads[pat.a_index].source, blk.reads[pat.b_index].source
    c_buf = blk.writes[0].source
    outer = sch.get(sch.get_loops(main)[0])
    m = 1
    for e in pat.m_extents:
        m = m * e
    nest = s_tir.SBlockRealize([], True, s_tir.SBlock(
        [], [_whole(a_buf), _whole(bp_buf)], [_whole(c_buf)], "amx_matmul",
        amx_bf16.amx_nest(a_buf, bp_buf, c_buf, m)))
    func = sch.mod["main"]
    root = func.body.block
    seq = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    hits = [i for i, st in enumerate(seq) if st.same_as(outer)]
    if len(hits) != 1:
        raise ValueError("the matmul's loop nest is not a child of the root block")
    seq[hits[0]] = nest
    new_root = s_tir.SBlock([], [], [], root.name_hint, tirx.SeqStmt(seq), None,
                            root.alloc_buffers, root.match_buffers, root.annotations)
    return s_tir.Schedule(tvm.IRModule({"main": func.with_body(
        s_tir.SBlockRealize([], True, new_root))}))


def _whole(buf):
    return tirx.BufferRegion(buf, [tvm.ir.Range.from_min_extent(tirx.IntImm("int64", 0), s)
                                   for s in buf.shape])
