/*
 * kiln's CPU kernels (fp32), built by `kiln compile` for the artefact's target (see
 * kernels/native.py): gcc -O3 -march=<x86-64 level> -fopenmp. Plain C with a flat ABI, called
 * through ctypes, so the build needs no torch headers (about a second) and is tied to no
 * torch version.
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
    /* The clamp is taken on x's bits, as integer minima: a float select here made GCC
     * compute the clamped ends as paths of their own and blend them, and on AVX2 the
     * caller's expression at those constant ends (silu's x / (1 + e^87)) came out
     * subnormal, a microcode assist every vector: SiLU ran 2.6x slower than scalar. As
     * unsigned, every x below -87 (a negative NaN too) is above -87's bits; as signed,
     * every x above 88 is above 88's. A NaN in is given back as it came. */
    const float in = x;
    uint32_t bits_in;
    memcpy(&bits_in, &x, sizeof bits_in);
    bits_in = bits_in < 0xC2AE0000u ? bits_in : 0xC2AE0000u; /* -87.0f */
    int32_t clamped = (int32_t)bits_in;
    clamped = clamped < 0x42B00000 ? clamped : 0x42B00000; /* 88.0f */
    memcpy(&x, &clamped, sizeof x);
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
    return in == in ? p * scale : in;
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

/* out[r] = (x[r] - mean) / sqrt(var + eps) * w (+ b: NULL for none) over rows of n, out
 * contiguous (LayerNorm: StarCoder 2's). Each of x's rows, `x_stride` apart, holds `groups`
 * rows of n side by side (per-head q/k norms; `rows` counts those); row r's weight and
 * bias start (r % groups) * w_step in (w_step 0: one weight for every group, n: a weight
 * per feature, Cohere's and StableLM's per-head norms). The mean first, then the variance
 * as the mean of squared deviations, both summed in double (rows far from zero mean keep
 * their deviations; no cancellation from E[x^2] - E[x]^2). */
void kiln_layernorm_f32(const float *x, int64_t x_stride, int64_t groups, const float *w,
                        const float *b, int64_t w_step, float *out, int64_t rows, int64_t n,
                        float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *a = x + (r / groups) * x_stride + (r % groups) * n;
        const float *wr = w + (r % groups) * w_step, *br = b ? b + (r % groups) * w_step : NULL;
        float *o = out + r * n;
        double sum = 0.0;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) sum += a[i];
        const float mean = (float)(sum / (double)n);
        double ss = 0.0;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) {
            const double d = (double)a[i] - (sum / (double)n);
            ss += d * d;
        }
        const float inv = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
        if (br) {
#pragma omp simd
            for (int64_t i = 0; i < n; i++) o[i] = (a[i] - mean) * inv * wr[i] + br[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < n; i++) o[i] = (a[i] - mean) * inv * wr[i];
        }
    }
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

/* out[r, i] = silu(x[r, i]) * x[r, d + i] for the fused [gate | up] projection's rows,
 * `x_stride` apart. */
static void silu_mul_rows(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t d,
                          int threads) {
#pragma omp parallel for num_threads(threads) if (rows * d >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * x_stride, *u = g + d;
        float *o = out + r * d;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) o[i] = g[i] / (1.0f + kexp(-g[i])) * u[i];
    }
}

void kiln_silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t d, int threads) {
    silu_mul_rows(x, 2 * d, out, rows, d, threads);
}

/* out[r, i] = f(x[r, i]) over `rows` rows of n, x's `x_stride` apart, out contiguous;
 * EXPR computes f from the element v. Vectorized, threaded above PARALLEL_MIN_ELEMS. */
#define MAP_ROWS(EXPR)                                                          \
    _Pragma("omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN_ELEMS)") \
    for (int64_t r = 0; r < rows; r++) {                                        \
        const float *a_ = x + r * x_stride;                                     \
        float *o_ = out + r * n;                                                \
        _Pragma("omp simd") for (int64_t i = 0; i < n; i++) {                   \
            const float v = a_[i];                                              \
            o_[i] = (EXPR);                                                     \
        }                                                                       \
    }

/* out[r, i] = gelu(x[r, i]) with the tanh approximation (Gemma's MLP), rows `x_stride`
 * apart: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), taken as
 * x / (1 + exp(-2u)) (silu's form, through kexp): no cancellation where tanh(u) nears -1,
 * no overflow at either end, and the loop vectorizes (libm's tanhf does not: Gemma 3
 * 270M has 18 x 2048 of them a token). */
void kiln_gelu_tanh_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t n,
                        int threads) {
    MAP_ROWS(v / (1.0f + kexp(-1.5957691216057308f * (v + 0.044715f * v * v * v))));
}

/* tanh(y) as sign(y) (1 - e) / (1 + e), e = exp(-2|y|) through kexp: no overflow, within
 * about 1e-7 of tanh absolute, and it vectorizes. */
static inline float ktanh(float y) {
    const float e = kexp(-2.0f * fabsf(y));
    return copysignf((1.0f - e) / (1.0f + e), y);
}

/* out[r, i] = tanh(x[r, i] / cap) * cap (Gemma 2's final-logit softcap), rows `x_stride`
 * apart. */
void kiln_softcap_f32(const float *x, int64_t x_stride, float cap, float *out, int64_t rows,
                      int64_t n, int threads) {
    MAP_ROWS(ktanh(v / cap) * cap);
}

/* One head of width dim: out = x * c + swap_halves(x) * s. */
static inline void rope_head(const float *x, const float *c, const float *s, float *out,
                             int64_t dim) {
    const int64_t half = dim / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) out[i] = x[i] * c[i] + x[i + half] * s[i];
#pragma omp simd
    for (int64_t i = half; i < dim; i++) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

/* Rotary embedding, rotate-half layout, on `heads` heads of width `dim` per token row.
 * cos / sin are the per-token tables [tokens, dim]: cos repeated over both halves, sin
 * negated on the first half, so out = x * cos + swap_halves(x) * sin. */
void kiln_rope_f32(const float *x, int64_t x_stride, const float *cos_t, const float *sin_t,
                   float *out, int64_t tokens, int64_t heads, int64_t dim,
                   int threads) {
#pragma omp parallel for num_threads(threads) if (tokens * heads * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + t * dim, *s = sin_t + t * dim;
        for (int64_t h = 0; h < heads; h++)
            rope_head(x + t * x_stride + h * dim, c, s, out + (t * heads + h) * dim, dim);
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

/* Pool element formats of decode attention: fp32, or one byte per element (fp8 e4m3 /
 * e5m2, as torch's float8_e4m3fn / float8_e5m2 lay them out). */
enum { KV_F32 = 0, KV_E4M3 = 1, KV_E5M2 = 2 };

/* fp32 -> fp8 e4m3fn (fmt 1) or e5m2 (fmt 2) byte, as torch's `.to(float8_...)` rounds:
 * to nearest, ties to even, on the magnitude's bits. A normal result: drop the low mantissa
 * bits after adding half an fp8 ulp less one (plus the kept bits' low bit, for the tie),
 * the exponent rebiased; a subnormal one: adding 2^(fp8 min normal exponent + 23 - fp8
 * mantissa bits) lets the FPU's own rounding line up the fp8 mantissa in the low bits.
 * Magnitudes past the format (and NaN) give its NaN (e4m3fn, which has no inf) or, for
 * e5m2, inf / NaN; the writer below saturates first, as attention.py's to_pool does. */
static inline uint8_t f32_to_fp8(float x, int fmt) {
    const int mbits = fmt == KV_E4M3 ? 3 : 2, bias = fmt == KV_E4M3 ? 7 : 15;
    const int drop = 23 - mbits;
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7FFFFFFFu;
    /* first magnitude that rounds past the largest finite value */
    const uint32_t over = fmt == KV_E4M3 ? 0x43F00000u /* 480 */ : 0x47800000u /* 65536 */;
    if (u >= over) {
        if (fmt == KV_E4M3) return sign | 0x7F;
        return sign | (u > 0x7F800000u ? 0x7F : 0x7C);
    }
    const uint32_t min_normal = (uint32_t)(127 + 1 - bias) << 23;
    if (u < min_normal) {
        const uint32_t magic = (uint32_t)(128 - bias + drop) << 23; /* 2^(1 - bias + drop) */
        float f, m;
        memcpy(&f, &u, sizeof f);
        memcpy(&m, &magic, sizeof m);
        f += m;
        memcpy(&u, &f, sizeof u);
        return sign | (uint8_t)(u - magic);
    }
    const uint32_t odd = (u >> drop) & 1u;
    u += ((uint32_t)(bias - 127) << 23) + ((1u << (drop - 1)) - 1u) + odd;
    return sign | (uint8_t)(u >> drop);
}

/* kiln_kv_write_f32 for an fp8 pool (fmt KV_E4M3 / KV_E5M2): each value / kv_scale,
 * saturated to the format's largest finite value (NaN kept), as one byte. */
void kiln_kv_write_fp8(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                       const int64_t *out_slots, int64_t tokens, uint8_t *k_cache,
                       uint8_t *v_cache, int64_t slots, int64_t kv_heads, int64_t dim, int fmt,
                       float kv_scale) {
    const float big = fmt == KV_E4M3 ? 448.0f : 57344.0f;
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t at = (h * slots + out_slots[t]) * dim;
            const float *kr = k + t * k_stride + h * dim, *vr = v + t * v_stride + h * dim;
            for (int64_t i = 0; i < dim; i++) {
                float a = kr[i] / kv_scale, b = vr[i] / kv_scale;
                a = a > big ? big : a < -big ? -big : a;
                b = b > big ? big : b < -big ? -big : b;
                k_cache[at + i] = f32_to_fp8(a, fmt);
                v_cache[at + i] = f32_to_fp8(b, fmt);
            }
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

/* Rows ahead of use that decode attention asks the memory for. */
#define KV_AHEAD 16
#define DECODE_PART_MIN 64  /* keys a part of a split decode row at least */
#define DECODE_PARTS_MAX 16 /* parts a split decode row at most */

typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

/* Eight pool elements from `base` (a row offset `off` elements in) as floats. fp8 bytes
 * become floats by moving their exponent and mantissa bits into an fp32's fields and
 * multiplying by 2^(127 - bias), which also turns their subnormals into exact fp32
 * subnormals. The pool never holds NaN or inf (writes saturate). Always inlined with a
 * constant format, so the fp32 path is a plain load. */
static inline __attribute__((always_inline)) v8f kv_load8(const void *base, int64_t off,
                                                           int fmt) {
    if (fmt == KV_F32) return *(const v8f *)((const float *)base + off);
    const uint8_t *p = (const uint8_t *)base + off;
#ifdef __AVX2__
    const v8i u = (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    v8i u;
    for (int c = 0; c < 8; c++) u[c] = p[c];
#endif
    const v8i bits = ((u & 0x80) << 24) | ((u & 0x7F) << (fmt == KV_E4M3 ? 20 : 21));
    v8f f;
    memcpy(&f, &bits, sizeof f);
    return f * (fmt == KV_E4M3 ? 0x1p120f : 0x1p112f);
}

/* Row offsets (in elements of one head's slots) of n consecutive keys from position
 * `start` of a sequence, through its page table: one division for the lot (a division a
 * key, by a page size known only at run time, was an eighth of a 129-key decode row). */
static inline void key_rows(const int64_t *pages, int64_t page_size, int64_t start, int64_t n,
                            int64_t dim, int64_t *offs) {
    int64_t page = start / page_size, at = start % page_size;
    for (int64_t i = 0; i < n; i++) {
        offs[i] = (pages[page] * page_size + at) * dim;
        if (++at == page_size) {
            at = 0;
            page++;
        }
    }
}

/* Ask for the row `off` elements into base (dim elements of the format) ahead of its use:
 * rows of a sequence sit on scattered pages, where the hardware prefetcher, which follows
 * one address stream, waits for each page's first miss. */
static inline __attribute__((always_inline)) void prefetch_row(const void *base, int64_t off,
                                                               int64_t dim, int fmt) {
    const int64_t bytes = dim * (fmt == KV_F32 ? 4 : 1);
    const char *p = (const char *)base + off * (fmt == KV_F32 ? 4 : 1);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

#ifdef __AVX512F__
/* Sixteen floats: an fp32 pool's rows in zmm registers, half the FMAs of two v8f. */
typedef float v16f __attribute__((vector_size(64), aligned(4)));

/* The eight sums of a[0..7] (each 16 wide), as one vector: each folded to 8 lanes, then
 * hsum8x8. */
static inline v8f hsum16x8(const v16f *a) {
    v8f h[8];
    for (int c = 0; c < 8; c++) {
        const __m512 z = (__m512)a[c];
        h[c] = (v8f)_mm256_add_ps(_mm512_castps512_ps256(z),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
    }
    return hsum8x8(h);
}
#endif

/* Vectors of fp32 K/V rows: 16 lanes on AVX-512, else 8. */
#ifdef __AVX512F__
#define AT_LANES 16
typedef v16f vaf;
#else
#define AT_LANES 8
typedef v8f vaf;
#endif

/* scores[g * n + i] = dot(qs + g * dim, base + offs[i]) for the hn query heads of one KV
 * head against its n key rows of width dim (a multiple of 8). Eight keys at a time: one dot
 * is a chain of dim/8 dependent FMAs, so eight independent chains keep the FMA units busy
 * where one would wait on latency; each query head takes its turn on those eight rows
 * while they sit in L1 (head after head over all the keys read every key from L2 again for
 * each: a KV head's 129 keys of SmolLM2 are 33 KB). An fp32 pool on AVX-512 (dim a
 * multiple of 16) takes 16 lanes a FMA: a verify step's rows each attend to their
 * request's whole cache, and that arithmetic, not memory, was their cost (1.7 us per cached
 * token a row for SmolLM2 at 8 lanes on a 2-core Xeon). */
static inline __attribute__((always_inline)) void score_keys(const float *qs, int64_t hn,
                                                             const void *base,
                                                             const int64_t *offs, int64_t n,
                                                             int64_t dim, float *scores,
                                                             int fmt) {
    int64_t i = 0;
#ifdef __AVX512F__
    if (fmt == KV_F32 && dim % 16 == 0) {
        const float *kb = (const float *)base;
        for (; i + 8 <= n; i += 8) {
            for (int64_t j = i + KV_AHEAD; j < i + KV_AHEAD + 8 && j < n; j++)
                prefetch_row(base, offs[j], dim, fmt);
            for (int64_t g = 0; g < hn; g++) {
                v16f a[8] = {{0}};
                for (int64_t d = 0; d < dim; d += 16) {
                    const v16f qv = *(const v16f *)(qs + g * dim + d);
                    for (int c = 0; c < 8; c++)
                        a[c] += qv * *(const v16f *)(kb + offs[i + c] + d);
                }
                *(v8f *)(scores + g * n + i) = hsum16x8(a);
            }
        }
    }
#endif
    for (; i + 8 <= n; i += 8) {
        for (int64_t j = i + KV_AHEAD; j < i + KV_AHEAD + 8 && j < n; j++)
            prefetch_row(base, offs[j], dim, fmt);
        for (int64_t g = 0; g < hn; g++) {
            v8f a[8] = {{0}};
            for (int64_t d = 0; d < dim; d += 8) {
                const v8f qv = *(const v8f *)(qs + g * dim + d);
                for (int c = 0; c < 8; c++) a[c] += qv * kv_load8(base, offs[i + c] + d, fmt);
            }
            *(v8f *)(scores + g * n + i) = hsum8x8(a);
        }
    }
    for (; i < n; i++)
        for (int64_t g = 0; g < hn; g++) {
            v8f a = {0};
            for (int64_t d = 0; d < dim; d += 8)
                a += *(const v8f *)(qs + g * dim + d) * kv_load8(base, offs[i] + d, fmt);
            scores[g * n + i] = hsum8(a);
        }
}

/* Value heads a pass of weigh_values over an fp32 pool, and output vectors a head: */
#ifdef __AVX512F__
#define WH 3 /* 3 x 4 accumulators + 4 value vectors + a broadcast of 32 registers */
#define WV 4
#else
#define WH 3 /* 3 x 2 + 2 + 1 of 16 */
#define WV 2
#endif

/* th (at most WH) heads' out[d, d + wv vectors) over an fp32 pool, in registers across all
 * n rows: each value vector loaded once for all of them. One head alone takes 8 vectors a
 * pass (128 floats on AVX-512: a 128-wide head's values read once, not twice). */
static inline __attribute__((always_inline)) void weigh_heads(const float *p, const float *vb,
                                                              const int64_t *offs, int64_t n,
                                                              int64_t dim, int64_t d,
                                                              const float *scale, float *out,
                                                              int64_t out_stride, const int th,
                                                              const int wv, int ahead) {
    vaf a[WH][8];
    for (int t = 0; t < th; t++)
        for (int c = 0; c < wv; c++) a[t][c] = (vaf){0};
    for (int64_t i = 0; i < n; i++) {
        if (ahead && i + KV_AHEAD < n) prefetch_row(vb, offs[i + KV_AHEAD], dim, KV_F32);
        vaf v[8];
        for (int c = 0; c < wv; c++) v[c] = *(const vaf *)(vb + offs[i] + d + c * AT_LANES);
        for (int t = 0; t < th; t++) {
            const float w = p[t * n + i];
            for (int c = 0; c < wv; c++) a[t][c] += w * v[c];
        }
    }
    for (int t = 0; t < th; t++)
        for (int c = 0; c < wv; c++)
            *(vaf *)(out + t * out_stride + d + c * AT_LANES) = a[t][c] * scale[t];
}

/* out + g * out_stride = scale[g] * sum_i p[g * n + i] * row_i for the hn query heads of
 * one KV head over its n value rows at base + offs[i]. The output is built in registers
 * across all rows (an accumulator kept in memory would put a store-to-load round trip on
 * every row), WH heads at a time on an fp32 pool so that a value vector serves them all. */
static inline __attribute__((always_inline)) void weigh_values(const float *p, int64_t hn,
                                                               const void *base,
                                                               const int64_t *offs, int64_t n,
                                                               int64_t dim, const float *scale,
                                                               float *out, int64_t out_stride,
                                                               int fmt) {
    if (fmt == KV_F32 && dim % AT_LANES == 0) {
        const float *vb = (const float *)base;
        int64_t d = 0;
        for (; hn == 1 && d + 8 * AT_LANES <= dim; d += 8 * AT_LANES)
            weigh_heads(p, vb, offs, n, dim, d, scale, out, out_stride, 1, 8, d == 0);
        for (; d + WV * AT_LANES <= dim; d += WV * AT_LANES)
            for (int64_t g = 0; g < hn; g += WH) {
                const float *pg = p + g * n;
                float *og = out + g * out_stride;
                const int ahead = d == 0 && g == 0;
                if (hn - g >= 3)
                    weigh_heads(pg, vb, offs, n, dim, d, scale + g, og, out_stride, 3, WV, ahead);
                else if (hn - g == 2)
                    weigh_heads(pg, vb, offs, n, dim, d, scale + g, og, out_stride, 2, WV, ahead);
                else
                    weigh_heads(pg, vb, offs, n, dim, d, scale + g, og, out_stride, 1, WV, ahead);
            }
        for (; d < dim; d += AT_LANES)
            for (int64_t g = 0; g < hn; g++) {
                vaf a = (vaf){0};
                for (int64_t i = 0; i < n; i++)
                    a += p[g * n + i] * *(const vaf *)(vb + offs[i] + d);
                *(vaf *)(out + g * out_stride + d) = a * scale[g];
            }
        return;
    }
    for (int64_t g = 0; g < hn; g++) {
        const float *pg = p + g * n;
        float *og = out + g * out_stride;
        int64_t d = 0;
        for (; d + 64 <= dim; d += 64) {
            v8f a[8] = {{0}};
            for (int64_t i = 0; i < n; i++) {
                if (g == 0 && d == 0 && i + KV_AHEAD < n)
                    prefetch_row(base, offs[i + KV_AHEAD], dim, fmt);
                const v8f w = {pg[i], pg[i], pg[i], pg[i], pg[i], pg[i], pg[i], pg[i]};
                for (int c = 0; c < 8; c++) a[c] += w * kv_load8(base, offs[i] + d + 8 * c, fmt);
            }
            for (int c = 0; c < 8; c++) *(v8f *)(og + d + 8 * c) = a[c] * scale[g];
        }
        for (; d < dim; d += 8) {
            v8f a = {0};
            for (int64_t i = 0; i < n; i++) {
                const v8f w = {pg[i], pg[i], pg[i], pg[i], pg[i], pg[i], pg[i], pg[i]};
                a += w * kv_load8(base, offs[i] + d, fmt);
            }
            *(v8f *)(og + d) = a * scale[g];
        }
    }
}

/* s[i] = exp(s[i] - max(s)) in place; returns 1 / sum, folded into the output later. With
 * a sink (GPT-OSS: a learned logit per head that attends to nothing) the sum also counts
 * exp(sink - max), so the keys share what the sink leaves; sink = -INFINITY: none. */
static float softmax_unnormalised(float *s, int64_t n, float sink, float *max_out) {
    float m = sink;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
    float sum = sink == -INFINITY ? 0.0f : kexp(sink - m);
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) {
        s[i] = kexp(s[i] - m);
        sum += s[i];
    }
    if (max_out) *max_out = m;
    return 1.0f / sum;
}

/* Gemma 2's soft cap: s = cap * tanh(s / cap), in place. */
static void soft_cap(float *s, int64_t n, float cap) {
    for (int64_t i = 0; i < n; i++) s[i] = cap * tanhf(s[i] / cap);
}

/* ---- Several rows of one sequence together (prefill, verify) ----
 *
 * A prefill or verify step gives a sequence many rows, each attending to the keys before
 * it. One row at a time (decode_attention's own loop), every row reads all of its keys
 * again and every FMA has a load of its own: 58 GFLOP/s for a 1536-token causal attention
 * of SmolLM2's shape on a 2-core Xeon, about half of that prefill's time. Here a block of
 * AT_QB rows (times the query heads of one KV head) meets AT_KC keys at a time: the chunk's
 * keys are transposed once into scratch, so one load of a key vector serves AT_QT queries,
 * and the softmax is carried across chunks online (running max and sum, the output
 * rescaled as the max rises): 163 GFLOP/s there (torch's SDPA, causal: 158).
 *
 * Rows form a run when each row's length is at least the row before's and their page tables
 * agree on every page the earlier row reads: then every row's keys are those of the run's
 * last (longest) table up to its own length, whichever request the rows belong to, so the
 * result does not depend on the step telling which rows are whose. An fp32 pool only. */
#ifdef __AVX512F__
#define AT_QT 4 /* queries a tile: 4 x 4 accumulators + 4 key vectors of 32 registers */
#define AT_NV 4
#else
/* 6 x 2 accumulators + 2 key vectors + a broadcast of 16 registers: 8 loads feed 12 FMAs
 * (2 x 4 made 10 loads feed 8: 55 -> 60 GFLOP/s at 128 rows, 76 -> 83 at 512, two cores) */
#define AT_QT 6
#define AT_NV 2
#endif
#define AT_KC (4 * AT_LANES) /* keys a chunk: four vectors */
#define AT_QB 32             /* rows a block */
#define RUN_MIN 4            /* rows that make a run worth blocking */

/* acc[t][c] += a[t * a_stride] * b[c] for the tile's t_n queries (the rest of the tile
 * repeats the first; its sums are never stored): the scores' and the output's inner step,
 * AT_QT broadcast scalars against AT_NV vectors. */
static inline __attribute__((always_inline)) void rank1_tile(vaf acc[AT_QT][AT_NV],
                                                             const float *a, int64_t a_stride,
                                                             int64_t t_n, const float *b) {
    vaf v[AT_NV];
    for (int c = 0; c < AT_NV; c++) v[c] = ((const vaf *)b)[c];
    for (int64_t t = 0; t < AT_QT; t++) {
        const float x = a[(t < t_n ? t : 0) * a_stride];
        for (int c = 0; c < AT_NV; c++) acc[t][c] += x * v[c];
    }
}

/* One block: rows [b0, b1) of a run read through page table `pt`, query heads of KV head kh
 * (kb / vb: that head's slots). `work` holds attend_block_floats(group, dim) floats. */
static int64_t attend_block_floats(int64_t group, int64_t dim) {
    const int64_t nq = AT_QB * group;
    return 2 * nq * dim + dim * AT_KC + nq * AT_KC + 2 * nq;
}

static void attend_block(const float *q, int64_t q_stride, const float *kb, const float *vb,
                         const int64_t *pt, const int64_t *kv_lens, int64_t b0, int64_t b1,
                         float *out, int64_t heads, int64_t group, int64_t kh, int64_t dim,
                         int64_t page_size, int64_t window, float scale, float softcap,
                         const float *sinks, float *work) {
    const int64_t nq = (b1 - b0) * group;
    float *Q = work, *O = Q + AT_QB * group * dim, *Kt = O + AT_QB * group * dim;
    float *S = Kt + dim * AT_KC, *m = S + AT_QB * group * AT_KC, *l = m + AT_QB * group;
    int64_t rows_a[AT_KC], rows_b[AT_KC], *offs = rows_a, *next_offs = rows_b;
    int64_t kmin = INT64_MAX, kmax = 0;
    for (int64_t i = 0; i < nq; i++) {
        const int64_t r = b0 + i / group, h = kh * group + i % group;
        const int64_t len = kv_lens[r], start = (window > 0 && len > window) ? len - window : 0;
        kmin = start < kmin ? start : kmin;
        kmax = len > kmax ? len : kmax;
        const float *src = q + r * q_stride + h * dim;
        for (int64_t d = 0; d < dim; d++) {
            Q[i * dim + d] = src[d] * scale;
            O[i * dim + d] = 0.0f;
        }
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    for (int64_t c0 = kmin; c0 < kmax; c0 += AT_KC) {
        const int64_t kc = kmax - c0 < AT_KC ? kmax - c0 : AT_KC;
        /* The chunk's keys transposed, [dim][AT_KC], zeros past kc. */
        /* this chunk's rows were found (and asked for) as the chunk before's next */
        if (c0 == kmin) {
            key_rows(pt, page_size, c0, kc, dim, offs);
        } else {
            int64_t *was = offs;
            offs = next_offs;
            next_offs = was;
        }
        for (int64_t j = kc; j < AT_KC; j++) offs[j] = -1;
        if (c0 + AT_KC < kmax) { /* the next chunk's keys, asked for now */
            const int64_t next = kmax - c0 - AT_KC < AT_KC ? kmax - c0 - AT_KC : AT_KC;
            key_rows(pt, page_size, c0 + AT_KC, next, dim, next_offs);
            for (int64_t j = 0; j < next; j++) prefetch_row(kb, next_offs[j], dim, KV_F32);
        }
        for (int64_t j = 0; j < AT_KC; j++) {
            const float *row = offs[j] >= 0 ? kb + offs[j] : NULL;
            for (int64_t d = 0; d < dim; d++) Kt[d * AT_KC + j] = row ? row[d] : 0.0f;
        }
        /* Scores, AT_QT queries x AT_NV vectors of keys a tile. */
        for (int64_t i = 0; i < nq; i += AT_QT) {
            const int64_t t_n = nq - i < AT_QT ? nq - i : AT_QT;
            for (int64_t j0 = 0; j0 < AT_KC; j0 += AT_NV * AT_LANES) {
                vaf acc[AT_QT][AT_NV] = {{{0}}};
                for (int64_t d = 0; d < dim; d++)
                    rank1_tile(acc, Q + i * dim + d, dim, t_n, Kt + d * AT_KC + j0);
                for (int64_t t = 0; t < t_n; t++)
                    for (int c = 0; c < AT_NV; c++)
                        *(vaf *)(S + (i + t) * AT_KC + j0 + c * AT_LANES) = acc[t][c];
            }
        }
        /* Each query's visible keys of the chunk into probabilities; the rest to zero. */
        for (int64_t i = 0; i < nq; i++) {
            const int64_t r = b0 + i / group, len = kv_lens[r];
            const int64_t start = (window > 0 && len > window) ? len - window : 0;
            const int64_t a = (start > c0 ? start : c0) - c0;
            const int64_t b = (len < c0 + kc ? len : c0 + kc) - c0;
            float *s = S + i * AT_KC;
            if (b <= a) {
                memset(s, 0, AT_KC * sizeof(float));
                continue;
            }
            if (softcap > 0.0f) soft_cap(s + a, b - a, softcap);
            float mx = m[i];
#pragma omp simd reduction(max : mx)
            for (int64_t j = a; j < b; j++) mx = s[j] > mx ? s[j] : mx;
            const float corr = kexp(m[i] - mx);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < AT_KC; j++) {
                const float p = (j >= a && j < b) ? kexp(s[j] - mx) : 0.0f;
                s[j] = p;
                sum += p;
            }
            l[i] = l[i] * corr + sum;
            /* (O is still zero before a query's first visible key: nothing to rescale) */
            if (corr != 1.0f && m[i] != -INFINITY)
                for (int64_t d = 0; d < dim; d++) O[i * dim + d] *= corr;
            m[i] = mx;
        }
        /* O += P V, AT_QT queries x AT_NV vectors of the output a tile. */
        for (int64_t i = 0; i < nq; i += AT_QT) {
            const int64_t t_n = nq - i < AT_QT ? nq - i : AT_QT;
            int64_t d0 = 0;
            for (; d0 + AT_NV * AT_LANES <= dim; d0 += AT_NV * AT_LANES) {
                vaf acc[AT_QT][AT_NV];
                for (int64_t t = 0; t < AT_QT; t++)
                    for (int c = 0; c < AT_NV; c++)
                        acc[t][c] = *(const vaf *)(O + (i + (t < t_n ? t : 0)) * dim + d0 +
                                                   c * AT_LANES);
                for (int64_t j = 0; j < kc; j++)
                    rank1_tile(acc, S + i * AT_KC + j, AT_KC, t_n, vb + offs[j] + d0);
                for (int64_t t = 0; t < t_n; t++)
                    for (int c = 0; c < AT_NV; c++)
                        *(vaf *)(O + (i + t) * dim + d0 + c * AT_LANES) = acc[t][c];
            }
            for (; d0 < dim; d0 += AT_LANES) {
                for (int64_t t = 0; t < t_n; t++) {
                    vaf a = *(const vaf *)(O + (i + t) * dim + d0);
                    for (int64_t j = 0; j < kc; j++)
                        a += S[(i + t) * AT_KC + j] * *(const vaf *)(vb + offs[j] + d0);
                    *(vaf *)(O + (i + t) * dim + d0) = a;
                }
            }
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        const int64_t r = b0 + i / group, h = kh * group + i % group;
        const float sum = l[i] + (sinks ? kexp(sinks[h] - m[i]) : 0.0f);
        const float inv = 1.0f / sum;
        float *dst = out + (r * heads + h) * dim;
        for (int64_t d = 0; d < dim; d++) dst[d] = O[i * dim + d] * inv;
    }
}

/* Row b's page table: row table_rows[b] of page_table, or row b without table_rows. */
#define TABLE_ROW(b) (table_rows ? table_rows[b] : (b))

/* The runs of rows [0, batch) (see above) of at least RUN_MIN rows: their first and end rows
 * into first / end, their count returned; rows in one are flagged in `in_run`. */
static int64_t find_runs(const int64_t *page_table, int64_t max_pages, const int64_t *kv_lens,
                         const int64_t *table_rows, int64_t batch, int64_t page_size,
                         int64_t *first, int64_t *end, char *in_run) {
    int64_t runs = 0;
    memset(in_run, 0, (size_t)batch);
    for (int64_t b = 0; b < batch;) {
        int64_t e = b + 1;
        while (e < batch && kv_lens[e] >= kv_lens[e - 1]) {
            const int64_t was = TABLE_ROW(e - 1), is = TABLE_ROW(e);
            const size_t pages = (size_t)((kv_lens[e - 1] + page_size - 1) / page_size);
            if (was != is && memcmp(page_table + was * max_pages, page_table + is * max_pages,
                                    pages * sizeof(int64_t)))
                break;
            e++;
        }
        if (e - b >= RUN_MIN) {
            first[runs] = b;
            end[runs++] = e;
            memset(in_run + b, 1, (size_t)(e - b));
        }
        b = e;
    }
    return runs;
}

/* Every run's blocks, each (run, KV head, block) one work item, longest blocks first. */
static int attend_runs(const float *q, int64_t q_stride, const float *k_cache,
                       const float *v_cache, int64_t slots, const int64_t *page_table,
                       int64_t max_pages, const int64_t *kv_lens, const int64_t *table_rows,
                       float *out, int64_t heads,
                       int64_t kv_heads, int64_t dim, int64_t page_size, int64_t window,
                       float scale, float softcap, const float *sinks, const int64_t *first,
                       const int64_t *end, int64_t runs, int threads) {
    int64_t blocks = 0;
    for (int64_t r = 0; r < runs; r++) blocks += (end[r] - first[r] + AT_QB - 1) / AT_QB;
    int64_t *items = malloc((size_t)(blocks * 2) * sizeof(int64_t));
    if (!items) return -1;
    int64_t n = 0;
    for (int64_t r = 0; r < runs; r++)
        for (int64_t b = end[r]; b > first[r]; b -= AT_QB) {
            items[2 * n] = r;
            items[2 * n++ + 1] = b - AT_QB > first[r] ? b - AT_QB : first[r];
        }
    const int64_t group = heads / kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (n * kv_heads > 1)
    {
        float *work = malloc((size_t)attend_block_floats(group, dim) * sizeof(float));
        if (!work) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t it = 0; it < n; it++) {
            for (int64_t kh = 0; kh < kv_heads; kh++) {
                if (failed) continue;
                const int64_t r = items[2 * it], b0 = items[2 * it + 1];
                const int64_t b1 = b0 + AT_QB < end[r] ? b0 + AT_QB : end[r];
                const int64_t *pt = page_table + TABLE_ROW(end[r] - 1) * max_pages;
                attend_block(q, q_stride, k_cache + kh * slots * dim, v_cache + kh * slots * dim,
                             pt, kv_lens, b0, b1, out, heads, group, kh, dim, page_size, window,
                             scale, softcap, sinks, work);
            }
        }
        free(work);
    }
    free(items);
    return failed ? -1 : 0;
}

/* Decode attention straight from the paged pool: one new token per sequence, read
 * through its page table, no gather. Work items are (sequence, KV head), so the query
 * heads sharing a KV head run on one core and K/V rows come from memory once. q: [batch,
 * heads * dim] (rows `q_stride` apart); pools: one layer, [kv_heads, slots, dim];
 * page_table: [tables, max_pages], row b reading table table_rows[b] (table_rows NULL:
 * table b, one table a row); a key j of a sequence of kv_len tokens is
 * seen when j >= kv_len - window (window <= 0: no window). dim must be a multiple of 8.
 * out: [batch, heads * dim]. Returns -1 if scratch memory could not be had, else 0.
 * An fp8 pool holds value / kv_scale: kv_scale is folded into the scaled query and into
 * the softmax's normaliser, not applied per element. softcap > 0 caps the scores (Gemma 2);
 * sinks, if not NULL, holds one logit per query head (GPT-OSS). */
static inline __attribute__((always_inline)) int decode_attention(
    const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, int64_t slots,
    const int64_t *page_table, int64_t max_pages, const int64_t *kv_lens,
    const int64_t *table_rows, float *out, int64_t batch, int64_t heads, int64_t kv_heads,
    int64_t dim, int64_t page_size, int64_t window, float scale, int fmt, float kv_scale,
    float softcap, const float *sinks, int threads, int deterministic) {
    const int64_t group = heads / kv_heads;
    int64_t longest = 1;
    for (int64_t b = 0; b < batch; b++) longest = kv_lens[b] > longest ? kv_lens[b] : longest;
    int failed = 0;
    /* Runs of one sequence's rows go together (attend_runs); the other rows one by one.
     * `deterministic` (--enable-deterministic-inference): every row one by one, whole (no
     * runs, no split keys), so a row's arithmetic is the same whatever else the step
     * holds: which rows came with it, how its prompt was chunked, what the prefix cache
     * gave it. */
    char *in_run = NULL;
    if (!deterministic && fmt == KV_F32 && dim % AT_LANES == 0 && batch >= RUN_MIN) {
        int64_t *first = malloc((size_t)batch * 2 * sizeof(int64_t));
        in_run = malloc((size_t)batch);
        if (!first || !in_run) {
            free(first);
            free(in_run);
            return -1;
        }
        const int64_t runs = find_runs(page_table, max_pages, kv_lens, table_rows, batch,
                                       page_size, first, first + batch, in_run);
        const int rc = runs ? attend_runs(q, q_stride, (const float *)k_cache,
                                          (const float *)v_cache, slots, page_table, max_pages,
                                          kv_lens, table_rows, out, heads, kv_heads, dim,
                                          page_size, window,
                                          scale, softcap, sinks, first, first + batch, runs,
                                          threads)
                            : 0;
        free(first);
        if (rc) {
            free(in_run);
            return rc;
        }
    }

    /* Fewer (sequence, KV head) items than two a thread (a batch of one: 3 KV heads on 2
     * threads ran 2 against 1) split each sequence's keys into parts of at least
     * DECODE_PART_MIN, each part's softmax kept with its own max and sum and the parts
     * merged after (part_out: [batch][heads][parts][dim], then [..][parts] maxima and
     * sums). */
    int64_t parts = 1;
    if (!deterministic && batch * kv_heads < 2 * threads && !in_run) {
        parts = (2 * threads + batch * kv_heads - 1) / (batch * kv_heads);
        const int64_t fit = longest / DECODE_PART_MIN;
        parts = parts < fit ? parts : fit > 1 ? fit : 1;
        parts = parts < DECODE_PARTS_MAX ? parts : DECODE_PARTS_MAX;
    }
    float *part_out = NULL;
    if (parts > 1) {
        part_out = malloc((size_t)(batch * heads * parts * (dim + 2)) * sizeof(float));
        if (!part_out) {
            free(in_run);
            return -1;
        }
    }
    float *part_max = part_out ? part_out + batch * heads * parts * dim : NULL;
    float *part_sum = part_out ? part_max + batch * heads * parts : NULL;

#pragma omp parallel num_threads(threads) if (batch * kv_heads * parts > 1)
    {
        float *scores = malloc((size_t)(group * longest) * sizeof(float));
        int64_t *offs = malloc((size_t)longest * sizeof(int64_t));
        float *qs = malloc((size_t)(group * (dim + 1)) * sizeof(float));
        if (!scores || !offs || !qs) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
#pragma omp for collapse(3) schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t kh = 0; kh < kv_heads; kh++) {
                for (int64_t part = 0; part < parts; part++) {
                    if (failed || (in_run && in_run[b])) continue;
                    const int64_t len = kv_lens[b];
                    const int64_t first = (window > 0 && len > window) ? len - window : 0;
                    const int64_t start = first + (len - first) * part / parts;
                    const int64_t end = first + (len - first) * (part + 1) / parts;
                    const int64_t n = end - start;
                    if (n <= 0 && part_out) { /* an empty part (a window's): weighs nothing */
                        for (int64_t g = 0; g < group; g++) {
                            const int64_t at = (b * heads + kh * group + g) * parts + part;
                            part_max[at] = -INFINITY;
                            part_sum[at] = 0.0f;
                            memset(part_out + at * dim, 0, (size_t)dim * sizeof(float));
                        }
                        continue;
                    }
                    const int64_t *pages = page_table + TABLE_ROW(b) * max_pages;
                    /* Row offset of every visible key within one head's slots. */
                    key_rows(pages, page_size, start, n, dim, offs);
                    const int64_t head = kh * slots * dim * (fmt == KV_F32 ? 4 : 1);
                    const void *kb = (const char *)k_cache + head;
                    const void *vb = (const char *)v_cache + head;
                    /* The group's query heads together: a K/V row read for one serves all
                     * (score_keys, weigh_values); qs holds their scaled queries, then each
                     * head's output scale. */
                    float *inv = qs + group * dim;
                    for (int64_t g = 0; g < group; g++) {
                        const float *src = q + b * q_stride + (kh * group + g) * dim;
#pragma omp simd
                        for (int64_t i = 0; i < dim; i++)
                            qs[g * dim + i] = src[i] * (scale * kv_scale);
                    }
                    score_keys(qs, group, kb, offs, n, dim, scores, fmt);
                    for (int64_t g = 0; g < group; g++) {
                        const int64_t h = kh * group + g;
                        float *s = scores + g * n;
                        if (softcap > 0.0f) soft_cap(s, n, softcap);
                        if (parts == 1) {
                            const float sink = sinks ? sinks[h] : -INFINITY;
                            inv[g] = softmax_unnormalised(s, n, sink, NULL) * kv_scale;
                            continue;
                        }
                        const int64_t at = (b * heads + h) * parts + part;
                        inv[g] = softmax_unnormalised(s, n, -INFINITY, part_max + at);
                        part_sum[at] = 1.0f / inv[g];
                    }
                    if (parts == 1)
                        weigh_values(scores, group, vb, offs, n, dim, inv,
                                     out + (b * heads + kh * group) * dim, dim, fmt);
                    else
                        weigh_values(scores, group, vb, offs, n, dim, inv,
                                     part_out + ((b * heads + kh * group) * parts + part) * dim,
                                     parts * dim, fmt);
                }
            }
        }
        free(scores);
        free(offs);
        free(qs);
    }
    if (part_out && !failed) {
        /* out = sum_p w_p o_p / (sum_p w_p + e^(sink - M)), w_p = l_p e^(max_p - M): part
         * p's sum l_p and max max_p, M the largest of them and the sink */
        for (int64_t b = 0; b < batch; b++)
            for (int64_t h = 0; h < heads; h++) {
                if (in_run && in_run[b]) continue;
                const int64_t at = (b * heads + h) * parts;
                float mx = sinks ? sinks[h] : -INFINITY;
                for (int64_t p = 0; p < parts; p++)
                    mx = part_max[at + p] > mx ? part_max[at + p] : mx;
                float w[DECODE_PARTS_MAX], total = sinks ? kexp(sinks[h] - mx) : 0.0f;
                for (int64_t p = 0; p < parts; p++) {
                    const float sum = part_sum[at + p];
                    w[p] = sum > 0.0f ? sum * kexp(part_max[at + p] - mx) : 0.0f;
                    total += w[p];
                }
                float *dst = out + (b * heads + h) * dim;
                for (int64_t d = 0; d < dim; d++) {
                    float acc = 0.0f;
                    for (int64_t p = 0; p < parts; p++)
                        acc += w[p] * part_out[(at + p) * dim + d];
                    dst[d] = acc / total * kv_scale;
                }
            }
    }
    free(part_out);
    free(in_run);
    return failed ? -1 : 0;
}

/* The exported entry: kv_format is KV_F32, KV_E4M3 or KV_E5M2 (the pool's element type);
 * each format is its own instantiation, so the fp32 path carries no conversion. */
int kiln_decode_attention(const float *q, int64_t q_stride, const void *k_cache,
                          const void *v_cache, int64_t slots, const int64_t *page_table,
                          int64_t max_pages, const int64_t *kv_lens,
                          const int64_t *table_rows, float *out, int64_t batch, int64_t heads,
                          int64_t kv_heads, int64_t dim, int64_t page_size, int64_t window,
                          float scale, int kv_format, float kv_scale, float softcap,
                          const float *sinks, int threads, int deterministic) {
#define DECODE_ATTENTION(F)                                                                  \
    decode_attention(q, q_stride, k_cache, v_cache, slots, page_table, max_pages, kv_lens,   \
                     table_rows, out, batch, heads, kv_heads, dim, page_size, window, scale, \
                     F, kv_scale, softcap, sinks, threads, deterministic)
    switch (kv_format) {
    case KV_F32: return DECODE_ATTENTION(KV_F32);
    case KV_E4M3: return DECODE_ATTENTION(KV_E4M3);
    case KV_E5M2: return DECODE_ATTENTION(KV_E5M2);
    default: return -2;
    }
#undef DECODE_ATTENTION
}

/* A decode step's attention straight from the fused projection's rows, fp32 pool: rotary
 * on the q and k heads (tables cos_t / sin_t: [batch, dim]), the new token's k and v rows
 * written into the pool at out_slots, then decode attention as above. One call per layer
 * where rope, the KV write and attention were three (each a Python-level call costing
 * ~10-25 us in a decode step). qkv: [batch, (heads + 2 kv_heads) * dim], rows `qkv_stride`
 * apart. Returns -1 without scratch memory, else 0. */
int kiln_rope_decode_attention_f32(const float *qkv, int64_t qkv_stride, const float *cos_t,
                                   const float *sin_t, const int64_t *out_slots,
                                   float *k_cache, float *v_cache, int64_t slots,
                                   const int64_t *page_table, int64_t max_pages,
                                   const int64_t *kv_lens, const int64_t *table_rows,
                                   float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                                   int64_t dim,
                                   int64_t page_size, int64_t window, float scale,
                                   float softcap, const float *sinks, int threads,
                                   int deterministic) {
    float *q = malloc((size_t)(batch * heads * dim) * sizeof(float));
    if (!q) return -1;
    for (int64_t t = 0; t < batch; t++) {
        const float *row = qkv + t * qkv_stride;
        const float *c = cos_t + t * dim, *s = sin_t + t * dim;
        for (int64_t h = 0; h < heads; h++)
            rope_head(row + h * dim, c, s, q + (t * heads + h) * dim, dim);
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t at = (h * slots + out_slots[t]) * dim;
            rope_head(row + (heads + h) * dim, c, s, k_cache + at, dim);
            memcpy(v_cache + at, row + (heads + kv_heads + h) * dim, (size_t)dim * sizeof(float));
        }
    }
    const int rc = decode_attention(q, heads * dim, k_cache, v_cache, slots, page_table,
                                    max_pages, kv_lens, table_rows, out, batch, heads,
                                    kv_heads, dim, page_size, window, scale, KV_F32, 1.0f,
                                    softcap, sinks, threads, deterministic);
    free(q);
    return rc;
}

/* ---- Linear layers ----
 *
 * out[m, n] = x[m, :] . w[n, :] (+ bias[n]). Weights come packed by the compiler (the
 * layout pass, kiln/core/layout.py) into panels of L = lanes of one vector:
 * [N_pad / L][K][L], N padded with zeros to whole groups of GROUP_PANELS panels, so each
 * panel is one contiguous stream and a group never runs short. x is transposed per call
 * into row tiles, [tiles][K][rows], so the rows' values for one k share a cache line.
 *
 * Two micro-tiles over that one layout; the compiler records which row counts take which
 * (the graph's `narrow_rows`), this file does not choose:
 * - narrow (few rows, decode batches): TILE_ROWS rows x 1 panel. The weight stream is the
 *   cost; per k one weight load and one FMA per row with x broadcast from memory, and the
 *   stream software-prefetched PREFETCH_BYTES ahead (the hardware prefetcher alone left it
 *   about 25% slower).
 * - wide (many rows, prefill): WIDE_ROWS rows x GROUP_PANELS panels, for fewer loads per
 *   FMA (10 per 24 on AVX-512 against 17 per 16), where compute is the cost.
 * Threads split the panels; each runs all row tiles of its panels, so a panel is read from
 * memory once and from cache after. The split is OpenMP's guided schedule (long runs of
 * panels first, short ones last) in every linear: a static split makes a call as slow as
 * its slower thread, and on a 2-core machine serving HTTP the server's own thread takes a
 * core from one of them every token (one-client ITL of a SmolLM2 Q4_K_M +a8 server: 9.0
 * ms static, 6.9 guided; offline the same within 2%). */
#ifdef __AVX512F__
#define LANES 16
#define TILE_ROWS 16  /* 16 accumulators + the weight vector of 32 registers */
#define WIDE_ROWS 6   /* 6 x 4 accumulators + 4 weight vectors + 1 broadcast */
#define GROUP_PANELS 4
#else
#define LANES 8
#define TILE_ROWS 8   /* of 16 registers */
#define WIDE_ROWS 4   /* 4 x 3 accumulators + 3 weight vectors + 1 broadcast */
#define GROUP_PANELS 3
#endif
#define PREFETCH_BYTES 2048
typedef float vlf __attribute__((vector_size(LANES * 4), aligned(4)));

/* One panel's accumulators for `rows` rows (acc[r * step]) plus the bias, stored into
 * output columns [base, base + LANES), cut at `cols` (the last panel may be partial). */
static inline __attribute__((always_inline)) void store_panel(const vlf *acc, int step,
                                                              int rows, int64_t base,
                                                              const float *bias, float *out,
                                                              int64_t n, int64_t cols) {
    const int64_t width = cols - base < LANES ? cols - base : LANES;
    vlf add = {0};
    for (int64_t c = 0; bias && c < width; c++) add[c] = bias[base + c];
    for (int r = 0; r < rows; r++) {
        const vlf v = acc[r * step] + add;
        if (width == LANES) {
            *(vlf *)(out + r * n + base) = v;
        } else {
            for (int64_t c = 0; c < width; c++) out[r * n + base + c] = v[c];
        }
    }
}

int64_t kiln_linear_lanes(void) { return LANES; }

/* The exported functions' signatures, as kernels/native.py declares them: bumped with any
 * change, so a library built from another kiln's source is refused, not misread. */
int64_t kiln_abi_version(void) { return 15; }
int64_t kiln_linear_group_panels(void) { return GROUP_PANELS; }

/* One narrow tile: `rows` rows (xt: [k][TILE_ROWS]) against one panel. Always inlined with
 * a constant `rows`, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void narrow_tile(
    const float *xt, int64_t k, const float *panel, const float *bias, float *out, int64_t n,
    int64_t cols, const int rows) {
    vlf acc[TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = (vlf){0};
    for (int64_t kk = 0; kk < k; kk++) {
        __builtin_prefetch(panel + kk * LANES + PREFETCH_BYTES / 4);
        const vlf w = *(const vlf *)(panel + kk * LANES);
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

#define NARROW_CASE(R) \
    case R: narrow_tile(xt, k, panel, bias, out, n, cols, R); break;

static void narrow_rows(const float *xt, int64_t k, const float *panel, const float *bias,
                        float *out, int64_t n, int64_t cols, int64_t rows) {
    switch (rows) {
        NARROW_CASE(1) NARROW_CASE(2) NARROW_CASE(3) NARROW_CASE(4)
        NARROW_CASE(5) NARROW_CASE(6) NARROW_CASE(7) NARROW_CASE(8)
#if TILE_ROWS == 16
        NARROW_CASE(9) NARROW_CASE(10) NARROW_CASE(11) NARROW_CASE(12)
        NARROW_CASE(13) NARROW_CASE(14) NARROW_CASE(15) NARROW_CASE(16)
#endif
        default: break;
    }
}

/* One wide tile: `rows` rows (xt: [k][WIDE_ROWS]) against GROUP_PANELS consecutive panels
 * (`panel`, the next ones k * LANES further). `cols`: the group's real columns (< its
 * width only in the last group, where the padding is zeros). */
static inline __attribute__((always_inline)) void wide_tile(
    const float *xt, int64_t k, const float *panel, const float *bias, float *out, int64_t n,
    int64_t cols, const char *ahead, int64_t ahead_lines, const int rows) {
    vlf acc[WIDE_ROWS][GROUP_PANELS];
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < GROUP_PANELS; p++) acc[r][p] = (vlf){0};
    for (int64_t kk = 0; kk < k; kk++) {
        if (kk < ahead_lines) __builtin_prefetch(ahead + kk * 64, 0, 2);
        vlf w[GROUP_PANELS];
        for (int p = 0; p < GROUP_PANELS; p++) w[p] = *(const vlf *)(panel + (p * k + kk) * LANES);
        const float *xk = xt + kk * WIDE_ROWS;
        for (int r = 0; r < rows; r++) {
            const float xr = xk[r];
            for (int p = 0; p < GROUP_PANELS; p++) acc[r][p] += xr * w[p];
        }
    }
    for (int p = 0; p < GROUP_PANELS && p * LANES < cols; p++)
        store_panel(&acc[0][p], GROUP_PANELS, rows, p * LANES, bias, out, n, cols);
}

#define WIDE_CASE(R) \
    case R: wide_tile(xt, k, panel, bias, out, n, cols, ahead, ahead_lines, R); break;

/* `ahead`: ahead_lines cache lines of the next panel group, asked into L2 while this tile
 * runs (each tile of a group asks for its share of the next group). */
static void wide_rows(const float *xt, int64_t k, const float *panel, const float *bias,
                      float *out, int64_t n, int64_t cols, int64_t rows, const char *ahead,
                      int64_t ahead_lines) {
    switch (rows) {
        WIDE_CASE(1) WIDE_CASE(2) WIDE_CASE(3) WIDE_CASE(4)
#if WIDE_ROWS == 6
        WIDE_CASE(5) WIDE_CASE(6)
#endif
        default: break;
    }
}

/* Tile t of x's rows, inputs [k0, k1), into xt ([tiles][k][rows]: a tile's rows side by
 * side per input, zeros past row m), so a micro-kernel's rows for one input share a cache
 * line. A whole tile of a build's tile height copies with its height a constant: GCC then
 * loads a vector from each row and interleaves them (the generic loop, a scalar load and
 * store an element, was 7% of a 128 x 1536 -> 576 F32 prompt linear). */
static inline __attribute__((always_inline)) void tile_inputs(const float *x, int64_t x_stride,
                                                              int64_t k0, int64_t k1,
                                                              int64_t rows, float *dst) {
    for (int64_t kk = k0; kk < k1; kk++)
        for (int64_t r = 0; r < rows; r++) dst[kk * rows + r] = x[r * x_stride + kk];
}

#define X_TILE_INPUTS 256 /* inputs a copy job */
static void x_tile(const float *x, int64_t x_stride, int64_t m, int64_t k, int64_t rows,
                   int64_t t, int64_t k0, float *xt) {
    const int64_t k1 = k0 + X_TILE_INPUTS < k ? k0 + X_TILE_INPUTS : k;
    const float *src = x + t * rows * x_stride;
    float *dst = xt + t * k * rows;
    if ((t + 1) * rows <= m) { /* a whole tile: the copy with its height a constant */
        if (rows == WIDE_ROWS) {
            tile_inputs(src, x_stride, k0, k1, WIDE_ROWS, dst);
            return;
        }
        if (rows == TILE_ROWS) {
            tile_inputs(src, x_stride, k0, k1, TILE_ROWS, dst);
            return;
        }
    }
    for (int64_t kk = k0; kk < k1; kk++)
        for (int64_t r = 0; r < rows; r++)
            dst[kk * rows + r] = t * rows + r < m ? src[r * x_stride + kk] : 0.0f;
}

/* Parts to split each work item's row tiles into, so that `items` items (each a column
 * span over every row) share out evenly over `threads`: the fewest parts, of at least
 * `min_tiles` tiles each and at most 8, that fill at least 95% of the threads' rounds.
 * SmolLM2's 576 outputs are 9 panel groups: on 2 threads one ran 5 while the other ran 4
 * (at best 90% of both cores). A part rereads its item's weights (from cache at prompt
 * sizes) and, quantized, dequantizes them again. */
static int64_t row_parts(int64_t items, int64_t tiles, int threads, int64_t min_tiles) {
    if (threads <= 1) return 1;
    for (int64_t parts = 1; parts * min_tiles <= tiles && parts <= 8; parts++) {
        const int64_t total = items * parts, rounds = (total + threads - 1) / threads;
        if (total * 100 >= rounds * threads * 95) return parts;
    }
    return 1;
}

/* x: [m, k] rows `x_stride` apart; packed: [N_pad / LANES][k][LANES] (N_pad a multiple of
 * LANES * GROUP_PANELS); bias: [n] or NULL; out: [m, n]. `wide`: 0 narrow tiles, 1 wide.
 * Returns -1 if the transposed copy of x could not be allocated, else 0. */
static int linear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k,
                      const float *packed, int64_t n, const float *bias, float *out, int wide,
                      int threads) {
    if (m <= 0) return 0; /* a step's logits of no rows (a prompt chunk that samples none) */
    const int64_t tile = wide ? WIDE_ROWS : TILE_ROWS;
    const int64_t step = wide ? GROUP_PANELS : 1; /* panels per work item */
    const int64_t groups = (n + LANES * GROUP_PANELS - 1) / (LANES * GROUP_PANELS);
    const int64_t items = groups * (GROUP_PANELS / step);
    const int64_t tiles = (m + tile - 1) / tile;
    const int64_t parts = row_parts(items, tiles, threads, 1);
    const int64_t per = (tiles + parts - 1) / parts; /* tiles a part */
    float *xt = malloc((size_t)(tiles * k * tile) * sizeof(float));
    if (!xt) return -1;
#pragma omp parallel num_threads(threads) if (m * n * k >= PARALLEL_MIN_ELEMS)
    {
#pragma omp for collapse(2)
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t k0 = 0; k0 < k; k0 += X_TILE_INPUTS)
                x_tile(x, x_stride, m, k, tile, t, k0, xt);
#pragma omp for schedule(guided)
        for (int64_t job = 0; job < items * parts; job++) {
            const int64_t it = job / parts, t0 = job % parts * per;
            const int64_t t1 = t0 + per < tiles ? t0 + per : tiles;
            const int64_t col0 = it * step * LANES;
            if (col0 >= n || t0 >= t1) continue; /* a padding panel, or an empty part */
            const float *panel = packed + it * step * k * LANES;
            const int64_t span = step * LANES;
            const int64_t cols = n - col0 < span ? n - col0 : span;
            const float *b = bias ? bias + col0 : NULL;
            /* The next group's panels, a share a tile: read from memory once a group, they
             * are its first tile's stall where nothing asked for them ahead (cold weights:
             * 257 against 310 GFLOP/s hot, SmolLM2's linears at 128 rows). Each part asks
             * for its tiles' shares. */
            const int64_t group_lines = step * k * LANES * (int64_t)sizeof(float) / 64;
            const char *next = it + 1 < items ? (const char *)(panel + step * k * LANES) : NULL;
            const int64_t share = (group_lines + tiles - 1) / tiles;
            for (int64_t t = t0; t < t1; t++) {
                const int64_t rows = m - t * tile < tile ? m - t * tile : tile;
                const float *xtt = xt + t * k * tile;
                float *o = out + t * tile * n + col0;
                if (wide)
                    wide_rows(xtt, k, panel, b, o, n, cols, rows,
                              next ? next + t * share * 64 : NULL, next ? share : 0);
                else
                    narrow_rows(xtt, k, panel, b, o, n, cols, rows);
            }
        }
    }
    free(xt);
    return 0;
}

/* out[t, :] = row ids[t] of a table stored as panels ([V_pad / LANES][h][LANES]): the
 * embedding lookup of a table the lm_head shares (tied), read in place. Returns -1 (and
 * writes nothing further) at the first id outside [0, vocab). */
int kiln_embedding_packed_f32(const int64_t *ids, int64_t tokens, const float *packed,
                              int64_t vocab, int64_t h, float *out) {
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t id = ids[t];
        if (id < 0 || id >= vocab) return -1;
        const float *panel = packed + (id / LANES) * h * LANES + id % LANES;
        for (int64_t j = 0; j < h; j++) out[t * h + j] = panel[j * LANES];
    }
    return 0;
}

/* ---- Quantized linear layers ----
 *
 * out[m, n] = x[m, :] . dequant(w)[n, :] (+ bias[n]) with w stored by the compiler
 * (kiln/core/layout.py, `qpanels`) as panels of LANES output columns, N padded with zeros to
 * whole panels, and one scale (and one min) per column per group of `group` k's:
 *   QFMT_INT8:     q [N_pad / L][K][L] int8,        w = q * s            (s: [N_pad/L][K/g][L])
 *   QFMT_UINT4:    q [N_pad / L][K / 2][L] uint8,   w = q * s + min       (k even in the low
 *                  nibble, k odd in the high one; s, min: [N_pad/L][K/g][2][L], s then min)
 *   QFMT_FP8_E4M3: q [N_pad / L][K][L] fp8 e4m3,    w = q * s
 *   QFMT_INT8M:    q [N_pad / L][K][L] int8,        w = q * s + min       (s, min as UINT4's)
 *   QFMT_INT5:     q [N_pad / L][K / 2 + K / 8][L]: UINT4's nibbles, then a byte of fifth
 *                  bits per 8 k's (bit j for k = 8b + j), w = (q - 16) * s   (GGUF Q5_0)
 *   QFMT_UINT5:    the same codes, w = q * s + min (s, min as UINT4's)  (GGUF Q5_1)
 *   QFMT_INT6:     q [N_pad / L][K / 2 + K / 4][L]: UINT4's nibbles, then a byte of top bit
 *                  pairs per 4 k's (bits 2j, 2j + 1 for k = 4b + j), w = (q - 32) * s
 * The *H formats keep their scales (and mins) as float16, the *K ones as GGUF K-quant
 * super-block records: per panel [K / (g * per)][R][L] bytes, R = P * (2 + per) for P planes
 * and `per` groups a super-block: each plane's float16 as two byte planes (low byte first),
 * then an int8 per group and plane, [per][P]; a group's scale is the float16 times its int8
 * (exact in float32): GGUF Q4_K (UINT4K), Q5_K (UINT5K), Q6_K (INT6K).
 * The weights are dequantized in registers, one vector of L columns per k, and then meet
 * every row of the tile (the narrow tile of the fp32 linear above): at batch 1 the weight
 * stream is the cost, and it is 4x (8-bit) or 8x (4-bit) shorter than fp32's. */
enum { QFMT_INT8 = 0, QFMT_UINT4 = 1, QFMT_FP8_E4M3 = 2, QFMT_UINT4_A8 = 3 /* embedding */,
       QFMT_INT8_A8 = 4 /* embedding */, QFMT_INT8M = 5, QFMT_INT5 = 6,
       QFMT_UINT5 = 7, QFMT_INT8H = 8, QFMT_UINT4H = 9, QFMT_INT5H = 10, QFMT_UINT4K = 11,
       QFMT_UINT5K = 12, QFMT_INT6K = 13, QFMT_INT6 = 14 /* INT6K's codes; not a format */,
       QFMT_UINT5H = 15, QFMT_INT8MH = 16, QFMT_INT8H_A8 = 17, QFMT_UINT4H_A8 = 18
       /* these two: the embedding's numbers for tables stored for the ga8 linears */ };

/* How a format stores its scales: SC_F32, SC_F16 (the *H formats: GGUF's Q8_0, Q4_0 / Q4_1,
 * Q5_0 and Q5_1 blocks as stored, and INT8MH for Q8_0 and Q5_1 parts of one fused weight),
 * or, from 2 up, super-block records of that many groups (the *K formats). */
enum { SC_F32 = 0, SC_F16 = 1 };
static inline int scale_mode(int fmt) {
    if ((fmt >= QFMT_INT8H && fmt <= QFMT_INT5H) || fmt == QFMT_UINT5H || fmt == QFMT_INT8MH ||
        fmt == QFMT_INT8H_A8 || fmt == QFMT_UINT4H_A8)
        return SC_F16;
    if (fmt == QFMT_UINT4K || fmt == QFMT_UINT5K) return 8;
    return fmt == QFMT_INT6K ? 16 : SC_F32;
}
static inline int base_format(int fmt) {
    switch (fmt) {
        case QFMT_INT8H: return QFMT_INT8;
        case QFMT_UINT4H: case QFMT_UINT4K: return QFMT_UINT4;
        case QFMT_INT5H: return QFMT_INT5;
        case QFMT_UINT5H: case QFMT_UINT5K: return QFMT_UINT5;
        case QFMT_INT8MH: return QFMT_INT8M;
        case QFMT_UINT4H_A8: return QFMT_UINT4_A8;
        case QFMT_INT6K: return QFMT_INT6;
        default: return fmt;
    }
}

/* An IEEE half as a float (subnormals included; scales are finite). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    float f;
    if (exp == 0) {
        f = (float)man * 0x1p-24f; /* subnormal: man * 2^-24 */
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    const uint32_t bits = sign | ((exp + 112) << 23) | (man << 13);
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* LANES scales from element `idx` of a scale array of floats (SC_F32), or of halves. */
static inline vlf scale_vec(const void *sc, int64_t idx, int mode) {
    if (mode == SC_F32) return *(const vlf *)((const float *)sc + idx);
    const uint16_t *h = (const uint16_t *)sc + idx;
#if LANES == 16 && defined(__AVX512F__)
    return (vlf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#elif LANES == 8 && defined(__F16C__)
    return (vlf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#else
    vlf v;
    for (int i = 0; i < LANES; i++) v[i] = half_to_float(h[i]);
    return v;
#endif
}

/* Element `idx` of a scale array: floats, halves, or (super-block records) bytes. */
static inline const void *scale_at(const void *sc, int64_t idx, int mode) {
    return mode == SC_F32   ? (const void *)((const float *)sc + idx)
           : mode == SC_F16 ? (const void *)((const uint16_t *)sc + idx)
                            : (const void *)((const uint8_t *)sc + idx);
}

/* Scale planes a (base) format stores per group: a scale, or a scale and a min. */
static inline int scale_planes(int fmt) {
    return fmt == QFMT_UINT4 || fmt == QFMT_INT8M || fmt == QFMT_UINT5 ? 2 : 1;
}

/* What a (base) format's codes are stored plus: w = (q - offset) s. */
static inline int code_offset(int fmt) {
    return fmt == QFMT_INT5 ? 16 : fmt == QFMT_INT6 ? 32 : 0;
}

/* Bytes a lane of a panel holds for k inputs of a (base) format's codes: nibbles, nibbles
 * and a plane of fifth bits (5-bit) or of top bit pairs (6-bit), or a byte a k. */
static inline int64_t panel_code_bytes(int fmt, int64_t k) {
    switch (fmt) {
        case QFMT_UINT4: case QFMT_UINT4_A8: return k / 2;
        case QFMT_INT5: case QFMT_UINT5: return k / 2 + k / 8;
        case QFMT_INT6: return k / 2 + k / 4;
        default: return k;
    }
}

/* LANES float16s stored as two byte planes, low bytes then high bytes, as floats. */
static inline vlf half_planes(const uint8_t *lo, const uint8_t *hi) {
#if LANES == 16 && defined(__AVX512F__)
    const __m128i l = _mm_loadu_si128((const __m128i *)lo), h = _mm_loadu_si128((const __m128i *)hi);
    return (vlf)_mm512_cvtph_ps(_mm256_set_m128i(_mm_unpackhi_epi8(l, h), _mm_unpacklo_epi8(l, h)));
#elif LANES == 8 && defined(__F16C__)
    const __m128i l = _mm_loadl_epi64((const __m128i *)lo), h = _mm_loadl_epi64((const __m128i *)hi);
    return (vlf)_mm256_cvtph_ps(_mm_unpacklo_epi8(l, h));
#else
    vlf v;
    for (int i = 0; i < LANES; i++) v[i] = half_to_float((uint16_t)(lo[i] | (hi[i] << 8)));
    return v;
#endif
}

/* Number of scale elements (floats, halves or record bytes) per panel. */
static inline int64_t scale_stride(int64_t k, int64_t group, int planes, int mode) {
    if (mode >= 2) return k / (group * mode) * planes * (2 + mode) * LANES;
    return (k / group) * planes * LANES;
}
#ifdef __AVX512F__
/* decode: 2 panels x up to 6 rows, two accumulators each. It was 4 panels x 3 rows, and 4
 * rows went to the prompt path (every panel dequantized to fp32 first): SmolLM2's 121
 * linears, uint4, ms: 4 rows 15.8-16.8 -> 9.9-10.7, 6 rows 16.2-16.7 -> 13.1-13.6, 2-3
 * rows 8-15% faster with half the interleaved weight streams; one row its own loop. */
#define QPANELS 2
#else
/* of 16 registers: 1 panel x up to 6 rows, weights, scales and mins. It was 2 panels x 2
 * rows, and 3 rows went to the prompt path: 121 linears, uint4, ms: 3 rows 18.0 -> 12.4,
 * 4 rows 19.0 -> 14.1; then 4 rows, 5-6 going to the prompt path: 576 x 1536 cache-hot,
 * one core, GMAC/s, 5 rows 14.9 -> 23.4, 6 rows 16.6 -> 25.7 (2-4 rows unchanged once the
 * x tile held only the call's rows, qlinear_f32). */
#define QPANELS 1
#endif
#define QROWS 6
typedef int32_t vli __attribute__((vector_size(LANES * 4), aligned(4)));

/* LANES bytes widened to int32 lanes, and int32 lanes to floats. With AVX-512 / AVX2 one
 * instruction each (vpmov[sz]xbd, vcvtdq2ps): GCC's generic vector conversions turned these
 * into scalar byte loads and scalar int-to-float conversions, 6x slower than the memory. */
#if defined(__AVX512F__)
static inline vli widen_u8(const uint8_t *p) {
    return (vli)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline vli widen_i8(const uint8_t *p) {
    return (vli)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline vlf to_float(vli v) { return (vlf)_mm512_cvtepi32_ps((__m512i)v); }
#elif defined(__AVX2__)
static inline vli widen_u8(const uint8_t *p) {
    return (vli)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline vli widen_i8(const uint8_t *p) {
    return (vli)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline vlf to_float(vli v) { return (vlf)_mm256_cvtepi32_ps((__m256i)v); }
#else
static inline vli widen_u8(const uint8_t *p) {
    vli v;
    for (int i = 0; i < LANES; i++) v[i] = p[i];
    return v;
}
static inline vli widen_i8(const uint8_t *p) {
    vli v;
    for (int i = 0; i < LANES; i++) v[i] = (int8_t)p[i];
    return v;
}
static inline vlf to_float(vli v) { return __builtin_convertvector(v, vlf); }
#endif

/* The scales (plane 0) or mins (plane 1) of a panel's LANES columns for group g; `sc` is the
 * panel's scales. Super-block records: the block's float16 times the group's int8. */
static inline vlf group_scale(const void *sc, int64_t g, int plane, int planes, int mode) {
    if (mode >= 2) {
        const uint8_t *r = (const uint8_t *)sc + (g / mode) * planes * (2 + mode) * LANES;
        const vlf d = half_planes(r + 2 * plane * LANES, r + (2 * plane + 1) * LANES);
        const int64_t at = 2 * planes + (g % mode) * planes + plane;
        return d * to_float(widen_i8(r + at * LANES));
    }
    return scale_vec(sc, (g * planes + plane) * LANES, mode);
}

/* fp8 e4m3 bytes (no NaN: weights are finite) as floats: the exponent and mantissa bits
 * moved into an fp32's exponent and mantissa fields, then 2^(127 - 7) undoes the bias;
 * e4m3 subnormals land on fp32 subnormals, which the same product scales exactly. */
static inline vlf fp8_e4m3_to_f32(const uint8_t *p) {
    const vli u = widen_u8(p);
    const vli bits = ((u & 0x80) << 24) | ((u & 0x7F) << 20);
    vlf f;
    memcpy(&f, &bits, sizeof f);
    return f * 0x1p120f;
}

/* The low nibble of each lane as a float. AVX-512: a 16-float table indexed by the lane's
 * low four bits (vpermps reads only those), one instruction for a mask and a convert. */
static inline vlf nibble_float(vli u) {
#if LANES == 16 && defined(__AVX512F__)
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return (vlf)_mm512_permutexvar_ps((__m512i)u, codes);
#else
    return to_float(u & 0xF);
#endif
}

/* The high nibble of each lane's byte (u: bytes widened) as a float: without a table, the
 * shift leaves nothing above the nibble, so no mask (a vector op of seven a code pair). */
static inline vlf high_nibble_float(vli u) {
#if LANES == 16 && defined(__AVX512F__)
    return nibble_float(u >> 4);
#else
    return to_float(u >> 4);
#endif
}

/* The LANES weights of one panel for inputs [g * group, (g + 1) * group) as floats into
 * w ([group][LANES]): the codes decoded and scaled (and offset by the min, or the code
 * offset) as the format stores them. The one decoder of a panel's codes for tall tiles and
 * the wide path (decode tiles, qtile_decode, keep theirs fused with their FMAs). */
static inline __attribute__((always_inline)) void dequant_group(
    const uint8_t *panel, const void *sc, int64_t k, int64_t g, int fmt, int64_t group,
    int mode, float *w) {
    const int64_t k0 = g * group;
    vlf *out = (vlf *)w;
    if (fmt == QFMT_UINT4 || fmt == QFMT_INT8M) {
        const vlf s = group_scale(sc, g, 0, 2, mode), mn = group_scale(sc, g, 1, 2, mode);
        for (int64_t j = 0; fmt == QFMT_INT8M && j < group; j++)
            out[j] = to_float(widen_i8(panel + (k0 + j) * LANES)) * s + mn;
        for (int64_t j = 0; fmt == QFMT_UINT4 && j < group; j += 2) {
            const vli u = widen_u8(panel + ((k0 + j) / 2) * LANES);
            out[j] = nibble_float(u) * s + mn;
            out[j + 1] = to_float(u >> 4) * s + mn;
        }
    } else if (fmt == QFMT_INT5 || fmt == QFMT_UINT5 || fmt == QFMT_INT6) {
        /* The nibbles and a plane of top bits: one (5-bit codes, a plane byte per 8 k's)
         * or two (6-bit, per 4 k's), OR-ed in above each nibble. */
        const int tb = fmt == QFMT_INT6 ? 2 : 1, span = 8 / tb, top = tb == 2 ? 0x30 : 0x10;
        const vlf s = group_scale(sc, g, 0, scale_planes(fmt), mode);
        const vlf mn = fmt == QFMT_UINT5 ? group_scale(sc, g, 1, 2, mode)
                                         : s * (float)-code_offset(fmt);
        for (int64_t kb = k0; kb < k0 + group; kb += span) {
            const uint8_t *q = panel + (kb / 2) * LANES;
            const vli h = widen_u8(panel + (k / 2 + kb / span) * LANES) << 4;
            for (int j = 0; j < span / 2; j++) {
                const vli u = widen_u8(q + j * LANES);
                out[kb - k0 + 2 * j] = to_float((u & 0xF) | ((h >> (2 * j * tb)) & top)) * s + mn;
                out[kb - k0 + 2 * j + 1] =
                    to_float((u >> 4) | ((h >> ((2 * j + 1) * tb)) & top)) * s + mn;
            }
        }
    } else {
        const vlf s = group_scale(sc, g, 0, 1, mode);
        for (int64_t j = 0; j < group; j++) {
            const uint8_t *q = panel + (k0 + j) * LANES;
            out[j] = (fmt == QFMT_INT8 ? to_float(widen_i8(q)) : fp8_e4m3_to_f32(q)) * s;
        }
    }
}

/* Up to TILE_ROWS rows (xt: [k][rows]) against one panel, a group dequantized at a time
 * into `w` ([group][LANES]): the last, short item of a decode-sized call. */
static inline __attribute__((always_inline)) void qtile(
    const float *xt, int64_t k, const uint8_t *panel, const void *sc, int fmt,
    int64_t group, const float *bias, float *out, int64_t n, int64_t cols, const int rows,
    const int mode, float *w) {
    vlf acc[TILE_ROWS];
    for (int i = 0; i < rows; i++) acc[i] = (vlf){0};
    for (int64_t g = 0; g < k / group; g++) {
        dequant_group(panel, sc, k, g, fmt, group, mode, w);
        for (int64_t j = 0; j < group; j++) {
            const float *xk = xt + (g * group + j) * rows;
            const vlf wj = *(const vlf *)(w + j * LANES);
            for (int r = 0; r < rows; r++) acc[r] += xk[r] * wj;
        }
    }
    store_panel(acc, 1, rows, 0, bias, out, n, cols);
}

/* acc + a fa + b fb as two FMAs into the accumulator: written as one sum, it compiled to
 * a multiply, an FMA and an add (a third more vector work in the decode tile's loop). */
static inline vlf qfma2(vlf acc, float a, vlf fa, float b, vlf fb) {
    acc += a * fa;
    acc += b * fb;
    return acc;
}

/* The decode tile: `rows` rows against `np` panels, with each group's scale (and min)
 * applied once per group instead of once per k: per group, g = sum_k x_k q_k, then
 * acc += s g (+ m sum_k x_k, the group sums of x precomputed in xs: [groups][rows]).
 * Per weight vector that leaves widen, convert and one FMA; dequantizing each vector first
 * (the prefill tile above) costs another FMA, and on this kind of CPU the vector ports,
 * not the memory, bound the decode GEMV (10.7 GB/s cache-hot on one core before).
 * One row runs a panel at a time (np = 1), its group sums spread over QSLOTS accumulators
 * by k (the FMA chain of a single one would bound it): one weight stream read in order,
 * which the hardware prefetchers keep ahead, where QPANELS interleaved streams ran at half
 * the bandwidth (SmolLM2's 576 x 3072 Q4_0 from DRAM, 2 cores: 21 -> 36 GMAC/s). */
#define QSLOTS 4

/* Top-bit tables (one row, AVX2 and AVX-512): a 5- or 6-bit code's bits above its nibble
 * add 16 x top x_k, and for one row x is the same in every lane, so a byte of a bit plane
 * (a lane's top bits of 8 k's, or of 4 for 6-bit codes) adds the same sum wherever it
 * occurs: a block's byte is cut into parts of QTOP_BITS bits, each part's sum read from a
 * table of its 2^QTOP_BITS values computed once a call, one permute for every panel, in
 * place of each code's shift, mask and OR. AVX-512: two 16-entry tables (vpermps, 4 bits
 * an index); AVX2: three 8-entry ones (its vpermps indexes 8 floats: bits 0-2, 3-5, 6-7).
 * 5-bit: a block is 8 k's, bit i of the byte k + i's; 6-bit: 4 k's, bits 2i and 2i + 1
 * k + i's pair (weights 16 and 32). xb: [blocks][QTOP_PARTS][QTOP_ENTRIES] floats. */
#if LANES == 16 && defined(__AVX512F__)
#define QTOP_TABLES 1
#define QTOP_BITS 4
#define QTOP_PARTS 2
#elif LANES == 8 && defined(__AVX2__)
#define QTOP_TABLES 1
#define QTOP_BITS 3
#define QTOP_PARTS 3
#else
#define QTOP_TABLES 0
#define QTOP_BITS 4
#define QTOP_PARTS 2
#endif
#define QTOP_ENTRIES (1 << QTOP_BITS)
#define QTOP_FLOATS (QTOP_PARTS * QTOP_ENTRIES) /* a block's tables */

static void top_bit_tables(const float *x, int64_t k, int six, float *xb) {
#if QTOP_TABLES
    /* a part's table is one vector (QTOP_ENTRIES == LANES): sum_i w_i bit_i(v), with
     * bit_i(v) as 0 / 1 vectors built once (a scalar loop over entries and bits had cost
     * a third of a Q6_K GEMV at 1536 inputs) */
    vlf bit[QTOP_BITS];
    for (int i = 0; i < QTOP_BITS; i++)
        for (int v = 0; v < QTOP_ENTRIES; v++) bit[i][v] = (float)((v >> i) & 1);
    const int64_t span = six ? 4 : 8;
    for (int64_t b = 0; b < k / span; b++) {
        float w[QTOP_PARTS * QTOP_BITS] = {0}; /* each bit of the block's byte, weighed */
        for (int j = 0; j < 8; j++)
            w[j] = six ? (j & 1 ? 32.0f : 16.0f) * x[b * span + j / 2] : 16.0f * x[b * span + j];
        for (int part = 0; part < QTOP_PARTS; part++) {
            vlf t = (vlf){0};
            for (int i = 0; i < QTOP_BITS; i++) t += w[part * QTOP_BITS + i] * bit[i];
            *(vlf *)(xb + (b * QTOP_PARTS + part) * QTOP_ENTRIES) = t;
        }
    }
#else
    (void)x, (void)k, (void)six, (void)xb;
#endif
}

/* The top bits' sum for a block's plane bytes h (a lane's byte each) from its tables
 * (each permute reads only its index's low QTOP_BITS bits: no masks). */
static inline vlf top_bits(vli h, const float *t) {
#if LANES == 16 && defined(__AVX512F__)
    return (vlf)_mm512_permutexvar_ps((__m512i)h, _mm512_loadu_ps(t)) +
           (vlf)_mm512_permutexvar_ps((__m512i)(h >> 4), _mm512_loadu_ps(t + 16));
#elif QTOP_TABLES
    return ((vlf)_mm256_permutevar8x32_ps(_mm256_loadu_ps(t), (__m256i)h) +
            (vlf)_mm256_permutevar8x32_ps(_mm256_loadu_ps(t + 8), (__m256i)(h >> 3))) +
           (vlf)_mm256_permutevar8x32_ps(_mm256_loadu_ps(t + 16), (__m256i)(h >> 6));
#else
    (void)h, (void)t;
    return (vlf){0};
#endif
}

/* 8-lane builds, one row of nibble codes: a code pair's byte u = lo + 16 hi gives its
 * high code as u & 0xF0 (16 hi) against the odd inputs scaled by 1/16 once a call
 * (pair_row), a mask where the high nibble took a shift. Both are exact (x / 16 and 16 hi
 * are), so the sums are the bits they were; the shift ran on an Intel core's two FMA
 * ports beside the converts and FMAs, the mask on any of three (one row from DRAM on
 * AVX2: Q4_0 1.05x, Q5_0 1.09x, Q5_K 1.17x, Q6_K 1.26x). */
#if LANES == 8
#define QPAIR_BYTE 1
#else
#define QPAIR_BYTE 0
#endif
static void pair_row(const float *x, int64_t k, float *xp) {
    for (int64_t i = 0; i < k; i += 2) {
        xp[i] = x[i];
        xp[i + 1] = x[i + 1] * 0.0625f;
    }
}

/* One row against one panel of 4-, 5-, 6- or 8-bit codes (fmt: UINT4, INT5, UINT5, INT6,
 * INT8, INT8M, FP8_E4M3), groups a multiple of 8 (every format that stores them: GGUF's
 * blocks of 32 and K-quant groups of 32 and 16, kiln's of 32 and up): qtile_decode's
 * arithmetic for np = rows = 1 (two FMAs a code pair, four accumulators by k, the group's
 * scale and min once), the top bits of 5- and 6-bit codes from their tables (xb,
 * top_bit_tables), over the row itself and moving pointers, eight k's an iteration. The
 * general loop's index arithmetic, x's tile stride and its checks of the step were a
 * third of its vector work (576 x 3072 Q4_0 cache-hot on one AVX2 core: 11.9 -> 16.5
 * GMAC/s); AVX2's 5-bit codes had cost five more vector ops a code pair. x: the row, or
 * (8-lane builds, nibble codes) pair_row's copy of it. */
static inline __attribute__((always_inline)) void qrow_codes(
    const float *x, const float *xs, const float *xb, int64_t k, const uint8_t *panel,
    const void *sc, int64_t group, const float *bias, float *out, int64_t n, int64_t cols,
    const int fmt, const int mode) {
    const int bytes = fmt == QFMT_INT8 || fmt == QFMT_INT8M || fmt == QFMT_FP8_E4M3;
    const int five = fmt == QFMT_INT5 || fmt == QFMT_UINT5;
    const int blocks = fmt == QFMT_INT6 ? 2 : five ? 1 : 0; /* plane bytes per 8 k's */
    const int planes = scale_planes(fmt);
    vlf acc = (vlf){0};
    const uint8_t *q = panel, *hp = panel + (bytes ? 0 : k / 2) * LANES;
    const float *xk = x, *tb = xb;
    for (int64_t g = 0; g < k / group; g++) {
        vlf a[4] = {(vlf){0}, (vlf){0}, (vlf){0}, (vlf){0}}, top = (vlf){0};
        for (int64_t j = 0; j < group; j += 8, q += (bytes ? 8 : 4) * LANES, xk += 8) {
            __builtin_prefetch(q + PREFETCH_BYTES);
            if (bytes && LANES == 16) __builtin_prefetch(q + PREFETCH_BYTES + 64);
            for (int i = 0; i < blocks; i++, hp += LANES, tb += QTOP_FLOATS)
                top += top_bits(widen_u8(hp), tb);
            for (int t = 0; t < 4; t++) {
                if (bytes) { /* a byte a code: two k's an accumulator */
                    const uint8_t *b0 = q + 2 * t * LANES, *b1 = b0 + LANES;
                    a[t] = fmt == QFMT_FP8_E4M3
                               ? qfma2(a[t], xk[2 * t], fp8_e4m3_to_f32(b0), xk[2 * t + 1],
                                       fp8_e4m3_to_f32(b1))
                               : qfma2(a[t], xk[2 * t], to_float(widen_i8(b0)), xk[2 * t + 1],
                                       to_float(widen_i8(b1)));
                    continue;
                }
                const vli u = widen_u8(q + t * LANES);
                a[t] = QPAIR_BYTE ? qfma2(a[t], xk[2 * t], to_float(u & 0xF), xk[2 * t + 1],
                                          to_float(u & 0xF0))
                                  : qfma2(a[t], xk[2 * t], nibble_float(u), xk[2 * t + 1],
                                          high_nibble_float(u));
            }
        }
        const vlf s = group_scale(sc, g, 0, planes, mode);
        const vlf sum = ((a[0] + a[1]) + (a[2] + a[3])) + top;
        if (planes == 2)
            acc += sum * s + xs[g] * group_scale(sc, g, 1, 2, mode);
        else if (code_offset(fmt))
            acc += sum * s + xs[g] * (s * (float)-code_offset(fmt));
        else
            acc += sum * s;
    }
    store_panel(&acc, 1, 1, 0, bias, out, n, cols);
}

static inline __attribute__((always_inline)) void qtile_decode(
    const float *xt, const float *xs, int64_t k, const uint8_t *panel, int64_t pstride,
    const void *sc, int64_t sstride, int fmt, int64_t group,
    const float *bias, float *out, int64_t n, int64_t cols, const int rows, const int mode,
    const int np) {
    /* slots: accumulators a (panel, row) sum into, by k; ga[slot][p * rows + r] */
    const int slots = np == 1 && rows == 1 ? QSLOTS : 1;
    vlf acc[QPANELS * QROWS], ga[QSLOTS][QPANELS * QROWS];
    for (int i = 0; i < rows * np; i++) acc[i] = (vlf){0};
    const int64_t groups = k / group;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t k0 = g * group;
        for (int t = 0; t < slots; t++)
            for (int i = 0; i < rows * np; i++) ga[t][i] = (vlf){0};
        if (fmt == QFMT_UINT4) {
            /* slots code pairs at a time where the group holds them, else one */
            const int64_t step = group % (2 * slots) ? 2 : 2 * slots;
            for (int64_t kb = k0; kb < k0 + group; kb += step) {
                for (int p = 0; p < np; p++) {
                    const uint8_t *q = panel + p * pstride + (kb / 2) * LANES;
                    __builtin_prefetch(q + PREFETCH_BYTES);
                    for (int t = 0; t < (step == 2 ? 1 : slots); t++) {
                        const float *x0 = xt + (kb + 2 * t) * rows, *x1 = x0 + rows;
                        const vli u = widen_u8(q + t * LANES);
                        const vlf f0 = nibble_float(u), f1 = high_nibble_float(u);
                        for (int r = 0; r < rows; r++)
                            ga[t][p * rows + r] =
                                qfma2(ga[t][p * rows + r], x0[r], f0, x1[r], f1);
                    }
                }
            }
        } else if (fmt == QFMT_INT5 || fmt == QFMT_UINT5) {
            /* Eight k's at a time: their fifth bits are one byte a lane, moved up to bit 4
             * of each nibble's code pair by pair. */
            for (int64_t k8 = k0; k8 < k0 + group; k8 += 8) {
                /* the panels' fifth-bit bytes first, then each code pair of every panel in
                 * turn: each accumulator's FMAs interleave with the other panel's */
#if LANES == 16 && defined(__AVX512BW__) && defined(__AVX512VL__)
                /* each fifth bit as a lane mask, OR-ed into its code where set */
                __m128i hb[QPANELS];
                const __m512i sixteen = _mm512_set1_epi32(16);
#else
                vli h[QPANELS];
#endif
                for (int p = 0; p < np; p++) {
                    const uint8_t *base = panel + p * pstride;
                    __builtin_prefetch(base + (k8 / 2) * LANES + PREFETCH_BYTES);
                    const uint8_t *hp = base + (k / 2 + k8 / 8) * LANES;
#if LANES == 16 && defined(__AVX512BW__) && defined(__AVX512VL__)
                    hb[p] = _mm_loadu_si128((const __m128i *)hp);
#else
                    h[p] = widen_u8(hp) << 4;
#endif
                }
                for (int j = 0; j < 4; j++) {
                    const float *x0 = xt + (k8 + 2 * j) * rows, *x1 = x0 + rows;
                    const int t = j % slots;
                    for (int p = 0; p < np; p++) {
                        const vli u = widen_u8(panel + p * pstride + (k8 / 2 + j) * LANES);
#if LANES == 16 && defined(__AVX512BW__) && defined(__AVX512VL__)
                        const __mmask16 m0 =
                            _mm_test_epi8_mask(hb[p], _mm_set1_epi8((char)(1 << (2 * j))));
                        const __mmask16 m1 =
                            _mm_test_epi8_mask(hb[p], _mm_set1_epi8((char)(1 << (2 * j + 1))));
                        const __m512i lo = (__m512i)(u & 0xF), hi = (__m512i)(u >> 4);
                        const vlf f0 = to_float((vli)_mm512_mask_or_epi32(lo, m0, lo, sixteen));
                        const vlf f1 = to_float((vli)_mm512_mask_or_epi32(hi, m1, hi, sixteen));
#else
                        const vlf f0 = to_float((u & 0xF) | ((h[p] >> (2 * j)) & 16));
                        const vlf f1 = to_float((u >> 4) | ((h[p] >> (2 * j + 1)) & 16));
#endif
                        for (int r = 0; r < rows; r++)
                            ga[t][p * rows + r] = qfma2(ga[t][p * rows + r], x0[r], f0, x1[r], f1);
                    }
                }
            }
        } else if (fmt == QFMT_INT6) {
            /* Four k's at a time: their top bit pairs are one byte a lane (two blocks a
             * step, in other slots, where the group holds them). */
            const int64_t step = slots > 1 && group % 8 == 0 ? 8 : 4;
            for (int64_t kb = k0; kb < k0 + group; kb += step) {
                for (int half = 0; half < (step == 8 ? 2 : 1); half++) {
                    /* the panels' top-bit bytes first, then code pairs panel by panel
                     * (each accumulator's FMAs interleave with the other panel's) */
                    const int64_t k4 = kb + 4 * half;
                    vli h[QPANELS];
                    for (int p = 0; p < np; p++) {
                        const uint8_t *base = panel + p * pstride;
                        __builtin_prefetch(base + (k4 / 2) * LANES + PREFETCH_BYTES);
                        h[p] = widen_u8(base + (k / 2 + k4 / 4) * LANES) << 4;
                    }
                    for (int j = 0; j < 2; j++) {
                        const float *x0 = xt + (k4 + 2 * j) * rows, *x1 = x0 + rows;
                        const int t = slots > 1 ? 2 * half + j : 0;
                        for (int p = 0; p < np; p++) {
                            const vli u = widen_u8(panel + p * pstride + (k4 / 2 + j) * LANES);
                            const vlf f0 = to_float((u & 0xF) | ((h[p] >> (4 * j)) & 0x30));
                            const vlf f1 = to_float((u >> 4) | ((h[p] >> (4 * j + 2)) & 0x30));
                            for (int r = 0; r < rows; r++)
                                ga[t][p * rows + r] =
                                    qfma2(ga[t][p * rows + r], x0[r], f0, x1[r], f1);
                        }
                    }
                }
            }
        } else {
            const int64_t step = group % slots ? 1 : slots;
            for (int64_t kb = k0; kb < k0 + group; kb += step) {
                for (int p = 0; p < np; p++) {
                    const uint8_t *q = panel + p * pstride + kb * LANES;
                    __builtin_prefetch(q + PREFETCH_BYTES);
                    for (int t = 0; t < (step == 1 ? 1 : slots); t++) {
                        const float *xk = xt + (kb + t) * rows;
                        const vlf w = fmt == QFMT_FP8_E4M3 ? fp8_e4m3_to_f32(q + t * LANES)
                                                           : to_float(widen_i8(q + t * LANES));
                        for (int r = 0; r < rows; r++) ga[t][p * rows + r] += xk[r] * w;
                    }
                }
            }
        }
        for (int t = 1; t < slots; t++)
            for (int i = 0; i < rows * np; i++) ga[0][i] += ga[t][i];
        /* The group's scale, and its min times the group's sum of x where there is one. */
        const int planes = scale_planes(fmt);
        const int mins = planes == 2 || code_offset(fmt);
        for (int p = 0; p < np; p++) {
            const void *ps = scale_at(sc, p * sstride, mode);
            const vlf sv = group_scale(ps, g, 0, planes, mode);
            const vlf mv = planes == 2 ? group_scale(ps, g, 1, 2, mode)
                                       : sv * (float)-code_offset(fmt);
            for (int r = 0; r < rows; r++)
                acc[p * rows + r] +=
                    ga[0][p * rows + r] * sv + (mins ? xs[g * rows + r] * mv : (vlf){0});
        }
    }
    for (int p = 0; p < np && p * LANES < cols; p++)
        store_panel(&acc[p * rows], 1, rows, p * LANES, bias, out, n, cols);
}

#define QDECODE_CASE(R) \
    case R: \
        qtile_decode(xt, xs, k, panel, pstride, sc, sstride, fmt, group, bias, out, n, cols, R, \
                     mode, QPANELS); \
        break;
#define QTALL_CASE(R) \
    case R: qtile(xt, k, panel, sc, fmt, group, bias, out, n, cols, R, mode, w); break;

/* Up to QROWS rows, xt and xs holding exactly those rows (each case's stride a constant,
 * its row count): without w, the decode tile over the item's QPANELS panels; with it, one panel
 * (the last, short item), a group at a time through w. */
static void qtile_rows(const float *xt, const float *xs, int64_t k, const uint8_t *panel,
                       int64_t pstride, const void *sc, int64_t sstride, int fmt,
                       int64_t group, const float *bias, float *out, int64_t n, int64_t cols,
                       int64_t rows, int mode, float *w) {
    if (!w) {
        switch (rows) {
            QDECODE_CASE(1) QDECODE_CASE(2) QDECODE_CASE(3) QDECODE_CASE(4) QDECODE_CASE(5)
            QDECODE_CASE(6)
            default: break;
        }
        return;
    }
    switch (rows) {
        QTALL_CASE(1) QTALL_CASE(2) QTALL_CASE(3) QTALL_CASE(4) QTALL_CASE(5) QTALL_CASE(6)
        default: break;
    }
}

/* Prefill-sized calls (more than QROWS rows): each item's GROUP_PANELS panels dequantized
 * once into fp32 panels (`dq`, the packed layout of an fp32 weight), then the fp32 wide
 * tiles over every row tile. The dequantizing was a tall tile's own work, redone for every
 * 16 rows and sharing its ports with the FMAs: SmolLM2's Q4_0 linears at 128 rows ran at
 * ~150 GFLOP/s against ~270 for fp32 weights on this Xeon. */
#define QPART_TILES (48 / WIDE_ROWS)
static void qlinear_wide(const float *xt, int64_t m, int64_t k, const void *q,
                         const void *scales, int fmt, int64_t group, int64_t n,
                         const float *bias, float *out, int mode, int threads, int *failed) {
    const int64_t panels = (n + LANES - 1) / LANES;
    const int64_t items = (panels + GROUP_PANELS - 1) / GROUP_PANELS;
    const int64_t tiles = (m + WIDE_ROWS - 1) / WIDE_ROWS;
    /* each part of an item's rows dequantizes the item's codes again, worth it from 48
     * rows a part (17 rows in 2 parts ran 15% slower, 128 in 2 parts 4% faster) */
    const int64_t parts = row_parts(items, tiles, threads, QPART_TILES);
    const int64_t per = (tiles + parts - 1) / parts;
    const int64_t pstride = panel_code_bytes(fmt, k) * LANES;
    const int64_t sstride = scale_stride(k, group, scale_planes(fmt), mode);
#pragma omp parallel num_threads(threads) if (m * n * k >= PARALLEL_MIN_ELEMS)
    {
        float *dq = malloc((size_t)(GROUP_PANELS * k * LANES) * sizeof(float));
        if (!dq) {
#pragma omp atomic write
            *failed = 1;
        }
#pragma omp barrier
#pragma omp for schedule(guided)
        for (int64_t job = 0; job < items * parts; job++) {
            const int64_t it = job / parts, t0 = job % parts * per;
            const int64_t t1 = t0 + per < tiles ? t0 + per : tiles;
            if (*failed || t0 >= t1) continue;
            const int64_t p0 = it * GROUP_PANELS, col0 = p0 * LANES;
            const int64_t cols = n - col0 < GROUP_PANELS * LANES ? n - col0 : GROUP_PANELS * LANES;
            for (int64_t p = 0; p < GROUP_PANELS; p++) {
                float *d = dq + p * k * LANES;
                if (p0 + p >= panels) {
                    memset(d, 0, (size_t)(k * LANES) * sizeof(float));
                    continue;
                }
                const uint8_t *panel = (const uint8_t *)q + (p0 + p) * pstride;
                const void *sc = scale_at(scales, (p0 + p) * sstride, mode);
                for (int64_t g = 0; g < k / group; g++)
                    dequant_group(panel, sc, k, g, fmt, group, mode, d + g * group * LANES);
            }
            /* the next item's codes, a share a tile, as linear_f32 asks for its panels */
            const int64_t lines = it + 1 < items ? GROUP_PANELS * pstride / 64 : 0;
            const char *next = lines ? (const char *)q + (p0 + GROUP_PANELS) * pstride : NULL;
            const int64_t share = (lines + tiles - 1) / tiles;
            for (int64_t t = t0; t < t1; t++) {
                const int64_t rows = m - t * WIDE_ROWS < WIDE_ROWS ? m - t * WIDE_ROWS : WIDE_ROWS;
                wide_rows(xt + t * k * WIDE_ROWS, k, dq, bias ? bias + col0 : NULL,
                          out + t * WIDE_ROWS * n + col0, n, cols, rows,
                          next ? next + t * share * 64 : NULL, share);
            }
        }
        free(dq);
    }
}

static int qlinear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const void *q,
                       const void *scales, int fmt, int64_t group, int64_t n, const float *bias,
                       float *out, int threads) {
    const int mode = scale_mode(fmt);
    fmt = base_format(fmt);
    const int five = fmt == QFMT_INT5 || fmt == QFMT_UINT5, six = fmt == QFMT_INT6;
    if (((fmt < QFMT_INT8 || fmt > QFMT_FP8_E4M3) && fmt != QFMT_INT8M && !five && !six) ||
        group <= 0 || k % group || (fmt == QFMT_UINT4 && group % 2) || (five && group % 8) ||
        (six && group % 4) || (mode >= 2 && k % (group * mode)))
        return -2;
    if (m <= 0) return 0;
    const int wide = m > QROWS;
    /* a decode call's tile holds its m rows and no padding, the tiles taking that stride as
     * a constant (qtile_rows): the copy below and the group sums are scalar, per row (padded
     * to QROWS = 6, AVX2's 2-3 rows ran 5-12% slower; a stride read at run time, 5%) */
    const int64_t xrows = wide ? WIDE_ROWS : m;
    const int64_t tiles = (m + xrows - 1) / xrows;
    const int64_t groups = k / group;
    /* x transposed into tiles, then (decode tiles) each group's sum of x per row */
    /* one row of 5- or 6-bit codes: their top-bit tables (top_bit_tables), up to 8k floats */
    const int tables = QTOP_TABLES && m == 1 && (five || six);
    /* and (8-lane builds) the row with its odd inputs / 16 for nibble codes (pair_row) */
    const int pairs = QPAIR_BYTE && m == 1 && (fmt == QFMT_UINT4 || five || six);
    /* one row is its own tile (k contiguous inputs): read in place, not copied (a batch-1
     * decode's 121 calls a token) */
    const int64_t copied = m == 1 ? 0 : tiles * k * xrows;
    float *xt = malloc((size_t)(copied + (wide ? 0 : groups * xrows) + (tables ? 8 * k : 0) +
                                (pairs ? k : 0)) *
                       sizeof(float));
    if (!xt) return -1;
    float *xs = xt + copied;
    float *xb = tables ? xs + groups * xrows : NULL;
    float *xp = pairs ? xs + groups * xrows + (tables ? 8 * k : 0) : NULL;
    if (tables) top_bit_tables(x, k, six, xb);
    if (pairs) pair_row(x, k, xp);
    /* Decode-sized inputs are copied on this thread: a few thousand floats, where each
     * worksharing loop's barrier would cost more than the copy (121 calls a token). */
    if (copied) {
#pragma omp parallel for collapse(2) num_threads(wide ? threads : 1)
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t k0 = 0; k0 < k; k0 += X_TILE_INPUTS)
                x_tile(x, x_stride, m, k, xrows, t, k0, xt);
    }
    const float *xtile = copied ? xt : x;
    int failed = 0;
    if (wide) {
        qlinear_wide(xt, m, k, q, scales, fmt, group, n, bias, out, mode, threads, &failed);
        free(xt);
        return failed ? -1 : 0;
    }
    for (int64_t g = 0; g < groups; g++)
        for (int64_t r = 0; r < xrows; r++) {
            float sum = 0.0f;
            for (int64_t kk = g * group; kk < (g + 1) * group; kk++)
                sum += xtile[kk * xrows + r];
            xs[g * xrows + r] = sum;
        }
    /* panels an item: one row reads one panel at a time (qtile_decode), so its items are
     * single panels, which also share out evenly (SmolLM2's 576 outputs: 36 panels, 9
     * items of 4 for 2 threads) */
    const int64_t per = m == 1 ? 1 : QPANELS;
    const int64_t panels = (n + LANES - 1) / LANES;
    const int64_t items = (panels + per - 1) / per;
    const int64_t pstride = panel_code_bytes(fmt, k) * LANES;
    const int64_t sstride = scale_stride(k, group, scale_planes(fmt), mode);
#pragma omp parallel num_threads(threads) if (m * n * k >= PARALLEL_MIN_ELEMS)
    {
        float *w = NULL; /* a group's weights, for the last item's panels one at a time */
#pragma omp for schedule(guided)
        for (int64_t it = 0; it < items; it++) {
            const int64_t p0 = it * per;
            const int64_t col0 = p0 * LANES;
            const int64_t span = (panels - p0 < per ? panels - p0 : per) * LANES;
            const int64_t cols = n - col0 < span ? n - col0 : span;
            const uint8_t *panel = (const uint8_t *)q + p0 * pstride;
            const void *sc = scale_at(scales, p0 * sstride, mode);
            const float *b = bias ? bias + col0 : NULL;
            if (m == 1 && group % 8 == 0 && (!(five || six) || tables)) {
                /* each format and scale mode its own copy, their branches folded */
#define QROW(F, M) \
    qrow_codes(xp ? xp : x, xs, xb, k, panel, sc, group, b, out + col0, n, cols, F, M)
#define QROW_MODES(F) \
    if (mode == SC_F16) QROW(F, SC_F16); \
    else if (mode == SC_F32) QROW(F, SC_F32); \
    else if (mode == 8) QROW(F, 8); /* Q4_K / Q5_K records */ \
    else QROW(F, mode);
                if (fmt == QFMT_UINT4) {
                    QROW_MODES(QFMT_UINT4)
                } else if (fmt == QFMT_INT5) {
                    QROW_MODES(QFMT_INT5)
                } else if (fmt == QFMT_UINT5) {
                    QROW_MODES(QFMT_UINT5)
                } else if (fmt == QFMT_INT8) {
                    QROW_MODES(QFMT_INT8)
                } else if (fmt == QFMT_INT8M) {
                    QROW_MODES(QFMT_INT8M)
                } else if (fmt == QFMT_FP8_E4M3) {
                    QROW(QFMT_FP8_E4M3, SC_F32);
                } else {
                    QROW(QFMT_INT6, 16); /* INT6K's records, the only 6-bit codes */
                }
#undef QROW_MODES
#undef QROW
                continue;
            }
            if (m == 1) {
                qtile_decode(xtile, xs, k, panel, pstride, sc, sstride, fmt, group, b, out + col0,
                             n, cols, 1, mode, 1);
                continue;
            }
            if (span / LANES == QPANELS) {
                qtile_rows(xt, xs, k, panel, pstride, sc, sstride, fmt, group, b, out + col0, n,
                           cols, m, mode, NULL);
                continue;
            }
            if (!w && !(w = malloc((size_t)(group * LANES) * sizeof(float)))) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            for (int64_t p = 0; p < span / LANES; p++) {
                const int64_t c0 = p * LANES;
                const int64_t cw = cols - c0 < LANES ? cols - c0 : LANES;
                qtile_rows(xt, NULL, k, panel + p * pstride, pstride,
                           scale_at(sc, p * sstride, mode), sstride, fmt, group,
                           b ? b + c0 : NULL, out + col0 + c0, n, cw, m, mode, w);
            }
        }
        free(w);
    }
    free(xt);
    return failed ? -1 : 0;
}

/* Lane c's scale (plane 0) or min (plane 1) of group g in a panel's scales `sc`. */
static inline float lane_scale(const void *sc, int64_t g, int plane, int planes, int mode,
                               int64_t c) {
    if (mode >= 2) {
        const uint8_t *r = (const uint8_t *)sc + (g / mode) * planes * (2 + mode) * LANES;
        const uint16_t h = (uint16_t)(r[2 * plane * LANES + c] | (r[(2 * plane + 1) * LANES + c] << 8));
        const int64_t at = (2 * planes + (g % mode) * planes + plane) * LANES + c;
        return half_to_float(h) * (float)(int8_t)r[at];
    }
    const int64_t at = (g * planes + plane) * LANES + c;
    return mode == SC_F16 ? half_to_float(((const uint16_t *)sc)[at]) : ((const float *)sc)[at];
}

/* out[t, :] = row ids[t] of a quantized table stored as above (the tied lm_head's), as
 * floats; QFMT_UINT4_A8 / QFMT_INT8_A8 (and their float16-scale forms QFMT_UINT4H_A8 /
 * QFMT_INT8H_A8): a table stored for the int8-activation linears below (their layouts).
 * Returns -1 at the first id outside [0, vocab), -2 for an unknown format. */
int kiln_qembedding_f32(const int64_t *ids, int64_t tokens, const void *q, const void *scales,
                        int fmt, int64_t group, int64_t vocab, int64_t h, float *out) {
    const int mode = scale_mode(fmt);
    fmt = base_format(fmt);
    const int five = fmt == QFMT_INT5 || fmt == QFMT_UINT5, six = fmt == QFMT_INT6;
    if (((fmt < QFMT_INT8 || fmt > QFMT_INT8_A8) && fmt != QFMT_INT8M && fmt != QFMT_INT8H_A8 &&
         !five && !six) ||
        group <= 0 || h % group || (five && h % 8) || (six && h % 4) ||
        (mode >= 2 && h % (group * mode)))
        return -2;
    const int64_t panel_bytes = panel_code_bytes(fmt, h) * LANES;
    const int planes = fmt == QFMT_INT8 || fmt == QFMT_FP8_E4M3 || fmt == QFMT_INT5 || six ||
                               fmt == QFMT_INT8H_A8 ? 1 : 2;
    const int64_t panel_scales = scale_stride(h, group, planes, mode);
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t id = ids[t];
        if (id < 0 || id >= vocab) return -1;
        const int64_t c = id % LANES;
        const uint8_t *panel = (const uint8_t *)q + (id / LANES) * panel_bytes;
        const void *sc = scale_at(scales, (id / LANES) * panel_scales, mode);
        for (int64_t j = 0; j < h; j++) {
            const float s = lane_scale(sc, j / group, 0, planes, mode, c);
            const float mn = planes == 1 ? 0.0f : lane_scale(sc, j / group, 1, planes, mode, c);
            float v;
            if (fmt == QFMT_UINT4) {
                const uint8_t byte = panel[(j / 2) * LANES + c];
                v = (float)((j & 1) ? byte >> 4 : byte & 0xF) * s + mn;
            } else if (fmt == QFMT_UINT4_A8) {
                const uint8_t byte = panel[((j / 8) * LANES + c) * 4 + j % 4];
                v = (float)((j % 8) < 4 ? byte & 0xF : byte >> 4) * s + mn;
            } else if (five) {
                const uint8_t byte = panel[(j / 2) * LANES + c];
                const uint8_t bits = panel[(h / 2 + j / 8) * LANES + c];
                const int q = ((j & 1) ? byte >> 4 : byte & 0xF) | (((bits >> (j % 8)) & 1) << 4);
                v = (float)(q - code_offset(fmt)) * s + mn;
            } else if (six) {
                const uint8_t byte = panel[(j / 2) * LANES + c];
                const uint8_t pairs = panel[(h / 2 + j / 4) * LANES + c];
                const int q = ((j & 1) ? byte >> 4 : byte & 0xF) | (((pairs >> (2 * (j % 4))) & 3) << 4);
                v = (float)(q - code_offset(fmt)) * s;
            } else if (fmt == QFMT_INT8 || fmt == QFMT_INT8M) {
                v = (float)((const int8_t *)panel)[j * LANES + c] * s + mn;
            } else if (fmt == QFMT_INT8_A8 || fmt == QFMT_INT8H_A8) {
                v = (float)((const int8_t *)panel)[((j / 4) * LANES + c) * 4 + j % 4] * s;
            } else {
                const uint8_t b = panel[j * LANES + c];
                const uint32_t bits = ((uint32_t)(b & 0x80) << 24) | ((uint32_t)(b & 0x7F) << 20);
                memcpy(&v, &bits, sizeof v);
                v *= 0x1p120f * s;
            }
            out[t * h + j] = v;
        }
    }
    return 0;
}

/* ---- w8a8 int8 linear (SGLang's --quantization w8a8_int8) ----
 *
 * Weights int8, one scale per output row; activations quantized per token at run time:
 * sx = max|x| / 127, xq = round(x / sx) (half to even). out = sx * sw * sum_k xq wq, the sum
 * exact in int32. With AVX-512 VNNI one vpdpbusd multiplies 4 k's for 16 rows of weights:
 * it takes unsigned x bytes, so x is stored as xq + 128 and the compiler's per-row
 * correction c = 128 * sum_k wq comes off the sum. Without VNNI the same integer sums are
 * computed plainly (identical results, slower).
 *
 * codes: [N_pad / L][K / 4][L][4] int8 (k % 4 == 0); scales: [N_pad / L][1][2][L]:
 * the row's scale, then c. */
#ifdef __AVX512VNNI__
#define A8_VNNI 1
#else
#define A8_VNNI 0
#endif

int64_t kiln_a8_vnni(void) { return A8_VNNI; }

#define A8_ROWS 4

static inline __attribute__((always_inline)) void a8_tile(
    const uint32_t *xb, int64_t k4, const int8_t *panel, int64_t pstride, const float *sc,
    int64_t sstride, const float *sx, const float *bias, float *out, int64_t n, int64_t cols,
    const int rows, const int np) {
    int32_t acc[4][A8_ROWS][LANES];
#if A8_VNNI
    __m512i va[4][A8_ROWS];
    for (int p = 0; p < np; p++)
        for (int r = 0; r < rows; r++) va[p][r] = _mm512_setzero_si512();
    for (int64_t kk = 0; kk < k4; kk++) {
        for (int p = 0; p < np; p++) {
            const int8_t *q = panel + p * pstride + kk * LANES * 4;
            __builtin_prefetch(q + PREFETCH_BYTES);
            const __m512i w = _mm512_loadu_si512((const void *)q);
            for (int r = 0; r < rows; r++)
                va[p][r] = _mm512_dpbusd_epi32(va[p][r], _mm512_set1_epi32((int)xb[r * k4 + kk]), w);
        }
    }
    for (int p = 0; p < np; p++)
        for (int r = 0; r < rows; r++) _mm512_storeu_si512((void *)acc[p][r], va[p][r]);
#else
    for (int p = 0; p < np; p++)
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < LANES; c++) acc[p][r][c] = 0;
    for (int64_t kk = 0; kk < k4; kk++) {
        for (int p = 0; p < np; p++) {
            const int8_t *q = panel + p * pstride + kk * LANES * 4;
            for (int r = 0; r < rows; r++) {
                const uint32_t xv = xb[r * k4 + kk];
                const int32_t x0 = (int32_t)(xv & 0xFF), x1 = (int32_t)((xv >> 8) & 0xFF);
                const int32_t x2 = (int32_t)((xv >> 16) & 0xFF), x3 = (int32_t)(xv >> 24);
                for (int c = 0; c < LANES; c++)
                    acc[p][r][c] += x0 * q[c * 4] + x1 * q[c * 4 + 1] + x2 * q[c * 4 + 2] +
                                    x3 * q[c * 4 + 3];
            }
        }
    }
#endif
    for (int p = 0; p < np; p++) {
        const int64_t base = p * LANES;
        if (base >= cols) break;
        const int64_t width = cols - base < LANES ? cols - base : LANES;
        const float *s = sc + p * sstride, *corr = s + LANES;
        for (int r = 0; r < rows; r++)
            for (int64_t c = 0; c < width; c++) {
                const float v = (float)((double)acc[p][r][c] - (double)corr[c]) * (sx[r] * s[c]);
                out[r * n + base + c] = bias ? v + bias[base + c] : v;
            }
    }
}

#define A8_CASE(R, NP) \
    case R: a8_tile(xb, k4, panel, pstride, sc, sstride, sx, b, o, n, cols, R, NP); break;

/* x: [m, k] rows `x_stride` apart, k % 4 == 0; codes, scales as above; out: [m, n].
 * Returns -1 without scratch memory, -2 if k is not a multiple of 4, else 0. */
static int a8_linear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k,
                         const int8_t *codes, const float *scales, int64_t n,
                         const float *bias, float *out, int threads) {
    if (k % 4) return -2;
    const int64_t k4 = k / 4, panels = (n + LANES - 1) / LANES;
    const int np = 4;
    const int64_t items = (panels + np - 1) / np;
    const int64_t pstride = k * LANES, sstride = 2 * LANES;
    uint32_t *xball = malloc((size_t)(m * k4) * sizeof(uint32_t) + (size_t)m * sizeof(float));
    if (!xball) return -1;
    float *sxall = (float *)(xball + m * k4);
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * x_stride;
        float amax = 0.0f;
        for (int64_t i = 0; i < k; i++) amax = fabsf(xr[i]) > amax ? fabsf(xr[i]) : amax;
        const float sx = amax > 0.0f ? amax / 127.0f : 1.0f;
        sxall[r] = sx;
        uint8_t *bytes = (uint8_t *)(xball + r * k4);
        for (int64_t i = 0; i < k; i++) {
            float q = nearbyintf(xr[i] / sx);
            q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
            bytes[i] = (uint8_t)((int)q + 128);
        }
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (m * n * k >= PARALLEL_MIN_ELEMS)
    for (int64_t it = 0; it < items; it++) {
        const int64_t p0 = it * np, col0 = p0 * LANES;
        const int64_t have = panels - p0 < np ? panels - p0 : np;
        const int64_t cols = n - col0 < have * LANES ? n - col0 : have * LANES;
        const int8_t *panel = codes + p0 * pstride;
        const float *sc = scales + p0 * sstride;
        const float *b = bias ? bias + col0 : NULL;
        for (int64_t r0 = 0; r0 < m; r0 += A8_ROWS) {
            const int64_t rows = m - r0 < A8_ROWS ? m - r0 : A8_ROWS;
            const uint32_t *xb = xball + r0 * k4;
            const float *sx = sxall + r0;
            float *o = out + r0 * n + col0;
            if (have == 4) {
                switch (rows) { A8_CASE(1, 4) A8_CASE(2, 4) A8_CASE(3, 4) A8_CASE(4, 4) default: break; }
            } else {
                for (int64_t p = 0; p < have; p++) {
                    const int64_t c0 = p * LANES, w = cols - c0 < LANES ? cols - c0 : LANES;
                    const int8_t *pp = panel + p * pstride;
                    const float *sp = sc + p * sstride, *bp = b ? b + c0 : NULL;
                    float *op = o + c0;
                    switch (rows) {
#define A8_ONE(R) \
    case R: a8_tile(xb, k4, pp, pstride, sp, sstride, sx, bp, op, n, w, R, 1); break;
                        A8_ONE(1) A8_ONE(2) A8_ONE(3) A8_ONE(4) default: break;
                    }
                }
            }
        }
    }
    free(xball);
    return 0;
}

/* ---- Grouped int8-activation linears (--quantize-activations int8) ----
 *
 * What llama.cpp does with its Q4_0 / Q4_1 / Q8_0 blocks: the activations are quantized to
 * int8 per group of `group` inputs at run time (sx = max|x| / 127 over the group, xq =
 * round(x / sx), half to even), so each group's dot product is an exact int32 sum, four k's
 * of 16 columns per vpdpbusd, scaled in float once per group:
 *   GA8_UINT4 (uint4_a8): w = q s + m, q in [0, 15]:  out += sx (s sum_k q xq + m sum_k xq)
 *   GA8_INT8  (int8_a8):  w = q s, q in [-127, 127]:  vpdpbusd takes unsigned bytes on one
 *             side, so x is stored as xq + 128 and out += sx s (sum_k q (xq + 128) - c),
 *             c = 128 sum_k q over the group (the second scale plane, from the compiler).
 * codes: GA8_UINT4 [N_pad / L][K / 8][L][4] bytes, byte j of a lane holding k = 8b + j in
 * its low nibble and k = 8b + 4 + j in its high one (one load and two masks give two
 * vpdpbusd operands); GA8_INT8 [N_pad / L][K / 4][L][4] int8 (w8a8_int8's layout).
 * scales: [N_pad / L][K / group][2][L]: s, then m or c. Per weight vector of 16 columns x
 * 8 k's (4-bit) that is one load, two masks and two vpdpbusd, against eight widen, convert
 * and FMA steps for float activations (qtile_decode above, which the vector ports bound).
 * AVX2 and AVX-512 without VNNI take two instructions per vpdpbusd (GA8_DOT below).
 * The GGUF 5- and 6-bit codes run the same way, their top bits OR-ed into each nibble:
 *   GA8_UINT5 (uint5h_a8, uint5k_a8): w = q s + m, q in [0, 31]
 *   GA8_INT5  (int5h_a8): w = (q - 16) s:  out += sx s (sum_k q xq - 16 sum_k xq), the
 *             offset taken off the int32 sum exactly
 *   GA8_INT6  (int6k_a8): w = (q - 32) s, q in [0, 63], the same with 32
 *   GA8_INT8H (int8h_a8, GGUF Q8_0 as stored): w = q s with x signed: VNNI reads the codes
 *             as q + 128 (the sign bit flipped) and takes 128 sum_k xq off the same way;
 *             the maddubs path multiplies |q| by sign(q) xq, and the plain one signed bytes.
 *   GA8_INT8MH (int8mh_a8, Q8_0 and Q5_1 parts of one fused weight): w = q s + m, q int8:
 *             GA8_INT8H's sums, then m sx sum_k xq as GA8_UINT4's min.
 * codes: GA8_UINT4's nibbles [N_pad / L][K / 8][L][4], then the bits above them as top
 * bytes [N_pad / L][K / (8 U)][L][4] (ga8_top_blocks: U = 4 blocks of 5-bit codes, 2 of
 * 6-bit ones; K a multiple of 8 U): byte j of lane c of a unit holds the top bits of the
 * codes at that byte of its U blocks, w = 1 or 2 bits each, block i's low nibble's at bit
 * i w and its high nibble's at 4 + i w. The kind's
 * bits from 8 up say how the scales are stored (scale_mode: 1 float16, 8 or 16 super-block
 * records of that many groups); scales [N_pad / L][K / group][P][L] or those records, P = 1
 * for GA8_INT5 and GA8_INT6. */
enum { GA8_UINT4 = 0, GA8_INT8 = 1, GA8_UINT5 = 2, GA8_INT5 = 3, GA8_INT6 = 4, GA8_INT8H = 5,
       GA8_INT8MH = 6 };
/* The tile over many rows: 8 rows x 1 panel, each block's nibble decode (and its top bits,
 * the dear part on AVX2) shared by 8 rows (SmolLM2's 576 x 1536 at 128 rows, one core,
 * AVX2 build: Q4_0 37 -> 56, Q6_K 28 -> 36, Q8_0 29 -> 38 GMAC/s against 4 rows; 4 x 2 with
 * the int16 sums was slower than before them, its 16 accumulators spilled). VNNI had kept
 * 4 rows x 2 panels: 8 x 1 (with the 2- and 4-row tiles specialised per kind, below) ran,
 * same shape, GMAC/s 4 x 2 -> 8 x 1: Q4_0 2 rows 44 -> 50, 6 rows 67 -> 77, 128 rows 101 ->
 * 104; Q5_K 34 -> 39, 52 -> 63, 76 -> 86; Q6_K 29 -> 33, 42 -> 50, 59 -> 65; Q8_0 48 -> 54,
 * 74 -> 87, 124 -> 120. */
#define GA8_ROWS 8

/* The 4-byte dot product per int32 lane, acc += sum_j u[j] s[j] (u unsigned, s signed
 * bytes), at the build's vector width: vpdpbusd with VNNI; else vpmaddubsw (pairs into
 * int16, saturating) then vpmaddwd against ones. The pairs cannot saturate for 4-bit u
 * (2 x 15 x 127); int8 weights use |q| against sign(q) x (2 x 127 x 127), so those sums
 * come out as sum q xq, without the + 128 of the VNNI form (GA8_SIGNED_INT8). Without
 * AVX2 the sums are computed plainly. */
#if defined(__AVX512BW__)
#define GA8_SIMD 1
typedef __m512i vbyte;
#define GA8_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define GA8_SET1(v) _mm512_set1_epi32(v)
#define GA8_ZERO() _mm512_setzero_si512()
#define GA8_LOW_NIBBLES(w) _mm512_and_si512((w), _mm512_set1_epi8(0x0F))
#define GA8_HIGH_NIBBLES(w) _mm512_and_si512(_mm512_srli_epi16((w), 4), _mm512_set1_epi8(0x0F))
#if A8_VNNI
#define GA8_SIGNED_INT8 0
#define GA8_DOT(acc, u, s) _mm512_dpbusd_epi32((acc), (u), (s))
#define GA8_FLIP(x) _mm512_xor_si512((x), _mm512_set1_epi8((char)0x80))
#else
#define GA8_SIGNED_INT8 1
#define GA8_DOT(acc, u, s) \
    _mm512_add_epi32((acc), _mm512_madd_epi16(_mm512_maddubs_epi16((u), (s)), \
                                              _mm512_set1_epi16(1)))
#define GA8_DOT16(acc, u, s) _mm512_add_epi16((acc), _mm512_maddubs_epi16((u), (s)))
#define GA8_WIDEN(acc, s16) _mm512_add_epi32((acc), _mm512_madd_epi16((s16), _mm512_set1_epi16(1)))
#define GA8_ABS(q) _mm512_abs_epi8(q)
#define GA8_SIGN(x, q) \
    _mm512_mask_sub_epi8((x), _mm512_movepi8_mask(q), _mm512_setzero_si512(), (x))
#define GA8_FLIP(x) _mm512_xor_si512((x), _mm512_set1_epi8((char)0x80))
#endif
#elif defined(__AVX2__)
#define GA8_SIMD 1
#define GA8_SIGNED_INT8 1
typedef __m256i vbyte;
#define GA8_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define GA8_SET1(v) _mm256_set1_epi32(v)
#define GA8_ZERO() _mm256_setzero_si256()
#define GA8_LOW_NIBBLES(w) _mm256_and_si256((w), _mm256_set1_epi8(0x0F))
#define GA8_HIGH_NIBBLES(w) _mm256_and_si256(_mm256_srli_epi16((w), 4), _mm256_set1_epi8(0x0F))
#define GA8_DOT(acc, u, s) \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), \
                                              _mm256_set1_epi16(1)))
#define GA8_DOT16(acc, u, s) _mm256_add_epi16((acc), _mm256_maddubs_epi16((u), (s)))
#define GA8_WIDEN(acc, s16) _mm256_add_epi32((acc), _mm256_madd_epi16((s16), _mm256_set1_epi16(1)))
#define GA8_ABS(q) _mm256_abs_epi8(q)
#define GA8_SIGN(x, q) _mm256_sign_epi8((x), (q))
#define GA8_FLIP(x) _mm256_xor_si256((x), _mm256_set1_epi8((char)0x80))
#else
#define GA8_SIMD 0
#define GA8_SIGNED_INT8 0
#endif

/* A unit's top bytes t (ga8_top_blocks), shifted right by w for each block before this
 * one, OR-ed into the block's nibbles: `mask` (0x10, or 0x30 for 6-bit codes) takes the
 * high nibbles' bits where they are and the low nibbles' moved up by 4. The shifts run on
 * 16-bit lanes: the bits that cross into a byte from its neighbour land outside the mask.
 * Per block six instructions on AVX2 (four on AVX-512, its AND and OR one ternary op)
 * where bit planes had cost AVX2 ten for 5-bit codes and twenty for 6-bit ones, five
 * each a nibble vector to spread a plane's bits over its bytes. 768 x 1536 x 24 layers,
 * one core, GMAC/s, alternating builds: AVX2 one row Q5_K 14.0 -> 15.5, Q6_K 10.1-11.0 ->
 * 13.4, 128 rows Q6_K 33-34 -> 36; VNNI one row Q5_K 23.3-23.8 -> 22.5 (AVX-512 had set
 * a plane's bits as a byte mask read from memory, one instruction fewer), Q6_K 18.1 ->
 * 19.5. */
#if GA8_SIMD && defined(__AVX512BW__)
#define GA8_TOP(w, t, mask) \
    _mm512_ternarylogic_epi32((w), (t), _mm512_set1_epi8(mask), 0xF8) /* w | (t & mask) */
#define GA8_TOP_UP(t) _mm512_slli_epi16((t), 4)
#define GA8_TOP_NEXT(t, w) _mm512_srli_epi16((t), (w))
#elif GA8_SIMD
#define GA8_TOP(w, t, mask) _mm256_or_si256((w), _mm256_and_si256((t), _mm256_set1_epi8(mask)))
#define GA8_TOP_UP(t) _mm256_slli_epi16((t), 4)
#define GA8_TOP_NEXT(t, w) _mm256_srli_epi16((t), (w))
#endif

/* A kind's codes a byte each (4 k's a block of a lane; else nibbles, 8 k's a block), its
 * scale planes, and the bytes a lane of a panel holds for k inputs. */
static inline int ga8_byte_codes(int kind) {
    return kind == GA8_INT8 || kind == GA8_INT8H || kind == GA8_INT8MH;
}
static inline int ga8_planes(int kind) {
    return kind == GA8_INT5 || kind == GA8_INT6 || kind == GA8_INT8H ? 1 : 2;
}
/* Top bits a code (5- and 6-bit codes), and the blocks of 8 k's whose top bits share a
 * unit of top bytes: 4 / width, so each of a unit's bytes is a whole byte of bits. */
static inline int ga8_top_width(int kind) { return kind == GA8_INT6 ? 2 : 1; }
static inline int64_t ga8_top_blocks(int kind) { return 4 / ga8_top_width(kind); }
static inline int64_t ga8_code_bytes(int kind, int64_t k) {
    return ga8_byte_codes(kind) ? k
           : kind == GA8_UINT4  ? k / 2
           : kind == GA8_INT6   ? k / 2 + k / 4
                                : k / 2 + k / 8;
}

/* Without VNNI, the blocks of nibble codes whose maddubs pairs sum in int16 before they
 * are widened: a block adds two pairs a lane, each at most 2 qmax 127 (|xq| <= 127), so
 * 4 blocks of 4-bit codes (8 x 3810 = 30480), 2 of 5-bit (4 x 7874), 1 of 6-bit (2 x
 * 16002) stay under 32767. A power of two. */
static inline int64_t ga8_span(int kind) {
    return kind == GA8_UINT4 ? 4 : kind == GA8_INT6 ? 1 : 2;
}

/* x rows -> int8 codes per group (xq, or xq + 128 for GA8_INT8) and per group GA8_XG
 * floats: sx, sx * sum xq, and sum xq itself (an integer, exact in a float). */
#define GA8_XG 3
#ifdef __AVX2__
/* ga8_quantize_row's group, 8 inputs a vector (group a multiple of 8): the same numbers
 * (the max is exact, the division and the round to nearest even are IEEE's, the int32 sum
 * exact): SmolLM2's 576 inputs in 0.25 us, 1536 in 0.65, where the scalar loop took 0.71
 * and 1.87 on a Zen 3 core, four calls a layer of a decode step. Returns sum xq. */
static inline int32_t ga8_quantize_group8(const float *xr, int64_t group, int plus128,
                                          uint8_t *out, float *sx_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < group; i += 8)
        m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xr + i)), m);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float sx = amax > 0.0f ? amax / 127.0f : 1.0f;
    const __m256 vs = _mm256_set1_ps(sx);
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = 0; i < group; i += 8) {
        __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xr + i), vs),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
        __m256i qi = _mm256_cvtps_epi32(q);
        sum = _mm256_add_epi32(sum, qi);
        if (plus128) qi = _mm256_add_epi32(qi, _mm256_set1_epi32(128));
        const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(qi),
                                            _mm256_extracti128_si256(qi, 1));
        _mm_storel_epi64((__m128i *)(out + i),
                         plus128 ? _mm_packus_epi16(w16, w16) : _mm_packs_epi16(w16, w16));
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *sx_out = sx;
    return _mm_cvtsi128_si32(s4);
}
#endif

/* One group's codes (xq, or xq + 128 where plus128) and scale sx, returning sum xq: the
 * plain loop, for any group; ga8_quantize_group8 above gives the same numbers. */
static int32_t ga8_quantize_group(const float *xr, int64_t group, int plus128, uint8_t *out,
                                  float *sx_out) {
    float amax = 0.0f;
    for (int64_t i = 0; i < group; i++) amax = fabsf(xr[i]) > amax ? fabsf(xr[i]) : amax;
    const float sx = amax > 0.0f ? amax / 127.0f : 1.0f;
    int32_t sum = 0;
    for (int64_t i = 0; i < group; i++) {
        float q = nearbyintf(xr[i] / sx);
        q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
        sum += (int32_t)q;
        out[i] = plus128 ? (uint8_t)((int)q + 128) : (uint8_t)(int8_t)q;
    }
    *sx_out = sx;
    return sum;
}

static void ga8_quantize_row(const float *x, int64_t k, int64_t group, int kind,
                             uint8_t *bytes, float *xg) { /* kind: GA8_INT8 or not */
    const int plus128 = kind == GA8_INT8;
    for (int64_t g = 0; g < k / group; g++) {
        const float *xr = x + g * group;
        uint8_t *out = bytes + g * group;
        float sx;
#ifdef __AVX2__
        const int32_t sum = group % 8 == 0 ? ga8_quantize_group8(xr, group, plus128, out, &sx)
                                           : ga8_quantize_group(xr, group, plus128, out, &sx);
#else
        const int32_t sum = ga8_quantize_group(xr, group, plus128, out, &sx);
#endif
        xg[GA8_XG * g] = sx;
        xg[GA8_XG * g + 1] = sx * (float)sum;
        xg[GA8_XG * g + 2] = (float)sum;
    }
}

/* `rows` rows (codes xb: [rows][k / 4] dwords, group terms xg: [rows][groups][2]) against
 * one panel. Always inlined with constant rows. */
static inline __attribute__((always_inline)) void ga8_tile(
    const uint32_t *xb, int64_t k, const float *xg, int64_t group, const uint8_t *panel,
    const void *sc, int kind, int mode, const float *bias, float *out, int64_t n, int64_t cols,
    const int rows) {
    const int64_t groups = k / group, kw = k / 4;
    /* signed codes read with signed x (GA8_INT8 reads x + 128) */
    const int signed_q = kind == GA8_INT8H || kind == GA8_INT8MH;
    const int64_t blocks = ga8_byte_codes(kind) ? group / 4 : group / 8; /* blocks a group */
    const int planes = ga8_planes(kind);
    const int64_t tops = k / 2 * LANES; /* the top bytes' offset in a panel */
    /* a unit of top bytes is 1 << unit_log2 blocks (ga8_top_blocks): a mask and a shift,
     * not a division, where a short tile's copy has the kind at run time */
    const int width = ga8_top_width(kind), unit_log2 = 3 - width;
    const int64_t unit_mask = (1 << unit_log2) - 1;
    vlf acc[GA8_ROWS];
#if GA8_SIMD
    vbyte top; /* the panel's unit of top bytes, shifted to the block's bits */
#endif
    for (int i = 0; i < rows; i++) acc[i] = (vlf){0};
    for (int64_t g = 0; g < groups; g++) {
        const uint32_t *xw = xb + g * (group / 4);
        vli isum[GA8_ROWS];
#if GA8_SIMD
        vbyte ia[GA8_ROWS];
        for (int i = 0; i < rows; i++) ia[i] = GA8_ZERO();
#if GA8_SIGNED_INT8
        vbyte s16[GA8_ROWS];
        for (int i = 0; i < rows; i++) s16[i] = GA8_ZERO();
        const int64_t span = ga8_span(kind);
#endif
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *q = panel + (g * blocks + b) * LANES * 4;
            __builtin_prefetch(q + PREFETCH_BYTES);
            const vbyte w = GA8_LOAD(q);
            if (signed_q) {
#if GA8_SIGNED_INT8
                const vbyte aw = GA8_ABS(w);
                for (int r = 0; r < rows; r++)
                    ia[r] = GA8_DOT(ia[r], aw, GA8_SIGN(GA8_SET1((int)xw[r * kw + b]), w));
#else
                const vbyte u = GA8_FLIP(w);
                for (int r = 0; r < rows; r++)
                    ia[r] = GA8_DOT(ia[r], u, GA8_SET1((int)xw[r * kw + b]));
#endif
            } else if (kind != GA8_INT8) {
                vbyte lo = GA8_LOW_NIBBLES(w), hi = GA8_HIGH_NIBBLES(w);
                if (kind != GA8_UINT4) {
                    const int64_t gb = g * blocks + b;
                    if ((gb & unit_mask) == 0)
                        top = GA8_LOAD(panel + tops + (gb >> unit_log2) * LANES * 4);
                    const char mask = kind == GA8_INT6 ? 0x30 : 0x10;
                    lo = GA8_TOP(lo, GA8_TOP_UP(top), mask);
                    hi = GA8_TOP(hi, top, mask);
                    top = GA8_TOP_NEXT(top, width);
                }
#if GA8_SIGNED_INT8
                /* maddubs' int16 pairs summed in int16 for `span` blocks (ga8_span),
                 * widened to int32 once: two instructions a pair of bytes fewer, where
                 * a tile has the rows to fill the vector ports (a row or two gained
                 * nothing and lost 20% in cache: the one accumulator's chain) */
                if (rows >= 4) {
                    for (int r = 0; r < rows; r++) {
                        const uint32_t *xr = xw + r * kw + 2 * b;
                        vbyte t = GA8_DOT16(s16[r], lo, GA8_SET1((int)xr[0]));
                        s16[r] = GA8_DOT16(t, hi, GA8_SET1((int)xr[1]));
                    }
                    if (((b + 1) & (span - 1)) == 0 || b + 1 == blocks)
                        for (int r = 0; r < rows; r++) {
                            ia[r] = GA8_WIDEN(ia[r], s16[r]);
                            s16[r] = GA8_ZERO();
                        }
                    continue;
                }
#endif
                for (int r = 0; r < rows; r++) {
                    const uint32_t *xr = xw + r * kw + 2 * b;
                    ia[r] = GA8_DOT(ia[r], lo, GA8_SET1((int)xr[0]));
                    ia[r] = GA8_DOT(ia[r], hi, GA8_SET1((int)xr[1]));
                }
            } else {
#if GA8_SIGNED_INT8
                const vbyte aw = GA8_ABS(w);
                for (int r = 0; r < rows; r++) {
                    const vbyte xs = GA8_FLIP(GA8_SET1((int)xw[r * kw + b]));
                    ia[r] = GA8_DOT(ia[r], aw, GA8_SIGN(xs, w));
                }
#else
                for (int r = 0; r < rows; r++)
                    ia[r] = GA8_DOT(ia[r], GA8_SET1((int)xw[r * kw + b]), w);
#endif
            }
        }
        for (int i = 0; i < rows; i++) isum[i] = (vli)ia[i];
#else
        for (int i = 0; i < rows; i++) isum[i] = (vli){0};
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *q = panel + (g * blocks + b) * LANES * 4;
            const int64_t gb = g * blocks + b;
            const uint8_t *tb = panel + tops + (gb >> unit_log2) * LANES * 4;
            const int shift = (int)(gb & unit_mask) * width, bits = (1 << width) - 1;
            for (int r = 0; r < rows; r++) {
                const uint8_t *xr = (const uint8_t *)(xw + r * kw);
                for (int c = 0; c < LANES; c++) {
                    int32_t s = 0;
                    for (int j = 0; j < 4; j++) {
                        if (signed_q) {
                            s += (int8_t)q[c * 4 + j] * (int8_t)xr[4 * b + j];
                        } else if (kind != GA8_INT8) {
                            const uint8_t byte = q[c * 4 + j];
                            int lo = byte & 0xF, hi = byte >> 4;
                            if (kind != GA8_UINT4) {
                                const int t = tb[c * 4 + j] >> shift;
                                lo |= (t & bits) << 4;
                                hi |= t & (bits << 4);
                            }
                            s += lo * (int8_t)xr[8 * b + j] + hi * (int8_t)xr[8 * b + 4 + j];
                        } else {
                            s += (int8_t)q[c * 4 + j] * xr[4 * b + j];
                        }
                    }
                    isum[r][c] += s;
                }
            }
        }
#endif
        const vlf s = group_scale(sc, g, 0, planes, mode);
        /* The codes' offset (INT5 16, INT6 32; INT8H 128 where VNNI read its codes as
         * q + 128) comes off the integer sum exactly, before any rounding, as GA8_INT8
         * takes its plane c off: offset * sum xq is an integer too. */
        const float off = kind == GA8_INT5   ? 16.0f
                          : kind == GA8_INT6 ? 32.0f
                          : (signed_q && GA8_SIMD && !GA8_SIGNED_INT8) ? 128.0f : 0.0f;
        const vlf mc = planes == 2 ? group_scale(sc, g, 1, 2, mode) : (vlf){0};
        for (int r = 0; r < rows; r++) {
            const float *t = xg + (r * groups + g) * GA8_XG;
            const vlf f = to_float(isum[r]);
            if (kind != GA8_INT8 && planes == 1) /* no min: mc is 0 */
                acc[r] += ((off != 0.0f ? f - off * t[2] : f) * t[0]) * s;
            else if (kind != GA8_INT8) /* off is 0 where a kind has none */
                acc[r] += ((off != 0.0f ? f - off * t[2] : f) * t[0]) * s + mc * t[1];
            else if (GA8_SIGNED_INT8)
                acc[r] += (f * t[0]) * s;
            else
                acc[r] += ((f - mc) * t[0]) * s;
        }
    }
    store_panel(acc, 1, rows, 0, bias, out, n, cols);
}

/* A full tile (every tile of a prefill but its last) and the tiles of a batch-1, 2 and 4
 * decode run a copy of ga8_tile for their kind, where the kind's branches and the
 * epilogue's unused terms fold away; the other short tiles share one. SmolLM2's 576 x
 * 1536, one core, GMAC/s, generic -> per kind: AVX2 build, 128 rows: 4-bit 56 -> 63, 5-bit
 * 43 -> 48, int6 36 -> 43, Q8_0 40 -> 48; one row: 4-bit 25 -> 36, int6 13 -> 16; VNNI
 * build, 128 rows: 4-bit 107 -> 135, int6 82 -> 101; one row: 42 -> 54, 32 -> 36; AVX2, 2
 * and 4 rows: 4-bit 31 -> 35, 41 -> 46, Q6_K 19 -> 22, 24 -> 29, Q8_0 26 -> 31, 34 -> 36. */
#define GA8_KIND(R, KIND) \
    case KIND: ga8_tile(xb, k, xg, group, pp, sp, KIND, mode, bp, op, n, w, R); break;
#define GA8_CASE(R) \
    case R: \
        if (R == GA8_ROWS || R == 1 || R == 2 || R == 4) { \
            switch (kind) { \
                GA8_KIND(R, GA8_UINT4) GA8_KIND(R, GA8_INT8) GA8_KIND(R, GA8_UINT5) \
                GA8_KIND(R, GA8_INT5) GA8_KIND(R, GA8_INT6) GA8_KIND(R, GA8_INT8H) \
                GA8_KIND(R, GA8_INT8MH) default: break; \
            } \
        } else { \
            ga8_tile(xb, k, xg, group, pp, sp, kind, mode, bp, op, n, w, R); \
        } \
        break;

/* x: [m, k] rows `x_stride` apart; codes, scales as above; out: [m, n]. Returns -1
 * without scratch memory, -2 for a kind it does not know or a group it cannot take
 * (a multiple of 8 for GA8_UINT4, of 4 for GA8_INT8, dividing k) or a k that is not whole
 * units of top bytes (5- and 6-bit codes), else 0. */
static int ga8_linear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k,
                          const uint8_t *codes, const void *scales, int kind, int64_t group,
                          int64_t n, const float *bias, float *out, int threads) {
    const int mode = kind >> 8;
    kind &= 0xFF;
    if (kind < GA8_UINT4 || kind > GA8_INT8MH || group <= 0 || k % group ||
        group % (ga8_byte_codes(kind) ? 4 : 8) ||
        (kind >= GA8_UINT5 && kind <= GA8_INT6 && k % (8 * ga8_top_blocks(kind))) ||
        (mode != SC_F32 && mode != SC_F16 && mode != 8 && mode != 16) ||
        (mode >= 2 && k % (group * mode)))
        return -2;
    const int64_t groups = k / group, panels = (n + LANES - 1) / LANES;
    const int64_t pstride = ga8_code_bytes(kind, k) * LANES;
    const int64_t sstride = scale_stride(k, group, ga8_planes(kind), mode);
    uint8_t *xball = malloc((size_t)(m * k) + (size_t)(m * groups * GA8_XG) * sizeof(float));
    if (!xball) return -1;
    float *xgall = (float *)(xball + m * k); /* k % 8 == 0 or k % 4 == 0: aligned */
#pragma omp parallel for schedule(static) num_threads(threads) if (m > GA8_ROWS)
    for (int64_t r = 0; r < m; r++)
        ga8_quantize_row(x + r * x_stride, k, group, kind, xball + r * k,
                         xgall + r * groups * GA8_XG);
    /* A panel at a time, every tile of rows over it: one weight stream read in order (two
     * interleaved ran 35% slower: SmolLM2 Q8_0 +a8, all linears of a step in order on 2 Zen
     * 4 cores, 5.5 -> 3.6 ms, 26 -> 40 GB/s), a prefill's later tiles from the cache. */
#pragma omp parallel for schedule(guided) num_threads(threads) if (m * n * k >= PARALLEL_MIN_ELEMS)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t col0 = p * LANES, w = n - col0 < LANES ? n - col0 : LANES;
        const uint8_t *pp = codes + p * pstride;
        const void *sp = scale_at(scales, p * sstride, mode);
        const float *bp = bias ? bias + col0 : NULL;
        for (int64_t r0 = 0; r0 < m; r0 += GA8_ROWS) {
            const int64_t rows = m - r0 < GA8_ROWS ? m - r0 : GA8_ROWS;
            const uint32_t *xb = (const uint32_t *)(xball + r0 * k);
            const float *xg = xgall + r0 * groups * GA8_XG;
            float *op = out + r0 * n + col0;
            switch (rows) {
                GA8_CASE(1) GA8_CASE(2) GA8_CASE(3) GA8_CASE(4) GA8_CASE(5) GA8_CASE(6) GA8_CASE(7)
                GA8_CASE(8) default: break;
            }
        }
    }
    free(xball);
    return 0;
}

/* ---- The linears' entries, with an input prologue ----
 * PROLOGUE_SILU_MUL: the linear's input is silu(x[:, :k]) * x[:, k:] of a [m, 2k] x, the
 * gated MLP's activation fused into the down projection (passes/fuse_silu_linear.py). It
 * is computed into scratch rows here: one kernel call per layer fewer, where each call
 * from Python costs ~10 us in a decode step. Returns -3 for a prologue it does not know,
 * -1 without memory for the scratch, else what the linear returns. */
enum { PROLOGUE_NONE = 0, PROLOGUE_SILU_MUL = 1 };

static int prologue_input(const float **x, int64_t *x_stride, int64_t m, int64_t k,
                          int prologue, int threads, float **scratch) {
    *scratch = NULL;
    if (prologue == PROLOGUE_NONE) return 0;
    if (prologue != PROLOGUE_SILU_MUL) return -3;
    *scratch = malloc((size_t)(m * k) * sizeof(float));
    if (!*scratch) return -1;
    silu_mul_rows(*x, *x_stride, *scratch, m, k, threads);
    *x = *scratch;
    *x_stride = k;
    return 0;
}

int kiln_linear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k,
                    const float *packed, int64_t n, const float *bias, float *out, int wide,
                    int prologue, int threads) {
    float *scratch;
    int rc = prologue_input(&x, &x_stride, m, k, prologue, threads, &scratch);
    if (rc == 0) rc = linear_f32(x, x_stride, m, k, packed, n, bias, out, wide, threads);
    free(scratch);
    return rc;
}

int kiln_qlinear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const void *q,
                     const void *scales, int fmt, int64_t group, int64_t n, const float *bias,
                     float *out, int prologue, int threads) {
    float *scratch;
    int rc = prologue_input(&x, &x_stride, m, k, prologue, threads, &scratch);
    if (rc == 0) rc = qlinear_f32(x, x_stride, m, k, q, scales, fmt, group, n, bias, out, threads);
    free(scratch);
    return rc;
}

int kiln_a8_linear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k,
                       const int8_t *codes, const float *scales, int64_t n, const float *bias,
                       float *out, int prologue, int threads) {
    float *scratch;
    int rc = prologue_input(&x, &x_stride, m, k, prologue, threads, &scratch);
    if (rc == 0) rc = a8_linear_f32(x, x_stride, m, k, codes, scales, n, bias, out, threads);
    free(scratch);
    return rc;
}

int kiln_ga8_linear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k,
                        const uint8_t *codes, const void *scales, int kind, int64_t group,
                        int64_t n, const float *bias, float *out, int prologue, int threads) {
    float *scratch;
    int rc = prologue_input(&x, &x_stride, m, k, prologue, threads, &scratch);
    if (rc == 0)
        rc = ga8_linear_f32(x, x_stride, m, k, codes, scales, kind, group, n, bias, out,
                            threads);
    free(scratch);
    return rc;
}
