/* Row kernels of the decode path (see cpu_ops/bindings.py): RMSNorm, rotate-half RoPE and the
 * gated MLP's activation. Single-threaded; the loops are written so that gcc -O3 vectorizes
 * them (#pragma omp simd, -fopenmp-simd: no OpenMP runtime is linked). */
#include "cpu_ops.h"

/* row (t, h) of x: x + t*sT + h*sH, D contiguous values; out row (t, h) at out + t*oT + h*D;
 * out = x / sqrt(mean(x^2) + eps) * scale[h % rows]  (scale [rows, D]). out may be x (same
 * strides). */
void rms_rows(const float *x, float *out, const float *scale, long T, long H, long D, long sT, long sH, long rows,
              float eps, long oT) {
    for (long t = 0; t < T; t++) {
        for (long h = 0; h < H; h++) {
            const float *xr = x + t * sT + h * sH;
            const float *sr = scale + (h % rows) * D;
            float *o = out + t * oT + h * D;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (long i = 0; i < D; i++) acc += xr[i] * xr[i];
            float r = 1.0f / sqrtf(acc / (float)D + eps);
#pragma omp simd
            for (long i = 0; i < D; i++) o[i] = xr[i] * r * sr[i];
        }
    }
}

/* x rows (t, h) at x + t*sT + h*sH; cos / sin rows at + t*c_sT, D values (sin's first half
 * negated: the tables of RotaryEmbedding.cos_sin); out rows (t, h) at out + t*oT + h*D (not x):
 * out[i] = x[i] * cos[i] + x[(i + D/2) % D] * sin[i], each product and the sum rounded as torch
 * rounds them (compiled with -ffp-contract=off: no fused multiply-add). */
void rope_rows(const float *x, float *out, const float *cs, const float *sn, long T, long H, long D, long sT, long sH,
               long c_sT, long oT) {
    long half = D / 2;
    for (long t = 0; t < T; t++) {
        const float *c = cs + t * c_sT, *s = sn + t * c_sT;
        for (long h = 0; h < H; h++) {
            const float *xr = x + t * sT + h * sH;
            float *o = out + t * oT + h * D;
#pragma omp simd
            for (long i = 0; i < half; i++) o[i] = xr[i] * c[i] + xr[i + half] * s[i];
#pragma omp simd
            for (long i = half; i < D; i++) o[i] = xr[i] * c[i] + xr[i - half] * s[i];
        }
    }
}

/* out[t, i] = act(gu[t, i]) * gu[t, I + i] (gu rows at + t*sT; out [T, I] contiguous);
 * act 0: silu x * sigmoid(x), 1: gelu with the tanh approximation. */
void gated_rows(const float *gu, float *out, long T, long I, long sT, long act) {
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
}
