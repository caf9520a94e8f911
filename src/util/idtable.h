/* idtable.h - a table of 64-bit ids for objects a peer holds by number (the kernel's file
 * and directory handles, fuse_file_info.fh): generation << 32 | slot, so that an id names
 * the same object in another process given the table (a live upgrade), and an id whose
 * slot was freed reads as unknown rather than as whatever reused the memory.
 *
 * Owns: nothing it points to. Thread-safe (one mutex).
 */
#ifndef KC_IDTABLE_H
#define KC_IDTABLE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

struct kc_idslot {
	void *p;      /* NULL: free */
	uint32_t gen; /* generation of the object in it, or of the last one */
	int kind;     /* the caller's tag */
};

/* A generation carries the epoch of the daemon that handed it out in its high
 * KC_EPOCH_BITS bits, and a count of that slot's uses in the rest. A daemon restarted on a
 * mount the kernel still holds ids of a dead one on (holder.h) runs in another epoch, so it
 * never hands out an id (slot, generation) that the dead one may have: a request naming an
 * old id reads as unknown, never as another object. Epoch 0 is a daemon's first. */
#define KC_EPOCH_BITS 12u
#define KC_EPOCH_MASK ((1u << KC_EPOCH_BITS) - 1)
#define KC_GEN_COUNT_BITS (32u - KC_EPOCH_BITS)

/* The generation after prev in epoch (never 0: generation 0 marks fixed ids). */
static inline uint32_t kc_gen_next(uint32_t prev, uint32_t epoch)
{
	uint32_t count = prev >> KC_GEN_COUNT_BITS == (epoch & KC_EPOCH_MASK)
				 ? (prev + 1) & ((1u << KC_GEN_COUNT_BITS) - 1) : 1;
	return (epoch & KC_EPOCH_MASK) << KC_GEN_COUNT_BITS | (count ? count : 1);
}

struct kc_idtable {
	pthread_mutex_t lock;
	uint32_t epoch;      /* of the ids it hands out (kc_gen_next); set before the first */
	struct kc_idslot *v; /* slots 1..n-1 (0 is never used: id 0 means none) */
	uint32_t n, cap;
	uint32_t *free;      /* free slots, a stack */
	size_t nfree, capfree;
};

void kc_idtable_init(struct kc_idtable *t);
/* Free the table (not the objects). */
void kc_idtable_destroy(struct kc_idtable *t);
/* A new id for p (not NULL) with the caller's kind. Returns it, or 0 on ENOMEM. */
uint64_t kc_idtable_add(struct kc_idtable *t, void *p, int kind);
/* The object of id if it is there with kind, else NULL. */
void *kc_idtable_get(struct kc_idtable *t, uint64_t id, int kind);
/* Nonzero when id is there, of any kind. */
int kc_idtable_has(struct kc_idtable *t, uint64_t id);
/* Forget id (no effect when it is not there). */
void kc_idtable_remove(struct kc_idtable *t, uint64_t id);
/* Put p under exactly id (restoring a table in another process). Returns 0, -EEXIST when
 * the slot holds an object, -EINVAL for id 0, -ENOMEM. Slots below it that were never
 * used become free. */
int kc_idtable_put(struct kc_idtable *t, uint64_t id, void *p, int kind);
/* Call fn(id, p, kind, arg) for every object, under the lock (fn must not call the
 * table); stops at and returns the first nonzero return, else 0. */
int kc_idtable_foreach(struct kc_idtable *t, int (*fn)(uint64_t id, void *p, int kind, void *arg),
		       void *arg);

#endif
