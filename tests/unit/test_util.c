/* test_util.c - the shared helpers (util.h): hex check, clocks, the periodic thread, the
 * secret-file reader and the file-id order. */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hash.h"
#include "tap.h"
#include "util.h"

static char tmpdir[] = "/tmp/kc-test-util-XXXXXX";

static void test_hex(void)
{
	CHECK(kc_hex_lower("0123456789abcdef", 16), "hex: every lowercase digit");
	CHECK(!kc_hex_lower("abcA", 4), "hex: an uppercase digit is refused");
	CHECK(!kc_hex_lower("ab g", 4), "hex: a non-digit is refused");
	CHECK(kc_hex_lower("abXX", 2), "hex: only the n bytes asked are read");
	CHECK(kc_hex_lower_str("00ff", 4), "hex string: exact length");
	CHECK(!kc_hex_lower_str("00ff0", 4), "hex string: longer is refused");
	CHECK(!kc_hex_lower_str("00f", 4), "hex string: shorter is refused");
	CHECK(!kc_hex_lower_str(NULL, 4), "hex string: NULL is refused");
}

static void test_clocks(void)
{
	int64_t a = kc_mono_ms();
	double s = kc_mono_s();
	CHECK(a >= 0 && s >= 0 && kc_mono_ms() >= a, "monotonic clock: never goes back");
	struct timespec t = kc_mono_after_ms(1500), now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	double d = (t.tv_sec - now.tv_sec) + (t.tv_nsec - now.tv_nsec) / 1e9;
	CHECK(d > 1.0 && d <= 1.5 && t.tv_nsec < 1000000000L,
	      "deadline: 1.5 s ahead on the monotonic clock, normalised");
	t = kc_wall_after_ms(1999);
	clock_gettime(CLOCK_REALTIME, &now);
	d = (t.tv_sec - now.tv_sec) + (t.tv_nsec - now.tv_nsec) / 1e9;
	CHECK(d > 1.5 && d <= 1.999 && t.tv_nsec < 1000000000L,
	      "deadline: 2 s ahead on the wall clock, normalised");
	CHECK(kc_wall_ms() / 1000 - time(NULL) <= 1 && time(NULL) - kc_wall_ms() / 1000 <= 1,
	      "wall clock: milliseconds since the epoch");
}

struct counter {
	atomic_int ticks;
	long next;
};

static long count_tick(void *arg)
{
	struct counter *c = arg;
	atomic_fetch_add(&c->ticks, 1);
	return c->next;
}

/* Wait (at most 30 s) until c has ticked at least n times. */
static int ticked(struct counter *c, int n)
{
	for (int i = 0; i < 3000 && atomic_load(&c->ticks) < n; i++)
		usleep(10000);
	return atomic_load(&c->ticks) >= n;
}

static void test_ticker(void)
{
	struct kc_ticker t;
	struct counter c = {0, 1};
	CHECK(kc_ticker_start(&t, 0, count_tick, &c) == 0, "ticker: starts");
	CHECK(ticked(&c, 5), "ticker: ticks again and again");
	kc_ticker_stop(&t);
	int after = atomic_load(&c.ticks);
	usleep(20000);
	CHECK(atomic_load(&c.ticks) == after, "ticker: no tick after the stop returned");
	kc_ticker_stop(&t); /* a second stop does nothing */

	/* A tick far away: a wake runs it now; an idle one waits only for wakes. */
	struct counter w = {0, KC_TICK_IDLE};
	CHECK(kc_ticker_start(&t, 3600 * 1000L, count_tick, &w) == 0, "ticker: starts idle");
	kc_ticker_wake(&t);
	CHECK(ticked(&w, 1), "ticker: a wake ends an hour's wait");
	kc_ticker_wake(&t);
	CHECK(ticked(&w, 2), "ticker: a wake ends an idle wait");
	kc_ticker_stop(&t);
	CHECK(atomic_load(&w.ticks) == 2, "ticker: the stop ends an idle wait without a tick");

	struct kc_ticker never = {0};
	kc_ticker_stop(&never);
	CHECK(1, "ticker: stopping one never started does nothing");
}

static void write_file(const char *path, const void *text, size_t len, mode_t mode)
{
	unlink(path);
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
	if (fd < 0 || write(fd, text, len) != (ssize_t)len)
		perror(path);
	if (fd >= 0)
		close(fd);
	chmod(path, mode);
}

static void test_secret(void)
{
	char path[300], link[300], why[512], *s;
	size_t len;

	snprintf(path, sizeof(path), "%s/secret", tmpdir);
	write_file(path, "k3y\0bytes\r\n\n", 12, 0600);
	CHECK(kc_secret_read("remote_key", path, 64, &s, &len, why, sizeof(why)) == 0 &&
		      len == 9 && memcmp(s, "k3y\0bytes", 9) == 0 && s[9] == '\0',
	      "secret: bytes (NUL among them) without the trailing newlines, NUL-terminated");
	kc_secret_free(s, len);
	kc_secret_free(NULL, 0);

	write_file(path, "k3y", 3, 0640);
	CHECK(kc_secret_read("remote_key", path, 64, &s, &len, why, sizeof(why)) == -EINVAL &&
		      strstr(why, "0640") && strstr(why, "remote_key") && !strstr(why, "k3y") && !s,
	      "secret: group-readable refused, saying the mode and the option, not the secret");
	write_file(path, "k3y", 3, 0604);
	CHECK(kc_secret_read("x", path, 64, &s, &len, why, sizeof(why)) == -EINVAL,
	      "secret: others-readable refused");
	write_file(path, "0123456789", 10, 0600);
	CHECK(kc_secret_read("x", path, 9, &s, &len, why, sizeof(why)) == -EINVAL &&
		      strstr(why, "larger than 9"), "secret: over max refused");
	CHECK(kc_secret_read("x", path, 10, &s, &len, why, sizeof(why)) == 0 && len == 10,
	      "secret: exactly max bytes read");
	kc_secret_free(s, len);

	snprintf(link, sizeof(link), "%s/link", tmpdir);
	CHECK(symlink(path, link) == 0, "secret: a symbolic link made");
	CHECK(kc_secret_read("x", link, 64, &s, &len, why, sizeof(why)) == -ELOOP &&
		      strstr(why, "cannot open"), "secret: a symbolic link refused (ELOOP)");
	CHECK(kc_secret_read("x", tmpdir, 64, &s, &len, why, sizeof(why)) == -EINVAL &&
		      strstr(why, "not a regular file"), "secret: a directory refused");
	snprintf(path, sizeof(path), "%s/none", tmpdir);
	CHECK(kc_secret_read("x", path, 64, &s, &len, why, sizeof(why)) == -ENOENT,
	      "secret: a missing file: -ENOENT");
	if (geteuid() == 0) {
		snprintf(path, sizeof(path), "%s/other", tmpdir);
		write_file(path, "k3y", 3, 0600);
		int err = chown(path, 12345, 12345) == 0
				  ? kc_secret_read("x", path, 64, &s, &len, why, sizeof(why))
				  : -errno;
		CHECK(err == -EINVAL && strstr(why, "uid 12345"),
		      "secret: a file of another user refused");
	}
}

static void test_file_id(void)
{
	CHECK(kc_file_id_cmp(1, 9, 2, 1) < 0, "file id: dev first");
	CHECK(kc_file_id_cmp(2, 1, 1, 9) > 0, "file id: dev first (reversed)");
	CHECK(kc_file_id_cmp(1, 1, 1, 2) < 0 && kc_file_id_cmp(1, 2, 1, 1) > 0,
	      "file id: then ino");
	CHECK(kc_file_id_cmp(3, 4, 3, 4) == 0, "file id: equal");
	CHECK(kc_file_id_cmp(1, (ino_t)-1, 1, 0) > 0, "file id: the largest ino sorts last");
}

/* kc_sha256_fd_sized gives kc_sha256_fd's digest and size whatever expect says: a file
 * that grew or shrank since its stat is read to its end. */
static void test_sha256_sized(void)
{
	static const size_t sizes[] = {0, 100, 65535, 65536, 65537, 200000};
	static char data[200000];
	for (size_t i = 0; i < sizeof(data); i++)
		data[i] = (char)(i * 7 + 3);
	char path[64];
	snprintf(path, sizeof(path), "%s/sized", tmpdir);
	int ok = 1;
	for (size_t k = 0; k < sizeof(sizes) / sizeof(*sizes); k++) {
		int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
		if (fd < 0 || write(fd, data, sizes[k]) != (ssize_t)sizes[k]) {
			ok = 0;
			if (fd >= 0)
				close(fd);
			continue;
		}
		char want[KC_SHA256_HEXLEN + 1], got[KC_SHA256_HEXLEN + 1];
		uint64_t wsize = 0, gsize = 0;
		kc_sha256_buf(data, sizes[k], want);
		/* 65536: a full buffer that ends there, with more after it (a file that grew) */
		int64_t expects[] = {(int64_t)sizes[k], -1, (int64_t)sizes[k] / 2,
				     (int64_t)sizes[k] + 1, 65536};
		for (size_t e = 0; e < sizeof(expects) / sizeof(*expects); e++) {
			memset(got, 0, sizeof(got));
			if (kc_sha256_fd_sized(fd, got, &gsize, expects[e]) != 0 ||
			    strcmp(got, want) != 0 || gsize != sizes[k])
				ok = 0;
		}
		if (kc_sha256_fd(fd, got, &wsize) != 0 || strcmp(got, want) != 0 ||
		    wsize != sizes[k])
			ok = 0;
		close(fd);
	}
	unlink(path);
	CHECK(ok, "sha256 of a file: sized read matches the whole read at 0 B to 200 KB, with "
		  "the size right, unknown, too small (grown since: also by exactly one full "
		  "read) or too large (shrunk since)");
}

int main(void)
{
	if (!mkdtemp(tmpdir)) {
		perror("mkdtemp");
		return 1;
	}
	test_hex();
	test_clocks();
	test_ticker();
	test_secret();
	test_file_id();
	test_sha256_sized();
	char cmd[400];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
	if (system(cmd) != 0)
		perror(cmd);
	return tap_done();
}
