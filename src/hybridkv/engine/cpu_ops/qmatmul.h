/* What the quantized matmul sources share (qmatmul.c: fp32 inputs, qmatmul_bf16.c: bf16). */
#ifndef HYBRIDKV_QMATMUL_H
#define HYBRIDKV_QMATMUL_H
#include "cpu_ops.h"

/* the hand-written vector code compiled in: AVX-512 where the target has it, else AVX2 + FMA,
 * else plain loops (HYBRIDKV_GENERIC: plain loops whatever the target; isa.py picks the target) */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(HYBRIDKV_GENERIC)
#define QM_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && !defined(HYBRIDKV_GENERIC)
#define QM_AVX2 1
#include <immintrin.h>
#endif

#define QM_TILES 4    /* bf16 path: tiles of 4 weight rows decoded before the rows of x pass over them */
#define QM_GROUPS 64  /* int4 groups whose scales a tile converts at a time */
#define QM_AHEAD 1024 /* bytes ahead of each weight row read to prefetch */
#define QX_BLOCK 256  /* AVX2: columns of x that share one rounding step (qmatmul_avx2.c) */

typedef struct {
    const float *x; /* [M, K], rows at + m * sx */
    long sx, M, K, N;
    const void *w;       /* int8 q [N, K] or uint8 nib [N, K/2] */
    const void *scales;  /* int8: fp32 [N]; int4: sz [N, K/G, 2] */
    int sz_bf16;         /* int4: sz in bf16 (else fp32); both: the inputs rounded to bf16 */
    long G;
    float *y; /* [M, N], rows at + m * sy */
    long sy;
    const float *xp; /* int4: x de-interleaved per 32 columns [M, K] (16 even columns, 16 odd) */
    const uint16_t *xb; /* bf16 inputs: x in bf16 [M, K32] (int4: de-interleaved), zeros past K */
    long K32;           /* K rounded up to a multiple of 32 */
    uint16_t *wb;       /* bf16 inputs: per part, QM_TILES decoded tiles of 4 weight rows [QM_TILES, 4, K32] */
    const int16_t *x16; /* AVX2: x rounded to int16 [M, K32] (int4: de-interleaved), zeros past K */
    const float *xd;    /* AVX2: the rounding's step d per row and block of blk columns [M, ceil(K / blk)] */
    const float *xg;    /* AVX2, int4: per row and group, d * the group's sum of x16 [M, K/G] */
    long blk;           /* AVX2: the blocks' width */
} qjob;

/* int4 group (n, g): its scale and lo = z - 8 s */
static inline void q4_group(const qjob *j, long n, long g, float *s, float *lo) {
    long i = (n * (j->K / j->G) + g) * 2;
    float sc, z;
    if (j->sz_bf16) {
        const uint16_t *p = (const uint16_t *)j->scales + i;
        sc = bf16_to_f32(p[0]), z = bf16_to_f32(p[1]);
    } else {
        const float *p = (const float *)j->scales + i;
        sc = p[0], z = p[1];
    }
    *s = sc;
    *lo = z - 8.0f * sc;
}

/* rows [n0, n1) of the job's share p of P: whole tiles of 4 rows, as even as that allows */
static inline void split_rows(long N, long p, long P, long *n0, long *n1) {
    long tiles = (N + 3) / 4;
    *n0 = (tiles * p / P) * 4;
    *n1 = (tiles * (p + 1) / P) * 4;
    if (*n1 > N) *n1 = N;
    if (*n0 > N) *n0 = N;
}

/* int4's fp32 inputs: rows x [M, K] (rows at + m * sx, K a multiple of 32) -> out [M, K]
 * de-interleaved per 32 columns, the 16 even columns then the 16 odd ones (the order a row's
 * 16 bytes of codes hold them in: low nibbles, then high) */
static inline void deinterleave_rows(const float *x, long sx, long M, long K, float *out) {
    for (long m = 0; m < M; m++) {
        const float *xr = x + m * sx;
        float *o = out + m * K;
        for (long k = 0; k < K; k += 32)
            for (int i = 0; i < 16; i++) o[k + i] = xr[k + 2 * i], o[k + 16 + i] = xr[k + 2 * i + 1];
    }
}

/* parts worth splitting a job into: about 64 KB of weights each, at most the pool's threads */
static inline long qm_parts(long bytes) {
    long parts = bytes / 65536 + 1;
    long t = pool_threads();
    return parts < t ? parts : t;
}

/* qmatmul_avx2.c (AVX2 builds): the job's fp32 rows rounded to int16, then integer dot
 * products; 0, or -1 when out of memory */
int qmatmul_x16(qjob *j, int int4);

/* qmatmul_bf16.c: the parts of a job with bf16 inputs */
void q8_bf16_part(void *ctx, long p, long P);
void q4_bf16_part(void *ctx, long p, long P);
void round_inputs(const qjob *j, uint16_t *xb, int deinterleave);
#endif
