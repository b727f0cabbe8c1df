"""Int8-activation matmul for x86 (AVX-512 VNNI, AVX-512BW, AVX2), every weight format (q8_0,
q4_0, q4_1, q3_k, q4_k, q5_k, q6_k).

A hand-scheduled kernel (not a rule): its loop nest is the schedule. The QuantizeLinear pass
emits it for `--activations int8` / `int16` on x86 CPUs with AVX2 or AVX-512 (VNNI where
present, see "Without VNNI"); TVM's rules skip it (marked scheduled).

Activations: each row of x is quantized at run time with one scale per 32 consecutive input
features (quantization/formats.py quantize_activation: s = max|x| / 127, q = round(x * 127 /
max|x|)); per block the sum of its int8 values is kept for the weights' offset / minimum term.
At batch 1 this runs on the calling thread before the one parallel region of the call (a row is
~K/32 blocks of a few vector instructions: cheaper than a second thread-pool launch); from 8
rows on, rows are quantized in parallel.

16-bit activations (act_bits 16, `--activations int16`, the default of exact format names on
VNNI CPUs): q = round(x * 32512 / max|x|) per block (s = max|x| / 32512, 127 * 256 levels, an
error <= 2^-16 of the block's max |x|, ~250x under int8's), held as two int8 halves, hi =
round(q / 256) in [-127, 127] (an arithmetic shift) and lo = q - 256 hi in [-128, 127]. Each
group runs the 8 vpdpbusd twice over the same unpacked tiles, one chain per half, joined as
(hi chain << 8) + lo chain, exact in int32; everything after (scales, offsets, the block sums
in xo) is the 8-bit path's with this s. So a weight format keeps float activations' accuracy
(on a real model: their perplexity) with integer dot products: no per-weight float convert,
and the "vnni" layout's bytes (q4_k 4.5 bits per weight, not the weight-only layout's 6.0).
Decode costs about what int8's does where memory bounds it; prefill and batched rows pay
the doubled dot products.

Weight layout (packed at build time by quantization/scheme.pack_vnni from the numpy
reference's stored arrays), per 16 output rows (a tile) and group g of 32 inputs:
    4-bit  wp[N/16, K/32, 4, 64] uint8: chunk c holds two VNNI tiles, low nibbles = tile 2c,
           high nibbles = tile 2c+1; tile t byte i*4+k = row i, input 32g + 4t + k, unsigned
           (q4_0 stores q + 8, q4_1 / q4_k their q in [0, 15])
    8-bit  wp[N/16, K/32, 8, 64] uint8: tile t byte i*4+k, q + 128 (q8_0)
    3, 5, 6-bit (q3_k, q5_k, q6_k)  wp[N/16, K/32, bits, 64] uint8: each code's bits where
           scheme.FIELDS puts them: whole codes from each chunk's bit 0 (2 a chunk for 3-bit
           codes, 1 for 5 and 6-bit), the 2 tiles left over split over the chunks' spare top
           bits. Unpacking a tile is a shift and a mask per field, ORed (weight_tiles); q3_k /
           q5_k / q6_k carry q4_k's sl, mh, d, dmin
    q8_0, q4_0: d[N/16, K/32, 16] float16; q4_1: d, m[N/16, K/32, 16] float16;
    q4_k: the 6-bit sc and mn at 12 bits per group, in pairs of groups (2j, 2j + 1) of a
          super-block of S groups (an odd S pads its last pair with a zero group;
          scheme.pack_kquant_codes): sl[N/16, NP, 16] uint8 = sc[2j] & 15 | (sc[2j + 1] & 15) << 4,
          mh[N/16, NP, 32] uint8, row i's bytes 2i, 2i + 1 = mn[g] | (sc[g] >> 4) << 6 of the
          pair's two groups (zero-extended to int16 lanes they are the pair's two minimums, an
          int16 pair per row for vpdpwssd, once masked), NP = K/32/S * ceil(S/2) (4.5 bits per
          weight with S = 8); d, dmin[N/16, K/S/32, 16] float16

Per tile and group, 8 vpdpbusd (16 rows x 4 inputs each, unsigned weight x signed activation)
give the int32 dot products of the 16 rows with row r of x, one dependency chain per row of x.
The group adds, in float,
    sym (q8_0, q4_0):  (acc - offset * xsum[r, g]) * (d * xs[r, g])
                       (the chain starts from the integer -offset * xsum: exact, no float op)
    q4_1, k-quants:    acc * (a * xs[r, g]) + b * (xs * xsum)[r, g]
with a, b per weight row: q4_1 a = d, b = m; k-quants a = d * sc, b = -dmin * mn (computed once per
tile and group, reused for every row of x), xs * xsum kept per row and block when x is
quantized. So a row and group cost 8 vpdpbusd and 3 (sym) or 4 vector float ops.

k-quant decode differs (kquant_sum): a group's int32 dot product times its 6-bit scale is one
int32 multiply (vpmulld), converted and scaled by xs once, and the minimum term is integer:
the row's xs * xsum per group as 30-bit integers per super-block in two int16 halves
(minimum_scales), two vpdpwssd per pair of groups against the pair's two minimums (mh's
int16 lanes, masked); d and dmin apply per statement. A q4_k group took ~45 vector
instructions with 8-bit activations (~21 of them codes and float terms), now ~41; hot weights
on one znver4 core (scripts/bench_int8_kernel.py --formats q4_k --rows 1 --act-bits 8
--shape llama-1b --threads 1, old and new runs alternated) 1.06-1.12x the GB/s (gate_up
45.2-47.1 -> 49.9-50.7, down 46.0-46.2 -> 49.8). With one int16 per minimum (an error of
2^-16 of the super-block's largest xs * xsum) SmolLM2-135M's decode logits at the second
token were 11 off its prefill's (the minimum term cancels against the scale term, and a
massive activation makes both large): hence 30 bits, float32's precision.

Decode (one row of x) adds one group per statement (group_sum, U groups unrolled per block,
U = a q4_k super-block, else the largest divisor of K/32 up to 8): each group is one
expression, so the weight tiles, the int32 dot products and the float terms stay in registers
(local buffers had become memory in the build's pipeline: every group stored and reloaded its
tiles, coefficients and accumulator), and each tile's 16 sums accumulate directly in y (a local
accumulator per tile had become a workspace allocation per tile). k-quants add V groups of a
super-block per statement instead (block_sum: d and dmin applied once to their sums, V * the
group's 64-byte chunks <= DECODE_BURST_LINES; q3_k 8 groups, q4_k / q5_k / q6_k 4), their
prefetches (below) issued together before it. With hot weights one core
runs ~1.4 G vpdpbusd/s (the VNNI issue rate is the compute bound); with cold weights the
kernel is bound by memory.

Decode's software prefetch: after each group's statement, ONE prefetch (into L2) of the first
64-byte line of the group PREFETCH_BYTES ahead; the hardware prefetchers fetch its other lines.
Decided on whole builds (scripts/ab_decode.py: llama-110m builds with --calibrate none as
Engines in one process, 8 batch-1 decode steps of each build per round, order alternating by
round, both load orders (--reverse-load); machine shared, load 3-8 on 2 cores). Median step
of the rounds relative to (a), the code before (range of the per-round ratios in brackets; at
1 thread the CPU-time ratios agreed within 0.07):
                                                     q4 1 thr    q4 2 thr    q8 1 thr    q8 2 thr
  (a) every line of each group PREFETCH_BYTES ahead,  1           1           1           1
      a block's 32 (q4) / 64 (q8) back to back at its   (3.3-3.6    (2.3-7.7    (6.4-6.7    (7.6-13.9
      start (the code before)                           ms/step)    ms/step)    ms/step)    ms/step)
  (b) as (a), first line of each group only           1.46-1.51   1.29-1.38   1.44-1.45   1.35-1.43
  (c) one per block (q4 2 KiB, q8 4 KiB), 8 KiB ahead 1.50-1.55   1.24-1.27   1.50-1.51   1.34-1.45
      the same, 16 KiB ahead                          1.46-1.48   1.24-1.25   1.50        1.39-1.48
  (d) one per group (first line) after the group's    0.84-0.89   0.85-1.02   0.69-0.72   0.68-0.78
      statement, one statement per group: KEPT        (0.73-0.97) (0.59-1.95) (0.59-0.83) (0.25-1.47)
  (d) with every line of the group prefetched         0.96-1.00   0.96-1.01   0.84-0.85   0.81
  (d) without prefetch (one statement per group)      1.04-1.10   0.97-1.00   1.41        1.22-1.38
  (e) no prefetch, block statement as (a)             1.71-1.78   1.45-1.55   1.53        1.47-1.50
Rounds: (a)-(c), (e) and the first (d) 20 rounds x 8 steps (six builds in one process), then
(a) and the three (d) 30 x 8 (four builds); (d) against (a) in both sets. The 2-thread rounds
were the noisiest (the machine's other jobs: some rounds 3x slower), the medians still agree.
Repeated at 2 threads when the load had fallen to ~1 (30 x 8, both load orders): (d) / (a)
q4 0.89-0.90 (1.88-1.97 against 2.12-2.24 ms/step), q8 0.73-0.75 (2.87-2.96 against 3.90-4.02).
So on builds the prefetch pays (no prefetch (e) is 1.5-1.8x slower, as is the previous
helper's finding), fewer prefetch instructions alone (b, c) lose, and what wins is spreading
them between the compute: (a)'s 32 / 64 back-to-back prefetches at a block's start held the
core waiting on miss buffers (perf: ~97% of the samples of this loop on them). For q4_k the
one-statement-per-group form alone (no prefetch) is within 0.97-1.10 of (a): the block
statement's load order (LLVM's) cost about what (a)'s prefetch gained there. The lead's
kernel bench (scripts/bench_int8_kernel.py, which does not compile the kernel exactly as a
build does) had measured q4_k faster without any prefetch (20-22 -> ~40 GB/s, 2 threads,
llama-1b gate_up, huge pages): that did not carry to builds. q4_k's super-scales d, dmin are
now applied per group (2 more vector multiplies per group, hidden under the memory stream;
the rounding order differs from the previous block sum by float rounding only).
Tried and measured equal at batch 1 (1 thread, CPU time, cold, interleaved): two tiles per
parallel iteration, and q8_0 with U = 1 or 2 groups per block statement instead of 8.
Distance of (d)'s prefetch (same method, 30 rounds x 8 steps, both load orders, 1 and 2
threads): 16 KiB 0.98-1.02 of 8 KiB's step time, 4 KiB 1.01-1.06, 2 KiB 1.01-1.07; 8 KiB stays.
That was measured on znver4. On znver5 (EPYC Turin) the same method found the opposite: every
line of each group after its statement (`decode_prefetch="every-line"`, chosen by the CPU's
row in microarch.py) stepped in 0.61-0.64x the time for q4_k with 16-bit activations (the first
line left the kernel at ~27 GB/s of ~50) and 0.83-0.98x for q4_0, q8_0 and the q4 / q8
defaults (llama-110m, 2 threads, both load orders; at 1 thread q4_k 0.57x, q8_0 0.81x, q4
0.98x). Prefetching those lines into L1 (prefetcht0, "every-line-l1") instead of L2 took
another 0.87-0.94x (q4_k, q8_0 on llama-110m, 1 and 2 threads) and 0.97-0.98x (the q4 default
on llama-1b), so znver5 takes that. On znver4 it pays for 4-bit weights only (builds made
with each policy, llama-110m, int8 activations, scripts/ab_decode.py, 40 rounds, 2 threads,
both load orders: every-line-l1 against first-line 0.86 / 0.87x the step time for q4_1, 0.97 /
0.88x q4_0, 0.90 / 0.85x q4_k; 1 thread 0.85x q4_1, 0.92-0.93x q4_0, but ~1.03x q4_k; q8_0 at
2 threads 1.02x, worse), so the zen4 row sets int8_decode_prefetch_4bit (TileRow.int8_prefetch;
k-quants went back to the first line at stop 52: the end of "k-quant groups per decode statement")
and 8-bit weights keep the first line. On an Intel Xeon (model 167, AMX; 2 threads, both load
orders) every-line-l1 won for both: the q4 default 0.81-0.82x the step time on llama-110m and
0.93-0.95x on llama-1b, q8 0.84-0.90x and 0.93-0.96x, so the Intel row took it for all weights;
for 4-bit weights every line into L2 ("every-line") later stepped llama-1b's q4 default in
0.936-0.939x the time of every-line-l1 (llama-110m 1.00x; q8 no difference), so the Intel row
now takes that for 4-bit weights (figures in microarch.py).

Further q4_k decode leads on znver4, tried and not kept (stop 30). With hot weights a q4_k group costs ~1.4x a
q4_0 group (bench_int8_kernel.py, 1 thread, CPU time, llama-1b gate_up / down, 8-bit activations:
47 / 46 GB/s against q4_0's 67 / 67): the code unpacking and the float terms. (1) Super-block
accumulators: per group only acc * (sc * xs) and mn * xo summed into two tile accumulators (a
per-call buffer of NT x 2 x 16 floats; a per-tile local one became a workspace allocation per
tile), d and dmin applied once per super-block; LLVM then unpacked sc and mn in byte lanes. Hot
1.17x faster (54.8 / 53.6 GB/s), but cold 2-thread calls lost (gate_up share 0.90 against 0.98)
and whole builds stepped slower (scripts/ab_decode.py, 2 threads, both load orders: llama-110m
q4_k int8 1.088 and 1.096x the step time, llama-1b q4 1.048x; 1 thread 1.021x). (2) Software
prefetch of the code (lo, hi) and d / dmin lines as far ahead as the weights': llama-110m 0.930 /
1.012x, llama-1b q4 1.000 / 0.994x (both load orders): the hardware prefetchers already follow
these four small streams. (3) Two vpdpbusd chains per group instead of one: equal hot, so the
chain's latency is not the bound.
Tried and not kept at stop 43 (same CPU, llama-1b q4 builds as `tvm-llm build --quantization q4`
makes them, scripts/ab_decode.py, 2 threads, 16-40 rounds x 8 steps, both load orders). At that
point each q4_k kernel of a build streamed ~33 GB/s against a 34-35 GB/s torch-sum probe taken
around the same run (scripts/profile_decode.py), and one thread streamed as fast as two
(bench_int8_kernel.py --cold: gate_up 31.8 GB/s at 1 thread, 30.4 at 2), so decode is held by
the memory system, not the kernel. (4) One array per q4_k weight: each super-block's codes, lo,
hi, d and dmin in one 2304-byte run per tile (36 lines, every line prefetched 8 KiB ahead), so
that decode reads one stream instead of five: 1.28 / 1.14x the step time with the scales after
the codes, 1.08 / 1.18x with them first; without the scales' prefetch, or prefetching whole
super-blocks ahead, 1.22-1.32x. The four small streams are not what the kernel waits on here.
(5) Prefetching, after a kernel's last tile, the first 64 or 256 KiB past its own arrays (the
build lays weights out in execution order, so that is the next linear's start), so that the
bus works during the attention and norms between two linears: 0.99-1.006x, no effect.
(6) Decode prefetch 16 KiB ahead instead of 8: 1.02 / 1.00x; every line into L2 instead of L1:
1.12 / 1.05x; both 1.12 / 1.06x. (7) Every line with prefetchnta (locality 0), so that the
stream would spare the caches the rest of the step runs from: for all weights 1.003 / 1.001x
over 40 rounds each order, and the attention call between two linears no faster; for 4-bit
weights only 0.99 / 0.96x over 20 rounds, inside those rounds' 0.83-1.28 spread (not repeated).

k-quant groups per decode statement on znver4 (stop 51, AMD EPYC family 25 model 17, 2 cores):
the 24-line bursts chosen on the Xeon (block_sum, 4 q4_k groups and their 16 prefetches per
statement) left every k-quant kernel at 0.44-0.74 of the same-bytes stream while q4_0 and
q8_0 (a statement per group) reached 0.8-1.0. One group a statement (the zen4 row's
int8_decode_burst_lines = 4: q3_k, q4_k one group, q5_k / q6_k one group over the limit),
`scripts/bench_int8_kernel.py --formats q3_k,q5_k,q6_k,q4_k --rows 1 --act-bits 8 --cold
--rotate-mb 1200 --against OLD.py`, llama-110m qkv / gate_up / down, one interleaved run: q3_k
0.58 / 0.54 / 0.66 -> 0.90 / 0.96 / 0.96, q4_k 0.74 / 0.66 / 0.66 -> 0.94 / 0.83 / 0.92, q5_k
0.72 / 0.65 / 0.71 -> 0.92 / 0.94 / 0.85, q6_k 0.61 / 0.60 / 0.44 -> 0.95 / 0.82 / 0.67 (two
groups a statement, 8 lines, sat between: q4_k 0.80-0.87). Whole llama-1b q4 builds (the
CLI's mix, `scripts/ab_decode.py OLD NEW --rounds 16`, both load orders): 0.829x and 0.820x
the step time (40.6 -> 49.1 tok/s in the first); llama-110m q4 0.718x and 0.764x. Tried there and not kept: high nibbles masked in
place (16 x the code, one `vpand` instead of a `vgf2p8affineqb`) on a second vpdpbusd chain
shifted right by 4 at the end (two chains of 4, not one of 8): hot q4_k on one thread equal
(gate_up 42.5 against 42.3 GB/s, down 39.3 against 38.2), so neither the GF2 unit nor the
chain's latency bounds a group; ~45 vector instructions do (a third of them codes and floats).
With one group a statement, k-quants on znver4 prefetch each group's first line into L2 again
(the row's int8_decode_prefetch_kquant; q4_0 / q4_1 keep every line into L1), stop 52, same
CPU, `scripts/ab_decode.py` against every-line-l1, 2 threads, 10-16 rounds, both load orders:
llama-1b q4 (the CLI's mix, int8 activations) 0.871 / 0.951x the step time, llama-110m q4
0.987 / 0.979x; q4_k with 16-bit activations llama-1b 0.900 / 1.005x, llama-110m 1.040 /
1.033x; q6_k llama-110m 1.009 / 0.992x. Every line into L2 instead: llama-1b q4 0.982x.
Stop 55 (same CPU) measured it again with the integer minimum term above, which is cheaper
per group the more groups a statement holds (one vpdpwssd a pair, d and dmin once): hot, one
thread, llama-1b, 2 / 4 / 8 groups a statement reached gate_up 52.5 / 47-50 / 57.4 GB/s (one
group ~50); cold (--cold --rotate-mb 1200, 2 threads, --against) 2-8 groups fell to 0.48-0.70
of the same-bytes stream where one group a statement held 0.94-0.99, prefetch after the
statement or before alike. So one group a statement stays on znver4: the pair's minimums are
added by the statement of its first group.

Without VNNI (dot "avx512bw": AVX-512 CPUs before Cascade Lake; dot "avx2": Zen 2/3, Haswell to
the client cores): the same layout, quantization and float terms; each group's dot products
come from vpmaddubsw (unsigned weight byte x signed activation byte, adjacent pairs summed to
int16) and vpmaddwd (int16 pairs summed to int32), exact like vpdpbusd. 4-bit weights keep every
int16 lane of a group under 2^15 (8 tiles x 2 products x 15 x 128 = 30720), so a group is 8
vpmaddubsw, 7 int16 adds and ONE vpmaddwd per 16 rows (3-bit codes the same; 5-bit codes one
vpmaddwd per 4 tiles, 6-bit per 2: 2 x 63 x 128 x 2 = 32256); 8-bit weights would saturate vpmaddubsw
(255 x 127 x 2 > 2^15) and are split into nibbles (two such sums, the high one shifted left by 4
after widening): twice the instructions per weight of 4-bit, as the bytes are twice. AVX2 runs a
64-byte tile as two 32-byte halves (rows 0-7, 8-15). Decode without VNNI prefetches every line
of the group, not the first. 8-bit weights, measured on znver4 running the x86-64-v3 code
(scripts/bench_int8_kernel.py --arch x86-64-v3 --cold, llama-110m gate_up / down, 2 threads):
24-26 / 23 GB/s against 8-10 / 8 with the first line only (1 thread: 19.8 against 5.9). 4-bit
weights there had measured 0.7-0.9x with every line, but on a real AVX2 CPU (AMD EPYC znver3,
2 threads, --cold, --against the first-line kernel, interleaved) every line is 1.4-1.8x faster:
q4_k (8-bit activations) qkv / gate_up / down 17.8 / 24.5 / 23.0 GB/s against 9.9 / 14.6 /
13.1, q4_0 and q4_1 at 8 and 16-bit activations alike (18-26 against 10-17); whole q4 builds
(scripts/ab_decode.py) step in 0.66x (llama-110m) and 0.48x (llama-1b) the time. So every
line, for every format, wherever the dot products are not VNNI.

Rows of x (prefill, batched decode): each group's weight tiles are loaded (and for 4 bits
unpacked) once into a local buffer of 8 tiles and used for every row (reads from L1 at worst),
so a row costs only its dot products;
the weight stream is prefetched PREFETCH_BYTES ahead into L2, since with many rows per group
the out-of-order window spans too few groups to keep enough cache misses in flight.
Here every line of the group stays prefetched at the group's start: on whole builds
(scripts/ab_decode.py --batch 8, llama-110m, 24 rounds x 6 steps, both load orders, 1 and 2
threads, machine shared) against it, prefetching every line after the group's rows measured
0.98-1.06 (q8) and 1.00-1.01 (q4) of the step time, only the first line after the rows
1.37-1.43 (q8) and 1.07-1.10 (q4), no prefetch 1.38-1.45 (q8) and 1.08-1.14 (q4).

Measured (scripts/bench_int8_kernel.py compiles the kernel as a build does; 1 thread, CPU time,
weights cold, llama-110m gate_up (768 -> 4096) and down (2048 -> 768), machine shared, A/B
against the previous kernel in one process): batch 1 1.2-1.5x faster, batches 8 and 16
1.9-2.4x faster; a batch-8 call costs 2.0-2.1x a batch-1 call for q8_0 (3.8x / 2.9x before),
2.5-2.7x for q4_k. The L2 prefetch alone made cold batch-8 calls 1.7x (q8_0) and 1.2x (q4_k)
faster (on 4 KiB pages). A direct tvm.compile of this PrimFunc generates better code than the build's pipeline
(there the 8 tiles and the float sums are reloaded from memory every row: ~175 GOP/s per core
at 8 rows with hot weights against ~290 for the direct compile): the next step for batched
decode is keeping the tiles in registers in the build's pipeline too.
Tried and measured equal (1 thread, hot weights, 32 rows, llama-110m gate_up, q4_k and q8_0:
all within +-3% of ~1.15 ms, i.e. ~36 us per row, the decode kernel's hot time per row): block_sum
per row with accumulators in y, rows in blocks of 1/2/4/8 as one expression (a 16*rows-lane
vector), rows outside the groups. Every variant issues the same vpdpbusd count and the VNNI issue
rate bounds them all on this machine, so the buffers path stays.
"""
from __future__ import annotations

import tvm
from tvm.script import tirx as T

from schedules.cpu.common import prefetch_l2

TILE_N = 16
GROUP = 32
# the group dot products' instructions: AVX-512 VNNI (vpdpbusd), AVX-512BW without VNNI and AVX2
# (vpmaddubsw + vpmaddwd); the target picks (targets/llvm.py int8_dot_isa)
DOT_ISAS = ("vnni", "avx512bw", "avx2")
PREFETCH_BYTES = 8192  # weights prefetched this far ahead into L2 (measured best of 1-64 KiB)
# k-quant decode: the most prefetched lines issued together before one statement (block_sum),
# by default (a CPU's row may set its own: microarch.TileRow.int8_decode_burst_lines): on an
# Intel Xeon (model 167) whole super-blocks as one statement (q4_k: 32 lines) ran 8-10% slower
# than a statement per group, and blocks of at most 24 lines 1-9% faster; on znver4 one group
# a statement (4 lines) streams 1.2-1.5x faster than 24 (see "Decode's software prefetch")
DECODE_BURST_LINES = 24
# decode's prefetch per group with VNNI: the first 64-byte line into L2, every line into L2, or
# every line into L1 (per CPU: microarch.TileRow.int8_decode_prefetch); without VNNI always
# every line into L2
DECODE_PREFETCH = ("first-line", "every-line", "every-line-l1")


def chunks_per_group(fmt) -> int:
    """64-byte chunks of packed weights per group of 32 and tile of 16 rows (wp's third dim)."""
    from tvm_llm.quantization.scheme import vnni_chunks

    return vnni_chunks(fmt.bits)


def int8_act_matmul_func(fmt, K: int, N: int | None, out_dtype: str = "float32",
                         act_bits: int = 8, dot: str = "vnni",
                         decode_prefetch: str = "first-line",
                         decode_burst_lines: int = DECODE_BURST_LINES) -> tvm.tirx.PrimFunc:
    """The kernel for x: (A, B, K) float32 -> (A, B, N) and weights of format `fmt` (a
    quantization.formats.WeightFormat) in the layout above. N = None: N / 16 tiles left
    symbolic (bound by the weight buffer's first dimension): one parse serves every N of this
    K, each shape then being `specialize_n`'s (TVMScript parsing took ~1 s per kernel).
    act_bits 16: 16-bit activations as two int8 halves (see "16-bit activations" above).
    dot: the instructions of the group dot products, one of DOT_ISAS (see "Without VNNI").
    decode_prefetch: one of DECODE_PREFETCH, what decode prefetches of each group with VNNI.
    decode_burst_lines: k-quant decode adds as many groups of a super-block per statement as
    keep their prefetched lines within this (at least one group)."""
    from tvm_llm.quantization.formats import ACTIVATION_QMAX, super_groups
    from tvm_llm.quantization.scheme import field_pieces

    if act_bits not in ACTIVATION_QMAX:
        raise ValueError(f"int8-activation matmul takes 8 or 16-bit activations, not {act_bits}")
    if dot not in DOT_ISAS:
        raise ValueError(f"int8-activation matmul: unknown dot-product instructions {dot!r} "
                         f"(one of {DOT_ISAS})")
    if decode_prefetch not in DECODE_PREFETCH:
        raise ValueError(f"int8-activation matmul: unknown decode prefetch {decode_prefetch!r} "
                         f"(one of {DECODE_PREFETCH})")
    if (N is not None and N % TILE_N) or K % GROUP:
        raise ValueError(f"int8-activation matmul needs N % 16 == 0 and K % 32 == 0 (N={N}, K={K})")

    NT = tvm.tirx.Var("n_tiles", "int32") if N is None else N // TILE_N
    N = NT * TILE_N
    NG = K // GROUP
    four = fmt.bits == 4
    C = chunks_per_group(fmt)
    kind = fmt.kind
    S = super_groups(K) if kind == "kquant" else 1
    NS = NG // S
    P = (S + 1) // 2  # k-quants: group pairs per super-block (scheme.kquant_pairs)
    NP = NS * P
    # k-quant decode's minimum term as int16 dot products (vpdpwssd, below); without VNNI in float
    int_minimum = kind == "kquant" and dot == "vnni"
    QMAX = ACTIVATION_QMAX[act_bits]  # |q| bound of an activation block (16-bit: q = hi * 256 + lo)
    # k-quants multiply a group's int32 dot product by its 6-bit scale in int32 where that cannot
    # overflow: |dot| <= 32 * code max * QMAX, times 63 (6-bit codes at 16-bit activations would
    # not fit: 32 * 63 * 32512 * 63 > 2^31)
    int_scale = 32 * ((1 << fmt.bits) - 1) * QMAX * 63 < 2**31
    # decode unrolls U groups per block: a q4_k super-block, else the largest divisor <= 8
    U = S if kind == "kquant" else next(u for u in range(8, 0, -1) if NG % u == 0)
    off = 8.0 if (kind == "sym" and four) else (128.0 if kind == "sym" else 0.0)
    f16 = "float16"
    xo_dtype = "int32" if kind == "sym" else "float32"
    pf_groups = PREFETCH_BYTES // (C * 64)
    nibble_planes = fmt.bits < 8  # codes of 3-6 bits in fields of chunks (scheme.FIELDS)
    split8 = dot != "vnni" and not nibble_planes  # 8-bit weights without VNNI: dot products per nibble
    # without VNNI: tiles whose vpmaddubsw int16 pairs can be added before widening (a pair is
    # <= 2 x code max x 128: 8 tiles for 3 and 4-bit codes, 4 for 5-bit, 2 for 6-bit)
    widen_every = min(8, 32767 // (2 * ((1 << fmt.bits) - 1) * 128)) if nibble_planes else 8
    wide = act_bits == 16

    @T.macro
    def prefetch(wp, nt, g, locality):
        """Every line of group g's weights PREFETCH_BYTES ahead (past the end of a tile: the
        next tile's), into L2 (locality 2) or L1 (3). Rows of x, into L2: with several rows of
        x a group's compute is long enough that the out-of-order window holds only 2-3 groups
        of loads, too few to hide DRAM latency; measured, this made cold-weight batch-8 calls
        1.2-1.7x faster."""
        for c in T.unroll(C):
            T.evaluate(prefetch_l2(T.address_of(wp[nt, g + pf_groups, c, 0]), locality))

    @T.macro
    def decode_prefetch(wp, nt, g):
        """Decode: group g's weights PREFETCH_BYTES ahead into L2. With VNNI its first 64-byte
        line, the hardware prefetchers fetching the others (see the module docstring), or every
        line (into L1 with "every-line-l1") where the CPU's row says so (znver5, Intel);
        without VNNI every line of the group (see "Without VNNI")."""
        if dot != "vnni":
            prefetch(wp, nt, g, 2)
        elif decode_prefetch != "first-line":
            prefetch(wp, nt, g, 3 if decode_prefetch == "every-line-l1" else 2)
        else:
            T.evaluate(prefetch_l2(T.address_of(wp[nt, g + pf_groups, 0, 0])))

    def low_nibbles(v):  # uint8x64: each byte's bits 0-3
        return field(v, 0, 4, 0)

    def high_nibbles(v):  # uint8x64: each byte's bits 4-7
        return field(v, 4, 4, 0)

    def field(v, pos, w, to):
        """uint8x64: the w-bit field at bit `pos` of each byte of v, moved to bit `to` (no mask
        for a byte's top field moved to bit 0: the right shift clears every other bit)."""
        def u8(b):
            return T.Broadcast(T.uint8(b), 64)

        d = pos - to
        moved = v if d == 0 else (T.shift_right(v, u8(d)) if d > 0 else T.shift_left(v, u8(-d)))
        if to == 0 and pos + w == 8:
            return moved
        return T.bitwise_and(moved, u8(((1 << w) - 1) << to))

    def weight_tiles(wp, nt, g):
        """The group's 8 VNNI tiles of 16 rows as unsigned byte vectors, one expression each,
        from their fields (scheme.FIELDS: 4-bit codes are a chunk's low and high nibbles,
        3, 5 and 6-bit codes OR one or two fields); 8-bit weights without VNNI: their 8 low-nibble
        tiles, then their 8 high-nibble tiles. A chunk's load is one expression shared by its
        tiles (LLVM merges the identical loads)."""
        chunks = [wp[nt, g, c, T.Ramp(0, 1, 64)] for c in range(C)]
        if not nibble_planes:
            return [low_nibbles(t) for t in chunks] + [high_nibbles(t) for t in chunks] if split8 else chunks
        tiles = [None] * 8
        for t, c, pos, w, shift in field_pieces(fmt.bits):
            part = field(chunks[c], pos, w, shift)
            tiles[t] = part if tiles[t] is None else T.bitwise_or(tiles[t], part)
        return tiles

    @T.macro
    def store8(tiles, ts, b):
        """tiles[b + i] = ts[b + i] for the 8 tile expressions from b (a Python list's items,
        so one statement each)."""
        tiles[b] = ts[b]
        tiles[b + 1] = ts[b + 1]
        tiles[b + 2] = ts[b + 2]
        tiles[b + 3] = ts[b + 3]
        tiles[b + 4] = ts[b + 4]
        tiles[b + 5] = ts[b + 5]
        tiles[b + 6] = ts[b + 6]
        tiles[b + 7] = ts[b + 7]

    @T.macro
    def unpack(tiles, wp, nt, g):
        """The group's tiles (weight_tiles) into `tiles`, unpacked once for every row of x."""
        ts = T.meta_var(weight_tiles(wp, nt, g))
        store8(tiles, ts, 0)
        if split8:
            store8(tiles, ts, 8)

    def i32(v):
        return T.Broadcast(T.int32(v) if isinstance(v, int) else T.Cast("int32", v), TILE_N)

    def kquant_pair(p0, p1, nt, g):
        """The codes of group g's pair for the tile's 16 rows as int32x16 lanes: sl's byte and
        mh's two bytes (as int16 halves: the pair's minimums for vpdpwssd once masked), and
        which of the pair g is. g: an expression (the batched path) or, in decode, (u, j, odd):
        super-block u's group j and which of its pair it is (a Python int where the statement
        fixes it, so that the shifts are constants)."""
        if isinstance(g, tuple):
            u, j, odd = g
            pair = u * P + j // 2
        else:
            pair, odd = (g // S) * P + (g % S) // 2, (g % S) % 2
        sl = T.Cast("int32x16", p0[nt, pair, T.Ramp(0, 1, TILE_N)])
        mh = T.reinterpret("int32x16", T.Cast("int16x32", p1[nt, pair, T.Ramp(0, 1, 2 * TILE_N)]))
        return sl, mh, odd

    def kquant_code(p0, p1, nt, g, which, as_int=False):
        """A k-quant's 6-bit sc (which = 0) or mn (1) of the tile's 16 rows for group g, as
        float32x16 (int32x16 with as_int), from pack_kquant_codes' pairs: sc is sl's nibble
        ORed with mh's top 2 bits moved to bits 4-5 (2-3 instructions), mn mh's low 6 bits."""
        sl, mh, odd = kquant_pair(p0, p1, nt, g)
        if which == 0:
            code = T.bitwise_or(T.bitwise_and(T.shift_right(mh, i32(2 + 16 * odd)), i32(0x30)),
                                T.bitwise_and(T.shift_right(sl, i32(4 * odd)), i32(15)))
        else:
            code = T.bitwise_and(T.shift_right(mh, i32(16 * odd)), i32(63))
        return code if as_int else T.Cast("float32x16", code)

    @T.macro
    def coefficients(ab, p0, p1, p2, p3, nt, g):
        """ab[0] = a, ab[1] = b of the tile's 16 rows for group g (see the module docstring)."""
        if kind == "sym":
            ab[0] = T.Cast("float32x16", p0[nt, g, T.Ramp(0, 1, TILE_N)])
        elif kind == "asym":
            ab[0] = T.Cast("float32x16", p0[nt, g, T.Ramp(0, 1, TILE_N)])
            ab[1] = T.Cast("float32x16", p1[nt, g, T.Ramp(0, 1, TILE_N)])
        else:
            ab[0] = T.Cast("float32x16", p2[nt, g // S, T.Ramp(0, 1, TILE_N)]) * kquant_code(p0, p1, nt, g, 0)
            ab[1] = T.Cast("float32x16", p3[nt, g // S, T.Ramp(0, 1, TILE_N)]) \
                * kquant_code(p0, p1, nt, g, 1) * T.Broadcast(T.float32(-1), TILE_N)

    def dot_chain8(init, tiles, xq, r, g):
        """The group's int32 dot products of row r of x with the 16 rows: one expression (a
        chain of 8 vpdpbusd from `init`), not a local accumulator buffer, so that LLVM keeps
        it in a register whatever the TIR pipeline does with local buffers (in the build's
        pipeline such a buffer became memory, and each vpdpbusd waited on a store-reload)."""
        a4 = [T.reinterpret("int32", xq[r, T.Ramp(g * GROUP + t * 4, 1, 4)]) for t in range(8)]
        if dot != "vnni":
            return init + pairwise_dot(tiles, a4)
        acc = init
        for t in range(8):
            acc = T.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpbusd.512", acc, tiles[t],
                                          T.reinterpret("int8x64", T.Broadcast(a4[t], TILE_N)))
        return acc

    def pairwise_dot(tiles, a4):
        """Without VNNI: the 8 tiles' dot products with the 8 broadcast activation words as
        int32x16, from vpmaddubsw (unsigned x signed byte pairs summed to int16) and vpmaddwd
        (int16 pairs summed to int32). Exact: 4-bit values (<= 15) keep every int16 sum of
        the group under 2^15 (8 tiles x 2 products x 15 x 128 = 30720), so the 8 tiles' int16
        pairs are added first and widened once; 8-bit weights come as 16 nibble tiles (low
        nibbles, then high: unpack, group_sum), the high sum shifted left by 4 after widening.
        AVX2 runs each 64-byte tile as two 32-byte halves (rows 0-7, rows 8-15)."""
        def half_sum(ts, half, first):  # int32x8 of rows 8 * half ... 8 * half + 7 (AVX2)
            acc = None
            for t, tile in enumerate(ts):
                w = T.Shuffle([tile], [T.int32(half * 32 + i) for i in range(32)])
                p = T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", w,
                                            T.reinterpret("int8x32", T.Broadcast(a4[first + t], 8)))
                acc = p if acc is None else acc + p
            return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", acc,
                                           T.Broadcast(T.int16(1), 16))

        def widened(ts, first=0):  # int32x16: the 16 rows' dot products over tiles `ts` (from tile `first`)
            if dot == "avx2":
                return T.Shuffle([half_sum(ts, 0, first), half_sum(ts, 1, first)],
                                 [T.int32(i) for i in range(TILE_N)])
            acc = None
            for t, tile in enumerate(ts):
                p = T.call_llvm_pure_intrin("int16x32", "llvm.x86.avx512.pmaddubs.w.512", tile,
                                            T.reinterpret("int8x64", T.Broadcast(a4[first + t], TILE_N)))
                acc = p if acc is None else acc + p
            return T.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.pmaddw.d.512", acc,
                                           T.Broadcast(T.int16(1), 32))

        tiles = [tiles[t] for t in range(16 if split8 else 8)]
        if split8:
            return widened(tiles[:8]) + T.shift_left(widened(tiles[8:]), T.Broadcast(T.int32(4), TILE_N))
        acc = None
        for first in range(0, 8, widen_every):
            part = widened(tiles[first:first + widen_every], first)
            acc = part if acc is None else acc + part
        return acc

    def dot_chain(init, tiles, xq, r, g):
        """8-bit: one chain over xq[0]. 16-bit: q = hi * 256 + lo, so the dot product is
        (hi chain) * 256 + (lo chain from init): two independent chains over the same tiles,
        joined by a shift and an add (exact in int32: |hi chain| <= 32 * 255 * 127)."""
        if not wide:
            return dot_chain8(init, tiles, xq[0], r, g)
        hi = dot_chain8(T.Broadcast(T.int32(0), TILE_N), tiles, xq[0], r, g)
        return T.shift_left(hi, T.Broadcast(T.int32(8), TILE_N)) + dot_chain8(init, tiles, xq[1], r, g)

    def group_sum(wp, p0, p1, p2, p3, xq, xs, xo, nt, u, j):
        """Decode (one row of x): the tile's 16 sums over group g = u * U + j (block u, its
        group j) as one expression, so that the weight tiles, the int32 dot products and the
        float terms stay in registers (local buffers in the build's pipeline became memory,
        and every group paid stores and reloads on its dependency chains). Weight loads are
        pure expressions: a 4-bit chunk's two nibble tiles share one load (LLVM merges the
        identical loads). k-quants (U = S, so u is the super-block): kquant_sum of group j."""
        g = u * U + j
        if kind == "kquant":
            return kquant_sum(wp, p0, p1, p2, p3, xq, xs, xo, nt, u, [(j, j % 2)])
        tiles = weight_tiles(wp, nt, g)
        init = T.Broadcast(xo[0, g], TILE_N) if kind == "sym" else T.Broadcast(T.int32(0), TILE_N)
        acc = T.Cast("float32x16", dot_chain(init, tiles, xq, 0, g))
        main = acc * (T.Cast("float32x16", p0[nt, g, T.Ramp(0, 1, TILE_N)]) * T.Broadcast(xs[0, g], TILE_N))
        if kind == "asym":
            main = main + T.Cast("float32x16", p1[nt, g, T.Ramp(0, 1, TILE_N)]) * T.Broadcast(xo[0, g], TILE_N)
        return main

    # decode, k-quants: V groups of a super-block per statement (block_sum), their prefetches
    # together before it, at most decode_burst_lines lines (one group at least)
    V = next((v for v in range(U, 0, -1) if U % v == 0 and v * C <= decode_burst_lines), 1)

    def kquant_sum(wp, p0, p1, p2, p3, xq, xs, xo, nt, u, groups, xm=None):
        """Decode, k-quants: the tile's 16 sums over `groups` ((j, odd): group u * S + j, odd
        which of its pair; with xm a Python int) of super-block u as one expression, with d and dmin
        applied once to the groups' sums,
            d * sum_g (acc_g * sc_g) * xs_g  -  dmin * sum_g mn_g * (xs * xsum)_g.
        acc_g * sc_g is an int32 product (one vpmulld where a float scale took a convert and a
        multiply). With VNNI the minimum term is integer too: xm = (xoq, xso), the row's xs *
        xsum per super-block as a 30-bit integer in two int16 halves (minimum_scales), and each
        pair's two minimums, int16 halves of mh, take two vpdpwssd (one per half) against the
        pair's two values; so a pair of groups costs ~12 vector instructions beyond its dot
        products (their codes, products and sums) where the float form took ~20."""
        main = minimum = None
        for j, odd in groups:
            g, at = u * S + j, (u, j, odd)
            acc = dot_chain(T.Broadcast(T.int32(0), TILE_N), weight_tiles(wp, nt, g), xq, 0, g)
            if int_scale:
                a = T.Cast("float32x16", acc * kquant_code(p0, p1, nt, at, 0, True)) * T.Broadcast(xs[0, g], TILE_N)
            else:
                a = T.Cast("float32x16", acc) * (kquant_code(p0, p1, nt, at, 0) * T.Broadcast(xs[0, g], TILE_N))
            main = a if main is None else main + a
            if xm is None:
                b = kquant_code(p0, p1, nt, at, 1) * T.Broadcast(xo[0, g], TILE_N)
                minimum = b if minimum is None else minimum + b
        # with VNNI a pair's minimums are added by the sum that holds its first group
        firsts = [j for j, odd in groups if odd == 0] if xm is not None else []
        if firsts:
            xoq, xso = xm
            def minimums(j):  # the pair's two minimums per row, int16 lanes
                _, mh, _ = kquant_pair(p0, p1, nt, (u, j, 0))
                return T.reinterpret("int16x32", T.bitwise_and(mh, i32(0x3F003F)))

            mns = [minimums(j) for j in firsts]
            halves = []
            for half in range(2):  # the high and low 15 bits of each xs * xsum
                acc = T.Broadcast(T.int32(0), TILE_N)
                for j, mn in zip(firsts, mns):
                    pair = u * (2 * P) + j  # the pair's two values, as one int32 to broadcast
                    acc = T.call_llvm_pure_intrin(
                        "int32x16", "llvm.x86.avx512.vpdpwssd.512", acc, mn,
                        T.reinterpret("int16x32",
                                      T.Broadcast(T.reinterpret("int32", xoq[half, T.Ramp(pair, 1, 2)]), TILE_N)))
                halves.append(T.Cast("float32x16", acc))
            minimum = (halves[0] * T.Broadcast(T.float32(32768), TILE_N) + halves[1]) \
                * T.Broadcast(xso[0, u], TILE_N)
        main = T.Cast("float32x16", p2[nt, u, T.Ramp(0, 1, TILE_N)]) * main
        if minimum is None:
            return main
        return main - T.Cast("float32x16", p3[nt, u, T.Ramp(0, 1, TILE_N)]) * minimum

    @T.macro
    def minimum_scales(xo, xoq, xso):
        """Decode with VNNI, k-quants: row 0's xo (xs * xsum per group) as integers per
        super-block, xo ~= v * xso with xso = max|xo| / (32767 * 32768) (|v| < 2^30), held as
        int16 halves v = hi * 32768 + lo (xoq[0] = hi, xoq[1] = lo in [0, 32767]) laid out in
        the weights' pairs (an odd S's padding group 0), for kquant_sum's vpdpwssd. 30 bits
        keep float32's precision: with one int16 per value the error (2^-16 of the super-block's
        largest xo) broke real models where a massive activation meets the minimum term's
        cancellation against the scale term (SmolLM2-135M: decode logits 11 off prefill's at
        the second token, 1.8 with float)."""
        for s in range(NS):
            amax = T.alloc_buffer((1,), "float32", scope="local")
            amax[0] = T.float32(0)
            for j in range(S):
                amax[0] = T.max(amax[0], T.abs(xo[0, s * S + j]))
            xso[0, s] = amax[0] / T.float32(32767 * 32768)
            for j in range(2 * P):
                if j < S:
                    v = T.meta_var(T.Cast("int32", T.nearbyint(xo[0, s * S + j] * T.Select(
                        amax[0] > T.float32(0), T.float32(32767 * 32768) / amax[0], T.float32(0)))))
                    xoq[0, s * (2 * P) + j] = T.Cast("int16", T.shift_right(v, T.int32(15)))
                    xoq[1, s * (2 * P) + j] = T.Cast("int16", T.bitwise_and(v, T.int32(32767)))
                else:
                    xoq[0, s * (2 * P) + j] = T.int16(0)
                    xoq[1, s * (2 * P) + j] = T.int16(0)

    def block_sum(wp, p0, p1, xq, xs, xo, nt, u, h, p2, p3, xm, first_odd):
        """kquant_sum over groups u * U + h * V ... + V - 1 of super-block u (h a loop
        variable; first_odd: whether group h * V is the second of its pair)."""
        return kquant_sum(wp, p0, p1, p2, p3, xq, xs, xo, nt, u,
                          [(h * V + j, (first_odd + j) % 2) for j in range(V)], xm)

    @T.macro
    def decode_prefetch_block(wp, nt, u, h):
        """decode_prefetch of block_sum's V groups, before its statement."""
        for j in T.unroll(V):
            decode_prefetch(wp, nt, u * U + h * V + j)

    @T.macro
    def row_group(facc, i, tiles, ab, xq, xs, xo, r, g):
        """facc[i] += row r of x times the tile's 16 rows over group g: one chain of 8
        vpdpbusd started from the offset term (sym) and 3-4 float ops after it."""
        if kind == "sym":
            facc[i, T.Ramp(0, 1, TILE_N)] = facc[i, T.Ramp(0, 1, TILE_N)] \
                + T.Cast("float32x16", dot_chain(T.Broadcast(xo[r, g], TILE_N), tiles, xq, r, g)) \
                * (ab[0] * T.Broadcast(xs[r, g], TILE_N))
        else:
            facc[i, T.Ramp(0, 1, TILE_N)] = facc[i, T.Ramp(0, 1, TILE_N)] \
                + T.Cast("float32x16", dot_chain(T.Broadcast(T.int32(0), TILE_N), tiles, xq, r, g)) \
                * (ab[0] * T.Broadcast(xs[r, g], TILE_N)) + ab[1] * T.Broadcast(xo[r, g], TILE_N)

    def hmax(v, n):
        """max over the n lanes of the float32 vector expression v (halving shuffles)."""
        while n > 1:
            n //= 2
            v = T.max(T.Shuffle([v], [T.int32(i) for i in range(n)]),
                      T.Shuffle([v], [T.int32(n + i) for i in range(n)]))
        return v

    def hsum(v, n):
        """sum over the n lanes of the int32 vector expression v."""
        while n > 1:
            n //= 2
            v = T.Shuffle([v], [T.int32(i) for i in range(n)]) + T.Shuffle([v], [T.int32(n + i) for i in range(n)])
        return v

    @T.macro
    def quantize_row(x, xq, xs, xo, r, B):
        """Row r of x as int8 (16-bit: as hi, lo int8 halves, q = hi * 256 + lo) with one scale
        per 32 (xs) and the block's offset term (xo), in vector expressions: a block is two
        16-lane loads, a shuffle-tree max, two rounded converts and a shuffle-tree sum
        (written per lane with local buffers, TVM scalarized the rounding: 32 scalar converts
        and byte stores per block)."""
        for g in range(NG):
            amax = T.alloc_buffer((1,), "float32", scope="local")
            amax[0] = hmax(T.max(T.abs(x[r // B, r % B, T.Ramp(g * GROUP, 1, 16)]),
                                 T.abs(x[r // B, r % B, T.Ramp(g * GROUP + 16, 1, 16)])), 16)
            xs[r, g] = amax[0] / T.float32(QMAX)
            inv = T.Broadcast(T.Select(amax[0] > T.float32(0), T.float32(QMAX) / amax[0], T.float32(0)), 16)
            hi, lo = T.Broadcast(T.float32(QMAX), 16), T.Broadcast(T.float32(-QMAX), 16)
            q0 = T.Cast("int32x16", T.max(T.min(T.nearbyint(x[r // B, r % B, T.Ramp(g * GROUP, 1, 16)] * inv),
                                                hi), lo))
            q1 = T.Cast("int32x16", T.max(T.min(T.nearbyint(x[r // B, r % B, T.Ramp(g * GROUP + 16, 1, 16)] * inv),
                                                hi), lo))
            if wide:
                # hi = round(q / 256) in [-127, 127] (an arithmetic shift), lo = q - 256 hi in [-128, 127]
                h0 = T.shift_right(q0 + T.Broadcast(T.int32(128), 16), T.Broadcast(T.int32(8), 16))
                h1 = T.shift_right(q1 + T.Broadcast(T.int32(128), 16), T.Broadcast(T.int32(8), 16))
                xq[0][r, T.Ramp(g * GROUP, 1, 16)] = T.Cast("int8x16", h0)
                xq[0][r, T.Ramp(g * GROUP + 16, 1, 16)] = T.Cast("int8x16", h1)
                xq[1][r, T.Ramp(g * GROUP, 1, 16)] = T.Cast(
                    "int8x16", q0 - T.shift_left(h0, T.Broadcast(T.int32(8), 16)))
                xq[1][r, T.Ramp(g * GROUP + 16, 1, 16)] = T.Cast(
                    "int8x16", q1 - T.shift_left(h1, T.Broadcast(T.int32(8), 16)))
            else:
                xq[0][r, T.Ramp(g * GROUP, 1, 16)] = T.Cast("int8x16", q0)
                xq[0][r, T.Ramp(g * GROUP + 16, 1, 16)] = T.Cast("int8x16", q1)
            if kind == "sym":
                xo[r, g] = hsum(q0 + q1, 16) * T.int32(-int(off))
            else:
                xo[r, g] = T.Cast("float32", hsum(q0 + q1, 16)) * xs[r, g]

    @T.macro
    def kernel(x, y, wp, p0, p1, p2, p3, A, B):
        xq_hi = T.alloc_buffer((A * B, K), "int8")
        xq = (xq_hi, T.alloc_buffer((A * B, K), "int8")) if wide else (xq_hi, xq_hi)  # 8-bit: no lo half
        xs = T.alloc_buffer((A * B, NG), "float32")
        xo = T.alloc_buffer((A * B, NG), xo_dtype)  # sym: -offset * sum(q); else xs * sum(q)
        # 1. int8 activations, one scale per block of 32 (rows in parallel once there are many)
        if A * B >= 8:
            for r in T.parallel(A * B):
                quantize_row(x, xq, xs, xo, r, B)
        else:
            for r in range(A * B):
                quantize_row(x, xq, xs, xo, r, B)
        # 2. tiles of 16 rows in parallel; each group's tiles unpacked once for all rows of x
        if A * B == 1 and out_dtype == "float32" and kind == "kquant":
            xoq = T.alloc_buffer((2, 2 * NP), "int16")  # row 0's high and low halves
            xso = T.alloc_buffer((1, NS), "float32")
            if int_minimum:
                minimum_scales(xo, xoq, xso)
            for nt in T.parallel(NT):
                y[0, 0, T.Ramp(nt * TILE_N, 1, TILE_N)] = T.Broadcast(T.float32(0), TILE_N)
                for u in range(NG // U):
                    for h in T.unroll(U // V):
                        decode_prefetch_block(wp, nt, u, h)
                        # an odd V alternates the pair position of a statement's first group:
                        # one branch per parity (a constant once the loop is unrolled)
                        if V % 2 == 0 or h % 2 == 0:
                            y[0, 0, T.Ramp(nt * TILE_N, 1, TILE_N)] = y[0, 0, T.Ramp(nt * TILE_N, 1, TILE_N)] \
                                + block_sum(wp, p0, p1, xq, xs, xo, nt, u, h, p2, p3,
                                            (xoq, xso) if int_minimum else None, 0)
                        else:
                            y[0, 0, T.Ramp(nt * TILE_N, 1, TILE_N)] = y[0, 0, T.Ramp(nt * TILE_N, 1, TILE_N)] \
                                + block_sum(wp, p0, p1, xq, xs, xo, nt, u, h, p2, p3,
                                            (xoq, xso) if int_minimum else None, 1)
        elif A * B == 1 and out_dtype == "float32":
            for nt in T.parallel(NT):
                y[0, 0, T.Ramp(nt * TILE_N, 1, TILE_N)] = T.Broadcast(T.float32(0), TILE_N)
                for u in range(NG // U):
                    for j in T.unroll(U):
                        y[0, 0, T.Ramp(nt * TILE_N, 1, TILE_N)] = y[0, 0, T.Ramp(nt * TILE_N, 1, TILE_N)] \
                            + group_sum(wp, p0, p1, p2, p3, xq, xs, xo, nt, u, j)
                        decode_prefetch(wp, nt, u * U + j)
        elif A * B == 1:
            for nt in T.parallel(NT):
                fsum = T.alloc_buffer((1, TILE_N), "float32", scope="local")
                fsum[0, T.Ramp(0, 1, TILE_N)] = T.Broadcast(T.float32(0), TILE_N)
                for u in range(NG // U):
                    for j in T.unroll(U):
                        fsum[0, T.Ramp(0, 1, TILE_N)] = fsum[0, T.Ramp(0, 1, TILE_N)] \
                            + group_sum(wp, p0, p1, p2, p3, xq, xs, xo, nt, u, j)
                        decode_prefetch(wp, nt, u * U + j)
                y[0, 0, T.Ramp(nt * TILE_N, 1, TILE_N)] = T.Cast(out_dtype + "x16", fsum[0, T.Ramp(0, 1, TILE_N)])
        else:
            for nt in T.parallel(NT):
                facc = T.alloc_buffer((A * B, TILE_N), "float32")
                for r in range(A * B):
                    facc[r, T.Ramp(0, 1, TILE_N)] = T.Broadcast(T.float32(0), TILE_N)
                for g in range(NG):
                    tiles = T.alloc_buffer((16 if split8 else 8,), "uint8x64", scope="local")
                    ab = T.alloc_buffer((2,), "float32x16", scope="local")
                    prefetch(wp, nt, g, 2)
                    unpack(tiles, wp, nt, g)
                    coefficients(ab, p0, p1, p2, p3, nt, g)
                    for r in range(A * B):
                        row_group(facc, r, tiles, ab, xq, xs, xo, r, g)
                for r in range(A * B):
                    for i in T.vectorized(TILE_N):
                        y[r // B, r % B, nt * TILE_N + i] = T.Cast(out_dtype, facc[r, i])

    @T.macro
    def entry(var_x, var_y, wp, p0, p1, p2, p3):
        # every format's function: x (A, B, K) -> y (A, B, N); only the weight buffers differ
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        A = T.int64()
        B = T.int64()
        x = T.match_buffer(var_x, (A, B, K), "float32")
        y = T.match_buffer(var_y, (A, B, N), out_dtype)
        kernel(x, y, wp, p0, p1, p2, p3, A, B)

    if kind == "sym":
        @T.prim_func(private=True, check_well_formed=False)
        def func(var_x: T.handle, wp: T.Buffer((NT, NG, C, 64), "uint8"),
                 d: T.Buffer((NT, NG, TILE_N), f16), var_y: T.handle):
            entry(var_x, var_y, wp, d, d, d, d)
    elif kind == "asym":
        @T.prim_func(private=True, check_well_formed=False)
        def func(var_x: T.handle, wp: T.Buffer((NT, NG, C, 64), "uint8"),
                 d: T.Buffer((NT, NG, TILE_N), f16), m: T.Buffer((NT, NG, TILE_N), f16),
                 var_y: T.handle):
            entry(var_x, var_y, wp, d, m, d, m)
    else:
        @T.prim_func(private=True, check_well_formed=False)
        def func(var_x: T.handle, wp: T.Buffer((NT, NG, C, 64), "uint8"),
                 sl: T.Buffer((NT, NP, TILE_N), "uint8"), mh: T.Buffer((NT, NP, 2 * TILE_N), "uint8"),
                 d: T.Buffer((NT, NS, TILE_N), f16), dmin: T.Buffer((NT, NS, TILE_N), f16),
                 var_y: T.handle):
            entry(var_x, var_y, wp, sl, mh, d, dmin)
    return func


def specialize_n(func: tvm.tirx.PrimFunc, fmt, K: int, N: int) -> tvm.tirx.PrimFunc:
    """`func` (int8_act_matmul_func(fmt, K, None)) for N output features: its packed weight
    parameter wp (N/16, K/32, C, 64) given its concrete shape binds the tile count everywhere."""
    if N % TILE_N:
        raise ValueError(f"int8-activation matmul needs N % 16 == 0 (N={N})")
    return func.specialize({func.params[1]: tvm.tirx.decl_buffer(
        (N // TILE_N, K // GROUP, chunks_per_group(fmt), 64), "uint8", name="wp")})
