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

void kc_rehash_destroy(struct kc_rehash_table *t)
{
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

/* The rehash itself: this node's compact manifest of list/len. */
static int rehash(const char *list, size_t len, char mine[KC_MANIFEST_COMPACT_MAX],
		  size_t *mlen, char *why, size_t whylen)
{
	char *full = NULL;
	size_t full_len = 0;
	int err = kc_manifest_rehash(list, len, &full, &full_len, why, whylen);
	if (!err)
		err = kc_manifest_compact(full, full_len, mine, mlen);
	free(full);
	return err;
}

/* The slot of hash (t->lock held): its own, else an empty or idle one taken for it (its
 * past result dropped); NULL when every slot is running another list's rehash. */
static struct kc_rehash_slot *slot_of(struct kc_rehash_table *t, const char *hash)
{
	for (int i = 0; i < KC_REHASH_SLOTS; i++)
		if (strcmp(t->slots[i].hash, hash) == 0)
			return &t->slots[i];
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

int kc_rehash_own(struct kc_rehash_table *t, unsigned long ticket, const char *hash,
		  const char *list, size_t len, char mine[KC_MANIFEST_COMPACT_MAX], size_t *mlen,
		  char *why, size_t whylen)
{
	struct kc_rehash_slot *s;
	pthread_mutex_lock(&t->lock);
	for (;;) {
		s = slot_of(t, hash);
		if (!s) { /* 16 other lists at once: not shared */
			pthread_mutex_unlock(&t->lock);
			return rehash(list, len, mine, mlen, why, whylen);
		}
		/* begun after this fetch asked: as fresh as its own; or begun before, and the
		 * watch says nothing it looked at has changed since (a success only) */
		int proven = s->seq && s->seq <= ticket && !s->running && !s->err &&
			     kc_watch_unchanged(&t->watch, s->watched);
		if (s->seq > ticket || proven) {
			int err = s->err;
			t->proven += (unsigned long)proven;
			memcpy(mine, s->mine, sizeof(s->mine));
			*mlen = s->mine_len;
			snprintf(why, whylen, "%s", s->why);
			pthread_mutex_unlock(&t->lock);
			return err;
		}
		if (!s->running)
			break;
		/* a running one: its result if it began after the ticket, else the next one's */
		pthread_cond_wait(&t->done, &t->lock);
	}
	unsigned long seq = ++t->starts;
	s->running = 1;
	pthread_mutex_unlock(&t->lock);

	char m[KC_MANIFEST_COMPACT_MAX] = "", w[sizeof(s->why)] = "";
	size_t ml = 0;
	/* A header read for its hash raises IN_OPEN on its watch, which would end the word of
	 * the very rehash that read it (a joining node's first fetches then armed and rehashed
	 * a second time while the others waited). So the arm itself reads the headers the
	 * memo lacks, through the descriptor it opens for each one's lease (an open it tells
	 * from others'), and the stats after it open none. */
	unsigned long watched = kc_watch_arm(&t->watch, list, len, kc_manifest_memo_fill);
	int err = rehash(list, len, m, &ml, w, sizeof(w));

	pthread_mutex_lock(&t->lock);
	s->running = 0; /* the slot stays this list's while running: slot_of skips it */
	s->seq = seq;
	s->err = err;
	s->watched = watched;
	memcpy(s->mine, m, sizeof(m));
	s->mine_len = ml;
	memcpy(s->why, w, sizeof(w));
	pthread_cond_broadcast(&t->done);
	pthread_mutex_unlock(&t->lock);
	memcpy(mine, m, sizeof(m));
	*mlen = ml;
	snprintf(why, whylen, "%s", w);
	return err;
}
