/* The native engine's decode-step loops on CPU, float32 (see cpu_decode.py for why and when).
 *
 * Built on the machine that runs it (-O3 -march=native -fopenmp), loaded after torch so that the
 * OpenMP runtime, and its thread team, is torch's own. Portable C with GCC vector extensions:
 * the compiler picks AVX-512, AVX2 or NEON. Every function takes plain pointers and sizes; the
 * Python side checks dtypes, devices and contiguity before calling.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

static inline float hsum8(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* e^x for 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
 * (relative error below 2e-7 over the range, about float32 rounding), 2^n through the exponent
 * bits. Inputs below -87 give 0, as expf's result would underflow there anyway. */
typedef int32_t vi8 __attribute__((vector_size(32)));

static inline v8 select8(vi8 mask, v8 a, v8 b) { /* a where mask, else b */
    vi8 ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    vi8 bits = (ai & mask) | (bi & ~mask);
    v8 out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline v8 exp8(v8 x) {
    const v8 zero = {0}, lo = zero - 87.0f, hi = zero + 88.0f;
    vi8 under = x < lo;
    x = select8(under, lo, x);
    x = select8(x > hi, hi, x);
    v8 t = x * 1.44269504088896341f + 0.5f;
    vi8 n = __builtin_convertvector(t, vi8);  /* truncates: floor for t >= 0 */
    n += __builtin_convertvector(n, v8) > t;  /* true is -1: floor below 0 too */
    v8 nf = __builtin_convertvector(n, v8);
    v8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f; /* ln2 split in two for an exact product */
    v8 p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    vi8 bits = (n + 127) << 23;
    v8 scale;
    memcpy(&scale, &bits, sizeof scale);
    return select8(under, zero, p * scale);
}

static inline float dot(const float *a, const float *b, int64_t n) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        a0 += load8(a + k) * load8(b + k);
        a1 += load8(a + k + 8) * load8(b + k + 8);
        a2 += load8(a + k + 16) * load8(b + k + 16);
        a3 += load8(a + k + 24) * load8(b + k + 24);
    }
    for (; k + 8 <= n; k += 8) a0 += load8(a + k) * load8(b + k);
    float s = hsum8((a0 + a1) + (a2 + a3));
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}

/* ---------------------------------------------------------------- products
 * y[b, n] = x[b, :] . w[n, :] (+ bias[n]) for b < B (1..8): a decode step's few rows. The weight
 * is read once, row after row (one sequential stream per thread, which is what the hardware
 * prefetcher serves best), each row against every x row held in L1. */

#define ROWS_KERNEL(B)                                                                             \
    static void rows_##B(const float *x, const float *w, const float *bias, float *y, int64_t N,   \
                         int64_t K, int64_t n0, int64_t n1) {                                      \
        for (int64_t n = n0; n < n1; n++) {                                                        \
            const float *wr = w + n * K;                                                           \
            v8 acc[B][2];                                                                          \
            memset(acc, 0, sizeof acc);                                                            \
            int64_t k = 0;                                                                         \
            for (; k + 16 <= K; k += 16) {                                                         \
                v8 w0 = load8(wr + k), w1 = load8(wr + k + 8);                                     \
                for (int b = 0; b < B; b++) {                                                      \
                    acc[b][0] += w0 * load8(x + b * K + k);                                        \
                    acc[b][1] += w1 * load8(x + b * K + k + 8);                                    \
                }                                                                                  \
            }                                                                                      \
            for (int b = 0; b < B; b++) {                                                          \
                float s = hsum8(acc[b][0] + acc[b][1]);                                            \
                for (int64_t j = k; j < K; j++) s += wr[j] * x[b * K + j];                         \
                y[b * N + n] = bias ? s + bias[n] : s;                                             \
            }                                                                                      \
        }                                                                                          \
    }

ROWS_KERNEL(1)
ROWS_KERNEL(2)
ROWS_KERNEL(3)
ROWS_KERNEL(4)
ROWS_KERNEL(5)
ROWS_KERNEL(6)
ROWS_KERNEL(7)
ROWS_KERNEL(8)

typedef void (*rows_fn)(const float *, const float *, const float *, float *, int64_t, int64_t, int64_t,
                        int64_t);
static const rows_fn ROWS[9] = {0, rows_1, rows_2, rows_3, rows_4, rows_5, rows_6, rows_7, rows_8};

int colorl_linear(const float *x, const float *w, const float *bias, float *y, int64_t B, int64_t N,
                  int64_t K, int threads) {
    if (B < 1 || B > 8) return -1;
    rows_fn kernel = ROWS[B];
    if (threads <= 1 || N < 64) {
        kernel(x, w, bias, y, N, K, 0, N);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t chunk = (N + nt - 1) / nt;
        int64_t n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        if (n0 < n1) kernel(x, w, bias, y, N, K, n0, n1);
    }
    return 0;
}

/* ---------------------------------------------------------------- norms and activations */

/* x[t] += add[t] when add is given (the residual stream, in place), then
 * out[t] = weight * x[t] / sqrt(mean(x[t]^2) + eps), as HF's RMSNorm computes it in float32. */
void colorl_add_rms_norm(float *x, const float *add, const float *weight, float *out, int64_t T,
                         int64_t C, float eps) {
    for (int64_t t = 0; t < T; t++) {
        float *row = x + t * C;
        if (add)
            for (int64_t c = 0; c < C; c++) row[c] += add[t * C + c];
        float inv = 1.0f / sqrtf(dot(row, row, C) / (float)C + eps);
        float *o = out + t * C;
        for (int64_t c = 0; c < C; c++) o[c] = weight[c] * (row[c] * inv);
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]: the gated MLP's activation. */
void colorl_silu_mul(const float *gate_up, float *out, int64_t T, int64_t I) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            v8 gv = load8(g + i);
            store8(o + i, gv / (1.0f + exp8(-gv)) * load8(u + i));
        }
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* ---------------------------------------------------------------- RoPE and the KV write
 * qkv: [T, (H + 2 Hkv) * D] rows of the fused projection. Rotates q and k in place (HF's
 * rotate_half layout: pairs (i, i + D/2)) with the cos/sin tables [P, D] at each token's
 * position, then writes k and v to cache[slot] ([slots, 2, Hkv, D]). */
void colorl_rope_write_kv(float *qkv, int64_t T, int64_t H, int64_t Hkv, int64_t D, const float *cos,
                          const float *sin, const int64_t *positions, const int64_t *slots, float *cache) {
    int64_t width = (H + 2 * Hkv) * D, half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * width;
        const float *c = cos + positions[t] * D, *s = sin + positions[t] * D;
        for (int64_t h = 0; h < H + Hkv; h++) {
            float *v = row + h * D;
            for (int64_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
        memcpy(cache + slots[t] * 2 * Hkv * D, row + H * D, 2 * Hkv * D * sizeof(float));
    }
}

/* ---------------------------------------------------------------- paged decode attention
 * One query token per sequence, attending to its whole context straight from the block table
 * (no gather into a padded copy, no mask). q: [S, H, D], sequence s at q + s * q_stride (rows of the
 * fused qkv projection); cache: one layer [slots, 2, Hkv, D]; tables: [S, width] block ids;
 * lengths: [S] context tokens; out: [S, H, D]. One task per (sequence, KV head) reads that head's
 * keys and values once for its whole query-head group, in two passes: every score, then the
 * softmax-weighted sum of values, in float32 like SDPA's CPU kernel. */
static inline __attribute__((always_inline)) void
decode_one(const float *q, const float *cache, const int64_t *table, int64_t length, float *out, int64_t H,
           int64_t Hkv, const int64_t D, int64_t block_size, float scale, int64_t kvh) {
    int64_t group = H / Hkv, stride = 2 * Hkv * D;
    const float *qh = q + kvh * group * D;
    float *oh = out + kvh * group * D;
    float *scores = malloc(sizeof(float) * group * length);
    if (!scores) abort();
    for (int64_t first = 0, b = 0; first < length; first += block_size, b++) {
        const float *k = cache + table[b] * block_size * stride + kvh * D;
        int64_t last = first + block_size < length ? first + block_size : length;
        for (int64_t p = first; p < last; p++, k += stride)
            for (int64_t g = 0; g < group; g++) scores[g * length + p] = dot(qh + g * D, k, D) * scale;
    }
    for (int64_t g = 0; g < group; g++) {
        float *row = scores + g * length, top = row[0], total = 0.0f;
        for (int64_t p = 1; p < length; p++) top = row[p] > top ? row[p] : top;
        int64_t p = 0;
        v8 sums = {0}, tops = top - (v8){0};
        for (; p + 8 <= length; p += 8) {
            v8 e = exp8(load8(row + p) - tops);
            store8(row + p, e);
            sums += e;
        }
        total = hsum8(sums);
        for (; p < length; p++) total += row[p] = expf(row[p] - top);
        float inv = 1.0f / total;
        for (p = 0; p < length; p++) row[p] *= inv;
    }
    for (int64_t g = 0; g < group; g++) { /* one head's sum in registers, the values re-read from L1/L2 */
        v8 acc[D / 8];
        memset(acc, 0, sizeof acc);
        const float *weights = scores + g * length;
        for (int64_t first = 0, b = 0; first < length; first += block_size, b++) {
            const float *v = cache + table[b] * block_size * stride + (Hkv + kvh) * D;
            int64_t last = first + block_size < length ? first + block_size : length;
            for (int64_t p = first; p < last; p++, v += stride)
                for (int64_t d = 0; d < D / 8; d++) acc[d] += weights[p] * load8(v + 8 * d);
        }
        for (int64_t d = 0; d < D / 8; d++) store8(oh + g * D + 8 * d, acc[d]);
        for (int64_t d = D / 8 * 8; d < D; d++) { /* a head size that is not a multiple of 8 */
            float sum = 0.0f;
            for (int64_t p = 0; p < length; p++)
                sum += weights[p] * cache[(table[p / block_size] * block_size + p % block_size) * stride + (Hkv + kvh) * D + d];
            oh[g * D + d] = sum;
        }
    }
    free(scores);
}

void colorl_paged_decode(const float *q, int64_t q_stride, const float *cache, const int64_t *tables, int64_t width,
                         const int64_t *lengths, float *out, int64_t S, int64_t H, int64_t Hkv,
                         int64_t D, int64_t block_size, float scale, int threads) {
    int64_t tasks = S * Hkv;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t s = task / Hkv, kvh = task % Hkv;
        const float *qs = q + s * q_stride;
        const int64_t *table = tables + s * width;
        float *os = out + s * H * D;
        /* the common head sizes as constants: the compiler unrolls the per-position loops */
        if (D == 64)
            decode_one(qs, cache, table, lengths[s], os, H, Hkv, 64, block_size, scale, kvh);
        else if (D == 128)
            decode_one(qs, cache, table, lengths[s], os, H, Hkv, 128, block_size, scale, kvh);
        else
            decode_one(qs, cache, table, lengths[s], os, H, Hkv, D, block_size, scale, kvh);
    }
}
