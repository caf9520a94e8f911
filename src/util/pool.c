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

struct kc_pool {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	pthread_cond_t idle; /* broadcast when a job ends and none is queued */
	struct job *head, *tail;
	unsigned queued, running, nthreads;
	int stopping;
	pthread_t threads[];
};

static void *worker(void *arg)
{
	struct kc_pool *p = arg;

	pthread_mutex_lock(&p->lock);
	for (;;) {
		while (!p->head && !p->stopping)
			pthread_cond_wait(&p->cond, &p->lock);
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
	struct kc_pool *p = calloc(1, sizeof(*p) + n * sizeof(pthread_t));
	if (!p)
		return NULL;
	pthread_mutex_init(&p->lock, NULL);
	pthread_cond_init(&p->cond, NULL);
	pthread_cond_init(&p->idle, NULL);
	for (unsigned i = 0; i < n; i++) {
		if (pthread_create(&p->threads[i], NULL, worker, p) != 0) {
			p->nthreads = i;
			kc_pool_destroy(p);
			errno = EAGAIN;
			return NULL;
		}
	}
	p->nthreads = n;
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
	pthread_cond_signal(&p->cond);
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
	struct timespec until;
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_nsec += 100000000L;
	if (until.tv_nsec >= 1000000000L) {
		until.tv_sec++;
		until.tv_nsec -= 1000000000L;
	}
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
	pthread_cond_broadcast(&p->cond);
	pthread_mutex_unlock(&p->lock);
	for (unsigned i = 0; i < p->nthreads; i++)
		pthread_join(p->threads[i], NULL);
	pthread_cond_destroy(&p->cond);
	pthread_cond_destroy(&p->idle);
	pthread_mutex_destroy(&p->lock);
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
