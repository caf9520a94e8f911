/* idtable.c - see idtable.h */
#include "idtable.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

void kc_idtable_init(struct kc_idtable *t)
{
	memset(t, 0, sizeof(*t));
	pthread_mutex_init(&t->lock, NULL);
	t->n = 1;
}

void kc_idtable_destroy(struct kc_idtable *t)
{
	free(t->v);
	free(t->free);
	pthread_mutex_destroy(&t->lock);
	memset(t, 0, sizeof(*t));
}

/* Make slots up to slot exist (lock held). Returns 0 or -ENOMEM. */
static int grow(struct kc_idtable *t, uint32_t slot)
{
	if (slot < t->cap)
		return 0;
	uint32_t cap = t->cap ? t->cap : 64;
	while (cap <= slot)
		cap *= 2;
	struct kc_idslot *v = realloc(t->v, cap * sizeof(*v));
	if (!v)
		return -ENOMEM;
	memset(v + t->cap, 0, (cap - t->cap) * sizeof(*v));
	t->v = v;
	t->cap = cap;
	return 0;
}

static int push_free(struct kc_idtable *t, uint32_t slot)
{
	if (t->nfree == t->capfree) {
		size_t cap = t->capfree ? t->capfree * 2 : 64;
		uint32_t *f = realloc(t->free, cap * sizeof(*f));
		if (!f)
			return -ENOMEM;
		t->free = f;
		t->capfree = cap;
	}
	t->free[t->nfree++] = slot;
	return 0;
}

uint64_t kc_idtable_add(struct kc_idtable *t, void *p, int kind)
{
	pthread_mutex_lock(&t->lock);
	uint32_t slot;
	if (t->nfree) {
		slot = t->free[--t->nfree];
	} else {
		if (t->n == UINT32_MAX || grow(t, t->n) != 0) {
			pthread_mutex_unlock(&t->lock);
			return 0;
		}
		slot = t->n++;
	}
	struct kc_idslot *s = &t->v[slot];
	s->gen = kc_gen_next(s->gen, t->epoch);
	s->p = p;
	s->kind = kind;
	uint64_t id = (uint64_t)s->gen << 32 | slot;
	pthread_mutex_unlock(&t->lock);
	return id;
}

/* The object of id with kind (any kind: -1), or NULL. */
static void *lookup(struct kc_idtable *t, uint64_t id, int kind)
{
	uint32_t slot = (uint32_t)id, gen = (uint32_t)(id >> 32);
	void *p = NULL;
	pthread_mutex_lock(&t->lock);
	if (slot && slot < t->n && t->v[slot].p && t->v[slot].gen == gen &&
	    (kind < 0 || t->v[slot].kind == kind))
		p = t->v[slot].p;
	pthread_mutex_unlock(&t->lock);
	return p;
}

void *kc_idtable_get(struct kc_idtable *t, uint64_t id, int kind)
{
	return kind < 0 ? NULL : lookup(t, id, kind);
}

int kc_idtable_has(struct kc_idtable *t, uint64_t id)
{
	return lookup(t, id, -1) != NULL;
}

void kc_idtable_remove(struct kc_idtable *t, uint64_t id)
{
	uint32_t slot = (uint32_t)id, gen = (uint32_t)(id >> 32);
	pthread_mutex_lock(&t->lock);
	if (slot && slot < t->n && t->v[slot].p && t->v[slot].gen == gen) {
		t->v[slot].p = NULL;
		push_free(t, slot); /* on ENOMEM the slot is not reused: harmless */
	}
	pthread_mutex_unlock(&t->lock);
}

int kc_idtable_put(struct kc_idtable *t, uint64_t id, void *p, int kind)
{
	uint32_t slot = (uint32_t)id, gen = (uint32_t)(id >> 32);
	if (!slot || !p)
		return -EINVAL;
	pthread_mutex_lock(&t->lock);
	int err = grow(t, slot);
	if (!err && t->v[slot].p)
		err = -EEXIST;
	if (!err) {
		/* Slots skipped over become free; the one taken leaves the free stack. */
		for (uint32_t s = t->n; s < slot && !err; s++)
			err = push_free(t, s);
		if (slot >= t->n)
			t->n = slot + 1;
		for (size_t i = 0; i < t->nfree; i++)
			if (t->free[i] == slot) {
				t->free[i] = t->free[--t->nfree];
				break;
			}
		t->v[slot] = (struct kc_idslot){p, gen, kind};
	}
	pthread_mutex_unlock(&t->lock);
	return err;
}

int kc_idtable_foreach(struct kc_idtable *t, int (*fn)(uint64_t id, void *p, int kind, void *arg),
		       void *arg)
{
	int r = 0;
	pthread_mutex_lock(&t->lock);
	for (uint32_t s = 1; s < t->n && !r; s++)
		if (t->v[s].p)
			r = fn((uint64_t)t->v[s].gen << 32 | s, t->v[s].p, t->v[s].kind, arg);
	pthread_mutex_unlock(&t->lock);
	return r;
}
