/*
 * A decode step alternates kernel calls that stream weights from DRAM with Python that touches almost
 * no memory (norms, rope, routing, small torch ops). One core streams from DRAM at half the speed or
 * less that the same kernel reads L3 (docs/kernels.md, "Read-ahead into the caches"), and the caches on
 * these hosts are large (hundreds of MB of L3), so the helper thread, idle during the Python stretches,
 * reads the next layer's weights (the engine says which) into the caches: the kernel then finds them
 * there. The bytes read from DRAM are the same; they move off the critical path.
 *
 * A request replaces the previous one (the engine asks for the next layer's weights once per layer:
 * an older request is about a layer already past). The helper reads one step at a time under `lock`,
 * so once read_ahead_request has swapped the lists no older range is touched again.
 */
#include "read_ahead.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#define READ_AHEAD_STEP_BYTES (16 * 1024) /* between two looks at the kernel's ticket: a few microseconds */
#define LINE 64

typedef struct {
    const uint8_t *start;
    size_t length;
} Range;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static Range *ranges = NULL;
static int n_ranges = 0, current = 0;
static size_t offset = 0; /* within ranges[current] */
static int pending = 0;   /* ranges left: read without the lock by the helper's poll */
static int requesting = 0; /* callers inside read_ahead_request: the helper steps aside (see read_ahead_step) */
static volatile uint8_t sink;
static uint64_t bytes_read = 0; /* ever, for tests and stats */

int read_ahead_request(const void *const *starts, const size_t *lengths, int n) {
    Range *fresh = NULL;
    int ok = 1;
    if (n > 0 && (fresh = malloc(sizeof(Range) * (size_t)n)) == NULL) ok = 0, n = 0;
    for (int i = 0; i < n; i++) fresh[i] = (Range){(const uint8_t *)starts[i], lengths[i]};
    __atomic_add_fetch(&requesting, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&lock);
    free(ranges);
    ranges = fresh, n_ranges = n, current = 0, offset = 0;
    __atomic_store_n(&pending, n > 0, __ATOMIC_SEQ_CST); /* seq_cst: split.c wake_helper */
    pthread_mutex_unlock(&lock);
    __atomic_sub_fetch(&requesting, 1, __ATOMIC_SEQ_CST);
    return ok ? 0 : -1;
}

int read_ahead_pending(void) { return __atomic_load_n(&pending, __ATOMIC_SEQ_CST); }

/* One load per cache line: the hardware brings the line into this core's L2, and from there into the
 * shared L3 when L2 evicts it. Loads (not prefetch hints) so that none is dropped. */
static uint8_t touch(const uint8_t *p, size_t n) {
    uint8_t x = 0;
    for (size_t i = 0; i < n; i += LINE) x ^= p[i];
    return n ? (uint8_t)(x ^ p[n - 1]) : x;
}

int read_ahead_step(void) {
    if (!read_ahead_pending()) return 0;
    /* The helper calls this back to back, and a mutex is not fair: re-taking it at once after each
     * step, the helper kept the caller's read_ahead_request waiting (docs/benchmarks-log.md, "Figures behind the
     * code"). While a request waits, a step reads nothing and says "more to do". */
    if (__atomic_load_n(&requesting, __ATOMIC_SEQ_CST)) return 1;
    pthread_mutex_lock(&lock);
    size_t budget = READ_AHEAD_STEP_BYTES;
    while (budget > 0 && current < n_ranges) {
        Range r = ranges[current];
        size_t n = r.length - offset < budget ? r.length - offset : budget;
        sink ^= touch(r.start + offset, n);
        offset += n, budget -= n;
        __atomic_add_fetch(&bytes_read, n, __ATOMIC_RELAXED);
        if (offset == r.length) current++, offset = 0;
    }
    int left = current < n_ranges;
    __atomic_store_n(&pending, left, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&lock);
    return left;
}

uint64_t read_ahead_bytes_read(void) { return __atomic_load_n(&bytes_read, __ATOMIC_RELAXED); }

void read_ahead_after_fork(void) {
    pthread_mutex_init(&lock, NULL);
    ranges = NULL; /* the parent's list: not ours to free */
    n_ranges = current = 0, offset = 0, pending = 0, requesting = 0;
}
