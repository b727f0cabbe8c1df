/* The float32 prefill micro-kernel of schedules/cpu/gemm.py, written by hand in C (AVX-512):
 * an MR x 64 register tile (6 rows x 4 zmm) over a packed panel Bp[K][64], the activations
 * read in place (row stride K), the panel prefetched into L1 2 KiB ahead, and optionally the
 * next panel into L2 spread over S row tiles (the next-panel prefetch of
 * schedules/cpu/pipeline.py). Driven by scripts/bench_gemm_ceiling.py, which compiles it and
 * runs one copy per core: what this core design reaches on this CPU, free of TVM, so that a
 * kernel figure can be told apart from a limit of the machine.
 *
 *   gemm_ceiling K M PANELS S...    (M rows of A; PANELS per timed walk; S: 0 = no next-panel
 *                                    prefetch, -1 = spread over every row tile, else S tiles)
 * prints, per S, the median over 9 interleaved rounds of GFLOP/s of this process, for a hot
 * walk (the same PANELS panels, which then stay in L2 if small) and a cold one (the next
 * PANELS of a 700 MiB huge-page buffer each round).
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

#define MR 6
#define PN 64

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* One MR x PN tile of C = A[MR rows] x panel; tile t of `tiles` prefetches its share of the
 * next panel when s != 0. */
__attribute__((noinline)) static void tile(const float *a, long lda, const float *b, long K,
                                           float *c, const char *next, int t, int s) {
    __m512 acc[MR][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    long lines = K * (PN / 16), per = s > 0 ? lines / s : 0;
    for (long k = 0; k < K; k++) {
        const float *bk = b + k * PN;
        __m512 b0 = _mm512_load_ps(bk), b1 = _mm512_load_ps(bk + 16);
        __m512 b2 = _mm512_load_ps(bk + 32), b3 = _mm512_load_ps(bk + 48);
        const char *ahead = (const char *)bk + 2048;
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead + 64, _MM_HINT_T0);
        _mm_prefetch(ahead + 128, _MM_HINT_T0);
        _mm_prefetch(ahead + 192, _MM_HINT_T0);
        if (per && t < s) _mm_prefetch(next + (t * per + k * per / K) * 64, _MM_HINT_T1);
        for (int i = 0; i < MR; i++) {
            __m512 x = _mm512_set1_ps(a[i * lda + k]);
            acc[i][0] = _mm512_fmadd_ps(x, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(x, b1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(x, b2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(x, b3, acc[i][3]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < 4; j++) _mm512_store_ps(c + i * PN + j * 16, acc[i][j]);
}

static long K, M, PANELS, total_panels, cursor;
static float *A, *C, *B;

/* GFLOP/s of one walk over PANELS panels from `first`, all row tiles of each. */
static double walk(long first, int s) {
    int tiles = (int)(M / MR);
    if (s < 0) s = tiles;
    double t0 = now();
    for (long p = 0; p < PANELS; p++) {
        const float *panel = B + (first + p) * K * PN;
        for (int t = 0; t < tiles; t++)
            tile(A + t * MR * K, K, panel, K, C + t * MR * PN, (const char *)(panel + K * PN), t, s);
    }
    return 2.0 * tiles * MR * K * PN * PANELS / (now() - t0) / 1e9;
}

static int cmp(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: gemm_ceiling K M PANELS S...\n");
        return 2;
    }
    K = atol(argv[1]), M = atol(argv[2]), PANELS = atol(argv[3]);
    int nv = argc - 4, rounds = 9;
    long bytes = 700L << 20;
    total_panels = bytes / (K * PN * 4);
    if (M < MR || PANELS + 2 > total_panels) {
        fprintf(stderr, "gemm_ceiling: need M >= %d and fewer than %ld panels\n", MR, total_panels - 1);
        return 2;
    }
    A = aligned_alloc(64, (M * K * 4 + 63) / 64 * 64);
    C = aligned_alloc(64, M * PN * 4);
    B = aligned_alloc(2 << 20, bytes);
    if (!A || !C || !B) return 2;
    madvise(B, bytes, MADV_HUGEPAGE);
    for (long i = 0; i < M * K; i++) A[i] = 1e-3f * (i % 7);
    for (long i = 0; i < bytes / 4; i++) B[i] = 1e-3f * (i % 5);
    double *hot = calloc(nv * rounds, sizeof(double)), *cold = calloc(nv * rounds, sizeof(double));
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < nv; i++) {
            int v = r % 2 ? nv - 1 - i : i, s = atoi(argv[4 + v]);
            walk(0, s);
            hot[v * rounds + r] = walk(0, s);
            if (cursor + PANELS + 2 > total_panels) cursor = 1;
            cold[v * rounds + r] = walk(cursor, s);
            cursor += PANELS;
        }
    for (int v = 0; v < nv; v++) {
        qsort(hot + v * rounds, rounds, sizeof(double), cmp);
        qsort(cold + v * rounds, rounds, sizeof(double), cmp);
        printf("%s %.2f %.2f\n", argv[4 + v], hot[v * rounds + rounds / 2], cold[v * rounds + rounds / 2]);
    }
    return 0;
}
