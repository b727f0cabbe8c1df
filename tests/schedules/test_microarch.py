"""The register-tile table of schedules/cpu/microarch.py is honoured per -mcpu: the same packed
GEMM compiled for two CPU models differs in its assembly as the table says."""
from __future__ import annotations

import re

import pytest
import tvm
from tvm import relax

import cpu_workloads as workloads
from schedules.cpu import common, cpu_schedule_pass, microarch
from schedules.cpu.pipeline import cpu_tir_pipeline


def _target(cpu):
    return tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": cpu,
                              "num-cores": 2})


def packed_gemm_asm(cpu, K=256, N=1536, mode="prefill"):
    """Assembly of one prefill (or decode) linear over build-time packed weight panels (N
    divides by 48 and 32, so every tile of the table fits without a padded panel), compiled
    with the build's CPU pipeline (tiles over 1 KiB stay in registers)."""
    mod = workloads.linear_suite([dict(name="p", K=K, N=N, mode=mode, epilogue=None)])
    mod = relax.transform.AttachAttrLayoutFreeBuffers()(mod)
    target = _target(cpu)
    with target:
        mod = cpu_schedule_pass()(mod)
    mod = relax.transform.SplitLayoutRewritePreproc()(mod)
    ex = tvm.compile(mod, target=target, tir_pipeline=cpu_tir_pipeline())
    return ex.mod.imports[0].inspect_source("asm")


def main_loop(asm):
    """The basic block of `asm` with the most FMAs: the micro-kernel's k loop over full row
    tiles (the partial tile's loop also broadcasts rows that it guards)."""
    blocks = re.split(r"\n\.LBB\w+:", asm)
    return max(blocks, key=lambda b: len(re.findall(r"\bvfmadd\w*ps", b)))


def fma_stats(asm):
    fmas = re.findall(r"\bvfmadd\w*ps\s+([^\n]*)", asm)
    return (len(fmas), sum("zmm" in f for f in fmas), sum("ymm" in f for f in fmas),
            len(re.findall(r"\bvbroadcastss\b", asm)))


def test_rows_by_cpu_model():
    assert microarch.tile_row(_target("znver4")).name == "zen4"
    assert microarch.tile_row(_target("znver5")).name == "zen5"
    for cpu in ("sapphirerapids", "icelake-server", "skylake-avx512"):
        assert microarch.tile_row(_target(cpu)).name == "intel-avx512-2fma"
    for cpu in ("haswell", "znver3"):
        assert microarch.tile_row(_target(cpu)).name == "avx2"
    arm = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]})
    assert microarch.tile_row(arm).name == "neon"
    assert microarch.tile_row(_target("znver4")).measured
    assert microarch.tile_row(_target("znver5")).measured
    assert microarch.tile_row(_target("sapphirerapids")).measured
    assert microarch.tile_row(_target("znver3")).measured  # the avx2 row, measured on znver3
    assert not microarch.tile_row(arm).measured


def test_host_features_override_a_masked_cpu_name():
    """A VM that shows an AMX Xeon as a Rocket Lake model: the host target gains the features
    its flags list (bf16 dot products, AMX) and the Intel server row; a feature the name implies
    but the flags hide is switched off."""
    from tvm_llm.targets.llvm import host_feature_attrs

    rkl = set("avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512cd avx512vbmi avx512_vbmi2 "
              "avx512ifma avx512_bitalg avx512_vpopcntdq avx512_vnni".split())
    assert host_feature_attrs("rocketlake", rkl) == []
    attrs = host_feature_attrs("rocketlake", rkl | {"avx512_bf16", "amx_tile", "amx_bf16"})
    assert attrs == ["+avx512bf16", "+amx-tile", "+amx-bf16"]
    assert host_feature_attrs("sapphirerapids", rkl - {"avx512_vnni"})[0] == "-avx512vnni"
    assert host_feature_attrs("znver4", set()) == []  # unreadable flags: the name is trusted
    masked = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu",
                                "mcpu": "rocketlake", "mattr": attrs})
    assert microarch.tile_row(masked).name == "intel-avx512-2fma"
    assert microarch.tile_row(_target("rocketlake")).name == "avx512-other"


@pytest.mark.parametrize("cpu,row", [("znver4", "zen4"), ("znver5", "zen5"),
                                     ("sapphirerapids", "intel-avx512-2fma"), ("haswell", "avx2")])
def test_assembly_follows_the_table(cpu, row):
    """Per k step the micro-kernel broadcasts Mr scalars of A and issues Mr*Nv FMAs, so FMAs
    per broadcast = Nv of the row's first float32 tile: znver4 4x3 (3), znver5 7x2 (2),
    sapphirerapids 8x3 (3; 24 accumulators, 1.5 KiB), haswell 4x3 (3, on ymm: AVX2 has no
    zmm)."""
    table = microarch.tile_row(_target(cpu))
    assert table.name == row
    mr, nv = (table.gemm_float32 or table.gemm)[0]
    fmas, zmm, ymm, bcasts = fma_stats(main_loop(packed_gemm_asm(cpu)))
    assert fmas > 0 and bcasts > 0
    assert fmas == nv * bcasts, (cpu, fmas, bcasts)
    if row == "avx2":
        assert zmm == 0 and ymm == fmas
    else:
        assert zmm == fmas
    assert (mr, nv) == {"zen4": (4, 3), "zen5": (7, 2), "intel-avx512-2fma": (8, 3),
                        "avx2": (4, 3)}[row]


@pytest.mark.parametrize("cpu,streams", [("znver4", 1), ("znver5", 4), ("sapphirerapids", 4),
                                         ("znver3", 4)])
def test_decode_walks_the_rows_panels_at_once(cpu, streams):
    """A decode row (batch 1) against the packed weight runs `gemm_decode_streams` panels side
    by side: per broadcast of x[k], Nv FMAs on each of that many panels, which lie one panel
    (K x PN floats) apart in memory. 4 panels gave 1.5-1.6x the single-panel stream's
    bandwidth on emeraldrapids, 1.4-2.0x on znver3 (AVX2: the avx2 row) and 1.02-1.2x on
    znver5 (scripts/bench_kernels.py --decode-streams 1,2,4,8)."""
    table = microarch.tile_row(_target(cpu))
    assert table.gemm_decode_streams == streams
    nv = (table.gemm_float32 or table.gemm)[0][1]
    lanes = common.vector_lanes(_target(cpu))  # floats per vector: 8 on AVX2, 16 on AVX-512
    asm = packed_gemm_asm(cpu, mode="decode")
    fmas, zmm, ymm, bcasts = fma_stats(asm)
    assert fmas > 0 and bcasts > 0 and (ymm if lanes == 8 else zmm) == fmas
    if streams == 1:
        assert fmas == nv * bcasts, (fmas, bcasts)
    else:
        assert fmas == streams * nv * bcasts, (fmas, bcasts)
        panel = 256 * nv * lanes * 4  # K x PN floats
        offsets = {int(o) for o in re.findall(r"\bvfmadd\w*ps\s+(-?\d+)\(", asm)}
        spans = {(b - a) // panel for a in offsets for b in offsets if b - a >= panel}
        assert set(range(1, streams)) <= spans, sorted(offsets)


def test_bfloat16_keeps_the_rows_32_wide_panels():
    """The float32 tiles come first only for float32 inputs and where their panel divides N:
    bfloat16 weights keep the row's `gemm` tiles, whose 32-wide panels their vdpbf16ps and
    AMX kernels read."""
    from schedules.cpu.gemm import gemm_tile

    spr = _target("sapphirerapids")
    assert gemm_tile(spr, 768, 768) == (8, 3)
    assert gemm_tile(spr, 1280, 768) == (6, 4)  # 48 does not divide 1280: no padded panel
    assert gemm_tile(spr, 1312, 768) == (7, 2)  # nor 64 (32 does)
    assert gemm_tile(spr, 768, 768, "float32", "bfloat16") == (7, 2)
    assert gemm_tile(_target("znver4"), 768, 768) == (4, 3)


@pytest.mark.parametrize("cpu", ["sapphirerapids", "znver4"])
def test_gemm_prefetch_follows_the_cpu_row(cpu):
    """Where the row asks for it (Intel: 2 KiB ahead) the prefill micro-kernel prefetches into
    L1 (prefetcht0) each panel line it loads, one per 64-byte vector of the tile, the row's
    distance further on; elsewhere it leaves the panel to the hardware prefetchers."""
    row = microarch.tile_row(_target(cpu))
    asm = packed_gemm_asm(cpu)
    hints = [(int(o or 0), r) for o, r in re.findall(r"\bprefetcht0\s+(-?\d*)\((%r\w+)\)", asm)]
    if not row.gemm_prefetch_bytes:
        assert "prefetch" not in asm
        return
    loads = {(int(o or 0), r)
             for o, r in re.findall(r"\bvmov[au]ps\s+(-?\d*)\((%r\w+)\), %zmm", asm)}
    nv = row.gemm_float32[0][1]
    # one per panel vector of the 8x3 tile in the full tiles' k loop
    assert len(re.findall(r"\bprefetcht0\b", main_loop(asm))) == nv, main_loop(asm)
    # LLVM may address them from a pointer of their own; where it shares the load's, the
    # prefetch is the row's distance ahead of a load (the partial tile's loop)
    ahead = [(o, r) for o, r in hints if (o - row.gemm_prefetch_bytes, r) in loads]
    assert len(ahead) >= nv, (hints, sorted(loads))


@pytest.mark.parametrize("cpu", ["sapphirerapids", "znver4"])
def test_gemm_next_panel_prefetch_and_k_blocks_follow_the_cpu_row(cpu):
    """Where the row sets gemm_next_panel_bytes (Intel) the prefill micro-kernel's k loop also
    prefetches into L2 (prefetcht1) one line of the next packed panel; a panel over the row's
    gemm_k_block_bytes (llama-1b's down projection: K=5632, 1.4 MiB) runs in k blocks whose
    slices are small enough for that prefetch too. A row that sets neither (znver4) keeps the
    whole K and leaves the panel to the hardware."""
    from types import SimpleNamespace

    from schedules.cpu.gemm import k_blocks

    def blocks_of(K):  # k blocks of a K x 64-float panel (6x4 tiles)
        return k_blocks(_target(cpu), SimpleNamespace(K=K), 64)

    row = microarch.tile_row(_target(cpu))
    blocks = blocks_of(5632)
    small = main_loop(packed_gemm_asm(cpu, K=256, N=1536))
    large = main_loop(packed_gemm_asm(cpu, K=5632, N=2048))
    if not row.gemm_next_panel_bytes:
        assert blocks == 1 and not row.gemm_k_block_bytes
        assert not re.findall(r"\bprefetcht1\b", small + large)
        return
    assert blocks == 4 and 5632 // 4 * 64 * 4 <= row.gemm_k_block_bytes  # 352 KiB slices
    assert blocks_of(4099) == 1  # a prime K: whole K
    assert blocks_of(11008) == 8  # a 7B down projection: 1376
    assert 256 * 48 * 4 <= row.gemm_next_panel_bytes
    for loop in (small, large):
        assert len(re.findall(r"\bprefetcht1\b", loop)) == 1, loop
    assert len(re.findall(r"\bprefetcht0\b", small)) == row.gemm_float32[0][1]


@pytest.mark.parametrize("rows, K", [(4, 2048), (3, 768), (4, 1408), (4, 770)])
def test_next_panel_prefetch_covers_the_panel_at_any_row_count(rows, K):
    """The lines that a call's row tiles prefetch of the next panel (pipeline.next_panel_line,
    R = `rows` lines per k step) cover it whole wherever the call has R row tiles or more: a
    64-token prefill's 11 tiles of 6x4 as well as a 128-token one's 22 (with a fixed spread
    of 4, 11 tiles had covered only 11/16 of it), and never name a line past it."""
    import numpy as np
    from tvm import te

    from schedules.cpu import pipeline

    n = tvm.tirx.Var("n", "int64")
    lines = te.compute((n, K), lambda mo, k: pipeline.next_panel_line(mo, k, n, rows, K),
                       name="lines")
    f = tvm.compile(te.create_prim_func([lines]), target="llvm")
    for tiles in sorted({1, rows - 1, rows, 2 * rows - 1, 2 * rows, 11, 22, 4 * rows + 3} - {0}):
        out = tvm.runtime.tensor(np.zeros((tiles, K), "int64"))
        f(out)
        got = out.numpy()
        assert got.min() >= 0 and got.max() < rows * K
        if tiles >= rows:
            assert np.unique(got).size == rows * K, (tiles, rows * K - np.unique(got).size)
