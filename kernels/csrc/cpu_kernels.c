/*
 * kiln's CPU kernels (fp32), built on the machine that runs them (see kernels/cpu.py):
 * gcc -O3 -march=native -fopenmp. Plain C with a flat ABI, called through ctypes, so the
 * build needs no torch headers (about a second) and is tied to no torch version.
 *
 * Tensors arrive as raw pointers with an explicit row stride (elements) where a view of a
 * wider row (a column slice of the fused QKV output) is read in place. Loops meant for
 * SIMD carry `omp simd`; reductions under it may be reassociated, nothing else is.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

/* Work below this many elements runs on the calling thread, where handing half to the
 * OpenMP team costs more than it saves (measured: SiLU-and-mul of 16 x 1536 elements,
 * 29 -> 17 us on two threads; RMSNorm of 16 x 576 gains nothing). */
#define PARALLEL_MIN_ELEMS (1 << 14)

/* exp(x) in float, branch-free so that loops calling it vectorize (glibc's expf does not
 * without -ffast-math). Range reduction x = n ln2 + r with ln2 split in two, then the
 * Cephes degree-6 polynomial; about 1 ulp on [-87, 88]. Inputs are clamped to that range:
 * exp(-87) = 1.6e-38 stands in for smaller results, which only ever meet a sum >= 1. */
static inline float kexp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* Round to nearest by adding and subtracting 1.5 * 2^23 (no libm call, so it
     * vectorizes; valid without -ffast-math, which would fold it away). */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

static inline void rms_row(const float *x, const float *w, float *out, int64_t n, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

/* out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps) over rows of n features. The input holds
 * `groups` such rows side by side per line of `x_stride` floats (groups > 1: Qwen3's
 * per-head q/k norm, read in place from the fused QKV output); out is contiguous. */
void kiln_rmsnorm_f32(const float *x, int64_t x_stride, int64_t groups, const float *w,
                      float *out, int64_t rows, int64_t n, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++)
        rms_row(x + (r / groups) * x_stride + (r % groups) * n, w, out + r * n, n, eps);
}

/* total = x + residual; out = rmsnorm(total). Both outputs are contiguous [rows, n]. */
void kiln_add_rmsnorm_f32(const float *x, const float *residual, const float *w, float *out,
                          float *total, int64_t rows, int64_t n, float eps,
                          int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *a = x + r * n, *b = residual + r * n;
        float *t = total + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) t[i] = a[i] + b[i];
        rms_row(t, w, out + r * n, n, eps);
    }
}

/* out[r, i] = silu(x[r, i]) * x[r, d + i] for the fused [gate | up] projection. */
void kiln_silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t d, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * d >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * 2 * d, *u = g + d;
        float *o = out + r * d;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) o[i] = g[i] / (1.0f + kexp(-g[i])) * u[i];
    }
}

/* Rotary embedding, rotate-half layout, on `heads` heads of width `dim` per token row.
 * cos / sin are the per-token tables [tokens, dim]: cos repeated over both halves, sin
 * negated on the first half, so out = x * cos + swap_halves(x) * sin. */
void kiln_rope_f32(const float *x, int64_t x_stride, const float *cos_t, const float *sin_t,
                   float *out, int64_t tokens, int64_t heads, int64_t dim,
                   int threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads) if (tokens * heads * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + t * dim, *s = sin_t + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * x_stride + h * dim;
            float *o = out + (t * heads + h) * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) o[i] = xh[i] * c[i] + xh[i + half] * s[i];
#pragma omp simd
            for (int64_t i = half; i < dim; i++) o[i] = xh[i] * c[i] + xh[i - half] * s[i];
        }
    }
}

/* Write new tokens' K and V rows ([tokens, kv_heads * dim], rows `stride` apart) into
 * one layer of the head-major pool [kv_heads, slots, dim] at `out_slots`. */
void kiln_kv_write_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                       const int64_t *out_slots, int64_t tokens, float *k_cache,
                       float *v_cache, int64_t slots, int64_t kv_heads, int64_t dim) {
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t at = (h * slots + out_slots[t]) * dim;
            memcpy(k_cache + at, k + t * k_stride + h * dim, (size_t)dim * sizeof(float));
            memcpy(v_cache + at, v + t * v_stride + h * dim, (size_t)dim * sizeof(float));
        }
    }
}

/* Eight floats; aligned(4) lets it load from any float address. */
typedef float v8f __attribute__((vector_size(32), aligned(4)));

static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* The eight sums of a[0..7], as one vector. */
static inline v8f hsum8x8(const v8f *a) {
#ifdef __AVX__
    /* Pairwise horizontal adds and one cross-lane add: 7 instructions, not 8 scalar
     * reductions through memory. */
    __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]);
    __m256 t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]);
    __m256 t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                              _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    v8f r;
    for (int c = 0; c < 8; c++) r[c] = hsum8(a[c]);
    return r;
#endif
}

/* scores[i] = dot(qh, base + offs[i]) for n key rows of width dim (a multiple of 8).
 * Eight keys at a time: one dot is a chain of dim/8 dependent FMAs, so eight independent
 * chains keep the FMA units busy where one would wait on latency. */
static void score_keys(const float *qh, const float *base, const int64_t *offs, int64_t n,
                       int64_t dim, float *scores) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f a[8] = {{0}};
        for (int64_t d = 0; d < dim; d += 8) {
            const v8f qv = *(const v8f *)(qh + d);
            for (int c = 0; c < 8; c++) a[c] += qv * *(const v8f *)(base + offs[i + c] + d);
        }
        *(v8f *)(scores + i) = hsum8x8(a);
    }
    for (; i < n; i++) {
        const float *r = base + offs[i];
        v8f a = {0};
        for (int64_t d = 0; d < dim; d += 8) a += *(const v8f *)(qh + d) * *(const v8f *)(r + d);
        scores[i] = hsum8(a);
    }
}

/* out = scale * sum_i p[i] * row_i over n value rows at base + offs[i]. The output is
 * built 64 floats at a time in eight registers across all rows (an accumulator kept in
 * memory would put a store-to-load round trip on every row). */
static void weigh_values(const float *p, const float *base, const int64_t *offs, int64_t n,
                         int64_t dim, float scale, float *out) {
    int64_t d = 0;
    for (; d + 64 <= dim; d += 64) {
        v8f a[8] = {{0}};
        for (int64_t i = 0; i < n; i++) {
            const float *r = base + offs[i] + d;
            const v8f w = {p[i], p[i], p[i], p[i], p[i], p[i], p[i], p[i]};
            for (int c = 0; c < 8; c++) a[c] += w * *(const v8f *)(r + 8 * c);
        }
        for (int c = 0; c < 8; c++) *(v8f *)(out + d + 8 * c) = a[c] * scale;
    }
    for (; d < dim; d += 8) {
        v8f a = {0};
        for (int64_t i = 0; i < n; i++) {
            const v8f w = {p[i], p[i], p[i], p[i], p[i], p[i], p[i], p[i]};
            a += w * *(const v8f *)(base + offs[i] + d);
        }
        *(v8f *)(out + d) = a * scale;
    }
}

/* s[i] = exp(s[i] - max(s)) in place; returns 1 / sum, folded into the output later. */
static float softmax_unnormalised(float *s, int64_t n) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) {
        s[i] = kexp(s[i] - m);
        sum += s[i];
    }
    return 1.0f / sum;
}

/* Decode attention straight from the paged pool: one new token per sequence, read
 * through its page table, no gather. Work items are (sequence, KV head), so the query
 * heads sharing a KV head run on one core and K/V rows come from memory once. q: [batch, heads * dim] (rows `q_stride` apart); pools: one layer, [kv_heads,
 * slots, dim]; page_table: [batch, max_pages]; a key j of a sequence of kv_len tokens is
 * seen when j >= kv_len - window (window <= 0: no window). dim must be a multiple of 8.
 * out: [batch, heads * dim]. Returns -1 if scratch memory could not be had, else 0. */
int kiln_decode_attention_f32(const float *q, int64_t q_stride, const float *k_cache,
                              const float *v_cache, int64_t slots, const int64_t *page_table,
                              int64_t max_pages, const int64_t *kv_lens, float *out,
                              int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                              int64_t page_size, int64_t window, float scale, int threads) {
    const int64_t group = heads / kv_heads;
    int64_t longest = 1;
    for (int64_t b = 0; b < batch; b++) longest = kv_lens[b] > longest ? kv_lens[b] : longest;
    int failed = 0;

#pragma omp parallel num_threads(threads) if (batch * kv_heads > 1)
    {
        float *scores = malloc((size_t)longest * sizeof(float));
        int64_t *offs = malloc((size_t)longest * sizeof(int64_t));
        float *qs = malloc((size_t)dim * sizeof(float));
        if (!scores || !offs || !qs) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t kh = 0; kh < kv_heads; kh++) {
                if (failed) continue;
                const int64_t len = kv_lens[b];
                const int64_t start = (window > 0 && len > window) ? len - window : 0;
                const int64_t n = len - start;
                const int64_t *pages = page_table + b * max_pages;
                /* Row offset of every visible key within one head's slots. */
                for (int64_t j = start, i = 0; j < len; j++, i++)
                    offs[i] = (pages[j / page_size] * page_size + j % page_size) * dim;
                const float *kb = k_cache + kh * slots * dim;
                const float *vb = v_cache + kh * slots * dim;
                /* The group's query heads one after another: the K/V rows the first one
                 * brought into cache serve the others. */
                for (int64_t g = 0; g < group; g++) {
                    const int64_t h = kh * group + g;
                    const float *src = q + b * q_stride + h * dim;
#pragma omp simd
                    for (int64_t i = 0; i < dim; i++) qs[i] = src[i] * scale;
                    score_keys(qs, kb, offs, n, dim, scores);
                    const float inv = softmax_unnormalised(scores, n);
                    weigh_values(scores, vb, offs, n, dim, inv, out + (b * heads + h) * dim);
                }
            }
        }
        free(scores);
        free(offs);
        free(qs);
    }
    return failed ? -1 : 0;
}

/* ---- Linear layers with few rows (serving decode batches) ----
 *
 * out[m, n] = x[m, :] . w[n, :] (+ bias[n]) for m up to a few dozen rows. Such a GEMM
 * streams every weight once and uses each m times, so it lives or dies by how well the
 * weight stream flows. Weights are repacked once into column blocks, [N / L][K][L]
 * (L = lanes of one vector; zero past N): a block is one contiguous stream. x is
 * transposed per call into row tiles, [tiles][K][TILE_ROWS], so the rows' values for one
 * k share a cache line. Per k, a tile does one weight-vector load and one FMA per row
 * with x broadcast from memory, accumulating in registers. The weight stream is
 * software-prefetched PREFETCH_BYTES ahead: the hardware prefetcher alone left it about
 * 25% slower, and x read in place, rows apart, cost up to 40% from 16 rows up. */
#ifdef __AVX512F__
#define LANES 16
#define TILE_ROWS 16 /* 16 accumulators + the weight vector fit in 32 registers */
#else
#define LANES 8
#define TILE_ROWS 8 /* 16 registers on AVX2 */
#endif
#define PREFETCH_BYTES 2048
typedef float vlf __attribute__((vector_size(LANES * 4), aligned(4)));

int64_t kiln_linear_lanes(void) { return LANES; }
int64_t kiln_linear_tile_rows(void) { return TILE_ROWS; }

/* packed[b][k][l] = w[b * LANES + l][k] for w [n, k] row-major. */
void kiln_pack_linear_f32(const float *w, int64_t n, int64_t k, float *packed, int threads) {
    const int64_t blocks = (n + LANES - 1) / LANES;
#pragma omp parallel for num_threads(threads)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t l = 0; l < LANES; l++) {
                const int64_t row = b * LANES + l;
                packed[(b * k + kk) * LANES + l] = row < n ? w[row * k + kk] : 0.0f;
            }
}

/* One tile: `rows` rows (xt: [k][TILE_ROWS]) against one packed column block. Always
 * inlined with a constant `rows`, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void linear_tile(
    const float *xt, int64_t k, const float *block, const float *bias, float *out, int64_t n,
    int64_t cols, const int rows) {
    vlf acc[TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = (vlf){0};
    for (int64_t kk = 0; kk < k; kk++) {
        __builtin_prefetch(block + kk * LANES + PREFETCH_BYTES / 4);
        const vlf w = *(const vlf *)(block + kk * LANES);
        const float *xk = xt + kk * TILE_ROWS;
        for (int r = 0; r < rows; r++) acc[r] += xk[r] * w;
    }
    vlf add = {0};
    for (int64_t c = 0; bias && c < cols; c++) add[c] = bias[c];
    for (int r = 0; r < rows; r++) {
        acc[r] += add;
        if (cols == LANES) {
            *(vlf *)(out + r * n) = acc[r];
        } else {
            for (int64_t c = 0; c < cols; c++) out[r * n + c] = acc[r][c];
        }
    }
}

#define TILE_CASE(R) \
    case R: linear_tile(xt, k, block, bias, out, n, cols, R); break;

static void linear_rows(const float *xt, int64_t k, const float *block, const float *bias,
                        float *out, int64_t n, int64_t cols, int64_t rows) {
    switch (rows) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
        TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
#if TILE_ROWS == 16
        TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
        TILE_CASE(13) TILE_CASE(14) TILE_CASE(15) TILE_CASE(16)
#endif
        default: break;
    }
}

/* x: [m, k] contiguous; packed: from kiln_pack_linear_f32; bias: [n] or NULL; out: [m, n].
 * Column blocks are split between threads; each thread runs all row tiles of its blocks
 * (a block re-read for a further row tile comes from cache). Returns -1 if the transposed
 * copy of x could not be allocated, else 0. */
int kiln_linear_f32(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                    const float *bias, float *out, int threads) {
    const int64_t blocks = (n + LANES - 1) / LANES;
    const int64_t tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    float *xt = malloc((size_t)(tiles * k * TILE_ROWS) * sizeof(float));
    if (!xt) return -1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for collapse(2)
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t kk = 0; kk < k; kk++)
                for (int r = 0; r < TILE_ROWS; r++) {
                    const int64_t row = t * TILE_ROWS + r;
                    xt[(t * k + kk) * TILE_ROWS + r] = row < m ? x[row * k + kk] : 0.0f;
                }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const float *block = packed + b * k * LANES;
            const int64_t cols = n - b * LANES < LANES ? n - b * LANES : LANES;
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t rows = m - t * TILE_ROWS < TILE_ROWS ? m - t * TILE_ROWS : TILE_ROWS;
                linear_rows(xt + t * k * TILE_ROWS, k, block, bias ? bias + b * LANES : NULL,
                            out + t * TILE_ROWS * n + b * LANES, n, cols, rows);
            }
        }
    }
    free(xt);
    return 0;
}
