/* Read-ahead (read_ahead.c): the kernel helper thread reads ahead, into the caches, the weights the next calls
 * will use, while the caller runs Python between kernel calls. */
#ifndef COLIBRI_READ_AHEAD_H
#define COLIBRI_READ_AHEAD_H

#include <stddef.h>
#include <stdint.h>

/* Replaces what is left to read ahead by these n ranges, in order. On return no byte of the ranges
 * given before is touched any more (their memory may be freed). n = 0 clears. Returns 0, or -1
 * without memory (nothing is then read ahead). */
int read_ahead_request(const void *const *starts, const size_t *lengths, int n);

/* Reads the next READ_AHEAD_STEP_BYTES of what is requested; 0 when nothing is left (the helper's idle poll). */
int read_ahead_step(void);

/* Whether anything is left to read ahead (the helper does not sleep while there is). */
int read_ahead_pending(void);

/* Bytes the helper has read ahead since the process started. */
uint64_t read_ahead_bytes_read(void);

/* A forked child: nothing to read ahead, fresh lock. */
void read_ahead_after_fork(void);

#endif
