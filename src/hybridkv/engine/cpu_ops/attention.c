/* Paged decode attention of one query per sequence (see cpu_ops/bindings.py: decode_attention):
 * each sequence's new K/V written to its slot, then its query heads attend to first[s] .. pos[s]
 * read straight through the block table (no gathered copy, no padding, no mask), GQA by h / rep.
 * Single-threaded; gcc vectorizes the loops (#pragma omp simd). */
#include "cpu_ops.h"

int attend_check(const attn_job *a, char *err, size_t size) {
    long bs = a->bs;
    if (bs < 1 || a->Hkv < 1 || a->rep < 1 || a->D < 1 || a->S < 0) {
        snprintf(err, size, "bad attention shapes: block size %ld, %ld KV heads x %ld, head size %ld", bs, a->Hkv,
                 a->rep, a->D);
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

/* Work items i0 .. i1-1 of a job, item i = (sequence s, KV head g) = (i / Hkv, i % Hkv): write
 * its new K/V at pos[s], then attend from its rep query heads to positions first[s] .. pos[s]
 * (validated by the caller); sc: room for rep x the longest key range. Items touch disjoint
 * cache rows (head g of slot pos[s]) and output rows. */
static void attend_range(const attn_job *a, long i0, long i1, float *sc) {
    long D = a->D, rep = a->rep, Hkv = a->Hkv, bs = a->bs, num_slots = a->num_slots;
    float *keys_v = a->kv + Hkv * num_slots * D;
    long Hq = Hkv * rep;
    for (long i = i0; i < i1; i++) {
        long s = i / Hkv, g = i % Hkv;
        const int64_t *table = a->tables + s * a->table_stride;
        long p_last = (long)a->pos[s], p0 = (long)a->first[s];
        long n = p_last - p0 + 1;
        if (a->k_new != NULL) {
            long slot = (long)table[p_last / bs] * bs + p_last % bs;
            memcpy(a->kv + (g * num_slots + slot) * D, a->k_new + s * a->new_sS + g * a->new_sH, D * sizeof(float));
            memcpy(keys_v + (g * num_slots + slot) * D, a->v_new + s * a->new_sS + g * a->new_sH, D * sizeof(float));
        }
        { /* the attention of head g's rep query heads */
            const float *qg = a->q + s * a->q_sS + g * rep * a->q_sH;
            const float *kg = a->kv + g * num_slots * D;
            const float *vg = keys_v + g * num_slots * D;
            /* scores [rep, n], block by block (a block's slots are consecutive rows) */
            for (long b = p0 / bs, j = 0; b <= p_last / bs; b++) {
                long lo = b * bs > p0 ? b * bs : p0, hi = (b + 1) * bs <= p_last ? (b + 1) * bs : p_last + 1;
                const float *k = kg + ((long)table[b] * bs + (lo - b * bs)) * D;
                for (long p = lo; p < hi; p++, j++, k += D) {
                    for (long r = 0; r < rep; r++) {
                        const float *qr = qg + r * a->q_sH;
                        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                        for (long d = 0; d < D; d++) acc += qr[d] * k[d];
                        sc[r * n + j] = acc * a->scale;
                    }
                }
            }
            /* softmax per query head */
            for (long r = 0; r < rep; r++) {
                float *row = sc + r * n;
                float m = row[0];
                for (long j = 1; j < n; j++) m = row[j] > m ? row[j] : m;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (long j = 0; j < n; j++) {
                    float e = exp_neg(row[j] - m);
                    row[j] = e;
                    sum += e;
                }
                float inv = 1.0f / sum;
#pragma omp simd
                for (long j = 0; j < n; j++) row[j] *= inv;
            }
            /* out[s, g*rep + r] = sum_j p[r, j] v_j */
            float *og = a->out + (s * Hq + g * rep) * D;
            memset(og, 0, rep * D * sizeof(float));
            for (long b = p0 / bs, j = 0; b <= p_last / bs; b++) {
                long lo = b * bs > p0 ? b * bs : p0, hi = (b + 1) * bs <= p_last ? (b + 1) * bs : p_last + 1;
                const float *v = vg + ((long)table[b] * bs + (lo - b * bs)) * D;
                for (long p = lo; p < hi; p++, j++, v += D) {
                    for (long r = 0; r < rep; r++) {
                        float w = sc[r * n + j];
                        float *o = og + r * D;
#pragma omp simd
                        for (long d = 0; d < D; d++) o[d] += w * v[d];
                    }
                }
            }
        }
    }
}

#define MAX_PARTS 64

/* a job split by (sequence, KV head) into parts of about equal key counts */
typedef struct {
    const attn_job *a;
    float *sc;   /* [parts][rep * longest] */
    long stride; /* rep * longest */
    long bounds[MAX_PARTS + 1];
} attn_split;

static void attend_part(void *ctx, long p, long P) {
    const attn_split *c = ctx;
    attend_range(c->a, c->bounds[p], c->bounds[p + 1], c->sc + p * c->stride);
}

/* Each sequence's K/V write and attention, its KV heads split over the kernels' threads (parts
 * of about equal keys, when there are enough keys to split). -1 when out of memory. */
int attend(const attn_job *a) {
    long longest = 0, keys = 0;
    for (long s = 0; s < a->S; s++) {
        long n = (long)(a->pos[s] - a->first[s] + 1);
        longest = n > longest ? n : longest;
        keys += n;
    }
    long items = a->S * a->Hkv; /* (sequence, KV head) pairs */
    long parts = keys * a->Hkv * a->rep * a->D / 65536 + 1; /* ~64 K multiply-adds a part at least */
    long threads = pool_threads();
    parts = parts < threads ? parts : threads;
    parts = parts < items ? parts : items;
    parts = parts < MAX_PARTS ? parts : MAX_PARTS;
    if (parts < 1) parts = 1;
    attn_split c = {.a = a, .stride = a->rep * longest + 1};
    c.sc = (float *)malloc(sizeof(float) * (size_t)(c.stride * parts));
    if (c.sc == NULL) return -1;
    long i = 0, seen = 0; /* part p ends where the keys so far pass (p + 1) / parts of them */
    c.bounds[0] = 0;
    for (long p = 0; p < parts; p++) {
        while (i < items && (p == parts - 1 || seen * parts < keys * a->Hkv * (p + 1)))
            seen += a->pos[i / a->Hkv] - a->first[i / a->Hkv] + 1, i++;
        c.bounds[p + 1] = i;
    }
    pool_run(attend_part, &c, parts);
    free(c.sc);
    return 0;
}

