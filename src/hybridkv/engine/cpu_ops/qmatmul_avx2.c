/* The quantized matmuls on AVX2 + FMA (qmatmul.c calls qmatmul_x16 where QM_AVX2 is defined):
 * the rows of x rounded to 16-bit integers, the products summed exactly in 32-bit integers.
 *
 * Why: without AVX-512 an fp32 row times int8 weights costs a widening, a conversion and an
 * FMA per 8 weights, and decode then runs at half the memory's speed; vpmaddwd multiplies 16
 * int16 pairs and adds them in pairs in one instruction, so the same weights take a third of
 * the instructions and the matmul reads its weights at the memory's speed.
 *
 * The rounding (the contract tests check bit for bit):
 *   per row m and block b of QX_BLOCK columns (int4: a multiple of the group G; the last block
 *   is shorter), amax = max |x[m, k]| over the block, d = amax / 32767 and
 *   x16[m, k] = rint(x[m, k] * (32767 / amax)) in [-32767, 32767] (fp32 arithmetic, round to
 *   nearest even), so x ~ x16 * d within d / 2 (2^-16 of the block's largest |x|: ~100 times
 *   finer than bf16). amax 0: d 0, the block's x16 0; amax inf / nan: d nan (so y is nan).
 *   Then y = sum over blocks of d * (sum_k x16 * code) in exact integers per block:
 *     int8: y[m, n] = scale[n] * sum_b d[m, b] * sum_{k in b} x16[m, k] q[n, k]
 *     int4: y[m, n] = sum_g (s[n, g] * d * sum_{k in g} x16 code + lo[n, g] * d * sum_{k in g} x16)
 *   Worked example (int8, one block): x = [0.5, -1.0, 0.25] -> amax 1, x16 = [16384, -32767,
 *   8192] (16383.5 rounds to the even 16384), d = 1/32767; q = [2, 1, -4], scale 0.5 ->
 *   y = 0.5 * (32768 - 32767 - 32768) / 32767 = -0.5 (x16 * d is 0.500015.. for 0.5, and
 *   0.250008.. for 0.25: a bias of up to half a step each, here cancelling).
 *
 * Bounds: |x16 * q| <= 32767 * 127 and a block adds at most QX_BLOCK / 8 * 2 products per
 * 32-bit lane (int8; int4 codes are < 16): no overflow for blocks up to 4096 columns. */
#include "qmatmul.h"

#ifdef QM_AVX2
#include <math.h>
#include <string.h>

/* int8: bytes ahead of each weight row read to prefetch: about the next tile and a half (4
 * rows of 640 columns), far enough for the memory's latency at its full speed (README) */
#define X8_AHEAD 4096

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the activation blocks' width: QX_BLOCK columns, for int4 the multiple of G nearest it from
 * above (G itself from 256 on) */
static long block_width(const qjob *j, int int4) {
    if (!int4) return QX_BLOCK;
    return j->G >= QX_BLOCK ? j->G : (QX_BLOCK + j->G - 1) / j->G * j->G;
}

/* rows src [M, K] (rows at + m * ss) -> x16 [M, K32] (zeros past K) and d [M, nblk] */
static void round_rows(const float *src, long ss, long M, long K, long K32, long blk, int16_t *x16, float *d) {
    long nblk = (K + blk - 1) / blk;
    for (long m = 0; m < M; m++) {
        const float *r = src + m * ss;
        int16_t *o = x16 + m * K32;
        for (long b = 0; b < nblk; b++) {
            long k0 = b * blk, k1 = k0 + blk < K ? k0 + blk : K;
            float amax = 0.0f;
            int bad = 0;
            for (long k = k0; k < k1; k++) {
                float v = fabsf(r[k]);
                amax = v > amax ? v : amax;
                bad |= v != v;
            }
            int finite = !bad && isfinite(amax);
            float inv = finite && amax > 0.0f ? 32767.0f / amax : 0.0f;
            d[m * nblk + b] = finite ? amax / 32767.0f : NAN;
            for (long k = k0; k < k1; k++) o[k] = (int16_t)lrintf(r[k] * inv);
        }
        for (long k = K; k < K32; k++) o[k] = 0;
    }
}

/* int8 tile: NB rows n.., MB (<= 2) rows m.. */
static inline __attribute__((always_inline)) void q8x_tile(const qjob *j, long n, long m, const int NB, const int MB) {
    const int8_t *q = (const int8_t *)j->w;
    const float *sc = (const float *)j->scales;
    long K = j->K, K32 = j->K32, blk = j->blk, nblk = (K + blk - 1) / blk;
    __m256 tot[4][2];
    for (int a = 0; a < NB; a++)
        for (int b = 0; b < MB; b++) tot[a][b] = _mm256_setzero_ps();
    for (long bi = 0; bi < nblk; bi++) {
        long k0 = bi * blk, k1 = k0 + blk < K ? k0 + blk : K;
        __m256i acc[4][2];
        for (int a = 0; a < NB; a++)
            for (int b = 0; b < MB; b++) acc[a][b] = _mm256_setzero_si256();
        for (long k = k0; k < k1; k += 32) {
            __m256i x0[2], x1[2];
            for (int b = 0; b < MB; b++) {
                x0[b] = _mm256_loadu_si256((const __m256i *)(j->x16 + (m + b) * K32 + k));
                x1[b] = _mm256_loadu_si256((const __m256i *)(j->x16 + (m + b) * K32 + k + 16));
            }
            for (int a = 0; a < NB; a++) {
                const int8_t *src = q + (n + a) * K + k;
                int8_t pad[32];
                if (k + 32 > K) { /* the row's last K % 32 columns: no read past them */
                    memset(pad, 0, sizeof pad);
                    memcpy(pad, src, (size_t)(K - k));
                    src = pad;
                } else {
                    _mm_prefetch((const char *)src + X8_AHEAD, _MM_HINT_T0);
                }
                __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)src));
                __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(src + 16)));
                for (int b = 0; b < MB; b++)
                    acc[a][b] = _mm256_add_epi32(acc[a][b], _mm256_add_epi32(_mm256_madd_epi16(w0, x0[b]),
                                                                              _mm256_madd_epi16(w1, x1[b])));
            }
        }
        for (int b = 0; b < MB; b++) {
            __m256 d = _mm256_set1_ps(j->xd[(m + b) * nblk + bi]);
            for (int a = 0; a < NB; a++) tot[a][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[a][b]), d, tot[a][b]);
        }
    }
    for (int a = 0; a < NB; a++)
        for (int b = 0; b < MB; b++) j->y[(m + b) * j->sy + n + a] = hsum8(tot[a][b]) * sc[n + a];
}

/* int4 tile over x16 de-interleaved per 32 columns (16 even, then 16 odd columns): 16 bytes of
 * codes widened to 16 bits hold the 16 even columns' codes in their low nibbles and the odd
 * ones' in the high; each group's integer sums scaled by s, its lo term from xg */
static inline __attribute__((always_inline)) void q4x_tile(const qjob *j, long n, long m, const int NB, const int MB) {
    const uint8_t *nib = (const uint8_t *)j->w;
    long K = j->K, G = j->G, half = K / 2, KG = K / G, blk = j->blk, nblk = (K + blk - 1) / blk;
    const __m256i low4 = _mm256_set1_epi16(15);
    __m256 tot[4][2];
    float lacc[4][2] = {{0.0f}};
    for (int a = 0; a < NB; a++)
        for (int b = 0; b < MB; b++) tot[a][b] = _mm256_setzero_ps();
    for (long bi = 0; bi < nblk; bi++) {
        long g0 = bi * blk / G, g1 = (bi + 1) * blk / G < KG ? (bi + 1) * blk / G : KG;
        __m256 bacc[4][2];
        for (int a = 0; a < NB; a++)
            for (int b = 0; b < MB; b++) bacc[a][b] = _mm256_setzero_ps();
        for (long g = g0; g < g1; g++) {
            float s[4], lo[4];
            __m256i acc[4][2];
            for (int a = 0; a < NB; a++) {
                q4_group(j, n + a, g, &s[a], &lo[a]);
                for (int b = 0; b < MB; b++) acc[a][b] = _mm256_setzero_si256();
            }
            for (long k = g * G; k < (g + 1) * G; k += 32) {
                __m256i xe[2], xo[2];
                for (int b = 0; b < MB; b++) {
                    xe[b] = _mm256_loadu_si256((const __m256i *)(j->x16 + (m + b) * j->K32 + k));
                    xo[b] = _mm256_loadu_si256((const __m256i *)(j->x16 + (m + b) * j->K32 + k + 16));
                }
                for (int a = 0; a < NB; a++) {
                    const uint8_t *src = nib + (n + a) * half + k / 2;
                    _mm_prefetch((const char *)src + QM_AHEAD, _MM_HINT_T0);
                    __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src));
                    __m256i ce = _mm256_and_si256(c, low4), co = _mm256_srli_epi16(c, 4);
                    for (int b = 0; b < MB; b++)
                        acc[a][b] = _mm256_add_epi32(acc[a][b], _mm256_add_epi32(_mm256_madd_epi16(ce, xe[b]),
                                                                                  _mm256_madd_epi16(co, xo[b])));
                }
            }
            for (int a = 0; a < NB; a++) {
                __m256 sv = _mm256_set1_ps(s[a]);
                for (int b = 0; b < MB; b++) {
                    bacc[a][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[a][b]), sv, bacc[a][b]);
                    lacc[a][b] += lo[a] * j->xg[(m + b) * KG + g];
                }
            }
        }
        for (int b = 0; b < MB; b++) {
            __m256 d = _mm256_set1_ps(j->xd[(m + b) * nblk + bi]);
            for (int a = 0; a < NB; a++) tot[a][b] = _mm256_fmadd_ps(bacc[a][b], d, tot[a][b]);
        }
    }
    for (int a = 0; a < NB; a++)
        for (int b = 0; b < MB; b++) j->y[(m + b) * j->sy + n + a] = hsum8(tot[a][b]) + lacc[a][b];
}

/* tiles of 4 weight rows by up to 2 input rows: 8 integer accumulators, 4 x registers, 2-3 for
 * the weights (the float sums, touched once a group or block, may live in memory) */
#define TILES_X16(TILE)                                                               \
    for (long n = n0; n < n1; n += 4) {                                               \
        long nb = n1 - n < 4 ? n1 - n : 4;                                            \
        for (long m = 0; m < j->M; m += 2) {                                          \
            long mb = j->M - m < 2 ? j->M - m : 2;                                    \
            if (nb == 4) {                                                            \
                if (mb == 1) TILE(j, n, m, 4, 1);                                     \
                else TILE(j, n, m, 4, 2);                                             \
            } else {                                                                  \
                for (long a = 0; a < nb; a++)                                         \
                    for (long b = 0; b < mb; b++) TILE(j, n + a, m + b, 1, 1);        \
            }                                                                         \
        }                                                                             \
    }

static void q8x_part(void *ctx, long p, long P) {
    const qjob *j = ctx;
    long n0, n1;
    split_rows(j->N, p, P, &n0, &n1);
    TILES_X16(q8x_tile)
}

static void q4x_part(void *ctx, long p, long P) {
    const qjob *j = ctx;
    long n0, n1;
    split_rows(j->N, p, P, &n0, &n1);
    TILES_X16(q4x_tile)
}

int qmatmul_x16(qjob *j, int int4) {
    long M = j->M, K = j->K;
    long K32 = (K + 31) / 32 * 32, blk = block_width(j, int4), nblk = (K + blk - 1) / blk, KG = int4 ? K / j->G : 0;
    size_t bytes = sizeof(int16_t) * (size_t)(M * K32) + sizeof(float) * (size_t)(M * (nblk + KG + (int4 ? K : 0)));
    char *buf = malloc(bytes);
    if (buf == NULL) return -1;
    int16_t *x16 = (int16_t *)buf;
    float *xd = (float *)(buf + sizeof(int16_t) * (size_t)(M * K32)), *xg = xd + M * nblk, *xp = xg + M * KG;
    const float *src = j->x;
    long ss = j->sx;
    if (int4) {
        deinterleave_rows(j->x, j->sx, M, K, xp);
        src = xp, ss = K;
    }
    round_rows(src, ss, M, K, K32, blk, x16, xd);
    for (long m = 0; m < M && int4; m++) /* each group's rounded sum: d * sum of its x16 */
        for (long g = 0; g < KG; g++) {
            long sum = 0;
            for (long k = g * j->G; k < (g + 1) * j->G; k++) sum += x16[m * K32 + k];
            xg[m * KG + g] = (float)sum * xd[m * nblk + g * j->G / blk];
        }
    j->x16 = x16, j->xd = xd, j->xg = xg, j->K32 = K32, j->blk = blk;
    long bytes_w = int4 ? j->N * K / 2 : j->N * K;
    pool_run(int4 ? q4x_part : q8x_part, j, qm_parts(bytes_w * M / (M < 2 ? M : 2)));
    free(buf);
    return 0;
}
#else
typedef int qmatmul_avx2_unused; /* ISO C: a translation unit declares something */
#endif
