"""W4A8 matmul for AVX-512 VNNI: 4-bit group-quantized weights x per-token int8 activations.

A hand-scheduled kernel (not a rule): its loop nest is the schedule. The QuantizeLinear pass
emits it for `--quantization q4 --activations int8` on CPUs with VNNI; TVM's rules skip it
(it is marked scheduled) and nothing is fused into it.

Data layout, chosen at build time (tvm_llm/quantization/kernels.quantize_weight):
    wp[N/16, K/G, G/8, 64] uint8  per 16 output rows, per group of G inputs, G/8 chunks of 64
                                  bytes; chunk c holds two VNNI tiles: the low nibbles are
                                  tile 2c, the high nibbles tile 2c+1; tile t byte i*4+k is row
                                  i, input g*G + 4t + k, stored as q + 8 (unsigned, 0..15)
    ws[N/16, K/G, 16]     float32 the 16 rows' scales of each group, one aligned vector

Per call:
    1. each row of x is quantized to int8 with one scale (max|x| / 127); per group the sum
       of its int8 values is kept (serial, K * rows elements: small next to the matmul);
    2. parallel over 16-row tiles; per group the 2*G/8 weight tiles are unpacked once (AND,
       shift) and reused for every row of x: vpdpbusd(acc, tile (u8), 4 activations (s8)
       broadcast) accumulates 16 int32 lanes, G/4 instructions per group;
    3. the group's int32 sum is corrected for the +8 offset (acc - 8 * sum(x_q in group)),
       converted and accumulated with the group's scales in float; the row's activation scale
       is applied at the end.
Bytes per weight: 0.5 + 4/G (0.625 at G = 32), the same as weight-only q4.
"""
from __future__ import annotations

import tvm
from tvm.script import tirx as T

TILE_N = 16


def w4a8_matmul_func(K: int, N: int, G: int, out_dtype: str = "float32") -> tvm.tirx.PrimFunc:
    """The kernel for x: (A, B, K) float32 -> (A, B, N), weights stored as described above."""
    if N % TILE_N or K % G or G % 8 or K % 16:
        raise ValueError(f"W4A8 needs N % 16 == 0, K % G == 0, G % 8 == 0 (N={N}, K={K}, G={G})")
    NT, NG, C = N // TILE_N, K // G, G // 8

    @T.macro
    def unpack(tiles, wp, nt, g):
        """The group's 2C VNNI tiles of 16 rows: low nibbles, then high nibbles, of each chunk."""
        for c in T.unroll(C):
            packed = wp[nt, g, c, T.Ramp(0, 1, 64)]
            tiles[2 * c] = T.bitwise_and(packed, T.Broadcast(T.uint8(15), 64))
            tiles[2 * c + 1] = T.shift_right(packed, T.Broadcast(T.uint8(4), 64))

    @T.macro
    def group_sum(acc, tiles, xq, xsum, r, g):
        """acc[0] + acc[1]: the group's int32 dot products of row r, +8 offset removed, in
        acc[0]; two accumulator chains (low / high nibble tiles) halve the latency."""
        acc[0] = T.Broadcast(T.int32(0), TILE_N)
        acc[1] = T.Broadcast(T.int32(0), TILE_N)
        for t in T.unroll(2 * C):
            a4 = T.reinterpret("int32", xq[r, T.Ramp(g * G + t * 4, 1, 4)])
            acc[t % 2] = T.call_llvm_pure_intrin(
                "int32x16", "llvm.x86.avx512.vpdpbusd.512", acc[t % 2], tiles[t],
                T.reinterpret("int8x64", T.Broadcast(a4, TILE_N)))
        acc[0] = acc[0] + acc[1] - T.Broadcast(xsum[r, g] * 8, TILE_N)

    @T.prim_func(private=True, check_well_formed=False)
    def w4a8_matmul(var_x: T.handle, wp: T.Buffer((NT, NG, C, 64), "uint8"),
                    ws: T.Buffer((NT, NG, TILE_N), "float32"), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        A = T.int64()
        B = T.int64()
        x = T.match_buffer(var_x, (A, B, K), "float32")
        y = T.match_buffer(var_y, (A, B, N), out_dtype)
        xq = T.alloc_buffer((A * B, K), "int8")
        xsum = T.alloc_buffer((A * B, NG), "int32")
        xscale = T.alloc_buffer((A * B,), "float32")
        # 1. per-row int8 quantization of x (16 lanes at a time)
        for r in range(A * B):
            lanes = T.alloc_buffer((16,), "float32", scope="local")
            for l in T.vectorized(16):
                lanes[l] = T.float32(0)
            for k0 in range(K // 16):
                for l in T.vectorized(16):
                    lanes[l] = T.max(lanes[l], T.abs(x[r // B, r % B, k0 * 16 + l]))
            amax = T.alloc_buffer((1,), "float32", scope="local")
            amax[0] = T.float32(0)
            for l in range(16):
                amax[0] = T.max(amax[0], lanes[l])
            xscale[r] = amax[0] / T.float32(127)
            inv = T.alloc_buffer((1,), "float32", scope="local")
            inv[0] = T.Select(amax[0] > T.float32(0), T.float32(127) / amax[0], T.float32(0))
            for g in range(NG):
                part = T.alloc_buffer((8,), "int32", scope="local")
                for l in T.vectorized(8):
                    part[l] = 0
                for j0 in range(G // 8):
                    for l in T.vectorized(8):
                        xq[r, g * G + j0 * 8 + l] = T.Cast("int8", T.Cast("int32", T.max(T.min(
                            T.nearbyint(x[r // B, r % B, g * G + j0 * 8 + l] * inv[0]),
                            T.float32(127)), T.float32(-127))))
                        part[l] = part[l] + T.Cast("int32", xq[r, g * G + j0 * 8 + l])
                total = T.alloc_buffer((1,), "int32", scope="local")
                total[0] = 0
                for l in range(8):
                    total[0] = total[0] + part[l]
                xsum[r, g] = total[0]
        # 2.-3. tiles of 16 rows in parallel
        if A * B == 1:
            # one row (a decode step of one sequence): the float accumulator stays in a register
            for nt in T.parallel(NT):
                fsum = T.alloc_buffer((1,), "float32x16", scope="local")
                fsum[0] = T.Broadcast(T.float32(0), TILE_N)
                for g in range(NG):
                    tiles = T.alloc_buffer((2 * C,), "uint8x64", scope="local")
                    acc = T.alloc_buffer((2,), "int32x16", scope="local")
                    unpack(tiles, wp, nt, g)
                    group_sum(acc, tiles, xq, xsum, 0, g)
                    fsum[0] = fsum[0] + T.Cast("float32x16", acc[0]) \
                        * ws[nt, g, T.Ramp(0, 1, TILE_N)]
                y[0, 0, T.Ramp(nt * TILE_N, 1, TILE_N)] = T.Cast(
                    out_dtype + "x16", fsum[0] * T.Broadcast(xscale[0], TILE_N))
        else:
            # several rows: each group's tiles are unpacked once and reused for every row
            for nt in T.parallel(NT):
                facc = T.alloc_buffer((A * B, TILE_N), "float32")
                for r in range(A * B):
                    facc[r, T.Ramp(0, 1, TILE_N)] = T.Broadcast(T.float32(0), TILE_N)
                for g in range(NG):
                    tiles = T.alloc_buffer((2 * C,), "uint8x64", scope="local")
                    unpack(tiles, wp, nt, g)
                    for r in range(A * B):
                        acc = T.alloc_buffer((2,), "int32x16", scope="local")
                        group_sum(acc, tiles, xq, xsum, r, g)
                        facc[r, T.Ramp(0, 1, TILE_N)] = facc[r, T.Ramp(0, 1, TILE_N)] \
                            + T.Cast("float32x16", acc[0]) * ws[nt, g, T.Ramp(0, 1, TILE_N)]
                for r in range(A * B):
                    for i in T.vectorized(TILE_N):
                        y[r // B, r % B, nt * TILE_N + i] = T.Cast(out_dtype, facc[r, i] * xscale[r])

    return w4a8_matmul
