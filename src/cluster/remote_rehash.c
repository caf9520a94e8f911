/* remote_rehash.c - see remote_rehash.h */
#include "remote_rehash.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kc_rehash_init(struct kc_rehash_table *t)
{
	memset(t, 0, sizeof(*t));
	pthread_mutex_init(&t->lock, NULL);
	pthread_cond_init(&t->done, NULL);
	kc_watch_init(&t->watch);
}

void kc_rehash_settle(struct kc_rehash_table *t)
{
	pthread_mutex_lock(&t->lock);
	while (t->arming)
		pthread_cond_wait(&t->done, &t->lock);
	pthread_mutex_unlock(&t->lock);
}

void kc_rehash_destroy(struct kc_rehash_table *t)
{
	kc_rehash_settle(t);
	if (t->armer_live)
		pthread_join(t->armer, NULL);
	pthread_mutex_destroy(&t->lock);
	pthread_cond_destroy(&t->done);
	kc_watch_destroy(&t->watch);
}

unsigned long kc_rehash_ticket(struct kc_rehash_table *t)
{
	pthread_mutex_lock(&t->lock);
	unsigned long ticket = t->starts;
	pthread_mutex_unlock(&t->lock);
	return ticket;
}

/* The rehash itself: this node's compact manifest of list/len (with spread, its headers
 * on helper threads: kc_manifest_rehash_spread). */
static int rehash(const char *list, size_t len, int spread, char mine[KC_MANIFEST_COMPACT_MAX],
		  size_t *mlen, char *why, size_t whylen)
{
	char *full = NULL;
	size_t full_len = 0;
	int err = (spread ? kc_manifest_rehash_spread : kc_manifest_rehash)(list, len, &full,
									    &full_len, why, whylen);
	if (!err)
		err = kc_manifest_compact(full, full_len, mine, mlen);
	free(full);
	return err;
}

/* The list's slot if it has one (t->lock held), else NULL. */
static struct kc_rehash_slot *slot_if_any(struct kc_rehash_table *t, const char *hash)
{
	for (int i = 0; i < KC_REHASH_SLOTS; i++)
		if (strcmp(t->slots[i].hash, hash) == 0)
			return &t->slots[i];
	return NULL;
}

/* The slot of hash (t->lock held): its own, else an empty or idle one taken for it (its
 * past result dropped); NULL when every slot is running another list's rehash. */
static struct kc_rehash_slot *slot_of(struct kc_rehash_table *t, const char *hash)
{
	struct kc_rehash_slot *own = slot_if_any(t, hash);
	if (own)
		return own;
	for (int i = 0; i < KC_REHASH_SLOTS; i++) {
		struct kc_rehash_slot *s = &t->slots[t->next++ % KC_REHASH_SLOTS];
		if (s->running)
			continue;
		memset(s, 0, sizeof(*s));
		snprintf(s->hash, sizeof(s->hash), "%s", hash);
		return s;
	}
	return NULL;
}

/* s's last result into mine / *mlen / why (t->lock held); returns its error. */
static int take(const struct kc_rehash_slot *s, char mine[KC_MANIFEST_COMPACT_MAX],
		size_t *mlen, char *why, size_t whylen)
{
	memcpy(mine, s->mine, sizeof(s->mine));
	*mlen = s->mine_len;
	snprintf(why, whylen, "%s", s->why);
	return s->err;
}

/* Whether s's last result, older than ticket, may be taken if the watch says nothing
 * changed: a success of a rehash that began after the arm that covers the list. */
static int coverable(const struct kc_rehash_slot *s, unsigned long ticket)
{
	return s->seq && s->seq <= ticket && !s->running && !s->err && s->cover_gen &&
	       s->seq > s->cover_at;
}

/* Who asks own for a rehash: a fetch (an uncovered rehash of its starts the armer), the
 * armer (its rehash counts in armer_starts, and starts none), or kc_rehash_check (starts
 * none). */
enum asker { ASK_FETCH, ASK_ARMER, ASK_CHECK };

static int own(struct kc_rehash_table *t, unsigned long ticket, const char *hash,
	       const char *list, size_t len, char mine[KC_MANIFEST_COMPACT_MAX], size_t *mlen,
	       char *why, size_t whylen, enum asker who);

struct arm_job {
	struct kc_rehash_table *t;
	char hash[KC_SHA256_HEXLEN + 1];
	size_t len;
	char list[]; /* the header list, len bytes */
};

/* The armer: arm the watch for the job's list, cover the list's slot with it, and run one
 * rehash under it (its stats after the arm), whose result the next fetches may take on the
 * watch's word. */
static void *arm_behind(void *arg)
{
	struct arm_job *j = arg;
	struct kc_rehash_table *t = j->t;
	unsigned long gen = kc_watch_arm(&t->watch, j->list, j->len, kc_manifest_memo_fill);
	unsigned long ticket = 0;
	pthread_mutex_lock(&t->lock);
	struct kc_rehash_slot *s = slot_if_any(t, j->hash);
	if (s && gen) {
		s->cover_gen = gen;
		s->cover_at = ticket = t->starts;
	}
	else if (s) /* not to be watched now: a thread per rehash would not help */
		s->arm_skip = KC_REHASH_ARM_BACKOFF;
	pthread_mutex_unlock(&t->lock);
	if (s && gen) {
		char m[KC_MANIFEST_COMPACT_MAX], w[200];
		size_t ml = 0;
		own(t, ticket, j->hash, j->list, j->len, m, &ml, w, sizeof(w), ASK_ARMER);
	}
	pthread_mutex_lock(&t->lock);
	t->arming = 0;
	pthread_cond_broadcast(&t->done);
	pthread_mutex_unlock(&t->lock);
	free(j);
	return NULL;
}

/* Start the armer for the list list/len whose digest is hash (t->lock held), unless it is
 * running (for this list or another: that list's next uncovered rehash asks again). A
 * thread that cannot be had leaves the list uncovered: its fetches stat, as before. */
static void start_armer(struct kc_rehash_table *t, const char *hash, const char *list,
			size_t len)
{
	if (t->arming)
		return;
	if (t->armer_live) { /* ended (arming is 0): only its return is left */
		pthread_join(t->armer, NULL);
		t->armer_live = 0;
	}
	struct arm_job *j = malloc(sizeof(*j) + len);
	if (!j)
		return;
	j->t = t;
	snprintf(j->hash, sizeof(j->hash), "%s", hash);
	j->len = len;
	memcpy(j->list, list, len);
	if (pthread_create(&t->armer, NULL, arm_behind, j) != 0) {
		free(j);
		return;
	}
	t->arming = t->armer_live = 1;
	t->arms++;
}

int kc_rehash_own(struct kc_rehash_table *t, unsigned long ticket, const char *hash,
		  const char *list, size_t len, char mine[KC_MANIFEST_COMPACT_MAX], size_t *mlen,
		  char *why, size_t whylen)
{
	return own(t, ticket, hash, list, len, mine, mlen, why, whylen, ASK_FETCH);
}

int kc_rehash_check(struct kc_rehash_table *t, unsigned long ticket, const char *hash,
		    const char *list, size_t len, char mine[KC_MANIFEST_COMPACT_MAX],
		    size_t *mlen, char *why, size_t whylen)
{
	return own(t, ticket, hash, list, len, mine, mlen, why, whylen, ASK_CHECK);
}

void kc_rehash_arm(struct kc_rehash_table *t, const char *hash, const char *list, size_t len)
{
	pthread_mutex_lock(&t->lock);
	while (t->arming) /* another list's: an arm is milliseconds */
		pthread_cond_wait(&t->done, &t->lock);
	struct kc_rehash_slot *s = slot_if_any(t, hash);
	if (s && s->seq && !s->err && !s->cover_gen && !s->arm_skip)
		start_armer(t, hash, list, len);
	pthread_mutex_unlock(&t->lock);
}

/* kc_rehash_own for who (enum asker). */
static int own(struct kc_rehash_table *t, unsigned long ticket, const char *hash,
	       const char *list, size_t len, char mine[KC_MANIFEST_COMPACT_MAX], size_t *mlen,
	       char *why, size_t whylen, enum asker who)
{
	struct kc_rehash_slot *s;
	int disproved = 0;
	pthread_mutex_lock(&t->lock);
	for (;;) {
		s = slot_of(t, hash);
		if (!s) { /* 16 other lists at once: not shared */
			pthread_mutex_unlock(&t->lock);
			return rehash(list, len, 0, mine, mlen, why, whylen);
		}
		/* begun after this fetch asked: as fresh as its own */
		if (s->seq > ticket) {
			int err = take(s, mine, mlen, why, whylen);
			pthread_mutex_unlock(&t->lock);
			return err;
		}
		/* begun before, and the watch says nothing it looked at has changed since. Asked
		 * without t->lock, which every fetch needs; while an arm runs the watch cannot
		 * tell (-EBUSY at once), and this fetch stats instead of waiting for it. */
		if (!disproved && coverable(s, ticket)) {
			unsigned long gen = s->cover_gen, seq = s->seq;
			pthread_mutex_unlock(&t->lock);
			int same = kc_watch_unchanged(&t->watch, gen);
			pthread_mutex_lock(&t->lock);
			s = slot_if_any(t, hash);
			if (same == 1 && s && s->seq == seq && s->cover_gen == gen &&
			    coverable(s, ticket)) {
				t->proven++;
				int err = take(s, mine, mlen, why, whylen);
				pthread_mutex_unlock(&t->lock);
				return err;
			}
			disproved = same != 1;
			if (same == 0 && s && s->cover_gen == gen) /* stale: the next rehash arms again */
				s->cover_gen = 0;
			continue;
		}
		if (!s->running)
			break;
		/* a running one: its result if it began after the ticket, else the next one's */
		pthread_cond_wait(&t->done, &t->lock);
	}
	unsigned long seq = ++t->starts;
	int first = !s->seq; /* the list's first rehash in this process: the memo lacks it */
	s->running = 1;
	t->armer_starts += who == ASK_ARMER;
	pthread_mutex_unlock(&t->lock);

	char m[KC_MANIFEST_COMPACT_MAX] = "", w[sizeof(s->why)] = "";
	size_t ml = 0;
	int err = rehash(list, len, first, m, &ml, w, sizeof(w));

	pthread_mutex_lock(&t->lock);
	s->running = 0; /* the slot stays this list's while running: slot_of skips it */
	s->seq = seq;
	s->err = err;
	memcpy(s->mine, m, sizeof(m));
	s->mine_len = ml;
	memcpy(s->why, w, sizeof(w));
	if (who == ASK_FETCH && !err && !s->cover_gen && (!s->arm_skip || !--s->arm_skip))
		start_armer(t, hash, list, len);
	pthread_cond_broadcast(&t->done);
	pthread_mutex_unlock(&t->lock);
	memcpy(mine, m, sizeof(m));
	*mlen = ml;
	snprintf(why, whylen, "%s", w);
	return err;
}
