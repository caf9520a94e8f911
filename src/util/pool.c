/* pool.c - see pool.h */
#include "pool.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "util.h"

struct job {
	struct job *next;
	kc_job_fn fn;
	void *arg;
};

/* A worker: waits on a condition of its own, so that a job wakes the one chosen for it. */
struct worker {
	struct kc_pool *pool;
	pthread_t thread;
	pthread_cond_t wake;
	int waiting; /* on the idle stack; cleared by whoever pops it */
};

struct kc_pool {
	pthread_mutex_t lock;
	pthread_cond_t idle; /* broadcast when a job ends and none is queued, and when the
			      * last worker went idle */
	struct job *head, *tail;
	unsigned queued, running, nthreads;
	int stopping;
	unsigned nidle;
	struct worker **idlers; /* idle workers, the most recently idle last */
	struct worker workers[];
};

/* Wait (p->lock held) until a job is queued or the pool stops, on the idle stack. */
static void wait_for_job(struct kc_pool *p, struct worker *w)
{
	while (!p->head && !p->stopping) {
		w->waiting = 1;
		p->idlers[p->nidle++] = w;
		if (p->nidle == p->nthreads) /* kc_pool_create waits for all to be idle */
			pthread_cond_broadcast(&p->idle);
		while (w->waiting && !p->stopping)
			pthread_cond_wait(&w->wake, &p->lock);
		if (w->waiting) { /* stopping: take itself off the stack */
			for (unsigned i = 0; i < p->nidle; i++)
				if (p->idlers[i] == w) {
					p->idlers[i] = p->idlers[--p->nidle];
					break;
				}
			w->waiting = 0;
		}
	}
}

static void *worker(void *arg)
{
	struct worker *w = arg;
	struct kc_pool *p = w->pool;

	pthread_mutex_lock(&p->lock);
	for (;;) {
		wait_for_job(p, w);
		struct job *j = p->head;
		if (!j)
			break;
		p->head = j->next;
		if (!p->head)
			p->tail = NULL;
		p->queued--;
		p->running++;
		pthread_mutex_unlock(&p->lock);
		j->fn(j->arg);
		free(j);
		pthread_mutex_lock(&p->lock);
		p->running--;
		if (!p->head)
			pthread_cond_broadcast(&p->idle);
	}
	pthread_mutex_unlock(&p->lock);
	return NULL;
}

struct kc_pool *kc_pool_create(unsigned n)
{
	if (n == 0)
		n = 1;
	struct kc_pool *p = calloc(1, sizeof(*p) + n * sizeof(struct worker));
	if (!p || !(p->idlers = calloc(n, sizeof(*p->idlers)))) {
		free(p);
		errno = ENOMEM;
		return NULL;
	}
	pthread_mutex_init(&p->lock, NULL);
	pthread_cond_init(&p->idle, NULL);
	for (unsigned i = 0; i < n; i++) {
		p->workers[i].pool = p;
		pthread_cond_init(&p->workers[i].wake, NULL);
		if (pthread_create(&p->workers[i].thread, NULL, worker, &p->workers[i]) != 0) {
			pthread_cond_destroy(&p->workers[i].wake);
			pthread_mutex_lock(&p->lock);
			p->nthreads = i;
			pthread_mutex_unlock(&p->lock);
			kc_pool_destroy(p);
			errno = EAGAIN;
			return NULL;
		}
	}
	/* every worker on the idle stack before the first job, so that it goes to the last */
	pthread_mutex_lock(&p->lock);
	p->nthreads = n;
	while (p->nidle < n)
		pthread_cond_wait(&p->idle, &p->lock);
	pthread_mutex_unlock(&p->lock);
	return p;
}

int kc_pool_submit(struct kc_pool *p, kc_job_fn fn, void *arg)
{
	struct job *j = malloc(sizeof(*j));
	if (!j)
		return -ENOMEM;
	j->fn = fn;
	j->arg = arg;
	j->next = NULL;
	pthread_mutex_lock(&p->lock);
	if (p->stopping) {
		pthread_mutex_unlock(&p->lock);
		free(j);
		return -ESHUTDOWN;
	}
	if (p->tail)
		p->tail->next = j;
	else
		p->head = j;
	p->tail = j;
	p->queued++;
	if (p->nidle) { /* the most recently idle: its stack and malloc arena are warm */
		struct worker *w = p->idlers[--p->nidle];
		w->waiting = 0;
		pthread_cond_signal(&w->wake);
	}
	pthread_mutex_unlock(&p->lock);
	return 0;
}

void kc_pool_load(struct kc_pool *p, unsigned *queued, unsigned *running)
{
	pthread_mutex_lock(&p->lock);
	*queued = p->queued;
	*running = p->running;
	pthread_mutex_unlock(&p->lock);
}

void kc_cond_wait_briefly(pthread_cond_t *cond, pthread_mutex_t *lock)
{
	/* the condition's clock is CLOCK_REALTIME: short waits, the callers' deadlines
	 * monotonic, so a step of the wall clock costs at most one wait */
	struct timespec until = kc_wall_after_ms(100);
	pthread_cond_timedwait(cond, lock, &until);
}

unsigned kc_pool_wait_idle(struct kc_pool *p, double timeout_s)
{
	double deadline = kc_mono_s() + timeout_s;
	pthread_mutex_lock(&p->lock);
	while ((p->queued || p->running) && kc_mono_s() < deadline) {
		kc_cond_wait_briefly(&p->idle, &p->lock);
	}
	unsigned left = p->queued + p->running;
	pthread_mutex_unlock(&p->lock);
	return left;
}

void kc_pool_destroy(struct kc_pool *p)
{
	pthread_mutex_lock(&p->lock);
	p->stopping = 1;
	for (unsigned i = 0; i < p->nthreads; i++)
		pthread_cond_signal(&p->workers[i].wake);
	pthread_mutex_unlock(&p->lock);
	for (unsigned i = 0; i < p->nthreads; i++) {
		pthread_join(p->workers[i].thread, NULL);
		pthread_cond_destroy(&p->workers[i].wake);
	}
	pthread_cond_destroy(&p->idle);
	pthread_mutex_destroy(&p->lock);
	free(p->idlers);
	free(p);
}

void kc_slots_init(struct kc_slots *s, unsigned n)
{
	pthread_mutex_init(&s->lock, NULL);
	pthread_cond_init(&s->cond, NULL);
	s->n = s->free = n ? n : 1;
	s->waiting = 0;
	s->next = s->serving = 0;
}

void kc_slots_destroy(struct kc_slots *s)
{
	pthread_cond_destroy(&s->cond);
	pthread_mutex_destroy(&s->lock);
}

void kc_slots_acquire(struct kc_slots *s)
{
	pthread_mutex_lock(&s->lock);
	unsigned long ticket = s->next++;
	s->waiting++;
	while (ticket != s->serving || s->free == 0)
		pthread_cond_wait(&s->cond, &s->lock);
	s->serving++;
	s->free--;
	s->waiting--;
	pthread_cond_broadcast(&s->cond); /* the next ticket may take a free slot too */
	pthread_mutex_unlock(&s->lock);
}

void kc_slots_release(struct kc_slots *s)
{
	pthread_mutex_lock(&s->lock);
	s->free++;
	pthread_cond_broadcast(&s->cond);
	pthread_mutex_unlock(&s->lock);
}

void kc_slots_load(struct kc_slots *s, unsigned *waiting, unsigned *held)
{
	pthread_mutex_lock(&s->lock);
	*waiting = s->waiting;
	*held = s->n - s->free;
	pthread_mutex_unlock(&s->lock);
}
