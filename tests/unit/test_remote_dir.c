/* test_remote_dir.c - the dir: backend of the cluster store on a real temporary directory:
 * the backend contract (remote_contract.c: objects, leases, notes, expiry, races), then
 * what is dir:'s own: a store directory never made, the files' layout and modes, no
 * temporary left, FIFOs and garbage lease files, signed and bounded lease records, the
 * liveness of a holder, watches by polling, the per-operation bound. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "remote.h"
#include "remote_dir.h"
#include "remote_contract.h"
#include "remote_object.h"
#include "tap.h"

static char root[64], store[128];
static struct kc_remote_backend *b;

#define KEY1 "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
#define KEY2 "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"
#define TOK1 "11111111111111111111111111111111"
#define TOK2 "22222222222222222222222222222222"

static void sleep_ms(unsigned ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000l};
	nanosleep(&ts, NULL);
}

/* Entries of dir whose name starts with '.' (temporaries), other than the clock files. */
static int temporaries(const char *dir)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	int n = 0;
	if (!d)
		return 0;
	while ((e = readdir(d)))
		if (e->d_name[0] == '.' && strcmp(e->d_name, ".") && strcmp(e->d_name, "..") &&
		    strncmp(e->d_name, ".clock.", 7))
			n++;
	closedir(d);
	return n;
}

/* Temporaries in the subdirectories of store/area (objects or leases). */
static int temporaries_under(const char *area)
{
	char dir[256];
	snprintf(dir, sizeof(dir), "%s/%s", store, area);
	DIR *d = opendir(dir);
	struct dirent *e;
	int n = 0;
	if (!d)
		return 0;
	while ((e = readdir(d))) {
		char sub[512];
		if (e->d_name[0] == '.')
			continue;
		snprintf(sub, sizeof(sub), "%s/%s", dir, e->d_name);
		n += temporaries(sub);
	}
	closedir(d);
	return n;
}

/* Threads of this process now (entries of /proc/self/task). */
static int threads_now(void)
{
	int n = 0;
	DIR *d = opendir("/proc/self/task");
	for (struct dirent *e; d && (e = readdir(d));)
		n += e->d_name[0] != '.';
	if (d)
		closedir(d);
	return n;
}

static void *get_one(void *arg)
{
	char *data = NULL;
	size_t len = 0;
	intptr_t ok = b->ops->get(b, arg, &data, &len) == 0 && len == 5 &&
		      memcmp(data, "first", 5) == 0;
	free(data);
	return (void *)ok;
}

/* The workers: one stays idle after a call and takes the next; calls at once each get
 * one; idle ones end after a while, and a call after that starts one again. */
static void workers(const char *key)
{
	/* the idle workers of the calls before end: the count holds still for 3 s (2 s idle
	 * and a margin), within 20 s */
	int base = threads_now();
	for (int still = 0, i = 0; still < 30 && i < 200; i++) {
		sleep_ms(100);
		int n = threads_now();
		still = n == base ? still + 1 : 0;
		base = n;
	}
	void *ok = get_one((void *)key);
	CHECK(ok && threads_now() >= base + 1, "a worker stays, idle, after its call");
	int ran = 1;
	for (int i = 0; i < 200; i++)
		ran &= get_one((void *)key) != NULL;
	/* 8 idle, and the last call's worker maybe not back yet */
	CHECK(ran && threads_now() <= base + 9, "200 calls one after another: at most 8 idle workers stay");
	pthread_t t[24];
	int started = 0;
	for (int i = 0; i < 24; i++)
		started += pthread_create(&t[i], NULL, get_one, (void *)key) == 0;
	int all = started == 24;
	for (int i = 0; i < started; i++) {
		void *r = NULL;
		pthread_join(t[i], &r);
		all &= r != NULL;
	}
	CHECK(all, "24 calls at once: each served");
	for (int i = 0; i < 600 && threads_now() > base; i++)
		sleep_ms(10);
	CHECK(threads_now() == base, "idle workers end after 2 s");
	CHECK(get_one((void *)key) != NULL, "a call after that starts a worker again");

	/* a child forked while a worker is idle has no worker of its own: its call starts
	 * one, not queued for the parent's */
	CHECK(get_one((void *)key) != NULL && threads_now() >= base + 1, "a worker idle, then a fork");
	pid_t pid = fork();
	if (pid == 0)
		_exit(get_one((void *)key) != NULL ? 0 : 1);
	int status = -1;
	CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
		      WEXITSTATUS(status) == 0, "the forked child's call is served");
}

int main(void)
{
	char why[300], path[256], *data = NULL;
	size_t len = 0;
	enum kc_lease_state st;
	struct stat sb;

	snprintf(root, sizeof(root), "/tmp/kc-remote-dir-XXXXXX");
	if (!mkdtemp(root))
		return 1;
	snprintf(store, sizeof(store), "%s/store", root);

	/* open */
	CHECK(kc_remote_backend_open("dir:relative/path", NULL, 1000, why, sizeof(why)) == NULL &&
		      errno == EINVAL && strstr(why, "absolute"), "relative dir: path refused");
	CHECK(kc_remote_backend_open("ftp://x", NULL, 1000, why, sizeof(why)) == NULL &&
		      errno == EINVAL && strstr(why, "unknown"), "unknown scheme refused");
	CHECK(kc_remote_backend_open("dir:/x", "/etc/passwd", 1000, why, sizeof(why)) == NULL &&
		      errno == EINVAL, "remote_auth= refused for dir:");
	snprintf(path, sizeof(path), "dir:%s/", store);
	/* A store directory that is not there (a shared filesystem not mounted) is a fault,
	 * never made by the daemon: a private store would share nothing. */
	b = kc_remote_backend_open(path, NULL, 10000, why, sizeof(why));
	CHECK(b != NULL, "open dir: a missing store is not an error at open");
	if (!b)
		return tap_done();
	CHECK(b->ops->put(b, KEY1, "x", 1) < 0 && b->ops->put(b, KEY1, "x", 1) != -EEXIST &&
		      stat(store, &sb) != 0 && errno == ENOENT,
	      "put to a missing store: a fault, and the store is not created");
	CHECK(b->ops->get(b, KEY1, &data, &len) == -EIO,
	      "get from a missing store: a fault (the store is down), not a miss");
	b->ops->destroy(b);
	CHECK(mkdir(store, 0755) == 0, "the operator makes the store");
	b = kc_remote_backend_open(path, NULL, 10000, why, sizeof(why));
	CHECK(b != NULL, "open dir: store");
	if (!b)
		return tap_done();
	CHECK(strcmp(b->ops->describe(b), path) != 0 && strstr(b->ops->describe(b), store),
	      "describe names the directory");

	remote_contract(b, "dir");
	CHECK(temporaries_under("objects") == 0 && temporaries_under("leases") == 0,
	      "no temporary left behind by the contract's puts, takes and races");

	/* objects: read-only files */
	CHECK(b->ops->put(b, KEY1, "first", 5) == 0, "put");
	snprintf(path, sizeof(path), "%s/objects/01/" KEY1, store);
	CHECK(stat(path, &sb) == 0 && (sb.st_mode & 0777) == 0444, "objects are read-only files");
	snprintf(path, sizeof(path), "%s/objects/01", store);
	CHECK(temporaries(path) == 0, "no temporary left behind");

	/* a name that is no regular file, and a stray half-written temporary */
	snprintf(path, sizeof(path), "%s/objects/ab", store);
	mkdir(path, 0755);
	snprintf(path, sizeof(path), "%s/objects/ab/ab%062d", store, 0);
	mkfifo(path, 0644);
	CHECK(b->ops->get(b, path + strlen(path) - 64, &data, &len) == -EPROTO,
	      "a FIFO under a key is a fault, not a hang");
	snprintf(path, sizeof(path), "%s/objects/ab/.ab%062d.tmp.0.1", store, 1);
	close(open(path, O_WRONLY | O_CREAT, 0644));
	CHECK(b->ops->get(b, "ab00000000000000000000000000000000000000000000000000000000000001",
			  &data, &len) == -ENOENT, "a temporary is not an object");

	{ /* garbage in a lease file: held until its mtime passes, then taken over */
		const char *k = "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff";
		snprintf(path, sizeof(path), "%s/leases/ff", store);
		mkdir(path, 0755);
		snprintf(path, sizeof(path), "%s/leases/ff/%s", store, k);
		int fd = open(path, O_WRONLY | O_CREAT, 0644);
		CHECK(fd >= 0 && write(fd, "\x01garbage", 8) == 8, "write a garbage lease");
		close(fd);
		CHECK(remote_wait_state(b, k, KC_LEASE_NONE) &&
			      b->ops->lease_take(b, k, TOK1, 1000, &st) == 0,
		      "a garbage lease expires and is taken over");
	}

	{ /* with a key, only a signed record within its bound stands; others are taken over */
		static const unsigned char sec[] = "0123456789abcdef0123", other_sec[] =
			"fedcba9876543210fedc";
		struct kc_object_secret key = {sec, 20}, other = {other_sec, 20};
		const char *k = "abababababababababababababababababababababababababababababababab";
		char rec[KC_LEASE_RECORD_MAX], line[KC_LEASE_RECORD_MAX + 40];
		struct {
			const struct kc_object_secret *by;
			enum kc_lease_state state;
			unsigned ttl;
			const char *what;
		} planted[] = {
			{NULL, KC_LEASE_HELD, 60000, "an unsigned lease"},
			{NULL, KC_LEASE_FAILED, 4000, "an unsigned failure note"},
			{&other, KC_LEASE_HELD, 60000, "a lease signed with another key"},
			{&other, KC_LEASE_FAILED, 4000, "a note signed with another key"},
			{&key, KC_LEASE_HELD, 61000, "a signed lease over the bound"},
			{&key, KC_LEASE_FAILED, 5001, "a signed note over the bound"},
		};
		b->secret = &key;
		b->held_max_ms = 60000;
		b->note_max_ms = 5000;
		snprintf(path, sizeof(path), "%s/leases/ab", store);
		mkdir(path, 0755);
		snprintf(path, sizeof(path), "%s/leases/ab/%s", store, k);
		for (size_t i = 0; i < sizeof(planted) / sizeof(*planted); i++) {
			int n = kc_lease_record(planted[i].by, k, planted[i].state, TOK2,
						planted[i].ttl, rec);
			FILE *f = fopen(path, "w");
			snprintf(line, sizeof(line), "%s\nalive 0000000000000000\n", rec);
			printf("# planted: %s\n", planted[i].what);
			CHECK(n > 0 && f && fputs(line, f) >= 0 && fclose(f) == 0, "plant it");
			CHECK(b->ops->lease_peek(b, k, &st) == 0 && st == KC_LEASE_NONE,
			      "peek sees none");
			CHECK(b->ops->lease_take(b, k, TOK1, 60000, &st) == 0 &&
				      b->ops->lease_release(b, k, TOK1, 0) == 0, "taken over at once");
		}
		CHECK(b->ops->lease_take(b, k, TOK1, 60000, &st) == 0 &&
			      b->ops->lease_take(b, k, TOK2, 60000, &st) == -EBUSY &&
			      st == KC_LEASE_HELD, "a signed lease of this key stands");
		CHECK(b->ops->lease_release(b, k, TOK1, 4000) == 0 &&
			      b->ops->lease_take(b, k, TOK2, 60000, &st) == -EBUSY &&
			      st == KC_LEASE_FAILED, "and so does its signed failure note");
		CHECK(remote_wait_state(b, k, KC_LEASE_NONE), "which expires");

		/* liveness: a holder that stops renewing is dead after KC_REMOTE_ALIVE_MS of
		 * a taker's clock, whatever its ttl; one that renews lives */
		struct timespec t0, t1;
		CHECK(b->ops->lease_take(b, k, TOK1, 60000, &st) == 0, "take a 60 s lease");
		clock_gettime(CLOCK_MONOTONIC, &t0);
		for (int i = 0; i < 10; i++) {
			sleep_ms(500);
			CHECK(b->ops->lease_renew(b, k, TOK1, 60000) == 0 &&
				      b->ops->lease_take(b, k, TOK2, 60000, &st) == -EBUSY,
			      "renewed every 500 ms: it stands");
		}
		CHECK(b->ops->lease_take(b, k, TOK2, 60000, &st) == -EBUSY, "the holder stops");
		while (b->ops->lease_take(b, k, TOK2, 60000, &st) == -EBUSY)
			sleep_ms(50);
		clock_gettime(CLOCK_MONOTONIC, &t1);
		double gone = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9 - 5;
		printf("# a holder that stopped renewing: taken over %.2f s later\n", gone);
		CHECK(gone >= KC_REMOTE_ALIVE_MS / 1000.0 - 0.6 && gone < 20,
		      "taken over once not heard from for KC_REMOTE_ALIVE_MS, not its 60 s ttl");
		CHECK(b->ops->lease_renew(b, k, TOK1, 60000) == -ENOLCK, "the dead one's renew: -ENOLCK");
		CHECK(b->ops->lease_release(b, k, TOK2, 0) == 0, "released");
		b->secret = NULL;
	}

	/* watches: a stat of the index and lease files every KC_REMOTE_WATCH_POLL_MS */
	{
		const char *k = "7777777777777777777777777777777777777777777777777777777777777777";
		struct kc_remote_watch *w = NULL, *w2 = NULL;
		struct timespec t0, t1;
		CHECK(b->ops->watch_start(b, "0123", &w) == -EINVAL && !w, "watch of a bad key");
		CHECK(b->ops->notify == NULL, "dir: sends no notice: the index file is one");
		CHECK(b->ops->lease_take(b, k, TOK1, 60000, &st) == 0, "a holder takes a key");
		CHECK(b->ops->watch_start(b, k, &w) == 0 && w &&
			      b->ops->watch_start(b, k, &w2) == 0 && w2, "two waiters watch it");
		clock_gettime(CLOCK_MONOTONIC, &t0);
		CHECK(b->ops->watch_wait(b, w, 300) == -ETIMEDOUT, "nothing changed: -ETIMEDOUT");
		clock_gettime(CLOCK_MONOTONIC, &t1);
		double took = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
		CHECK(took >= 0.29 && took < 10, "after the wait asked for");
		CHECK(b->ops->lease_renew(b, k, TOK1, 60000) == 0 &&
			      b->ops->watch_wait(b, w, 300) == -ETIMEDOUT,
		      "a renewal is no notice (it rewrites the lease file in place)");
		CHECK(b->ops->put(b, k, "index", 5) == 0, "the holder stores the index");
		clock_gettime(CLOCK_MONOTONIC, &t0);
		CHECK(b->ops->watch_wait(b, w, 10000) == 0 && b->ops->watch_wait(b, w2, 10000) == 0,
		      "both waiters see it");
		clock_gettime(CLOCK_MONOTONIC, &t1);
		took = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
		printf("# the index seen %.3f s after its put\n", took);
		CHECK(took < 5, "within a few polls");
		CHECK(b->ops->watch_wait(b, w, 200) == -ETIMEDOUT, "a change is seen once");
		CHECK(b->ops->lease_release(b, k, TOK1, 0) == 0 &&
			      b->ops->watch_wait(b, w, 10000) == 0, "a release is a notice too");
		b->ops->watch_end(b, w);
		b->ops->watch_end(b, w2);
	}

	workers(KEY1);

	/* the bound: a put slower than the timeout returns -ETIMEDOUT; its worker finishes on
	 * its own, after the backend was destroyed */
	{
		snprintf(path, sizeof(path), "dir:%s", store);
		struct kc_remote_backend *quick =
			kc_remote_backend_open(path, NULL, 1, why, sizeof(why));
		size_t big = 64u << 20;
		char *buf = malloc(big);
		memset(buf, 'b', big);
		const char *k = "9999999999999999999999999999999999999999999999999999999999999999";
		CHECK(quick && quick->ops->put(quick, k, buf, big) == -ETIMEDOUT,
		      "a 64 MiB put bounded by a 1 ms timeout: -ETIMEDOUT");
		quick->ops->destroy(quick);
		free(buf);
		int seen = 0;
		for (int i = 0; i < 3000 && !seen; i++) {
			if (b->ops->get(b, k, &data, &len) == 0) {
				seen = len == big;
				free(data);
				if (!seen)
					break;
			} else {
				sleep_ms(10);
			}
		}
		CHECK(seen, "the abandoned put completes whole");
	}

	b->ops->destroy(b);
	char cmd[200];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", root);
	CHECK(system(cmd) == 0, "clean up");
	return tap_done();
}
