/*
 * One persistent helper thread shares each call's blocks with the caller. Both take blocks from one
 * atomic ticket (job generation, block count, the next block of each half) by compare-and-swap, so the
 * helper can never take a block of a finished job: a ticket of another generation fails its swap.
 *
 * The caller takes the first half's blocks in order, the helper the second half's, and whichever is done
 * first goes on with the other's, from where the other is: each thread reads one contiguous range of a
 * matrix, one stream the hardware prefetchers follow (blocks taken by turns restart every thread's stream
 * at every block: docs/kernels.md, "The interleaved layout"), and a helper that never starts still costs
 * the caller nothing but the blocks it then takes itself.
 *
 * Wake-ups cost more than a small call's work (a condition variable's wake-up beside an expert
 * matrix's time: docs/benchmarks-log.md, "Figures behind the code"), so after a job the helper spins for a
 * while (SPIN_NS, yielding the CPU between polls) before it sleeps: during a forward pass the next call
 * comes sooner than that and finds it awake. The caller, once no block is left, waits only for a block
 * the helper is inside.
 */
#include "split.h"
#include "read_ahead.h"

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

#define SPIN_NS 300000L /* how long an idle helper polls before it sleeps */

/* ticket bits: generation 10 | blocks 18 | next block of the first half 18 | of the second half 18. A
 * generation that wraps is harmless: a helper that slept through 1023 jobs skips one (the caller takes
 * its blocks), and a swap of a whole ticket equal to the current one takes the current job's block. */
#define FIELD_BITS 18
#define FIELD_MASK ((1ull << FIELD_BITS) - 1)
#define GENERATION_MASK ((1ull << (64 - 3 * FIELD_BITS)) - 1)
static inline uint64_t ticket_of(uint64_t gen, uint64_t n, uint64_t front, uint64_t back) {
    return (gen << (3 * FIELD_BITS)) | (n << (2 * FIELD_BITS)) | (front << FIELD_BITS) | back;
}
static inline uint64_t generation(uint64_t t) { return t >> (3 * FIELD_BITS); }
static inline int blocks_of(uint64_t t) { return (int)((t >> (2 * FIELD_BITS)) & FIELD_MASK); }
static inline int front_of(uint64_t t) { return (int)((t >> FIELD_BITS) & FIELD_MASK); }
static inline int back_of(uint64_t t) { return (int)(t & FIELD_MASK); }
static inline int middle_of(int n) { return (n + 1) / 2; } /* the first block of the second half */
static inline int blocks_left(uint64_t t) {
    return front_of(t) < middle_of(blocks_of(t)) || back_of(t) < blocks_of(t);
}

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;           /* guards the helper's sleep */
static pthread_cond_t work_ready = PTHREAD_COND_INITIALIZER;
static uint64_t ticket = 0;
static split_block_fn job_fn;
static void *job_arg;
static int helper_inside = 0;   /* the helper is running a block */
static int helper_sleeping = 0; /* the helper waits on work_ready */
static int helper_state = 0;    /* 0 not started, 1 running, -1 could not start */
static pthread_t helper_id;
static clockid_t helper_clock; /* the helper's CPU-time clock (join_helper) */
static int helper_clock_ok = 0;

/* Tests (split_give_load): the load signals below given instead of measured, so that a verdict does not
 * depend on how busy the test machine is. given_share >= 0: the share of wall time the helper runs (per
 * mille; the caller then runs all of it) in place of their CPU clocks; given_yield_lost >= 0: whether a yield
 * in a join lost the caller's core; given_solo_ns > 0: a solo period's first length (the longest 32 times it)
 * and the time within which two lost yields are a verdict (STRIKES_NS). */
static int given_share = -1; /* per mille */
static int given_yield_lost = -1;
static int64_t given_solo_ns = 0;

/* Takes the next block of generation gen, from the caller's half first (helper 0) or the helper's (1), then
 * from the other's; -1 when none is left (or the job is another one). */
static int take_block(uint64_t gen, int helper) {
    uint64_t t = __atomic_load_n(&ticket, __ATOMIC_SEQ_CST);
    while (generation(t) == gen && blocks_left(t)) {
        int n = blocks_of(t), own_front = front_of(t) < middle_of(n), own_back = back_of(t) < n;
        int from_back = helper ? own_back : !own_front;
        int block = from_back ? back_of(t) : front_of(t);
        uint64_t taken = from_back ? t + 1 : t + (1ull << FIELD_BITS);
        if (__atomic_compare_exchange_n(&ticket, &t, taken, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return block;
    }
    return -1;
}

/* A clock's time in ns: CLOCK_MONOTONIC (now_ns), this thread's CPU time, or the helper's (helper_clock). */
static int64_t clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t now_ns(void) { return clock_ns(CLOCK_MONOTONIC); }

static int has_work(uint64_t seen) {
    uint64_t t = __atomic_load_n(&ticket, __ATOMIC_SEQ_CST);
    return generation(t) != seen && blocks_left(t);
}

static int64_t thread_cpu_ns(void) { return clock_ns(CLOCK_THREAD_CPUTIME_ID); }

/* Whether the helper shares its core with another busy thread: over its last awake window of
 * SHARE_WINDOW_NS it ran less than SHARE_MIN of the time (each poll yields the core, so a competitor
 * takes it). Read-ahead then stops: on a shared core it would take time from the caller, not give it
 * (decode beside a busy loop was slower with it: docs/kernels.md, "Read-ahead into the caches"). Under
 * load the helper keeps measuring; a verdict older than SHARE_FORGET_NS is dropped by the next request,
 * which is then read until a window says otherwise (a core shared a while ago may be free now). */
#define SHARE_WINDOW_NS 200000L
#define SHARE_MIN 0.75
#define SHARE_FORGET_NS 20000000L /* a verdict older than this is measured again on the next request */
static int core_shared = 0;
static int64_t measured_at = 0; /* when core_shared was last measured */
/* split_give_load's count, and the count a verdict was measured under: a helper that read the signals just
 * before a test gave new ones must not leave its verdict as one about the new signals */
static int signals_given = 0;
static int verdict_signals = 0;

static int shared(void) { return __atomic_load_n(&core_shared, __ATOMIC_SEQ_CST); }

static void watch_share(int64_t wall, int64_t *wall0, int64_t *cpu0) {
    if (wall - *wall0 < SHARE_WINDOW_NS) return;
    int64_t cpu = thread_cpu_ns();
    int signals = __atomic_load_n(&signals_given, __ATOMIC_SEQ_CST); /* before the signals it counts */
    int given = __atomic_load_n(&given_share, __ATOMIC_SEQ_CST);     /* per mille, or -1: measured */
    int verdict = given >= 0 ? given < SHARE_MIN * 1000 : (double)(cpu - *cpu0) < SHARE_MIN * (double)(wall - *wall0);
    __atomic_store_n(&measured_at, wall, __ATOMIC_RELAXED);
    __atomic_store_n(&core_shared, verdict, __ATOMIC_SEQ_CST);
    __atomic_store_n(&verdict_signals, signals, __ATOMIC_SEQ_CST);
    *wall0 = wall, *cpu0 = cpu;
}

/* Returns the generation of a job with blocks left. Meanwhile reads ahead what the engine asked for (read_ahead.c)
 * unless the core is shared, then spins, then sleeps until a job or a read-ahead request comes. */
static uint64_t wait_for_job(uint64_t seen) {
    while (!has_work(seen)) {
        int64_t wall0 = now_ns(), cpu0 = thread_cpu_ns();
        int64_t deadline = wall0 + SPIN_NS;
        for (int polls = 0; !has_work(seen); polls++) {
            if (!shared() && read_ahead_step()) {
                deadline = now_ns() + SPIN_NS; /* idle only from the end of the read-ahead */
                if (polls % 64 == 63) watch_share(now_ns(), &wall0, &cpu0);
                continue;
            }
            if (polls % 64 == 63) {
                int64_t wall = now_ns();
                watch_share(wall, &wall0, &cpu0);
                if (wall > deadline) break;
                sched_yield();
            }
            PAUSE();
        }
        pthread_mutex_lock(&mu);
        __atomic_store_n(&helper_sleeping, 1, __ATOMIC_SEQ_CST);
        while (!has_work(seen) && !(read_ahead_pending() && !shared())) pthread_cond_wait(&work_ready, &mu);
        __atomic_store_n(&helper_sleeping, 0, __ATOMIC_SEQ_CST);
        pthread_mutex_unlock(&mu);
    }
    return generation(__atomic_load_n(&ticket, __ATOMIC_SEQ_CST));
}

static void *helper_main(void *unused) {
    (void)unused;
    uint64_t seen = 0;
    for (;;) {
        seen = wait_for_job(seen);
        for (;;) {
            __atomic_store_n(&helper_inside, 1, __ATOMIC_SEQ_CST); /* before the swap: the caller waits for it */
            int block = take_block(seen, 1);
            if (block < 0) break;
            job_fn(job_arg, block);
            __atomic_store_n(&helper_inside, 0, __ATOMIC_SEQ_CST);
        }
        __atomic_store_n(&helper_inside, 0, __ATOMIC_SEQ_CST);
    }
    return NULL;
}

static int solo(int64_t now);

static int ensure_helper(void) {
    if (helper_state == 0) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        helper_state = pthread_create(&helper_id, &attr, helper_main, NULL) == 0 ? 1 : -1;
        pthread_attr_destroy(&attr);
        helper_clock_ok = helper_state == 1 && pthread_getcpuclockid(helper_id, &helper_clock) == 0;
    }
    return helper_state == 1;
}

/* The helper may be asleep: the state it checks before sleeping was stored (seq_cst) before this load. */
static void wake_helper(void) {
    if (__atomic_load_n(&helper_sleeping, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&mu);
        pthread_cond_signal(&work_ready);
        pthread_mutex_unlock(&mu);
    }
}

int split_read_ahead(const void *const *starts, const size_t *lengths, int n, int threads) {
    if (n == 0) return read_ahead_request(starts, lengths, 0); /* a clear needs no helper */
    /* No idle core to read ahead on: the older request is dropped all the same, for the caller lets its arrays
     * go once this returns (read_ahead.py): left pending, the helper would read freed memory later. */
    if (threads < 2 || solo(now_ns())) return read_ahead_request(starts, lengths, 0);
    pthread_mutex_lock(&call_lock);
    int helper = ensure_helper();
    pthread_mutex_unlock(&call_lock);
    if (!helper) return read_ahead_request(starts, lengths, 0);
    if (now_ns() - __atomic_load_n(&measured_at, __ATOMIC_RELAXED) > SHARE_FORGET_NS)
        __atomic_store_n(&core_shared, 0, __ATOMIC_SEQ_CST); /* stale: measured again from this request on */
    int status = read_ahead_request(starts, lengths, n);
    wake_helper();
    return status;
}

/* Another busy process on the cores stalls every job at its join: the scheduler takes the helper off inside its
 * block for a slice of milliseconds, or gives the caller's core to the other process when the caller yields it
 * in the wait (beside a busy loop two threads ran 0.44x of idle, one thread alone 0.5x: docs/kernels.md,
 * "Threads beside a busy process"). Two signs of it, each a solo period: calls run on the caller alone, which
 * the scheduler then gives a whole core, and read-ahead stops (it would take a shared core's time):
 *  - a yield in the wait that returned after YIELD_LOST_NS, twice within STRIKES_NS: another thread ran on the
 *    caller's core for a slice (the common case: the caller, not the helper, lost its core; measured 1284 of
 *    1307 long waits beside a busy loop ended before the CPU clocks below were read). Once could be a hiccup
 *    of an idle machine (an interrupt, the hypervisor taking the virtual core);
 *  - a wait past SOLO_WAIT_NS while the two threads together ran less than 1.8 cores' worth of it (their CPU
 *    clocks, system calls, read only in a wait past WATCH_AFTER_NS): the helper was off. A long block on an
 *    idle machine (attention over a long context) keeps both threads running, so it does not count.
 * A period lasts SOLO_NS; one that starts again within SOLO_NS of the last one's end lasts twice the last, up to
 * SOLO_MAX_NS, so a steady competitor costs a two-thread trial every second or so, not every 50 ms (each trial
 * stalls for a slice or more). */
#define WATCH_AFTER_NS 50000L
#define SOLO_WAIT_NS 500000L
#define YIELD_LOST_NS 500000L
#define STRIKES_NS 20000000L
#define SOLO_NS 50000000L
#define SOLO_MAX_NS 1600000000L
static int64_t solo_until = 0;
#define NO_SOLO_YET (-(1LL << 62)) /* a solo_until long enough ago for any period's length (split_give_load) */
static int64_t solo_length = SOLO_NS; /* the last period's */
static int64_t core_lost_at = -STRIKES_NS; /* the last yield that lost the caller's core */
static int join_watched = 0; /* a join has read the CPU clocks (split_probe's helper block waits for it) */

static int solo(int64_t now) { return now < __atomic_load_n(&solo_until, __ATOMIC_RELAXED); }

static void start_solo(int64_t now) {
    int64_t first = given_solo_ns > 0 ? given_solo_ns : SOLO_NS;
    int64_t longest = given_solo_ns > 0 ? 32 * given_solo_ns : SOLO_MAX_NS;
    int again = now - __atomic_load_n(&solo_until, __ATOMIC_RELAXED) < first;
    solo_length = again ? (solo_length * 2 < longest ? solo_length * 2 : longest) : first;
    __atomic_store_n(&solo_until, now + solo_length, __ATOMIC_RELAXED);
}

/* Both threads' CPU time so far. */
static int64_t both_cpu_ns(void) { return thread_cpu_ns() + clock_ns(helper_clock); }

/* Yields the caller's core; whether another thread then ran on it for YIELD_LOST_NS or more. */
static int yield_lost_core(void) {
    int64_t before = now_ns();
    sched_yield();
    int given = __atomic_load_n(&given_yield_lost, __ATOMIC_RELAXED);
    return given >= 0 ? given : now_ns() - before >= YIELD_LOST_NS;
}

/* Waits for the block the helper is inside, if any; a wait that shows shared cores starts a solo period. */
static void join_helper(void) {
    int64_t since = 0, watched = 0, cpu0 = 0;
    int lost_core = 0;
    for (int polls = 0; __atomic_load_n(&helper_inside, __ATOMIC_SEQ_CST); polls++) {
        if (polls == 0) since = now_ns();
        if (polls % 64 == 63) {
            if (watched == 0 && helper_clock_ok && now_ns() - since > WATCH_AFTER_NS) {
                watched = now_ns(), cpu0 = both_cpu_ns();
                __atomic_store_n(&join_watched, 1, __ATOMIC_SEQ_CST);
            }
            lost_core |= yield_lost_core(); /* the helper may be descheduled inside its block */
        }
        PAUSE();
    }
    if (!lost_core && watched == 0) return; /* no wait long enough to tell anything: no clock to read */
    int64_t now = now_ns();
    int given = __atomic_load_n(&given_share, __ATOMIC_RELAXED); /* the caller then runs all the time */
    int ran_little = given >= 0 ? 1000 + given < 1800 : 10 * (both_cpu_ns() - cpu0) < 18 * (now - watched);
    int helper_off = watched != 0 && now - since > SOLO_WAIT_NS && ran_little;
    int lost_twice = lost_core && now - core_lost_at < (given_solo_ns > 0 ? given_solo_ns : STRIKES_NS);
    if (lost_core) core_lost_at = now;
    if (lost_twice || helper_off) start_solo(now);
}

static void run_side(const SplitSide *side) {
    if (side != NULL) side->fn(side->arg);
}

void split_run_beside(split_block_fn fn, void *job, int n_blocks, int threads, const SplitSide *side) {
    if (n_blocks <= 0) {
        run_side(side);
        return;
    }
    pthread_mutex_lock(&call_lock);
    if (threads < 2 || n_blocks < 2 || (uint64_t)n_blocks > FIELD_MASK || solo(now_ns()) || !ensure_helper()) {
        pthread_mutex_unlock(&call_lock);
        run_side(side);
        for (int b = 0; b < n_blocks; b++) fn(job, b);
        return;
    }
    job_fn = fn, job_arg = job;
    uint64_t gen = generation(__atomic_load_n(&ticket, __ATOMIC_SEQ_CST)) % GENERATION_MASK + 1; /* 1..: 0 is no job's */
    __atomic_store_n(&ticket, ticket_of(gen, (uint64_t)n_blocks, 0, (uint64_t)middle_of(n_blocks)), __ATOMIC_SEQ_CST);
    wake_helper();
    run_side(side); /* meanwhile the helper takes its half's blocks, then the caller's */
    for (int block; (block = take_block(gen, 0)) >= 0;) fn(job, block);
    join_helper();
    pthread_mutex_unlock(&call_lock);
}

void split_run(split_block_fn fn, void *job, int n_blocks, int threads) {
    split_run_beside(fn, job, n_blocks, threads, NULL);
}

int split_cores_shared(long max_age_ns) {
    if (solo(now_ns())) return 1;
    if (helper_state != 1 || now_ns() - __atomic_load_n(&measured_at, __ATOMIC_RELAXED) > max_age_ns) return -1;
    if (__atomic_load_n(&verdict_signals, __ATOMIC_SEQ_CST) != __atomic_load_n(&signals_given, __ATOMIC_SEQ_CST))
        return -1; /* measured under signals given before the latest split_give_load */
    return shared();
}

long split_solo_ns(void) { return (long)solo_length; }

void split_give_load(double helper_share, int yield_lost, long solo_ns) {
    __atomic_store_n(&given_share, helper_share >= 0 ? (int)(helper_share * 1000 + 0.5) : -1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&signals_given, 1, __ATOMIC_SEQ_CST); /* after the share: a helper that sees it sees the share */
    __atomic_store_n(&given_yield_lost, yield_lost, __ATOMIC_RELAXED);
    given_solo_ns = solo_ns;
    /* what was measured before is not about these signals */
    __atomic_store_n(&solo_until, NO_SOLO_YET, __ATOMIC_RELAXED);
    solo_length = solo_ns > 0 ? solo_ns : SOLO_NS, core_lost_at = NO_SOLO_YET;
    __atomic_store_n(&core_shared, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&measured_at, 0, __ATOMIC_RELAXED);
}

void split_end_solo(long ago_ns) { __atomic_store_n(&solo_until, now_ns() - ago_ns, __ATOMIC_RELAXED); }

void split_after_fork(void) {
    read_ahead_after_fork();
    helper_state = 0;
    helper_inside = helper_sleeping = 0;
    solo_until = 0, solo_length = SOLO_NS, core_lost_at = -STRIKES_NS, helper_clock_ok = 0;
    pthread_mutex_init(&call_lock, NULL);
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&work_ready, NULL);
}

/* The probe's job: block 0 is the caller's, block 1 the helper's (middle_of(2) = 1). The caller's waits until
 * the helper is inside block 1 (unless the job runs solo, or ten seconds pass: no helper). Where helper_ns is
 * past SOLO_WAIT_NS (a check of the CPU-clock rule; a shorter block holds the join for its yields) the helper's
 * block waits until the caller's join has read the CPU clocks, then lasts helper_ns more, asleep
 * (descheduled, as far as the join can tell) or spinning (running): the join then waits out helper_ns past its
 * clocks however late the scheduler let the caller get there. A solo job leaves the ticket's generation as it
 * was; asking solo() again instead would wait for nothing when the period ends between split_run's check and
 * the block's. */
typedef struct {
    long helper_ns;
    int helper_sleeps, helper_started, helper_blocks;
    uint64_t generation_before;
} Probe;

static void probe_block(void *arg, int block) {
    Probe *p = arg;
    if (pthread_equal(pthread_self(), helper_id)) {
        __atomic_add_fetch(&p->helper_blocks, 1, __ATOMIC_SEQ_CST);
        __atomic_store_n(&p->helper_started, 1, __ATOMIC_SEQ_CST);
        for (int64_t until = now_ns() + 10000000000L; p->helper_ns > SOLO_WAIT_NS && helper_clock_ok &&
                                                     !__atomic_load_n(&join_watched, __ATOMIC_SEQ_CST) && now_ns() < until;)
            PAUSE();
        if (p->helper_sleeps) {
            struct timespec pause = {p->helper_ns / 1000000000L, p->helper_ns % 1000000000L};
            nanosleep(&pause, NULL);
        } else {
            for (int64_t until = now_ns() + p->helper_ns; now_ns() < until;) PAUSE();
        }
    } else if (block == 0 && generation(__atomic_load_n(&ticket, __ATOMIC_SEQ_CST)) != p->generation_before) {
        for (int64_t until = now_ns() + 10000000000L; !__atomic_load_n(&p->helper_started, __ATOMIC_SEQ_CST) && now_ns() < until;)
            PAUSE();
    }
}

int split_probe(long helper_ns, int helper_sleeps, int fresh) {
    if (fresh) __atomic_store_n(&solo_until, NO_SOLO_YET, __ATOMIC_RELAXED);
    __atomic_store_n(&join_watched, 0, __ATOMIC_SEQ_CST);
    Probe probe = {helper_ns, helper_sleeps, 0, 0, generation(__atomic_load_n(&ticket, __ATOMIC_SEQ_CST))};
    split_run(probe_block, &probe, 2, 2);
    return probe.helper_blocks;
}
