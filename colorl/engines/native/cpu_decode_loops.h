/* The decode step's loops other than the products, once per storage type: cpu_decode.c includes
 * this file twice, for float32 (_f32) and bfloat16 (_bf16). The arithmetic is float32 in both;
 * ELEM is the type in memory, LOAD8/LOADW/LOAD1 widen from it (8 lanes, WIDE, one), STORE8/STOREW/STORE1 round to
 * it, and ROUND8/ROUNDW/ROUND1 round a float32 to ELEM's precision where HF's module rounds an intermediate (the
 * identity in float32); STAGE_KV: attention widens its keys and values first. Defined by the
 * includer: ELEM, SUFFIX, LOAD8/W, STORE8/W, LOAD1, STORE1, ROUND8/W, ROUND1, STAGE_KV, KPAIR_PANELS (the panels hold k
 * in pairs, packed and multiplied by cpu_decode_kpairs.h: bf16 on a CPU with AVX512-BF16), AMX_PANELS (those
 * products run on AMX tiles where granted: bf16 on a CPU with AMX). */
#define LOOP_NAME_(name, suffix) name##suffix
#define LOOP_NAME(name, suffix) LOOP_NAME_(name, suffix)
#define NAMED(name) LOOP_NAME(name, SUFFIX)

/* ---------------------------------------------------------------- norms and activations */

/* x[t] += add[t] when add is given (the residual stream, in place, rounded to ELEM), then
 * out[t] = weight * (x[t] / sqrt(mean(x[t]^2) + eps)), as HF's RMSNorm computes it: in float32,
 * rounded to ELEM before the weight's product. */
void NAMED(colorl_add_rms_norm)(ELEM *x, const ELEM *add, const ELEM *weight, ELEM *out, int64_t T, int64_t C,
                                float eps) {
    for (int64_t t = 0; t < T; t++) {
        ELEM *row = x + t * C;
#if WIDE == 16
        vwide s = {0}; /* lanes 0-7 sum values c..c+7 of each 16, lanes 8-15 c+8..c+15: the 8-lane loop's two sums */
        int64_t c = 0;
        for (; c + 16 <= C; c += 16) {
            vwide a = LOADW(row + c);
            if (add) {
                a = ROUNDW(a + LOADW(add + t * C + c));
                STOREW(row + c, a);
            }
            s += a * a;
        }
        float squares = hsum_wide(s);
#else
        v8 s0 = {0}, s1 = {0};
        int64_t c = 0;
        for (; c + 16 <= C; c += 16) {
            v8 a = LOAD8(row + c), b = LOAD8(row + c + 8);
            if (add) {
                a = ROUND8(a + LOAD8(add + t * C + c));
                b = ROUND8(b + LOAD8(add + t * C + c + 8));
                STORE8(row + c, a);
                STORE8(row + c + 8, b);
            }
            s0 += a * a;
            s1 += b * b;
        }
        float squares = hsum8(s0 + s1);
#endif
        for (; c < C; c++) {
            float v = LOAD1(row + c);
            if (add) {
                v = ROUND1(v + LOAD1(add + t * C + c));
                STORE1(row + c, v);
            }
            squares += v * v;
        }
        float inv = 1.0f / sqrtf(squares / (float)C + eps);
        ELEM *o = out + t * C;
        c = 0;
        for (; c + WIDE <= C; c += WIDE) STOREW(o + c, LOADW(weight + c) * ROUNDW(LOADW(row + c) * inv));
        for (; c + 8 <= C; c += 8) STORE8(o + c, LOAD8(weight + c) * ROUND8(LOAD8(row + c) * inv));
        for (; c < C; c++) STORE1(o + c, LOAD1(weight + c) * ROUND1(LOAD1(row + c) * inv));
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]: the gated MLP's activation (silu rounded
 * to ELEM before the product, as HF's act(gate) * up). */
void NAMED(colorl_silu_mul)(const ELEM *gate_up, ELEM *out, int64_t T, int64_t I) {
    for (int64_t t = 0; t < T; t++) {
        const ELEM *g = gate_up + t * 2 * I, *u = g + I;
        ELEM *o = out + t * I;
        int64_t i = 0;
        for (; i + WIDE <= I; i += WIDE) {
            vwide gv = LOADW(g + i);
            STOREW(o + i, ROUNDW(gv / (1.0f + exp_wide(-gv))) * LOADW(u + i));
        }
        for (; i + 8 <= I; i += 8) {
            v8 gv = LOAD8(g + i);
            STORE8(o + i, ROUND8(gv / (1.0f + exp8(-gv))) * LOAD8(u + i));
        }
        for (; i < I; i++) {
            float gi = LOAD1(g + i);
            STORE1(o + i, ROUND1(gi / (1.0f + expf(-gi))) * LOAD1(u + i));
        }
    }
}

/* ---------------------------------------------------------------- products over panels
 * y[b, n] = x[b, :] . w[n, :] (+ bias[n]) over the weights packed once per version, k-major: with AVX-512 in
 * groups of GROUP outputs ([N/GROUP, K, GROUP]), on AVX2 in panels of PANEL outputs read in pairs ([N/PANEL, K,
 * PANEL], N zero-padded to a whole pair): the layout both kinds of step read as one sequential stream per
 * group (per panel), with no horizontal sums.
 *
 * More rows than the rows kernel takes (MAX_ROWS in cpu_decode.py): a product bound by arithmetic,
 * not by the stream of weights. oneDNN reaches about a third of this CPU's matmul rate there (28
 * GFLOP/s of 76 on one Zen 3 core at 32 rows); these loops reach about 80 % (bench/README.md, issue
 * 31), in the classic way: x packed per call in tiles of rows ([K, rows], float32), and a block of sums
 * held in registers while k runs. On AVX2 a TILE x 2 PANEL block over a pair of panels, twelve registers:
 * per k, two weight vectors and six broadcasts feed twelve FMAs (fifteen registers of AVX2's sixteen: the
 * weights stay in registers; a 4 x 24 block, sixteen, made the compiler re-load them); with AVX-512 an 8 x
 * GROUP block, 24 registers (below). Each thread streams its own run of groups (pairs) once (the first tile
 * asks for them PANEL_AHEAD values ahead, as the rows kernel does); the later tiles read them again from cache.
 *
 * Up to 8 rows (a decode step's tail, where the race in cpu_decode.py picks them over the rows
 * kernel): B rows of sums in registers, per k the group's (panel's) weight vectors and B broadcasts of x
 * (packed k-major, [K, B]). The rows kernel's dot products load a whole vector of x per FMA; a broadcast is
 * a narrower load, and on AVX2 the 8-row dot-product loop also spills three of its sixteen sums:
 * over the same 85 MB on one Zen 3 core the panels read 0.82-0.85x a plain sum's rate at 8 rows,
 * the rows kernel 0.69x (bench/rows_stream.py). They ask for the stream as the rows kernel does at the
 * same rows (STREAM_AHEAD, cpu_decode.c): at 1-2 as the machine's race says. */
#define PANEL 8
#define PANEL_AHEAD 2048

/* Row b's sums for outputs n0.. (width of them, the rest padding), plus the bias, into y. */
static inline void NAMED(store_sums)(ELEM *row, v8 sums, const float *bv, int64_t width) {
    if (width == PANEL) {
        STORE8(row, sums + load8(bv));
    } else {
        float out[PANEL];
        store8(out, sums + load8(bv));
        for (int64_t j = 0; j < width; j++) STORE1(row + j, out[j]);
    }
}

static inline void NAMED(panel_bias)(const ELEM *bias, int64_t n0, int64_t width, float *bv) {
    for (int64_t j = 0; j < PANEL; j++) bv[j] = bias && j < width ? LOAD1(bias + n0 + j) : 0.0f;
}

/* The pair of panels at outputs n0..: each panel's width (0 for padding) and bias. */
static inline void NAMED(pair_bias)(const ELEM *bias, int64_t N, int64_t n0, int64_t widths[2], float bv[2][PANEL]) {
    for (int v = 0; v < 2; v++) {
        int64_t left = N - n0 - v * PANEL;
        widths[v] = left < 0 ? 0 : left < PANEL ? left : PANEL;
        NAMED(panel_bias)(bias, n0 + v * PANEL, widths[v], bv[v]);
    }
}

/* Column k of x's rows in tiles of R rows ([tiles][K][R] floats from row 0, zeros past B): what the many-rows
 * loops broadcast, one row's value at a time. */
static inline void NAMED(tile_x)(const ELEM *x, float *xp, int64_t B, int64_t K, int64_t tiles, int64_t R, int64_t k) {
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t i = 0, b = t * R; i < R; i++, b++) xp[(t * K + k) * R + i] = b < B ? LOAD1(x + b * K + k) : 0.0f;
}

/* A thread's share (id of nt) of x's tiles: one contiguous run of k's, in blocks of 16 (whole 64-byte lines of xp at
 * R = 8 or 6 rows a k). Every other k, as it was, had both threads write every line of xp, which then crossed between
 * their cores at each write: where the two cores sit on two CCDs (a cache line's round trip 370-430 ns against 80-140
 * on one), float32 steps of 32 rows took 1.47x their time on one (39.3 against 26.7 ms), and 1.2x laid out in runs
 * (bench/README.md, "Two CCDs"). A copy of x for each thread, as the bf16 k-pair loops lay out, took 1.06x as long
 * as this: float32 tiles of x are twice their bytes. */
static inline void NAMED(tile_x_share)(const ELEM *x, float *xp, int64_t B, int64_t K, int64_t tiles, int64_t R,
                                       int id, int nt) {
    int64_t blocks = (K + 15) / 16, per = (blocks + nt - 1) / nt;
    int64_t k0 = id * per * 16 < K ? id * per * 16 : K, k1 = (id + 1) * per * 16 < K ? (id + 1) * per * 16 : K;
    for (int64_t k = k0; k < k1; k++) NAMED(tile_x)(x, xp, B, K, tiles, R, k);
}

#if defined(__AVX512F__)
/* With AVX-512 the panels are groups of GROUP = 48 outputs, k-major ([N/GROUP, K, GROUP], N zero-padded to
 * whole groups): per k three 16-wide weight vectors, one after the other, and per row of x one broadcast that
 * feeds three FMAs. Up to 8 rows' sums (24 registers of 32) are held while k runs; a group streams as one
 * sequence of 192-byte rows. Pairs of 8-wide panels (16 outputs a register, as the AVX2 loops below read them)
 * loaded one vector of x per FMA's worth of weights and read 8 rows of float32 at 0.55-0.6x a plain sum's rate
 * from memory on a Zen 5 core (40 GB/s from L2, where 8 rows' FMAs alone would take 62); three pairs read as
 * three streams 36 KB apart, 0.5x; one group of 48, 0.85-0.95x, and 60 GB/s from L2 (bench/README.md, "Groups
 * of 48"). Many rows take tiles of 8 rows against a group, block of k by block (panels_many), the first tile
 * streaming it (asking PANEL_AHEAD values ahead, as the rows kernel does), the others reading it from L1. */
#define GROUP_VECS 3
#define GROUP (GROUP_VECS * 16)
#define GROUP_TILE 8 /* rows of x whose sums a group's loop holds at once */
#define ASK_KS (4 / (int)sizeof(ELEM)) /* the k's of a group in 192 bytes: its three lines a float32 k holds */

#define PACK_WIDTH GROUP /* colorl_pack_panels: outputs per unit, and units for N outputs */
#define PACK_UNITS(N) (((N) + GROUP - 1) / GROUP)

/* R rows of x (xt [K, R]) against the group at wg over k0..k1, added to the 3 x R sums in c, which stay in
 * registers where R is a constant (it is inlined). stream: ask for the group's lines ahead (the tile that reads
 * it from memory). */
static inline __attribute__((always_inline)) void NAMED(group_sums)(const float *xt, const ELEM *wg, int64_t k0,
                                                                   int64_t k1, int R, int stream, const char *ahead,
                                                                   int ahead_lines, v16 c[GROUP_TILE][GROUP_VECS]) {
    for (int64_t k = k0; k < k1; k++) {
        const ELEM *wk = wg + k * GROUP;
        for (int l = 0; l < ahead_lines; l++) __builtin_prefetch(ahead + ((k - k0) * ahead_lines + l) * 64, 0, 2);
        if (stream && k % ASK_KS == 0) { /* the 192 bytes (three lines) ahead, as the rows kernel asks at R rows */
            const char *line = (const char *)(wk + PANEL_AHEAD);
            STREAM_AHEAD(R, line);
            STREAM_AHEAD(R, line + 64);
            STREAM_AHEAD(R, line + 128);
        }
        v16 w[GROUP_VECS];
#pragma GCC unroll 3
        for (int j = 0; j < GROUP_VECS; j++) w[j] = LOADW(wk + 16 * j);
        const float *xk = xt + k * R;
#pragma GCC unroll 8
        for (int i = 0; i < R; i++)
#pragma GCC unroll 3
            for (int j = 0; j < GROUP_VECS; j++) c[i][j] += w[j] * xk[i];
    }
}

/* One row's sums for the group at outputs n0.. (those below N), plus the bias, into that row of y. */
static inline void NAMED(group_store)(const v16 sums[GROUP_VECS], ELEM *row, const ELEM *bias, int64_t N, int64_t n0) {
    for (int j = 0; j < GROUP_VECS; j++)
        for (int h = 0; h < 2; h++) {
            int64_t m = n0 + 16 * j + PANEL * h, width = N - m < PANEL ? N - m : PANEL;
            if (width <= 0) return;
            float bv[PANEL];
            NAMED(panel_bias)(bias, m, width, bv);
            NAMED(store_sums)(row + m, half16(sums[j], h), bv, width);
        }
}

/* Groups g0..g1 against B <= 8 rows of x packed k-major (xt [K, B]); B is a constant where it is inlined. */
static inline __attribute__((always_inline)) void NAMED(panel_rows)(const float *xt, const ELEM *panels,
                                                                   const ELEM *bias, ELEM *y, int64_t B, int64_t N,
                                                                   int64_t K, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        v16 c[GROUP_TILE][GROUP_VECS];
#pragma GCC unroll 8
        for (int i = 0; i < B; i++)
            for (int j = 0; j < GROUP_VECS; j++) c[i][j] = (v16){0};
        NAMED(group_sums)(xt, panels + g * K * GROUP, 0, K, B, 1, NULL, 0, c);
        for (int64_t b = 0; b < B; b++) NAMED(group_store)(c[b], y + b * N, bias, N, g * GROUP);
    }
}
#define FEW_UNITS(N) (((N) + GROUP - 1) / GROUP) /* what panel_rows' g0..g1 count: groups */
#define FEW_TEAM_OUTPUTS 128 /* outputs per thread from which a few rows' product splits (8 pairs of 16 panels held) */

/* More than 8 rows: x laid out once per call in tiles of GROUP_TILE rows ([K, 8] each, zeros past B); each
 * thread one contiguous run of groups. A group's k's are taken GROUP_KS at a time (36 KB of float32, in L1), each
 * block against every tile in turn, the first tile streaming it: the tiles' sums wait in `carried` between blocks
 * (float32, added to in the same order of k, so the bits are those of one pass). Taking the whole group per tile,
 * 110 KB from L2 after the first, ran [3072, 576] products at 32 rows at 175-190 GFLOP/s on a Zen 5 core where
 * the pairs' 16-row tiles ran at 200-207; blocks of 192 k's, 190-207. */
#define GROUP_KS 192
/* One thread's share (id of nt, cpu_decode_team.h): x laid out with the others, then its own run of groups. */
static int NAMED(panels_many_share)(const ELEM *x, float *xp, const ELEM *panels, const ELEM *bias, ELEM *y, int64_t B,
                                    int64_t N, int64_t K, int id, int nt) {
    int64_t groups = (N + GROUP - 1) / GROUP, tiles = (B + GROUP_TILE - 1) / GROUP_TILE;
    NAMED(tile_x_share)(x, xp, B, K, tiles, GROUP_TILE, id, nt);
    team_barrier(nt); /* each thread reads the whole of x */
    /* tiles 1..P each ask for a share of the next block (the next group's first at the end) into L2, L lines a k
     * (a float32 k's three lines among them) */
    int P = tiles - 1 < 3 ? (int)tiles - 1 : 3, L = P ? (3 + P - 1) / P : 0;
    v16 *carried = aligned_alloc(sizeof(v16), sizeof(v16) * tiles * GROUP_TILE * GROUP_VECS); /* [tiles][8][3] */
    if (!carried) return COLORL_NO_MEMORY;
    int64_t share = (groups + nt - 1) / nt, g0 = id * share, g1 = g0 + share < groups ? g0 + share : groups;
    for (int64_t g = g0; g < g1; g++) {
        const ELEM *wg = panels + g * K * GROUP;
        memset(carried, 0, sizeof(v16) * tiles * GROUP_TILE * GROUP_VECS);
        for (int64_t k0 = 0; k0 < K; k0 += GROUP_KS) {
            int64_t k1 = k0 + GROUP_KS < K ? k0 + GROUP_KS : K;
            const char *after = k1 < K || g + 1 < g1 ? (const char *)(wg + k1 * GROUP) : NULL;
            for (int64_t t = 0; t < tiles; t++) {
                v16 c[GROUP_TILE][GROUP_VECS], *sums = carried + t * GROUP_TILE * GROUP_VECS;
#pragma GCC unroll 8
                for (int i = 0; i < GROUP_TILE; i++)
                    for (int j = 0; j < GROUP_VECS; j++) c[i][j] = sums[i * GROUP_VECS + j];
                const float *xt = xp + t * K * GROUP_TILE;
                if (t == 0)
                    NAMED(group_sums)(xt, wg, k0, k1, GROUP_TILE, 1, NULL, 0, c);
                else if (after && t <= P)
                    NAMED(group_sums)(xt, wg, k0, k1, GROUP_TILE, 0, after + (t - 1) * (k1 - k0) * L * 64, L, c);
                else
                    NAMED(group_sums)(xt, wg, k0, k1, GROUP_TILE, 0, NULL, 0, c);
#pragma GCC unroll 8
                for (int i = 0; i < GROUP_TILE; i++)
                    for (int j = 0; j < GROUP_VECS; j++) sums[i * GROUP_VECS + j] = c[i][j];
            }
        }
        for (int64_t b = 0; b < B; b++) NAMED(group_store)(carried + b * GROUP_VECS, y + b * N, bias, N, g * GROUP);
    }
    free(carried);
    return 0;
}

static int NAMED(panels_many)(const ELEM *x, const ELEM *panels, const ELEM *bias, ELEM *y, int64_t B, int64_t N,
                              int64_t K, int threads) {
    int64_t groups = (N + GROUP - 1) / GROUP, tiles = (B + GROUP_TILE - 1) / GROUP_TILE;
    int own, code, team = threads > 1 && groups >= 2 * threads ? threads : 1;
    float *xp = team_buffer(sizeof(float) * tiles * GROUP_TILE * K, &own);
    ON_TEAM(code, team, xp ? NAMED(panels_many_share)(x, xp, panels, bias, y, B, N, K, id, nt) : COLORL_NO_MEMORY);
    if (own) free(xp);
    return code;
}
#else
/* AVX2: pairs of panels of PANEL outputs, k-major ([N/PANEL, K, PANEL], N zero-padded to a whole pair). */
#define LINE_KS (64 / (PANEL * (int)sizeof(ELEM))) /* the k's of a panel in one 64-byte line */

#define PACK_WIDTH PANEL
#define PACK_UNITS(N) (((N) + 2 * PANEL - 1) / (2 * PANEL) * 2) /* whole pairs */

#define TILE 6

/* TILE rows of x (xt [K, TILE]) against a pair of panels. fetch: ask for this pair's next lines ahead (the tile
 * that streams it); next: the following pair's panels, asked for into L2 a line at a time as this tile reads the
 * pair from cache (NULL: none). */
static inline __attribute__((always_inline)) void NAMED(panel_tile)(const float *xt, const ELEM *wa, const ELEM *wb,
                                                                   int64_t K, int fetch, const ELEM *next,
                                                                   v8 c[TILE][2]) {
    v8 c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};
    v8 c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};
    for (int64_t k = 0; k < K; k++) {
        const ELEM *ka = wa + k * PANEL, *kb = wb + k * PANEL;
        if (fetch) {
            __builtin_prefetch(ka + PANEL_AHEAD, 0, 2);
            __builtin_prefetch(kb + PANEL_AHEAD, 0, 2);
        }
        if (next && k % LINE_KS == 0) {
            __builtin_prefetch(next + k * PANEL, 0, 2);
            __builtin_prefetch(next + (K + k) * PANEL, 0, 2);
        }
        v8 w0 = LOAD8(ka), w1 = LOAD8(kb);
        const float *xk = xt + k * TILE;
        v8 a = BROADCAST8(xk[0]);
        c00 += a * w0; c01 += a * w1;
        a = BROADCAST8(xk[1]);
        c10 += a * w0; c11 += a * w1;
        a = BROADCAST8(xk[2]);
        c20 += a * w0; c21 += a * w1;
        a = BROADCAST8(xk[3]);
        c30 += a * w0; c31 += a * w1;
        a = BROADCAST8(xk[4]);
        c40 += a * w0; c41 += a * w1;
        a = BROADCAST8(xk[5]);
        c50 += a * w0; c51 += a * w1;
    }
    c[0][0] = c00; c[0][1] = c01; c[1][0] = c10; c[1][1] = c11; c[2][0] = c20; c[2][1] = c21;
    c[3][0] = c30; c[3][1] = c31; c[4][0] = c40; c[4][1] = c41; c[5][0] = c50; c[5][1] = c51;
}

/* Panels p0..p1 against B <= 8 rows of x packed k-major (xt [K, B]). B is a constant where it is
 * inlined, so the sums stay in registers. */
static inline __attribute__((always_inline)) void NAMED(panel_rows)(const float *xt, const ELEM *panels,
                                                                   const ELEM *bias, ELEM *y, int64_t B, int64_t N,
                                                                   int64_t K, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++) {
        int64_t n0 = p * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
        const ELEM *wp = panels + p * K * PANEL;
        v8 c[8] = {{0}};
        for (int64_t k = 0; k < K; k++) {
            if (!(k & 1)) STREAM_AHEAD(B, wp + k * PANEL + PANEL_AHEAD);
            v8 w = LOAD8(wp + k * PANEL);
            const float *xk = xt + k * B;
#pragma GCC unroll 8
            for (int64_t b = 0; b < B; b++) c[b] += w * BROADCAST8(xk[b]);
        }
        float bv[PANEL];
        NAMED(panel_bias)(bias, n0, width, bv);
        for (int64_t b = 0; b < B; b++) NAMED(store_sums)(y + b * N + n0, c[b], bv, width);
    }
}
#define FEW_UNITS(N) (((N) + PANEL - 1) / PANEL) /* panels */
#define FEW_TEAM_OUTPUTS 64 /* 8 panels */

/* More than 8 rows: x laid out once per call in tiles of TILE rows ([K, TILE] each, zeros past B); each thread one
 * contiguous run of pairs of panels, each pair against every tile in turn. */
/* One thread's share (id of nt, cpu_decode_team.h): x laid out with the others, then its own run of pairs. */
static int NAMED(panels_many_share)(const ELEM *x, float *xp, const ELEM *panels, const ELEM *bias, ELEM *y, int64_t B,
                                    int64_t N, int64_t K, int id, int nt) {
    int64_t pairs = (N + 2 * PANEL - 1) / (2 * PANEL), tiles = (B + TILE - 1) / TILE;
    NAMED(tile_x_share)(x, xp, B, K, tiles, TILE, id, nt);
    team_barrier(nt); /* each thread reads the whole of x */
    int64_t share = (pairs + nt - 1) / nt, q0 = id * share, q1 = q0 + share < pairs ? q0 + share : pairs;
    for (int64_t q = q0; q < q1; q++) {
        const ELEM *wa = panels + 2 * q * K * PANEL, *wb = wa + K * PANEL;
        int64_t n0 = 2 * q * PANEL, widths[2];
        float bv[2][PANEL];
        NAMED(pair_bias)(bias, N, n0, widths, bv);
        /* The first tile streams the pair, asking for it ahead; the second reads it from cache, and meanwhile
         * asks for the next pair (into L2), which the memory would otherwise idle through. */
        const ELEM *next = q + 1 < q1 ? wb + K * PANEL : NULL;
        for (int64_t t = 0; t < tiles; t++) {
            v8 c[TILE][2];
            const float *xt = xp + t * K * TILE;
            if (t == 0)
                NAMED(panel_tile)(xt, wa, wb, K, 1, NULL, c);
            else
                NAMED(panel_tile)(xt, wa, wb, K, 0, t == 1 ? next : NULL, c);
            for (int64_t i = 0, b = t * TILE; i < TILE && b < B; i++, b++)
                for (int v = 0; v < 2; v++)
                    if (widths[v]) NAMED(store_sums)(y + b * N + n0 + v * PANEL, c[i][v], bv[v], widths[v]);
        }
    }
    return 0;
}

static int NAMED(panels_many)(const ELEM *x, const ELEM *panels, const ELEM *bias, ELEM *y, int64_t B, int64_t N,
                              int64_t K, int threads) {
    int64_t pairs = (N + 2 * PANEL - 1) / (2 * PANEL), tiles = (B + TILE - 1) / TILE;
    int own, code, team = threads > 1 && pairs >= 2 * threads ? threads : 1;
    float *xp = team_buffer(sizeof(float) * tiles * TILE * K, &own);
    ON_TEAM(code, team, xp ? NAMED(panels_many_share)(x, xp, panels, bias, y, B, N, K, id, nt) : COLORL_NO_MEMORY);
    if (own) free(xp);
    return code;
}
#endif

/* w [N, K] into its units (groups, or panels in pairs), k-major, zeros past N; the k-pair panels where the CPU has
 * them (cpu_decode_kpairs.h). */
void NAMED(colorl_pack_panels)(const ELEM *w, ELEM *panels, int64_t N, int64_t K, int threads) {
#if KPAIR_PANELS
    kpairs_pack_bf16(w, panels, N, K, threads);
    return;
#endif
    int64_t units = PACK_UNITS(N);
#pragma omp parallel for num_threads(threads) if (threads > 1 && units > 1)
    for (int64_t u = 0; u < units; u++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < PACK_WIDTH; j++) {
                int64_t n = u * PACK_WIDTH + j;
                ELEM zero;
                memset(&zero, 0, sizeof zero);
                panels[(u * K + k) * PACK_WIDTH + j] = n < N ? w[n * K + k] : zero;
            }
}

/* One thread's share (id of nt, cpu_decode_team.h): its run of groups (panels) against x's rows in xt. */
static int NAMED(panels_few_share)(const float *xt, const ELEM *panels, const ELEM *bias, ELEM *y, int64_t B, int64_t N,
                                   int64_t K, int id, int nt) {
    int64_t count = FEW_UNITS(N), share = (count + nt - 1) / nt;
    int64_t p0 = id * share, p1 = p0 + share < count ? p0 + share : count;
    switch (B) { /* one copy of the loop per row count, its sums in registers */
    case 1: NAMED(panel_rows)(xt, panels, bias, y, 1, N, K, p0, p1); break;
    case 2: NAMED(panel_rows)(xt, panels, bias, y, 2, N, K, p0, p1); break;
    case 3: NAMED(panel_rows)(xt, panels, bias, y, 3, N, K, p0, p1); break;
    case 4: NAMED(panel_rows)(xt, panels, bias, y, 4, N, K, p0, p1); break;
    case 5: NAMED(panel_rows)(xt, panels, bias, y, 5, N, K, p0, p1); break;
    case 6: NAMED(panel_rows)(xt, panels, bias, y, 6, N, K, p0, p1); break;
    case 7: NAMED(panel_rows)(xt, panels, bias, y, 7, N, K, p0, p1); break;
    default: NAMED(panel_rows)(xt, panels, bias, y, 8, N, K, p0, p1); break;
    }
    return 0;
}

/* Up to 8 rows: each thread one contiguous run of groups (of panels on AVX2), split among the threads when each
 * gets FEW_TEAM_OUTPUTS outputs or more (counted in outputs: a [576, K] matrix is 12 groups and 36 pairs). x is laid
 * out k-major by the calling thread (inside a step, by each thread for itself: a few KB). */
static int NAMED(panels_few)(const ELEM *x, const ELEM *panels, const ELEM *bias, ELEM *y, int64_t B, int64_t N,
                             int64_t K, int threads) {
    float *xt = malloc(sizeof(float) * K * B);
    for (int64_t k = 0; xt && k < K; k++) NAMED(tile_x)(x, xt, B, K, 1, B, k); /* one tile of all B rows: [K, B] */
    int code, team = threads > 1 && N >= FEW_TEAM_OUTPUTS * threads ? threads : 1;
    ON_TEAM(code, team, xt ? NAMED(panels_few_share)(xt, panels, bias, y, B, N, K, id, nt) : COLORL_NO_MEMORY);
    free(xt);
    return code;
}

/* y [B, N] = x [B, K] . w [N, K]^T (+ bias), w given as its panels (colorl_pack_panels). */
int NAMED(colorl_panels)(const ELEM *x, const ELEM *panels, const ELEM *bias, ELEM *y, int64_t B, int64_t N,
                         int64_t K, int threads) {
    if (B < 1) return COLORL_BAD_ROWS;
#if AMX_PANELS
    if (amx_on && B >= AMX_MIN_ROWS) return amx_panels_bf16(x, panels, bias, y, B, N, K, threads); /* cpu_decode_kpairs.h */
#endif
#if KPAIR_PANELS
    return kpairs_fma_bf16(x, panels, bias, y, B, N, K, threads);
#endif
    if (B <= 8) return NAMED(panels_few)(x, panels, bias, y, B, N, K, threads);
    return NAMED(panels_many)(x, panels, bias, y, B, N, K, threads);
}

/* ---------------------------------------------------------------- RoPE and the KV write
 * qkv: [T, (H + 2 Hkv) * D] rows of the fused projection. Rotates q and k in place (HF's
 * rotate_half layout: pairs (i, i + D/2)) with the float32 cos/sin tables [P, D] at each token's
 * position (rounded to ELEM, as HF casts them), then writes k and v to cache[slot]
 * ([slots, 2, Hkv, D]). rope_write_heads does one token's KV heads [h0, h1) and their query heads: this entry runs
 * every row's whole, in turn; in the whole-layer call each attention task does its own heads first
 * (paged_decode_share). Both check every slot and position first. */
static inline void NAMED(rope_write_heads)(ELEM *qkv, int64_t t, int64_t H, int64_t Hkv, int64_t D, const float *cos,
                                           const float *sin, const int64_t *positions, const int64_t *slots,
                                           ELEM *cache, int64_t h0, int64_t h1) {
    int64_t width = (H + 2 * Hkv) * D, half = D / 2, group = H / Hkv;
    ELEM *row = qkv + t * width, *written = cache + slots[t] * 2 * Hkv * D;
    const float *c = cos + positions[t] * D, *s = sin + positions[t] * D;
    for (int64_t part = 0; part < 2; part++) /* the query heads of KV heads [h0, h1), then those KV heads' keys */
        for (int64_t h = part ? H + h0 : h0 * group; h < (part ? H + h1 : h1 * group); h++) {
            ELEM *v = row + h * D;
            for (int64_t i = 0; i < half; i++) {
                float a = LOAD1(v + i), b = LOAD1(v + i + half);
                STORE1(v + i, a * ROUND1(c[i]) - b * ROUND1(s[i]));
                STORE1(v + i + half, b * ROUND1(c[i + half]) + a * ROUND1(s[i + half]));
            }
        }
    memcpy(written + h0 * D, row + (H + h0) * D, (h1 - h0) * D * sizeof(ELEM));                     /* keys */
    memcpy(written + (Hkv + h0) * D, row + (H + Hkv + h0) * D, (h1 - h0) * D * sizeof(ELEM)); /* values */
}

int NAMED(colorl_rope_write_kv)(ELEM *qkv, int64_t T, int64_t H, int64_t Hkv, int64_t D, const float *cos,
                                const float *sin, const int64_t *positions, const int64_t *slots, ELEM *cache,
                                int64_t num_slots, int64_t num_positions) {
    if (check_writes(slots, positions, T, num_slots, num_positions)) return COLORL_OUT_OF_RANGE;
    for (int64_t t = 0; t < T; t++)
        NAMED(rope_write_heads)(qkv, t, H, Hkv, D, cos, sin, positions, slots, cache, 0, Hkv);
    return 0;
}

/* ---------------------------------------------------------------- paged decode attention
 * decode_one (cpu_decode.c) over the block table: one task per (sequence, KV head) in float32.
 * In bf16 one task per sequence widens its context's keys to float32 a few positions at a time, every
 * head at once, into a buffer that stays in L1 (STAGE_BYTES), and runs each KV head's scores over it
 * (head_scores); then the softmax; then the values the same way (head_values). Each run of positions adds
 * to the sums the run before left, so the bits are decode_one's over a whole widened copy, as before; that
 * copy went to L2 and back (at 32 sequences of bf16 on the AMX Xeon its widening took 2.4 ms of a step's
 * 5.5 ms of attention, 1.3 ms of them with the keys and values already in cache). Widening inside the
 * loops, per head from a strided read, made bf16 attention 1.5x slower than float32 for half the bytes.
 * With fewer sequences than threads (a batch-1 step) each task takes a share of the KV heads instead,
 * widening only theirs, so that no thread waits through the whole attention.
 * Where the CPU multiplies bf16 pairs (AVX512-BF16, KPAIR_PANELS) and D is a multiple of 32, the scores read the
 * keys in place instead, VDPBF16PS on the bf16 query and key as they are (kpairs_scores_bf16, cpu_decode_kpairs.h):
 * no widened copy of the keys and half the instructions; on a Zen 5 core 0.76-0.84x the attention's time at one
 * thread from 8 sequences on, 0.85-0.94x at two (bench/README.md, "bf16 keys in place"). The values stay widened:
 * their weights are float32. */
/* count values of ELEM as float32 (bf16 attention's staging, the logits). */
static void NAMED(widen)(const ELEM *from, float *to, int64_t count) {
    int64_t i = 0;
    for (; i + WIDE <= count; i += WIDE) store_wide(to + i, LOADW(from + i));
    for (; i + 8 <= count; i += 8) store8(to + i, LOAD8(from + i));
    for (; i < count; i++) to[i] = LOAD1(from + i);
}

#if STAGE_KV
#define STAGE_BYTES 16384 /* of widened keys or values at a time: a third of a 48 KB L1, half of a 32 KB one */
#define ONE_RUN (INT64_C(1) << 40) /* the block size that makes a staged run one block (a shift, not a division) */

/* KV heads [h0, h1) of one sequence: the outputs of their query heads (D a constant where it is inlined). */
static inline __attribute__((always_inline)) int
NAMED(decode_runs)(const ELEM *q, const ELEM *cache, const int64_t *table, int64_t length, ELEM *out, int64_t H,
                   int64_t Hkv, const int64_t D, int64_t block_size, float scale, int64_t h0, int64_t h1) {
    int64_t stride = 2 * Hkv * D, group = H / Hkv, width = (h1 - h0) * D; /* a staged position: the task's heads */
    int64_t run = STAGE_BYTES / (int64_t)sizeof(float) / width / 8 * 8; /* positions: a multiple of 8 (head_scores) */
    run = run < 8 ? 8 : run;
    float *scores = thread_scratch((h1 - h0) * group * length + run * width + 2 * H * D);
    if (!scores) return COLORL_NO_MEMORY;
    float *staged = scores + (h1 - h0) * group * length, *qf = staged + run * width, *of = qf + H * D;
    const int64_t one_block = 0;
    const int keys_in_place = KPAIR_PANELS && D % 32 == 0;
    if (!keys_in_place) NAMED(widen)(q + h0 * group * D, qf + h0 * group * D, (h1 - h0) * group * D);
    for (int part = 0; part < 2; part++) { /* the keys, then the values */
        int staged_part = !(part == 0 && keys_in_place); /* otherwise the keys are read in place */
#if KPAIR_PANELS
        if (!staged_part) kpairs_scores_bf16(q, cache, table, length, block_size, Hkv, h0, h1, D, group, scale, scores);
#endif
        for (int64_t from = 0; staged_part && from < length; from += run) {
            int64_t count = length - from < run ? length - from : run;
            for (int64_t t = 0; t < count; t++) {
                int64_t p = from + t;
                if (p + KV_ROWS_AHEAD < length)
                    ask_for_bytes(KV_ROW(cache, table, block_size, stride, p + KV_ROWS_AHEAD) + part * Hkv * D + h0 * D,
                                  width * (int64_t)sizeof(ELEM));
                NAMED(widen)(KV_ROW(cache, table, block_size, stride, p) + part * Hkv * D + h0 * D, staged + t * width,
                             width);
            }
            for (int64_t kvh = h0; kvh < h1; kvh++) {
                float *rows = scores + (kvh - h0) * group * length + from;
                if (part == 0)
                    head_scores(qf + kvh * group * D, staged, &one_block, ONE_RUN, width, kvh - h0, D, group, count,
                                scale, rows, length, 0);
                else
                    head_values(rows, length, staged, &one_block, ONE_RUN, width, 0, kvh - h0, D, group, count,
                                of + kvh * group * D, from > 0, 0);
            }
        }
        if (part == 0) softmax_rows(scores, (h1 - h0) * group, length);
    }
    int64_t i = h0 * group * D, end = h1 * group * D;
    for (; i + 8 <= end; i += 8) STORE8(out + i, load8(of + i));
    for (; i < end; i++) STORE1(out + i, of[i]);
    return 0;
}

static int NAMED(decode_sequence)(const ELEM *q, const ELEM *cache, const int64_t *table, int64_t length, ELEM *out,
                                  int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t h0,
                                  int64_t h1) {
    if (D == 64) return NAMED(decode_runs)(q, cache, table, length, out, H, Hkv, 64, block_size, scale, h0, h1);
    if (D == 128) return NAMED(decode_runs)(q, cache, table, length, out, H, Hkv, 128, block_size, scale, h0, h1);
    return NAMED(decode_runs)(q, cache, table, length, out, H, Hkv, D, block_size, scale, h0, h1);
}
#endif

/* One thread's share (id of nt, cpu_decode_team.h) of colorl_paged_decode: the tasks it claims in turn from
 * *claimed (schedule(dynamic, 1): sequences' contexts differ in length). In bf16 a task is a sequence, or, with fewer
 * sequences than `threads`, a share of its KV heads (shares of them); in float32 a (sequence, KV head). With `rope`
 * (a whole layer's step, q its fused projection's rows) a task first rotates its own query and KV heads and writes its
 * KV heads' keys and values (rope_write_heads): no other task reads them, so RoPE needs no loop and no barrier of its
 * own, and each value is computed as colorl_rope_write_kv computes it. */
static int NAMED(paged_decode_share)(ELEM *q, int64_t q_stride, ELEM *cache, const int64_t *tables, int64_t width,
                                     const int64_t *lengths, ELEM *out, int64_t S, int64_t H, int64_t Hkv, int64_t D,
                                     int64_t block_size, float scale, int64_t shares, int64_t *claimed, int nt,
                                     const decode_step_t *rope) {
    int64_t tasks = S * shares, row_bytes = 2 * Hkv * D * (int64_t)sizeof(ELEM);
    int code = 0;
    for (int64_t task = team_claim(claimed); task < tasks; task = team_claim(claimed)) {
        int64_t s = task / shares, share = task % shares;
#if STAGE_KV
        int64_t h0 = share * Hkv / shares, h1 = (share + 1) * Hkv / shares;
#else
        int64_t h0 = share, h1 = share + 1;
#endif
        if (rope)
            NAMED(rope_write_heads)(q, s, H, Hkv, D, rope->cos, rope->sin, rope->positions, rope->slots, cache, h0, h1);
        ask_for_sequences(cache, tables, width, lengths, block_size, row_bytes, task, tasks, shares, nt);
#if STAGE_KV
        int failed = NAMED(decode_sequence)(q + s * q_stride, cache, tables + s * width, lengths[s], out + s * H * D, H,
                                            Hkv, D, block_size, scale, h0, h1);
#else
        int failed = decode_head(q + s * q_stride, cache, tables + s * width, lengths[s], out + s * H * D, H, Hkv, D,
                                 block_size, scale, h0);
#endif
        code = code ? code : failed;
    }
    return code;
}

/* The attention's loop over S sequences, after RoPE where `rope` is given (paged_decode_share). */
static int NAMED(paged_attend)(ELEM *q, int64_t q_stride, ELEM *cache, const int64_t *tables, int64_t width,
                               const int64_t *lengths, ELEM *out, int64_t S, int64_t H, int64_t Hkv, int64_t D,
                               int64_t block_size, float scale, int threads, int64_t num_slots,
                               const decode_step_t *rope) {
    if (check_tables(tables, width, lengths, S, block_size, num_slots)) return COLORL_OUT_OF_RANGE;
    if (rope && check_writes(rope->slots, rope->positions, S, rope->num_slots, rope->num_positions))
        return COLORL_OUT_OF_RANGE;
#if STAGE_KV
    int64_t shares = S < threads ? (threads < Hkv ? threads : Hkv) : 1; /* of each sequence's KV heads */
#else
    int64_t shares = Hkv; /* a task per KV head */
#endif
    int64_t own = 0, *claimed = team_counter(&own);
    int code;
    ON_TEAM(code, threads > 1 && S * shares > 1 ? threads : 1,
            NAMED(paged_decode_share)(q, q_stride, cache, tables, width, lengths, out, S, H, Hkv, D, block_size, scale,
                                      shares, claimed, nt, rope));
    return code;
}

int NAMED(colorl_paged_decode)(const ELEM *q, int64_t q_stride, const ELEM *cache, const int64_t *tables,
                               int64_t width, const int64_t *lengths, ELEM *out, int64_t S, int64_t H, int64_t Hkv,
                               int64_t D, int64_t block_size, float scale, int threads, int64_t num_slots) {
    /* without RoPE nothing writes q or the cache */
    return NAMED(paged_attend)((ELEM *)q, q_stride, (ELEM *)cache, tables, width, lengths, out, S, H, Hkv, D,
                               block_size, scale, threads, num_slots, NULL);
}

/* ---------------------------------------------------------------- a whole decoder layer
 * One layer of a decode step over T sequences, one new token each, in one call: the same
 * loops, in the same order, as the model's per-operation path (model.py), without the Python and
 * the ctypes calls between them (nine per layer, 1.5-3.6 us each: a few % of a step).
 * x: the residual stream [T, C], updated in place; delta: the previous layer's MLP output (NULL
 * for the first layer); out: this layer's MLP output [T, C]; scratch: T * (2 C + (H + 2 Hkv) D +
 * H D + 3 I) values. Its products run over the layer's panels where given (colorl_pack_panels;
 * required above 8 rows), else the rows kernel. Returns 0, or the first error of its loops (COLORL_*: rows, memory, an index out of
 * range), which it never computes past. */
static int NAMED(product)(const ELEM *x, const ELEM *w, const ELEM *panels, const ELEM *bias, ELEM *y, int64_t T,
                          int64_t N, int64_t K, int threads) {
    if (T <= 8 && !panels) return NAMED(colorl_linear)(x, w, bias, y, T, N, K, threads);
    if (!panels) return COLORL_BAD_ROWS;
    return NAMED(colorl_panels)(x, panels, bias, y, T, N, K, threads);
}

/* The norms, the SiLU and the logits' widening work row by row: inside the step's team (cpu_decode_team.h) the rows
 * are split among its threads from two rows on (a layer's norms of up to OWN_NORM_ROWS rows instead run whole on
 * every thread, with no barrier: norm_rows), which otherwise wait at the next
 * product's barrier while one thread runs them (at 32 rows of bf16 on the AMX Xeon, 13 % of a step's time:
 * bench/README.md, "Where a batch of 32 spends its step"); with a team forked per loop (colorl_one_team(0)), from
 * SPLIT_ROWS rows on. Each row's loop is the one the per-operation path runs, so the bits are the same.
 * result = `row` (a statement of t) for every row t < T. */
#define SPLIT_ROWS 16
#define EACH_ROW(result, T, threads, row)                                                                         \
    ON_TEAM(result, (threads) > 1 && (T) >= (step_team ? 2 : SPLIT_ROWS) ? (threads) : 1,                        \
            ({ for (int64_t t = id; t < (T); t += nt) row; 0; }))

static int NAMED(split_norm)(ELEM *x, const ELEM *add, const ELEM *weight, ELEM *out, int64_t T, int64_t C, float eps,
                             int threads) {
    int code;
    EACH_ROW(code, T, threads, NAMED(colorl_add_rms_norm)(x + t * C, add ? add + t * C : NULL, weight, out + t * C, 1, C, eps));
    return code;
}

/* Up to this many rows, on a step's team of two or more threads, each thread runs a layer's two norms over every row
 * for itself (norm_rows), so that the next product's x needs no barrier: a few us of arithmetic a norm, against a
 * barrier whose wait (a line's round trip per thread, and the threads' spread) a step pays about 300 times. */
#define OWN_NORM_ROWS 8

static inline int NAMED(own_norms)(const decode_step_t *s) {
    return step_team && omp_get_num_threads() > 1 && s->tokens <= OWN_NORM_ROWS;
}

/* The step's own bytes (team_layer) for own_norms: the stream's second copy [T, C], then each thread's normed rows
 * [T, C] and a row [C], each at a 64-byte boundary; none for more rows. */
static size_t NAMED(own_rows_bytes)(const decode_step_t *s) {
    return ((size_t)(s->tokens + 1) * (size_t)s->hidden * sizeof(ELEM) + 63) / 64 * 64;
}
static size_t NAMED(layer_bytes)(const decode_step_t *s) {
    return s->tokens <= OWN_NORM_ROWS ? NAMED(own_rows_bytes)(s) * (size_t)(s->threads + 1) : 0;
}

/* Each row's add and norm, on this thread for itself, no barrier: the normed rows into h (this thread's own: the next
 * product's x), the stream's new rows into stream_out, which no thread reads in this loop (not x: another thread may
 * still read x's row), each row written by one thread. Per row the same colorl_add_rms_norm as split_norm, so the
 * same bits. */
static void NAMED(norm_rows)(const ELEM *x, const ELEM *add, const ELEM *weight, ELEM *h, ELEM *stream_out, int64_t T,
                             int64_t C, float eps) {
    int id = omp_get_thread_num(), nt = omp_get_num_threads();
    ELEM *row = h + T * C;
    for (int64_t t = 0; t < T; t++) {
        memcpy(row, x + t * C, sizeof(ELEM) * C);
        NAMED(colorl_add_rms_norm)(row, add ? add + t * C : NULL, weight, h + t * C, 1, C, eps);
        if (t % nt == id) memcpy(stream_out + t * C, row, sizeof(ELEM) * C);
    }
}

/* One layer, on the step's team. With own_norms the stream goes from x to the step's second copy at the first norm
 * and back at the second, and each product reads its own thread's normed rows. */
static int NAMED(decode_layer)(ELEM *x, const ELEM *delta, ELEM *out, ELEM *scratch, const decode_layer_t *l,
                               const decode_step_t *s) {
    int64_t T = s->tokens, C = s->hidden, H = s->heads, Hkv = s->kv_heads, D = s->head_dim, I = s->intermediate;
    int64_t width = (H + 2 * Hkv) * D;
    ELEM *h = scratch, *qkv = h + T * C, *attn = qkv + T * width, *gate_up = attn + T * H * D, *act = gate_up + T * 2 * I,
         *o = act + T * I;
    int code, own = NAMED(own_norms)(s);
    ELEM *second = x;
    if (own) {
        size_t bytes = NAMED(own_rows_bytes)(s);
        second = team_layer();
        h = (ELEM *)((char *)second + bytes * (size_t)(1 + omp_get_thread_num()));
        NAMED(norm_rows)(x, delta, l->input_norm, h, second, T, C, s->eps);
    } else if ((code = NAMED(split_norm)(x, delta, l->input_norm, h, T, C, s->eps, s->threads))) {
        return code;
    }
    if ((code = NAMED(product)(h, l->w_qkv, l->p_qkv, l->b_qkv, qkv, T, width, C, s->threads))) return code;
    if ((code = NAMED(paged_attend)(qkv, width, l->cache, s->tables, s->width, s->lengths, attn, T, H, Hkv, D,
                                    s->block_size, s->scale, s->threads, s->num_slots, s)))
        return code;
    if ((code = NAMED(product)(attn, l->w_o, l->p_o, l->b_o, o, T, C, H * D, s->threads))) return code;
    if (own)
        NAMED(norm_rows)(second, o, l->post_norm, h, x, T, C, s->eps);
    else if ((code = NAMED(split_norm)(x, o, l->post_norm, h, T, C, s->eps, s->threads)))
        return code;
    if ((code = NAMED(product)(h, l->w_gate_up, l->p_gate_up, l->b_gate_up, gate_up, T, 2 * I, C, s->threads)))
        return code;
    EACH_ROW(code, T, s->threads, NAMED(colorl_silu_mul)(gate_up + t * 2 * I, act + t * I, 1, I));
    if (code) return code;
    return NAMED(product)(act, l->w_down, l->p_down, l->b_down, out, T, C, I, s->threads);
}

/* The bytes the step's products share for their x (team_buffer): the most any product's layout takes, from T rows
 * rounded up to a whole tile (16 at most) over its widest K rounded up to a whole k-block (32). */
static size_t NAMED(step_bytes)(const decode_step_t *s) {
    int64_t K = s->hidden, attention = s->heads * s->head_dim;
    K = attention > K ? attention : K;
    K = s->intermediate > K ? s->intermediate : K;
    return (size_t)(s->tokens + 16) * (size_t)(K + 32) * sizeof(float) * (size_t)s->threads;
}

/* Every layer of a decode step, in order, on the step's team. Each layer takes the previous one's MLP output as its
 * delta (none for the first); out receives the last one's. scratch: 2 T C values for the layers' outputs, in turn,
 * then one layer's scratch. */
static int NAMED(decode_layers)(ELEM *x, ELEM *out, ELEM *scratch, const decode_layer_t *layers, int64_t count,
                                const decode_step_t *s) {
    int64_t size = s->tokens * s->hidden;
    const ELEM *delta = NULL;
    for (int64_t i = 0; i < count; i++) {
        ELEM *mlp = i == count - 1 ? out : scratch + (i % 2) * size;
        int code = NAMED(decode_layer)(x, delta, mlp, scratch + 2 * size, &layers[i], s);
        if (code) return code;
        delta = mlp;
    }
    return 0;
}

/* Every layer of a decode step in one call (a call per layer cost 30-50 us of Python and ctypes each: 2-3 % of a
 * batch-1 step of a 135M model), on one team of threads (cpu_decode_team.h). */
int NAMED(colorl_decode_layers)(ELEM *x, ELEM *out, ELEM *scratch, const decode_layer_t *layers, int64_t count,
                                const decode_step_t *s) {
    int code;
    STEP_TEAM(code, s->threads, NAMED(step_bytes)(s), NAMED(layer_bytes)(s),
              NAMED(decode_layers)(x, out, scratch, layers, count, s));
    return code;
}

/* The layers, then the last MLP output added to the stream, the final norm and the head's product as the model's
 * per-operation path runs them (the same loops, so the same bits), the head's ELEM outputs widened to float32
 * logits [T, V] (the per-operation path's `.float()`), on the step's team. */
static int NAMED(decode_logits)(ELEM *x, ELEM *out, ELEM *scratch, const decode_layer_t *layers, int64_t count,
                                const decode_step_t *s, const decode_head_t *head, float *logits) {
    int code = NAMED(decode_layers)(x, out, scratch, layers, count, s);
    if (code) return code;
    int64_t T = s->tokens, C = s->hidden, V = head->vocab, H = s->heads, D = s->head_dim;
    ELEM *h = scratch + T * (4 * C + (H + 2 * s->kv_heads) * D + H * D + 3 * s->intermediate);
    ELEM *y = sizeof(ELEM) == sizeof(float) ? (ELEM *)logits : h + T * C; /* float32: the head writes the logits */
    if ((code = NAMED(split_norm)(x, out, head->norm, h, T, C, s->eps, s->threads))) return code;
    if ((code = NAMED(product)(h, head->w, head->p, NULL, y, T, V, C, s->threads))) return code;
    if ((void *)y != (void *)logits) EACH_ROW(code, T, s->threads, NAMED(widen)(y + t * V, logits + t * V, V));
    return code;
}

/* A decode step whose every token samples, its layers and its logits in one call. Done in Python, the logits' steps
 * cost a few tensors and calls a step (0.1-0.3 ms, with cold caches after the weights' stream). x: the stream,
 * updated in place; out: the last layer's MLP output; scratch: colorl_decode_layers' values, then T C for the
 * norm's output and, but in float32, T V for the head's. */
int NAMED(colorl_decode_logits)(ELEM *x, ELEM *out, ELEM *scratch, const decode_layer_t *layers, int64_t count,
                                const decode_step_t *s, const decode_head_t *head, float *logits) {
    int code;
    STEP_TEAM(code, s->threads, NAMED(step_bytes)(s), NAMED(layer_bytes)(s),
              NAMED(decode_logits)(x, out, scratch, layers, count, s, head, logits));
    return code;
}

/* The steps of colorl_decode_burst, on the step's team; moved: the positions, then the context lengths, of its
 * rows, which it moves on a step at a time. */
static int NAMED(decode_burst)(ELEM *x, ELEM *out, ELEM *scratch, const decode_layer_t *layers, int64_t count,
                               const decode_step_t *s, const decode_head_t *head, float *logits, const ELEM *embed,
                               const float *temperatures, int64_t steps, const int64_t *slots, const double *u,
                               const int64_t *stops, const int64_t *offsets, int64_t *tokens, float *logps,
                               int64_t *done, int64_t *moved) {
    int64_t T = s->tokens, C = s->hidden, V = head->vocab;
    decode_step_t step = *s;
    step.positions = moved;
    step.lengths = moved + T;
    int code = 0, stopped = 0;
    for (int64_t j = 0; j < steps && !code && !stopped; j++) {
        if (j > 0) {
            EACH_ROW(code, T, s->threads, {
                memcpy(x + t * C, embed + tokens[(j - 1) * T + t] * C, sizeof(ELEM) * C);
                moved[t]++;
                moved[T + t]++;
            });
            if (code) break;
        }
        step.slots = slots + j * T;
        if ((code = NAMED(decode_logits)(x, out, scratch, layers, count, &step, head, logits))) break;
        EACH_ROW(code, T, s->threads, {
            if (temperatures[t] != 1.0f)
                for (int64_t v = 0; v < V; v++) logits[t * V + v] /= temperatures[t];
        });
        if (code) break;
        if ((code = colorl_sample_plain(logits, T, V, u + j * T, tokens + j * T, logps + j * T, s->threads))) break;
        if (omp_get_thread_num() == 0) *done = j + 1;
        for (int64_t t = 0; t < T; t++) /* every thread reads the same tokens, and stops at the same step */
            for (int64_t i = offsets[t]; i < offsets[t + 1]; i++) stopped |= tokens[j * T + t] == stops[i];
    }
    return code;
}

/* A burst of up to `steps` decode steps of the same T sequences in one call, each sampling every sequence's next
 * token (colorl_sample_plain, at u[j * T + t]) and feeding it to the next step: its embedding row copied into the
 * stream, its position and context length one further, its K/V into slots[j * T + t]. Each step runs the loops of
 * colorl_decode_logits, then divides a row's logits by its temperature (float32, as the sampler's z / T) where that
 * is not 1. The burst ends after the first step at which a row draws one of its stop tokens (stops[offsets[t]] to
 * stops[offsets[t + 1]] for row t), so that every step runs over the rows one step per call would run: the row
 * count picks the products' loops, and with them the bits. So the tokens and log-probs are those of single steps.
 * Between single steps the engine's Python (scheduling, the step's tensors, the draws, appending the tokens) took
 * 0.45-0.75 ms while the second core idled; in bursts of 8 a bf16 step at two threads on a Zen 5 took 0.93-0.97x
 * the time. The whole burst runs on one team (cpu_decode_team.h). The caller reserved every slot. x: the first
 * step's stream; s: the first step's inputs (not changed); tokens, logps: [steps, T], of which *done steps are
 * drawn. Stops at the first error. */
int NAMED(colorl_decode_burst)(ELEM *x, ELEM *out, ELEM *scratch, const decode_layer_t *layers, int64_t count,
                               const decode_step_t *s, const decode_head_t *head, float *logits, const ELEM *embed,
                               const float *temperatures, int64_t steps, const int64_t *slots, const double *u,
                               const int64_t *stops, const int64_t *offsets, int64_t *tokens, float *logps,
                               int64_t *done) {
    int64_t T = s->tokens;
    int64_t *moved = malloc(sizeof(int64_t) * 2 * T); /* positions, then lengths */
    if (!moved) return COLORL_NO_MEMORY;
    memcpy(moved, s->positions, sizeof(int64_t) * T);
    memcpy(moved + T, s->lengths, sizeof(int64_t) * T);
    *done = 0;
    int code;
    STEP_TEAM(code, s->threads, NAMED(step_bytes)(s), NAMED(layer_bytes)(s),
              NAMED(decode_burst)(x, out, scratch, layers, count, s, head, logits, embed, temperatures, steps, slots, u,
                                  stops, offsets, tokens, logps, done, moved));
    free(moved);
    return code;
}

#undef NAMED
#undef LOOP_NAME
#undef LOOP_NAME_
