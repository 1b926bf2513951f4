/* How fast the native engine's rows kernel (colorl_linear_f32, included from the engine's own source) and its
 * panels (colorl_panels_f32 over colorl_pack_panels_f32's k-major copy) read their weights at 1, 2, 4 and 8
 * rows, against a plain sum of the same memory, from DRAM and from L2; and a probe of the rows kernel's 8-row
 * step's arithmetic without its loads of x. Driven by bench/rows_stream.py, which builds it the
 * way the engine builds its loops and prints the table; one thread, weights on huge pages where the kernel
 * gives them. Prints one JSON object. */
#include "../colorl/engines/native/cpu_decode.c"

#include <stdio.h>
#include <sys/mman.h>
#include <time.h>

enum { N = 3072, K = 576, MATRICES = 12, L2_ROWS = 96, ROUNDS = 15 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static float stream_sum(const float *w, int64_t n) {
    v8 a = {0}, b = {0}, c = {0}, d = {0};
    for (int64_t i = 0; i + 32 <= n; i += 32) {
        a += load8(w + i);
        b += load8(w + i + 8);
        c += load8(w + i + 16);
        d += load8(w + i + 24);
    }
    return hsum8((a + b) + (c + d));
}

/* The 8-row step's 16 FMAs per cache line of weights, with x held in registers instead of loaded: what the
 * stream reaches when only the weights are loaded. */
static float fmas_without_x_loads(const float *w, int64_t n) {
    v8 c[8] = {{0}}, x[8];
    for (int b = 0; b < 8; b++) x[b] = (v8){1, 1, 1, 1, 1, 1, 1, 1} * (1.0f + 0.001f * b);
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        __builtin_prefetch(w + i + PREFETCH_AHEAD, 0, 2);
        v8 w0 = load8(w + i), w1 = load8(w + i + 8);
        for (int b = 0; b < 8; b++) c[b] += w0 * x[b] + w1 * x[(b + 1) & 7];
    }
    v8 s = {0};
    for (int b = 0; b < 8; b++) s += c[b];
    return hsum8(s);
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v) {
    qsort(v, ROUNDS, sizeof *v, by_value);
    return v[ROUNDS / 2];
}

int main(void) {
    size_t per = (size_t)N * K, total = per * MATRICES, bytes = total * sizeof(float);
    float *w = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (w == MAP_FAILED) return 1;
    float *panels = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (panels == MAP_FAILED) return 1;
    madvise(w, bytes, MADV_HUGEPAGE);
    madvise(panels, bytes, MADV_HUGEPAGE);
    for (size_t i = 0; i < total; i++) w[i] = 0.001f * (float)(i % 13);
    for (int m = 0; m < MATRICES; m++) colorl_pack_panels_f32(w + m * per, panels + m * per, N, K, 1); /* N: whole pairs */
    float *x = malloc(sizeof(float) * 8 * K), *y = malloc(sizeof(float) * 8 * N);
    for (int i = 0; i < 8 * K; i++) x[i] = 0.01f * (float)(i % 7);
    const int rows[] = {1, 2, 4, 8};
    double sum_dram[ROUNDS], probe_dram[ROUNDS], dram[4][ROUNDS], l2[4][ROUNDS], panel_dram[4][ROUNDS],
        panel_l2[4][ROUNDS];
    uint16_t *w16 = mmap(NULL, bytes / 2, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (w16 == MAP_FAILED) return 1;
    madvise(w16, bytes / 2, MADV_HUGEPAGE);
    for (size_t i = 0; i < total; i++) w16[i] = float_to_bf16(w[i]);
    uint16_t *x16 = malloc(sizeof(uint16_t) * 8 * K), *y16 = malloc(sizeof(uint16_t) * 8 * N);
    for (int i = 0; i < 8 * K; i++) x16[i] = float_to_bf16(x[i]);
    uint16_t *panels16 = mmap(NULL, bytes / 2, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (panels16 == MAP_FAILED) return 1;
    madvise(panels16, bytes / 2, MADV_HUGEPAGE);
    for (int m = 0; m < MATRICES; m++) colorl_pack_panels_bf16(w16 + m * per, panels16 + m * per, N, K, 1);
    double bf16_dram[4][ROUNDS], bf16_sum[ROUNDS], bf16_panel_dram[4][ROUNDS], bf16_panel_l2[4][ROUNDS];
    volatile float sink = 0;
    for (int r = 0; r < ROUNDS; r++) {
        double t = now();
        for (int m = 0; m < MATRICES; m++) sink += stream_sum(w + m * per, per);
        sum_dram[r] = bytes / (now() - t) / 1e9;
        t = now();
        for (int m = 0; m < MATRICES; m++) sink += fmas_without_x_loads(w + m * per, per);
        probe_dram[r] = bytes / (now() - t) / 1e9;
        t = now(); /* the bf16 matrices' bytes, summed as float32 */
        sink += stream_sum((const float *)w16, total / 2);
        bf16_sum[r] = bytes / 2 / (now() - t) / 1e9;
        for (int i = 0; i < 4; i++) {
            t = now();
            for (int m = 0; m < MATRICES; m++) colorl_linear_bf16(x16, w16 + m * per, NULL, y16, rows[i], N, K, 1);
            bf16_dram[i][r] = bytes / 2 / (now() - t) / 1e9;
            t = now();
            for (int m = 0; m < MATRICES; m++) colorl_panels_bf16(x16, panels16 + m * per, NULL, y16, rows[i], N, K, 1);
            bf16_panel_dram[i][r] = bytes / 2 / (now() - t) / 1e9;
            t = now();
            for (int q = 0; q < 300; q++) colorl_panels_bf16(x16, panels16, NULL, y16, rows[i], L2_ROWS, K, 1);
            bf16_panel_l2[i][r] = 300.0 * L2_ROWS * K * sizeof(uint16_t) / (now() - t) / 1e9;
        }
        for (int i = 0; i < 4; i++) {
            t = now();
            for (int m = 0; m < MATRICES; m++) colorl_linear_f32(x, w + m * per, NULL, y, rows[i], N, K, 1);
            dram[i][r] = bytes / (now() - t) / 1e9;
            t = now(); /* a matrix of L2_ROWS rows, read again and again from L2 */
            for (int q = 0; q < 300; q++) colorl_linear_f32(x, w, NULL, y, rows[i], L2_ROWS, K, 1);
            l2[i][r] = 300.0 * L2_ROWS * K * sizeof(float) / (now() - t) / 1e9;
            t = now();
            for (int m = 0; m < MATRICES; m++) colorl_panels_f32(x, panels + m * per, NULL, y, rows[i], N, K, 1);
            panel_dram[i][r] = bytes / (now() - t) / 1e9;
            t = now();
            for (int q = 0; q < 300; q++) colorl_panels_f32(x, panels, NULL, y, rows[i], L2_ROWS, K, 1);
            panel_l2[i][r] = 300.0 * L2_ROWS * K * sizeof(float) / (now() - t) / 1e9;
        }
    }
    printf("{\"sum_gb_s\": %.2f, \"fmas_without_x_loads_gb_s\": %.2f, \"rows\": {", median(sum_dram), median(probe_dram));
    for (int i = 0; i < 4; i++)
        printf("%s\"%d\": {\"dram_gb_s\": %.2f, \"l2_gb_s\": %.2f, \"panels_dram_gb_s\": %.2f, \"panels_l2_gb_s\": %.2f}",
               i ? ", " : "", rows[i], median(dram[i]), median(l2[i]), median(panel_dram[i]), median(panel_l2[i]));
    printf("}, \"bf16_sum_gb_s\": %.2f, \"bf16_rows\": {", median(bf16_sum));
    for (int i = 0; i < 4; i++) printf("%s\"%d\": %.2f", i ? ", " : "", rows[i], median(bf16_dram[i]));
    printf("}, \"bf16_panels\": {");
    for (int i = 0; i < 4; i++)
        printf("%s\"%d\": {\"dram_gb_s\": %.2f, \"l2_gb_s\": %.2f}", i ? ", " : "", rows[i],
               median(bf16_panel_dram[i]), median(bf16_panel_l2[i]));
    printf("}}\n");
    return 0;
}
