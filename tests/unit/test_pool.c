/* test_pool.c - the compile pool's FIFO order and the job slots (pool.h). */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "pool.h"
#include "tap.h"

static struct kc_slots slots;
static pthread_t ran_on[16];
static atomic_int nran_on;

static void whoami(void *arg)
{
	(void)arg;
	ran_on[atomic_fetch_add(&nran_on, 1)] = pthread_self();
}
static pthread_mutex_t order_lock = PTHREAD_MUTEX_INITIALIZER;
static int order[8], norder;

static void record(int id)
{
	pthread_mutex_lock(&order_lock);
	order[norder++] = id;
	pthread_mutex_unlock(&order_lock);
}

static void *slot_taker(void *arg)
{
	kc_slots_acquire(&slots);
	record((int)(long)arg);
	kc_slots_release(&slots);
	return NULL;
}

/* Wait until n callers wait for a slot (at most 10 s). */
static int waiting_for(unsigned n)
{
	for (int i = 0; i < 10000; i++) {
		unsigned w, h;
		kc_slots_load(&slots, &w, &h);
		if (w == n)
			return 1;
		usleep(1000);
	}
	return 0;
}

static atomic_int ran;
static void job(void *arg)
{
	record((int)(long)arg);
	atomic_fetch_add(&ran, 1);
}

static atomic_int hold, held_ran;
static void held_job(void *arg)
{
	(void)arg;
	while (atomic_load(&hold))
		usleep(1000);
	atomic_fetch_add(&held_ran, 1);
}

int main(void)
{
	unsigned w, h;

	/* slots: n at once */
	kc_slots_init(&slots, 2);
	kc_slots_acquire(&slots);
	kc_slots_acquire(&slots);
	kc_slots_load(&slots, &w, &h);
	CHECK(w == 0 && h == 2, "two slots held, none waiting");
	kc_slots_release(&slots);
	kc_slots_release(&slots);
	kc_slots_destroy(&slots);

	/* one slot: the callers get it in the order they asked (each releases it before the
	 * next can record) */
	kc_slots_init(&slots, 1);
	kc_slots_acquire(&slots);
	pthread_t t[4];
	int started = 1;
	for (long i = 0; i < 4; i++) { /* each queued before the next asks */
		started &= pthread_create(&t[i], NULL, slot_taker, (void *)i) == 0;
		started &= waiting_for((unsigned)i + 1);
	}
	CHECK(started, "four callers wait for a slot");
	CHECK(norder == 0, "none got the slot while it is held");
	kc_slots_release(&slots);
	for (int i = 0; i < 4; i++)
		pthread_join(t[i], NULL);
	CHECK(norder == 4 && order[0] == 0 && order[1] == 1 && order[2] == 2 && order[3] == 3,
	      "slots were handed out in the order they were asked for");
	kc_slots_load(&slots, &w, &h);
	CHECK(w == 0 && h == 0, "every slot came back");
	kc_slots_destroy(&slots);

	kc_slots_init(&slots, 0);
	kc_slots_acquire(&slots);
	kc_slots_load(&slots, &w, &h);
	CHECK(h == 1, "slots of 0 are one slot");
	kc_slots_release(&slots);
	kc_slots_destroy(&slots);

	/* the pool: one worker runs jobs in the order they were queued */
	norder = 0;
	struct kc_pool *p = kc_pool_create(1);
	CHECK(p != NULL, "a pool of one worker");
	if (!p)
		return tap_done();
	for (long i = 0; i < 8; i++)
		kc_pool_submit(p, job, (void *)i);
	kc_pool_destroy(p); /* runs what is queued */
	int fifo = norder == 8;
	for (int i = 0; i < norder; i++)
		fifo &= order[i] == i;
	CHECK(fifo && atomic_load(&ran) == 8, "queued jobs all ran, in FIFO order");

	/* waiting for the pool to be idle: bounded while a job runs, 0 once it ended */
	p = kc_pool_create(1);
	CHECK(p != NULL && kc_pool_wait_idle(p, 0) == 0, "a new pool is idle");
	if (!p)
		return tap_done();
	atomic_store(&hold, 1);
	kc_pool_submit(p, held_job, NULL);
	kc_pool_submit(p, held_job, NULL);
	CHECK(kc_pool_wait_idle(p, 0.2) == 2 && atomic_load(&held_ran) == 0,
	      "a wait for idleness gives up at its bound with the jobs left (one running, one "
	      "queued)");
	atomic_store(&hold, 0);
	CHECK(kc_pool_wait_idle(p, 60) == 0 && atomic_load(&held_ran) == 2,
	      "the wait ends once every job ran");
	kc_pool_destroy(p);

	/* jobs one after another go to the worker that went idle last: one worker of 8 */
	p = kc_pool_create(8);
	CHECK(p != NULL, "a pool of 8 workers");
	if (!p)
		return tap_done();
	for (int i = 0; i < 16; i++) {
		kc_pool_submit(p, whoami, NULL);
		kc_pool_wait_idle(p, 60);
	}
	int one = atomic_load(&nran_on) == 16;
	for (int i = 1; i < 16; i++)
		one &= pthread_equal(ran_on[i], ran_on[0]);
	CHECK(one, "16 jobs in turn all ran on the worker that went idle last");
	kc_pool_destroy(p);
	return tap_done();
}
