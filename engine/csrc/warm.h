/* Warming (warm.c): the kernel helper thread reads ahead, into the caches, the weights the next calls
 * will use, while the caller runs Python between kernel calls. */
#ifndef COLIBRI_WARM_H
#define COLIBRI_WARM_H

#include <stddef.h>
#include <stdint.h>

/* Replaces what is left to warm by these n ranges, in order. On return no byte of the ranges
 * given before is touched any more (their memory may be freed). n = 0 clears. Returns 0, or -1
 * without memory (nothing is then warmed). */
int warm_request(const void *const *starts, const size_t *lengths, int n);

/* Reads the next WARM_STEP_BYTES of what is requested; 0 when nothing is left (the helper's idle poll). */
int warm_step(void);

/* Whether anything is left to warm (the helper does not sleep while there is). */
int warm_pending(void);

/* Bytes the helper has read ahead since the process started. */
uint64_t warm_bytes_read(void);

/* A forked child: nothing to warm, fresh lock. */
void warm_after_fork(void);

#endif
