/* test_cache.c - the hub (cache.h) without FUSE: staging into an entry of a real store,
 * lookups, the single-flight compile with its waiters, publish and its verification,
 * remembered rejections, and a corrupt cubin rebuilt. The compiler is the real nvcc behind
 * a wrapper script that counts its runs, can be held at a gate, and rejects sources that
 * say KC_REJECT. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache.h"
#include "config.h"
#include "log.h"
#include "store.h"
#include "tap.h"
#include "tmptree.h"
#include "util.h"

#define NVCC "/usr/local/cuda/bin/nvcc"
#define WAIT_MS 120000 /* the bound of a wait for a compile (busy machines) */

static char base[64], root[128], count_path[128], gate_path[128];
static struct kc_store store;
static struct kc_config cfg;
static struct kc_cache cache;

static const char SOURCE[] =
	"extern \"C\" __global__ void hub(float *x) { x[threadIdx.x] *= 2.0f; }\n";
static const char SOURCE2[] =
	"extern \"C\" __global__ void hub(float *x) { x[threadIdx.x] *= 3.0f; }\n";

/* A waiter that records its result. */
struct test_waiter {
	struct kc_waiter w;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int done, result;
};

static void tw_done(struct kc_waiter *w, int result)
{
	struct test_waiter *t = (struct test_waiter *)w;
	pthread_mutex_lock(&t->mu);
	t->done = 1;
	t->result = result;
	pthread_cond_broadcast(&t->cv);
	pthread_mutex_unlock(&t->mu);
}

static void tw_init(struct test_waiter *t)
{
	memset(t, 0, sizeof(*t));
	t->w.done = tw_done;
	pthread_mutex_init(&t->mu, NULL);
	kc_cond_init_mono(&t->cv);
}

/* Wait (at most WAIT_MS) for t's result; -ETIMEDOUT when it never came. */
static int tw_wait(struct test_waiter *t)
{
	struct timespec until = kc_mono_after_ms(WAIT_MS);
	pthread_mutex_lock(&t->mu);
	while (!t->done && pthread_cond_timedwait(&t->cv, &t->mu, &until) == 0)
		;
	int r = t->done ? t->result : -ETIMEDOUT;
	pthread_mutex_unlock(&t->mu);
	return r;
}

/* Runs of the compiler so far (cubin compiles, not --version). */
static int compiler_runs(void)
{
	FILE *f = fopen(count_path, "r");
	int n = 0, c;
	if (!f)
		return 0;
	while ((c = fgetc(f)) != EOF)
		n += c == '\n';
	fclose(f);
	return n;
}

/* A new entry directory kernel.hub.<tag> in the store; returns its fd (O_RDONLY). */
static int new_entry(const char *tag)
{
	char name[128];
	snprintf(name, sizeof(name), "kernel.hub.%s", tag);
	if (mkdirat(store.root_fd, name, 0755) != 0)
		return -1;
	return openat(store.root_fd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
}

/* Stage bytes as role in the entry, as a writer's close does: a temporary in the store's
 * tmp/, committed by kc_cache_stage. Returns its result. */
static int stage(int entry, enum kc_role role, const char *bytes)
{
	char name[64];
	int fd = kc_store_tmpfile(&store, 0644, name);
	if (fd < 0)
		return fd;
	ssize_t n = write(fd, bytes, strlen(bytes));
	close(fd);
	if (n != (ssize_t)strlen(bytes))
		return -EIO;
	return kc_cache_stage(&cache, role, store.tmp_fd, name, entry);
}

/* Look the entry's cubin up and, when a compile is in flight, wait for it: 0 published,
 * else the lookup's or the waiter's error. */
static int lookup_and_wait(int entry)
{
	struct test_waiter t;
	tw_init(&t);
	int r = kc_cache_lookup_cubin(&cache, entry, &t.w, NULL);
	return r == KC_PENDING ? tw_wait(&t) : r;
}

static int write_compiler(void)
{
	char path[128], text[1024];
	snprintf(path, sizeof(path), "%s/nvcc", base);
	snprintf(text, sizeof(text),
		 "#!/bin/sh\n"
		 "case \"$*\" in *-cubin*) ;; *) exec %s \"$@\";; esac\n"
		 "case \" $* \" in *\" -M \"*) exec %s \"$@\";; esac\n"
		 "echo run >> %s\n"
		 "while [ -e %s ]; do sleep 0.02; done\n"
		 "if grep -q KC_REJECT \"$1\"; then echo \"$1: error: rejected\" >&2; exit 1; fi\n"
		 "exec %s \"$@\"\n",
		 NVCC, NVCC, count_path, gate_path, NVCC);
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0755);
	if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text))
		return -1;
	close(fd);
	chmod(base, 0755);
	cfg.nvcc = strdup(path);
	return 0;
}

static void test_lookup_and_publish(void)
{
	int e = new_entry("0000000000000001");
	CHECK(e >= 0, "an entry");
	CHECK(kc_cache_lookup_cubin(&cache, e, NULL, NULL) == -ENOENT,
	      "nothing staged: -ENOENT, no compile");
	CHECK(!kc_cache_cubin_pending(&cache, e), "nothing staged: no cubin pending");
	CHECK(stage(e, KC_ROLE_SOURCE, SOURCE) == 0, "stage kernel.cu");
	CHECK(stage(e, KC_ROLE_FLAGS, "-O3\n") == 0, "stage kernel.flags");
	CHECK(kc_cache_cubin_pending(&cache, e), "a recipe staged: its cubin is pending");
	CHECK(stage(e, KC_ROLE_SOURCE, SOURCE) == KC_STAGE_KEPT,
	      "the same source again: kept, nothing changes");
	CHECK(stage(e, KC_ROLE_SOURCE, SOURCE2) == -EEXIST, "another source: -EEXIST");

	int runs = compiler_runs();
	CHECK(lookup_and_wait(e) == 0, "lookup: compiled and published, the waiter told 0");
	CHECK(compiler_runs() == runs + 1, "one compiler run");
	CHECK(kc_cache_lookup_cubin(&cache, e, NULL, NULL) == 0, "lookup again: published");
	CHECK(compiler_runs() == runs + 1, "and no other run");
	int fd = openat(e, "kernel.cubin", O_RDONLY | O_CLOEXEC);
	CHECK(fd >= 0 && kc_cache_verify_open(&cache, fd, e) == 0,
	      "the published cubin verifies against its record");
	if (fd >= 0)
		close(fd);
	CHECK(stage(e, KC_ROLE_SOURCE, SOURCE2) == -EEXIST,
	      "a published entry keeps its source: -EEXIST");
	close(e);
}

/* Lookups started together while the compiler is held: one run, every waiter told. */
static void test_single_flight(void)
{
	enum { N = 8 };
	struct test_waiter t[N];
	int e = new_entry("0000000000000002"), pending = 0;
	CHECK(e >= 0 && stage(e, KC_ROLE_SOURCE, SOURCE2) == 0 &&
		      stage(e, KC_ROLE_FLAGS, "-O3\n") == 0, "single-flight: a recipe staged");
	close(open(gate_path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
	int runs = compiler_runs();
	uint64_t waits = atomic_load(&cache.stats.waits);
	for (int i = 0; i < N; i++) {
		tw_init(&t[i]);
		pending += kc_cache_lookup_cubin(&cache, e, &t[i].w, NULL) == KC_PENDING;
	}
	CHECK(pending == N, "8 lookups while it compiles: all pending");
	CHECK(atomic_load(&cache.stats.waits) - waits >= N - 1,
	      "7 of them joined the compile in flight");
	unlink(gate_path);
	int ok = 0;
	for (int i = 0; i < N; i++)
		ok += tw_wait(&t[i]) == 0;
	CHECK(ok == N, "every waiter told 0 once it is published");
	CHECK(compiler_runs() == runs + 1, "one compiler run for all 8");
	close(e);
}

/* A source the compiler rejects: the waiter gets -EIO, and the rejection is remembered
 * (no second run) until the source changes. */
static void test_rejection(void)
{
	int e = new_entry("0000000000000003");
	CHECK(e >= 0 && stage(e, KC_ROLE_SOURCE, "// KC_REJECT\n") == 0 &&
		      stage(e, KC_ROLE_FLAGS, "-O3\n") == 0, "rejection: a recipe staged");
	int runs = compiler_runs();
	uint64_t refused = atomic_load(&cache.stats.rejected_lookups);
	CHECK(lookup_and_wait(e) == -EIO, "a rejected compile: the waiter gets -EIO");
	CHECK(kc_cache_lookup_cubin(&cache, e, NULL, NULL) == -EIO &&
		      atomic_load(&cache.stats.rejected_lookups) == refused + 1,
	      "the next lookup: -EIO from the remembered rejection");
	CHECK(compiler_runs() == runs + 1, "without running the compiler again");
	CHECK(!kc_cache_cubin_pending(&cache, e), "a rejected recipe shows no pending cubin");
	char log[4096] = "";
	int fd = openat(e, "kernel.log", O_RDONLY | O_CLOEXEC);
	ssize_t n = fd >= 0 ? read(fd, log, sizeof(log) - 1) : -1;
	if (fd >= 0)
		close(fd);
	CHECK(n > 0 && strstr(log, "rejected"), "kernel.log holds the compiler's reason");
	close(e);
}

/* A published cubin damaged on disk is refused at open and compiled again. */
static void test_corrupt_rebuilt(void)
{
	int e = new_entry("0000000000000004");
	CHECK(e >= 0 && stage(e, KC_ROLE_SOURCE, SOURCE) == 0 &&
		      stage(e, KC_ROLE_FLAGS, "-O3\n") == 0 && lookup_and_wait(e) == 0,
	      "corrupt: a cubin published");
	int fd = openat(e, "kernel.cubin", O_RDWR | O_CLOEXEC);
	unsigned char byte;
	int damaged = fd >= 0 && pread(fd, &byte, 1, 100) == 1 && (byte ^= 0xff, 1) &&
		      pwrite(fd, &byte, 1, 100) == 1;
	CHECK(damaged, "a byte of it flipped on disk");
	uint64_t corrupt = atomic_load(&cache.stats.corrupt);
	CHECK(fd >= 0 && kc_cache_verify_open(&cache, fd, e) == -EIO &&
		      atomic_load(&cache.stats.corrupt) == corrupt + 1,
	      "verify at open: -EIO, counted corrupt");
	if (fd >= 0)
		close(fd);
	int runs = compiler_runs();
	CHECK(lookup_and_wait(e) == 0 && compiler_runs() == runs + 1,
	      "the next lookup compiles it again from its recipe");
	fd = openat(e, "kernel.cubin", O_RDONLY | O_CLOEXEC);
	CHECK(fd >= 0 && kc_cache_verify_open(&cache, fd, e) == 0, "and the new one verifies");
	if (fd >= 0)
		close(fd);
	close(e);
}

int main(void)
{
	char why[512];

	kc_log_init(0, KC_LOG_WARN);
	if (tmptree_new(base, sizeof(base), "kc-test-cache") != 0)
		return 1;
	snprintf(root, sizeof(root), "%s/root", base);
	snprintf(count_path, sizeof(count_path), "%s/runs", base);
	snprintf(gate_path, sizeof(gate_path), "%s/gate", base);
	if (mkdir(root, 0755) != 0 || kc_store_open(&store, root, why, sizeof(why)) != 0) {
		CHECK(0, "a store");
		return tap_done();
	}
	if (access(NVCC, X_OK) != 0 || write_compiler() != 0) {
		CHECK(0, "the real nvcc behind a counting wrapper");
		return tap_done();
	}
	cfg.arch = strdup("sm_90a");
	cfg.compile_uids_opt = strdup("daemon");
	cfg.jobs = 2;
	cfg.compile_timeout = 120;
	int err = kc_config_resolve(&cfg, why, sizeof(why));
	CHECK(err == 0, "the mount's settings resolve");
	if (err) {
		printf("# %s\n", why);
		return tap_done();
	}
	CHECK(kc_cache_init(&cache, &cfg, &store, NULL) == 0, "the hub starts");

	test_lookup_and_publish();
	test_single_flight();
	test_rejection();
	test_corrupt_rebuilt();

	kc_cache_shutdown(&cache);
	kc_store_close(&store);
	kc_config_free(&cfg);
	CHECK(tmptree_remove(base) == 0, "clean up");
	return tap_done();
}
