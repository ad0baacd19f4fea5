/* fp32 rows times a weight held in GGUF blocks as the file stores them (see cpu_ops/bindings.py:
 * gguf_linear, gguf_rows), split over the pool's threads (pool.c); no activation is quantized.
 *
 * A weight [N, K] is a list of *segments*: consecutive output rows held in one ggml block type
 * (a fused q/k/v matrix whose parts the file stores in different types is three segments). The
 * segment table is int64 [S, 4]: (ggml type, rows, data pointer, bytes per row). A row is K / QK
 * blocks; a block decodes to QK values in sub-blocks of L values, sub-block s being
 * w = a_s * q + c_s with integer codes q (held as floats), scale a_s and offset c_s:
 *
 *   type  id QK  bytes  L   codes q                     a_s              c_s
 *   Q4_0   2 32  18     32  nibble - 8                  d                0
 *   Q4_1   3 32  20     32  nibble                      d                m
 *   Q5_0   6 32  22     32  (nibble | high bit << 4) - 16  d             0
 *   Q5_1   7 32  24     32  nibble | high bit << 4      d                m
 *   Q8_0   8 32  34     32  int8                        d                0
 *   Q4_K  12 256 144    32  nibble                      d * sc_s         -(dmin * m_s)
 *   Q5_K  13 256 176    32  nibble | high bit << 4      d * sc_s         -(dmin * m_s)
 *   Q6_K  14 256 210    16  (nibble | 2 high bits << 4) - 32  d * sc_s   0
 *
 * (d, dmin, m: fp16; the K-quants' 6-bit sc_s, m_s packed in 12 bytes as ggml's get_scale_min_k4
 * reads them, Q6_K's sc_s int8.) Each product and sum is rounded as gguf's Python dequantizer
 * rounds it (no contraction: -ffp-contract=off), so gguf_rows gives its fp32 values bit for bit.
 * Worked example (Q8_0): d = 0.5 (fp16 0x3800) and codes (4, -2, ...) are the weights (2.0, -1.0, ...).
 *
 * The matmul: y[m, n] = sum over sub-blocks s of a_s * (q_s . x_s) + c_s * sum(x_s), i.e. the
 * dequantized weight times x up to the order of the fp32 sums (the sums of x per 32 columns
 * are taken once per call). A part decodes a weight row's blocks once into a scratch row and
 * multiplies it with every row of x (8 lanes of partial sums, gcc vectorizes the loops). */
#include "qmatmul.h"

/* up to this many rows of x, the vector build decodes each weight row in registers once per 4
 * rows of x; more rows decode it once into a scratch row that all of them read */
#define FUSED_ROWS 8

typedef struct {
    long id, qk, bytes, sub; /* ggml type id, values per block, bytes per block, values per sub-block */
} gtype;

static const gtype GTYPES[] = {
    {2, 32, 18, 32}, {3, 32, 20, 32}, {6, 32, 22, 32}, {7, 32, 24, 32},
    {8, 32, 34, 32}, {12, 256, 144, 32}, {13, 256, 176, 32}, {14, 256, 210, 16},
};

const gtype *gguf_type(long id) {
    for (size_t i = 0; i < sizeof GTYPES / sizeof GTYPES[0]; i++)
        if (GTYPES[i].id == id) return &GTYPES[i];
    return NULL;
}

/* whether the type's sub-blocks have offsets c (else c = 0) */
static inline int has_offsets(const gtype *t) { return t->id == 3 || t->id == 7 || t->id == 12 || t->id == 13; }

#if defined(__F16C__) && !defined(HYBRIDKV_GENERIC)
#include <immintrin.h>
static inline float h2f(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }
#else
static inline float h2f(const uint8_t *p) { return f16_to_f32((uint16_t)(p[0] | (p[1] << 8))); }
#endif

/* K-quants' 6-bit scale and min of sub-block j (ggml's get_scale_min_k4) */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* block b of type t -> codes q [QK], per sub-block a, c [QK / L] */
static void decode_block(long id, const uint8_t *b, float *q, float *a, float *c) {
    switch (id) {
    case 2: case 3: { /* Q4_0, Q4_1 */
        const uint8_t *qs = b + (id == 2 ? 2 : 4);
        float off = id == 2 ? -8.0f : 0.0f;
        for (int i = 0; i < 16; i++) q[i] = (float)(qs[i] & 15) + off, q[i + 16] = (float)(qs[i] >> 4) + off;
        a[0] = h2f(b), c[0] = id == 2 ? 0.0f : h2f(b + 2);
        return;
    }
    case 6: case 7: { /* Q5_0, Q5_1 */
        const uint8_t *hb = b + (id == 6 ? 2 : 4), *qs = hb + 4;
        uint32_t qh = (uint32_t)hb[0] | (uint32_t)hb[1] << 8 | (uint32_t)hb[2] << 16 | (uint32_t)hb[3] << 24;
        float off = id == 6 ? -16.0f : 0.0f;
        for (int i = 0; i < 16; i++) {
            q[i] = (float)((qs[i] & 15) | (((qh >> i) & 1) << 4)) + off;
            q[i + 16] = (float)((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) + off;
        }
        a[0] = h2f(b), c[0] = id == 6 ? 0.0f : h2f(b + 2);
        return;
    }
    case 8: { /* Q8_0 */
        const int8_t *qs = (const int8_t *)(b + 2);
        for (int i = 0; i < 32; i++) q[i] = (float)qs[i];
        a[0] = h2f(b), c[0] = 0.0f;
        return;
    }
    case 12: case 13: { /* Q4_K, Q5_K: 8 sub-blocks of 32; bytes of 32 hold sub-blocks 2i (low), 2i+1 (high) */
        float d = h2f(b), dmin = h2f(b + 2);
        const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + (id == 12 ? 16 : 48);
        for (int s = 0; s < 8; s++) {
            int scale, min;
            scale_min_k4(s, sc, &scale, &min);
            a[s] = d * (float)scale, c[s] = -(dmin * (float)min);
            const uint8_t *p = qs + 32 * (s / 2);
            int shift = 4 * (s & 1);
            for (int i = 0; i < 32; i++) {
                int v = (p[i] >> shift) & 15;
                if (id == 13) v |= ((qh[i] >> s) & 1) << 4;
                q[32 * s + i] = (float)v;
            }
        }
        return;
    }
    case 14: { /* Q6_K: 2 halves of 128; sub-blocks of 16 */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = h2f(b + 208);
        for (int h = 0; h < 2; h++, ql += 64, qh += 32) {
            float *y = q + 128 * h;
            for (int l = 0; l < 32; l++) {
                y[l] = (float)((int)((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
                y[l + 32] = (float)((int)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
                y[l + 64] = (float)((int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                y[l + 96] = (float)((int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        for (int s = 0; s < 16; s++) a[s] = d * (float)sc[s], c[s] = 0.0f;
        return;
    }
    }
}


typedef struct {
    const int64_t *seg; /* [S, 4] */
    long S, N, K;
    const float *x; /* [M, K], rows at + m * sx */
    long sx, M;
    const float *xs; /* [M, K / 32]: sums of x per 32 columns (NULL: no segment has offsets) */
    float *y;        /* [M, N], rows at + m * sy */
    long sy;
    const int64_t *ids; /* gguf_rows: the rows to dequantize [T] (NULL: rows 0..T-1) */
    long T;
} gjob;

#if (defined(QM_AVX2) || defined(QM_AVX512))
#define GG_VEC 1
/* 32 code bytes (unsigned, or signed when sgn) -> 32 weights w[0..31] = (code + off) * a */
static inline void put32(__m256i v, float *q, int sgn, float off, float a) {
    __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    __m256 o = _mm256_set1_ps(off), s = _mm256_set1_ps(a);
    for (int i = 0; i < 4; i++) {
        __m256i w = sgn ? _mm256_cvtepi8_epi32(parts[i]) : _mm256_cvtepu8_epi32(parts[i]);
        _mm256_store_ps(q + 8 * i, _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(w), o), s));
    }
}

/* 32 signed code bytes -> w[0..15] = code * a0, w[16..31] = code * a1 (Q6_K's sub-blocks of 16) */
static inline void put32_2(__m256i v, float *q, float a0, float a1) {
    __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++)
        _mm256_store_ps(q + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i])),
                                                  _mm256_set1_ps(i < 2 ? a0 : a1)));
}

/* the 32 bits of qh as 32 bytes of 0 / 16 (bit i -> byte i) */
static inline __m256i bits16(uint32_t qh) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3);
    const __m256i mask = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), shuf);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, mask), mask);
    return _mm256_and_si256(v, _mm256_set1_epi8(16));
}

/* the vector build's decode_block, the codes scaled: w = a * q (as decode_row makes them), c */
static void decode_block_vec(long id, const uint8_t *b, float *q, float *c) {
    float a[16];
    const __m256i low4 = _mm256_set1_epi8(15);
    switch (id) {
    case 2: case 3: case 6: case 7: {
        int five = id == 6 || id == 7;
        const uint8_t *qs = b + (id == 2 ? 2 : id == 6 ? 6 : id == 3 ? 4 : 8);
        __m128i v = _mm_loadu_si128((const __m128i *)qs);
        __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
        if (five) {
            const uint8_t *hb = b + (id == 6 ? 2 : 4);
            codes = _mm256_or_si256(codes, bits16((uint32_t)hb[0] | (uint32_t)hb[1] << 8 | (uint32_t)hb[2] << 16
                                                  | (uint32_t)hb[3] << 24));
        }
        a[0] = h2f(b), c[0] = (id == 3 || id == 7) ? h2f(b + 2) : 0.0f;
        put32(codes, q, 0, id == 2 ? -8.0f : id == 6 ? -16.0f : 0.0f, a[0]);
        return;
    }
    case 8:
        a[0] = h2f(b), c[0] = 0.0f;
        put32(_mm256_loadu_si256((const __m256i *)(b + 2)), q, 1, 0.0f, a[0]);
        return;
    case 12: case 13: {
        float d = h2f(b), dmin = h2f(b + 2);
        const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + (id == 12 ? 16 : 48);
        __m256i hv = id == 13 ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
        const __m256i one = _mm256_set1_epi8(1);
        for (int s = 0; s < 8; s++) {
            int scale, min;
            scale_min_k4(s, sc, &scale, &min);
            a[s] = d * (float)scale, c[s] = -(dmin * (float)min);
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * (s / 2)));
            if (s & 1) v = _mm256_srli_epi16(v, 4);
            v = _mm256_and_si256(v, low4);
            if (id == 13) {
                __m256i h = _mm256_and_si256(_mm256_srl_epi16(hv, _mm_cvtsi32_si128(s)), one);
                v = _mm256_or_si256(v, _mm256_slli_epi16(h, 4));
            }
            put32(v, q + 32 * s, 0, 0.0f, a[s]);
        }
        return;
    }
    case 14: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = h2f(b + 208);
        for (int s = 0; s < 16; s++) a[s] = d * (float)sc[s], c[s] = 0.0f;
        const __m256i three = _mm256_set1_epi8(3), m32 = _mm256_set1_epi8(32);
        for (int h = 0; h < 2; h++, ql += 64, qh += 32) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            __m256i hv = _mm256_loadu_si256((const __m256i *)qh);
            __m256i parts[4] = {
                _mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
            for (int i = 0; i < 4; i++) {
                __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hv, _mm_cvtsi32_si128(2 * i)), three);
                __m256i v = _mm256_sub_epi8(_mm256_or_si256(parts[i], _mm256_slli_epi16(hi, 4)), m32);
                put32_2(v, q + 128 * h + 32 * i, a[8 * h + 2 * i], a[8 * h + 2 * i + 1]);
            }
        }
        return;
    }
    }
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* rows m0 .. m0 + MB of x times the decoded row (w = a * q, offsets c): y[m, n]; A accumulators
 * a row (independent chains: the FMAs' latency hidden) */
static inline __attribute__((always_inline)) void dot_tile(const float *w, const float *c, long L, long K,
                                                           int offsets, const float *x, long sx, const float *xs,
                                                           long m0, const int MB, float *y, long sy, long n) {
    const int A = MB == 1 ? 4 : 2;
    __m256 acc[4][4];
    for (int b = 0; b < MB; b++)
        for (int i = 0; i < A; i++) acc[b][i] = _mm256_setzero_ps();
    for (long k = 0; k < K; k += 8 * A)
        for (int i = 0; i < A; i++) {
            __m256 wv = _mm256_load_ps(w + k + 8 * i);
            for (int b = 0; b < MB; b++)
                acc[b][i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (m0 + b) * sx + k + 8 * i), acc[b][i]);
        }
    for (int b = 0; b < MB; b++) {
        float off = 0.0f;
        for (long s = 0; offsets && s < K / L; s++) off = fmaf(c[s], xs[(m0 + b) * (K / 32) + s], off);
        __m256 t = A == 4 ? _mm256_add_ps(_mm256_add_ps(acc[b][0], acc[b][1]), _mm256_add_ps(acc[b][2], acc[b][3]))
                          : _mm256_add_ps(acc[b][0], acc[b][1]);
        y[(m0 + b) * sy + n] = hsum8(t) + off;
    }
}
/* 32 code bytes -> 4 registers of 8 floats (code + off) * a (a0 for the first 16, a1 after) */
static inline __attribute__((always_inline)) void regs32(__m256i v, int sgn, float off, float a0, float a1, __m256 w[4]) {
    __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    __m256 o = _mm256_set1_ps(off), s0 = _mm256_set1_ps(a0), s1 = _mm256_set1_ps(a1);
    for (int i = 0; i < 4; i++) {
        __m256 f = _mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(parts[i]) : _mm256_cvtepu8_epi32(parts[i]));
        if (off != 0.0f) f = _mm256_add_ps(f, o);
        w[i] = _mm256_mul_ps(f, i < 2 ? s0 : s1);
    }
}

/* values 32 sb .. 32 sb + 31 of block b (type id, a constant after inlining) -> w (a * q, as
 * decode_row makes them) and their offset c */
static inline __attribute__((always_inline)) void load32(const long id, const uint8_t *b, int sb, __m256 w[4],
                                                         float *c) {
    const __m256i low4 = _mm256_set1_epi8(15);
    if (id == 2 || id == 3 || id == 6 || id == 7) {
        const uint8_t *qs = b + (id == 2 ? 2 : id == 6 ? 6 : id == 3 ? 4 : 8);
        __m128i v = _mm_loadu_si128((const __m128i *)qs);
        __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
        if (id == 6 || id == 7) {
            uint32_t qh;
            memcpy(&qh, b + (id == 6 ? 2 : 4), 4);
            codes = _mm256_or_si256(codes, bits16(qh));
        }
        float a = h2f(b);
        *c = (id == 3 || id == 7) ? h2f(b + 2) : 0.0f;
        regs32(codes, 0, id == 2 ? -8.0f : id == 6 ? -16.0f : 0.0f, a, a, w);
    } else if (id == 8) {
        float a = h2f(b);
        *c = 0.0f;
        regs32(_mm256_loadu_si256((const __m256i *)(b + 2)), 1, 0.0f, a, a, w);
    } else if (id == 12 || id == 13) {
        int scale, min;
        scale_min_k4(sb, b + 4, &scale, &min);
        float a = h2f(b) * (float)scale;
        *c = -(h2f(b + 2) * (float)min);
        __m256i v = _mm256_loadu_si256((const __m256i *)(b + (id == 12 ? 16 : 48) + 32 * (sb / 2)));
        if (sb & 1) v = _mm256_srli_epi16(v, 4);
        v = _mm256_and_si256(v, low4);
        if (id == 13) {
            __m256i h = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)), _mm_cvtsi32_si128(sb));
            v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(1)), 4));
        }
        regs32(v, 0, 0.0f, a, a, w);
    } else { /* Q6_K: sb = 4 h + i */
        int h = sb / 4, i = sb % 4;
        const uint8_t *ql = b + 64 * h + 32 * (i & 1), *qh = b + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = h2f(b + 208);
        __m256i l = _mm256_loadu_si256((const __m256i *)ql);
        if (i >= 2) l = _mm256_srli_epi16(l, 4);
        __m256i hi = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)qh), _mm_cvtsi32_si128(2 * i)),
                                      _mm256_set1_epi8(3));
        __m256i v = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l, low4), _mm256_slli_epi16(hi, 4)),
                                    _mm256_set1_epi8(32));
        *c = 0.0f;
        regs32(v, 1, 0.0f, d * (float)sc[2 * sb], d * (float)sc[2 * sb + 1], w);
    }
}

/* rows m0 .. m0 + MB of x times weight row `row` of type id (constants after inlining),
 * decoded in registers: y[m, n] */
static inline __attribute__((always_inline)) void fused_tile(const long id, const long QK, const long BYTES,
                                                             const uint8_t *row, long K, const float *x, long sx,
                                                             const float *xs, long m0, const int MB, float *y,
                                                             long sy, long n) {
    const int A = MB <= 2 ? 4 : 2; /* accumulators a row: chains enough to hide the FMAs' latency */
    __m256 acc[4][4];
    float off[4] = {0};
    const int offsets = id == 3 || id == 7 || id == 12 || id == 13;
    for (int b = 0; b < MB; b++)
        for (int i = 0; i < A; i++) acc[b][i] = _mm256_setzero_ps();
    for (long k = 0; k < K; k += 32) {
        __m256 w[4];
        float c;
        load32(id, row + (k / QK) * BYTES, (int)((k % QK) / 32), w, &c);
        if (QK == 32) _mm_prefetch((const char *)row + (k / QK) * BYTES + QM_AHEAD, _MM_HINT_T0);
        else if (k % QK == 0) _mm_prefetch((const char *)row + (k / QK) * BYTES + QM_AHEAD, _MM_HINT_T0);
        for (int b = 0; b < MB; b++) {
            const float *xr = x + (m0 + b) * sx + k;
            for (int i = 0; i < 4; i++) acc[b][i % A] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), acc[b][i % A]);
            if (offsets) off[b] = fmaf(c, xs[(m0 + b) * (K / 32) + k / 32], off[b]);
        }
    }
    for (int b = 0; b < MB; b++) {
        __m256 t = _mm256_add_ps(acc[b][0], acc[b][1]);
        if (A == 4) t = _mm256_add_ps(t, _mm256_add_ps(acc[b][2], acc[b][3]));
        y[(m0 + b) * sy + n] = hsum8(t) + off[b];
    }
}

/* rows n0 .. n1 of one type's segment (data at `data`, rows of `stride` bytes) times up to 4
 * rows of x at a time, decoded in registers */
static inline __attribute__((always_inline)) void fused_rows(const long id, const long QK, const long BYTES,
                                                             const gjob *j, const uint8_t *data, long stride,
                                                             long r0, long r1, long n_base) {
    for (long r = r0; r < r1; r++) {
        const uint8_t *row = data + r * stride;
        long m = 0, n = n_base + r;
        for (; m + 4 <= j->M; m += 4) fused_tile(id, QK, BYTES, row, j->K, j->x, j->sx, j->xs, m, 4, j->y, j->sy, n);
        switch (j->M - m) {
        case 3: fused_tile(id, QK, BYTES, row, j->K, j->x, j->sx, j->xs, m, 3, j->y, j->sy, n); break;
        case 2: fused_tile(id, QK, BYTES, row, j->K, j->x, j->sx, j->xs, m, 2, j->y, j->sy, n); break;
        case 1: fused_tile(id, QK, BYTES, row, j->K, j->x, j->sx, j->xs, m, 1, j->y, j->sy, n); break;
        }
    }
}

/* the fused path of a part: each segment's share of rows [n0, n1) */
static void fused_part(const gjob *j, long n0, long n1) {
    long base = 0;
    for (long s = 0; s < j->S; s++) {
        const int64_t *e = j->seg + 4 * s;
        long r0 = n0 - base > 0 ? n0 - base : 0, r1 = n1 - base < e[1] ? n1 - base : e[1];
        const uint8_t *data = (const uint8_t *)(intptr_t)e[2];
        if (r0 < r1) switch (e[0]) {
            case 2: fused_rows(2, 32, 18, j, data, e[3], r0, r1, base); break;
            case 3: fused_rows(3, 32, 20, j, data, e[3], r0, r1, base); break;
            case 6: fused_rows(6, 32, 22, j, data, e[3], r0, r1, base); break;
            case 7: fused_rows(7, 32, 24, j, data, e[3], r0, r1, base); break;
            case 8: fused_rows(8, 32, 34, j, data, e[3], r0, r1, base); break;
            case 12: fused_rows(12, 256, 144, j, data, e[3], r0, r1, base); break;
            case 13: fused_rows(13, 256, 176, j, data, e[3], r0, r1, base); break;
            case 14: fused_rows(14, 256, 210, j, data, e[3], r0, r1, base); break;
            }
        base += e[1];
    }
}
#endif

/* one weight row (K / QK blocks) -> w [K] = a * q (the dequantized weight less its offsets),
 * offsets c [K / L] */
static void decode_row(const gtype *t, const uint8_t *row, long K, float *w, float *c) {
    long per = t->qk / t->sub, L = t->sub;
#ifdef GG_VEC
    for (long b = 0; b < K / t->qk; b++) decode_block_vec(t->id, row + b * t->bytes, w + b * t->qk, c + b * per);
    (void)L;
    return;
#endif
    float a[16];
    for (long b = 0; b < K / t->qk; b++) {
        float *wb = w + b * t->qk;
        decode_block(t->id, row + b * t->bytes, wb, a, c + b * per);
        for (long s = 0; s < per; s++) {
            float as = a[s];
            float *ws = wb + s * L;
            for (long i = 0; i < L; i++) ws[i] *= as;
        }
    }
}


/* row n's type and bytes */
static const uint8_t *row_at(const gjob *j, long n, const gtype **t) {
    for (long s = 0; s < j->S; s++) {
        const int64_t *e = j->seg + 4 * s;
        if (n < e[1]) {
            *t = gguf_type(e[0]);
            return (const uint8_t *)(intptr_t)e[2] + n * e[3];
        }
        n -= e[1];
    }
    *t = NULL;
    return NULL;
}

#ifdef __FMA__
#define MADD(a, b, c) fmaf(a, b, c)
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

/* a part's scratch row: w [K] then c [K / 16], 64-byte aligned (the vector build's whole-register
 * stores and loads; a store split in halves would stall the load that follows it) */
static float *scratch(long K) {
    size_t bytes = (sizeof(float) * (size_t)(K + K / 16) + 63) / 64 * 64;
    return aligned_alloc(64, bytes);
}

static void matmul_part(void *ctx, long p, long P) {
    const gjob *j = ctx;
    long K = j->K, n0 = j->N * p / P, n1 = j->N * (p + 1) / P;
#ifdef GG_VEC
    if (j->M <= FUSED_ROWS) { /* few rows: each weight row decoded in registers, no scratch */
        fused_part(j, n0, n1);
        return;
    }
#endif
    float *q = scratch(K);
    if (q == NULL) return; /* y stays as the caller filled it (nan): see gguf_matmul */
    float *c = q + K;
    for (long n = n0; n < n1; n++) {
        const gtype *t;
        const uint8_t *row = row_at(j, n, &t);
        decode_row(t, row, K, q, c);
        long L = t->sub, subs = K / L;
        int offsets = has_offsets(t);
#ifdef GG_VEC
        long m = 0;
        for (; m + 4 <= j->M; m += 4) dot_tile(q, c, L, K, offsets, j->x, j->sx, j->xs, m, 4, j->y, j->sy, n);
        switch (j->M - m) {
        case 3: dot_tile(q, c, L, K, offsets, j->x, j->sx, j->xs, m, 3, j->y, j->sy, n); break;
        case 2: dot_tile(q, c, L, K, offsets, j->x, j->sx, j->xs, m, 2, j->y, j->sy, n); break;
        case 1: dot_tile(q, c, L, K, offsets, j->x, j->sx, j->xs, m, 1, j->y, j->sy, n); break;
        }
        (void)subs;
#else
        for (long m = 0; m < j->M; m++) {
            const float *x = j->x + m * j->sx;
            float acc[8] = {0}, off = 0.0f;
            for (long s = 0; s < subs; s++) {
                const float *qs = q + s * L, *xv = x + s * L;
                float part[8] = {0};
                for (long i = 0; i < L; i += 8)
                    for (int l = 0; l < 8; l++) part[l] = MADD(qs[i + l], xv[i + l], part[l]);
                for (int l = 0; l < 8; l++) acc[l] += part[l];
                if (offsets) off = MADD(c[s], j->xs[m * (K / 32) + s], off); /* L = 32 where there are offsets */
            }
            float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
            j->y[m * j->sy + n] = sum + off;
        }
#endif
    }
    free(q);
}

static void rows_part(void *ctx, long p, long P) {
    const gjob *j = ctx;
    long K = j->K, t0 = j->T * p / P, t1 = j->T * (p + 1) / P;
    float *q = scratch(K);
    if (q == NULL) return;
    float *c = q + K;
    for (long r = t0; r < t1; r++) {
        const gtype *t;
        const uint8_t *row = row_at(j, j->ids != NULL ? j->ids[r] : r, &t);
        decode_row(t, row, K, q, c);
        long L = t->sub;
        float *out = j->y + r * j->sy;
        if (has_offsets(t)) /* (else a * q alone: + 0 would turn a -0 into +0) */
            for (long k = 0; k < K; k++) out[k] = q[k] + c[k / L];
        else
            memcpy(out, q, sizeof(float) * (size_t)K);
    }
    free(q);
}

/* the segment table fits together: known types, K a multiple of each one's block, rows adding
 * up to N, row bytes as the type says, data given */
int gguf_weight_ok(const int64_t *seg, long S, long N, long K) {
    long rows = 0;
    if (seg == NULL || S < 1 || K < 1 || N < 0) return 0;
    for (long s = 0; s < S; s++) {
        const int64_t *e = seg + 4 * s;
        const gtype *t = gguf_type(e[0]);
        if (t == NULL || K % t->qk || e[1] < 0 || e[3] != K / t->qk * t->bytes || (e[1] > 0 && e[2] == 0)) return 0;
        rows += e[1];
    }
    return rows == N;
}

int gguf_matmul(const int64_t *seg, long S, long N, long K, const float *x, long sx, long M, float *y, long sy) {
    if (M <= 0 || N <= 0) return 0;
    float *xs = malloc(sizeof(float) * (size_t)(M * (K / 32) + 1));
    if (xs == NULL) return -1;
    for (long m = 0; m < M; m++)
        for (long g = 0; g < K / 32; g++) {
            float s = 0.0f;
            for (int i = 0; i < 32; i++) s += x[m * sx + 32 * g + i];
            xs[m * (K / 32) + g] = s;
        }
    for (long m = 0; m < M; m++)
        for (long n = 0; n < N; n++) y[m * sy + n] = NAN; /* a part that cannot get scratch leaves nan */
    gjob j = {.seg = seg, .S = S, .N = N, .K = K, .x = x, .sx = sx, .M = M, .xs = xs, .y = y, .sy = sy};
    long bytes = 0;
    for (long s = 0; s < S; s++) bytes += seg[4 * s + 1] * seg[4 * s + 3];
    long parts = qm_parts(bytes), most = N / 4 > 0 ? N / 4 : 1;
    pool_run(matmul_part, &j, parts < most ? parts : most);
    free(xs);
    return 0;
}

/* gguf_linear(x, sx, M, K, seg, S, N, y, sy) */
PyObject *gguf_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "gguf_linear takes 9 arguments");
        return NULL;
    }
    const float *x = PyLong_AsVoidPtr(args[0]);
    long sx = PyLong_AsLong(args[1]), M = PyLong_AsLong(args[2]), K = PyLong_AsLong(args[3]);
    const int64_t *seg = PyLong_AsVoidPtr(args[4]);
    long S = PyLong_AsLong(args[5]), N = PyLong_AsLong(args[6]);
    float *y = PyLong_AsVoidPtr(args[7]);
    long sy = PyLong_AsLong(args[8]);
    if (PyErr_Occurred()) return NULL;
    if (M < 0 || sx < K || sy < N || !gguf_weight_ok(seg, S, N, K)) {
        PyErr_SetString(PyExc_ValueError, "gguf_linear: the segments do not fit together (types, K, rows)");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = gguf_matmul(seg, S, N, K, x, sx, M, y, sy);
    Py_END_ALLOW_THREADS
    if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* gguf_rows(seg, S, N, K, ids (0: rows 0..T-1), T, out): rows dequantized, out [T, K] */
PyObject *gguf_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "gguf_rows takes 7 arguments");
        return NULL;
    }
    const int64_t *seg = PyLong_AsVoidPtr(args[0]);
    long S = PyLong_AsLong(args[1]), N = PyLong_AsLong(args[2]), K = PyLong_AsLong(args[3]);
    const int64_t *ids = PyLong_AsVoidPtr(args[4]);
    long T = PyLong_AsLong(args[5]);
    float *out = PyLong_AsVoidPtr(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (T < 0 || !gguf_weight_ok(seg, S, N, K) || (ids == NULL && T > N)) {
        PyErr_SetString(PyExc_ValueError, "gguf_rows: the segments do not fit together, or more rows than N");
        return NULL;
    }
    for (long t = 0; ids != NULL && t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) {
            PyErr_Format(PyExc_IndexError, "gguf_rows: row %ld outside [0, %ld)", (long)ids[t], N);
            return NULL;
        }
    gjob j = {.seg = seg, .S = S, .N = N, .K = K, .y = out, .sy = K, .ids = ids, .T = T};
    long parts = qm_parts(T * K), most = T / 8 > 0 ? T / 8 : 1;
    Py_BEGIN_ALLOW_THREADS
    pool_run(rows_part, &j, parts < most ? parts : most);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
