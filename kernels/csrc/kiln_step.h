/*
 * The head of every native step (compiler/lower_step.py): what a generated step function
 * `kiln_step_run` calls and reads. A step is straight-line C that the compiler writes
 * from the graph, one call a node: every shape, weight index, attribute and arena offset is
 * a literal, and what changes per step (the rows, the step's ids, positions and pages, the
 * KV pool) comes in `kiln_step_args`.
 *
 * The kernels are the artefact's kiln_cpu library's (cpu_kernels.c), reached through the
 * table `kiln_kernels`, which the runtime fills from that library once: the step library
 * holds no kernel code of its own and no state (two runners of one artefact in a process
 * share its code, never its pointers). The few graph ops that have no kiln_cpu kernel
 * (rotary rows, element-wise ops, the logits rows' gather) are the small loops below.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* The kernels' signatures (kernels/native.py _SIGNATURES, ABI 15). */
typedef void (*kiln_rmsnorm_fn)(const float *, int64_t, int64_t, const float *, float *,
                                int64_t, int64_t, float, int);
typedef void (*kiln_layernorm_fn)(const float *, int64_t, int64_t, const float *,
                                  const float *, int64_t, float *, int64_t, int64_t, float, int);
typedef void (*kiln_add_rmsnorm_fn)(const float *, const float *, const float *, float *,
                                    float *, int64_t, int64_t, float, int);
typedef void (*kiln_silu_and_mul_fn)(const float *, float *, int64_t, int64_t, int);
typedef void (*kiln_gelu_tanh_fn)(const float *, int64_t, float *, int64_t, int64_t, int);
typedef void (*kiln_softcap_fn)(const float *, int64_t, float, float *, int64_t, int64_t, int);
typedef void (*kiln_rope_fn)(const float *, int64_t, const float *, const float *, float *,
                             int64_t, int64_t, int64_t, int);
typedef void (*kiln_kv_write_fn)(const float *, int64_t, const float *, int64_t,
                                 const int64_t *, int64_t, float *, float *, int64_t, int64_t,
                                 int64_t);
typedef void (*kiln_kv_write_fp8_fn)(const float *, int64_t, const float *, int64_t,
                                     const int64_t *, int64_t, uint8_t *, uint8_t *, int64_t,
                                     int64_t, int64_t, int, float);
typedef int (*kiln_linear_fn)(const float *, int64_t, int64_t, int64_t, const float *, int64_t,
                              const float *, float *, int, int, int);
typedef int (*kiln_qlinear_fn)(const float *, int64_t, int64_t, int64_t, const void *,
                               const void *, int, int64_t, int64_t, const float *, float *, int,
                               int);
typedef int (*kiln_a8_linear_fn)(const float *, int64_t, int64_t, int64_t, const void *,
                                 const void *, int64_t, const float *, float *, int, int);
typedef int (*kiln_embedding_packed_fn)(const int64_t *, int64_t, const float *, int64_t,
                                        int64_t, float *);
typedef int (*kiln_qembedding_fn)(const int64_t *, int64_t, const void *, const void *, int,
                                  int64_t, int64_t, int64_t, float *);
typedef int (*kiln_decode_attention_fn)(const float *, int64_t, const void *, const void *,
                                        int64_t, const int64_t *, int64_t, const int64_t *,
                                        const int64_t *, float *, int64_t, int64_t, int64_t,
                                        int64_t, int64_t, int64_t, float, int, float, float,
                                        const float *, int, int);
typedef int (*kiln_rope_decode_attention_fn)(const float *, int64_t, const float *,
                                             const float *, const int64_t *, float *, float *,
                                             int64_t, const int64_t *, int64_t,
                                             const int64_t *, const int64_t *, float *, int64_t,
                                             int64_t, int64_t, int64_t, int64_t, int64_t, float,
                                             float, const float *, int, int);

/* In kernels/native.py STEP_KERNELS order. */
typedef struct {
    kiln_rmsnorm_fn rmsnorm;
    kiln_add_rmsnorm_fn add_rmsnorm;
    kiln_silu_and_mul_fn silu_and_mul;
    kiln_rope_fn rope;
    kiln_kv_write_fn kv_write;
    kiln_linear_fn linear;
    kiln_qlinear_fn qlinear;
    kiln_a8_linear_fn a8_linear;
    kiln_qlinear_fn ga8_linear; /* same arguments as qlinear */
    kiln_embedding_packed_fn embedding_packed;
    kiln_qembedding_fn qembedding;
    kiln_decode_attention_fn decode_attention;
    kiln_rope_decode_attention_fn rope_decode_attention;
    kiln_gelu_tanh_fn gelu_tanh;
    kiln_softcap_fn softcap;
    kiln_kv_write_fp8_fn kv_write_fp8;
    kiln_layernorm_fn layernorm;
} kiln_kernels;

/* One step, as runtime/native_step.py fills it: every row one token, attending to its
 * sequence's keys up to its own position (a decode step: one row a sequence; a prefill,
 * extend or verify step: one a new token). */
/* LoRA adapters of a step (runtime/lora.py), or NULL in kiln_step_args: none. Adapter j
 * (0 .. adapters - 1) of this step on hook h (the h-th linear an adapter may touch,
 * kiln_step_lora_hooks() of them in graph order) is, at i = h * adapters + j: a[i] = A^T
 * [in, rank], b[i] = B^T [rank, out], both float32, or bfloat16 where bf16[i] (the
 * adapter's file had them so: half the bytes), scale[i] = each rank row's scale (x A^T is
 * scaled, so B is used as stored), and span[i] = for each rank row of B^T the columns
 * [lo, hi) outside which it is zero (a fused linear's B is block-diagonal over its
 * parts); a[i] NULL where the adapter leaves the linear alone.
 * The step's rows with an adapter come as blocks of consecutive rows of one adapter, at
 * most LORA_BLOCK rows each (the runtime makes them), so a prompt's rows read A and B
 * once a block, not once a row. */
#define LORA_BLOCK 8
typedef struct {
    int64_t adapters;
    const void *const *a;
    const void *const *b;
    const int64_t *bf16;
    const float *const *scale;
    const int64_t *rank;
    const int64_t *const *span;
    int64_t blocks;
    const int64_t *block; /* blocks x (first row, rows, adapter j) */
    float *act;           /* rows x the widest gated hook's input: silu(gate) * up */
    float *t;             /* rows x t_stride: each row's x A^T */
    int64_t t_stride;     /* the largest rank */
} kiln_lora;

typedef struct {
    const kiln_kernels *k;
    const void *const *w;       /* the weights, in the order of the manifest's list */
    float *arena;               /* kiln_step_arena_width() x cap floats */
    int64_t cap;                /* rows the arena holds per value */
    int64_t rows;               /* tokens this step, <= cap */
    int64_t out_rows;           /* logits rows */
    const int64_t *ids, *positions, *logits_rows;
    const int64_t *slots;       /* each new token's KV slot */
    const int64_t *kv_index;    /* page tables, one a sequence, each kv_pages wide */
    const int64_t *kv_lens;     /* each row's keys: its position + 1 */
    const int64_t *kv_rows;     /* each row's page table (its sequence) */
    int64_t kv_pages;
    int64_t page_size;
    float *k_pool, *v_pool;     /* [layers, kv_heads, pool_slots, head_dim]: fp32, or fp8
                                 * bytes where the step was lowered for an fp8 pool */
    int64_t pool_slots;
    const float *const *rope;   /* each rope_cos_sin node's table, in graph order */
    int64_t rope_rows;          /* positions every table holds */
    float *logits;              /* out_rows x vocab */
    int64_t threads;
    int64_t *ticks;             /* NULL, or kiln_step_calls() + 1 clock readings (ns) out */
    int64_t failed_at;          /* out: the graph index of the node that failed */
    const kiln_lora *lora;      /* NULL: no row has an adapter */
    float *hidden;              /* the step's second output (NULL: none): hidden states,
                                 * kiln_step_hidden_width() a row, every row's or the
                                 * logits rows' (kiln_step_hidden_rows()) */
    const float *hidden_in;     /* an EAGLE head's: each row's hidden state, read by its
                                 * step_hidden node, kiln_step_hidden_in_width() a row */
} kiln_step_args;

static inline int64_t step_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* After call c (before the first, c = -1): the clock, when profiling. */
#define STEP_TICK(c)                                   \
    do {                                               \
        if (s->ticks) s->ticks[(c) + 1] = step_now();  \
    } while (0)

/* rope_cos_sin's rows for the step's positions, from a table [table_rows][2][dim] (cos,
 * then sin) that the runtime computes with the op's own kernel as positions reach it, so
 * the step's rotary values are the Python executor's to the bit; -1 for a position past
 * the table. */
static int step_rope_rows(const float *table, int64_t table_rows, int64_t dim,
                          const int64_t *pos, int64_t rows, float *cos_o, float *sin_o) {
    for (int64_t r = 0; r < rows; r++) {
        if (pos[r] < 0 || pos[r] >= table_rows) return -1;
        const float *t = table + pos[r] * 2 * dim;
        for (int64_t j = 0; j < dim; j++) {
            cos_o[r * dim + j] = t[j];
            sin_o[r * dim + j] = t[dim + j];
        }
    }
    return 0;
}

enum { STEP_ADD, STEP_MUL };

static void step_binary(int what, const float *a, int64_t as, const float *b, int64_t bs,
                        float *o, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const float *x = a + r * as, *y = b + r * bs;
        float *z = o + r * n;
        if (what == STEP_ADD) {
#pragma omp simd
            for (int64_t i = 0; i < n; i++) z[i] = x[i] + y[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < n; i++) z[i] = x[i] * y[i];
        }
    }
}

enum { STEP_SCALE, STEP_SILU, STEP_RELU2 };

/* x * c (torch's one rounding, so bit for bit); silu (c unused), within a few ulp of
 * torch's: no family kiln lowers has a bare silu (theirs are fused into silu_and_mul);
 * relu(x)^2 (Nemotron's, Arcee's MLP; one rounding, as torch's). */
static void step_unary(int what, const float *x, int64_t xs, float c, float *o, int64_t rows,
                       int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const float *a = x + r * xs;
        float *z = o + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float v = a[i];
            switch (what) {
            case STEP_SCALE: z[i] = v * c; break;
            case STEP_RELU2: z[i] = v > 0.0f ? v * v : 0.0f; break;
            default: z[i] = v / (1.0f + expf(-v)); break;
            }
        }
    }
}

/* Rows of n floats from x (stride xs) to o (stride os): a concat's part, a second output. */
static void step_copy(const float *x, int64_t xs, int64_t n, int64_t rows, float *o,
                      int64_t os) {
    for (int64_t r = 0; r < rows; r++) memcpy(o + r * os, x + r * xs, (size_t)n * sizeof(float));
}

/* Rows `idx` of x (rows, n floats, stride xs) -> o; -1 for an index outside [0, rows). */
static int step_gather(const float *x, int64_t xs, int64_t n, int64_t rows, const int64_t *idx,
                       int64_t count, float *o) {
    for (int64_t r = 0; r < count; r++) {
        if (idx[r] < 0 || idx[r] >= rows) return -1;
        for (int64_t i = 0; i < n; i++) o[r * n + i] = x[idx[r] * xs + i];
    }
    return 0;
}

static inline float bf16_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* t[b] = (x[b] A^T) * scale for the block's n rows; A float32 or bfloat16 (the loops are
 * written twice so that each vectorises with its load). */
static void lora_down(const float *x, int64_t xs, int64_t n, int64_t in, const void *A,
                      int bf16, const float *scale, int64_t rank, float *t, int64_t ts) {
    for (int64_t b = 0; b < n; b++)
        for (int64_t q = 0; q < rank; q++) t[b * ts + q] = 0.0f;
    for (int64_t i = 0; i < in; i++) {
        for (int64_t b = 0; b < n; b++) {
            const float v = x[b * xs + i];
            float *tb = t + b * ts;
            if (bf16) {
                const uint16_t *Ai = (const uint16_t *)A + i * rank;
#pragma omp simd
                for (int64_t q = 0; q < rank; q++) tb[q] += v * bf16_float(Ai[q]);
            } else {
                const float *Ai = (const float *)A + i * rank;
#pragma omp simd
                for (int64_t q = 0; q < rank; q++) tb[q] += v * Ai[q];
            }
        }
    }
    for (int64_t b = 0; b < n; b++)
        for (int64_t q = 0; q < rank; q++) t[b * ts + q] *= scale[q];
}

/* o[b] += t[b] B^T for the block's n rows, each rank row of B^T within its span. */
static void lora_up(const float *t, int64_t ts, int64_t n, const void *B, int bf16,
                    int64_t rank, const int64_t *span, float *o, int64_t os, int64_t out) {
    for (int64_t q = 0; q < rank; q++) {
        const int64_t lo = span[2 * q], hi = span[2 * q + 1];
        for (int64_t b = 0; b < n; b++) {
            const float v = t[b * ts + q];
            float *orow = o + b * os;
            if (bf16) {
                const uint16_t *Bq = (const uint16_t *)B + q * out;
#pragma omp simd
                for (int64_t c = lo; c < hi; c++) orow[c] += v * bf16_float(Bq[c]);
            } else {
                const float *Bq = (const float *)B + q * out;
#pragma omp simd
                for (int64_t c = lo; c < hi; c++) orow[c] += v * Bq[c];
            }
        }
    }
}

/* Hook h after a linear: each row with an adapter on it adds x A^T B^T to its output row
 * (x: the linear's input row, `in` floats; gated: silu(gate) * up of a row 2 * in wide, the
 * down projection's fused prologue, computed here by the silu_and_mul kernel). Blocks go
 * to the threads whole. One block (a decode step's row) runs on one thread: splitting its
 * rank and output columns between two ran no faster (a 2-core Zen 3, rank 64: 42 against
 * 46 tok/s; the adapter's bytes bound it, read at 13-20 GB/s by one core). */
static void step_lora(const kiln_step_args *s, int64_t h, const float *x, int64_t xs,
                      int64_t in, int gated, float *o, int64_t os, int64_t out, int64_t rows,
                      int T) {
    const kiln_lora *L = s->lora;
    int64_t any = 0; /* does any adapter of the step touch this linear? */
    for (int64_t k = 0; k < L->blocks && !any; k++)
        any = L->a[h * L->adapters + L->block[3 * k + 2]] != NULL;
    if (!any) return;
    if (gated) {
        if (xs == 2 * in) {
            s->k->silu_and_mul(x, L->act, rows, in, T);
        } else {
            for (int64_t r = 0; r < rows; r++)
                for (int64_t i = 0; i < in; i++) {
                    const float g = x[r * xs + i];
                    L->act[r * in + i] = g / (1.0f + expf(-g)) * x[r * xs + in + i];
                }
        }
        x = L->act;
        xs = in;
    }
    const int64_t ts = L->t_stride, nb = L->blocks;
#pragma omp parallel for num_threads(T) schedule(dynamic, 1) if (T > 1 && nb > 1)
    for (int64_t k = 0; k < nb; k++) {
        const int64_t r0 = L->block[3 * k], n = L->block[3 * k + 1];
        const int64_t at = h * L->adapters + L->block[3 * k + 2];
        if (!L->a[at]) continue;
        const int64_t rank = L->rank[at];
        float *t = L->t + r0 * ts;
        const int bf16 = L->bf16[at] != 0;
        lora_down(x + r0 * xs, xs, n, in, L->a[at], bf16, L->scale[at], rank, t, ts);
        lora_up(t, ts, n, L->b[at], bf16, rank, L->span[at], o + r0 * os, os, out);
    }
}

#define STEP_CALL(node, call)              \
    do {                                   \
        const int rc_ = (call);            \
        if (rc_ != 0) {                    \
            s->failed_at = (node);         \
            return rc_;                    \
        }                                  \
    } while (0)
