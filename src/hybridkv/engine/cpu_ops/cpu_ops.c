/* Fused CPU kernels of the decode path (see cpu_ops/__init__.py): RMSNorm rows, rotate-half
 * RoPE, the gated MLP's activation and paged decode attention (the step's K/V write and the
 * attention of one query per sequence).
 *
 * Plain C over raw pointers: the Python side passes each tensor's data_ptr() and strides
 * (in elements) and keeps the tensors alive for the call. fp32 only. Single-threaded; the
 * loops are written so that gcc -O3 vectorizes them (#pragma omp simd, -fopenmp-simd: no
 * OpenMP runtime is linked).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (softmax after subtracting the max): 2^(x log2 e) as 2^n * 2^f, f in
 * [-0.5, 0.5], 2^f by Cephes' exp2f polynomial (relative error < 2e-7); x < -86 gives 0
 * (e^-86 < 1e-37, and 2^n stays a normal float). */
static inline float exp_neg(float x) {
    if (x < -86.0f) return 0.0f;
    float t = x * 1.44269504088896341f;
    float n = nearbyintf(t);
    float f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    union { float f; int32_t i; } u;
    u.f = p;
    u.i += ((int32_t)n) << 23;
    return u.f;
}

/* rms_norm(x, out, scale, T, H, D, sT, sH, scale_rows, eps)
 * row (t, h) of x: x + t*sT + h*sH, D contiguous values; out [T, H, D] contiguous;
 * out = x / sqrt(mean(x^2) + eps) * scale[h % scale_rows]  (scale [scale_rows, D]). */
static PyObject *rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "rms_norm takes 10 arguments");
        return NULL;
    }
    const float *x = (const float *)PyLong_AsVoidPtr(args[0]);
    float *out = (float *)PyLong_AsVoidPtr(args[1]);
    const float *scale = (const float *)PyLong_AsVoidPtr(args[2]);
    long T = PyLong_AsLong(args[3]), H = PyLong_AsLong(args[4]), D = PyLong_AsLong(args[5]);
    long sT = PyLong_AsLong(args[6]), sH = PyLong_AsLong(args[7]), rows = PyLong_AsLong(args[8]);
    float eps = (float)PyFloat_AsDouble(args[9]);
    if (PyErr_Occurred()) return NULL;
    for (long t = 0; t < T; t++) {
        for (long h = 0; h < H; h++) {
            const float *xr = x + t * sT + h * sH;
            const float *sr = scale + (h % rows) * D;
            float *o = out + (t * H + h) * D;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (long i = 0; i < D; i++) acc += xr[i] * xr[i];
            float r = 1.0f / sqrtf(acc / (float)D + eps);
#pragma omp simd
            for (long i = 0; i < D; i++) o[i] = xr[i] * r * sr[i];
        }
    }
    Py_RETURN_NONE;
}

/* rope_rotate_half(x, out, cos, sin, T, H, D, sT, sH, c_sT)
 * x rows (t, h) at x + t*sT + h*sH; cos / sin rows at + t*c_sT, D values (sin's first half
 * negated: the tables of RotaryEmbedding.cos_sin); out [T, H, D] contiguous:
 * out[i] = x[i] * cos[i] + x[(i + D/2) % D] * sin[i], each product and the sum rounded as torch
 * rounds them (compiled with -ffp-contract=off: no fused multiply-add). */
static PyObject *rope_rotate_half(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "rope_rotate_half takes 10 arguments");
        return NULL;
    }
    const float *x = (const float *)PyLong_AsVoidPtr(args[0]);
    float *out = (float *)PyLong_AsVoidPtr(args[1]);
    const float *cs = (const float *)PyLong_AsVoidPtr(args[2]);
    const float *sn = (const float *)PyLong_AsVoidPtr(args[3]);
    long T = PyLong_AsLong(args[4]), H = PyLong_AsLong(args[5]), D = PyLong_AsLong(args[6]);
    long sT = PyLong_AsLong(args[7]), sH = PyLong_AsLong(args[8]), c_sT = PyLong_AsLong(args[9]);
    if (PyErr_Occurred()) return NULL;
    long half = D / 2;
    for (long t = 0; t < T; t++) {
        const float *c = cs + t * c_sT, *s = sn + t * c_sT;
        for (long h = 0; h < H; h++) {
            const float *xr = x + t * sT + h * sH;
            float *o = out + (t * H + h) * D;
#pragma omp simd
            for (long i = 0; i < half; i++) o[i] = xr[i] * c[i] + xr[i + half] * s[i];
#pragma omp simd
            for (long i = half; i < D; i++) o[i] = xr[i] * c[i] + xr[i - half] * s[i];
        }
    }
    Py_RETURN_NONE;
}

/* gated_act(gu, out, T, I, sT, act): out[t, i] = act(gu[t, i]) * gu[t, I + i] (gu rows at + t*sT;
 * out [T, I] contiguous); act 0: silu x * sigmoid(x), 1: gelu with the tanh approximation. */
static PyObject *gated_act(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "gated_act takes 6 arguments");
        return NULL;
    }
    const float *gu = (const float *)PyLong_AsVoidPtr(args[0]);
    float *out = (float *)PyLong_AsVoidPtr(args[1]);
    long T = PyLong_AsLong(args[2]), I = PyLong_AsLong(args[3]), sT = PyLong_AsLong(args[4]);
    long act = PyLong_AsLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    for (long t = 0; t < T; t++) {
        const float *g = gu + t * sT, *u = g + I;
        float *o = out + t * I;
        if (act == 0) {
#pragma omp simd
            for (long i = 0; i < I; i++) {
                float x = g[i];
                float e = exp_neg(-fabsf(x)); /* sigmoid(x) = 1 / (1 + e^-x), from e^-|x| <= 1 */
                float sig = x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
                o[i] = x * sig * u[i];
            }
        } else {
#pragma omp simd
            for (long i = 0; i < I; i++) {
                float x = g[i];
                float y = 1.5957691216057308f * (x + 0.044715f * x * x * x); /* 2 sqrt(2/pi) (..) */
                float e = exp_neg(-fabsf(y)); /* 0.5 (1 + tanh(y/2)) = sigmoid(y): no cancellation at x << 0 */
                float sig = y >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
                o[i] = x * sig * u[i];
            }
        }
    }
    Py_RETURN_NONE;
}

/* What one decode_attention call computes: its S sequences. */
typedef struct {
    const float *q, *k_new, *v_new;
    long q_sS, q_sH, new_sS, new_sH;
    float *kv;
    long num_slots, Hkv, D, rep;
    const int64_t *tables;
    long table_stride;
    const int64_t *first, *pos;
    long bs;
    float scale;
    float *out;
    long S;
} attn_job;

/* Each sequence of a job: write its new K/V at pos[s], then attend from its rep * Hkv query heads
 * to positions first[s] .. pos[s] (validated by the caller). Returns -1 when out of memory. */
static int attend(const attn_job *a) {
    long D = a->D, rep = a->rep, Hkv = a->Hkv, bs = a->bs, num_slots = a->num_slots;
    float *keys_v = a->kv + Hkv * num_slots * D;
    long Hq = Hkv * rep, longest = 0;
    for (long s = 0; s < a->S; s++) {
        long n = (long)(a->pos[s] - a->first[s] + 1);
        longest = n > longest ? n : longest;
    }
    float *sc = (float *)malloc((size_t)(rep * longest + 1) * sizeof(float));
    if (sc == NULL) return -1;
    for (long s = 0; s < a->S; s++) {
        const int64_t *table = a->tables + s * a->table_stride;
        long p_last = (long)a->pos[s], p0 = (long)a->first[s];
        long n = p_last - p0 + 1;
        if (a->k_new != NULL) {
            long slot = (long)table[p_last / bs] * bs + p_last % bs;
            for (long g = 0; g < Hkv; g++) {
                memcpy(a->kv + (g * num_slots + slot) * D, a->k_new + s * a->new_sS + g * a->new_sH, D * sizeof(float));
                memcpy(keys_v + (g * num_slots + slot) * D, a->v_new + s * a->new_sS + g * a->new_sH, D * sizeof(float));
            }
        }
        for (long g = 0; g < Hkv; g++) {
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
                        for (long i = 0; i < D; i++) acc += qr[i] * k[i];
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
                        for (long i = 0; i < D; i++) o[i] += w * v[i];
                    }
                }
            }
        }
    }
    free(sc);
    return 0;
}

static PyObject *decode_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 20) {
        PyErr_SetString(PyExc_TypeError, "decode_attention takes 20 arguments");
        return NULL;
    }
    attn_job job;
    job.q = (const float *)PyLong_AsVoidPtr(args[0]);
    job.q_sS = PyLong_AsLong(args[1]);
    job.q_sH = PyLong_AsLong(args[2]);
    job.k_new = (const float *)PyLong_AsVoidPtr(args[3]);
    job.v_new = (const float *)PyLong_AsVoidPtr(args[4]);
    job.new_sS = PyLong_AsLong(args[5]);
    job.new_sH = PyLong_AsLong(args[6]);
    job.kv = (float *)PyLong_AsVoidPtr(args[7]);
    job.num_slots = PyLong_AsLong(args[8]);
    job.Hkv = PyLong_AsLong(args[9]);
    job.D = PyLong_AsLong(args[10]);
    job.rep = PyLong_AsLong(args[11]);
    job.tables = (const int64_t *)PyLong_AsVoidPtr(args[12]);
    job.table_stride = PyLong_AsLong(args[13]);
    job.first = (const int64_t *)PyLong_AsVoidPtr(args[14]);
    job.pos = (const int64_t *)PyLong_AsVoidPtr(args[15]);
    long S = job.S = PyLong_AsLong(args[16]);
    job.bs = PyLong_AsLong(args[17]);
    job.scale = (float)PyFloat_AsDouble(args[18]);
    job.out = (float *)PyLong_AsVoidPtr(args[19]);
    if (PyErr_Occurred()) return NULL;
    long bs = job.bs;
    for (long s = 0; s < S; s++) {
        const int64_t *table = job.tables + s * job.table_stride;
        long p_last = (long)job.pos[s], p0 = (long)job.first[s];
        long n = p_last - p0 + 1;
        if (p0 < 0 || n < 1 || p_last / bs >= job.table_stride) {
            PyErr_Format(PyExc_ValueError, "sequence %ld: positions %ld..%ld outside its table of %ld blocks of %ld",
                         s, p0, p_last, job.table_stride, bs);
            return NULL;
        }
        for (long b = p0 / bs; b <= p_last / bs; b++) {
            if (table[b] < 0 || (table[b] + 1) * bs > job.num_slots) {
                PyErr_Format(PyExc_ValueError, "sequence %ld: block id %ld outside the pool of %ld slots", s,
                             (long)table[b], job.num_slots);
                return NULL;
            }
        }
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = attend(&job);
    Py_END_ALLOW_THREADS
    if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", (PyCFunction)(void (*)(void))rms_norm, METH_FASTCALL, "RMSNorm of fp32 rows"},
    {"rope_rotate_half", (PyCFunction)(void (*)(void))rope_rotate_half, METH_FASTCALL, "rotate-half RoPE of fp32 rows"},
    {"gated_act", (PyCFunction)(void (*)(void))gated_act, METH_FASTCALL, "act(gate) * up of fp32 rows"},
    {"decode_attention", (PyCFunction)(void (*)(void))decode_attention, METH_FASTCALL,
     "K/V write and paged attention of one query per sequence (fp32)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hybridkv_cpu_ops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hybridkv_cpu_ops(void) { return PyModule_Create(&module); }
