/* What gguf_blocks.c (types, the scalar decode, the scratch-row matmul, the Python entry points)
 * and gguf_blocks_vec.c (the AVX2 / AVX-512 decode and the in-register matmul) share. See
 * gguf_blocks.c for the layouts and the contract. */
#ifndef HYBRIDKV_GGUF_BLOCKS_H
#define HYBRIDKV_GGUF_BLOCKS_H
#include "qmatmul.h"

/* up to this many rows of x, the vector build decodes each weight row in registers once per 4
 * rows of x; more rows decode it once into a scratch row that all of them read */
#define FUSED_ROWS 8

typedef struct {
    long id, qk, bytes, sub; /* ggml type id, values per block, bytes per block, values per sub-block */
} gtype;

/* the types the kernels read, X(id, values per block, bytes per block, values per sub-block):
 * Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (the one table; gguf_blocks_vec.c's dispatch
 * expands it too) */
#define GGUF_TYPES(X) \
    X(2, 32, 18, 32) X(3, 32, 20, 32) X(6, 32, 22, 32) X(7, 32, 24, 32) X(8, 32, 34, 32) \
    X(12, 256, 144, 32) X(13, 256, 176, 32) X(14, 256, 210, 16)
#define GTYPE_ROW(id, qk, bytes, sub) {id, qk, bytes, sub},
static const gtype GTYPES[] = {GGUF_TYPES(GTYPE_ROW)};

static inline const gtype *gguf_type(long id) {
    for (size_t i = 0; i < sizeof GTYPES / sizeof GTYPES[0]; i++)
        if (GTYPES[i].id == id) return &GTYPES[i];
    return NULL;
}

/* whether type id's sub-blocks have offsets c (else c = 0): Q4_1, Q5_1, Q4_K, Q5_K */
static inline int has_offsets(long id) { return id == 3 || id == 7 || id == 12 || id == 13; }

#if defined(__F16C__) && !defined(HYBRIDKV_GENERIC)
#include <immintrin.h>
/* (vmovd then vcvtph2ps: _cvtsh_ss's vpinsrw would merge into a register the previous block's
 * decode wrote, chaining every block to the one before) */
static inline float h2f(const uint8_t *p) {
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((int)(p[0] | (p[1] << 8)))));
}
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


typedef struct {
    const int64_t *seg; /* [S, 4] */
    long S, N, K;
    const float *x; /* [M, K], rows at + m * sx */
    long sx, M;
    const float *xs; /* [M, K / 32]: sums of x per 32 columns (NULL: no segment has offsets) */
    float *y;        /* [M, N], rows at + m * sy */
    long sy;
    float *scratch; /* the scratch-row matmul: per part, a row's w [K] and c [K / 16] (scratch_floats) */
    const int64_t *ids; /* gguf_rows: the rows to dequantize [T] (NULL: rows 0..T-1) */
    long T;
} gjob;

/* a part's scratch row in floats: w [K] then c [K / 16], a multiple of 16 floats (64 bytes) */
static inline long scratch_floats(long K) { return (K + K / 16 + 15) / 16 * 16; }

#if (defined(QM_AVX2) || defined(QM_AVX512))
#define GG_VEC 1
/* gguf_blocks_vec.c: block id's values decoded and scaled, w = a * q [QK], offsets c [QK / L] */
void gguf_decode_block_vec(long id, const uint8_t *b, float *w, float *c);
/* y[:, n] of all rows of x times a decoded row (w [K], offsets c [K / L]) */
void gguf_dot_row_vec(const gjob *j, const float *w, const float *c, long L, int offsets, long n);
/* rows [n0, n1) of every segment times the rows of x, each weight row decoded in registers */
void gguf_fused_part(const gjob *j, long n0, long n1);
#endif
#endif
