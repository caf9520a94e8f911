/* flight.h - the single-flight table: at most one compile in flight per entry, and the
 * waiters that get its result.
 *
 * The idea is CernVM-FS's fetcher (cvmfs/fetch.h): concurrent requests for one object
 * collapse into one download, and every waiter is signalled with the result or the error.
 * Waiters are plain structs owned by the caller; nothing here sleeps, so a waiter holds no
 * thread while it waits.
 */
#ifndef KC_FLIGHT_H
#define KC_FLIGHT_H

#include <pthread.h>
#include <sys/types.h>

struct kc_waiter;
/* Called once with the flight's result (0, or -errno) from the thread that finished it,
 * after the waiter has left the table; the waiter may be freed inside. */
typedef void (*kc_waiter_fn)(struct kc_waiter *w, int result);

struct kc_waiter {
	struct kc_waiter *next; /* owned by the table while queued */
	kc_waiter_fn done;
	int fetch_only; /* waits for a fetch only: served with -EINPROGRESS when its flight
			 * goes on to compile (kc_flight_compiling) */
	int internal;   /* a thread of the daemon waits (a client's compile for a compile
			 * ahead), not a request: kc_flight_sweep leaves it */
};

struct kc_flight_key {
	dev_t dev; /* the entry directory on the backing filesystem */
	ino_t ino;
};

struct kc_flight;

struct kc_flight_table {
	pthread_mutex_t lock;
	struct kc_flight *head; /* few at a time: at most one per entry being compiled */
	unsigned count;
};

/* kc_flight_join results; a recheck that finds the work done returns KC_FLIGHT_DONE (it
 * must never return JOINED or LEADER, which would say the waiter was queued). */
enum { KC_FLIGHT_JOINED = 1, KC_FLIGHT_LEADER = 2, KC_FLIGHT_DONE = 3 };

void kc_flight_table_init(struct kc_flight_table *t);
void kc_flight_table_destroy(struct kc_flight_table *t);

/* Queue w on the flight for key. If none is in flight, recheck(arg) runs under the table
 * lock (it sees every publish that a finished flight made); a nonzero return is passed
 * back and w is not queued. Otherwise a flight is created with w as its first waiter.
 * w may be NULL: then nothing is queued, only a missing flight is created. A fetch_only w
 * joining a flight that already compiles (kc_flight_compiling) is not queued: its
 * done(-EINPROGRESS) is called before the return (the lock released).
 * Returns KC_FLIGHT_JOINED, KC_FLIGHT_LEADER (the caller must start the work and call
 * kc_flight_finish), recheck's value, or -ENOMEM. */
int kc_flight_join(struct kc_flight_table *t, const struct kc_flight_key *key,
		   struct kc_waiter *w, int (*recheck)(void *arg), void *arg);

/* Queue w on the flight for key if one is in flight: KC_FLIGHT_JOINED (a fetch_only w on
 * a compiling flight is served -EINPROGRESS instead, as in kc_flight_join); else 0
 * (nothing queued, no flight created). */
int kc_flight_join_running(struct kc_flight_table *t, const struct kc_flight_key *key,
			   struct kc_waiter *w);

/* End the flight for key: remove it, then call every waiter's done(result). Returns the
 * number of waiters served. */
unsigned kc_flight_finish(struct kc_flight_table *t, const struct kc_flight_key *key,
			  int result);

/* The flight for key fetched nothing and goes on to compile: remove its fetch_only
 * waiters and call their done(-EINPROGRESS); those that join it later are served so at
 * once (kc_flight_join). Returns the number served. */
unsigned kc_flight_compiling(struct kc_flight_table *t, const struct kc_flight_key *key);

/* Remove every queued waiter but internal ones for which pred(w, arg) is nonzero (called under the table
 * lock, so w is not served meanwhile) and return them as a list linked by next; their done
 * is not called, the caller owns them. */
struct kc_waiter *kc_flight_sweep(struct kc_flight_table *t,
				  int (*pred)(struct kc_waiter *w, void *arg), void *arg);

/* Run fn(arg) under the table lock if no flight for key exists, so that none starts while
 * it runs (eviction removes an entry this way). Returns fn's value, or -EBUSY when a flight
 * is there. */
int kc_flight_run_if_idle(struct kc_flight_table *t, const struct kc_flight_key *key,
			  int (*fn)(void *arg), void *arg);

/* Number of flights now (for statistics). */
unsigned kc_flight_count(struct kc_flight_table *t);

#endif
