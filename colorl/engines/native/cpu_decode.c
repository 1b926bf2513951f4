/* The native engine's decode-step loops on CPU, float32 and bfloat16 (see cpu_decode.py for why
 * and when). The products are here; the other loops are in cpu_decode_loops.h, once per type.
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

/* What the exported functions return besides 0 (cpu_decode.py raises the matching Python error). */
#define COLORL_BAD_ROWS (-1)
#define COLORL_NO_MEMORY (-2)
#define COLORL_OUT_OF_RANGE (-3)

#include "cpu_decode_team.h"

/* Eight lanes of float32, and, with AVX-512, sixteen (one register). The element-wise loops (the SiLU, the e^x of
 * the softmax and the sampler, attention's sums of values, bf16's widening) run on the widest vector the build has,
 * vwide (WIDE lanes): on AVX-512 half the instructions per value, and each lane's value is the 8-lane loop's (the
 * same steps per lane; tests/engines/test_cpu_decode.py). Not 16 lanes on AVX2: GCC 12 splits them into halves so
 * badly (the e^x's compares and converts) that the SiLU and the sampler ran 3-4x slower than on 8 lanes. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

#define DEFINE_LOAD_STORE(VF, N)                                                                                  \
    static inline VF load##N(const float *p) {                                                                    \
        VF v;                                                                                                     \
        memcpy(&v, p, sizeof v);                                                                                  \
        return v;                                                                                                 \
    }                                                                                                             \
    static inline void store##N(float *p, VF v) { memcpy(p, &v, sizeof v); }
DEFINE_LOAD_STORE(v8, 8)

#define BROADCAST8(s) ((v8){(s), (s), (s), (s), (s), (s), (s), (s)}) /* one vbroadcastss from memory */

static inline float hsum8(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* a where mask, else b, lane by lane, for float32 vectors VF whose int32 lanes are VI (vector casts keep the bits). */
#define SELECT(VF, VI, mask, a, b) ((VF)(((VI)(a) & (mask)) | ((VI)(b) & ~(mask))))

/* e^x over the lanes of VF: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
 * (relative error below 2e-7 over the range, about float32 rounding), 2^n through the exponent
 * bits. Inputs below -87 give 0, as expf's result would underflow there anyway. */
#define DEFINE_EXP(name, VF, VI)                                                                                  \
    static inline VF name(VF x) {                                                                                 \
        const VF zero = {0}, lo = zero - 87.0f, hi = zero + 88.0f;                                               \
        VI under = x < lo;                                                                                        \
        x = SELECT(VF, VI, under, lo, x);                                                                         \
        x = SELECT(VF, VI, x > hi, hi, x);                                                                        \
        VF t = x * 1.44269504088896341f + 0.5f;                                                                   \
        VI n = __builtin_convertvector(t, VI); /* truncates: floor for t >= 0 */                                  \
        n += __builtin_convertvector(n, VF) > t; /* true is -1: floor below 0 too */                              \
        VF nf = __builtin_convertvector(n, VF);                                                                   \
        VF r = x - nf * 0.693359375f + nf * 2.12194440e-4f; /* ln2 split in two for an exact product */           \
        VF p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720)))))); \
        return SELECT(VF, VI, under, zero, p * (VF)((n + 127) << 23));                                           \
    }
DEFINE_EXP(exp8, v8, vi8)

#if defined(__AVX512F__)
#define WIDE 16
typedef float v16 __attribute__((vector_size(64)));
typedef v16 vwide;
typedef int32_t viwide __attribute__((vector_size(64)));
DEFINE_LOAD_STORE(vwide, _wide)
DEFINE_EXP(exp_wide, vwide, viwide)

/* Lanes 0-7 (h = 0) or 8-15 (h = 1): a pair of panels' sums (cpu_decode_loops.h), or a wide loop's halves. */
static inline v8 half16(v16 v, int h) {
    return h ? __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)
             : __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
}

static inline v8 add_in_order(v8 sums, vwide e) { /* sums + e's two halves in turn: the 8-lane loop's order */
    return (sums + half16(e, 0)) + half16(e, 1);
}
static inline float hsum_wide(vwide v) { return hsum8(half16(v, 0) + half16(v, 1)); }
#else
#define WIDE 8
typedef v8 vwide;
typedef vi8 viwide;
#define load_wide load8
#define store_wide store8
#define exp_wide exp8
static inline v8 add_in_order(v8 sums, vwide e) { return sums + e; }
static inline float hsum_wide(vwide v) { return hsum8(v); }
#endif

/* to[i] = e^(from[i] - top) for i below n rounded down to 8, and their sums in 8 lanes (lane j: every i = j mod 8,
 * in order, whatever WIDE is). */
static inline v8 exp_shifted(const float *from, float *to, int64_t n, float top) {
    v8 sums = {0};
    int64_t i = 0;
    for (; i + WIDE <= n; i += WIDE) {
        vwide e = exp_wide(load_wide(from + i) - (top - (vwide){0}));
        store_wide(to + i, e);
        sums = add_in_order(sums, e);
    }
    for (; i + 8 <= n; i += 8) {
        v8 e = exp8(load8(from + i) - (top - (v8){0}));
        store8(to + i, e);
        sums += e;
    }
    return sums;
}

/* The largest of x[0..n) (n >= 1): WIDE lanes at a time, then across them; exact in any order. */
static inline float max_of(const float *x, int64_t n) {
    float top = x[0];
    int64_t i = 0;
    if (n >= WIDE) {
        vwide tops = top - (vwide){0};
        for (; i + WIDE <= n; i += WIDE) {
            vwide next = load_wide(x + i);
            tops = SELECT(vwide, viwide, next > tops, next, tops);
        }
        for (int lane = 0; lane < WIDE; lane++) top = tops[lane] > top ? tops[lane] : top;
    }
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    return top;
}

/* Two-source shuffles of 8 lanes (indices 0-7: a's lanes, 8-15: b's); GCC before 12 has only __builtin_shuffle. */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, (vi8){__VA_ARGS__})
#endif

/* Pairwise sums within each 128-bit half, as x86's vhaddps: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, ...]. */
static inline v8 pair_sums8(v8 a, v8 b) {
    return SHUFFLE8(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE8(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* The eight sums of eight vectors' lanes, as one vector: [sum(a[0]), ..., sum(a[7])]. Three levels of
 * pairwise sums and one swap of halves, where eight horizontal sums take a shuffle chain each. */
static inline v8 sums8x8(const v8 a[8]) {
    v8 lo = pair_sums8(pair_sums8(a[0], a[1]), pair_sums8(a[2], a[3])); /* a0..a3: low halves' sums | high halves' */
    v8 hi = pair_sums8(pair_sums8(a[4], a[5]), pair_sums8(a[6], a[7]));
    return SHUFFLE8(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE8(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
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
 * prefetcher serves best), each row against every x row held in L1.
 *
 * From PAIR_FROM rows on, where the build has AVX-512, two weight rows go together on 16 lanes and each
 * vector of x loaded from L1 serves both. On a Zen 5 core the loads of x, not the arithmetic, held
 * the stream back at 7-8 rows: 16 lanes alone took 8 rows from L2 from 26 to 43 GB/s but left them at
 * about 25 of a plain sum's 40 GB/s from memory (a probe doing the same FMAs with x in registers
 * streamed at the sum's rate); pairs halve the loads of x, and the float32 decode step at 8 rows on
 * one thread took 1.81-1.89x its memory floor instead of 1.90-2.28x, by turns (bench/README.md, "A Zen 5").
 * At 3-5 rows pairs streamed slower there (26-30 GB/s against 34-39 in one row's loop), and at 6 the
 * same. 2B sums and two weight vectors fit AVX-512's 32 registers; AVX2's 16 would spill.
 *
 * From 3 rows on, the loop's own arithmetic slows how fast it asks for the stream, and the
 * hardware prefetcher alone no longer keeps enough lines in flight: the stream fell to 10 GB/s at
 * 8 rows on Zen 4. Asking for the weights PREFETCH_AHEAD floats (8 KB) ahead, into L2 (prefetcht1:
 * L2 tracks more misses than L1), brings 3-8 rows to 19-28 GB/s there (the race in cpu_decode.py
 * decides per machine; bench/README.md, "The engines alone").
 *
 * At 1-2 rows (FEW_ROWS) how to ask is the machine's: the race (cpu_decode.py, race_rows) times a decode
 * step's 1-2 rows asking into L2, non-temporally (prefetchnta: into L1, past the caches that hold what the
 * rest of the step reads) and not at all, and sets one here (colorl_few_rows_ask). On a Zen 5 core,
 * non-temporally took a batch-1 step from 1.15-1.18x its memory floor to 1.13x in float32 and from
 * 1.24-1.30x to 1.18-1.20x in bf16 (bench/README.md, "Non-temporal"). On an Intel Xeon with AMX
 * (family 6 model 167) the same asks took 2.8-2.9x the floor, not at all 1.08-1.14x, into L2 0.95-1.04x:
 * an L1 prefetch holds one of L1's few fill buffers until its line arrives, so few lines are in flight
 * (bench/README.md, "1-2 rows ask as the machine's race says"). */
#define PREFETCH_AHEAD 2048
#define FEW_ROWS 2
enum { ASK_NONE = 0, ASK_NTA = 1, ASK_L2 = 2 }; /* cpu_decode.py's FEW_ROWS_ASKS, in this order */
static int few_rows_ask = ASK_NTA;
int colorl_few_rows_ask(int ask) { /* sets how 1-2 rows ask for their weights ahead (-1: only reads it) */
    if (ask >= ASK_NONE && ask <= ASK_L2) few_rows_ask = ask;
    return few_rows_ask;
}
/* Ask for the line at p ahead of a loop over `rows` rows of x: into L2 above FEW_ROWS, else as the race set. */
#define STREAM_AHEAD(rows, p)                                                                      \
    do {                                                                                           \
        if ((rows) > FEW_ROWS || few_rows_ask == ASK_L2) __builtin_prefetch((p), 0, 2);            \
        else if (few_rows_ask == ASK_NTA) __builtin_prefetch((p), 0, 0);                           \
    } while (0)

/* Two weight rows against B rows of x, one sum per (weight row, x row) (above). */
#define PAIRS (WIDE == 16)
#define PAIR_FROM 7
static inline __attribute__((always_inline)) void row_pair_sums(const float *x, const float *wr, int64_t K, int B,
                                                                float *s0, float *s1) {
    const float *wr1 = wr + K;
    vwide acc[2][8];
    memset(acc, 0, sizeof acc);
    int64_t k = 0;
    for (; k + WIDE <= K; k += WIDE) {
        STREAM_AHEAD(B, wr + k + PREFETCH_AHEAD);
        STREAM_AHEAD(B, wr1 + k + PREFETCH_AHEAD);
        vwide w0 = load_wide(wr + k), w1 = load_wide(wr1 + k);
#pragma GCC unroll 8
        for (int b = 0; b < B; b++) {
            vwide xb = load_wide(x + b * K + k);
            acc[0][b] += w0 * xb;
            acc[1][b] += w1 * xb;
        }
    }
    for (int b = 0; b < B; b++) {
        s0[b] = hsum_wide(acc[0][b]);
        s1[b] = hsum_wide(acc[1][b]);
        for (int64_t j = k; j < K; j++) {
            s0[b] += wr[j] * x[b * K + j];
            s1[b] += wr1[j] * x[b * K + j];
        }
    }
}

#define ROWS_KERNEL(B)                                                                             \
    static void rows_##B(const float *x, const float *w, const float *bias, float *y, int64_t N,   \
                         int64_t K, int64_t n0, int64_t n1) {                                      \
        int64_t n = n0;                                                                            \
        if (PAIRS && B >= PAIR_FROM)                                                               \
            for (; n + 2 <= n1; n += 2) {                                                          \
                float s0[B], s1[B];                                                                \
                row_pair_sums(x, w + n * K, K, B, s0, s1);                                         \
                for (int b = 0; b < B; b++) {                                                      \
                    y[b * N + n] = bias ? s0[b] + bias[n] : s0[b];                                 \
                    y[b * N + n + 1] = bias ? s1[b] + bias[n + 1] : s1[b];                         \
                }                                                                                  \
            }                                                                                      \
        for (; n < n1; n++) {                                                                      \
            const float *wr = w + n * K;                                                           \
            v8 acc[B][2];                                                                          \
            memset(acc, 0, sizeof acc);                                                            \
            int64_t k = 0;                                                                         \
            for (; k + 16 <= K; k += 16) {                                                         \
                STREAM_AHEAD(B, wr + k + PREFETCH_AHEAD);                                          \
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

/* result = 0 after `each` ran over [n0, n1) of [0, N) split in one contiguous share per thread (one weight stream
 * each), or whole on one thread when one thread or a small N would not repay a team (ON_TEAM); `refused` instead
 * where a thread's share cannot run (its memory). */
#define SHARE_ROWS(result, N, threads, refused, each)                                              \
    ON_TEAM(result, (threads) > 1 && (N) >= 64 ? (threads) : 1, ({                                 \
                int64_t chunk = ((N) + nt - 1) / nt, n0 = id * chunk;                              \
                int64_t n1 = n0 + chunk < (N) ? n0 + chunk : (N);                                  \
                if (!(refused) && n0 < n1) each;                                                   \
                (refused) ? COLORL_NO_MEMORY : 0;                                                  \
            }))

int colorl_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t B, int64_t N,
                  int64_t K, int threads) {
    if (B < 1 || B > 8) return COLORL_BAD_ROWS;
    rows_fn kernel = ROWS[B];
    int code;
    SHARE_ROWS(code, N, threads, 0, kernel(x, w, bias, y, N, K, n0, n1));
    return code;
}

/* ---------------------------------------------------------------- products in bfloat16
 * The same products over bf16 weights: half the bytes to stream. Sums are float32 and the result
 * is rounded to bf16 once (to nearest, ties to even), as torch's bf16 product does; a bf16 times
 * a bf16 is exact in float32, so only the order of the sums differs.
 *
 * Widening each weight to float32 costs more than streaming it, so the loops avoid it:
 * - on CPUs with AVX512-BF16 (Zen 4, Sapphire Rapids), from 2 rows on, vdpbf16ps multiplies and
 *   adds bf16 pairs in one instruction (1.6-1.8x the widening loop at 3-8 rows);
 * - elsewhere, 16 weights load as 8 32-bit words whose high halves are the odd
 *   weights and whose low halves, shifted up, the even ones (two integer ops for 16 weights);
 *   x is laid out once per call to match: per 16 values, the 8 even then the 8 odd, in float32.
 * One row (row_sums_bf16_1) keeps four sums: with two, each 32 bytes of weights waited on one FMA's latency (8
 * bytes a cycle, 27-29 GB/s on a Zen 4 core whose plain sum reads 29-33). Asking for the lines 8 KB ahead into L2
 * took its stream from 0.98-1.03x a plain sum to 0.78-0.82x there (bench/README.md, "One row of bf16"); it asks
 * for them 4 KB ahead as the float32 kernel's 1-2 rows do (STREAM_AHEAD above): non-temporally, 1.05-1.11x a
 * plain sum on a Zen 5 core against 0.98-1.00x without (bench/rows_stream.py times the loops). */
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the bf16 loops read pairs of bf16 as little-endian 32-bit words"
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

typedef uint32_t vu8 __attribute__((vector_size(32)));
typedef uint16_t vh8 __attribute__((vector_size(16)));

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline void even_odd8(const uint16_t *p, v8 *even, v8 *odd) { /* 16 bf16 -> two v8 of float32 */
    vu8 bits, lo, hi;
    memcpy(&bits, p, sizeof bits);
    lo = bits << 16;
    hi = bits & 0xffff0000u;
    memcpy(even, &lo, sizeof *even);
    memcpy(odd, &hi, sizeof *odd);
}

/* The weights' row n against B rows: x16 the bf16 rows, xeo the same in the even/odd float32 layout
 * (NULL where the dpbf16 loop runs); s[b] receives row b's float32 sum. */
#define ROW_SUMS_BF16(B)                                                                           \
    static inline void row_sums_bf16_##B(const uint16_t *x16, const float *xeo, const uint16_t *wr, \
                                         int64_t K, float *s) {                                    \
        int64_t k = 0;                                                                             \
        if (HAVE_DPBF16) {                                                                         \
            DPBF16_LOOP(B)                                                                         \
        } else {                                                                                   \
            v8 acc[B][2];                                                                          \
            memset(acc, 0, sizeof acc);                                                            \
            for (; k + 16 <= K; k += 16) {                                                         \
                STREAM_AHEAD(B, (const char *)(wr + k) + PREFETCH_AHEAD * 4);                      \
                v8 even, odd;                                                                      \
                even_odd8(wr + k, &even, &odd);                                                    \
                for (int b = 0; b < B; b++) {                                                      \
                    acc[b][0] += even * load8(xeo + b * K + k);                                    \
                    acc[b][1] += odd * load8(xeo + b * K + k + 8);                                 \
                }                                                                                  \
            }                                                                                      \
            for (int b = 0; b < B; b++) s[b] = hsum8(acc[b][0] + acc[b][1]);                       \
        }                                                                                          \
        for (int b = 0; b < B; b++)                                                                \
            for (int64_t j = k; j < K; j++) s[b] += bf16_to_float(wr[j]) * bf16_to_float(x16[b * K + j]); \
    }

#if HAVE_DPBF16
#define DPBF16_LOOP(B)                                                                             \
    __m256 acc[B][2];                                                                              \
    for (int b = 0; b < B; b++) acc[b][0] = acc[b][1] = _mm256_setzero_ps();                       \
    for (; k + 32 <= K; k += 32) {                                                                 \
        STREAM_AHEAD(B, (const char *)(wr + k) + PREFETCH_AHEAD * 4);                              \
        __m256bh w0 = (__m256bh)_mm256_loadu_si256((const __m256i *)(wr + k));                    \
        __m256bh w1 = (__m256bh)_mm256_loadu_si256((const __m256i *)(wr + k + 16));               \
        for (int b = 0; b < B; b++) {                                                              \
            acc[b][0] = _mm256_dpbf16_ps(acc[b][0], w0, (__m256bh)_mm256_loadu_si256((const __m256i *)(x16 + b * K + k))); \
            acc[b][1] = _mm256_dpbf16_ps(acc[b][1], w1, (__m256bh)_mm256_loadu_si256((const __m256i *)(x16 + b * K + k + 16))); \
        }                                                                                          \
    }                                                                                              \
    for (int b = 0; b < B; b++) {                                                                  \
        v8 lo, hi;                                                                                 \
        memcpy(&lo, &acc[b][0], sizeof lo);                                                        \
        memcpy(&hi, &acc[b][1], sizeof hi);                                                        \
        s[b] = hsum8(lo + hi);                                                                     \
    }
#else
#define DPBF16_LOOP(B)
#endif

/* The weights' row n against one row of x: four independent sums, the lines asked for as the race set (above). */
static inline void row_sums_bf16_1(const uint16_t *x16, const float *xeo, const uint16_t *wr, int64_t K, float *s) {
    int64_t k = 0;
#if HAVE_DPBF16
    (void)xeo;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; k + 64 <= K; k += 64) {
        STREAM_AHEAD(1, (const char *)(wr + k) + PREFETCH_AHEAD * 2);
        STREAM_AHEAD(1, (const char *)(wr + k) + PREFETCH_AHEAD * 2 + 64);
        for (int i = 0; i < 4; i++)
            acc[i] = _mm256_dpbf16_ps(acc[i], (__m256bh)_mm256_loadu_si256((const __m256i *)(wr + k + 16 * i)),
                                      (__m256bh)_mm256_loadu_si256((const __m256i *)(x16 + k + 16 * i)));
    }
    for (; k + 16 <= K; k += 16)
        acc[0] = _mm256_dpbf16_ps(acc[0], (__m256bh)_mm256_loadu_si256((const __m256i *)(wr + k)),
                                  (__m256bh)_mm256_loadu_si256((const __m256i *)(x16 + k)));
    v8 sums[4];
    memcpy(sums, acc, sizeof sums);
#else
    v8 sums[4] = {{0}};
    for (; k + 32 <= K; k += 32) {
        STREAM_AHEAD(1, (const char *)(wr + k) + PREFETCH_AHEAD * 2);
        v8 even0, odd0, even1, odd1;
        even_odd8(wr + k, &even0, &odd0);
        even_odd8(wr + k + 16, &even1, &odd1);
        sums[0] += even0 * load8(xeo + k);
        sums[1] += odd0 * load8(xeo + k + 8);
        sums[2] += even1 * load8(xeo + k + 16);
        sums[3] += odd1 * load8(xeo + k + 24);
    }
    for (; k + 16 <= K; k += 16) {
        v8 even, odd;
        even_odd8(wr + k, &even, &odd);
        sums[0] += even * load8(xeo + k);
        sums[1] += odd * load8(xeo + k + 8);
    }
#endif
    s[0] = hsum8((sums[0] + sums[1]) + (sums[2] + sums[3]));
    for (int64_t j = k; j < K; j++) s[0] += bf16_to_float(wr[j]) * bf16_to_float(x16[j]);
}

ROW_SUMS_BF16(2)
ROW_SUMS_BF16(3)
ROW_SUMS_BF16(4)
ROW_SUMS_BF16(5)
ROW_SUMS_BF16(6)
ROW_SUMS_BF16(7)
ROW_SUMS_BF16(8)

#define ROWS_KERNEL_BF16(B)                                                                        \
    static void rows_bf16_##B(const uint16_t *x16, const float *xeo, const uint16_t *w, const uint16_t *bias, \
                              uint16_t *y, int64_t N, int64_t K, int64_t n0, int64_t n1) {         \
        float s[B];                                                                                \
        for (int64_t n = n0; n < n1; n++) {                                                        \
            row_sums_bf16_##B(x16, xeo, w + n * K, K, s);                                          \
            for (int b = 0; b < B; b++) y[b * N + n] = float_to_bf16(bias ? s[b] + bf16_to_float(bias[n]) : s[b]); \
        }                                                                                          \
    }

ROWS_KERNEL_BF16(1)
ROWS_KERNEL_BF16(2)
ROWS_KERNEL_BF16(3)
ROWS_KERNEL_BF16(4)
ROWS_KERNEL_BF16(5)
ROWS_KERNEL_BF16(6)
ROWS_KERNEL_BF16(7)
ROWS_KERNEL_BF16(8)

typedef void (*rows_bf16_fn)(const uint16_t *, const float *, const uint16_t *, const uint16_t *, uint16_t *,
                             int64_t, int64_t, int64_t, int64_t);
static const rows_bf16_fn ROWS_BF16[9] = {0, rows_bf16_1, rows_bf16_2, rows_bf16_3, rows_bf16_4,
                                          rows_bf16_5, rows_bf16_6, rows_bf16_7, rows_bf16_8};

int colorl_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t B,
                       int64_t N, int64_t K, int threads) {
    if (B < 1 || B > 8) return COLORL_BAD_ROWS;
    float *xeo = NULL;
    if (!HAVE_DPBF16) { /* the even/odd layout of x's whole 16-value chunks */
        xeo = malloc(sizeof(float) * B * K); /* each thread's own inside a step (cpu_decode_team.h) */
        for (int64_t b = 0; xeo && b < B; b++)
            for (int64_t c = 0; c + 16 <= K; c += 16)
                for (int i = 0; i < 8; i++) {
                    xeo[b * K + c + i] = bf16_to_float(x[b * K + c + 2 * i]);
                    xeo[b * K + c + 8 + i] = bf16_to_float(x[b * K + c + 2 * i + 1]);
                }
    }
    rows_bf16_fn kernel = ROWS_BF16[B];
    int code;
    SHARE_ROWS(code, N, threads, !HAVE_DPBF16 && !xeo, kernel(x, xeo, w, bias, y, N, K, n0, n1));
    free(xeo);
    return code;
}

/* ---------------------------------------------------------------- paged decode attention
 * One query token per sequence, attending to its whole context straight from the block table
 * (no gather into a padded copy, no mask). q: [S, H, D], sequence s at q + s * q_stride (rows of the
 * fused qkv projection); cache: one layer [slots, 2, Hkv, D]; tables: [S, width] block ids;
 * lengths: [S] context tokens; out: [S, H, D]. One task per (sequence, KV head) reads that head's
 * keys and values once for its whole query-head group, in two passes: every score, then the
 * softmax-weighted sum of values, in float32 like SDPA's CPU kernel.
 *
 * The keys and values come from memory: the step's weights have just streamed through the caches. Read row by
 * row (a few hundred bytes each, every block a jump), they came in at a fraction of the memory's rate, the loops
 * waiting on each load: on a Zen 5 core a batch-8 bf16 step's attention took 7.2x its KV bytes' floor. So the
 * loops ask for them ahead, into L2: each row KV_ROWS_AHEAD positions before it is read, and a thread's next
 * sequence whole as it starts a task (its first one too). One thread, bf16: 0.63-0.77x the time (8 x 60 tokens:
 * 7.2x the floor -> 5.3x, 8 x 600: 5.5x -> 3.1x), float32 0.76-1.0x (bench/README.md, "Keys and values asked
 * for ahead"). Asking changes no arithmetic. */
#define KV_ROWS_AHEAD 16
#define KV_ROW(cache, table, block_size, stride, p)                                                \
    ((cache) + ((table)[(p) / (block_size)] * (block_size) + (p) % (block_size)) * (stride))

static inline void ask_for_bytes(const void *from, int64_t bytes) { /* each 64-byte line into L2 */
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch((const char *)from + at, 0, 2);
}

/* Every row of a sequence's keys and values in one layer's cache (row_bytes each, `length` of them). */
static void ask_for_kv(const void *cache, const int64_t *table, int64_t length, int64_t block_size, int64_t row_bytes) {
    for (int64_t first = 0; first < length; first += block_size)
        ask_for_bytes(KV_ROW((const char *)cache, table, block_size, row_bytes, first),
                      (length - first < block_size ? length - first : block_size) * row_bytes);
}

/* As a thread starts task `task` of a paged decode (`per_sequence` tasks to a sequence, handed out in turn): its
 * first sequence (task < threads), whole, and the one it will likely take next. */
static void ask_for_sequences(const void *cache, const int64_t *tables, int64_t width, const int64_t *lengths,
                              int64_t block_size, int64_t row_bytes, int64_t task, int64_t tasks, int64_t per_sequence,
                              int threads) {
    int64_t s = task / per_sequence, next = (task + threads) / per_sequence;
    if (task < threads) ask_for_kv(cache, tables + s * width, lengths[s], block_size, row_bytes);
    if (task + threads < tasks && next != s) ask_for_kv(cache, tables + next * width, lengths[next], block_size, row_bytes);
}

/* q . k over D values (a multiple of 8) as eight lanes still to be summed: with AVX-512 sixteen lanes at a time where
 * D allows (half the FMAs), then their two halves added. */
static inline __attribute__((always_inline)) v8 dot_lanes(const float *q, const float *k, const int64_t D) {
#if WIDE == 16
    if (D % 16 == 0) {
        vwide sum = load_wide(q) * load_wide(k);
        for (int64_t d = 16; d < D; d += 16) sum += load_wide(q + d) * load_wide(k + d);
        return add_in_order((v8){0}, sum);
    }
#endif
    v8 sum = load8(q) * load8(k);
    for (int64_t d = 8; d < D; d += 8) sum += load8(q + d) * load8(k + d);
    return sum;
}

/* The scores of KV head kvh's query heads (qh: their queries, [group, D]) against the keys of positions 0..count
 * (row p at KV_ROW(cache, table, block_size, stride, p)), times scale: query head g's in
 * scores[g * scores_stride + p]. Eight positions at a time: each query head's eight dot products summed across
 * lanes together (sums8x8), its q held in registers over them; the last few positions one by one. A position's
 * score does not depend on the others, so runs of positions that start at multiples of 8 give the same bits.
 * `ahead`: each key asked for that many positions before it is read (0: none, the rows are in cache). */
static inline __attribute__((always_inline)) void
head_scores(const float *qh, const float *cache, const int64_t *table, int64_t block_size, int64_t stride,
            int64_t kvh, const int64_t D, int64_t group, int64_t count, float scale, float *scores,
            int64_t scores_stride, const int64_t ahead) {
    int64_t pos = 0;
    for (; D % 8 == 0 && pos + 8 <= count; pos += 8) {
        const float *k[8];
        for (int j = 0; j < 8; j++) k[j] = KV_ROW(cache, table, block_size, stride, pos + j) + kvh * D;
        for (int j = 0; ahead && j < 8 && pos + ahead + j < count; j++)
            ask_for_bytes(KV_ROW(cache, table, block_size, stride, pos + ahead + j) + kvh * D, D * sizeof(float));
        for (int64_t g = 0; g < group; g++) {
            const float *qg = qh + g * D;
            v8 partial[8];
            for (int j = 0; j < 8; j++) partial[j] = dot_lanes(qg, k[j], D);
            store8(scores + g * scores_stride + pos, sums8x8(partial) * scale);
        }
    }
    for (; pos < count; pos++) {
        const float *k = KV_ROW(cache, table, block_size, stride, pos) + kvh * D;
        for (int64_t g = 0; g < group; g++) scores[g * scores_stride + pos] = dot(qh + g * D, k, D) * scale;
    }
}

/* Each of the group's rows of scores [group, length] -> its softmax, in place. */
static inline void softmax_rows(float *scores, int64_t group, int64_t length) {
    for (int64_t g = 0; g < group; g++) {
        float *row = scores + g * length, top = max_of(row, length), total = hsum8(exp_shifted(row, row, length, top));
        int64_t p = length / 8 * 8;
        for (; p < length; p++) total += row[p] = expf(row[p] - top);
        float inv = 1.0f / total;
        for (p = 0; p < length; p++) row[p] *= inv;
    }
}

/* Query heads g..g + n's sums of values over positions 0..count (n <= VALUE_HEADS, a constant where inlined): their
 * sums in registers, each position's values loaded once for all n. Row p's values at KV_ROW(cache, table,
 * block_size, stride, p) + at; weights and `ahead` as head_values'. */
#define VALUE_HEADS 4
#define SUMS_HELD (WIDE == 16 ? 16 : 8) /* vwide sums a loop keeps in registers: half of AVX-512's 32, AVX2's 16 */
static inline __attribute__((always_inline)) void
heads_values(const float *weights, int64_t weights_stride, const float *cache, const int64_t *table,
             int64_t block_size, int64_t stride, int64_t at, const int64_t D, const int n, int64_t count, float *oh,
             int more, const int64_t ahead) {
    vwide acc[VALUE_HEADS][D / WIDE];
    for (int h = 0; h < n; h++)
        for (int64_t d = 0; d < D / WIDE; d++) acc[h][d] = more ? load_wide(oh + h * D + WIDE * d) : (vwide){0};
    for (int64_t first = 0; first < count; first += block_size) {
        const float *v = KV_ROW(cache, table, block_size, stride, first) + at;
        int64_t last = first + block_size < count ? first + block_size : count;
        for (int64_t p = first; p < last; p++, v += stride) {
            if (ahead && p + ahead < count)
                ask_for_bytes(KV_ROW(cache, table, block_size, stride, p + ahead) + at, D * sizeof(float));
            for (int64_t d = 0; d < D / WIDE; d++) {
                vwide values = load_wide(v + WIDE * d);
                for (int h = 0; h < n; h++) acc[h][d] += weights[h * weights_stride + p] * values;
            }
        }
    }
    for (int h = 0; h < n; h++)
        for (int64_t d = 0; d < D / WIDE; d++) store_wide(oh + h * D + WIDE * d, acc[h][d]);
}

/* oh[g] (+)= sum over positions 0..count of weights[g * weights_stride + p] * the values of KV head kvh at p (row p
 * addressed as in head_scores; the values follow the keys' Hkv heads): added to what oh holds where `more`, so
 * that runs of positions summed in turn give the one run's bits. WIDE values of a head at a time, as many heads
 * at once as SUMS_HELD sums hold (up to VALUE_HEADS); a head size that is not a multiple of WIDE sums the rest one
 * value at a time, in the same order. `ahead`: each row's values asked for that many positions before they are
 * read (0: none). */
static inline __attribute__((always_inline)) void
head_values(const float *weights, int64_t weights_stride, const float *cache, const int64_t *table,
            int64_t block_size, int64_t stride, int64_t Hkv, int64_t kvh, const int64_t D, int64_t group,
            int64_t count, float *oh, int more, const int64_t ahead) {
    int64_t at = (Hkv + kvh) * D, together = SUMS_HELD / (D / WIDE > 0 ? D / WIDE : 1);
    together = together < 1 ? 1 : together > VALUE_HEADS ? VALUE_HEADS : together;
    for (int64_t g = 0; D >= WIDE && g < group; g += together) {
        const float *w = weights + g * weights_stride;
        switch (group - g < together ? group - g : together) {
        case 1: heads_values(w, weights_stride, cache, table, block_size, stride, at, D, 1, count, oh + g * D, more, ahead); break;
        case 2: heads_values(w, weights_stride, cache, table, block_size, stride, at, D, 2, count, oh + g * D, more, ahead); break;
        case 3: heads_values(w, weights_stride, cache, table, block_size, stride, at, D, 3, count, oh + g * D, more, ahead); break;
        default: heads_values(w, weights_stride, cache, table, block_size, stride, at, D, 4, count, oh + g * D, more, ahead); break;
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = D / WIDE * WIDE; d < D; d++) {
            float sum = more ? oh[g * D + d] : 0.0f;
            for (int64_t p = 0; p < count; p++)
                sum += weights[g * weights_stride + p] * KV_ROW(cache, table, block_size, stride, p)[at + d];
            oh[g * D + d] = sum;
        }
}

static inline __attribute__((always_inline)) int
decode_one(const float *q, const float *cache, const int64_t *table, int64_t length, float *out, int64_t H,
           int64_t Hkv, const int64_t D, int64_t block_size, float scale, int64_t kvh) {
    int64_t group = H / Hkv, stride = 2 * Hkv * D;
    float *scores = malloc(sizeof(float) * group * length);
    if (!scores) return COLORL_NO_MEMORY;
    head_scores(q + kvh * group * D, cache, table, block_size, stride, kvh, D, group, length, scale, scores, length,
                KV_ROWS_AHEAD);
    softmax_rows(scores, group, length);
    head_values(scores, length, cache, table, block_size, stride, Hkv, kvh, D, group, length, out + kvh * group * D, 0,
                KV_ROWS_AHEAD);
    free(scores);
    return 0;
}

/* decode_one with the common head sizes as constants: the compiler unrolls the per-position loops. */
static int decode_head(const float *q, const float *cache, const int64_t *table, int64_t length, float *out,
                       int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t kvh) {
    if (D == 64) return decode_one(q, cache, table, length, out, H, Hkv, 64, block_size, scale, kvh);
    if (D == 128) return decode_one(q, cache, table, length, out, H, Hkv, 128, block_size, scale, kvh);
    return decode_one(q, cache, table, length, out, H, Hkv, D, block_size, scale, kvh);
}

/* Every block a step's sequences read, and every slot and position it writes, lies inside the cache and
 * the tables: a bad index from the caller is refused before any memory is touched, as torch's own
 * indexing refuses it (the loops would otherwise read or write out of bounds). */
static int check_tables(const int64_t *tables, int64_t width, const int64_t *lengths, int64_t S, int64_t block_size,
                        int64_t num_slots) {
    if (block_size < 1) return COLORL_OUT_OF_RANGE;
    int64_t blocks = num_slots / block_size;
    for (int64_t s = 0; s < S; s++) {
        int64_t length = lengths[s];
        if (length < 1 || length > width * block_size) return COLORL_OUT_OF_RANGE;
        for (int64_t b = 0; b < (length + block_size - 1) / block_size; b++)
            if (tables[s * width + b] < 0 || tables[s * width + b] >= blocks) return COLORL_OUT_OF_RANGE;
    }
    return 0;
}

static int check_writes(const int64_t *slots, const int64_t *positions, int64_t T, int64_t num_slots,
                        int64_t num_positions) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots || positions[t] < 0 || positions[t] >= num_positions)
            return COLORL_OUT_OF_RANGE;
    return 0;
}

/* ---------------------------------------------------------------- the other loops, per storage type */

/* A float32 buffer of at least n values for the calling thread, kept for its next call: a step's
 * tasks would otherwise each map and unmap a fresh buffer of a few hundred KB (malloc's mmap
 * threshold is 128 KB), page faults included. Grows to the longest context seen; never freed. */
static float *thread_scratch(int64_t n) { /* NULL when memory runs out */
    static __thread float *buffer = NULL;
    static __thread int64_t capacity = 0;
    if (n > capacity) {
        free(buffer);
        capacity = n + n / 2;
        buffer = malloc(sizeof(float) * capacity);
        if (!buffer) capacity = 0;
    }
    return buffer;
}

/* ---------------------------------------------------------------- sampling
 * A token drawn from softmax(z) for each of N rows of float32 logits z [N, V], by inverse CDF in
 * vocabulary order at u[row] (sampler.py's _inverse_cdf_two_level, the same steps without its twenty torch
 * operators, which took 1.2 ms of a batch-1 step on one Zen 3 core, 2.3 ms at batch 8, 2.2-2.7x this call:
 * bench/decode_step.py): the row's largest logit
 * `top`, each e^(z - top) in float32, their sums per SAMPLE_CHUNK tokens in float32 and the running total
 * of those in float64, the first chunk whose running total reaches u * total, then the first token inside
 * it whose float64 running total reaches the rest. logps[row] = z[token] - top - log(total). */
#define SAMPLE_CHUNK 256

static int64_t sample_row(const float *z, int64_t V, double u, float *weights, float *logp) {
    float top = max_of(z, V); /* NaN logits are the caller's to refuse (the engine's numerics checks) */
    int64_t v;
    double total = 0.0;
    int64_t chunks = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    double *running = (double *)(weights + V + (-V & 1)); /* after the weights, 8-byte aligned */
    for (int64_t c = 0; c < chunks; c++) {
        int64_t first = c * SAMPLE_CHUNK, last = first + SAMPLE_CHUNK < V ? first + SAMPLE_CHUNK : V;
        float sum = hsum8(exp_shifted(z + first, weights + first, last - first, top));
        for (v = first + (last - first) / 8 * 8; v < last; v++) sum += weights[v] = expf(z[v] - top);
        running[c] = total += sum;
    }
    double target = u * total;
    int64_t chunk = 0;
    while (chunk < chunks - 1 && running[chunk] < target) chunk++;
    double before = chunk ? running[chunk - 1] : 0.0, rest = target - before, inner = 0.0;
    int64_t first = chunk * SAMPLE_CHUNK, last = first + SAMPLE_CHUNK < V ? first + SAMPLE_CHUNK : V, token = first;
    for (; token < last - 1; token++) {
        inner += weights[token];
        if (inner >= rest) break;
    }
    *logp = (z[token] - top) - (float)log(total);
    return token;
}

/* Rows id, id + nt, ... of colorl_sample_plain's, on one thread of its team (cpu_decode_team.h). */
static int sample_rows(const float *z, int64_t N, int64_t V, const double *u, int64_t *tokens, float *logps, int id,
                       int nt) {
    if (id >= N) return 0;
    float *weights = thread_scratch(V + 1 + 2 * ((V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK)); /* then the chunks' totals */
    if (!weights) return COLORL_NO_MEMORY;
    for (int64_t row = id; row < N; row += nt) tokens[row] = sample_row(z + row * V, V, u[row], weights, logps + row);
    return 0;
}

int colorl_sample_plain(const float *z, int64_t N, int64_t V, const double *u, int64_t *tokens, float *logps,
                        int threads) {
    if (V < 1) return COLORL_OUT_OF_RANGE;
    int code;
    ON_TEAM(code, threads > 1 && N > 1 ? threads : 1, sample_rows(z, N, V, u, tokens, logps, id, nt));
    return code;
}

static inline v8 bf16_load8(const uint16_t *p) { /* 8 bf16 -> 8 float32, exactly */
#ifdef __AVX2__ /* one widening load and a shift: GCC splits the generic form into 128-bit halves (five ops) */
    __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    v8 out;
    memcpy(&out, &bits, sizeof out);
    return out;
#else
    vh8 h;
    memcpy(&h, p, sizeof h);
    vu8 bits = __builtin_convertvector(h, vu8) << 16;
    v8 out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

/* float32 -> bf16, to nearest, ties to even, NaN kept NaN: bf16_round_bitsN (the bf16 in the high halves),
 * bf16_roundN (as float32), bf16_storeN, for N lanes. */
#define DEFINE_BF16_ROUND(N)                                                                                      \
    static inline vu##N bf16_round_bits##N(v##N v) {                                                              \
        vu##N bits = (vu##N)v;                                                                                    \
        vu##N nan = (bits & 0x7fffffffu) > 0x7f800000u; /* all ones where NaN */                                 \
        vu##N rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;                                     \
        return (rounded & ~nan) | (0x7fc00000u & nan);                                                            \
    }                                                                                                             \
    static inline v##N bf16_round##N(v##N v) { return (v##N)bf16_round_bits##N(v); }                              \
    static inline void bf16_store##N(uint16_t *p, v##N v) {                                                       \
        vh##N h = __builtin_convertvector(bf16_round_bits##N(v) >> 16, vh##N);                                    \
        memcpy(p, &h, sizeof h);                                                                                  \
    }
/* Where the CPU has AVX512-BF16, one VCVTNEPS2BF16 rounds 8 or 16 lanes instead of the integer steps: the same
 * bits for every float32 but subnormals, which it flushes to zero as the products' VDPBF16PS does, and NaNs, which
 * stay NaN with their sign and payload (checked over all 2^32 inputs on a Zen 5). On that core the SiLU of 8 rows of
 * 1536 took 0.64x the time, the residual add and norm of 8 rows of 576 0.58x (0.45x with its 16-lane loops), and a
 * batch-8 decode step at one thread went from 1.48-1.51x its memory floor to 1.44-1.47x (bench/README.md, "Rounding
 * to bf16 in one instruction"). */
#if HAVE_DPBF16
/* N lanes of VF (a vector of PS, whose bf16 halves are HALF) rounded by CVT, widened back by WIDEN and SHIFT. */
#define DEFINE_BF16_ROUND_CVT(N, VF, PS, HALF, CVT, WIDEN, SHIFT, STORE)                                          \
    static inline VF bf16_round##N(VF v) { return (VF)SHIFT(WIDEN((HALF)CVT((PS)v)), 16); }                       \
    static inline void bf16_store##N(uint16_t *p, VF v) { STORE((HALF *)p, (HALF)CVT((PS)v)); }
DEFINE_BF16_ROUND_CVT(8, v8, __m256, __m128i, _mm256_cvtneps_pbh, _mm256_cvtepu16_epi32, _mm256_slli_epi32,
                      _mm_storeu_si128)
#else
DEFINE_BF16_ROUND(8)
#endif

#if WIDE == 16
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
#if HAVE_DPBF16
DEFINE_BF16_ROUND_CVT(16, v16, __m512, __m256i, _mm512_cvtneps_pbh, _mm512_cvtepu16_epi32, _mm512_slli_epi32,
                      _mm256_storeu_si256)
#else
DEFINE_BF16_ROUND(16)
#endif
#define bf16_round_wide bf16_round16
#define bf16_store_wide bf16_store16
static inline vwide bf16_load_wide(const uint16_t *p) { /* 16 bf16 -> 16 float32, exactly, as bf16_load8 */
    __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    return (vwide)bits;
}
#else
#define bf16_round_wide bf16_round8
#define bf16_store_wide bf16_store8
#define bf16_load_wide bf16_load8
#endif

static inline float bf16_round1(float f) { return bf16_to_float(float_to_bf16(f)); }
static inline void bf16_store1(uint16_t *p, float f) { *p = float_to_bf16(f); }
static inline float f32_load1(const float *p) { return *p; }
static inline void f32_store1(float *p, float f) { *p = f; }
static inline v8 same8(v8 v) { return v; }
static inline vwide same_wide(vwide v) { return v; }
static inline float same1(float f) { return f; }

/* What colorl_decode_layer_* reads (cpu_decode.py builds both with ctypes): one decoder layer's
 * tensors (biases may be NULL), and the step's shapes and per-sequence inputs. */
typedef struct {
    const void *input_norm, *w_qkv, *b_qkv, *w_o, *b_o, *post_norm, *w_gate_up, *b_gate_up, *w_down, *b_down;
    void *cache;                             /* this layer's [slots, 2, Hkv, D] */
    const void *p_qkv, *p_o, *p_gate_up, *p_down; /* the matrices' panels (colorl_pack_panels); NULL: the rows kernel, up to 8 rows */
} decode_layer_t;

typedef struct {
    int64_t tokens, hidden, heads, kv_heads, head_dim, intermediate, width, block_size;
    int64_t num_slots, num_positions;                         /* the cache's slots, the cos/sin tables' rows */
    const float *cos, *sin;                                   /* [P, D] tables */
    const int64_t *positions, *slots, *tables, *lengths;      /* [T], [T], [T, width], [T] */
    float eps, scale;
    int threads;
} decode_step_t;

typedef struct {
    const void *norm, *w, *p; /* the final norm's weight; the LM head [V, C] and its panels (NULL: the rows kernel) */
    int64_t vocab;
} decode_head_t;

#define ELEM float
#define SUFFIX _f32
#define LOAD8 load8
#define STORE8 store8
#define LOADW load_wide
#define STOREW store_wide
#define LOAD1 f32_load1
#define STORE1 f32_store1
#define ROUND8 same8
#define ROUNDW same_wide
#define ROUND1 same1
#define STAGE_KV 0
#define AMX_PANELS 0
#define KPAIR_PANELS 0
#include "cpu_decode_loops.h"
#undef ELEM
#undef SUFFIX
#undef LOAD8
#undef STORE8
#undef LOADW
#undef STOREW
#undef LOAD1
#undef STORE1
#undef ROUND8
#undef ROUNDW
#undef ROUND1
#undef STAGE_KV
#undef AMX_PANELS
#undef KPAIR_PANELS

/* ---------------------------------------------------------------- bf16 panels in k-pairs (cpu_decode_kpairs.h)
 * Where the CPU multiplies bf16 in pairs of k (AVX512-BF16), the bf16 panels hold k in pairs and their
 * products run on VDPBF16PS, or on AMX tiles where the CPU has them and Linux grants the tile state. */
#define HAVE_KPAIRS HAVE_DPBF16
#if HAVE_KPAIRS
static void kpairs_pack_bf16(const uint16_t *w, uint16_t *panels, int64_t N, int64_t K, int threads);
static int kpairs_fma_bf16(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int64_t B,
                           int64_t N, int64_t K, int threads); /* after the bf16 loops, whose bias and store they share */
static void kpairs_scores_bf16(const uint16_t *q, const uint16_t *cache, const int64_t *table, int64_t length,
                               int64_t block_size, int64_t Hkv, int64_t h0, int64_t h1, int64_t D, int64_t group,
                               float scale, float *scores);
#endif
#if HAVE_KPAIRS && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_on = 0; /* until colorl_use_amx(1) is granted */
/* One row wastes 15 of a tile's 16 rows, and its fixed work per weight tile (loading x, storing the sums) is
 * then the same as for 16: there the k-pair FMA loop, one VDPBF16PS per 64-byte line, streams the same panels
 * 3-6 % faster; from two rows on the tiles are 2-75 % faster (bench/README.md, "One row on the FMA loop"). */
#define AMX_MIN_ROWS 2
static int amx_panels_bf16(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int64_t B,
                           int64_t N, int64_t K, int threads);
#else
#define HAVE_AMX 0
int colorl_use_amx(int on) { (void)on; return 0; } /* built without AMX: never */
#endif
int colorl_amx_built(void) { return HAVE_AMX; }
#if HAVE_AMX
int colorl_amx_min_rows(void) { return AMX_MIN_ROWS; } /* fewer rows stay on the FMA loops */
#else
int colorl_amx_min_rows(void) { return 0; }
#endif

#define ELEM uint16_t
#define SUFFIX _bf16
#define LOAD8 bf16_load8
#define STORE8 bf16_store8
#define LOADW bf16_load_wide
#define STOREW bf16_store_wide
#define LOAD1(p) bf16_to_float(*(p))
#define STORE1 bf16_store1
#define ROUND8 bf16_round8
#define ROUNDW bf16_round_wide
#define ROUND1 bf16_round1
#define STAGE_KV 1
#define AMX_PANELS HAVE_AMX
#define KPAIR_PANELS HAVE_KPAIRS
#include "cpu_decode_loops.h"

#if HAVE_KPAIRS
#include "cpu_decode_kpairs.h"
#endif
