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
#include "gguf_blocks.h"

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

/* one weight row (K / QK blocks) -> w [K] = a * q (the dequantized weight less its offsets),
 * offsets c [K / L] */
static void decode_row(const gtype *t, const uint8_t *row, long K, float *w, float *c) {
    long per = t->qk / t->sub;
#ifdef GG_VEC
    for (long b = 0; b < K / t->qk; b++) gguf_decode_block_vec(t->id, row + b * t->bytes, w + b * t->qk, c + b * per);
#else
    long L = t->sub;
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
#endif
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

static void matmul_part(void *ctx, long p, long P) {
    const gjob *j = ctx;
    long K = j->K, n0 = j->N * p / P, n1 = j->N * (p + 1) / P;
#ifdef GG_VEC
    if (j->M <= FUSED_ROWS) { /* few rows: each weight row decoded in registers, no scratch */
        gguf_fused_part(j, n0, n1);
        return;
    }
#endif
    float *q = j->scratch + p * scratch_floats(K), *c = q + K;
    for (long n = n0; n < n1; n++) {
        const gtype *t;
        const uint8_t *row = row_at(j, n, &t);
        decode_row(t, row, K, q, c);
        long L = t->sub;
        int offsets = has_offsets(t->id);
#ifdef GG_VEC
        gguf_dot_row_vec(j, q, c, L, offsets, n);
#else
        for (long m = 0; m < j->M; m++) {
            const float *x = j->x + m * j->sx;
            float acc[8] = {0}, off = 0.0f;
            for (long s = 0; s < K / L; s++) {
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
}

static void rows_part(void *ctx, long p, long P) {
    const gjob *j = ctx;
    long K = j->K, t0 = j->T * p / P, t1 = j->T * (p + 1) / P;
    float c[K / 16 + 1]; /* a row's offsets (K / L of them) */
    for (long r = t0; r < t1; r++) {
        const gtype *t;
        const uint8_t *row = row_at(j, j->ids != NULL ? j->ids[r] : r, &t);
        float *out = j->y + r * j->sy;
        decode_row(t, row, K, out, c); /* a * q, then + c: gguf's values (+ 0 would turn a -0 into +0) */
        long L = t->sub;
        if (has_offsets(t->id))
            for (long sb = 0; sb < K / L; sb++) {
                float cs = c[sb];
                for (long i = sb * L; i < (sb + 1) * L; i++) out[i] += cs;
            }
    }
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
    long bytes = 0, offsets = 0;
    for (long s = 0; s < S; s++) bytes += seg[4 * s + 1] * seg[4 * s + 3], offsets |= has_offsets(seg[4 * s]);
    long parts = qm_parts(bytes), most = N / 4 > 0 ? N / 4 : 1;
    parts = parts < most ? parts : most;
    int fused = 0;
#ifdef GG_VEC
    fused = M <= FUSED_ROWS;
#endif
    /* the sums of x per 32 columns where a segment has offsets; the parts' scratch rows where
     * they decode a row for all rows of x: allocated before any part runs (64-byte aligned: the
     * vector build's whole-register loads), so a part never fails */
    size_t nxs = offsets ? (size_t)(M * (K / 32)) : 0, nscratch = fused ? 0 : (size_t)(parts * scratch_floats(K));
    float *buf = aligned_alloc(64, sizeof(float) * (nscratch + (nxs + 15) / 16 * 16 + 16));
    if (buf == NULL) return -1;
    float *xs = offsets ? buf + nscratch : NULL;
    for (long m = 0; m < M && xs != NULL; m++)
        for (long g = 0; g < K / 32; g++) {
            float s = 0.0f;
            for (int i = 0; i < 32; i++) s += x[m * sx + 32 * g + i];
            xs[m * (K / 32) + g] = s;
        }
    gjob j = {.seg = seg, .S = S, .N = N, .K = K, .x = x, .sx = sx, .M = M, .xs = xs, .y = y, .sy = sy,
              .scratch = fused ? NULL : buf};
    pool_run(matmul_part, &j, parts);
    free(buf);
    return 0;
}

/* gguf_linear(x, sx, M, K, seg, S, N, y, sy) */
PyObject *gguf_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(gguf_linear, 9)
    const float *x = PTR(0);
    long sx = LONG(1), M = LONG(2), K = LONG(3);
    const int64_t *seg = PTR(4);
    long S = LONG(5), N = LONG(6);
    float *y = PTR(7);
    long sy = LONG(8);
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
    ARGS(gguf_rows, 7)
    const int64_t *seg = PTR(0);
    long S = LONG(1), N = LONG(2), K = LONG(3);
    const int64_t *ids = PTR(4);
    long T = LONG(5);
    float *out = PTR(6);
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
