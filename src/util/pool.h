/* pool.h - a fixed set of worker threads running queued jobs in FIFO order, and slots: a
 * counting semaphore served in FIFO order. Together they bound how many compiles run at
 * once (-o jobs=N): without a cluster store the pool has N workers; with one, a job may
 * wait for another node's compile, so the pool is wider and a job holds one of N slots
 * only while its compiler runs.
 *
 * A queued job wakes the worker that went idle last (a stack of idle workers, as in
 * Folly's LifoSem-based executors): its stack and malloc arena are already touched, so a
 * burst of k jobs keeps to about k workers instead of going round all n (a joining node's
 * fetches faulted in the stacks and arenas of all 34 workers, about 700 page faults).
 *
 * Owns: its threads and queued job records. Jobs own their argument.
 */
#ifndef KC_POOL_H
#define KC_POOL_H

#include <pthread.h>

struct kc_pool;

typedef void (*kc_job_fn)(void *arg);

/* Start n (>= 1) workers. Returns NULL with errno set on failure. */
struct kc_pool *kc_pool_create(unsigned n);

/* Queue fn(arg). Returns 0, or -ENOMEM, or -ESHUTDOWN after kc_pool_destroy began. */
int kc_pool_submit(struct kc_pool *p, kc_job_fn fn, void *arg);

/* Jobs queued but not started yet, and jobs running now. */
void kc_pool_load(struct kc_pool *p, unsigned *queued, unsigned *running);

/* Wait until no job is queued or running, at most timeout_s seconds. Returns the jobs
 * still queued or running (0: idle). Jobs submitted meanwhile are waited for too. */
unsigned kc_pool_wait_idle(struct kc_pool *p, double timeout_s);

/* Wait on cond (with lock held, as pthread_cond_wait) at most 100 ms: for loops that
 * recheck their condition against a CLOCK_MONOTONIC deadline of their own. */
void kc_cond_wait_briefly(pthread_cond_t *cond, pthread_mutex_t *lock);

/* Stop accepting, run what is queued, join the workers, free. */
void kc_pool_destroy(struct kc_pool *p);

/* n slots, handed out in the order they were asked for (a ticket lock's queue). */
struct kc_slots {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	unsigned n, free, waiting;
	unsigned long next, serving; /* the next ticket to hand out, the next to serve */
};

void kc_slots_init(struct kc_slots *s, unsigned n);
void kc_slots_destroy(struct kc_slots *s);

/* Wait for a slot (blocks; not cancellable: slots come back as compiles end). */
void kc_slots_acquire(struct kc_slots *s);

void kc_slots_release(struct kc_slots *s);

/* Callers waiting for a slot, and slots held now. */
void kc_slots_load(struct kc_slots *s, unsigned *waiting, unsigned *held);

#endif
