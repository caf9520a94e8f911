/* flight.c - see flight.h */
#include "flight.h"

#include <errno.h>
#include <stdlib.h>

struct kc_flight {
	struct kc_flight *next;
	struct kc_flight_key key;
	struct kc_waiter *waiters;
	int compiling; /* kc_flight_compiling was called: nothing to fetch */
};

void kc_flight_table_init(struct kc_flight_table *t)
{
	pthread_mutex_init(&t->lock, NULL);
	t->head = NULL;
	t->count = 0;
}

void kc_flight_table_destroy(struct kc_flight_table *t)
{
	pthread_mutex_destroy(&t->lock);
}

static struct kc_flight **find(struct kc_flight_table *t, const struct kc_flight_key *key)
{
	struct kc_flight **p = &t->head;
	while (*p && ((*p)->key.dev != key->dev || (*p)->key.ino != key->ino))
		p = &(*p)->next;
	return p;
}

/* Queue w (may be NULL) on the flight f (the table lock held). Returns 1 when w is a
 * fetch-only waiter and f already compiles: not queued, the caller serves it -EINPROGRESS
 * once the lock is released (kc_flight_compiling served the ones queued before). */
static int queue_on(struct kc_flight *f, struct kc_waiter *w)
{
	if (!w)
		return 0;
	if (w->fetch_only && f->compiling)
		return 1;
	w->next = f->waiters;
	f->waiters = w;
	return 0;
}

int kc_flight_join_running(struct kc_flight_table *t, const struct kc_flight_key *key,
			   struct kc_waiter *w)
{
	pthread_mutex_lock(&t->lock);
	struct kc_flight **p = find(t, key);
	int ret = *p ? KC_FLIGHT_JOINED : 0, now = 0;
	if (*p)
		now = queue_on(*p, w);
	pthread_mutex_unlock(&t->lock);
	if (now)
		w->done(w, -EINPROGRESS);
	return ret;
}

int kc_flight_join(struct kc_flight_table *t, const struct kc_flight_key *key,
		   struct kc_waiter *w, int (*recheck)(void *arg), void *arg)
{
	int ret, now = 0;

	pthread_mutex_lock(&t->lock);
	struct kc_flight **p = find(t, key);
	if (*p) {
		now = queue_on(*p, w);
		ret = KC_FLIGHT_JOINED;
	} else if (recheck && (ret = recheck(arg)) != 0) {
		/* already done: nothing queued */
	} else {
		struct kc_flight *f = malloc(sizeof(*f));
		if (!f) {
			ret = -ENOMEM;
		} else {
			f->key = *key;
			f->compiling = 0;
			f->next = t->head;
			if (w)
				w->next = NULL;
			f->waiters = w;
			t->head = f;
			t->count++;
			ret = KC_FLIGHT_LEADER;
		}
	}
	pthread_mutex_unlock(&t->lock);
	if (now)
		w->done(w, -EINPROGRESS);
	return ret;
}

/* Call done(result) on each waiter of the list w (linked by next); the lock not held. */
static unsigned serve(struct kc_waiter *w, int result)
{
	unsigned n = 0;
	while (w) {
		struct kc_waiter *next = w->next;
		w->done(w, result);
		w = next;
		n++;
	}
	return n;
}

/* Move the waiters of *list for which pred(w, arg) holds onto *out (the lock held). */
static void take(struct kc_waiter **list, int (*pred)(struct kc_waiter *w, void *arg),
		 void *arg, struct kc_waiter **out)
{
	for (struct kc_waiter **p = list; *p;) {
		struct kc_waiter *w = *p;
		if (!w->internal && pred(w, arg)) {
			*p = w->next;
			w->next = *out;
			*out = w;
		} else {
			p = &w->next;
		}
	}
}

unsigned kc_flight_finish(struct kc_flight_table *t, const struct kc_flight_key *key,
			  int result)
{
	struct kc_waiter *w = NULL;

	pthread_mutex_lock(&t->lock);
	struct kc_flight **p = find(t, key);
	struct kc_flight *f = *p;
	if (f) {
		*p = f->next;
		w = f->waiters;
		t->count--;
	}
	pthread_mutex_unlock(&t->lock);
	free(f);
	return serve(w, result);
}

static int is_fetch_only(struct kc_waiter *w, void *arg)
{
	(void)arg;
	return w->fetch_only;
}

unsigned kc_flight_compiling(struct kc_flight_table *t, const struct kc_flight_key *key)
{
	struct kc_waiter *out = NULL;

	pthread_mutex_lock(&t->lock);
	struct kc_flight *f = *find(t, key);
	if (f) {
		f->compiling = 1; /* fetch-only waiters that join later are served at once */
		take(&f->waiters, is_fetch_only, NULL, &out);
	}
	pthread_mutex_unlock(&t->lock);
	return serve(out, -EINPROGRESS);
}

struct kc_waiter *kc_flight_sweep(struct kc_flight_table *t,
				  int (*pred)(struct kc_waiter *w, void *arg), void *arg)
{
	struct kc_waiter *out = NULL;

	pthread_mutex_lock(&t->lock);
	for (struct kc_flight *f = t->head; f; f = f->next)
		take(&f->waiters, pred, arg, &out);
	pthread_mutex_unlock(&t->lock);
	return out;
}

unsigned kc_flight_count(struct kc_flight_table *t)
{
	pthread_mutex_lock(&t->lock);
	unsigned n = t->count;
	pthread_mutex_unlock(&t->lock);
	return n;
}

int kc_flight_run_if_idle(struct kc_flight_table *t, const struct kc_flight_key *key,
			  int (*fn)(void *arg), void *arg)
{
	pthread_mutex_lock(&t->lock);
	int ret = *find(t, key) ? -EBUSY : fn(arg);
	pthread_mutex_unlock(&t->lock);
	return ret;
}
