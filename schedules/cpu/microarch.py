"""Register tiles per CPU microarchitecture, chosen from the target's ``-mcpu``.

Two CPUs with the same ISA want different matmul tiles: AMD znver4 runs AVX-512 on two 256-bit
pipes (one 512-bit FMA per cycle), AMD znver5 (EPYC Turin) and Intel server parts since
skylake-avx512 have two 512-bit FMA ports (two per cycle, from L1 and L2 that must then feed
twice the bytes). The rules (:mod:`.gemm`, :mod:`.gemv`) read their tile candidates from the
row of this table that matches the target's CPU; the tuner (tvm_llm/tune/rule_grid.py) measures
every candidate of the row on the machine and records the winner in the tuning log, so a row
that is only reasoned is corrected by measurement wherever such a CPU is at hand.

Rows and where their figures come from:

=================  ==========================================================  ============
row                CPUs (LLVM names)                                           source
=================  ==========================================================  ============
zen4               znver4                                                      measured
zen5               znver5                                                      measured
intel-avx512-2fma  sapphirerapids, emeraldrapids, graniterapids, icelake-server,  measured
                   cascadelake, cooperlake, skylake-avx512; any CPU with AMX   (emeraldrapids)
                   (a VM may mask a Xeon's model: LLVM then names it rocketlake)
avx2               haswell, broadwell, skylake, alderlake, znver1-3, ...       measured
                                                                               (znver3)
neon               aarch64 (generic, neoverse-*, apple-*)                      reasoned
=================  ==========================================================  ============

* zen4, measured here (AMD EPYC znver4, 1 thread, scripts/bench_kernels.py, llama-110m/1b
  shapes, n=128): packed GEMM 4x3 and 7x2 at 106-111 GFLOP/s (~95% of one 512-bit FMA per
  cycle); row-major GEMV-rule prefill 3x4 80 GF/s, 2x6 74, 1x8 45; decode 1x8 at torch.sum's
  bandwidth, 2x6 15% slower. The int8-activation decode prefetches every line of a group into
  L1 for q4_0 / q4_1 (llama-110m builds, 2 threads, scripts/ab_decode.py, both load orders:
  q4_1 0.86x the step time, q4_0 0.88-0.97x; q8_0 1.02x, so 8-bit keeps the first line). k-quants
  had taken it too (q4_k 0.85-0.90x) until they moved to one group a statement (stop 51); since
  then the first line into L2 steps llama-1b q4 in 0.871 / 0.951x the time of every line into L1
  (stop 52, int8_decode_prefetch_kquant; see int8_act_matmul.py). Float32 decode keeps one
  panel at a time: 4 or 2 panels side by side (gemm_decode_streams) stepped a llama-110m build
  in 1.02-1.06x the time, and prefetching the panel 2 KiB ahead into L1 1.03x, 8 KiB
  0.98-1.00x (scripts/ab_decode.py, 2 threads, 20 rounds, both load orders; stop 43).
* zen5, measured on an AMD EPYC Turin (znver5, a 2-core VM; two 512-bit FMA pipes), same script
  and shapes, 1 thread, CPU time: packed GEMM 7x2 256-268 GF/s (2.2x numpy's sgemm of the run,
  ~2 FMAs per cycle), 4x3 and 3x4 alike except on the long-K down projection (K=5632: 7x2 256,
  4x3 221, 3x4 176), 15x1/14x1 145-225. Decode at 2 threads (--decode-streams 1,2,4,8): 4
  panels side by side streamed 47-53 GB/s where one streamed 45-49 (1b down 52 against 43), 8
  no better; a whole llama-110m decode step took 0.93-0.96x the time of the zen4 row's in
  float32 and 0.92-0.93x in bfloat16 (scripts/ab_decode.py, both load orders). The
  int8-activation decode prefetches every line of a group here, not the first (llama-110m
  builds, 2 threads, scripts/ab_decode.py, both load orders: q4_k with 16-bit activations
  0.61-0.64x the step time, q4_0 0.83-0.93x, q8_0 0.83-0.97x, the q4 / q8 defaults 0.95-0.98x /
  0.94-0.95x), and into L1 rather than L2 (a further 0.87-0.94x for q4_k and q8_0, 0.97-0.98x
  for llama-1b q4).
* intel-avx512-2fma, measured on an Intel Xeon (emeraldrapids, a 2-core VM whose neighbours
  moved its sgemm peak between 150 and 290 GFLOP/s and its read bandwidth between 9 and 25 GB/s
  within minutes; only figures of one interleaved run compare). Prefill, 1 thread, CPU time,
  llama-110m/1b linears at n=128 (scripts/bench_kernels.py --gemm-tiles): 7x2 114-144 GF/s,
  4x3 and 3x4 within the same noise, 14x1 57-88; every tile of 1 KiB or more (6x4, 8x3, 12x2,
  5x4, 4x4) 46-58 GF/s (a workspace tile, see gemm.py). A k-blocked variant (each 256-k slice of
  the panel reused from L1 by all row tiles) measured no better than the whole-K kernel there;
  blocks sized for L2 did later (below). Decode
  is where the CPUs differ: one packed panel at a time streamed 7-11 GB/s at 1 thread and 14-15
  at 2, where 4 panels walked side by side (gemm_decode_streams, 8 accumulators, 4 sequential
  streams in flight) streamed 12-15 and 22-25 GB/s, as fast as or faster than the row-major
  GEMV and torch (scripts/bench_kernels.py --decode-streams 1,2,4,8: 2 and 4 alike, 8 slower);
  a whole llama-110m decode step 1.57x faster in float32 and 1.39x in bfloat16. Tiles over
  1 KiB, kept in registers since the build's TIR pipeline keeps them on the stack (pipeline.py),
  measured on an Intel Xeon (model 167 shown as rocketlake, AMX; a 2-core VM, true FMA peak
  ~200 GF/s a core by a C loop of 14 independent FMAs), 1 thread, n=128 (scripts/
  bench_kernels.py --cpu-time --gemm-tiles 7x2,6x4,8x3,7x3,5x4): 8x3 the fastest on every
  llama-110m/1b linear, 1.04-1.10x 7x2 (110m 127-136 GF/s); 6x4 1.02-1.07x on the 110m ones
  but 0.88-0.95x 7x2 on llama-1b's 2048 x 11264 gate_up (repeated runs), so only 8x3 is taken,
  and only where 48 divides N (a padded panel makes decode walk one panel at a time); float32
  only (bfloat16's vdpbf16ps and AMX kernels read 32-wide panels). Whole llama-110m float32
  build, 2 threads: prefill 0.969x the time of 7x2's (21 interleaved prefills of 128 tokens),
  decode 0.996x (scripts/ab_decode.py); with 6x4 for the other widths prefill was 0.943x.
  The int8-activation decode prefetches every line of a group into L1 here too, for 8-bit and
  4-bit weights (same Xeon, 2 threads, scripts/ab_decode.py, both load orders, against the
  first line: the q4 default 0.81-0.82x the step time on llama-110m and 0.93-0.95x on llama-1b,
  q8 0.84-0.90x and 0.93-0.96x; 1 thread llama-110m q4 0.93x). For 4-bit weights every line
  into L2 (prefetcht1) then beat L1 on llama-1b: the q4 default 0.936 / 0.939x the step time of
  every-line-l1 (12 rounds each load order; 16 and 32 KiB ahead 0.93-0.94x, 4 KiB into L1
  1.00x), on llama-110m 1.00x (30 rounds x 16 steps); q8 on llama-1b 0.995x, so 8-bit keeps
  L1. Prefill's float32 micro-kernel prefetches its panel into L1 (prefetcht0, one per line
  the tile loads) 2 KiB ahead (gemm_prefetch_bytes; same Xeon, 2 threads, n=128 linears,
  interleaved: llama-110m +2-11%, llama-1b +6-16%, 1-4 KiB alike, 0.5 KiB less; whole builds,
  scripts/ab_decode.py --prefill: llama-110m 128 tokens 0.937 / 0.949x the time, both load
  orders, llama-1b 64 tokens 0.893x); where 48 does not divide N, 6x4 before 7x2 (kernels
  +5-10% on llama-110m qkv / gate_up and llama-1b qkv / o / gate_up; builds: 110m prefill 0.962x,
  1b 0.963x, decode 0.995x both). The row tiles of a panel prefetch the next panel into L2 as
  they go (gemm_next_panel_bytes, panels up to 512 KiB: two of them and the activations fit a
  2 MiB L2; model 167 with a 480 MiB L3, stop 46, scripts/ab_prefill_kernels.py: llama-1b
  64-row kernels, cold, qkv / gate_up 230 / 236-240 -> 296 / 284 GFLOP/s; the down
  projection's 1.4 MiB 6x4 panels, or 720 KiB 7x2 ones, gained nothing; whole builds 0.94x
  the prefill time on llama-1b and llama-110m).
  That down projection (K=5632: a 1.4 MiB panel and, at 64 rows, 1.4 MiB of activations, both
  reread per row tile through a 2 MiB L2) runs in k blocks of at most 384 KiB of panel
  (gemm_k_block_bytes; 4 blocks of 1408): 64 rows cold 232-239 -> 276-288 GFLOP/s, 128 rows
  274 -> 330-342 (8 or 11 blocks alike); a whole llama-1b 64-token prefill 0.934x the time.
  Two tiles walked side by side per decode thread (two
  weight streams a core) ran 1.06-1.16x faster in scripts/bench_int8_kernel.py --cold but
  stepped llama-1b q4 builds 1.03-1.04x slower, so one tile stays. The reasoning the row
  started from: with two FMAs per cycle a 4x3 packed
  tile streams 3 panel vectors (192 B) from L2 every 6 cycles, 32 B/cycle, about what those
  L2s sustain; 7x2 needs 128 B per 7 cycles (18 B/cycle), so it comes first. For the row-major
  prefill the 4x3 dot-product tile (4 x rows against 3 weight rows: 7 loads per 12 FMAs,
  as 3x4) keeps more rows of x per loaded weight vector, and the x rows, not the weight, are
  the L2 stream there. Decode is bandwidth-bound as everywhere: 1x8.
* avx2 (16 ymm registers), measured on an AMD EPYC znver3 (Milan, a 2-core VM; two 256-bit
  FMA pipes). Prefill, 1 thread, CPU time, llama-110m/1b linears at n=128 (scripts/
  bench_kernels.py --threads 1 --cpu-time --gemm-tiles ...): 4x3 (12 accumulators + 3 panel
  + 1 broadcast register) 90-97 GF/s, at or above numpy's sgemm peak of the run (95); 6x2
  85-88, 4x2 86-92, 5x2 84-88, 8x1 64-83, 12x1 32-75, 3x4 54-65. Decode: one packed panel at
  a time streamed 17-25 GB/s at 2 threads, 4 panels side by side (gemm_decode_streams) 31-49,
  2 panels 30-44 (--decode-streams 1,2,4); a whole llama-110m float32 decode step took 0.59x
  the time (scripts/ab_decode.py, 12 rounds). Row-major GEMV prefill stays reasoned: 3x4.
* neon (32 q registers of 4 floats), reasoned: 6x4 / 8x3 packed.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from . import common


@dataclass(frozen=True)
class TileRow:
    """Tile candidates of one microarchitecture family, best first."""

    name: str
    cpus: tuple  # LLVM CPU names (exact) or prefixes ending in "*"
    isa: str
    gemm: tuple  # (Mr, Nv): rows of A x SIMD vectors of C, packed-panel GEMM
    gemv_prefill: tuple  # (Mr, Nr): rows of x x rows of W, row-major dot products
    gemv_decode: tuple  # (1, Nr)
    measured: bool
    gemm_decode_streams: int = 1  # packed panels one decode row walks at once (gemm.py)
    # float32 GEMM tiles tried before `gemm` (which bfloat16/float16 weights keep: their
    # vdpbf16ps and AMX kernels read 32-wide panels): tiles over 1 KiB, which only the
    # build's TIR pipeline keeps in registers (pipeline.py)
    gemm_float32: tuple = ()
    # the int8-activation decode's prefetch with VNNI: each group's "first-line" or
    # "every-line" into L2, or "every-line-l1" (int8_act_matmul.py DECODE_PREFETCH; without
    # VNNI always every line); for 4-bit weights int8_decode_prefetch_4bit where set
    int8_decode_prefetch: str = "first-line"
    int8_decode_prefetch_4bit: str | None = None
    # k-quant weights' (q3_k ... q6_k) decode prefetch where set, before the 4-bit choice: their
    # decode statements differ from q4_0 / q4_1's (block_sum, int8_decode_burst_lines)
    int8_decode_prefetch_kquant: str | None = None
    # k-quant decode's prefetched lines per statement (int8_act_matmul.py block_sum); None: the
    # kernel's DECODE_BURST_LINES
    int8_decode_burst_lines: int | None = None
    # the float32 GEMM micro-kernel's software prefetch of its panel, bytes ahead (0: none;
    # pipeline.row_tile_loops)
    gemm_prefetch_bytes: int = 0
    # the largest packed panel (bytes) whose successor the float32 GEMM's row tiles prefetch
    # into L2 while they compute (0: none; pipeline._next_panel_prefetched): the two panels
    # must fit the core's L2 beside the activations
    gemm_next_panel_bytes: int = 0
    # a float32 prefill GEMM whose packed panel is larger runs in k blocks whose panel slices
    # are at most this many bytes (0: whole K always; gemm._schedule_k_blocked)
    gemm_k_block_bytes: int = 0

    def int8_prefetch(self, weight_bits: int, kquant: bool = False) -> str:
        """The int8-activation decode's prefetch for weights of `weight_bits` (3-6: the
        4-bit choice, for codes of 3-6 bits in fields of chunks; 8); k-quants take
        int8_decode_prefetch_kquant where the row sets it."""
        if kquant and self.int8_decode_prefetch_kquant:
            return self.int8_decode_prefetch_kquant
        if weight_bits < 8 and self.int8_decode_prefetch_4bit:
            return self.int8_decode_prefetch_4bit
        return self.int8_decode_prefetch


_DECODE = ((1, 8), (1, 4), (1, 2), (1, 1))

ROWS = (
    TileRow("zen4", ("znver4",), "avx512",
            gemm=((4, 3), (7, 2), (3, 4), (15, 1)),
            gemv_prefill=((3, 4), (2, 4), (3, 2), (1, 4), (1, 2), (1, 1)),
            gemv_decode=_DECODE, measured=True, int8_decode_prefetch_4bit="every-line-l1",
            int8_decode_prefetch_kquant="first-line", int8_decode_burst_lines=4),
    TileRow("zen5", ("znver5",), "avx512",
            gemm=((7, 2), (4, 3), (3, 4), (15, 1)),
            gemv_prefill=((3, 4), (2, 4), (3, 2), (1, 4), (1, 2), (1, 1)),
            gemv_decode=_DECODE, measured=True, gemm_decode_streams=4,
            int8_decode_prefetch="every-line-l1"),
    TileRow("intel-avx512-2fma",
            ("sapphirerapids", "emeraldrapids", "graniterapids*", "icelake-server",
             "cascadelake", "cooperlake", "skylake-avx512", "diamondrapids"), "avx512",
            gemm=((7, 2), (4, 3), (14, 1), (3, 4)),
            gemv_prefill=((4, 3), (3, 4), (2, 4), (3, 2), (1, 4), (1, 2), (1, 1)),
            gemv_decode=_DECODE, measured=True, gemm_decode_streams=4,
            gemm_float32=((8, 3), (6, 4)), int8_decode_prefetch="every-line-l1",
            int8_decode_prefetch_4bit="every-line", gemm_prefetch_bytes=2048,
            gemm_next_panel_bytes=512 << 10, gemm_k_block_bytes=384 << 10),
    TileRow("avx512-other", ("*",), "avx512",  # client AVX-512 parts, unknown names
            gemm=((4, 3), (7, 2), (3, 4), (15, 1)),
            gemv_prefill=((3, 4), (2, 4), (3, 2), (1, 4), (1, 2), (1, 1)),
            gemv_decode=_DECODE, measured=False),
    TileRow("avx2", ("*",), "avx2",
            gemm=((4, 3), (6, 2), (4, 2), (5, 2), (12, 1)),
            gemv_prefill=((3, 4), (2, 4), (3, 2), (1, 4), (1, 2), (1, 1)),
            gemv_decode=_DECODE, measured=True, gemm_decode_streams=4),
    TileRow("neon", ("*",), "neon",
            gemm=((6, 4), (8, 3), (12, 2)),
            gemv_prefill=((3, 4), (2, 4), (3, 2), (1, 4), (1, 2), (1, 1)),
            gemv_decode=_DECODE, measured=False),
    TileRow("sse", ("*",), "*",
            gemm=((4, 2), (8, 1)),
            gemv_prefill=((3, 4), (2, 4), (3, 2), (1, 4), (1, 2), (1, 1)),
            gemv_decode=_DECODE, measured=False),
)


def cpu_name(target: Target) -> str:
    """The target's LLVM CPU name (``-mcpu``), "generic" when it names none."""
    return str(target.attrs.get("mcpu", "") or "") or "generic"


def _matches(pattern: str, cpu: str) -> bool:
    return cpu.startswith(pattern[:-1]) if pattern.endswith("*") else cpu == pattern


def tile_row(target: Target) -> TileRow:
    """The table row for the target: its CPU name within its ISA, else the ISA's default."""
    isa, cpu = common.vector_isa(target), cpu_name(target)
    if isa == "avx512" and common.has_feature("amx-tile", target):
        cpu = "sapphirerapids"  # only Xeons have AMX, whatever model number a VM shows
    for row in ROWS:
        if row.isa in (isa, "*") and any(_matches(p, cpu) for p in row.cpus):
            return row
    return ROWS[-1]
