/* pool.h - a fixed set of worker threads running queued jobs in FIFO order; bounds how
 * many compiles run at once (-o jobs=N).
 *
 * Owns: its threads and queued job records. Jobs own their argument.
 */
#ifndef KC_POOL_H
#define KC_POOL_H

struct kc_pool;

typedef void (*kc_job_fn)(void *arg);

/* Start n (>= 1) workers. Returns NULL with errno set on failure. */
struct kc_pool *kc_pool_create(unsigned n);

/* Queue fn(arg). Returns 0, or -ENOMEM, or -ESHUTDOWN after kc_pool_destroy began. */
int kc_pool_submit(struct kc_pool *p, kc_job_fn fn, void *arg);

/* Jobs queued but not started yet, and jobs running now. */
void kc_pool_load(struct kc_pool *p, unsigned *queued, unsigned *running);

/* Stop accepting, run what is queued, join the workers, free. */
void kc_pool_destroy(struct kc_pool *p);

#endif
