/* bf16 products over panels held in pairs of k, on CPUs with AVX512-BF16 (Zen 4, Sapphire Rapids and later
 * Xeons): cpu_decode.c includes this after the bf16 loops (cpu_decode_loops.h), whose pack and product
 * call these instead of their own where KPAIR_PANELS is set.
 *
 * Why another layout. Both instructions that multiply bf16 on these CPUs take k in pairs: VDPBF16PS
 * adds x[2j] w[2j] + x[2j+1] w[2j+1] into a float32 lane, and AMX's TDPBF16PS takes its weight tile as
 * 16 rows of k-pairs x 16 outputs. The k-major panels (one k per row) made the FMA loops widen every
 * weight to float32 and take one k per instruction, and made the tiles re-lay each pair of panels per
 * call: staging alone took 1.29x the memory floor on the AMX Xeon, where the tiles themselves took 0.51x
 * (bench/README.md, "AMX tiles"). Packed once per weight version in the instructions' own order, a pair
 * of panels (16 outputs) is [K2 = ceil(K / 2)][16][2]: k-pair j of output o at (j * 16 + o) * 2, zero
 * past N and K. Both loops then read it as one sequential stream:
 * - the FMA loops: per k-pair one 64-byte weight load and one VDPBF16PS per row of x (its k-pair
 *   broadcast), up to 16 rows of sums at a time, as the k-major loops hold them, and the stream asked for
 *   as they ask for it (STREAM_AHEAD, cpu_decode.c);
 * - the tiles: each 16 k-pairs of a pair of panels is one weight tile, loaded straight from the panels
 *   (16 rows of 64 bytes, 1 KB in a row); only a K that is not a multiple of 32 copies its last, partial
 *   tile into zeros. Per weight tile one x tile and one TDPBF16PS per 16 rows of x.
 *
 * Both round float32 sums to bf16 once, as every other product does; both flush bf16 subnormals to
 * zero (as the instructions do), which the products' tests allow for. */

/* How far ahead the FMA loops ask for the panels, in bf16 values: the 8 KB the float32 loops ask ahead (PANEL_AHEAD
 * floats). Half that, as PANEL_AHEAD bf16 values, left the stream short on a Zen 5 core: [3072, 576] matrices from
 * DRAM at 8 rows 33.3-33.9 GB/s against 35.7-37.1 at 8 KB, 2 rows 38.6 against 43.1, 32 rows 12.4 against 13.6
 * (16 KB: no better; float32 at 16 KB: 8 rows 11 % slower; bench/README.md, "8 KB ahead"). */
#define KPAIR_AHEAD (PANEL_AHEAD * (int64_t)(sizeof(float) / sizeof(uint16_t)))
#define KPAIR_TILE 16 /* the most rows of x whose sums the FMA loop holds at once (16-wide registers) */
#define KPAIR_ROWS(B, left) ((B) <= 8 ? (B) : (left) > 8 ? 16 : 8) /* a tile's rows, as TILE_ROWS in cpu_decode_loops.h */

static inline int64_t kpairs_pair_size(int64_t K) { return 32 * ((K + 1) / 2); } /* elements of a pair of panels */

static void kpairs_pack_bf16(const uint16_t *w, uint16_t *panels, int64_t N, int64_t K, int threads) {
    int64_t K2 = (K + 1) / 2, pairs = (N + 2 * PANEL - 1) / (2 * PANEL);
#pragma omp parallel for num_threads(threads) if (threads > 1 && pairs > 1)
    for (int64_t q = 0; q < pairs; q++) {
        uint16_t *pair = panels + q * kpairs_pair_size(K);
        for (int64_t j = 0; j < K2; j++)
            for (int64_t o = 0; o < 2 * PANEL; o++)
                for (int64_t e = 0; e < 2; e++) {
                    int64_t n = q * 2 * PANEL + o, k = 2 * j + e;
                    pair[(j * 2 * PANEL + o) * 2 + e] = n < N && k < K ? w[n * K + k] : 0;
                }
    }
}

/* k-pairs j0..j1 of x's rows b0.. (`rows` of them, zeros past B) into a tile laid out k-pair-major: [K2][rows]
 * 32-bit words. Row by row, each k-pair one 32-bit word of the row (the last one of an odd K alone): half the time
 * of pair by pair, two halves put together (a 1536-wide x of 8 rows 1.6 us against 3.3 on a Zen 5; 32 rows 6.9
 * against 11.6; the layout runs once per product, four times a layer). */
static inline void kpairs_of_x(const uint16_t *x, uint32_t *xp, int64_t B, int64_t K, int64_t b0, int64_t rows,
                               int64_t j0, int64_t j1) {
    int64_t whole = K / 2 < j1 ? K / 2 : j1; /* k-pairs with both halves */
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *row = x + (b0 + i) * K;
        int64_t j = j0;
        if (b0 + i < B) {
            for (; j < whole; j++) memcpy(xp + j * rows + i, row + 2 * j, sizeof(uint32_t));
            for (; j < j1; j++) xp[j * rows + i] = row[2 * j]; /* an odd K's last k, its pair zero */
        }
        for (; j < j1; j++) xp[j * rows + i] = 0;
    }
}

/* One pair of panels (wp) against R <= KPAIR_TILE rows of x's k-pairs (xt [K2][R]): the pair's 16 sums per
 * row, in c. R is a constant where it is inlined, so the sums stay in registers. `chains` 2 (R <= 8 only): each
 * sum is two runs of VDPBF16PS, the even k-pairs' and the odd ones', added at the end. One run per row left a
 * product of up to 8 rows waiting on the instruction's latency (8 sums in flight where two a cycle at 6 cycles
 * each want 12): from DRAM, 8 rows of a [3072, 576] matrix read 35.0-35.5 GB/s on a Zen 5 core against 37.7-40.1
 * with two runs (bench/README.md, "Two runs per sum"). A tile of 16 rows has 16 sums in flight already, and 32
 * would not fit in registers: products of more than 8 rows keep one run per sum in every tile, their last one too,
 * so that within a product each row's sum is taken in the same order. */
static inline __attribute__((always_inline)) void kpairs_sums(const uint32_t *xt, const uint16_t *wp, int64_t K2,
                                                              int64_t R, int fetch, const int chains,
                                                              __m512 c[KPAIR_TILE]) {
    __m512 odd[8];
    for (int64_t i = 0; i < R; i++) c[i] = _mm512_setzero_ps();
    for (int64_t i = 0; chains == 2 && i < R; i++) odd[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < K2; j += chains) {
        if (fetch) /* one line per k-pair */
            for (int line = 0; line < chains; line++) STREAM_AHEAD(R, wp + (j + line) * 32 + KPAIR_AHEAD);
        __m512bh w = (__m512bh)_mm512_loadu_si512(wp + j * 32);
        const uint32_t *xj = xt + j * R;
        if (chains == 2 && j + 1 < K2) {
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + j * 32 + 32);
#pragma GCC unroll 8
            for (int64_t i = 0; i < R && i < 8; i++) {
                c[i] = _mm512_dpbf16_ps(c[i], w, (__m512bh)_mm512_set1_epi32((int)xj[i]));
                odd[i] = _mm512_dpbf16_ps(odd[i], w1, (__m512bh)_mm512_set1_epi32((int)xj[R + i]));
            }
        } else {
#pragma GCC unroll 16
            for (int64_t i = 0; i < R; i++) c[i] = _mm512_dpbf16_ps(c[i], w, (__m512bh)_mm512_set1_epi32((int)xj[i]));
        }
    }
    for (int64_t i = 0; chains == 2 && i < R && i < 8; i++) c[i] = _mm512_add_ps(c[i], odd[i]);
}

/* The sums of rows b0.. (R of them, those below B) for the pair of panels at outputs n0.., plus the bias, into y. */
static void kpairs_store(const __m512 *c, int64_t R, uint16_t *y, int64_t B, int64_t N, int64_t b0, int64_t n0,
                         const int64_t widths[2], float bv[2][PANEL]) {
    for (int64_t i = 0; i < R && b0 + i < B; i++)
        for (int v = 0; v < 2; v++)
            if (widths[v]) store_sums_bf16(y + (b0 + i) * N + n0 + v * PANEL, half16((v16)c[i], v), bv[v], widths[v]);
}

#define KPAIRS_TILE_CASE(R)                                                                        \
    case R:                                                                                        \
        if (B <= 8)                                                                                \
            kpairs_sums(xt, wp, K2, R, first, 2, c);                                               \
        else                                                                                       \
            kpairs_sums(xt, wp, K2, R, first, 1, c);                                               \
        break;

/* x's k-pairs in tiles ([K2, R] from each tile's first row b0), in whole 64-byte lines: one thread's copy. */
static inline int64_t kpairs_x_words(int64_t B, int64_t K) {
    int64_t packed = 0;
    for (int64_t b0 = 0; b0 < B; b0 += KPAIR_ROWS(B, B - b0)) packed += KPAIR_ROWS(B, B - b0);
    return (packed * ((K + 1) / 2) + 15) / 16 * 16;
}

/* One thread's share (id of nt, cpu_decode_team.h) of kpairs_fma_bf16: x's k-pairs laid out into its own copy (xp
 * holds one per thread, kpairs_x_words each), then its own contiguous run of pairs of panels, streamed once (the
 * first tile of rows asks for them ahead; the others re-read the pair, 18 KB at K = 576, from L1/L2). One copy laid
 * out by all, half by each, needed a barrier inside the product and had each thread read half its x from the other
 * core: where the two cores sit on two CCDs, bf16 steps of 32 rows took 1.06x as long so (bench/README.md, "Two
 * CCDs"). float32 keeps one copy (its tiles of x are twice the bytes: a copy each took 1.06x as long). */
static int kpairs_fma_share(const uint16_t *x, uint32_t *xp, const uint16_t *panels, const uint16_t *bias, uint16_t *y,
                            int64_t B, int64_t N, int64_t K, int id, int nt) {
    int64_t K2 = (K + 1) / 2, pairs = (N + 2 * PANEL - 1) / (2 * PANEL);
    xp += id * kpairs_x_words(B, K);
    for (int64_t b0 = 0; b0 < B; b0 += KPAIR_ROWS(B, B - b0)) /* tile by tile from row b0: [K2, R] */
        kpairs_of_x(x, xp + b0 * K2, B, K, b0, KPAIR_ROWS(B, B - b0), 0, K2);
    int64_t share = (pairs + nt - 1) / nt, q0 = id * share, q1 = q0 + share < pairs ? q0 + share : pairs;
    for (int64_t q = q0; q < q1; q++) {
        const uint16_t *wp = panels + q * kpairs_pair_size(K);
        int64_t n0 = 2 * q * PANEL, widths[2];
        float bv[2][PANEL];
        pair_bias_bf16(bias, N, n0, widths, bv);
        for (int64_t b0 = 0; b0 < B; b0 += KPAIR_ROWS(B, B - b0)) {
            int64_t R = KPAIR_ROWS(B, B - b0);
            int first = b0 == 0; /* the first tile streams the pair, ahead */
            const uint32_t *xt = xp + b0 * K2;
            __m512 c[KPAIR_TILE];
            switch (R) { /* one copy of the loop per row count, its sums in registers */
            KPAIRS_TILE_CASE(1) KPAIRS_TILE_CASE(2) KPAIRS_TILE_CASE(3) KPAIRS_TILE_CASE(4)
            KPAIRS_TILE_CASE(5) KPAIRS_TILE_CASE(6) KPAIRS_TILE_CASE(7) KPAIRS_TILE_CASE(8)
            default: kpairs_sums(xt, wp, K2, KPAIR_TILE, first, 1, c);
            }
            kpairs_store(c, R, y, B, N, b0, n0, widths, bv);
        }
    }
    return 0;
}

/* y [B, N] = x [B, K] . w^T (+ bias) over w's k-pair panels, on the FMA units. */
static int kpairs_fma_bf16(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int64_t B,
                           int64_t N, int64_t K, int threads) {
    int64_t pairs = (N + 2 * PANEL - 1) / (2 * PANEL);
    int own, code, team = threads > 1 && pairs >= (B <= 8 ? 8 : 2) * threads ? threads : 1;
    uint32_t *xp = team_buffer(sizeof(uint32_t) * kpairs_x_words(B, K) * team, &own);
    ON_TEAM(code, team, xp ? kpairs_fma_share(x, xp, panels, bias, y, B, N, K, id, nt) : COLORL_NO_MEMORY);
    if (own) free(xp);
    return code;
}

/* ---------------------------------------------------------------- bf16 attention's scores in k-pairs
 * A query and a key are pairs of bf16 in memory as they are, so VDPBF16PS takes them in place: no widened copy of
 * the keys, and half the instructions of the float32 FMAs over it. Scores of KV heads [h0, h1)'s query heads (q:
 * the sequence's [H, D] queries) against its `length` positions, times scale, into scores [(h1 - h0) group][length];
 * eight positions at a time, each query's eight sums across lanes together (sums8x8), as the float32 loops take
 * them. D a multiple of 32 (a constant where inlined). */
static inline __attribute__((always_inline)) void
kpairs_scores_d(const uint16_t *q, const uint16_t *cache, const int64_t *table, int64_t length, int64_t block_size,
                int64_t Hkv, int64_t h0, int64_t h1, const int64_t D, int64_t group, float scale, float *scores) {
    int64_t stride = 2 * Hkv * D, bytes = (h1 - h0) * D * (int64_t)sizeof(uint16_t);
    for (int64_t pos = 0; pos < length; pos += 8) {
        int64_t count = length - pos < 8 ? length - pos : 8;
        const uint16_t *rows[8];
        for (int64_t j = 0; j < 8; j++) rows[j] = KV_ROW(cache, table, block_size, stride, pos + (j < count ? j : 0));
        for (int64_t j = 0; j < count && pos + KV_ROWS_AHEAD + j < length; j++)
            ask_for_bytes(KV_ROW(cache, table, block_size, stride, pos + KV_ROWS_AHEAD + j) + h0 * D, bytes);
        for (int64_t kvh = h0; kvh < h1; kvh++)
            for (int64_t g = 0; g < group; g++) {
                const uint16_t *qg = q + (kvh * group + g) * D;
                v8 partial[8];
                for (int j = 0; j < 8; j++) {
                    __m512 sum = _mm512_setzero_ps();
                    for (int64_t c = 0; c < D; c += 32)
                        sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(rows[j] + kvh * D + c),
                                               (__m512bh)_mm512_loadu_si512(qg + c));
                    partial[j] = add_in_order((v8){0}, (vwide)sum);
                }
                v8 s = sums8x8(partial) * scale;
                float *row = scores + ((kvh - h0) * group + g) * length + pos;
                if (count == 8) store8(row, s);
                else
                    for (int64_t j = 0; j < count; j++) row[j] = s[j];
            }
    }
}

static void kpairs_scores_bf16(const uint16_t *q, const uint16_t *cache, const int64_t *table, int64_t length,
                               int64_t block_size, int64_t Hkv, int64_t h0, int64_t h1, int64_t D, int64_t group,
                               float scale, float *scores) {
    if (D == 64) kpairs_scores_d(q, cache, table, length, block_size, Hkv, h0, h1, 64, group, scale, scores);
    else if (D == 128) kpairs_scores_d(q, cache, table, length, block_size, Hkv, h0, h1, 128, group, scale, scores);
    else kpairs_scores_d(q, cache, table, length, block_size, Hkv, h0, h1, D, group, scale, scores);
}

/* ---------------------------------------------------------------- the same products on AMX tiles
 * On CPUs with AMX one TDPBF16PS multiplies 16 rows x 32 k of x by 32 k x 16 outputs of w and adds the
 * float32 sums into a 16 x 16 tile: a decode step's product is bound by the weights' stream there.
 * Whether a few rows run here or on the rows kernel is the race's (cpu_decode.py), as on any CPU.
 *
 * Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, once per process);
 * refused, or turned off (colorl_use_amx(0), COLORL_CPU_DECODE_AMX=0 in cpu_decode.py), the FMA loops
 * above run, on the same panels. */
#if HAVE_AMX
int colorl_use_amx(int on) { /* 1 when the bf16 products over the panels run on AMX from now on */
    amx_on = on && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_on;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_config_t;

static void amx_configure(void) { /* eight tiles of 16 rows x 64 bytes, for this thread */
    amx_config_t config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

#define AMX_TILE_AHEAD 4 /* weight tiles (1 KB each) asked for ahead of the one loaded */
/* Tiles: the sums of up to AMX_BLOCKS row blocks in 0-2, their x in 3-5, and the weights in 6 and 7 by turns
 * (k-blocks even, odd): a tile is loaded while the one before is still multiplied. (Two pairs of panels
 * at a time against two row blocks, each tile used twice, measured no faster: the stream bounds it.) */
#define AMX_BLOCKS 3
#define AMX_DOT(t, xt, wt)                                                                         \
    if (blocks > t) {                                                                              \
        _tile_loadd(xt, xa + ((first + t) * K32 + kb) * 512, 64);                                  \
        _tile_dpbf16ps(t, xt, wt);                                                                 \
    }
#define AMX_STORE(t)                                                                               \
    if (blocks > t) _tile_stored(t, sums + t * 256, 64);
/* One thread's share (id of nt) of amx_panels_bf16: x laid out with the others in 16-row blocks of tiles, then its
 * own run of pairs of panels, streamed once (the first AMX_BLOCKS row blocks read it from memory, any later ones
 * from L2). */
static int amx_share(const uint16_t *x, uint16_t *xa, const uint16_t *panels, const uint16_t *bias, uint16_t *y,
                     int64_t B, int64_t N, int64_t K, int id, int nt) {
    int64_t K2 = (K + 1) / 2, K32 = (K + 31) / 32, whole = K2 / 16, RB = (B + 15) / 16;
    int64_t pairs = (N + 2 * PANEL - 1) / (2 * PANEL);
    for (int64_t tile = id; tile < RB * K32; tile += nt) { /* [B/16, K/32, 16, 32], zero-padded */
        int64_t rb = tile / K32, kb = tile % K32;
        for (int64_t r = 0; r < 16; r++) {
            uint16_t *to = xa + ((rb * K32 + kb) * 16 + r) * 32;
            int64_t b = rb * 16 + r, k0 = kb * 32, n = b < B ? (K - k0 < 32 ? K - k0 : 32) : 0;
            if (n) memcpy(to, x + b * K + k0, n * sizeof(uint16_t));
            if (n < 32) memset(to + n, 0, (32 - n) * sizeof(uint16_t));
        }
    }
    team_barrier(nt); /* each thread reads the whole of x */
    uint16_t *tail = aligned_alloc(64, 512 * sizeof(uint16_t)); /* a partial last weight tile, zero-padded */
    float *sums = aligned_alloc(64, AMX_BLOCKS * 256 * sizeof(float));
    if (!tail || !sums) {
        free(tail);
        free(sums);
        return COLORL_NO_MEMORY;
    }
    amx_configure();
    int64_t share = (pairs + nt - 1) / nt, q0 = id * share, q1 = q0 + share < pairs ? q0 + share : pairs;
    for (int64_t q = q0; q < q1; q++) {
        const uint16_t *wp = panels + q * kpairs_pair_size(K);
        if (whole < K32) {
            memset(tail, 0, 512 * sizeof(uint16_t));
            memcpy(tail, wp + whole * 512, (K2 - whole * 16) * 32 * sizeof(uint16_t));
        }
        int64_t n0 = 2 * q * PANEL, widths[2];
        float bv[2][PANEL];
        pair_bias_bf16(bias, N, n0, widths, bv);
        for (int64_t first = 0; first < RB; first += AMX_BLOCKS) {
            int64_t blocks = RB - first < AMX_BLOCKS ? RB - first : AMX_BLOCKS;
            _tile_zero(0); _tile_zero(1); _tile_zero(2);
            for (int64_t kb = 0; kb < K32; kb++) {
                if (first == 0) /* the stream, AMX_TILE_AHEAD tiles on (into the next pair at the end) */
                    for (int line = 0; line < 16; line++)
                        __builtin_prefetch(wp + (kb + AMX_TILE_AHEAD) * 512 + line * 32, 0, 2);
                if (kb & 1) {
                    _tile_loadd(7, kb < whole ? wp + kb * 512 : tail, 64);
                    AMX_DOT(0, 3, 7) AMX_DOT(1, 4, 7) AMX_DOT(2, 5, 7)
                } else {
                    _tile_loadd(6, kb < whole ? wp + kb * 512 : tail, 64);
                    AMX_DOT(0, 3, 6) AMX_DOT(1, 4, 6) AMX_DOT(2, 5, 6)
                }
            }
            AMX_STORE(0) AMX_STORE(1) AMX_STORE(2)
            for (int64_t t = 0; t < blocks; t++)
                for (int64_t r = 0; r < 16; r++) {
                    int64_t b = (first + t) * 16 + r;
                    if (b >= B) break;
                    const float *s = sums + t * 256 + r * 16;
                    for (int v = 0; v < 2; v++)
                        if (widths[v]) store_sums_bf16(y + b * N + n0 + v * PANEL, load8(s + v * PANEL), bv[v], widths[v]);
                }
        }
    }
    _tile_release();
    free(tail);
    free(sums);
    return 0;
}

/* y [B, N] = x [B, K] . w^T (+ bias) over w's k-pair panels, on AMX. */
static int amx_panels_bf16(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int64_t B,
                           int64_t N, int64_t K, int threads) {
    int64_t K32 = (K + 31) / 32, RB = (B + 15) / 16, pairs = (N + 2 * PANEL - 1) / (2 * PANEL);
    int own, code, team = threads > 1 && pairs >= 2 * threads ? threads : 1;
    uint16_t *xa = team_buffer((size_t)RB * K32 * 512 * sizeof(uint16_t), &own);
    ON_TEAM(code, team, xa ? amx_share(x, xa, panels, bias, y, B, N, K, id, nt) : COLORL_NO_MEMORY);
    if (own) free(xa);
    return code;
}
#endif
