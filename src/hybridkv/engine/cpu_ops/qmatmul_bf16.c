/* Quantized matmuls with bf16 inputs (the default compute dtype of quantized weights): x is
 * rounded to bf16 once per call, each tile of 4 weight rows is decoded once into bf16 (an
 * int8 code is exact in bf16; an int4 weight, code * s + lo, is rounded to it), then every
 * 4 rows of x are multiplied by it with bf16 dot products accumulated in fp32 (AVX512-BF16's
 * vdpbf16ps: 32 products a instruction, twice an fp32 FMA's). Decoding once per tile, not
 * per row of x, is what makes 32 rows at a time (32 sequences' decode) cheap: the decode is
 * paid once for all of them. Without AVX512-BF16, plain loops over the same rounded values.
 *
 * Worked example (int8): a weight row [3, -2] with scale 0.5 and x = [1.00390625, 1] (bf16
 * rounds 1.00390625 to 1): y = 0.5 * (3 * 1 + -2 * 1) = 0.5. */
#include "qmatmul.h"

#if defined(QM_AVX512) && defined(__AVX512BF16__)
#define QM_BF16 1
#endif

/* wb [4][K32]: rows n .. n+3 of an int8 weight in bf16 (rows past N and columns past K: 0) */
static void decode_q8(const qjob *j, long n, uint16_t *wb) {
    const int8_t *q = (const int8_t *)j->w;
    long K = j->K, K32 = j->K32;
    for (long a = 0; a < 4; a++) {
        uint16_t *o = wb + a * K32;
        if (n + a >= j->N) {
            memset(o, 0, sizeof(uint16_t) * K32);
            continue;
        }
        const int8_t *r = q + (n + a) * K;
        long k = 0;
#ifdef QM_BF16
        for (; k + 32 <= K; k += 32) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(r + k));
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
            _mm512_storeu_si512((void *)(o + k), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
#endif
        for (; k < K; k++) o[k] = f32_to_bf16((float)r[k]);
        for (; k < K32; k++) o[k] = 0;
    }
}

/* wb [4][K32]: rows n .. n+3 of an int4 weight in bf16, columns de-interleaved per 32 (16 even,
 * 16 odd: the order of j->xb) */
static void decode_q4(const qjob *j, long n, uint16_t *wb) {
    const uint8_t *nib = (const uint8_t *)j->w;
    long K = j->K, G = j->G, half = K / 2;
    for (long a = 0; a < 4; a++) {
        uint16_t *o = wb + a * j->K32; /* K32 == K: a multiple of the group, of 32 */
        if (n + a >= j->N) {
            memset(o, 0, sizeof(uint16_t) * j->K32);
            continue;
        }
        for (long g = 0; g < K / G; g++) {
            float s, lo;
            q4_group(j, n + a, g, &s, &lo);
            long k = g * G;
#ifdef QM_BF16
            const __m512 lut = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_ps(s), _mm512_set1_ps(lo));
            for (; k < (g + 1) * G; k += 32) {
                __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(nib + (n + a) * half + k / 2)));
                __m512 we = _mm512_permutexvar_ps(c, lut), wo = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), lut);
                _mm512_storeu_si512((void *)(o + k), (__m512i)_mm512_cvtne2ps_pbh(wo, we));
            }
#endif
            for (; k < (g + 1) * G; k += 32) {
                const uint8_t *c = nib + (n + a) * half + k / 2;
                for (int i = 0; i < 16; i++) {
                    o[k + i] = f32_to_bf16((float)(c[i] & 15) * s + lo);
                    o[k + 16 + i] = f32_to_bf16((float)(c[i] >> 4) * s + lo);
                }
            }
        }
    }
}

#ifdef QM_BF16
static inline __attribute__((always_inline)) void dot_tile(const qjob *j, const uint16_t *wb, long m, float out[4][4],
                                                           const int MB) {
    long K32 = j->K32;
    __m512 acc[4][4];
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < MB; b++) acc[a][b] = _mm512_setzero_ps();
    for (long k = 0; k < K32; k += 32) {
        __m512bh xv[4];
        for (int b = 0; b < MB; b++) xv[b] = (__m512bh)_mm512_loadu_si512((const void *)(j->xb + (m + b) * K32 + k));
        for (int a = 0; a < 4; a++) {
            __m512bh w = (__m512bh)_mm512_loadu_si512((const void *)(wb + a * K32 + k));
            for (int b = 0; b < MB; b++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], w, xv[b]);
        }
    }
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < MB; b++) out[a][b] = _mm512_reduce_add_ps(acc[a][b]);
}
#endif

/* out[a][b] = wb row a . xb row m + b, for b < mb */
static void dot(const qjob *j, const uint16_t *wb, long m, long mb, float out[4][4]) {
#ifdef QM_BF16
    switch (mb) {
    case 1: dot_tile(j, wb, m, out, 1); return;
    case 2: dot_tile(j, wb, m, out, 2); return;
    case 3: dot_tile(j, wb, m, out, 3); return;
    default: dot_tile(j, wb, m, out, 4); return;
    }
#else
    for (int a = 0; a < 4; a++)
        for (long b = 0; b < mb; b++) {
            const uint16_t *w = wb + a * j->K32, *x = j->xb + (m + b) * j->K32;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (long k = 0; k < j->K32; k++) acc += bf16_to_f32(w[k]) * bf16_to_f32(x[k]);
            out[a][b] = acc;
        }
#endif
}

static void bf16_part(const qjob *j, long p, long P, int int4) {
    long n0, n1;
    split_rows(j->N, p, P, &n0, &n1);
    if (n0 >= n1) return;
    uint16_t *wb = j->wb + p * QM_TILES * 4 * j->K32; /* this part's decoded tiles */
    const float *sc = (const float *)j->scales;
    for (long n = n0; n < n1; n += 4 * QM_TILES) { /* QM_TILES tiles decoded, then each 4 rows of x times them */
        long tiles = (n1 - n + 3) / 4 < QM_TILES ? (n1 - n + 3) / 4 : QM_TILES;
        for (long t = 0; t < tiles; t++) {
            if (int4) decode_q4(j, n + 4 * t, wb + t * 4 * j->K32);
            else decode_q8(j, n + 4 * t, wb + t * 4 * j->K32);
        }
        for (long m = 0; m < j->M; m += 4) {
            long mb = j->M - m < 4 ? j->M - m : 4;
            for (long t = 0; t < tiles; t++) {
                long nt = n + 4 * t, nb = n1 - nt < 4 ? n1 - nt : 4;
                float out[4][4];
                dot(j, wb + t * 4 * j->K32, m, mb, out);
                for (long a = 0; a < nb; a++)
                    for (long b = 0; b < mb; b++)
                        j->y[(m + b) * j->sy + nt + a] = int4 ? out[a][b] : out[a][b] * sc[nt + a];
            }
        }
    }
}

void q8_bf16_part(void *ctx, long p, long P) { bf16_part(ctx, p, P, 0); }
void q4_bf16_part(void *ctx, long p, long P) { bf16_part(ctx, p, P, 1); }

/* xb [M, K32] = x in bf16 (int4: de-interleaved per 32 columns), zeros past K */
void round_inputs(const qjob *j, uint16_t *xb, int deinterleave) {
    for (long m = 0; m < j->M; m++) {
        const float *xr = j->x + m * j->sx;
        uint16_t *o = xb + m * j->K32;
        if (deinterleave) {
            for (long k = 0; k < j->K; k += 32)
                for (int i = 0; i < 16; i++)
                    o[k + i] = f32_to_bf16(xr[k + 2 * i]), o[k + 16 + i] = f32_to_bf16(xr[k + 2 * i + 1]);
        } else {
            for (long k = 0; k < j->K; k++) o[k] = f32_to_bf16(xr[k]);
        }
        for (long k = j->K; k < j->K32; k++) o[k] = 0;
    }
}
