/* test_flight.c - the single-flight table. */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "flight.h"
#include "tap.h"

struct test_waiter {
	struct kc_waiter w; /* first: done gets &w */
	int calls;
	int result;
};

static void tw_done(struct kc_waiter *w, int result)
{
	struct test_waiter *t = (struct test_waiter *)w;
	t->calls++;
	t->result = result;
}

static void tw_init(struct test_waiter *t)
{
	memset(t, 0, sizeof(*t));
	t->w.done = tw_done;
	t->result = 12345;
}

static int recheck_calls;
static int recheck_value(void *arg)
{
	recheck_calls++;
	return *(int *)arg;
}

/* Take w off its flight the way the waiter sweeper does (kc_flight_sweep with a predicate
 * that picks w). Returns 1 if w was queued (and is now out), 0 if not. */
static int is_w(struct kc_waiter *w, void *arg)
{
	return w == arg;
}

static int take(struct kc_flight_table *t, struct kc_waiter *w)
{
	struct kc_waiter *out = kc_flight_sweep(t, is_w, w);
	return out == w && !out->next;
}

/* The three results are distinct: a recheck reporting "already done" must never read as
 * "joined" (the waiter would be believed queued and never answered). */
static void test_done_is_not_joined(void)
{
	struct kc_flight_table t;
	struct kc_flight_key a = {.dev = 1, .ino = 300};
	struct test_waiter w;
	int done = KC_FLIGHT_DONE;

	tw_init(&w);
	kc_flight_table_init(&t);
	CHECK(KC_FLIGHT_DONE != KC_FLIGHT_JOINED && KC_FLIGHT_DONE != KC_FLIGHT_LEADER &&
	      KC_FLIGHT_JOINED != KC_FLIGHT_LEADER, "join results are distinct");
	CHECK(kc_flight_join(&t, &a, &w.w, recheck_value, &done) == KC_FLIGHT_DONE,
	      "a recheck that finds the work done returns KC_FLIGHT_DONE");
	CHECK(kc_flight_count(&t) == 0 && take(&t, &w.w) == 0,
	      "and queues nothing");
	kc_flight_table_destroy(&t);
}

static void test_basic(void)
{
	struct kc_flight_table t;
	struct kc_flight_key a = {.dev = 1, .ino = 100}, b = {.dev = 1, .ino = 200};
	struct kc_flight_key a_other_dev = {.dev = 2, .ino = 100};
	struct test_waiter w[6];
	int zero = 0;

	for (int i = 0; i < 6; i++)
		tw_init(&w[i]);
	kc_flight_table_init(&t);
	CHECK(kc_flight_count(&t) == 0, "new table has no flights");

	recheck_calls = 0;
	CHECK(kc_flight_join(&t, &a, &w[0].w, recheck_value, &zero) == KC_FLIGHT_LEADER,
	      "first join is the leader");
	CHECK(recheck_calls == 1, "recheck runs when no flight exists");
	CHECK(kc_flight_count(&t) == 1, "one flight");
	CHECK(kc_flight_join(&t, &a, &w[1].w, recheck_value, &zero) == KC_FLIGHT_JOINED,
	      "second join for the same key joins");
	CHECK(kc_flight_join(&t, &a, &w[2].w, NULL, NULL) == KC_FLIGHT_JOINED,
	      "third join (no recheck) joins");
	CHECK(recheck_calls == 1, "recheck does not run when the flight exists");
	CHECK(kc_flight_count(&t) == 1, "still one flight");

	CHECK(kc_flight_join(&t, &b, &w[3].w, NULL, NULL) == KC_FLIGHT_LEADER,
	      "another key gets its own leader");
	CHECK(kc_flight_join(&t, &a_other_dev, &w[4].w, NULL, NULL) == KC_FLIGHT_LEADER,
	      "same inode on another device is another key");
	CHECK(kc_flight_count(&t) == 3, "three flights");

	CHECK(kc_flight_finish(&t, &a, -EIO) == 3, "finish returns the number of waiters");
	CHECK(w[0].calls == 1 && w[1].calls == 1 && w[2].calls == 1,
	      "every waiter of the flight called exactly once");
	CHECK(w[0].result == -EIO && w[1].result == -EIO && w[2].result == -EIO,
	      "every waiter got the result");
	CHECK(w[3].calls == 0 && w[4].calls == 0, "waiters of other flights not called");
	CHECK(kc_flight_count(&t) == 2, "two flights after one finished");
	CHECK(kc_flight_finish(&t, &a, 0) == 0, "finishing it again serves nobody");
	CHECK(w[0].calls == 1, "no second call after a second finish");

	/* after finish a new join is leader again */
	tw_init(&w[0]);
	recheck_calls = 0;
	CHECK(kc_flight_join(&t, &a, &w[0].w, recheck_value, &zero) == KC_FLIGHT_LEADER,
	      "join after finish is leader again");
	CHECK(recheck_calls == 1, "recheck runs again for the new flight");
	CHECK(kc_flight_finish(&t, &a, 0) == 1 && w[0].calls == 1 && w[0].result == 0,
	      "the new flight finishes with its one waiter");

	CHECK(kc_flight_finish(&t, &b, 7) == 1 && w[3].result == 7, "finish the second key");
	CHECK(kc_flight_finish(&t, &a_other_dev, 8) == 1 && w[4].result == 8,
	      "finish the other-device key");
	CHECK(kc_flight_count(&t) == 0, "no flights left");
	kc_flight_table_destroy(&t);
}

static void test_recheck(void)
{
	struct kc_flight_table t;
	struct kc_flight_key a = {.dev = 3, .ino = 1};
	struct test_waiter w, w2;
	int seven = 7, minus = -ENOENT, zero = 0;

	kc_flight_table_init(&t);
	tw_init(&w);
	tw_init(&w2);
	CHECK(kc_flight_join(&t, &a, &w.w, recheck_value, &seven) == 7,
	      "recheck's nonzero value is returned");
	CHECK(kc_flight_count(&t) == 0, "no flight created when recheck says done");
	CHECK(take(&t, &w.w) == 0, "waiter was not queued");
	CHECK(kc_flight_join(&t, &a, &w.w, recheck_value, &minus) == -ENOENT,
	      "recheck's negative value is returned");
	CHECK(kc_flight_count(&t) == 0, "still no flight");
	CHECK(kc_flight_finish(&t, &a, 0) == 0 && w.calls == 0, "nothing to finish, no call");

	CHECK(kc_flight_join(&t, &a, &w.w, recheck_value, &zero) == KC_FLIGHT_LEADER,
	      "recheck zero: leader");
	CHECK(kc_flight_join(&t, &a, &w2.w, recheck_value, &seven) == KC_FLIGHT_JOINED,
	      "a flight exists: joined even though recheck would say done");
	CHECK(kc_flight_finish(&t, &a, 0) == 2, "both served");
	kc_flight_table_destroy(&t);
}

static void test_take_one(void)
{
	struct kc_flight_table t;
	struct kc_flight_key a = {.dev = 4, .ino = 1}, b = {.dev = 4, .ino = 2};
	struct test_waiter w[5];

	for (int i = 0; i < 5; i++)
		tw_init(&w[i]);
	kc_flight_table_init(&t);
	CHECK(kc_flight_join(&t, &a, &w[0].w, NULL, NULL) == KC_FLIGHT_LEADER, "sweep one: leader");
	kc_flight_join(&t, &a, &w[1].w, NULL, NULL);
	kc_flight_join(&t, &a, &w[2].w, NULL, NULL);
	kc_flight_join(&t, &a, &w[3].w, NULL, NULL);
	CHECK(kc_flight_join(&t, &b, &w[4].w, NULL, NULL) == KC_FLIGHT_LEADER,
	      "sweep one: other key");

	CHECK(take(&t, &w[2].w) == 1, "sweep out a waiter in the middle");
	CHECK(take(&t, &w[2].w) == 0, "sweep it out twice: 0");
	CHECK(take(&t, &w[0].w) == 1, "sweep out the first waiter");
	CHECK(take(&t, &w[4].w) == 1, "sweep out the only waiter of another flight");
	CHECK(kc_flight_count(&t) == 2, "a sweep does not end flights");

	CHECK(kc_flight_finish(&t, &a, 5) == 2, "finish serves only the waiters left");
	CHECK(w[1].calls == 1 && w[3].calls == 1 && w[1].result == 5 && w[3].result == 5,
	      "remaining waiters called once with the result");
	CHECK(w[0].calls == 0 && w[2].calls == 0, "swept waiters never called");
	CHECK(take(&t, &w[1].w) == 0, "sweep out after being served: 0");
	CHECK(kc_flight_finish(&t, &b, 5) == 0 && w[4].calls == 0,
	      "finishing a flight whose waiter left serves nobody");
	CHECK(kc_flight_count(&t) == 0, "sweep one: no flights left");

	struct test_waiter never;
	tw_init(&never);
	CHECK(take(&t, &never.w) == 0, "sweep out a waiter never queued: 0");
	kc_flight_table_destroy(&t);
}

/* A waiter that frees itself (here: marks itself dead) inside done must not break the walk. */
struct self_free_waiter {
	struct kc_waiter w;
	int *calls;
};

static void sf_done(struct kc_waiter *w, int result)
{
	struct self_free_waiter *s = (struct self_free_waiter *)w;
	(void)result;
	(*s->calls)++;
	memset(w, 0xa5, sizeof(*s)); /* scribble over it, as free + reuse would */
}

static void test_free_in_done(void)
{
	struct kc_flight_table t;
	struct kc_flight_key a = {.dev = 5, .ino = 1};
	struct self_free_waiter s[4];
	int calls = 0;

	kc_flight_table_init(&t);
	for (int i = 0; i < 4; i++) {
		s[i].w.done = sf_done;
		s[i].calls = &calls;
		kc_flight_join(&t, &a, &s[i].w, NULL, NULL);
	}
	CHECK(kc_flight_finish(&t, &a, 0) == 4 && calls == 4,
	      "waiters may be destroyed inside done");
	kc_flight_table_destroy(&t);
}

/* Threaded: NTHREADS join one key at once while a finisher keeps finishing it. */
#define NTHREADS 32
#define ROUNDS 50

struct mt_waiter {
	struct kc_waiter w;
	atomic_int calls;
	atomic_int result; /* the finish number that served it */
	int join_ret;
};

static struct kc_flight_table mt_table;
static const struct kc_flight_key mt_key = {.dev = 9, .ino = 9};
static struct mt_waiter mt_w[NTHREADS];
static atomic_int mt_served;  /* done calls */
static atomic_int mt_joined;  /* joins returned */
static pthread_barrier_t mt_barrier;

static void mt_done(struct kc_waiter *w, int result)
{
	struct mt_waiter *m = (struct mt_waiter *)w;
	atomic_store(&m->result, result);
	atomic_fetch_add(&m->calls, 1);
	atomic_fetch_add(&mt_served, 1);
}

static void *mt_joiner(void *arg)
{
	struct mt_waiter *m = arg;
	pthread_barrier_wait(&mt_barrier);
	m->join_ret = kc_flight_join(&mt_table, &mt_key, &m->w, NULL, NULL);
	atomic_fetch_add(&mt_joined, 1);
	return NULL;
}

struct mt_finisher {
	unsigned total;   /* sum of finish returns */
	int finishes;     /* finish calls that served someone */
	int last_id;
};

static void *mt_finish(void *arg)
{
	struct mt_finisher *f = arg;
	int id = 1;
	pthread_barrier_wait(&mt_barrier);
	/* finish until every joiner has joined and every waiter has been served */
	while (atomic_load(&mt_joined) < NTHREADS || atomic_load(&mt_served) < NTHREADS) {
		unsigned n = kc_flight_finish(&mt_table, &mt_key, id);
		if (n) {
			f->total += n;
			f->finishes++;
			id++;
		} else {
			sched_yield();
		}
	}
	f->last_id = id;
	return NULL;
}

static void test_threads(void)
{
	int ok_once = 1, ok_leaders = 1, ok_total = 1, ok_ret = 1, ok_empty = 1;
	int total_leaders = 0, total_finishes = 0;

	for (int round = 0; round < ROUNDS; round++) {
		pthread_t th[NTHREADS], fin;
		struct mt_finisher f = {0};
		int leaders_of[NTHREADS + 2] = {0};

		kc_flight_table_init(&mt_table);
		pthread_barrier_init(&mt_barrier, NULL, NTHREADS + 1);
		atomic_store(&mt_served, 0);
		atomic_store(&mt_joined, 0);
		for (int i = 0; i < NTHREADS; i++) {
			memset(&mt_w[i], 0, sizeof(mt_w[i]));
			mt_w[i].w.done = mt_done;
		}
		for (int i = 0; i < NTHREADS; i++)
			pthread_create(&th[i], NULL, mt_joiner, &mt_w[i]);
		pthread_create(&fin, NULL, mt_finish, &f);
		for (int i = 0; i < NTHREADS; i++)
			pthread_join(th[i], NULL);
		pthread_join(fin, NULL);

		int leaders = 0;
		for (int i = 0; i < NTHREADS; i++) {
			int calls = atomic_load(&mt_w[i].calls);
			int id = atomic_load(&mt_w[i].result);
			if (calls != 1)
				ok_once = 0;
			if (mt_w[i].join_ret != KC_FLIGHT_LEADER && mt_w[i].join_ret != KC_FLIGHT_JOINED)
				ok_ret = 0;
			if (mt_w[i].join_ret == KC_FLIGHT_LEADER) {
				leaders++;
				if (id >= 1 && id <= NTHREADS)
					leaders_of[id]++;
			}
		}
		/* each finish that served someone ended a flight that had exactly one leader */
		for (int id = 1; id < f.last_id; id++)
			if (leaders_of[id] != 1)
				ok_leaders = 0;
		if (leaders != f.finishes)
			ok_leaders = 0;
		if (f.total != NTHREADS || atomic_load(&mt_served) != NTHREADS)
			ok_total = 0;
		if (kc_flight_count(&mt_table) != 0)
			ok_empty = 0;
		total_leaders += leaders;
		total_finishes += f.finishes;
		pthread_barrier_destroy(&mt_barrier);
		kc_flight_table_destroy(&mt_table);
	}
	CHECK(ok_ret, "threads: every join returned LEADER or JOINED");
	CHECK(ok_once, "threads: every waiter called exactly once");
	CHECK(ok_leaders, "threads: exactly one leader per flight");
	CHECK(ok_total, "threads: finish counts add up to the number of waiters");
	CHECK(ok_empty, "threads: no flight left behind");
	printf("# %d rounds: %d flights, %d leaders\n", ROUNDS, total_finishes, total_leaders);
}

/* kc_flight_join_running queues only on a flight in flight, and starts none. */
static void test_join_running(void)
{
	struct kc_flight_table t;
	struct kc_flight_key a = {.dev = 1, .ino = 400};
	struct test_waiter w[3];
	int zero = 0;

	for (int i = 0; i < 3; i++)
		tw_init(&w[i]);
	kc_flight_table_init(&t);
	CHECK(kc_flight_join_running(&t, &a, &w[0].w) == 0 && kc_flight_count(&t) == 0,
	      "join_running: no flight, nothing queued, none started");
	CHECK(kc_flight_join(&t, &a, &w[1].w, recheck_value, &zero) == KC_FLIGHT_LEADER,
	      "join_running: a leader starts one");
	CHECK(kc_flight_join_running(&t, &a, &w[2].w) == KC_FLIGHT_JOINED &&
	      kc_flight_count(&t) == 1, "join_running: joins the flight in flight");
	CHECK(kc_flight_finish(&t, &a, -EAGAIN) == 2 && w[2].calls == 1 && w[2].result == -EAGAIN &&
	      w[0].calls == 0, "join_running: its waiter gets the result, the unqueued one none");
	CHECK(kc_flight_join_running(&t, &a, &w[0].w) == 0, "join_running: none after the finish");
	kc_flight_table_destroy(&t);
}

/* A flight that goes on to compile serves its fetch-only waiters (parked lookups) with
 * -EINPROGRESS at once, and only those, and only its own: the others wait for the result. */
static void test_compiling(void)
{
	struct kc_flight_table t;
	struct kc_flight_key a = {.dev = 6, .ino = 1}, b = {.dev = 6, .ino = 2};
	struct test_waiter w[5];
	int zero = 0;

	for (int i = 0; i < 5; i++)
		tw_init(&w[i]);
	w[1].w.fetch_only = w[3].w.fetch_only = w[4].w.fetch_only = 1;
	kc_flight_table_init(&t);
	CHECK(kc_flight_compiling(&t, &a) == 0, "compiling: no flight, none served");
	CHECK(kc_flight_join(&t, &a, &w[0].w, recheck_value, &zero) == KC_FLIGHT_LEADER &&
	      kc_flight_join(&t, &a, &w[1].w, recheck_value, &zero) == KC_FLIGHT_JOINED &&
	      kc_flight_join(&t, &a, &w[2].w, recheck_value, &zero) == KC_FLIGHT_JOINED &&
	      kc_flight_join(&t, &a, &w[3].w, recheck_value, &zero) == KC_FLIGHT_JOINED &&
	      kc_flight_join(&t, &b, &w[4].w, recheck_value, &zero) == KC_FLIGHT_LEADER,
	      "compiling: five waiters on two flights");
	CHECK(kc_flight_compiling(&t, &a) == 2 && w[1].calls == 1 && w[1].result == -EINPROGRESS &&
	      w[3].calls == 1 && w[3].result == -EINPROGRESS,
	      "compiling: the flight's fetch-only waiters are served -EINPROGRESS");
	CHECK(w[0].calls == 0 && w[2].calls == 0 && w[4].calls == 0 && kc_flight_count(&t) == 2,
	      "compiling: the others, and the other flight's, still wait");
	CHECK(kc_flight_compiling(&t, &a) == 0, "compiling: a second call serves none");
	CHECK(kc_flight_finish(&t, &a, 0) == 2 && w[0].calls == 1 && w[0].result == 0 &&
	      w[2].calls == 1 && w[1].calls == 1 && w[3].calls == 1,
	      "compiling: the finish serves the rest once, the served ones not again");
	CHECK(kc_flight_finish(&t, &b, -EIO) == 1 && w[4].result == -EIO,
	      "compiling: a fetch-only waiter of a flight that ends gets its result");
	kc_flight_table_destroy(&t);
}

/* A fetch-only waiter (a parked lookup) that joins a flight after it went on to compile has
 * nothing to wait for: it is served -EINPROGRESS at once, not left for the sweeper; other
 * waiters still queue, and a later flight of the same key starts fetching again. */
static void test_join_after_compiling(void)
{
	struct kc_flight_table t;
	struct kc_flight_key a = {.dev = 7, .ino = 1};
	struct test_waiter w[5];
	int zero = 0;

	for (int i = 0; i < 5; i++)
		tw_init(&w[i]);
	w[1].w.fetch_only = w[2].w.fetch_only = w[4].w.fetch_only = 1;
	kc_flight_table_init(&t);
	CHECK(kc_flight_join(&t, &a, &w[0].w, recheck_value, &zero) == KC_FLIGHT_LEADER &&
	      kc_flight_compiling(&t, &a) == 0, "late join: a flight that compiles");
	CHECK(kc_flight_join(&t, &a, &w[1].w, recheck_value, &zero) == KC_FLIGHT_JOINED &&
	      w[1].calls == 1 && w[1].result == -EINPROGRESS,
	      "late join: a fetch-only waiter is served -EINPROGRESS at once");
	CHECK(kc_flight_join_running(&t, &a, &w[2].w) == KC_FLIGHT_JOINED && w[2].calls == 1 &&
	      w[2].result == -EINPROGRESS, "late join: join_running serves it so too");
	CHECK(kc_flight_join(&t, &a, &w[3].w, recheck_value, &zero) == KC_FLIGHT_JOINED &&
	      w[3].calls == 0, "late join: another waiter queues");
	CHECK(kc_flight_finish(&t, &a, 0) == 2 && w[0].calls == 1 && w[3].calls == 1 &&
	      w[1].calls == 1 && w[2].calls == 1,
	      "late join: the finish serves the queued ones, the served ones not again");
	CHECK(kc_flight_join(&t, &a, &w[0].w, recheck_value, &zero) == KC_FLIGHT_LEADER &&
	      kc_flight_join(&t, &a, &w[4].w, recheck_value, &zero) == KC_FLIGHT_JOINED &&
	      w[4].calls == 0, "late join: a new flight of the key may fetch: it queues");
	CHECK(kc_flight_finish(&t, &a, 0) == 2 && w[4].calls == 1 && w[4].result == 0,
	      "late join: and gets the fetch's result");
	kc_flight_table_destroy(&t);
}

int main(void)
{
	test_basic();
	test_join_running();
	test_compiling();
	test_join_after_compiling();
	test_done_is_not_joined();
	test_recheck();
	test_take_one();
	test_free_in_done();
	test_threads();
	return tap_done();
}
