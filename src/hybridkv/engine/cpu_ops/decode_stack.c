/* A decode step's decoder layers in one call (the fused decode step's Python side builds the
 * plan). Per layer, on S rows of the residual stream h [S, hidden] (updated in place):
 *
 *   a   = rms(h) * ln1                                  input norm
 *   qkv = a @ Wqkv^T                                    [S, (Hq + 2 Hkv) D], quantized weight
 *   qk  = rms_per_head(qk) * qk_norm                    (when the layer has q/k norms)
 *   qk  = rope(qk)                                      rotate-half, the step's cos / sin rows
 *   o   = attention(q, k, v)                            K/V written, then read through the table
 *   t   = o @ Wo^T;  t = rms(t) * post_attn (sandwich);  h += t
 *   a   = rms(h) * ln2
 *   t   = down(act(a @ Wgate^T) * (a @ Wup^T));  t = rms(t) * post_ff (sandwich);  h += t
 *
 * the same kernels, in the same order, as the layers' Python forward on the quantized CPU
 * path runs them one call each, so the result is the same up to the matmuls' summation order.
 *
 * The plan: one record of PLAN_FIELDS 8-byte fields per layer (int64, the last two doubles; the
 * KV cache fp32, bf16 or fp16, as L_KV_TYPE says);
 * the step: int64 [S, block_size, R, A, G, R x (cos, sin, c_sT), A x (first, pos), G x
 * (tables, table_stride, table_width)] (rope tables, attention types' first / last positions, KV groups'
 * block tables, each a tensor's data_ptr()). */
#include "cpu_ops.h"

enum {
    L_HQ, L_HKV, L_D, L_HIDDEN, L_INTER,
    L_LN1, L_LN2, L_POST_ATTN, L_POST_FF, L_QK_NORM, /* fp32 multipliers (0: none) */
    L_ROPE, L_ATTN, L_GROUP, L_KV, L_SLOTS, L_ACT,   /* indexes into the step; kv [2 Hkv, slots, D] */
    L_KV_TYPE,                                        /* the cache's element type (KV_F32 / KV_BF16 / KV_F16) */
    L_QKV, L_O = L_QKV + 7, L_GATE_UP = L_O + 7, L_DOWN = L_GATE_UP + 7, /* qweight: 7 fields each */
    L_EPS = L_DOWN + 7, L_SCALE,                      /* doubles */
    PLAN_FIELDS
};

static qweight weight_at(const int64_t *r) {
    qweight w = {.kind = r[0], .w = (const void *)(intptr_t)r[1], .scales = (const void *)(intptr_t)r[2],
                 .group = r[3], .sz_bf16 = r[4], .N = r[5], .K = r[6]};
    return w;
}

static double double_at(const int64_t *p) {
    double d;
    memcpy(&d, p, sizeof d);
    return d;
}

#define F(p) ((float *)(intptr_t)(p))

/* layer p's attention job on the step (q and out filled in by the caller) */
static attn_job job_of(const int64_t *p, const int64_t *step) {
    long R = step[2], A = step[3];
    const int64_t *at = step + 5 + 3 * R + 2 * p[L_ATTN], *gr = step + 5 + 3 * R + 2 * A + 3 * p[L_GROUP];
    long Hq = p[L_HQ], Hkv = p[L_HKV], D = p[L_D], Nqkv = (Hq + 2 * Hkv) * D;
    attn_job job = {
        .q_sS = Nqkv, .q_sH = D, .new_sS = Nqkv, .new_sH = D, .kv = (void *)(intptr_t)p[L_KV],
        .kv_type = p[L_KV_TYPE], .num_slots = p[L_SLOTS], .Hkv = Hkv, .D = D, .rep = Hq / Hkv,
        .tables = (const int64_t *)(intptr_t)gr[0], .table_stride = gr[1],
        .table_width = gr[2],
        .first = (const int64_t *)(intptr_t)at[0], .pos = (const int64_t *)(intptr_t)at[1], .S = step[0],
        .bs = step[1], .scale = (float)double_at(p + L_SCALE),
    };
    return job;
}

/* a weight the matmuls can read (qweight_ok) of shape [n, k] */
static int weight_ok(const qweight *w, long n, long k) { return w->N == n && w->K == k && qweight_ok(w); }

/* layer p's shapes and indexes make sense for the step (else err) */
static int layer_ok(const int64_t *p, const int64_t *step, long l, char *err, size_t size) {
    long Hq = p[L_HQ], Hkv = p[L_HKV], D = p[L_D], H = p[L_HIDDEN], I = p[L_INTER];
    qweight qkv = weight_at(p + L_QKV), o = weight_at(p + L_O), gu = weight_at(p + L_GATE_UP), d = weight_at(p + L_DOWN);
    int ok = Hkv > 0 && Hq > 0 && Hq % Hkv == 0 && D > 0 && D % 2 == 0 && H > 0 && I > 0 && p[L_LN1] && p[L_LN2]
             && p[L_KV] && p[L_ROPE] >= 0 && p[L_ROPE] < step[2] && p[L_ATTN] >= 0 && p[L_ATTN] < step[3]
             && p[L_GROUP] >= 0 && p[L_GROUP] < step[4] && p[L_ACT] >= 0 && p[L_ACT] <= 1
             && p[L_KV_TYPE] >= KV_F32 && p[L_KV_TYPE] <= KV_F16
             && weight_ok(&qkv, (Hq + 2 * Hkv) * D, H) && weight_ok(&o, H, Hq * D) && weight_ok(&gu, 2 * I, H)
             && weight_ok(&d, H, I);
    if (!ok) snprintf(err, size, "layer %ld: its plan does not fit together (shapes, weights or indexes)", l);
    return ok;
}

/* runs with the GIL released; 0, or -1 with err set */
static int run(const int64_t *plan, long L, const int64_t *step, float *h, char *err, size_t size) {
    long S = step[0];
    const int64_t *ropes = step + 5;
    long most = 0; /* scratch: the widest row any buffer needs */
    if (S < 0 || step[1] < 1 || step[2] < 1 || step[3] < 1 || step[4] < 1) {
        snprintf(err, size, "bad step: %ld rows, block size %ld", S, (long)step[1]);
        return -1;
    }
    for (long l = 0; l < L; l++) { /* every layer checked before any K/V is written */
        const int64_t *p = plan + l * PLAN_FIELDS;
        if (!layer_ok(p, step, l, err, size)) return -1;
        attn_job job = job_of(p, step);
        if (attend_check(&job, err, size) != 0) return -1;
        long qkv = (p[L_HQ] + 2 * p[L_HKV]) * p[L_D], widest = qkv;
        if (2 * p[L_INTER] > widest) widest = 2 * p[L_INTER];
        if (p[L_HIDDEN] > widest) widest = p[L_HIDDEN];
        most = widest > most ? widest : most;
    }
    float *buf = malloc(sizeof(float) * (size_t)(4 * S * most));
    if (buf == NULL) {
        snprintf(err, size, "out of memory");
        return -1;
    }
    float *a = buf, *q = buf + S * most, *c = buf + 2 * S * most, *t = buf + 3 * S * most;
    int rc = 0;
    for (long l = 0; l < L; l++) {
        const int64_t *p = plan + l * PLAN_FIELDS;
        long Hq = p[L_HQ], Hkv = p[L_HKV], D = p[L_D], H = p[L_HIDDEN], I = p[L_INTER];
        long Nqkv = (Hq + 2 * Hkv) * D, Hqk = Hq + Hkv;
        float eps = (float)double_at(p + L_EPS);
        qweight wqkv = weight_at(p + L_QKV), wo = weight_at(p + L_O), wgu = weight_at(p + L_GATE_UP),
                wd = weight_at(p + L_DOWN);
        const int64_t *rope = ropes + 3 * p[L_ROPE];
        /* attention */
        rms_rows(h, a, F(p[L_LN1]), S, 1, H, H, 0, 1, eps, H);
        if ((rc = qmatmul(&wqkv, a, H, S, q, Nqkv)) != 0) break;
        const float *src = q;
        long src_sT = Nqkv;
        if (p[L_QK_NORM]) { /* per head, into t [S, Hq + Hkv, D] */
            rms_rows(q, t, F(p[L_QK_NORM]), S, Hqk, D, Nqkv, D, Hqk, eps, Hqk * D);
            src = t, src_sT = Hqk * D;
        }
        rope_rows(src, c, F(rope[0]), F(rope[1]), S, Hqk, D, src_sT, D, rope[2], Nqkv); /* c [S, Hq+2Hkv, D] */
        for (long s = 0; s < S; s++) memcpy(c + s * Nqkv + Hqk * D, q + s * Nqkv + Hqk * D, sizeof(float) * Hkv * D);
        attn_job job = job_of(p, step);
        job.q = c, job.k_new = c + Hq * D, job.v_new = c + Hqk * D, job.out = a;
        if ((rc = attend(&job)) != 0 || (rc = qmatmul(&wo, a, Hq * D, S, t, H)) != 0) break; /* a [S, Hq, D] */
        if (p[L_POST_ATTN]) rms_rows(t, t, F(p[L_POST_ATTN]), S, 1, H, H, 0, 1, eps, H);
        for (long i = 0; i < S * H; i++) h[i] = t[i] + h[i];
        /* MLP */
        rms_rows(h, a, F(p[L_LN2]), S, 1, H, H, 0, 1, eps, H);
        if ((rc = qmatmul(&wgu, a, H, S, q, 2 * I)) != 0) break;
        gated_rows(q, c, S, I, 2 * I, p[L_ACT]);
        if ((rc = qmatmul(&wd, c, I, S, t, H)) != 0) break;
        if (p[L_POST_FF]) rms_rows(t, t, F(p[L_POST_FF]), S, 1, H, H, 0, 1, eps, H);
        for (long i = 0; i < S * H; i++) h[i] = t[i] + h[i];
    }
    if (rc != 0) snprintf(err, size, "out of memory");
    free(buf);
    return rc;
}

/* decode_stack(plan, layers, step, h) */
PyObject *decode_stack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "decode_stack takes 4 arguments");
        return NULL;
    }
    const int64_t *plan = PyLong_AsVoidPtr(args[0]);
    long L = PyLong_AsLong(args[1]);
    const int64_t *step = PyLong_AsVoidPtr(args[2]);
    float *h = PyLong_AsVoidPtr(args[3]);
    if (PyErr_Occurred()) return NULL;
    char err[160] = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = run(plan, L, step, h, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        if (strcmp(err, "out of memory") == 0) return PyErr_NoMemory();
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}
