/* The Python module of the fused CPU kernels (see cpu_ops/bindings.py): each function takes
 * tensors' data_ptr() values and strides (in elements) from the Python wrappers, which check
 * dtypes and shapes and keep the tensors alive for the call. The kernels themselves are in
 * rowops.c, attention.c, qmatmul.c and decode_stack.c. */
#include "qmatmul.h"

/* rms_norm(x, out, scale, T, H, D, sT, sH, scale_rows, eps) */
static PyObject *rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(rms_norm, 10)
    const float *x = PTR(0), *scale = PTR(2);
    float *out = PTR(1);
    long T = LONG(3), H = LONG(4), D = LONG(5), sT = LONG(6), sH = LONG(7), rows = LONG(8);
    float eps = (float)PyFloat_AsDouble(args[9]);
    if (PyErr_Occurred()) return NULL;
    rms_rows(x, out, scale, T, H, D, sT, sH, rows, eps, H * D);
    Py_RETURN_NONE;
}

/* rope_rotate_half(x, out, cos, sin, T, H, D, sT, sH, c_sT) */
static PyObject *rope_rotate_half(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(rope_rotate_half, 10)
    const float *x = PTR(0), *cs = PTR(2), *sn = PTR(3);
    float *out = PTR(1);
    long T = LONG(4), H = LONG(5), D = LONG(6), sT = LONG(7), sH = LONG(8), c_sT = LONG(9);
    if (PyErr_Occurred()) return NULL;
    rope_rows(x, out, cs, sn, T, H, D, sT, sH, c_sT, H * D);
    Py_RETURN_NONE;
}

/* gated_act(gu, out, T, I, sT, act) */
static PyObject *gated_act(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(gated_act, 6)
    const float *gu = PTR(0);
    float *out = PTR(1);
    long T = LONG(2), I = LONG(3), sT = LONG(4), act = LONG(5);
    if (PyErr_Occurred()) return NULL;
    gated_rows(gu, out, T, I, sT, act);
    Py_RETURN_NONE;
}

/* decode_attention(q, q_sS, q_sH, k_new, v_new, new_sS, new_sH, kv, num_slots, Hkv, D, rep,
 *                  tables, table_stride, table_width, first, pos, S, block_size, scale, out, kv_type) */
static PyObject *decode_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(decode_attention, 22)
    attn_job job = {
        .q = PTR(0), .q_sS = LONG(1), .q_sH = LONG(2), .k_new = PTR(3), .v_new = PTR(4), .new_sS = LONG(5),
        .new_sH = LONG(6), .kv = PTR(7), .num_slots = LONG(8), .Hkv = LONG(9), .D = LONG(10), .rep = LONG(11),
        .tables = PTR(12), .table_stride = LONG(13), .table_width = LONG(14), .first = PTR(15), .pos = PTR(16),
        .S = LONG(17), .bs = LONG(18), .scale = (float)PyFloat_AsDouble(args[19]), .out = PTR(20),
        .kv_type = LONG(21),
    };
    if (PyErr_Occurred()) return NULL;
    char err[160];
    if (attend_check(&job, err, sizeof err) != 0) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = attend(&job);
    Py_END_ALLOW_THREADS
    if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* set_threads(n): how many threads the splitting kernels (the quantized matmuls) use */
static PyObject *set_threads(PyObject *self, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    pool_set_threads((int)n);
    Py_RETURN_NONE;
}

/* get_threads(): how many threads the splitting kernels use now */
static PyObject *get_threads(PyObject *self, PyObject *unused) { return PyLong_FromLong(pool_threads()); }

#define FAST(name, doc) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL, doc}
static PyMethodDef methods[] = {
    FAST(rms_norm, "RMSNorm of fp32 rows"),
    FAST(rope_rotate_half, "rotate-half RoPE of fp32 rows"),
    FAST(gated_act, "act(gate) * up of fp32 rows"),
    FAST(decode_attention, "K/V write and paged attention of one query per sequence (fp32 / bf16 / fp16 cache)"),
    FAST(q8_linear, "fp32 rows times an int8 weight"),
    FAST(q4_linear, "fp32 rows times an int4 weight"),
    FAST(gguf_linear, "fp32 rows times a weight in GGUF blocks"),
    FAST(gguf_rows, "rows of a weight in GGUF blocks, dequantized"),
    FAST(decode_stack, "a decode step's decoder layers in one call"),
    {"set_threads", set_threads, METH_O, "threads of the splitting kernels"},
    {"get_threads", get_threads, METH_NOARGS, "threads of the splitting kernels"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hybridkv_cpu_ops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hybridkv_cpu_ops(void) {
    PyObject *m = PyModule_Create(&module);
#ifdef QM_AVX2 /* X16_BLOCK: the columns per rounding step of the rows the quantized matmuls round to int16 (0: none) */
    long x16 = QX_BLOCK;
#else
    long x16 = 0;
#endif
    if (m != NULL && PyModule_AddIntConstant(m, "X16_BLOCK", x16) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
