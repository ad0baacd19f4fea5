/* Shared declarations of the fused CPU kernels' sources: rowops.c (norms, RoPE, activation),
 * attention.c (paged decode attention), qmatmul.c (quantized matmuls), pool.c (threads),
 * decode_stack.c (a decode step's layers in one call) and cpu_ops.c (the Python module).
 * All fp32, over raw pointers; strides are in elements. */
#ifndef HYBRIDKV_CPU_OPS_H
#define HYBRIDKV_CPU_OPS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (softmax after subtracting the max): 2^(x log2 e) as 2^n * 2^f, f in
 * [-0.5, 0.5], 2^f by Cephes' exp2f polynomial (relative error < 2e-7); x < -86 gives 0
 * (e^-86 < 1e-37, and 2^n stays a normal float). Branch-free (selects, no early return), so
 * the `omp simd` loops that call it are vectorized. */
static inline float exp_neg(float x) {
    float xc = x < -86.0f ? -86.0f : x;
    float t = xc * 1.44269504088896341f;
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
    return x < -86.0f ? 0.0f : u.f;
}

/* the Python functions' argument checks and reads (METH_FASTCALL: args[0 .. nargs)) */
#define ARGS(name, n)                                                    \
    if (nargs != n) {                                                    \
        PyErr_SetString(PyExc_TypeError, #name " takes " #n " arguments"); \
        return NULL;                                                     \
    }
#define PTR(i) PyLong_AsVoidPtr(args[i])
#define LONG(i) PyLong_AsLong(args[i])

/* rowops.c */
void rms_rows(const float *x, float *out, const float *scale, long T, long H, long D, long sT, long sH, long rows,
              float eps, long oT);
void rope_rows(const float *x, float *out, const float *cs, const float *sn, long T, long H, long D, long sT, long sH,
               long c_sT, long oT);
void gated_rows(const float *gu, float *out, long T, long I, long sT, long act);

/* attention.c */
/* the KV cache's element types (attn_job.kv_type): fp32, bf16, fp16 */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

/* fp32 -> bf16 / fp16 bits, rounded to nearest even, nan to a quiet nan: torch's own conversions
 * (c10's round_to_nearest_even and fp16_ieee_from_fp32_value), so a K/V written here equals the
 * one torch's .to(dtype) writes; and back (exact). Bit tricks on the float's representation; no FP
 * flags read. The attention's cache and the bf16 matmuls' rounding (qmatmul_bf16.c) use them. */
static inline uint32_t f32_bits(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    return v.u;
}
static inline float bits_f32(uint32_t u) {
    union { uint32_t u; float f; } v = {.u = u};
    return v.f;
}
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }
static inline uint16_t f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w = f32_bits(f), shl1 = w + w, sign = w & 0x80000000u, bias = shl1 & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    uint32_t bits = f32_bits(base), nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign));
}
static inline float f16_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    float normal = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float denormal = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    return bits_f32(sign | (two_w < (1u << 27) ? f32_bits(denormal) : f32_bits(normal)));
}

/* What one decode_attention call computes: its S sequences. kv holds kv_type elements. */
typedef struct {
    const float *q, *k_new, *v_new;
    long q_sS, q_sH, new_sS, new_sH;
    void *kv;
    long kv_type;
    long num_slots, Hkv, D, rep;
    const int64_t *tables;
    long table_stride, table_width; /* a table row's stride; blocks it holds */
    const int64_t *first, *pos;
    long bs;
    float scale;
    float *out;
    long S;
} attn_job;

/* 0, or -1 with `err` (of `size` bytes) saying which sequence's positions or blocks are outside
 * its table or the pool */
int attend_check(const attn_job *a, char *err, size_t size);
/* 0, or -1 when out of memory */
int attend(const attn_job *a);

/* pool.c */
typedef void (*part_fn)(void *ctx, long part, long parts);
void pool_run(part_fn fn, void *ctx, long parts);
void pool_set_threads(int threads);
long pool_threads(void);

/* qmatmul.c: y [M, N] (rows at + m * sy) = x [M, K] (rows at + m * sx) times a quantized
 * weight [N, K]: kind 1 int8 (w: q [N, K], scales fp32 [N]), 2 int4 (w: nibbles [N, K/2],
 * scales: (scale, zero) pairs [N, K/G, 2] in bf16 when sz_bf16, else fp32), 3 GGUF blocks
 * (w: the segment table int64 [group, 4] of gguf_blocks.c, scales unused) */
typedef struct {
    long kind;
    const void *w, *scales;
    long group, sz_bf16, N, K;
} qweight;
/* whether w is a weight the matmuls can read (kind, group, K) */
int qweight_ok(const qweight *w);
/* 0, or -1 when out of memory (int4 needs a copy of x) */
int qmatmul(const qweight *w, const float *x, long sx, long M, float *y, long sy);
PyObject *q8_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *q4_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* gguf_blocks.c: weights in GGUF block types (segments: int64 [S, 4] of type, rows, data, row bytes) */
int gguf_weight_ok(const int64_t *seg, long S, long N, long K);
/* 0, or -1 when out of memory */
int gguf_matmul(const int64_t *seg, long S, long N, long K, const float *x, long sx, long M, float *y, long sy);
PyObject *gguf_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *gguf_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* decode_stack.c */
PyObject *decode_stack(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
#endif
