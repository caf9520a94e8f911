/* util.h - the small helpers every module shares, written once: a lowercase-hex check,
 * the clocks (monotonic for durations and deadlines, the wall clock for times kept on disk),
 * a stoppable periodic thread, a reader of secret files that wipes what it read, and the
 * order of files by (st_dev, st_ino).
 */
#ifndef KC_UTIL_H
#define KC_UTIL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

/* ---- lowercase hex ---- */

/* 1 when the n bytes at s (not NUL-terminated: s may be inside a larger buffer) are all
 * lowercase hex digits [0-9a-f], else 0. n 0 gives 1. */
int kc_hex_lower(const char *s, size_t n);

/* 1 when s is a NUL-terminated string of exactly n lowercase hex digits; 0 otherwise, and
 * for s NULL. */
int kc_hex_lower_str(const char *s, size_t n);

/* ---- clocks ---- */

/* CLOCK_MONOTONIC now, in seconds (double) or milliseconds: for durations and deadlines,
 * which a step of the wall clock must not stretch or cut. */
double kc_mono_s(void);
int64_t kc_mono_ms(void);

/* CLOCK_MONOTONIC now plus ms, as the absolute time pthread_cond_timedwait takes on a
 * condition initialised with kc_cond_init_mono. */
struct timespec kc_mono_after_ms(unsigned ms);

/* CLOCK_REALTIME now plus ms: a deadline only for calls that take no other clock
 * (pthread_timedjoin_np, a condition on the default clock), kept short, as a step of the
 * wall clock stretches or cuts it. */
struct timespec kc_wall_after_ms(unsigned ms);

/* Initialise cond on CLOCK_MONOTONIC (its timed waits then take kc_mono_after_ms times).
 * Returns 0 or the positive error of pthread_cond_init. */
int kc_cond_init_mono(pthread_cond_t *cond);

/* CLOCK_REALTIME now in milliseconds since the epoch: only for times that outlive the
 * process or meet file times (an entry's last use, persisted in an xattr and compared with
 * its cubin's mtime); never for a deadline. */
int64_t kc_wall_ms(void);

/* ---- a stoppable periodic thread ---- */

/* What a tick returns instead of a delay: wait for kc_ticker_wake (or the stop). */
#define KC_TICK_IDLE (-1L)

/* One thread that runs tick(arg) again and again: before the first tick it waits first_ms,
 * and then what each tick returns: milliseconds (CLOCK_MONOTONIC), 0 for at once, or
 * KC_TICK_IDLE. A wake ends the wait early (one wake, given while a tick runs, ends the next
 * wait). The stop ends any wait at once; a tick in progress finishes first (a long one can
 * poll kc_ticker_stopping). The struct is the caller's; all fields are the ticker's. */
struct kc_ticker {
	pthread_t thread;
	pthread_mutex_t mu;
	pthread_cond_t cv; /* CLOCK_MONOTONIC */
	long (*tick)(void *arg);
	void *arg;
	long first_ms;
	int stop, woken, started;
};

/* Start t's thread. Returns 0, or -errno (EAGAIN, ENOMEM: t is then not started, and
 * kc_ticker_stop on it does nothing). */
int kc_ticker_start(struct kc_ticker *t, long first_ms, long (*tick)(void *arg), void *arg);

/* End t's current or next wait early. Any thread, any lock held but a tick's own. */
void kc_ticker_wake(struct kc_ticker *t);

/* 1 once kc_ticker_stop was called on t (for a long tick to give up early), else 0. */
int kc_ticker_stopping(struct kc_ticker *t);

/* Stop t's thread and join it (the tick in progress finishes); frees what start set up.
 * Does nothing on a ticker never started, or stopped already. Not from the tick itself. */
void kc_ticker_stop(struct kc_ticker *t);

/* ---- secret files ---- */

/* Read the secret file path: a regular file (a symbolic link is refused), owned by root or
 * by this process's effective user, that group and others may not access (no bit of mode
 * 077), of at most max bytes. Trailing newlines (\n, \r) are not part of the secret. On 0,
 * *out is a malloc'd buffer of *len bytes followed by a NUL byte (the secret may hold NUL
 * bytes itself), to be given back with kc_secret_free. what names the option in why (e.g.
 * "remote_auth"); why never holds the secret. Every copy of the bytes read is wiped,
 * whatever the outcome. Returns 0; -EINVAL with why for a file that breaks a rule, or over
 * max bytes; -errno (ENOENT, EACCES, ELOOP, EIO...) with why when it cannot be opened or
 * read; -ENOMEM. */
int kc_secret_read(const char *what, const char *path, size_t max, char **out, size_t *len,
		   char *why, size_t whylen);

/* Wipe the len bytes of a secret (and the NUL after them) and free it. s may be NULL. */
void kc_secret_free(char *s, size_t len);

/* ---- file identity ---- */

/* Order of files by (dev, ino): <0, 0 or >0 as (da, ia) sorts before, with or after
 * (db, ib). For the comparators of tables keyed by a file's identity. */
int kc_file_id_cmp(dev_t da, ino_t ia, dev_t db, ino_t ib);

#endif
