/* The vector build's GGUF block kernels (AVX2 + FMA + F16C, also compiled where AVX-512 is): a
 * block's codes widened and converted 8 at a time (load32, the one decode), then either scaled and
 * stored to a part's scratch row (gguf_decode_block_vec, many rows of x) or multiplied in
 * registers with up to 4 rows of x at a time (gguf_fused_part, few rows: one pass over the
 * weight's bytes per 4 rows). Values and offsets as gguf_blocks.c's scalar decode gives them, bit
 * for bit. */
#include "gguf_blocks.h"
#ifdef GG_VEC
/* the 32 bits of qh as 32 bytes of 0 / 16 (bit i -> byte i) */
static inline __m256i bits16(uint32_t qh) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3);
    const __m256i mask = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), shuf);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, mask), mask);
    return _mm256_and_si256(v, _mm256_set1_epi8(16));
}

/* 32 code bytes -> 4 registers of 8 floats, unscaled (signed codes: their offset already taken
 * off in the bytes) */
static inline __attribute__((always_inline)) void codes32(__m256i v, int sgn, __m256 w[4]) {
    __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(parts[i]) : _mm256_cvtepu8_epi32(parts[i]));
}

/* values 32 sb .. 32 sb + 31 of block b (type id, a constant after inlining) -> their codes q
 * (floats, unscaled), the scales a0 (first 16) and a1 (last 16; a0 but for Q6_K) and the offset
 * c: the weights are a * q + c */
static inline __attribute__((always_inline)) void load32(const long id, const uint8_t *b, int sb, __m256 w[4],
                                                         float *a0, float *a1, float *c) {
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
        *a0 = *a1 = h2f(b);
        *c = (id == 3 || id == 7) ? h2f(b + 2) : 0.0f;
        if (id == 2 || id == 6) /* symmetric: code - 8 (- 16), in the bytes */
            codes32(_mm256_sub_epi8(codes, _mm256_set1_epi8(id == 2 ? 8 : 16)), 1, w);
        else
            codes32(codes, 0, w);
    } else if (id == 8) {
        *a0 = *a1 = h2f(b);
        *c = 0.0f;
        codes32(_mm256_loadu_si256((const __m256i *)(b + 2)), 1, w);
    } else if (id == 12 || id == 13) {
        int scale, min;
        scale_min_k4(sb, b + 4, &scale, &min);
        *a0 = *a1 = h2f(b) * (float)scale;
        *c = -(h2f(b + 2) * (float)min);
        __m256i v = _mm256_loadu_si256((const __m256i *)(b + (id == 12 ? 16 : 48) + 32 * (sb / 2)));
        if (sb & 1) v = _mm256_srli_epi16(v, 4);
        v = _mm256_and_si256(v, low4);
        if (id == 13) {
            __m256i h = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)), _mm_cvtsi32_si128(sb));
            v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(1)), 4));
        }
        codes32(v, 0, w);
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
        *a0 = d * (float)sc[2 * sb], *a1 = d * (float)sc[2 * sb + 1];
        codes32(v, 1, w);
    }
}

/* block b of type id (a constant after inlining) -> w = a * q [QK], offsets c [QK / L]: load32's
 * codes and scales, multiplied and stored (the values gguf_blocks.c's scalar decode gives) */
static inline __attribute__((always_inline)) void decode_block(const long id, const long QK, const uint8_t *b,
                                                               float *q, float *c) {
    for (int sb = 0; sb < QK / 32; sb++) {
        __m256 w[4];
        float a0, a1, cs;
        load32(id, b, sb, w, &a0, &a1, &cs);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(q + 32 * sb + 8 * i, _mm256_mul_ps(w[i], _mm256_set1_ps(i < 2 ? a0 : a1)));
        if (id == 14) /* sub-blocks of 16: no offsets */
            c[2 * sb] = c[2 * sb + 1] = 0.0f;
        else
            c[sb] = cs;
    }
}

#define DECODE_CASE(id, qk, bytes, sub) case id: decode_block(id, qk, b, q, c); return;
void gguf_decode_block_vec(long id, const uint8_t *b, float *q, float *c) {
    switch (id) { GGUF_TYPES(DECODE_CASE) }
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
/* rows m0 .. m0 + MB of x times weight row `row` of type id (constants after inlining),
 * decoded in registers: y[m, n] */
static inline __attribute__((always_inline)) void fused_tile(const long id, const long QK, const long BYTES,
                                                             const uint8_t *row, long K, const float *x, long sx,
                                                             const float *xs, long m0, const int MB, float *y,
                                                             long sy, long n) {
    __m256 acc[4][2]; /* [1]: Q6_K's second scale's sums */
    float off[4] = {0};
    const int offsets = has_offsets(id);
    for (int b = 0; b < MB; b++) acc[b][0] = acc[b][1] = _mm256_setzero_ps();
    for (long k = 0; k < K; k += 32) {
        __m256 w[4];
        float a0, a1, c;
        load32(id, row + (k / QK) * BYTES, (int)((k % QK) / 32), w, &a0, &a1, &c);
        if (QK == 32 || k % QK == 0) _mm_prefetch((const char *)row + (k / QK) * BYTES + QM_AHEAD, _MM_HINT_T0);
        __m256 s0 = _mm256_set1_ps(a0), s1 = _mm256_set1_ps(a1);
        for (int b = 0; b < MB; b++) { /* a0 * (q . x) over the block (Q6_K: a0 and a1 over its halves) */
            const float *xr = x + (m0 + b) * sx + k;
            __m256 p = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
            p = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), p);
            if (id == 14) {
                __m256 p1 = _mm256_mul_ps(w[2], _mm256_loadu_ps(xr + 16));
                p1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), p1);
                acc[b][1] = _mm256_fmadd_ps(p1, s1, acc[b][1]);
            } else {
                p = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), p);
                p = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), p);
            }
            acc[b][0] = _mm256_fmadd_ps(p, s0, acc[b][0]);
            if (offsets) off[b] = fmaf(c, xs[(m0 + b) * (K / 32) + k / 32], off[b]);
        }
    }
    for (int b = 0; b < MB; b++) y[(m0 + b) * sy + n] = hsum8(_mm256_add_ps(acc[b][0], acc[b][1])) + off[b];
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

#define FUSED_CASE(id, qk, bytes, sub) case id: fused_rows(id, qk, bytes, j, data, e[3], r0, r1, base); break;
/* the fused path of a part: each segment's share of rows [n0, n1) */
void gguf_fused_part(const gjob *j, long n0, long n1) {
    long base = 0;
    for (long s = 0; s < j->S; s++) {
        const int64_t *e = j->seg + 4 * s;
        long r0 = n0 - base > 0 ? n0 - base : 0, r1 = n1 - base < e[1] ? n1 - base : e[1];
        const uint8_t *data = (const uint8_t *)(intptr_t)e[2];
        if (r0 < r1) switch (e[0]) { GGUF_TYPES(FUSED_CASE) }
        base += e[1];
    }
}

void gguf_dot_row_vec(const gjob *j, const float *w, const float *c, long L, int offsets, long n) {
    long m = 0, K = j->K;
    for (; m + 4 <= j->M; m += 4) dot_tile(w, c, L, K, offsets, j->x, j->sx, j->xs, m, 4, j->y, j->sy, n);
    switch (j->M - m) {
    case 3: dot_tile(w, c, L, K, offsets, j->x, j->sx, j->xs, m, 3, j->y, j->sy, n); break;
    case 2: dot_tile(w, c, L, K, offsets, j->x, j->sx, j->xs, m, 2, j->y, j->sy, n); break;
    case 1: dot_tile(w, c, L, K, offsets, j->x, j->sx, j->xs, m, 1, j->y, j->sy, n); break;
    }
}
#endif
