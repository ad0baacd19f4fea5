/* Weight-only quantized matmuls of fp32 rows (see cpu_ops/bindings.py: q8_linear, q4_linear),
 * split over a small pool of threads (pool.c).
 *
 *   int8: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]           q [N, K] int8, scale [N] fp32
 *   int4: y[m, n] = sum_k x[m, k] * (code[n, k] * s[n, g] + lo[n, g])   g = k / G
 *         codes two per byte, nib [N, K/2] uint8: column 2j in the low nibble of byte j, 2j+1 in
 *         the high one; sz [N, K/G, 2] (scale s, zero z) in bf16 or fp32, lo = z - 8 s, i.e.
 *         w = (code - 8) * s + z, the weight torch's int4 kernel multiplies by.
 *
 * Worked example (int4, G = 32): byte 0x3A of row n at j = 0 holds column 0's code 10 (0xA)
 * and column 1's code 3; with s = 0.5, z = 1 (lo = -3) they are the weights 2.0 and -1.5.
 *
 * With AVX-512 (and in the plain-C build) activations stay fp32 (only the weights are
 * quantized), accumulated with fused multiply-adds in fp32. The work is split by output rows n
 * (tiles of 4 rows); each tile's weights are read once for all M input rows (tiles of up to 4
 * m), so M rows cost one pass over the weights. With AVX-512 the tiles are written with
 * intrinsics (a row of 16 int8 or 32 int4 weights is one load, widened and converted in
 * registers); elsewhere plain loops (gcc vectorizes what it can). With AVX2 + FMA but no
 * AVX-512, qmatmul_avx2.c rounds the rows to 16-bit integers per block of columns (2^-16 of
 * the block's largest |x|) and sums the products exactly in integers: see its contract. */
#include "qmatmul.h"

/* from this many rows of x on, bf16 inputs (when the weight's compute dtype is bf16) take the
 * bf16 dot products; fewer rows read fp32 x (more exact; with few rows the time goes to reading
 * the weight's bytes, not to the products). */
#define BF16_ROWS 8

#ifdef QM_AVX512
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

/* int8 tile: NB rows n.., MB rows m.. (compile-time constants after inlining) */
static inline __attribute__((always_inline)) void q8_tile(const qjob *j, long n, long m, const int NB, const int MB) {
    const int8_t *q = (const int8_t *)j->w;
    const float *sc = (const float *)j->scales;
    long K = j->K;
    __m512 acc[4][4];
    for (int a = 0; a < NB; a++)
        for (int b = 0; b < MB; b++) acc[a][b] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 xv[4];
        for (int b = 0; b < MB; b++) xv[b] = _mm512_loadu_ps(j->x + (m + b) * j->sx + k);
        for (int a = 0; a < NB; a++) {
            const int8_t *src = q + (n + a) * K + k;
            _mm_prefetch((const char *)src + QM_AHEAD, _MM_HINT_T0);
            __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
            for (int b = 0; b < MB; b++) acc[a][b] = _mm512_fmadd_ps(w, xv[b], acc[a][b]);
        }
    }
    if (k < K) { /* the last K % 16 columns: masked loads read nothing past the row */
        __mmask16 mk = (__mmask16)((1u << (K - k)) - 1u);
        __m512 xv[4];
        for (int b = 0; b < MB; b++) xv[b] = _mm512_maskz_loadu_ps(mk, j->x + (m + b) * j->sx + k);
        for (int a = 0; a < NB; a++) {
            __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mk, q + (n + a) * K + k)));
            for (int b = 0; b < MB; b++) acc[a][b] = _mm512_fmadd_ps(w, xv[b], acc[a][b]);
        }
    }
    for (int a = 0; a < NB; a++)
        for (int b = 0; b < MB; b++) j->y[(m + b) * j->sy + n + a] = hsum(acc[a][b]) * sc[n + a];
}

/* sb / lb [NB][chunk]: scale and lo of groups g0 .. g0 + count of rows n .. n + NB */
static inline __attribute__((always_inline)) void q4_scales(const qjob *j, long n, long g0, long count, const int NB,
                                                            float sb[][QM_GROUPS], float lb[][QM_GROUPS]) {
    long KG = j->K / j->G;
    for (int a = 0; a < NB; a++) {
        long c = 0;
        if (j->sz_bf16) { /* a (scale, zero) bf16 pair as one uint32: scale in the low half */
            const uint32_t *p = (const uint32_t *)j->scales + (n + a) * KG + g0;
            const __m512 m8 = _mm512_set1_ps(-8.0f);
            for (; c + 16 <= count; c += 16) {
                __m512i u = _mm512_loadu_si512((const void *)(p + c));
                __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
                __m512 z = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
                _mm512_storeu_ps(sb[a] + c, sc);
                _mm512_storeu_ps(lb[a] + c, _mm512_fmadd_ps(m8, sc, z));
            }
        }
        for (; c < count; c++) q4_group(j, n + a, g0 + c, &sb[a][c], &lb[a][c]);
    }
}

/* int4 tile over x de-interleaved per 32 columns (xp: 16 even, then 16 odd columns). Each
 * group's 16 possible weights (code * s + lo, code 0..15) are one register; a code picks its
 * weight with a permute (which reads only the index's low 4 bits: the high nibble needs a
 * shift, the low one no mask). */
static inline __attribute__((always_inline)) void q4_tile(const qjob *j, const float *xp, long n, long m, const int NB,
                                                          const int MB) {
    const uint8_t *nib = (const uint8_t *)j->w;
    long K = j->K, G = j->G, half = K / 2, KG = K / G;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float sb[4][QM_GROUPS], lb[4][QM_GROUPS];
    __m512 acc[4][4];
    for (int a = 0; a < NB; a++)
        for (int b = 0; b < MB; b++) acc[a][b] = _mm512_setzero_ps();
    for (long g0 = 0; g0 < KG; g0 += QM_GROUPS) {
        long count = KG - g0 < QM_GROUPS ? KG - g0 : QM_GROUPS;
        q4_scales(j, n, g0, count, NB, sb, lb);
        for (long g = g0; g < g0 + count; g++) {
            __m512 lut[4];
            for (int a = 0; a < NB; a++)
                lut[a] = _mm512_fmadd_ps(iota, _mm512_set1_ps(sb[a][g - g0]), _mm512_set1_ps(lb[a][g - g0]));
            for (long k = g * G; k < (g + 1) * G; k += 32) {
                __m512 xe[4], xo[4];
                for (int b = 0; b < MB; b++) {
                    xe[b] = _mm512_loadu_ps(xp + (m + b) * K + k);
                    xo[b] = _mm512_loadu_ps(xp + (m + b) * K + k + 16);
                }
                for (int a = 0; a < NB; a++) {
                    const uint8_t *src = nib + (n + a) * half + k / 2;
                    _mm_prefetch((const char *)src + QM_AHEAD, _MM_HINT_T0);
                    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
                    __m512 we = _mm512_permutexvar_ps(c, lut[a]);
                    __m512 wo = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), lut[a]);
                    for (int b = 0; b < MB; b++) {
                        acc[a][b] = _mm512_fmadd_ps(we, xe[b], acc[a][b]);
                        acc[a][b] = _mm512_fmadd_ps(wo, xo[b], acc[a][b]);
                    }
                }
            }
        }
    }
    for (int a = 0; a < NB; a++)
        for (int b = 0; b < MB; b++) j->y[(m + b) * j->sy + n + a] = hsum(acc[a][b]);
}

#define TILES(TILE, ...)                                                              \
    for (long n = n0; n < n1; n += 4) {                                               \
        long nb = n1 - n < 4 ? n1 - n : 4;                                            \
        for (long m = 0; m < j->M; m += 4) {                                          \
            long mb = j->M - m < 4 ? j->M - m : 4;                                    \
            if (nb == 4) {                                                            \
                switch (mb) {                                                         \
                case 1: TILE(__VA_ARGS__, n, m, 4, 1); break;                         \
                case 2: TILE(__VA_ARGS__, n, m, 4, 2); break;                         \
                case 3: TILE(__VA_ARGS__, n, m, 4, 3); break;                         \
                default: TILE(__VA_ARGS__, n, m, 4, 4); break;                        \
                }                                                                     \
            } else {                                                                  \
                for (long a = 0; a < nb; a++)                                         \
                    for (long b = 0; b < mb; b++) TILE(__VA_ARGS__, n + a, m + b, 1, 1); \
            }                                                                         \
        }                                                                             \
    }

#endif

#if defined(QM_AVX512)
/* each weight tile (TILES above) read once for all rows of x */
static void q8_part(void *ctx, long p, long P) {
    const qjob *j = ctx;
    long n0, n1;
    split_rows(j->N, p, P, &n0, &n1);
    TILES(q8_tile, j)
}

static void q4_part(void *ctx, long p, long P) {
    const qjob *j = ctx;
    const float *xp = j->xp;
    long n0, n1;
    split_rows(j->N, p, P, &n0, &n1);
    TILES(q4_tile, j, xp)
}
#elif !defined(QM_AVX2) /* plain loops (AVX2: qmatmul_avx2.c) */
static void q8_part(void *ctx, long p, long P) {
    const qjob *j = ctx;
    const int8_t *q = (const int8_t *)j->w;
    const float *sc = (const float *)j->scales;
    long n0, n1;
    split_rows(j->N, p, P, &n0, &n1);
    for (long n = n0; n < n1; n++)
        for (long m = 0; m < j->M; m++) {
            const float *xr = j->x + m * j->sx;
            const int8_t *qr = q + n * j->K;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (long k = 0; k < j->K; k++) acc += xr[k] * (float)qr[k];
            j->y[m * j->sy + n] = acc * sc[n];
        }
}

static void q4_part(void *ctx, long p, long P) {
    const qjob *j = ctx;
    const float *xp = j->xp;
    const uint8_t *nib = (const uint8_t *)j->w;
    long K = j->K, G = j->G, n0, n1;
    split_rows(j->N, p, P, &n0, &n1);
    for (long n = n0; n < n1; n++)
        for (long m = 0; m < j->M; m++) {
            float acc = 0.0f;
            for (long g = 0; g < K / G; g++) {
                float s, lo;
                q4_group(j, n, g, &s, &lo);
                for (long k = g * G; k < (g + 1) * G; k += 32) {
                    const uint8_t *c = nib + n * (K / 2) + k / 2;
                    const float *xe = xp + m * K + k, *xo = xe + 16;
#pragma omp simd reduction(+ : acc)
                    for (int i = 0; i < 16; i++)
                        acc += xe[i] * ((float)(c[i] & 15) * s + lo) + xo[i] * ((float)(c[i] >> 4) * s + lo);
                }
            }
            j->y[m * j->sy + n] = acc;
        }
}
#endif

int qmatmul(const qweight *w, const float *x, long sx, long M, float *y, long sy) {
    qjob j = {.x = x, .sx = sx, .M = M, .K = w->K, .N = w->N, .w = w->w, .scales = w->scales,
              .sz_bf16 = (int)w->sz_bf16, .G = w->group, .y = y, .sy = sy, .xp = NULL};
    if (M <= 0 || w->N <= 0) return 0;
    if (w->kind == 3) return gguf_matmul(w->w, w->group, w->N, w->K, x, sx, M, y, sy);
    if (w->sz_bf16 && M >= BF16_ROWS) { /* bf16 inputs: x rounded once, weights decoded per tile of 4 rows */
        long K32 = (w->K + 31) / 32 * 32, parts = qm_parts(w->N * w->K * M / (M < 4 ? M : 4));
        uint16_t *buf = malloc(sizeof(uint16_t) * (size_t)(K32 * (M + QM_TILES * 4 * parts)));
        if (buf == NULL) return -1;
        j.K32 = K32, j.xb = buf, j.wb = buf + M * K32;
        round_inputs(&j, buf, w->kind == 2);
        pool_run(w->kind == 1 ? q8_bf16_part : q4_bf16_part, &j, parts);
        free(buf);
        return 0;
    }
#ifdef QM_AVX2
    return qmatmul_x16(&j, w->kind == 2);
#else
    if (w->kind == 1) {
        pool_run(q8_part, &j, qm_parts(w->N * w->K * M / (M < 4 ? M : 4)));
        return 0;
    }
    float *xp = malloc(sizeof(float) * (size_t)(M * w->K));
    if (xp == NULL) return -1;
    deinterleave_rows(x, sx, M, w->K, xp);
    j.xp = xp;
    pool_run(q4_part, &j, qm_parts(w->N * w->K / 2 * M / (M < 4 ? M : 4)));
    free(xp);
    return 0;
#endif
}

/* a weight of kind 1 (int8), 2 (int4: G a multiple of 32 dividing K) or 3 (GGUF blocks: G
 * segments that fit together), K >= 1, N >= 0, its memory given when it has rows */
int qweight_ok(const qweight *w) {
    if (w->kind == 3) return gguf_weight_ok(w->w, w->group, w->N, w->K);
    if (w->K < 1 || w->N < 0 || (w->N > 0 && (w->w == NULL || w->scales == NULL))) return 0;
    return w->kind == 1 || (w->kind == 2 && w->group >= 32 && w->group % 32 == 0 && w->K % w->group == 0);
}

/* what both wrappers do once their arguments are read: check, run without the GIL */
static PyObject *linear_call(const qweight *w, const float *x, long sx, long M, float *y, long sy, const char *what) {
    if (PyErr_Occurred()) return NULL;
    if (M < 0 || !qweight_ok(w) || sx < w->K || sy < w->N) {
        PyErr_Format(PyExc_ValueError, "%s: bad shapes (K >= 1; int4: K a multiple of G, G of 32)", what);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = qmatmul(w, x, sx, M, y, sy);
    Py_END_ALLOW_THREADS
    if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* q8_linear(x, sx, M, K, q, scale, N, y, sy, bf16) */
PyObject *q8_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "q8_linear takes 10 arguments");
        return NULL;
    }
    qweight w = {.kind = 1, .K = PyLong_AsLong(args[3]), .w = PyLong_AsVoidPtr(args[4]),
                 .scales = PyLong_AsVoidPtr(args[5]), .N = PyLong_AsLong(args[6]), .sz_bf16 = PyObject_IsTrue(args[9])};
    return linear_call(&w, PyLong_AsVoidPtr(args[0]), PyLong_AsLong(args[1]), PyLong_AsLong(args[2]),
                       PyLong_AsVoidPtr(args[7]), PyLong_AsLong(args[8]), "q8_linear");
}

/* q4_linear(x, sx, M, K, nib, sz, sz_bf16, G, N, y, sy) */
PyObject *q4_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "q4_linear takes 11 arguments");
        return NULL;
    }
    qweight w = {.kind = 2, .K = PyLong_AsLong(args[3]), .w = PyLong_AsVoidPtr(args[4]),
                 .scales = PyLong_AsVoidPtr(args[5]), .sz_bf16 = PyObject_IsTrue(args[6]),
                 .group = PyLong_AsLong(args[7]), .N = PyLong_AsLong(args[8])};
    return linear_call(&w, PyLong_AsVoidPtr(args[0]), PyLong_AsLong(args[1]), PyLong_AsLong(args[2]),
                       PyLong_AsVoidPtr(args[9]), PyLong_AsLong(args[10]), "q4_linear");
}
