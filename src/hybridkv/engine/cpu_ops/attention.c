/* Paged decode attention of one query per sequence (see cpu_ops/bindings.py: decode_attention):
 * each sequence's new K/V written to its slot, then its query heads attend to first[s] .. pos[s]
 * read straight through the block table (no gathered copy, no padding, no mask), GQA by h / rep.
 * Split over the kernels' threads by keys (flash-decoding): each (sequence, KV head)'s keys in
 * units of KEY_PART, a unit's softmax pieces combined after, so one sequence with one KV head
 * uses every core from a few hundred keys on, and the result is the same whatever the thread
 * count. gcc vectorizes the loops (#pragma omp simd).
 *
 * Worked example: 600 keys, KEY_PART 256 -> units of keys 0-255, 256-511, 512-599; each unit u
 * leaves (m_u, l_u, o_u) = (max score, sum e^(score - m_u), sum e^(score - m_u) v); with
 * M = max m_u the output is sum e^(m_u - M) o_u / sum e^(m_u - M) l_u, the softmax of all 600.
 *
 * The cache may hold fp32, bf16 or fp16 (attn_job.kv_type): a bf16 / fp16 run of up to RUN keys is
 * widened to fp32 once (exactly: every bf16 / fp16 value is an fp32 one) and then read by the fp32
 * loops, so the scores are those of the fp32 query against the stored keys; the new K/V is rounded
 * to the cache's type as torch's .to(dtype) rounds it. */
#include "cpu_ops.h"

int attend_check(const attn_job *a, char *err, size_t size) {
    long bs = a->bs;
    if (bs < 1 || a->Hkv < 1 || a->rep < 1 || a->D < 1 || a->S < 0 || a->kv_type < KV_F32 || a->kv_type > KV_F16) {
        snprintf(err, size, "bad attention shapes: block size %ld, %ld KV heads x %ld, head size %ld, KV type %ld", bs,
                 a->Hkv, a->rep, a->D, a->kv_type);
        return -1;
    }
    for (long s = 0; s < a->S; s++) {
        const int64_t *table = a->tables + s * a->table_stride;
        long p_last = (long)a->pos[s], p0 = (long)a->first[s];
        if (p0 < 0 || p_last < p0 || p_last / bs >= a->table_width) {
            snprintf(err, size, "sequence %ld: positions %ld..%ld outside its table of %ld blocks of %ld", s, p0,
                     p_last, a->table_width, bs);
            return -1;
        }
        for (long b = p0 / bs; b <= p_last / bs; b++) {
            if (table[b] < 0 || table[b] >= a->num_slots / bs) {
                snprintf(err, size, "sequence %ld: block id %ld outside the pool of %ld slots", s, (long)table[b],
                         a->num_slots);
                return -1;
            }
        }
    }
    return 0;
}

/* keys one unit of work attends to: an item's keys are cut into parts of KEY_PART (fixed by the
 * key range, never by the thread count, so the result does not depend on how many threads ran) */
#define KEY_PART 256
#define MAX_PARTS 64
/* keys of a bf16 / fp16 cache widened to fp32 at a time (a thread's scratch: RUN rows of D) */
#define RUN 16

/* A job's units: unit u = (item, the keys k0 .. k1 of its sequence), item i = (sequence s, KV
 * head g) = (i / Hkv, i % Hkv), its units in key order. An item of one unit writes its output
 * itself; one of several leaves, per query head r, (m, l, o[D]) = (its scores' max, sum of
 * e^(score - m), sum of e^(score - m) v) in `part` for the combine. */
typedef struct {
    const attn_job *a;
    long *item_of, *k0, *first_unit; /* [units], [units], [items + 1] */
    float *sc;                       /* per thread part: [rep, KEY_PART] scores, then [RUN, D] rows */
    float *part;                     /* [units, rep, D + 2] */
    long bounds[MAX_PARTS + 1];      /* thread part p: units bounds[p] .. bounds[p + 1] */
    long ibounds[MAX_PARTS + 1];     /* combine part p: items ibounds[p] .. ibounds[p + 1] */
} attn_split;

#if defined(__AVX2__) && defined(__FMA__) && !defined(HYBRIDKV_GENERIC)
#define ATT_AVX2 1
#include <immintrin.h>
#endif

/* sc[r * n + i] = scale * q_r . k_i for the len consecutive key rows k (stride D), i < len: with
 * AVX2 8 keys at a time (8 accumulators, reduced to one vector of their 8 sums), so no key pays
 * a horizontal sum of its own */
static void scores_run(const float *q, long q_sH, long rep, const float *k, long len, long D, float scale, float *sc,
                       long n) {
    long i = 0;
#ifdef ATT_AVX2
    if (D % 8 == 0)
        for (; i + 8 <= len; i += 8)
            for (long r = 0; r < rep; r++) {
                const float *qr = q + r * q_sH, *kb = k + i * D;
                __m256 acc[8];
                for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
                for (long d = 0; d < D; d += 8) {
                    __m256 qv = _mm256_loadu_ps(qr + d);
                    for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(kb + t * D + d), qv, acc[t]);
                }
                __m256 h0 = _mm256_hadd_ps(acc[0], acc[1]), h1 = _mm256_hadd_ps(acc[2], acc[3]);
                __m256 h2 = _mm256_hadd_ps(acc[4], acc[5]), h3 = _mm256_hadd_ps(acc[6], acc[7]);
                __m256 h4 = _mm256_hadd_ps(h0, h1), h5 = _mm256_hadd_ps(h2, h3); /* [k0..k3 | k0..k3] halves */
                __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(h4, h5, 0x20), _mm256_permute2f128_ps(h4, h5, 0x31));
                _mm256_storeu_ps(sc + r * n + i, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
            }
#endif
    for (; i < len; i++)
        for (long r = 0; r < rep; r++) {
            const float *qr = q + r * q_sH, *kr = k + i * D;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (long d = 0; d < D; d++) acc += qr[d] * kr[d];
            sc[r * n + i] = acc * scale;
        }
}

/* o[0 .. D) += sum_i w[i] v_i over the len consecutive value rows v (stride D): with AVX2 the
 * output in registers, 64 columns at a time (a fixed count of 8 accumulators: with a variable
 * one gcc keeps them on the stack), then 8 at a time, instead of loaded and stored once a key */
static void values_run(const float *w, const float *v, long len, long D, float *o) {
    long d0 = 0;
#ifdef ATT_AVX2
    for (; d0 + 64 <= D; d0 += 64) {
        __m256 acc[8];
        for (int t = 0; t < 8; t++) acc[t] = _mm256_loadu_ps(o + d0 + 8 * t);
        for (long i = 0; i < len; i++) {
            __m256 wv = _mm256_set1_ps(w[i]);
            const float *vr = v + i * D + d0;
            for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vr + 8 * t), acc[t]);
        }
        for (int t = 0; t < 8; t++) _mm256_storeu_ps(o + d0 + 8 * t, acc[t]);
    }
    for (; d0 + 8 <= D; d0 += 8) {
        __m256 acc = _mm256_loadu_ps(o + d0);
        for (long i = 0; i < len; i++) acc = _mm256_fmadd_ps(_mm256_set1_ps(w[i]), _mm256_loadu_ps(v + i * D + d0), acc);
        _mm256_storeu_ps(o + d0, acc);
    }
#endif
    if (d0 < D)
        for (long i = 0; i < len; i++) {
            const float *vr = v + i * D;
#pragma omp simd
            for (long d = d0; d < D; d++) o[d] += w[i] * vr[d];
        }
}

/* dst[0 .. count) = the count bf16 / fp16 (type) values at src, widened to fp32 (exact) */
static void widen(const void *src, long type, long count, float *dst) {
    const uint16_t *h = src;
    long i = 0;
    if (type == KV_BF16) {
#ifdef ATT_AVX2
        for (; i + 8 <= count; i += 8) {
            __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
        }
#endif
        for (; i < count; i++) dst[i] = bf16_to_f32(h[i]);
    } else {
#ifdef ATT_AVX2
        for (; i + 8 <= count; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
        for (; i < count; i++) dst[i] = f16_to_f32(h[i]);
    }
}

/* the fp32 rows of the len keys (or values) from offset off of block id blk among the head's rows
 * `head`: the cache itself when fp32, else widened into tmp ([RUN, D]) */
static const float *key_rows(const attn_job *a, const char *head, long blk, long off, long len, float *tmp) {
    long D = a->D, esz = a->kv_type == KV_F32 ? 4 : 2;
    const char *src = head + (blk * a->bs + off) * D * esz;
    if (a->kv_type == KV_F32) return (const float *)src;
    widen(src, a->kv_type, len * D, tmp);
    return tmp;
}

/* unit u: scores of the rep query heads against its keys, their softmax pieces, the output
 * (one unit) or the partial sums (several) */
static void attend_unit(const attn_split *c, long u, float *sc, float *tmp) {
    const attn_job *a = c->a;
    long D = a->D, rep = a->rep, Hkv = a->Hkv, bs = a->bs, num_slots = a->num_slots, Hq = Hkv * rep;
    long i = c->item_of[u], s = i / Hkv, g = i % Hkv;
    const int64_t *table = a->tables + s * a->table_stride;
    long p0 = c->k0[u], p_last = (long)a->pos[s];
    long p1 = p0 + KEY_PART - 1 < p_last ? p0 + KEY_PART - 1 : p_last, n = p1 - p0 + 1;
    long esz = a->kv_type == KV_F32 ? 4 : 2, run = a->kv_type == KV_F32 ? bs : RUN;
    const float *qg = a->q + s * a->q_sS + g * rep * a->q_sH;
    const char *kg = (const char *)a->kv + g * num_slots * D * esz;
    const char *vg = (const char *)a->kv + (Hkv + g) * num_slots * D * esz;
    for (long b = p0 / bs, j = 0; b <= p1 / bs; b++) { /* scores [rep, n], block by block, run by run */
        long lo = b * bs > p0 ? b * bs : p0, hi = (b + 1) * bs <= p1 ? (b + 1) * bs : p1 + 1;
        for (long r0 = lo; r0 < hi; r0 += run) {
            long len = hi - r0 < run ? hi - r0 : run;
            scores_run(qg, a->q_sH, rep, key_rows(a, kg, (long)table[b], r0 - b * bs, len, tmp), len, D, a->scale,
                       sc + j, n);
            j += len;
        }
    }
    int whole = c->first_unit[i + 1] - c->first_unit[i] == 1;
    float *og = whole ? a->out + (s * Hq + g * rep) * D : NULL;
    for (long r = 0; r < rep; r++) { /* e^(score - max) and their sum per query head */
        float *row = sc + r * n, mx = row[0], sum = 0.0f;
        for (long j = 1; j < n; j++) mx = row[j] > mx ? row[j] : mx;
#pragma omp simd reduction(+ : sum)
        for (long j = 0; j < n; j++) {
            float e = exp_neg(row[j] - mx);
            row[j] = e;
            sum += e;
        }
        float *o = whole ? og + r * D : c->part + (u * rep + r) * (D + 2) + 2;
        memset(o, 0, D * sizeof(float));
        if (whole) { /* one unit: the probabilities themselves */
            float inv = 1.0f / sum;
#pragma omp simd
            for (long j = 0; j < n; j++) row[j] *= inv;
        } else {
            o[-2] = mx, o[-1] = sum;
        }
    }
    for (long b = p0 / bs, j = 0; b <= p1 / bs; b++) { /* o_r += sum_j w[r, j] v_j, run by run, in key order */
        long lo = b * bs > p0 ? b * bs : p0, hi = (b + 1) * bs <= p1 ? (b + 1) * bs : p1 + 1;
        for (long r0 = lo; r0 < hi; r0 += run) {
            long len = hi - r0 < run ? hi - r0 : run;
            const float *v = key_rows(a, vg, (long)table[b], r0 - b * bs, len, tmp);
            for (long r = 0; r < rep; r++)
                values_run(sc + r * n + j, v, len, D, whole ? og + r * D : c->part + (u * rep + r) * (D + 2) + 2);
            j += len;
        }
    }
}

static void attend_part(void *ctx, long p, long P) {
    const attn_split *c = ctx;
    float *sc = c->sc + p * (c->a->rep * KEY_PART + RUN * c->a->D);
    for (long u = c->bounds[p]; u < c->bounds[p + 1]; u++) attend_unit(c, u, sc, sc + c->a->rep * KEY_PART);
}

/* items of several units: out = sum_u e^(m_u - M) o_u / sum_u e^(m_u - M) l_u, M the largest
 * m_u, in unit order */
static void combine_part(void *ctx, long p, long P) {
    const attn_split *c = ctx;
    const attn_job *a = c->a;
    long D = a->D, rep = a->rep, Hq = a->Hkv * rep;
    for (long i = c->ibounds[p]; i < c->ibounds[p + 1]; i++) {
        long u0 = c->first_unit[i], u1 = c->first_unit[i + 1];
        if (u1 - u0 == 1) continue;
        long s = i / a->Hkv, g = i % a->Hkv;
        for (long r = 0; r < rep; r++) {
            float M = -INFINITY, L = 0.0f, *o = a->out + (s * Hq + g * rep + r) * D;
            for (long u = u0; u < u1; u++) {
                float mu = c->part[(u * rep + r) * (D + 2)];
                M = mu > M ? mu : M;
            }
            memset(o, 0, D * sizeof(float));
            for (long u = u0; u < u1; u++) {
                const float *pu = c->part + (u * rep + r) * (D + 2);
                float f = exp_neg(pu[0] - M);
                L += f * pu[1];
#pragma omp simd
                for (long d = 0; d < D; d++) o[d] += f * pu[2 + d];
            }
            float inv = 1.0f / L;
#pragma omp simd
            for (long d = 0; d < D; d++) o[d] *= inv;
        }
    }
}

/* the D values x stored at element e of the cache, rounded to its type */
static void store_row(const attn_job *a, long e, const float *x) {
    long D = a->D;
    if (a->kv_type == KV_F32) {
        memcpy((float *)a->kv + e, x, D * sizeof(float));
        return;
    }
    uint16_t *h = (uint16_t *)a->kv + e;
    if (a->kv_type == KV_BF16)
        for (long d = 0; d < D; d++) h[d] = f32_to_bf16(x[d]);
    else
        for (long d = 0; d < D; d++) h[d] = f32_to_f16(x[d]);
}

/* Each sequence's K/V write, then its attention: every (sequence, KV head)'s keys cut into units
 * of KEY_PART keys, the units split over the kernels' threads (a single sequence's one KV head
 * included), the items of several units combined after. -1 when out of memory. */
int attend(const attn_job *a) {
    long D = a->D, Hkv = a->Hkv, rep = a->rep, bs = a->bs, items = a->S * Hkv, units = 0, keys = 0;
    long multi = 0; /* units of items with several */
    for (long i = 0; i < items; i++) { /* the new K/V first: a later unit of the item reads it */
        long s = i / Hkv, g = i % Hkv, n = (long)(a->pos[s] - a->first[s] + 1), k = (n + KEY_PART - 1) / KEY_PART;
        units += k, keys += n, multi += k > 1 ? k : 0;
        if (a->k_new != NULL) {
            const int64_t *table = a->tables + s * a->table_stride;
            long p = (long)a->pos[s], slot = (long)table[p / bs] * bs + p % bs;
            store_row(a, (g * a->num_slots + slot) * D, a->k_new + s * a->new_sS + g * a->new_sH);
            store_row(a, ((Hkv + g) * a->num_slots + slot) * D, a->v_new + s * a->new_sS + g * a->new_sH);
        }
    }
    long parts = keys * rep * D / 65536 + 1; /* ~64 K multiply-adds a part at least */
    long threads = pool_threads();
    parts = parts < threads ? parts : threads;
    parts = parts < units ? parts : units;
    parts = parts < MAX_PARTS ? parts : MAX_PARTS;
    if (parts < 1) parts = 1;
    attn_split c = {.a = a};
    size_t ints = (size_t)(2 * units + items + 1), floats = (size_t)(parts * (rep * KEY_PART + RUN * D));
    floats += multi ? (size_t)(units * rep * (D + 2)) : 0;
    char *buf = malloc(sizeof(long) * ints + sizeof(float) * floats);
    if (buf == NULL) return -1;
    c.item_of = (long *)buf, c.k0 = c.item_of + units, c.first_unit = c.k0 + units;
    c.sc = (float *)(c.first_unit + items + 1);
    c.part = multi ? c.sc + parts * (rep * KEY_PART + RUN * D) : NULL;
    for (long i = 0, u = 0; i < items; i++) {
        long s = i / Hkv;
        c.first_unit[i] = u;
        for (long p = (long)a->first[s]; p <= (long)a->pos[s]; p += KEY_PART, u++) c.item_of[u] = i, c.k0[u] = p;
    }
    c.first_unit[items] = units;
    { /* thread parts of about equal keys (a unit's keys: KEY_PART but the item's last) */
        long u = 0, seen = 0;
        c.bounds[0] = 0;
        for (long p = 0; p < parts; p++) {
            while (u < units && (p == parts - 1 || seen * parts < keys * (p + 1))) {
                long last = (long)a->pos[c.item_of[u] / Hkv];
                seen += c.k0[u] + KEY_PART - 1 < last ? KEY_PART : last - c.k0[u] + 1, u++;
            }
            c.bounds[p + 1] = u;
        }
    }
    pool_run(attend_part, &c, parts);
    if (multi) {
        long cparts = parts < items ? parts : items;
        for (long p = 0; p <= cparts; p++) c.ibounds[p] = items * p / cparts;
        pool_run(combine_part, &c, cparts);
    }
    free(buf);
    return 0;
}
