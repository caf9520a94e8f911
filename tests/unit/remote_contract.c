/* remote_contract.c - see remote_contract.h */
#include "remote_contract.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hash.h"
#include "tap.h"

#define TOKA "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
#define TOKB "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
#define WAIT_MS 20000 /* the bound of a wait for an expiry */

static const char *tag_of_run;

/* The key named what in this run: SHA-256 of "contract <tag> <what>". */
static void key_of(const char *what, char key[KC_REMOTE_KEYLEN + 1])
{
	char text[256];
	snprintf(text, sizeof(text), "contract %s %s", tag_of_run, what);
	kc_sha256_buf(text, strlen(text), key);
}

static void nap_ms(unsigned ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

int remote_wait_state(struct kc_remote_backend *b, const char *key, enum kc_lease_state want)
{
	for (int i = 0; i < WAIT_MS / 20; i++) {
		enum kc_lease_state s;
		if (b->ops->lease_peek(b, key, &s) == 0 && s == want)
			return 1;
		nap_ms(20);
	}
	return 0;
}

static void objects(struct kc_remote_backend *b)
{
	char k1[65], k2[65], k3[65], *data = NULL, *big;
	size_t len = 0;
	const size_t BIG = 4u << 20;
	enum kc_lease_state st;

	key_of("obj 1", k1);
	key_of("obj 2", k2);
	key_of("obj 3", k3);
	CHECK(b->ops->get(b, k1, &data, &len) == -ENOENT && !data, "get of a missing key: -ENOENT");
	CHECK(b->ops->put(b, k1, "hello\0world", 11) == 0, "put stores");
	CHECK(b->ops->put(b, k1, "other", 5) == -EEXIST, "a second put of the key: -EEXIST");
	CHECK(b->ops->get(b, k1, &data, &len) == 0 && len == 11 &&
		      !memcmp(data, "hello\0world", 11),
	      "get returns the first put's bytes, NULs included");
	free(data);
	data = NULL;
	CHECK(b->ops->put(b, k2, "", 0) == 0 && b->ops->get(b, k2, &data, &len) == 0 && len == 0,
	      "an empty object round-trips");
	free(data);
	data = NULL;
	big = malloc(BIG);
	for (size_t i = 0; big && i < BIG; i++)
		big[i] = (char)(i * 131 + (i >> 9));
	CHECK(big && b->ops->put(b, k3, big, BIG) == 0, "put of 4 MiB");
	CHECK(big && b->ops->get(b, k3, &data, &len) == 0 && len == BIG && !memcmp(data, big, BIG),
	      "get of 4 MiB returns them exactly");
	free(data);
	data = NULL;
	free(big);
	if (b->ops->replace) {
		CHECK(b->ops->replace(b, k1, "new", 3) == 0 &&
			      b->ops->get(b, k1, &data, &len) == 0 && len == 3 &&
			      !memcmp(data, "new", 3), "replace: the new bytes are read");
		free(data);
		data = NULL;
	}
	CHECK(b->ops->get(b, "ABC", &data, &len) == -EINVAL &&
		      b->ops->get(b, "0123", &data, &len) == -EINVAL &&
		      b->ops->put(b, "../../etc/x", "x", 1) == -EINVAL,
	      "keys that are not 64 lowercase hex: -EINVAL");
	CHECK(b->ops->lease_take(b, k1, "short", 1000, &st) == -EINVAL &&
		      b->ops->lease_take(b, k1, TOKA, 0, &st) == -EINVAL,
	      "a bad token or a zero ttl: -EINVAL");
}

struct racer {
	struct kc_remote_backend *b;
	pthread_barrier_t *bar;
	const char *key;
	char token[KC_REMOTE_TOKENLEN + 1];
	char data[32];
	int result;
	int take; /* 1: lease_take, 0: put */
};

static void *race(void *arg)
{
	struct racer *r = arg;
	enum kc_lease_state s;
	pthread_barrier_wait(r->bar);
	r->result = r->take ? r->b->ops->lease_take(r->b, r->key, r->token, 60000, &s)
			    : r->b->ops->put(r->b, r->key, r->data, strlen(r->data));
	return NULL;
}

/* 16 threads at once; returns how many got 0, *others_ok 1 when the others all got busy. */
static int race_16(struct kc_remote_backend *b, const char *key, int take, int busy,
		   int *others_ok)
{
	pthread_barrier_t bar;
	pthread_t t[16];
	struct racer r[16];
	int won = 0;
	pthread_barrier_init(&bar, NULL, 16);
	for (int i = 0; i < 16; i++) {
		r[i] = (struct racer){.b = b, .bar = &bar, .key = key, .take = take};
		snprintf(r[i].token, sizeof(r[i].token), "%032x", 0xa00 + i);
		snprintf(r[i].data, sizeof(r[i].data), "object of racer %d", i);
		pthread_create(&t[i], NULL, race, &r[i]);
	}
	*others_ok = 1;
	for (int i = 0; i < 16; i++) {
		pthread_join(t[i], NULL);
		if (r[i].result == 0)
			won++;
		else if (r[i].result != busy)
			*others_ok = 0;
	}
	pthread_barrier_destroy(&bar);
	return won;
}

static void races(struct kc_remote_backend *b)
{
	char k[65], *data = NULL;
	size_t len;
	enum kc_lease_state st;
	int ok;

	key_of("racing puts", k);
	CHECK(race_16(b, k, 0, -EEXIST, &ok) == 1 && ok, "16 racing puts: one stored");
	CHECK(b->ops->get(b, k, &data, &len) == 0 && len > 15 &&
		      memcmp(data, "object of racer", 15) == 0, "the winner's object is whole");
	free(data);
	key_of("racing takes", k);
	CHECK(race_16(b, k, 1, -EBUSY, &ok) == 1 && ok, "16 racing takes: one holder");
	CHECK(b->ops->lease_take(b, k, TOKA, 200, &st) == -EBUSY, "held by the winner");
	key_of("racing takeovers", k);
	CHECK(b->ops->lease_take(b, k, TOKA, 200, &st) == 0 &&
		      remote_wait_state(b, k, KC_LEASE_NONE),
	      "an expired lease");
	CHECK(race_16(b, k, 1, -EBUSY, &ok) == 1 && ok,
	      "16 racing takeovers of an expired lease: one holder");
}

static void leases(struct kc_remote_backend *b)
{
	char k[65];
	enum kc_lease_state st = KC_LEASE_NONE;

	key_of("lease", k);
	CHECK(b->ops->lease_peek(b, k, &st) == 0 && st == KC_LEASE_NONE, "peek: nobody holds it");
	CHECK(b->ops->lease_take(b, k, TOKA, 60000, &st) == 0, "A takes the lease");
	st = KC_LEASE_NONE;
	CHECK(b->ops->lease_take(b, k, TOKB, 60000, &st) == -EBUSY && st == KC_LEASE_HELD,
	      "B cannot take it: -EBUSY, held");
	CHECK(b->ops->lease_take(b, k, TOKA, 60000, &st) == -EBUSY, "nor A again");
	CHECK(b->ops->lease_peek(b, k, &st) == 0 && st == KC_LEASE_HELD, "peek: held");
	CHECK(b->ops->lease_renew(b, k, TOKB, 60000) == -ENOLCK, "B cannot renew A's lease");
	CHECK(b->ops->lease_renew(b, k, TOKA, 60000) == 0, "A renews it");
	CHECK(b->ops->lease_release(b, k, TOKB, 0) == -ENOLCK, "B cannot release A's lease");
	CHECK(b->ops->lease_peek(b, k, &st) == 0 && st == KC_LEASE_HELD, "which still stands");
	CHECK(b->ops->lease_release(b, k, TOKA, 0) == 0, "A releases it");
	CHECK(b->ops->lease_peek(b, k, &st) == 0 && st == KC_LEASE_NONE, "released: none");
	CHECK(b->ops->lease_release(b, k, TOKA, 0) == -ENOLCK, "releasing it twice: -ENOLCK");

	/* A failed compile: the note stands for fail_ms, then the key is free again. */
	CHECK(b->ops->lease_take(b, k, TOKA, 60000, &st) == 0 &&
		      b->ops->lease_release(b, k, TOKA, 4000) == 0,
	      "A releases it with a failure note");
	CHECK(b->ops->lease_peek(b, k, &st) == 0 && st == KC_LEASE_FAILED, "peek: failed");
	CHECK(b->ops->lease_take(b, k, TOKB, 60000, &st) == -EBUSY && st == KC_LEASE_FAILED,
	      "B cannot take it while the note stands: -EBUSY, failed");
	CHECK(b->ops->lease_renew(b, k, TOKA, 60000) == -ENOLCK &&
		      b->ops->lease_release(b, k, TOKA, 0) == -ENOLCK,
	      "the note is nobody's lease: renew and release are -ENOLCK");
	CHECK(remote_wait_state(b, k, KC_LEASE_NONE), "the note expires");
	CHECK(b->ops->lease_take(b, k, TOKB, 60000, &st) == 0, "then B takes the lease");

	/* A holder that died: its lease expires, another takes over, the dead one's token no
	 * longer acts. */
	CHECK(b->ops->lease_release(b, k, TOKB, 0) == 0 &&
		      b->ops->lease_take(b, k, TOKA, 300, &st) == 0, "A takes a 300 ms lease");
	CHECK(remote_wait_state(b, k, KC_LEASE_NONE), "it expires unrenewed");
	CHECK(b->ops->lease_take(b, k, TOKB, 60000, &st) == 0, "B takes it over");
	CHECK(b->ops->lease_renew(b, k, TOKA, 60000) == -ENOLCK &&
		      b->ops->lease_release(b, k, TOKA, 5000) == -ENOLCK,
	      "A's late renew and release: -ENOLCK");
	CHECK(b->ops->lease_peek(b, k, &st) == 0 && st == KC_LEASE_HELD &&
		      b->ops->lease_release(b, k, TOKB, 0) == 0, "B's lease was untouched");

	key_of("standing note", k);
	CHECK(b->ops->lease_take(b, k, TOKA, 60000, &st) == 0 &&
		      b->ops->lease_release(b, k, TOKA, 60000) == 0 &&
		      b->ops->lease_take(b, k, TOKB, 60000, &st) == -EBUSY && st == KC_LEASE_FAILED,
	      "a standing note: take says failed");
}

struct thr_arg {
	struct kc_remote_backend *b;
	int id, fails;
};

static void *thr_main(void *p)
{
	struct thr_arg *t = p;
	char key[65], what[32], val[80], *data;
	size_t len;

	for (int i = 0; i < 100; i++) {
		snprintf(what, sizeof(what), "thread %d %d", t->id, i);
		key_of(what, key);
		snprintf(val, sizeof(val), "value %d %d", t->id, i);
		if (t->b->ops->put(t->b, key, val, strlen(val)) != 0)
			t->fails++;
		data = NULL;
		if (t->b->ops->get(t->b, key, &data, &len) != 0 || len != strlen(val) ||
		    memcmp(data, val, len))
			t->fails++;
		free(data);
	}
	return NULL;
}

static void threads(struct kc_remote_backend *b)
{
	struct thr_arg a[8];
	pthread_t th[8];
	int fails = 0;

	for (int i = 0; i < 8; i++) {
		a[i] = (struct thr_arg){.b = b, .id = i};
		pthread_create(&th[i], NULL, thr_main, &a[i]);
	}
	for (int i = 0; i < 8; i++) {
		pthread_join(th[i], NULL);
		fails += a[i].fails;
	}
	CHECK(fails == 0, "8 threads x 100 puts and gets on one backend: every one right");
}

void remote_contract(struct kc_remote_backend *b, const char *tag)
{
	tag_of_run = tag;
	printf("# the backend contract on %s\n", b->ops->describe(b));
	objects(b);
	races(b);
	leases(b);
	threads(b);
}
