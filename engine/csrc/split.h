/* The kernels' thread split (split.c): a call's work cut into numbered blocks, taken from a shared
 * counter by the calling thread and one persistent helper thread. */
#ifndef COLIBRI_SPLIT_H
#define COLIBRI_SPLIT_H

#include <stddef.h>

/* Computes block `block` of a job; blocks of one job touch disjoint outputs. */
typedef void (*split_block_fn)(void *job, int block);

/* fn(job, b) for every b in [0, n_blocks), on the caller and (threads >= 2) the helper; returns when
 * all are done. The caller never waits for a helper that has not started: it takes every block the
 * helper has not, so a descheduled helper (a busy machine) costs nothing but its own blocks. A helper
 * descheduled inside a block does stall the caller; after one such wait, or a yield in it that lost the
 * caller's core (a busy machine), calls run on the caller alone for a while (split.c SOLO_NS, longer when
 * it happens again at once). */
void split_run(split_block_fn fn, void *job, int n_blocks, int threads);

/* Work of the caller's that does not depend on a job (e.g. a layer's routing beside its shared expert). */
typedef struct {
    void (*fn)(void *arg);
    void *arg;
} SplitSide;

/* split_run, but the caller first runs side (when not NULL) while the helper starts on the blocks: the
 * side's time overlaps the job's reads instead of adding to them. The blocks and their outputs are
 * split_run's; side must not call split_run. */
void split_run_beside(split_block_fn fn, void *job, int n_blocks, int threads, const SplitSide *side);

/* Has the helper (threads >= 2) read these ranges into the caches while it has no block to run,
 * replacing what was asked before (read_ahead.c); returns at once. 0, or -1 without memory. */
int split_read_ahead(const void *const *starts, const size_t *lengths, int n, int threads);

/* The helper's last verdict on its core (split.c watch_share): 1 shared with another busy thread (or a solo
 * period runs: a join waited long for a descheduled helper), 0 not, -1 none measured within max_age_ns (no
 * helper, or idle that long). */
int split_cores_shared(long max_age_ns);

/* The length of the last solo period (split.c start_solo), in ns (tests). */
long split_solo_ns(void);

/* Tests: the load signals split.c reads given instead of measured, so that its verdicts do not depend on the
 * test machine's load. helper_share >= 0: the helper runs that fraction of the wall time and the caller all
 * of it (watch_share's and join_helper's CPU clocks); yield_lost >= 0: whether a yield in a join lost the
 * caller's core; solo_ns > 0: a solo period's first length. A negative value (or 0 for solo_ns) measures
 * again. Either way the verdicts measured so far are dropped (no solo period, no verdict on the core). */
void split_give_load(double helper_share, int yield_lost, long solo_ns);

/* Tests: the solo period ended ago_ns ago (a negative ago_ns: it ends that far ahead). */
void split_end_solo(long ago_ns);

/* A forked child has no helper thread (only the forking thread survives): call in the child. */
void split_after_fork(void);

/* A check of the solo rule (tests): a two-block job whose helper block lasts helper_ns, asleep where
 * helper_sleeps (descheduled, as far as the caller can tell) or spinning, after ending any solo period where
 * fresh; returns how many blocks the helper ran (0: the job ran on the caller alone). */
int split_probe(long helper_ns, int helper_sleeps, int fresh);

#endif
