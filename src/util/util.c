/* util.c - see util.h */
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- lowercase hex ---- */

int kc_hex_lower(const char *s, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
			return 0;
	return 1;
}

int kc_hex_lower_str(const char *s, size_t n)
{
	return s && strnlen(s, n + 1) == n && kc_hex_lower(s, n);
}

/* ---- clocks ---- */

static struct timespec clock_now(clockid_t id)
{
	struct timespec ts;
	clock_gettime(id, &ts);
	return ts;
}

double kc_mono_s(void)
{
	struct timespec ts = clock_now(CLOCK_MONOTONIC);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int64_t kc_mono_ms(void)
{
	struct timespec ts = clock_now(CLOCK_MONOTONIC);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t kc_wall_ms(void)
{
	struct timespec ts = clock_now(CLOCK_REALTIME);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The clock id's now plus ms, normalised. */
static struct timespec after_ms(clockid_t id, unsigned ms)
{
	struct timespec ts = clock_now(id);
	ts.tv_sec += ms / 1000;
	ts.tv_nsec += (long)(ms % 1000) * 1000000L;
	if (ts.tv_nsec >= 1000000000L) {
		ts.tv_sec++;
		ts.tv_nsec -= 1000000000L;
	}
	return ts;
}

struct timespec kc_mono_after_ms(unsigned ms)
{
	return after_ms(CLOCK_MONOTONIC, ms);
}

struct timespec kc_wall_after_ms(unsigned ms)
{
	return after_ms(CLOCK_REALTIME, ms);
}

int kc_cond_init_mono(pthread_cond_t *cond)
{
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	int err = pthread_cond_init(cond, &ca);
	pthread_condattr_destroy(&ca);
	return err;
}

/* ---- a stoppable periodic thread ---- */

static void *ticker_loop(void *arg)
{
	struct kc_ticker *t = arg;
	long wait_ms = t->first_ms;

	pthread_mutex_lock(&t->mu);
	for (;;) {
		if (wait_ms == KC_TICK_IDLE) {
			while (!t->stop && !t->woken)
				pthread_cond_wait(&t->cv, &t->mu);
		} else if (wait_ms > 0) {
			struct timespec until = kc_mono_after_ms((unsigned)wait_ms);
			while (!t->stop && !t->woken &&
			       pthread_cond_timedwait(&t->cv, &t->mu, &until) != ETIMEDOUT)
				;
		}
		if (t->stop)
			break;
		t->woken = 0;
		pthread_mutex_unlock(&t->mu);
		wait_ms = t->tick(t->arg);
		pthread_mutex_lock(&t->mu);
	}
	pthread_mutex_unlock(&t->mu);
	return NULL;
}

int kc_ticker_start(struct kc_ticker *t, long first_ms, long (*tick)(void *arg), void *arg)
{
	*t = (struct kc_ticker){.tick = tick, .arg = arg, .first_ms = first_ms};
	pthread_mutex_init(&t->mu, NULL);
	int err = kc_cond_init_mono(&t->cv);
	if (!err)
		err = pthread_create(&t->thread, NULL, ticker_loop, t);
	if (err) {
		pthread_cond_destroy(&t->cv);
		pthread_mutex_destroy(&t->mu);
		return -err;
	}
	t->started = 1;
	return 0;
}

void kc_ticker_wake(struct kc_ticker *t)
{
	pthread_mutex_lock(&t->mu);
	t->woken = 1;
	pthread_cond_signal(&t->cv);
	pthread_mutex_unlock(&t->mu);
}

int kc_ticker_stopping(struct kc_ticker *t)
{
	return __atomic_load_n(&t->stop, __ATOMIC_RELAXED);
}

void kc_ticker_stop(struct kc_ticker *t)
{
	if (!t->started)
		return;
	pthread_mutex_lock(&t->mu);
	__atomic_store_n(&t->stop, 1, __ATOMIC_RELAXED);
	pthread_cond_signal(&t->cv);
	pthread_mutex_unlock(&t->mu);
	pthread_join(t->thread, NULL);
	pthread_cond_destroy(&t->cv);
	pthread_mutex_destroy(&t->mu);
	t->started = 0;
}

/* ---- secret files ---- */

/* Check the rules on fd's file; 0, or -EINVAL with why. */
static int secret_rules(int fd, const char *what, const char *path, size_t max, char *why,
			size_t whylen)
{
	struct stat st;
	if (fstat(fd, &st) != 0) {
		int err = -errno;
		snprintf(why, whylen, "%s: cannot stat %s: %s", what, path, strerror(errno));
		return err;
	}
	if (!S_ISREG(st.st_mode)) {
		snprintf(why, whylen, "%s: %s is not a regular file", what, path);
		return -EINVAL;
	}
	if (st.st_uid != 0 && st.st_uid != geteuid()) {
		snprintf(why, whylen, "%s: %s is owned by uid %u: it must belong to root (or to "
			 "the daemon's user)", what, path, (unsigned)st.st_uid);
		return -EINVAL;
	}
	if (st.st_mode & 077) {
		snprintf(why, whylen, "%s: %s has mode %04o: group and others may not access it "
			 "(chmod 600)", what, path, (unsigned)(st.st_mode & 07777));
		return -EINVAL;
	}
	if ((uintmax_t)st.st_size > max) {
		snprintf(why, whylen, "%s: %s is larger than %zu bytes", what, path, max);
		return -EINVAL;
	}
	return 0;
}

int kc_secret_read(const char *what, const char *path, size_t max, char **out, size_t *len,
		   char *why, size_t whylen)
{
	size_t got = 0;
	char *buf = NULL;
	int err;

	*out = NULL;
	*len = 0;
	int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
	if (fd < 0) {
		err = -errno;
		snprintf(why, whylen, "%s: cannot open %s: %s", what, path, strerror(errno));
		return err;
	}
	err = secret_rules(fd, what, path, max, why, whylen);
	/* one buffer of max + 1 bytes, never grown: a realloc would leave a copy unwiped */
	if (!err && !(buf = malloc(max + 1)))
		err = -ENOMEM;
	while (!err && got <= max) {
		ssize_t n = read(fd, buf + got, max + 1 - got);
		if (n == 0)
			break;
		if (n > 0) {
			got += (size_t)n;
		} else if (errno != EINTR) {
			err = -errno;
			snprintf(why, whylen, "%s: cannot read %s: %s", what, path,
				 strerror(errno));
		}
	}
	close(fd);
	if (!err && got > max) { /* it grew since fstat */
		snprintf(why, whylen, "%s: %s is larger than %zu bytes", what, path, max);
		err = -EINVAL;
	}
	if (err) {
		kc_secret_free(buf, buf ? max : 0);
		return err;
	}
	while (got && (buf[got - 1] == '\n' || buf[got - 1] == '\r'))
		got--;
	OPENSSL_cleanse(buf + got, max + 1 - got);
	*out = buf;
	*len = got;
	return 0;
}

void kc_secret_free(char *s, size_t len)
{
	if (!s)
		return;
	OPENSSL_cleanse(s, len + 1);
	free(s);
}

/* ---- file identity ---- */

int kc_file_id_cmp(dev_t da, ino_t ia, dev_t db, ino_t ib)
{
	if (da != db)
		return da < db ? -1 : 1;
	return ia < ib ? -1 : ia > ib;
}
