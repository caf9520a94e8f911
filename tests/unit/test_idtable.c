/* test_idtable.c - handle ids (src/util/idtable.h): generation-tagged slots, stale ids after a
 * remove, kinds kept apart, and a table rebuilt at the same ids (as a live upgrade does). */
#include <errno.h>
#include <stdint.h>

#include "idtable.h"
#include "tap.h"

static int count_one(uint64_t id, void *p, int kind, void *arg)
{
	(void)id;
	(void)p;
	(void)kind;
	++*(int *)arg;
	return 0;
}

int main(void)
{
	struct kc_idtable t;
	int a, b, c;
	kc_idtable_init(&t);
	uint64_t ia = kc_idtable_add(&t, &a, 1), ib = kc_idtable_add(&t, &b, 2);
	CHECK(ia && ib && ia != ib && ia >> 32 >= 1, "two ids, generation at least 1");
	CHECK(kc_idtable_get(&t, ia, 1) == &a && kc_idtable_get(&t, ib, 2) == &b, "ids resolve");
	CHECK(kc_idtable_get(&t, ia, 2) == NULL, "another kind: unknown");
	CHECK(kc_idtable_get(&t, 0, 1) == NULL && kc_idtable_get(&t, 999, 1) == NULL,
	      "0 and an unused slot: unknown");
	kc_idtable_remove(&t, ia);
	CHECK(kc_idtable_get(&t, ia, 1) == NULL, "removed: stale");
	uint64_t ic = kc_idtable_add(&t, &c, 1);
	CHECK((uint32_t)ic == (uint32_t)ia && ic != ia && kc_idtable_get(&t, ia, 1) == NULL &&
	      kc_idtable_get(&t, ic, 1) == &c, "a reused slot gets a new generation");

	/* Rebuilt elsewhere at the same ids. */
	struct kc_idtable u;
	kc_idtable_init(&u);
	CHECK(kc_idtable_put(&u, ib, &b, 2) == 0 && kc_idtable_put(&u, ic, &c, 1) == 0,
	      "put at given ids");
	CHECK(kc_idtable_put(&u, ic, &a, 1) == -EEXIST && kc_idtable_put(&u, 0, &a, 1) == -EINVAL,
	      "a taken slot and id 0 refused");
	CHECK(kc_idtable_get(&u, ib, 2) == &b && kc_idtable_get(&u, ic, 1) == &c,
	      "the same ids resolve in the rebuilt table");
	uint64_t id = kc_idtable_add(&u, &a, 1);
	CHECK(id && id != ib && id != ic && kc_idtable_get(&u, id, 1) == &a,
	      "a new id in the rebuilt table takes no restored one");
	int n = 0;
	kc_idtable_foreach(&u, count_one, &n);
	CHECK(n == 3, "foreach visits every object");

	/* A table of a daemon started again (another epoch) never hands out an id of the
	 * dead one's, which it does not know: those read as unknown. */
	struct kc_idtable v;
	kc_idtable_init(&v);
	v.epoch = 1;
	uint64_t iv = kc_idtable_add(&v, &a, 1);
	CHECK((uint32_t)iv == (uint32_t)ia && iv != ia && iv != ic && kc_idtable_has(&v, iv) &&
	      !kc_idtable_has(&v, ia) && !kc_idtable_has(&v, ic),
	      "another epoch: the same slot, another id; the old ids unknown");
	CHECK(iv >> 32 >> KC_GEN_COUNT_BITS == 1, "the epoch is in the generation's high bits");
	CHECK(kc_gen_next(0, 0) == 1 && kc_gen_next(1, 0) == 2 &&
	      kc_gen_next((1u << KC_GEN_COUNT_BITS) - 1, 0) == 1 &&
	      kc_gen_next(5, 2) == (2u << KC_GEN_COUNT_BITS | 1) &&
	      kc_gen_next(0, KC_EPOCH_MASK + 1) == 1,
	      "generations count within an epoch, never 0, and start again at 1 in another");
	kc_idtable_destroy(&v);
	kc_idtable_destroy(&u);
	kc_idtable_destroy(&t);
	return tap_done();
}
