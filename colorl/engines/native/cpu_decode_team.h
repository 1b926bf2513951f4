/* One team of threads for a whole decode step: cpu_decode.c includes this before its loops.
 *
 * Every parallel loop is written as one thread's share of it, an expression of `id` and `nt` (this thread's
 * number, and how many share the loop) that gives 0 or a COLORL_* code, and ON_TEAM runs it:
 * - called alone (the per-operation path's calls from Python, the benches), on a team of its own, forked and
 *   joined;
 * - inside a whole step's call (colorl_decode_layers, _logits and _burst open one parallel region for the whole
 *   step, STEP_TEAM), on the step's team, each thread its share, then a barrier, so that the next loop reads what
 *   this one wrote.
 *
 * Why: a step ran about 150 loops, each forked and joined, and at two threads the fork, the join and the second
 * thread's wait through the first one's serial loops cost a tenth of a step. On a Zen 5 at two threads, a bf16
 * step's products alone, one after the other, took 1.11x a plain sum of their bytes at 1 row and 1.23-1.27x at
 * 8 rows; in one region with a barrier after each, 1.02x and 1.13x (bench/README.md, "One team for a step").
 *
 * A loop that would not repay a team (`team` 1) runs on the first thread while the others go on to the barrier; one
 * that splits runs on every thread of the step's team, so its share may meet the others at a barrier of its own
 * (team_barrier) between its stages. Which thread takes which share never changes the arithmetic: every output
 * is one thread's, summed in the same order at any thread count (the tests compare the bits).
 *
 * Errors: at the barrier every thread learns the first error of that loop (team_meet), and all of them stop there
 * together: a thread that went on alone would wait at the next barrier forever. */

typedef struct {
    int64_t first;      /* the first error a share returned and the loop it came from (count of loops since the
                           step began), as loop * 256 - code (codes are small negatives), 0 until then: one word, so
                           that it is set and read without a lock */
    int64_t claimed[2]; /* tasks claimed so far (team_counter): one counter for even loops, one for odd */
    void *buffer;       /* what a loop's threads share (team_buffer), `bytes` of it, 64-byte aligned */
    size_t bytes;
    void *layer;        /* what the step's own loops keep apart from the products' (team_layer), 64-byte aligned */
} team_t;

static __thread team_t *step_team = NULL; /* the step's, while this thread runs in it */
static __thread int64_t team_loops = 0;   /* the loops this thread has finished in the step */

/* colorl_one_team(0) (COLORL_CPU_DECODE_TEAM=0 in cpu_decode.py, bench/step_team.py): a step's loops each fork and
 * join a team of their own again, as before, to compare. */
static int one_team = 1;
int colorl_one_team(int on) {
    one_team = on != 0;
    return one_team;
}

/* A fault for the tests (tests/engines/test_step_team.py): from now on the last thread of every step's team fails
 * loop `loop` of the step alone, as a share whose memory ran out would; -1, none. */
static int64_t team_fault_loop = -1;
int colorl_team_fault(int64_t loop) {
    team_fault_loop = loop;
    return 0;
}

/* A cache line's round trip between two threads of a team, in ns over `trips` trips (0 where fewer than two threads
 * run): what each barrier, and each line one thread writes and the other reads, costs. About 80-140 ns where the two
 * cores share an L3; 370-430 ns on a Zen 5 whose two vCPUs sat on two CCDs, where the read rate was 1.5x as high
 * (bench/README.md, "Two CCDs"). bench/two_ccds.py tags its rounds with it. */
double colorl_core_trip(int64_t trips) {
    int64_t flag __attribute__((aligned(64))) = 0;
    double ns = 0;
    if (omp_get_num_procs() < 2) return 0; /* two threads on one CPU would hand the line over once a time slice */
#pragma omp parallel num_threads(2)
    if (omp_get_num_threads() == 2) {
        int id = omp_get_thread_num();
#pragma omp barrier
        double started = omp_get_wtime();
        for (int64_t i = 0; i < trips; i++) {
            if (id == 0) {
                __atomic_store_n(&flag, 2 * i + 1, __ATOMIC_RELEASE);
                while (__atomic_load_n(&flag, __ATOMIC_ACQUIRE) != 2 * i + 2) __builtin_ia32_pause();
            } else {
                while (__atomic_load_n(&flag, __ATOMIC_ACQUIRE) != 2 * i + 1) __builtin_ia32_pause();
                __atomic_store_n(&flag, 2 * i + 2, __ATOMIC_RELEASE);
            }
        }
        if (id == 0) ns = (omp_get_wtime() - started) / (double)(trips > 0 ? trips : 1) * 1e9;
    }
    return ns;
}

/* After a loop on the step's team: every thread's share done, and the first error of this loop or an earlier one
 * (one that another thread met in the next loop, having left this barrier first, is that loop's). */
static int team_meet(int code) {
    team_t *team = step_team;
    int64_t loop = team_loops++;
    if (loop == team_fault_loop && omp_get_thread_num() == omp_get_num_threads() - 1) code = COLORL_NO_MEMORY;
    if (code) {
        int64_t none = 0; /* the first wins: every share of an earlier loop wrote before this loop began */
        __atomic_compare_exchange_n(&team->first, &none, loop * 256 - code, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    }
    if (omp_get_thread_num() == 0) team->claimed[(loop + 1) & 1] = 0; /* for the next loop: this one's is in use */
#pragma omp barrier
    /* a lock here, taken by every thread after every barrier, cost a cache line's trip between the cores per loop */
    int64_t first = __atomic_load_n(&team->first, __ATOMIC_RELAXED);
    return first && first / 256 <= loop ? (int)-(first % 256) : 0;
}

/* result = the first error of `share` (an expression of id and nt) run by `team` threads. Inside a step, `team` 1
 * runs it on the step's first thread and anything more on all of the step's threads. */
#define ON_TEAM(result, team, share)                                                                              \
    do {                                                                                                          \
        int team_size_ = (team);                                                                                  \
        if (step_team) {                                                                                          \
            int nt = team_size_ > 1 ? omp_get_num_threads() : 1, id = omp_get_thread_num();                      \
            (result) = team_meet(id < nt ? (share) : 0);                                                        \
        } else {                                                                                                  \
            int team_code_ = 0;                                                                                   \
            _Pragma("omp parallel num_threads(team_size_) if (team_size_ > 1)") {                                 \
                int nt = omp_get_num_threads(), id = omp_get_thread_num(), mine_ = (share);                       \
                (void)id;                                                                                         \
                if (mine_) {                                                                                      \
                    _Pragma("omp atomic write") team_code_ = mine_;                                               \
                }                                                                                                 \
            }                                                                                                     \
            (result) = team_code_;                                                                                \
        }                                                                                                         \
    } while (0)

/* Inside a share run on nt threads: wait until all of them are here (the x they lay out together, complete). */
static inline void team_barrier(int nt) {
    if (nt > 1) {
#pragma omp barrier
    }
}

/* `bytes` that a loop's threads share (x laid out for a product), 64-byte aligned: inside a step the step's buffer
 * (NULL when it is too small: STEP_TEAM sized it), else a fresh one, *own set, that the caller frees. Either way
 * the same on every thread of the loop. */
static void *team_buffer(size_t bytes, int *own) {
    *own = !step_team;
    if (step_team) return bytes <= step_team->bytes ? step_team->buffer : NULL;
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* The counter from which a loop's threads claim their tasks in turn (schedule(dynamic, 1)): inside a step the
 * step's counter for this loop, zeroed at the barrier before it; else `own`, a zero the caller's threads share. */
static inline int64_t *team_counter(int64_t *own) { return step_team ? &step_team->claimed[team_loops & 1] : own; }
static inline int64_t team_claim(int64_t *counter) { return __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED); }

/* The step's `layer` bytes (STEP_TEAM), the same on every thread of the step; NULL outside a step. */
static inline void *team_layer(void) { return step_team ? step_team->layer : NULL; }

/* result = `body` (an expression, 0 or a COLORL_* code) run on every thread of one team of `threads` for a whole step,
 * its loops on that team (ON_TEAM), sharing `shared` bytes for their x (team_buffer) and `layer` bytes for the step's
 * own loops (team_layer). Every thread leaves `body` with the same result. */
#define STEP_TEAM(result, threads, shared, layer_bytes, body)                                                     \
    do {                                                                                                          \
        team_t team_ = {0};                                                                                       \
        int step_code_ = 0, step_threads_ = (threads);                                                            \
        if (one_team) {                                                                                           \
            team_.bytes = (shared);                                                                               \
            team_.buffer = aligned_alloc(64, (team_.bytes + 63) / 64 * 64);                                      \
            team_.layer = aligned_alloc(64, ((size_t)(layer_bytes) + 63) / 64 * 64 + 64);                        \
            step_code_ = team_.buffer && team_.layer ? 0 : COLORL_NO_MEMORY;                                      \
        }                                                                                                         \
        if (!one_team) {                                                                                          \
            step_code_ = (body); /* no step team: each loop forks its own */                                      \
        } else if (team_.buffer && team_.layer) {                                                                 \
            _Pragma("omp parallel num_threads(step_threads_)") {                                                  \
                step_team = &team_;                                                                               \
                team_loops = 0;                                                                                   \
                int mine_ = (body);                                                                               \
                step_team = NULL;                                                                                 \
                if (omp_get_thread_num() == 0) step_code_ = mine_;                                                \
            }                                                                                                     \
        }                                                                                                         \
        free(team_.buffer);                                                                                       \
        free(team_.layer);                                                                                        \
        (result) = step_code_;                                                                                    \
    } while (0)
