/*
 * dynamo.pytorch._paged_attn: decode attention straight out of the paged KV pool (float32, CPU).
 *
 * Why native: on plain torch ops a decode pass first gathers every row's blocks into a padded
 * [kv_heads * rows, keys, head_dim] copy (per layer, K and V), then runs batched matmuls whose
 * matrices are [group, head_dim] x [head_dim, keys]: far too small for a GEMM, so the pass pays
 * the copy, the padding and per-matrix overhead. At 32 rows x 192 keys on the tiny benchmark
 * Llama that was ~40 % of a decode pass (docs/performance.md). Here each (row, KV head) reads its
 * keys in place, block by block, once for all the query heads of its group.
 *
 * Layout (see dynamo/pytorch/attention.py):
 *   pool  [kv_heads, num_blocks, block_size, head_dim], C order, one for K and one for V
 *   q     [*, heads, head_dim] rows of q_row_stride floats (heads contiguous in a row);
 *         row rows[b] is decode row b
 *   out   [*, heads, head_dim] rows of out_row_stride floats; only the decode rows are written
 *   table [batch, table_width] int64 block ids; lens [batch] int64 keys per row
 * Query head h reads KV head h / (heads / kv_heads), as transformers' GQA does.
 *
 * The arithmetic is float32 with a float32 softmax (max-subtracted), as torch's path; sums are
 * taken in another order, so results agree to rounding, not bit for bit.
 *
 * The GIL is released while the kernel runs (the event loop thread keeps serving HTTP).
 * Pointers come from torch tensors the Python wrapper (dynamo/pytorch/native_attention.py)
 * checked for dtype, device, shape and contiguity; block ids and lengths are checked here, so a
 * bad table raises ValueError instead of reading out of bounds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
/* One AVX2/FMA clone and a baseline one, picked at load time by the CPU (GCC ifunc). */
#define MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MULTIVERSION
#endif

typedef float v8 __attribute__((vector_size(32)));

/* Macros, not functions: a 32-byte vector argument or result has a different ABI in the two
 * clones (GCC warns), so none ever crosses a call. Loads and stores are unaligned. */
#define LOAD8(dst, p) memcpy(&(dst), (p), sizeof(v8))
#define STORE8(p, src) memcpy((p), &(src), sizeof(v8))
#define HSUM8(x) ((((x)[0] + (x)[4]) + ((x)[1] + (x)[5])) + (((x)[2] + (x)[6]) + ((x)[3] + (x)[7])))

/* One (row, KV head): `group` query heads at q (head_dim apart) over `len` keys. `scores` has
 * room for group * len floats. Inlined with a constant head_dim where it is a common size, so
 * that the loops over it unroll and a query head and the output accumulators stay in
 * registers: per key, one pass of FMAs for the scores and one for the output. */
#define CHUNK 8 /* output vectors accumulated at once (64 floats): fits the 16 AVX registers */
static inline __attribute__((always_inline)) void attend(
    const float *q, float *out, const float *k_head, const float *v_head, const int64_t *table,
    int64_t len, int64_t group, const int64_t head_dim, int64_t block_size, float scale,
    float *scores)
{
    const int64_t block_floats = block_size * head_dim;
    const int64_t d8 = head_dim & ~(int64_t)7;
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * head_dim;
        float *sg = scores + g * len;
        for (int64_t j0 = 0; j0 < len; j0 += block_size) {
            const float *kb = k_head + table[j0 / block_size] * block_floats;
            const int64_t n = len - j0 < block_size ? len - j0 : block_size;
            for (int64_t t = 0; t < n; t++) {
                const float *kr = kb + t * head_dim;
                v8 acc = {0};
                int64_t d = 0;
                for (; d < d8; d += 8) {
                    v8 a, b;
                    LOAD8(a, qg + d);
                    LOAD8(b, kr + d);
                    acc += a * b;
                }
                float s = HSUM8(acc);
                for (; d < head_dim; d++)
                    s += qg[d] * kr[d];
                sg[j0 + t] = s * scale;
            }
        }
        float mx = sg[0];
        for (int64_t j = 1; j < len; j++)
            mx = sg[j] > mx ? sg[j] : mx;
        float sum = 0.0f;
        for (int64_t j = 0; j < len; j++) {
            sg[j] = expf(sg[j] - mx);
            sum += sg[j];
        }
        const float inv = 1.0f / sum;
        float *og = out + g * head_dim;
        for (int64_t c0 = 0; c0 < d8; c0 += 8 * CHUNK) {
            const int64_t nc = (d8 - c0) / 8 < CHUNK ? (d8 - c0) / 8 : CHUNK;
            v8 acc[CHUNK];
            for (int64_t c = 0; c < nc; c++)
                acc[c] = (v8){0};
            for (int64_t j0 = 0; j0 < len; j0 += block_size) {
                const float *vb = v_head + table[j0 / block_size] * block_floats + c0;
                const int64_t n = len - j0 < block_size ? len - j0 : block_size;
                for (int64_t t = 0; t < n; t++) {
                    const float p = sg[j0 + t];
                    const v8 pv = {p, p, p, p, p, p, p, p};
                    for (int64_t c = 0; c < nc; c++) {
                        v8 v;
                        LOAD8(v, vb + t * head_dim + 8 * c);
                        acc[c] += pv * v;
                    }
                }
            }
            const v8 iv = {inv, inv, inv, inv, inv, inv, inv, inv};
            for (int64_t c = 0; c < nc; c++) {
                v8 o = acc[c] * iv;
                STORE8(og + c0 + 8 * c, o);
            }
        }
        for (int64_t d = d8; d < head_dim; d++) {
            float o = 0.0f;
            for (int64_t j = 0; j < len; j++)
                o += sg[j] * v_head[table[j / block_size] * block_floats + (j % block_size) * head_dim + d];
            og[d] = o * inv;
        }
    }
}

MULTIVERSION
static void decode_all(
    const float *q, float *out, const float *k_pool, const float *v_pool, const int64_t *rows,
    const int64_t *tables, const int64_t *lens, int64_t batch, int64_t heads, int64_t kv_heads,
    int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t table_width,
    int64_t q_row_stride, int64_t out_row_stride, float scale, float *scores)
{
    const int64_t group = heads / kv_heads;
    const int64_t head_floats = num_blocks * block_size * head_dim;
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            const int64_t off = kh * group * head_dim;
            const float *qh = q + rows[b] * q_row_stride + off;
            float *oh = out + rows[b] * out_row_stride + off;
            const float *kp = k_pool + kh * head_floats, *vp = v_pool + kh * head_floats;
            const int64_t *tb = tables + b * table_width;
            switch (head_dim) { /* constant head sizes: see attend() */
            case 32:
                attend(qh, oh, kp, vp, tb, lens[b], group, 32, block_size, scale, scores);
                break;
            case 64:
                attend(qh, oh, kp, vp, tb, lens[b], group, 64, block_size, scale, scores);
                break;
            case 128:
                attend(qh, oh, kp, vp, tb, lens[b], group, 128, block_size, scale, scores);
                break;
            default:
                attend(qh, oh, kp, vp, tb, lens[b], group, head_dim, block_size, scale, scores);
            }
        }
    }
}

static PyObject *decode(PyObject *self, PyObject *args) {
    unsigned long long q, out, k_pool, v_pool, rows, tables, lens;
    long long batch, heads, kv_heads, head_dim, num_blocks, block_size, table_width;
    long long num_rows, q_row_stride, out_row_stride;
    float scale;
    if (!PyArg_ParseTuple(args, "KKKKKKKLLLLLLLLLLf", &q, &out, &k_pool, &v_pool, &rows,
                          &tables, &lens, &batch, &num_rows, &heads, &kv_heads, &head_dim,
                          &num_blocks, &block_size, &table_width, &q_row_stride,
                          &out_row_stride, &scale))
        return NULL;
    if (batch < 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads || head_dim <= 0 ||
        block_size <= 0 || table_width < 0 || q_row_stride < heads * head_dim ||
        out_row_stride < heads * head_dim) {
        PyErr_SetString(PyExc_ValueError, "decode: inconsistent shapes");
        return NULL;
    }
    const int64_t *row_ids = (const int64_t *)(uintptr_t)rows;
    const int64_t *table = (const int64_t *)(uintptr_t)tables;
    const int64_t *len = (const int64_t *)(uintptr_t)lens;
    int64_t max_len = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (row_ids[b] < 0 || row_ids[b] >= num_rows) {
            PyErr_SetString(PyExc_ValueError, "decode: a row index is out of range");
            return NULL;
        }
        if (len[b] <= 0 || len[b] > table_width * block_size) {
            PyErr_SetString(PyExc_ValueError, "decode: a length does not fit its block table");
            return NULL;
        }
        for (int64_t i = 0; i < (len[b] + block_size - 1) / block_size; i++) {
            const int64_t blk = table[b * table_width + i];
            if (blk < 0 || blk >= num_blocks) {
                PyErr_SetString(PyExc_ValueError, "decode: a block id is out of range");
                return NULL;
            }
        }
        max_len = len[b] > max_len ? len[b] : max_len;
    }
    float *scores = malloc((size_t)(max_len ? max_len : 1) * (size_t)(heads / kv_heads) *
                           sizeof(float));
    if (scores == NULL)
        return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    decode_all((const float *)(uintptr_t)q, (float *)(uintptr_t)out,
               (const float *)(uintptr_t)k_pool, (const float *)(uintptr_t)v_pool, row_ids,
               table, len, batch, heads, kv_heads, head_dim, num_blocks, block_size,
               table_width, q_row_stride, out_row_stride, scale, scores);
    Py_END_ALLOW_THREADS
    free(scores);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(q, out, k_pool, v_pool, rows, tables, lens, batch, num_rows, heads, kv_heads, "
     "head_dim, num_blocks, block_size, table_width, q_row_stride, out_row_stride, scale): "
     "data pointers and "
     "sizes as in the module comment; writes the decode rows of out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_paged_attn",
    "Decode attention over the paged KV pool (float32, CPU), GIL released.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__paged_attn(void) { return PyModule_Create(&module); }
