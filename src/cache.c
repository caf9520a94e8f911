/* cache.c - see cache.h */
#define _GNU_SOURCE
#include "cache.h"

#include <errno.h>
#include <fcntl.h>
#include <search.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#include "compile.h"
#include "io.h"
#include "key.h"
#include "log.h"
#include "recipe.h"
#include "remote_tier.h"
#include "reqtimeout.h"
#include "tree.h"

struct verified {
	dev_t dev;
	ino_t ino;
	struct timespec ctime;
	off_t size;
};

struct compile_job {
	struct kc_cache *c;
	struct kc_flight_key key;
	int entry_fd;
	struct kc_recipe recipe;
	int transient; /* set by run_compile: the failure had a passing cause */
	/* Set by run_compile when a published compile is to be shared (share_fd >= 0): the
	 * cluster's part, run by share_published in c->shares (queued as the single flight
	 * is answered). */
	struct kc_remote_job rj;
	struct kc_argv args;  /* the compile's arguments (owned) */
	const char *compiler; /* cfg's */
	int share_fd;         /* the published cubin (owned), or -1 */
	char label[512];
};

struct holdoff {
	struct holdoff *next;
	struct kc_flight_key key;
	char recipe[KC_SHA256_HEXLEN + 1];
	double until; /* CLOCK_MONOTONIC seconds */
};

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int verified_cmp(const void *a, const void *b)
{
	const struct verified *x = a, *y = b;
	if (x->dev != y->dev)
		return x->dev < y->dev ? -1 : 1;
	if (x->ino != y->ino)
		return x->ino < y->ino ? -1 : 1;
	return 0;
}

static int is_verified(struct kc_cache *c, const struct stat *st)
{
	struct verified key = {.dev = st->st_dev, .ino = st->st_ino};
	pthread_mutex_lock(&c->verified_lock);
	struct verified **v = tfind(&key, &c->verified, verified_cmp);
	int ok = v && (*v)->ctime.tv_sec == st->st_ctim.tv_sec &&
		 (*v)->ctime.tv_nsec == st->st_ctim.tv_nsec && (*v)->size == st->st_size;
	pthread_mutex_unlock(&c->verified_lock);
	return ok;
}

static void mark_verified(struct kc_cache *c, const struct stat *st)
{
	struct verified *n = malloc(sizeof(*n));
	if (!n)
		return;
	*n = (struct verified){st->st_dev, st->st_ino, st->st_ctim, st->st_size};
	pthread_mutex_lock(&c->verified_lock);
	struct verified **v = tsearch(n, &c->verified, verified_cmp);
	if (v && *v != n) {
		**v = *n;
		free(n);
	} else if (!v) {
		free(n);
	}
	pthread_mutex_unlock(&c->verified_lock);
}

/* Before a compile, and before its result is published or remembered: is the compiler on
 * disk still the one whose identity recipes are hashed with? A changed one is taken again
 * (compiler.h), and every cubin is verified again at its next open, where one compiled
 * under another identity is stale (check_published). Returns kc_compiler_refresh's. */
static int compiler_check(struct kc_cache *c)
{
	int r = kc_compiler_refresh(c->cfg->compiler);
	if (r == 1) {
		atomic_store(&c->compiler_changed, 1);
		pthread_mutex_lock(&c->verified_lock);
		tdestroy(c->verified, free);
		c->verified = NULL;
		pthread_mutex_unlock(&c->verified_lock);
	}
	return r;
}

/* The name of the entry directory behind entry_fd, whole (a label is cut for logs).
 * Returns 0, or -ENAMETOOLONG when the kernel cannot give its path. */
static int entry_name_of(struct kc_cache *c, int entry_fd, char name[256])
{
	char rel[PATH_MAX];
	if (kc_store_rel_path(c->store, entry_fd, rel, sizeof(rel)) != 0)
		return -ENAMETOOLONG;
	const char *slash = strrchr(rel, '/');
	const char *base = slash ? slash + 1 : rel;
	if (strlen(base) > 255)
		return -ENAMETOOLONG;
	memcpy(name, base, strlen(base) + 1);
	return 0;
}

void kc_cache_entry_label(struct kc_cache *c, int entry_fd, char *buf, size_t len)
{
	char link[32], path[4096];
	kc_fd_path(entry_fd, link);
	ssize_t n = readlink(link, path, sizeof(path) - 1);
	if (n < 0) {
		snprintf(buf, len, "(unknown entry)");
		return;
	}
	path[n] = '\0';
	size_t rl = strlen(c->store->root_path);
	const char *rel = strncmp(path, c->store->root_path, rl) == 0 ? path + rl : path;
	snprintf(buf, len, "%.*s", (int)(len > 1 ? len - 1 : 0), *rel ? rel : "/");
}

/* The slots that bound compiles, or NULL where the pool's size does (no cluster store). */
static struct kc_slots *job_slots(struct kc_cache *c)
{
	return c->remote ? &c->slots : NULL;
}

int kc_cache_init(struct kc_cache *c, const struct kc_config *cfg, struct kc_store *store,
		  struct kc_remote_tier *remote)
{
	memset(c, 0, sizeof(*c));
	c->cfg = cfg;
	c->store = store;
	kc_flight_table_init(&c->flights);
	pthread_mutex_init(&c->publish_lock, NULL);
	pthread_mutex_init(&c->verified_lock, NULL);
	pthread_mutex_init(&c->holdoff_lock, NULL);
	c->remote = remote;
	kc_slots_init(&c->slots, cfg->jobs);
	c->tree_memo = kc_tree_memo_new(KC_TREE_MEMO_DAEMON);
	c->pool = kc_pool_create(cfg->jobs + (remote ? KC_REMOTE_WAITERS : 0));
	if (!c->pool)
		return -errno;
	if (remote && !(c->shares = kc_pool_create(cfg->jobs)))
		return -errno;
	/* at most one warm NVRTC worker per job slot: each serves one compile at a time */
	if (cfg->nvrtc && !cfg->nvrtc_cold &&
	    !(c->nvrtc = kc_nvrtc_pool_create(store, cfg->jobs ? cfg->jobs : 1,
					      cfg->nvrtc_idle ? cfg->nvrtc_idle
							      : KC_NVRTC_IDLE_DEFAULT)))
		kc_log(KC_LOG_WARN, "no warm NVRTC workers (out of memory): a process per compile");
	return 0;
}

unsigned kc_cache_settle(struct kc_cache *c, double timeout_s)
{
	return c->shares ? kc_pool_wait_idle(c->shares, timeout_s > 0 ? timeout_s : 0) : 0;
}

void kc_cache_shutdown(struct kc_cache *c)
{
	kc_compile_shutdown();
	if (c->remote)
		kc_remote_tier_stop(c->remote); /* compiles waiting on other nodes go on here */
	if (c->pool)
		kc_pool_destroy(c->pool);
	c->pool = NULL;
	if (c->shares)
		kc_pool_destroy(c->shares); /* after the compiles, which queue shares */
	c->shares = NULL;
	kc_nvrtc_pool_destroy(c->nvrtc); /* after the compiles: none is busy now */
	c->nvrtc = NULL;
	kc_slots_destroy(&c->slots);
	tdestroy(c->verified, free);
	c->verified = NULL;
	while (c->holdoffs) {
		struct holdoff *h = c->holdoffs;
		c->holdoffs = h->next;
		free(h);
	}
	kc_flight_table_destroy(&c->flights);
	kc_tree_memo_free(c->tree_memo);
	c->tree_memo = NULL;
}

/* Remove entry/kernel.cubin if it is still the file st describes. */
static void unlink_if_same(int entry_fd, const struct stat *st)
{
	struct stat now;
	if (fstatat(entry_fd, KC_CUBIN_NAME, &now, AT_SYMLINK_NOFOLLOW) == 0 &&
	    now.st_ino == st->st_ino && now.st_dev == st->st_dev)
		unlinkat(entry_fd, KC_CUBIN_NAME, 0);
}

/* Check the cubin behind fd (stat st) against its integrity record, which is read into rec
 * (the caller remembers a good result with mark_verified). Returns NULL when it may be
 * served, else why not. */
static const char *cubin_problem(int fd, const struct stat *st, struct kc_record *rec)
{
	char sha[KC_SHA256_HEXLEN + 1];
	uint64_t size = 0;

	int err = kc_record_read(fd, rec);
	if (err == -ENODATA) { /* placed outside the mount's staging (a directory renamed in) */
		static __thread char why[300];
		char what[256];
		rec->origin = KC_ORIGIN_CLIENT;
		rec->recipe[0] = '\0';
		if (kc_cubin_check(fd, what, sizeof(what)) != 0) { /* as staging would refuse */
			snprintf(why, sizeof(why), "it has no record and %s", what);
			return why;
		}
		return NULL;
	}
	if (err)
		return "its integrity record is unreadable";
	if (kc_sha256_fd(fd, sha, &size) != 0)
		return "it cannot be read";
	if (size != rec->size || (uint64_t)st->st_size != rec->size)
		return "its size differs from the recorded size";
	if (strcmp(sha, rec->sha256) != 0)
		return "its SHA-256 differs from the recorded one";
	return NULL;
}

/* A bad published cubin: removed when the entry can compile it again (-ENOENT), else
 * refused (-EIO). Never served. */
static int cubin_bad(struct kc_cache *c, int entry_fd, const struct stat *st, const char *why)
{
	char label[512];

	kc_cache_entry_label(c, entry_fd, label, sizeof(label));
	atomic_fetch_add(&c->stats.corrupt, 1);
	if (kc_recipe_present(entry_fd, c->cfg)) {
		kc_log(KC_LOG_ERR, "%s: published cubin is corrupt (%s); removed, compiling again",
		       label, why);
		unlink_if_same(entry_fd, st);
		return -ENOENT;
	}
	kc_log(KC_LOG_ERR, "%s: published cubin is corrupt (%s) and has no recipe: refused",
	       label, why);
	return -EIO;
}

/* Nonzero if the entry holds both kernel.cu and kernel.flags: a recipe the client staged
 * for the mount to compile. (With -o autocompile a kernel.cu alone is a recipe too, but an
 * entry like that holding a client's cubin is the older DeepGEMM sequence: the client's
 * cubin, compiled with the client's own flags, is the one to serve.) */
static int staged_recipe(int entry_fd)
{
	return faccessat(entry_fd, KC_SOURCE_NAME, F_OK, AT_SYMLINK_NOFOLLOW) == 0 &&
	       faccessat(entry_fd, KC_FLAGS_NAME, F_OK, AT_SYMLINK_NOFOLLOW) == 0;
}

/* Nonzero if the cubin the mount compiled (record rec, stat st) is not the compile of the
 * entry's recipe as it is now (another recipe, compiler identity or arch): then it was
 * removed, so that the recipe is compiled again. */
static int compiled_stale(struct kc_cache *c, int entry_fd, const struct kc_record *rec,
			  const struct stat *st)
{
	struct kc_recipe r;
	if (kc_recipe_load(entry_fd, c->cfg, &r) != 0)
		return 0;
	int stale = strcmp(r.hash, rec->recipe) != 0;
	kc_recipe_free(&r);
	if (stale) {
		char label[512];
		kc_cache_entry_label(c, entry_fd, label, sizeof(label));
		kc_log(KC_LOG_INFO, "%s: cubin was compiled from another recipe, compiler or arch "
		       "(%.16s, now %.16s); compiling again", label, rec->recipe, r.hash);
		unlink_if_same(entry_fd, st);
	}
	return stale;
}

/* Check the published cubin of an entry. Returns 0 (serve it), -ENOENT (none, or a bad or
 * stale one was removed so that the recipe is compiled again), -EIO (bad, cannot rebuild). */
static int check_published(struct kc_cache *c, int entry_fd)
{
	struct stat st;
	struct kc_record rec;
	int fd = openat(entry_fd, KC_CUBIN_NAME, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);

	if (fd < 0)
		return errno == ENOENT ? -ENOENT : -EIO;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		close(fd);
		return -EIO;
	}
	if (is_verified(c, &st)) {
		close(fd);
		return 0;
	}
	const char *bad = cubin_problem(fd, &st, &rec);
	close(fd);
	if (bad)
		return cubin_bad(c, entry_fd, &st, bad);
	if (rec.origin != KC_ORIGIN_COMPILED && staged_recipe(entry_fd)) {
		/* Not the mount's compile of this recipe (placed in the backing directory, or left
		 * by an older kcachefs): never served as if it were. */
		char label[512];
		kc_cache_entry_label(c, entry_fd, label, sizeof(label));
		kc_log(KC_LOG_WARN, "%s: kernel.cubin was not compiled by the mount but the entry "
		       "has a recipe; removed, compiling the recipe", label);
		unlink_if_same(entry_fd, &st);
		return -ENOENT;
	}
	if (rec.origin == KC_ORIGIN_COMPILED && compiled_stale(c, entry_fd, &rec, &st))
		return -ENOENT;
	mark_verified(c, &st);
	return 0;
}

int kc_cache_verify_open(struct kc_cache *c, int fd, int entry_fd)
{
	struct stat st;
	struct kc_record rec;

	if (fstat(fd, &st) != 0)
		return -EIO;
	if (is_verified(c, &st))
		return 0;
	const char *bad = cubin_problem(fd, &st, &rec);
	if (bad) {
		if (entry_fd >= 0)
			cubin_bad(c, entry_fd, &st, bad);
		return -EIO;
	}
	/* The kernel keeps published cubins: after the compiler changed, one it holds may be
	 * another compiler's compile, which only the lookup (check_published) would catch. */
	if (rec.origin == KC_ORIGIN_COMPILED &&
	    atomic_load_explicit(&c->compiler_changed, memory_order_relaxed)) {
		if (entry_fd < 0)
			return -EAGAIN;
		if (compiled_stale(c, entry_fd, &rec, &st))
			return -ESTALE;
	}
	mark_verified(c, &st);
	return 0;
}

int kc_cache_verify_name(struct kc_cache *c, int fd, int entry_fd, uid_t reader)
{
	char key[KC_SHA256_HEXLEN + 1], name[256], link[32], label[512];
	struct stat st;
	if (!c->cfg->verify_keys)
		return 0;
	if (entry_fd < 0 || entry_name_of(c, entry_fd, name) != 0 || fstat(fd, &st) != 0)
		return -EIO;
	kc_fd_path(fd, link);
	ssize_t n = getxattr(link, KC_KEY_XATTR, key, KC_SHA256_HEXLEN);
	if (n == KC_SHA256_HEXLEN) {
		key[n] = '\0';
		if (kc_key_hash_matches(name, key))
			return 0;
		kc_cache_entry_label(c, entry_fd, label, sizeof(label));
		kc_log(KC_LOG_WARN, "%s: kernel.cubin refused: compiled from a recipe of key %.64s, "
		       "which the entry's name does not give (-o verify_keys; was the entry renamed?)",
		       label, key);
		return -EIO;
	}
	/* A client's cubin: no recipe says what it is. Its owner trusts it; nobody else. */
	if (reader == 0 ? st.st_uid == 0 : reader == st.st_uid)
		return 0;
	kc_cache_entry_label(c, entry_fd, label, sizeof(label));
	kc_log(KC_LOG_INFO, "%s: a client's kernel.cubin is served to its owner only "
	       "(-o verify_keys): uid %u asked", label, (unsigned)reader);
	return -EACCES;
}

/* Passing failures are held off briefly: the kernel queues concurrent lookups of one name
 * and sends them one after another, and each would otherwise start its own compile. */
static int held_off(struct kc_cache *c, const struct kc_flight_key *key, const char *recipe)
{
	double now = now_s();
	int found = 0;

	pthread_mutex_lock(&c->holdoff_lock);
	for (struct holdoff **p = &c->holdoffs; *p;) {
		struct holdoff *h = *p;
		if (h->until <= now) {
			*p = h->next;
			free(h);
			continue;
		}
		if (h->key.dev == key->dev && h->key.ino == key->ino &&
		    strcmp(h->recipe, recipe) == 0)
			found = 1;
		p = &h->next;
	}
	pthread_mutex_unlock(&c->holdoff_lock);
	return found;
}

static void hold_off(struct kc_cache *c, const struct kc_flight_key *key, const char *recipe)
{
	struct holdoff *h = malloc(sizeof(*h));
	if (!h)
		return;
	h->key = *key;
	snprintf(h->recipe, sizeof(h->recipe), "%s", recipe);
	h->until = now_s() + KC_RETRY_HOLDOFF;
	pthread_mutex_lock(&c->holdoff_lock);
	h->next = c->holdoffs;
	c->holdoffs = h;
	pthread_mutex_unlock(&c->holdoff_lock);
}

static void write_log(struct kc_cache *c, int entry_fd, const char *head, const char *body,
		      size_t body_len)
{
	size_t hl = strlen(head);
	char *buf = malloc(hl + body_len + 1);
	if (!buf)
		return;
	memcpy(buf, head, hl);
	if (body_len)
		memcpy(buf + hl, body, body_len);
	int err = kc_store_write_atomic(c->store, entry_fd, KC_LOG_NAME, buf, hl + body_len);
	if (err)
		kc_log(KC_LOG_WARN, "cannot write kernel.log: %s", strerror(-err));
	free(buf);
}

/* Publish a compiled, checked cubin (fd, the daemon's temporary tmp_name in tmp/) into the
 * entry; durable: fsync it and the entry, so that a compile survives a power loss. A
 * fetched cubin is published without (a fetch is cheap to repeat, and its fsyncs were
 * half of a fetch's time): a power loss may lose it, or leave a torn one, which the record
 * check at the first lookup after the start (check_published) removes, and it is fetched
 * again. Returns 0, -EAGAIN (the recipe changed meanwhile: nothing published) or -EIO. */
static int publish(struct compile_job *j, int fd, const char *tmp_name, const char *label,
		   uint64_t *bytes, int durable)
{
	struct kc_cache *c = j->c;
	struct kc_record rec = {.origin = KC_ORIGIN_COMPILED};
	struct kc_recipe now;
	char key[KC_SHA256_HEXLEN + 1];
	int err = kc_sha256_fd(fd, rec.sha256, &rec.size);
	strcpy(rec.recipe, j->recipe.hash);
	if (!err)
		err = kc_record_write(fd, &rec);
	if (!err)
		err = kc_key_compute(j->recipe.source, j->recipe.source_len, j->recipe.flags,
				     j->recipe.flags_len, key);
	if (!err)
		err = kc_key_record_write(fd, key);
	if (!err && (fchmod(fd, 0444) != 0 || (durable && fsync(fd) != 0)))
		err = -errno;
	if (err) {
		kc_log(KC_LOG_ERR, "%s: cannot prepare cubin for publishing: %s", label,
		       strerror(-err));
		return -EIO;
	}
	*bytes = rec.size;
	/* The compiler that ran must be the one the recipe was hashed with: swapped during
	 * the compile, its output is not this recipe's (and is compiled again). */
	int unsure = compiler_check(c) < 0;
	pthread_mutex_lock(&c->publish_lock);
	err = unsure ? -EAGAIN : kc_recipe_load(j->entry_fd, c->cfg, &now);
	if (!err) {
		if (strcmp(now.hash, j->recipe.hash) != 0)
			err = -EAGAIN;
		kc_recipe_free(&now);
	} else {
		err = -EAGAIN;
	}
	if (!err && renameat2(c->store->tmp_fd, tmp_name, j->entry_fd, KC_CUBIN_NAME,
			      RENAME_NOREPLACE) != 0) {
		err = errno == EEXIST ? 0 : -errno;
		if (!err) /* a client published first: ours is not needed */
			unlinkat(c->store->tmp_fd, tmp_name, 0);
	}
	pthread_mutex_unlock(&c->publish_lock);
	if (err == -EAGAIN) {
		kc_log(KC_LOG_INFO, "%s: recipe or compiler changed during the compile; result "
		       "discarded", label);
		return err;
	}
	if (err) {
		kc_log(KC_LOG_ERR, "%s: cannot publish cubin: %s", label, strerror(-err));
		return -EIO;
	}
	if (durable)
		kc_store_sync_dir(j->entry_fd);
	kc_store_clear_rejected(j->entry_fd);
	return 0;
}

/* Publish a cubin fetched from the cluster store (rj, verified) through the temporary
 * out_fd/out_name, as a compile's is published. Returns publish's result. */
static int publish_fetched(struct compile_job *j, struct kc_remote_job *rj, int out_fd,
			   const char *out_name, const char *label)
{
	char head[1024];
	uint64_t bytes = 0;
	int result = kc_write_all(out_fd, rj->obj.cubin, rj->obj.cubin_len) == 0
			     ? publish(j, out_fd, out_name, label, &bytes, 0)
			     : -EIO;
	snprintf(head, sizeof(head), "kcachefs: compile %s: %s from the cluster store (%s), "
		 "%zu bytes, not compiled here\n", label,
		 result == 0 ? "fetched" : "fetched but not published", rj->where,
		 rj->obj.cubin_len);
	if (result != -EAGAIN)
		write_log(j->c, j->entry_fd, head, NULL, 0);
	kc_log(result == 0 ? KC_LOG_INFO : KC_LOG_WARN, "%.*s", (int)strlen(head) - 11, head + 10);
	j->transient = result == -EIO;
	return result;
}

static int run_compile(struct compile_job *j)
{
	struct kc_cache *c = j->c;
	const struct kc_config *cfg = c->cfg;
	struct kc_argv args = {0}, eflags = {0};
	struct kc_compile_outcome out;
	char label[512], why[512], head[1536], scratch[4200];
	uint64_t bytes = 0;
	int result;

	kc_cache_entry_label(c, j->entry_fd, label, sizeof(label));
	if (kc_flags_parse(j->recipe.flags, j->recipe.flags_len, &eflags, why, sizeof(why))) {
		snprintf(head, sizeof(head), "kcachefs: kernel.flags %s\n", why);
		write_log(c, j->entry_fd, head, NULL, 0);
		kc_store_mark_rejected(j->entry_fd, j->recipe.hash);
		atomic_fetch_add(&c->stats.compile_failures, 1);
		kc_log(KC_LOG_WARN, "compile %s: %s", label, why);
		return -EIO;
	}
	if (kc_argv_extend(&args, &cfg->mount_flags) || kc_argv_extend(&args, &eflags) ||
	    (!kc_flags_have_arch(&args) &&
	     (snprintf(why, sizeof(why), "--gpu-architecture=%s", cfg->arch),
	      kc_argv_push(&args, why)))) {
		kc_argv_free(&args);
		kc_argv_free(&eflags);
		return -EIO;
	}
	kc_argv_free(&eflags);
	char arch[32];
	snprintf(arch, sizeof(arch), "%.31s", kc_flags_arch(&args));
	/* The backend: the entry's choice, else the mount's (-o compiler=). */
	const char *backend = kc_flags_backend(&args);
	int nvrtc = backend ? strcmp(backend, "nvrtc") == 0 : cfg->backend_nvrtc;
	if (nvrtc && !cfg->nvrtc) {
		snprintf(head, sizeof(head), "kcachefs: kernel.flags asks for NVRTC (%snvrtc), which "
			 "this kcachefs was built without\n", KC_FLAG_BACKEND);
		write_log(c, j->entry_fd, head, NULL, 0);
		kc_store_mark_rejected(j->entry_fd, j->recipe.hash);
		atomic_fetch_add(&c->stats.compile_failures, 1);
		kc_log(KC_LOG_WARN, "compile %s: NVRTC asked for, not built", label);
		kc_argv_free(&args);
		return -EIO;
	}
	const char *compiler = nvrtc ? cfg->nvrtc : cfg->nvcc;
	for (size_t i = 0; i < args.n;) { /* the choice is the mount's, not a compiler flag */
		if (strncmp(args.v[i], KC_FLAG_BACKEND, strlen(KC_FLAG_BACKEND)) != 0) {
			i++;
			continue;
		}
		free(args.v[i]);
		memmove(&args.v[i], &args.v[i + 1], (args.n - i) * sizeof(*args.v));
		args.n--;
	}

	char out_name[64];
	int out_fd = kc_store_tmpfile(c->store, 0600, out_name);
	if (out_fd < 0) {
		kc_log(KC_LOG_ERR, "compile %s: cannot create the cubin's temporary: %s", label,
		       strerror(-out_fd));
		kc_argv_free(&args);
		atomic_fetch_add(&c->stats.compile_failures, 1);
		return -EIO;
	}
	struct kc_remote_job rj;
	int scratch_fd = -1;
	if (kc_remote_tier_fetch(c->remote, j->recipe.hash, !nvrtc, job_slots(c), &rj) == 1) {
		kc_argv_free(&args);
		result = publish_fetched(j, &rj, out_fd, out_name, label);
		kc_remote_job_free(&rj);
		goto done;
	}
	rj.flags = j->recipe.flags; /* its include roots stay out of the header list */
	rj.flags_len = j->recipe.flags_len;
	/* Holding a job slot from here on. The scratch directory only for a compile: a fetch
	 * needs none. */
	scratch_fd = kc_store_scratch(c->store, scratch, sizeof(scratch));
	if (scratch_fd < 0) {
		kc_log(KC_LOG_ERR, "compile %s: cannot create scratch directory: %s", label,
		       strerror(-scratch_fd));
		kc_remote_tier_finish(c->remote, &rj, 0, 0, out_fd, NULL, 0);
		if (job_slots(c))
			kc_slots_release(job_slots(c));
		kc_argv_free(&args);
		close(out_fd);
		unlinkat(c->store->tmp_fd, out_name, 0);
		atomic_fetch_add(&c->stats.compile_failures, 1);
		return -EIO;
	}
	struct kc_compile_spec spec = {
		.nvcc = compiler, .args = &args, .source = j->recipe.source,
		.source_len = j->recipe.source_len, .scratch = scratch, .scratch_fd = scratch_fd,
		.timeout_s = cfg->compile_timeout, .first_uid = cfg->compile_uids,
		.ns_flags = cfg->ns_flags, .out_fd = out_fd, .pool = c->nvrtc, .warm = nvrtc,
		.compiler_gen = j->recipe.compiler_gen,
	};
	/* The include roots the recipe names by content must hold those bytes now: the key
	 * (key.h) is theirs, whatever the path (a tree changed since it was staged fails
	 * this compile as a transient one; a new stage names its new bytes). */
	int roots = kc_tree_check_roots(j->recipe.flags, j->recipe.flags_len, c->tree_memo, why,
					 sizeof(why));
	if (roots) {
		memset(&out, 0, sizeof(out));
		out.status = KC_COMPILE_TRANSIENT;
		snprintf(out.why, sizeof(out.why), "%.255s", why);
	} else if (kc_compile_run(&spec, &out) != 0) {
		out.status = KC_COMPILE_TRANSIENT;
		snprintf(out.why, sizeof(out.why), "out of memory");
	}
	if (!roots)
		kc_stats_observe_compile(&c->stats, out.seconds);
	if (out.timed_out)
		atomic_fetch_add(&c->stats.compile_timeouts, 1);
	kc_log(KC_LOG_DEBUG, "compile %s: compiler ran %.2f s: %s", label, out.seconds, out.why);

	result = -EIO;
	if (out.status == KC_COMPILE_REJECTED &&
	    (compiler_check(c) < 0 ||
	     kc_compiler_generation(cfg->compiler) != j->recipe.compiler_gen)) {
		/* A rejection is remembered for the compiler that gave it, and that one is gone:
		 * the waiters look again and the compiler there now compiles. */
		kc_log(KC_LOG_INFO, "compile %s: compiler changed during the compile; its "
		       "rejection discarded", label);
		result = -EAGAIN;
	} else if (out.status == KC_COMPILE_OK) {
		result = publish(j, out_fd, out_name, label, &bytes, 1);
		if (result == 0) {
			atomic_fetch_add(&c->stats.compiles, 1);
			atomic_fetch_add(&c->stats.published_bytes, bytes);
		}
	}
	if (result == 0 && kc_remote_tier_shares(c->remote, &rj) &&
	    (j->share_fd = fcntl(out_fd, F_DUPFD_CLOEXEC, 0)) >= 0) {
		/* shared after the openers have their cubin (share_published), the lease kept */
		kc_remote_job_move(&j->rj, &rj); /* rj's frame ends before the share */
		j->args = args;
		args = (struct kc_argv){0};
		j->compiler = compiler;
		snprintf(j->label, sizeof(j->label), "%s", label);
	} else {
		kc_remote_tier_finish(c->remote, &rj, 0, out.status == KC_COMPILE_REJECTED,
				      out_fd, NULL, 0);
	}
	kc_argv_free(&args);
	if (job_slots(c))
		kc_slots_release(job_slots(c));
	if (result != 0 && result != -EAGAIN)
		atomic_fetch_add(&c->stats.compile_failures, 1);
	const char *kind = out.status == KC_COMPILE_OK
				   ? (result == 0 ? "published" : "not published")
				   : out.status == KC_COMPILE_REJECTED ? "rejected" : "failed";
	snprintf(head, sizeof(head), "kcachefs: compile %s: %s (%s) in %.2f s with %s, arch %s\n",
		 label, kind, out.why, out.seconds, compiler, arch);
	if (out.timed_out && cfg->compile_timeout_asked) {
		size_t hl = strlen(head);
		snprintf(head + hl, sizeof(head) - hl, "kcachefs: the compile timeout is %u s, not "
			 "compile_timeout=%u, because the kernel aborts this mount when a request "
			 "waits %u s (sysctls fs.fuse.default_request_timeout and "
			 "fs.fuse.max_request_timeout): set them to 0 (off) or to at least %u and "
			 "remount, for compiles that long\n", cfg->compile_timeout,
			 cfg->compile_timeout_asked, cfg->request_timeout,
			 kc_reqtimeout_needed(cfg->compile_timeout_asked + 1));
	}
	if (result != -EAGAIN)
		write_log(c, j->entry_fd, head, out.log, out.log_len);
	if (out.status == KC_COMPILE_REJECTED && result != -EAGAIN)
		kc_store_mark_rejected(j->entry_fd, j->recipe.hash);
	j->transient = out.status != KC_COMPILE_REJECTED && result == -EIO;
	kc_log(result == 0 ? KC_LOG_INFO : KC_LOG_WARN, "%.*s", (int)strlen(head) - 11, head + 10);
	kc_compile_outcome_free(&out);
done:
	close(out_fd);
	if (result != 0)
		unlinkat(c->store->tmp_fd, out_name, 0);
	if (scratch_fd >= 0) {
		close(scratch_fd);
		kc_store_remove_tree(scratch);
	}
	if (result == 0 && c->evict)
		kc_evict_note_fd(c->evict, j->entry_fd);
	return result;
}

/* The cluster's part of a published compile: nvcc's dependency pass (the same source and
 * flags, sandboxed as a compile) gives the header list, then the object and index are put
 * and the lease released. Runs in c->shares after the openers were answered and holds no
 * job slot nor compile worker: the node's next compile need not wait for it. A pass that fails only means "not shared":
 * the published cubin stays, the lease is released, so another node compiles. */
static void share_published(struct compile_job *j)
{
	struct kc_cache *c = j->c;
	const struct kc_config *cfg = c->cfg;
	struct kc_compile_outcome out = {.status = KC_COMPILE_TRANSIENT};
	char scratch[4200];
	int scratch_fd = kc_store_scratch(c->store, scratch, sizeof(scratch));
	struct kc_compile_spec spec = {
		.nvcc = j->compiler, .args = &j->args, .source = j->recipe.source,
		.source_len = j->recipe.source_len, .scratch = scratch, .scratch_fd = scratch_fd,
		.timeout_s = cfg->compile_timeout, .first_uid = cfg->compile_uids,
		.ns_flags = cfg->ns_flags, .out_fd = -1, .deps_only = 1, .pool = c->nvrtc,
	};
	if (scratch_fd < 0)
		snprintf(out.why, sizeof(out.why), "no scratch directory: %s", strerror(-scratch_fd));
	else if (kc_compile_run(&spec, &out) != 0)
		snprintf(out.why, sizeof(out.why), "out of memory");
	if (out.status == KC_COMPILE_OK)
		kc_log(KC_LOG_DEBUG, "compile %s: dependency pass ran %.2f s", j->label, out.seconds);
	else
		kc_log(KC_LOG_WARN, "cluster store: %s not shared: its dependency pass %s",
		       j->label, out.why);
	kc_remote_tier_finish(c->remote, &j->rj, out.status == KC_COMPILE_OK, 0, j->share_fd,
			      out.deps, out.deps_len);
	kc_compile_outcome_free(&out);
	if (scratch_fd >= 0) {
		close(scratch_fd);
		kc_store_remove_tree(scratch);
	}
	close(j->share_fd);
	j->share_fd = -1;
}

static void job_free(struct compile_job *j)
{
	kc_argv_free(&j->args);
	close(j->entry_fd);
	kc_recipe_free(&j->recipe);
	free(j);
}

static void share_job(void *arg)
{
	share_published(arg);
	job_free(arg);
}

static void compile_job(void *arg)
{
	struct compile_job *j = arg;
	struct kc_cache *c = j->c;
	struct kc_flight_key key = j->key;
	int result = run_compile(j);
	if (j->transient)
		hold_off(c, &key, j->recipe.hash);
	/* The share runs in a pool of its own, queued before the openers are answered: once
	 * they are, kc_cache_settle sees it (a live upgrade waits for it). Run here when that
	 * pool is stopping. */
	if (j->share_fd >= 0 && kc_pool_submit(c->shares, share_job, j) == 0) {
		kc_flight_finish(&c->flights, &key, result);
		return;
	}
	kc_flight_finish(&c->flights, &key, result);
	if (j->share_fd >= 0)
		share_published(j);
	job_free(j);
}

struct recheck_arg {
	int entry_fd;
};

static int recheck_published(void *arg)
{
	struct recheck_arg *r = arg;
	struct stat st;
	return fstatat(r->entry_fd, KC_CUBIN_NAME, &st, AT_SYMLINK_NOFOLLOW) == 0 ? KC_FLIGHT_DONE
										   : 0;
}

uint64_t kc_recipe_id(const char *recipe_hex)
{
	uint64_t id = 0;
	for (int i = 0; i < 16 && recipe_hex[i]; i++) {
		char ch = recipe_hex[i];
		id = id << 4 | (uint64_t)(ch <= '9' ? ch - '0' : ch - 'a' + 10);
	}
	return id;
}

uint64_t kc_cache_cubin_recipe_id(int fd)
{
	struct kc_record rec;
	if (kc_record_read(fd, &rec) != 0 || !rec.recipe[0])
		return 0;
	return kc_recipe_id(rec.recipe);
}

int kc_cache_lookup_cubin(struct kc_cache *c, int entry_fd, struct kc_waiter *w,
			  uint64_t *recipe_id)
{
	struct stat est;
	char label[512];

	if (fstat(entry_fd, &est) != 0)
		return -errno;
	for (int attempt = 0; attempt < 4; attempt++) {
		int err = check_published(c, entry_fd);
		if (err == 0) {
			atomic_fetch_add(&c->stats.hits, 1);
			return 0;
		}
		if (kc_log_enabled(KC_LOG_DEBUG)) {
			kc_cache_entry_label(c, entry_fd, label, sizeof(label));
			kc_log(KC_LOG_DEBUG, "%s: kernel.cubin not published", label);
		}
		if (err != -ENOENT)
			return err;
		/* A request that waits (w) on a compile already in flight joins it without
		 * loading the recipe (a joining node's 8 readers of one kernel park 2 requests
		 * each): the leader loaded and checked it, a recipe changed since makes the
		 * flight publish nothing (-EAGAIN: its waiters come back here), and what it
		 * publishes is checked against the recipe (check_published) before any waiter
		 * is answered. */
		struct kc_flight_key running = {est.st_dev, est.st_ino};
		if (w && !recipe_id &&
		    kc_flight_join_running(&c->flights, &running, w) == KC_FLIGHT_JOINED) {
			atomic_fetch_add(&c->stats.waits, 1);
			return KC_PENDING;
		}

		/* A stat of the compiler per miss: a replaced one is not taken for the one whose
		 * rejections and cubins are recorded (its own are looked up instead). */
		compiler_check(c);
		struct compile_job *j = calloc(1, sizeof(*j));
		if (!j)
			return -ENOMEM;
		j->share_fd = -1;
		err = kc_recipe_load(entry_fd, c->cfg, &j->recipe);
		if (err) {
			free(j);
			if (err == -ENOENT) /* a refusal since the last stage: kernel.log says why */
				return kc_store_is_refused(entry_fd) ? -EIO : -ENOENT;
			kc_cache_entry_label(c, entry_fd, label, sizeof(label));
			kc_log(KC_LOG_WARN, "%s: cannot read recipe: %s", label, strerror(-err));
			return -EIO;
		}
		if (c->cfg->verify_keys) { /* also what came in by a directory rename */
			char why[400], name[256];
			kc_cache_entry_label(c, entry_fd, label, sizeof(label));
			int named = entry_name_of(c, entry_fd, name) == 0;
			if (!named)
				snprintf(why, sizeof(why), "its path is too long to check its key");
			if (!named ||
			    kc_key_names(name, j->recipe.source, j->recipe.source_len, j->recipe.flags,
					 j->recipe.flags_len, why, sizeof(why)) != 1) {
				kc_log(KC_LOG_WARN, "%s: not compiled: %s", label, why);
				kc_recipe_free(&j->recipe);
				free(j);
				atomic_fetch_add(&c->stats.rejected_lookups, 1);
				return -EIO;
			}
		}
		struct kc_flight_key key = {est.st_dev, est.st_ino};
		if (kc_store_is_rejected(entry_fd, j->recipe.hash) ||
		    held_off(c, &key, j->recipe.hash)) {
			kc_recipe_free(&j->recipe);
			free(j);
			atomic_fetch_add(&c->stats.rejected_lookups, 1);
			return -EIO;
		}
		struct recheck_arg ra = {entry_fd};
		int r = kc_flight_join(&c->flights, &key, w, recheck_published, &ra);
		if (recipe_id && (r == KC_FLIGHT_JOINED || r == KC_FLIGHT_LEADER))
			*recipe_id = kc_recipe_id(j->recipe.hash);
		if (r != KC_FLIGHT_LEADER) {
			kc_recipe_free(&j->recipe);
			free(j);
		}
		if (r == KC_FLIGHT_JOINED) {
			if (w)
				atomic_fetch_add(&c->stats.waits, 1);
			return KC_PENDING;
		}
		if (r < 0)
			return r;
		if (r != KC_FLIGHT_LEADER)
			continue; /* published meanwhile: verify it */
		atomic_fetch_add(&c->stats.misses, 1);
		if (kc_log_enabled(KC_LOG_DEBUG)) {
			kc_cache_entry_label(c, entry_fd, label, sizeof(label));
			kc_log(KC_LOG_DEBUG, "%s: compile queued (recipe %.16s)", label, j->recipe.hash);
		}
		j->c = c;
		j->key = key;
		j->entry_fd = fcntl(entry_fd, F_DUPFD_CLOEXEC, 0);
		if (j->entry_fd < 0 || kc_pool_submit(c->pool, compile_job, j) != 0) {
			if (j->entry_fd >= 0)
				close(j->entry_fd);
			kc_recipe_free(&j->recipe);
			free(j);
			kc_flight_finish(&c->flights, &key, -EIO);
		}
		return KC_PENDING;
	}
	return -EIO;
}

/* The contents of dir/name (malloc'd, *len bytes; NULL with *len 0 when absent). Returns 0
 * or -errno. */
static int read_small(int dir, const char *name, size_t max, char **out, size_t *len)
{
	*out = NULL;
	*len = 0;
	int fd = openat(dir, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return errno == ENOENT ? 0 : -errno;
	int err = kc_read_all(fd, max, out, len);
	close(fd);
	return err;
}

/* -o verify_keys, under publish_lock before role's file is committed: with its partner
 * (kernel.cu for kernel.flags, and the reverse) staged, the pair must be what the entry's
 * name says (key.h), else -EINVAL with the reason in why. Alone, it is not verified yet,
 * and replaces a lone file of other bytes (EEXIST would let anyone hold a name with a
 * source no key could ever match). Returns 0 or -errno. */
static int verify_stage(struct kc_cache *c, enum kc_role role, int src_dir, const char *src_name,
			int entry_fd, char *why, size_t whylen)
{
	const char *mine = role == KC_ROLE_SOURCE ? KC_SOURCE_NAME : KC_FLAGS_NAME;
	const char *other = role == KC_ROLE_SOURCE ? KC_FLAGS_NAME : KC_SOURCE_NAME;
	size_t max = c->cfg->max_source_size, nlen = 0, plen = 0;
	char *next = NULL, *partner = NULL, name[256];
	if (entry_name_of(c, entry_fd, name) != 0) {
		snprintf(why, whylen, "its path is too long to check its key");
		return -EINVAL;
	}
	int err = read_small(src_dir, src_name, max, &next, &nlen);
	if (!err)
		err = read_small(entry_fd, other, max, &partner, &plen);
	if (!err && partner) {
		int ok = role == KC_ROLE_SOURCE
				 ? kc_key_names(name, next, nlen, partner, plen, why, whylen)
				 : kc_key_names(name, partner, plen, next, nlen, why, whylen);
		if (ok == 0)
			err = -EINVAL;
		else if (ok < 0)
			err = ok;
	} else if (!err) {
		unlinkat(entry_fd, mine, 0); /* a lone, unverified file gives way */
	}
	free(next);
	free(partner);
	return err;
}

/* A cubin a client published is not the compile of any recipe, and a recipe's cubin is the
 * mount's compile of it: the two never share an entry (staged_recipe). Called under
 * publish_lock before role's file is committed. Returns 0 (go on); 1 for a client's cubin
 * in an entry that has a recipe (its bytes are discarded and the rename succeeds, as over a
 * published cubin: the mount compiles the recipe); -EEXIST (why says so) for a kernel.cu or
 * kernel.flags that would give an entry holding a client's cubin a recipe. */
static int recipe_meets_client_cubin(enum kc_role role, int entry_fd, const char *label,
				     char *why, size_t whylen)
{
	if (role == KC_ROLE_CUBIN) {
		if (!staged_recipe(entry_fd))
			return 0;
		kc_log(KC_LOG_INFO, "%s: kernel.cubin from a client discarded: the entry has a "
		       "recipe, whose cubin the mount compiles", label);
		return 1;
	}
	struct kc_record rec;
	int fd = openat(entry_fd, KC_CUBIN_NAME, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return 0;
	int client = kc_record_read(fd, &rec) != 0 || rec.origin != KC_ORIGIN_COMPILED;
	close(fd);
	const char *name = role == KC_ROLE_SOURCE ? KC_SOURCE_NAME : KC_FLAGS_NAME;
	if (!client || faccessat(entry_fd, name, F_OK, AT_SYMLINK_NOFOLLOW) == 0)
		return 0; /* an existing name: the commit keeps the same bytes or refuses others */
	snprintf(why, whylen, "the entry holds a kernel.cubin published by a client, which is "
		 "not a compile of any recipe");
	return -EEXIST;
}

/* Check src (open as fd, stat st) for role. Returns 0, or -errno with the reason in why. */
static int check_stage(struct kc_cache *c, enum kc_role role, int fd, const struct stat *st,
		       char *why, size_t whylen)
{
	if (role != KC_ROLE_CUBIN && (size_t)st->st_size > c->cfg->max_source_size) {
		snprintf(why, whylen, "%lld bytes exceed max_source_size %zu",
			 (long long)st->st_size, c->cfg->max_source_size);
		return -EFBIG;
	}
	if (role == KC_ROLE_FLAGS) {
		char *buf = malloc((size_t)st->st_size + 1);
		ssize_t n = buf ? pread(fd, buf, (size_t)st->st_size, 0) : -1;
		struct kc_argv parsed = {0};
		int err = 0;
		if (n < 0) {
			err = buf ? -errno : -ENOMEM;
			snprintf(why, whylen, "it cannot be read: %s", strerror(-err));
		} else if (kc_flags_parse(buf, (size_t)n, &parsed, why, whylen) != 0) {
			err = -EINVAL;
		}
		kc_argv_free(&parsed);
		free(buf);
		return err;
	}
	if (role == KC_ROLE_CUBIN) {
		struct kc_record rec = {.origin = KC_ORIGIN_CLIENT};
		if (kc_cubin_check(fd, why, whylen) != 0)
			return -EINVAL;
		int err = kc_sha256_fd(fd, rec.sha256, &rec.size);
		if (!err)
			err = kc_record_write(fd, &rec);
		if (err)
			snprintf(why, whylen, "its record cannot be written: %s", strerror(-err));
		return err;
	}
	return 0;
}

/* A staged file was refused: the entry says so, so that a writer who ignored close()'s
 * status learns why: kernel.log, and for a recipe file, kernel.cubin answering EIO where
 * nothing else is there (kc_cache_lookup_cubin) until a later stage succeeds. (A refused
 * cubin leaves the name free: its lookup must find nothing for the client to try again.) */
static void note_refusal(struct kc_cache *c, int entry_fd, enum kc_role role, const char *name,
			 const char *label, const char *why)
{
	char head[700];
	snprintf(head, sizeof(head), "kcachefs: %s refused: %s\n", name, why);
	write_log(c, entry_fd, head, NULL, 0);
	if (role != KC_ROLE_CUBIN)
		kc_store_mark_refused(entry_fd, name);
	kc_log(KC_LOG_WARN, "%s: %s refused: %s", label, name, why);
	atomic_fetch_add(&c->stats.stage_refusals, 1);
}

/* Open src_dir/src_name, to be staged as role, for reading (stat in *st). Returns the fd, or
 * -EINVAL for what is not a regular file, -EPERM (a refusal) for a file with other hard
 * links (another name could change the staged bytes in place, or be what the kernel shows
 * under the staged name after a rename), or -errno. */
static int open_stage_src(struct kc_cache *c, enum kc_role role, int src_dir,
			  const char *src_name, int entry_fd, struct stat *st)
{
	char label[512];
	int fd = openat(src_dir, src_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode)) {
		close(fd);
		return -EINVAL;
	}
	if (st->st_nlink > 1) {
		close(fd);
		kc_cache_entry_label(c, entry_fd, label, sizeof(label));
		note_refusal(c, entry_fd, role, kc_role_name(role), label,
			     "the file has other hard links");
		return -EPERM;
	}
	return fd;
}

int kc_cache_stage(struct kc_cache *c, enum kc_role role, int src_dir, const char *src_name,
		   int entry_fd)
{
	char label[512], why[512] = "";
	struct stat st;
	int err = 0;

	if (!kc_role_is_staged(role))
		return -EINVAL;
	kc_cache_entry_label(c, entry_fd, label, sizeof(label));
	int fd = open_stage_src(c, role, src_dir, src_name, entry_fd, &st);
	if (fd < 0)
		return fd;
	err = check_stage(c, role, fd, &st, why, sizeof(why));
	close(fd);
	if (!err) {
		pthread_mutex_lock(&c->publish_lock);
		int meet = recipe_meets_client_cubin(role, entry_fd, label, why, sizeof(why));
		if (meet == 1)
			unlinkat(src_dir, src_name, 0);
		if (!meet && c->cfg->verify_keys && role != KC_ROLE_CUBIN)
			meet = verify_stage(c, role, src_dir, src_name, entry_fd, why, sizeof(why));
		err = meet ? meet : kc_store_commit(src_dir, src_name, entry_fd, kc_role_name(role));
		pthread_mutex_unlock(&c->publish_lock);
		if (!meet && err == -EEXIST && role == KC_ROLE_CUBIN) {
			/* Racing ranks compile the same recipe; nvcc's output can differ run to
			 * run (anonymous-namespace names). The first published cubin stays, the
			 * later one is discarded, and the rename succeeds as it would locally. */
			unlinkat(src_dir, src_name, 0);
			kc_log(KC_LOG_INFO, "%s: kernel.cubin already published; other bytes discarded",
			       label);
			err = 1;
		} else if (!meet && err == -EEXIST) {
			snprintf(why, sizeof(why), "other bytes are already staged (unlink it first "
				 "to stage another recipe)");
		} else if (err < 0 && !why[0]) {
			snprintf(why, sizeof(why), "%s", strerror(-err));
		}
	}
	if (err < 0) {
		note_refusal(c, entry_fd, role, kc_role_name(role), label, why);
		return err;
	}
	kc_store_clear_refused(entry_fd);
	atomic_fetch_add(&c->stats.stages, 1);
	kc_log(KC_LOG_DEBUG, "%s: %s %s", label, kc_role_name(role), err ? "kept (same or published)" : "staged");
	int ret = err ? KC_STAGE_KEPT : 0;
	/* A new source or flags file is a new recipe: what was compiled before is stale. */
	if (!err && role != KC_ROLE_CUBIN && kc_cache_unstage(c, entry_fd))
		ret = KC_STAGE_CUBIN_REMOVED;
	if (c->evict)
		kc_evict_note_fd(c->evict, entry_fd);
	return ret;
}

int kc_cache_stage_copy(struct kc_cache *c, enum kc_role role, int src_dir,
			const char *src_name, int entry_fd)
{
	char tmp[64];
	struct stat st;
	if (!kc_role_is_staged(role))
		return -EINVAL;
	int src = open_stage_src(c, role, src_dir, src_name, entry_fd, &st);
	if (src < 0)
		return src;
	int fd = kc_store_copy_tmp(c->store, src, st.st_mode & 07777, tmp);
	close(src);
	if (fd < 0)
		return fd;
	if (geteuid() == 0 && fchown(fd, st.st_uid, st.st_gid) != 0)
		kc_log(KC_LOG_DEBUG, "chown of a staged copy: %s", strerror(errno));
	close(fd);
	int r = kc_cache_stage(c, role, c->store->tmp_fd, tmp, entry_fd);
	if (r < 0)
		unlinkat(c->store->tmp_fd, tmp, 0);
	else if (unlinkat(src_dir, src_name, 0) != 0 && errno != ENOENT)
		kc_log(KC_LOG_WARN, "a file staged by rename stays at its old name: %s",
		       strerror(errno));
	return r;
}

int kc_cache_unstage(struct kc_cache *c, int entry_fd)
{
	struct kc_record rec;
	int removed = 0;

	pthread_mutex_lock(&c->publish_lock);
	int fd = openat(entry_fd, KC_CUBIN_NAME, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd >= 0) {
		if (kc_record_read(fd, &rec) == 0 && rec.origin == KC_ORIGIN_COMPILED)
			removed = unlinkat(entry_fd, KC_CUBIN_NAME, 0) == 0;
		close(fd);
	}
	pthread_mutex_unlock(&c->publish_lock);
	kc_store_clear_rejected(entry_fd);
	kc_store_clear_refused(entry_fd);
	return removed;
}

int kc_cache_cubin_pending(struct kc_cache *c, int entry_fd)
{
	struct kc_recipe r;
	if (!kc_recipe_present(entry_fd, c->cfg))
		return 0;
	if (kc_recipe_load(entry_fd, c->cfg, &r) != 0)
		return 0;
	int rejected = kc_store_is_rejected(entry_fd, r.hash);
	kc_recipe_free(&r);
	return !rejected;
}

void kc_cache_gauges(struct kc_cache *c, struct kc_stats_gauges *g)
{
	kc_pool_load(c->pool, &g->queued, &g->inflight);
	if (job_slots(c)) { /* workers fetch and wait too: count compiles by their slots */
		unsigned waiting;
		kc_slots_load(job_slots(c), &waiting, &g->inflight);
		g->queued += waiting;
	}
	g->flights = kc_flight_count(&c->flights);
	g->remote_up = c->remote ? (unsigned)kc_remote_tier_up(c->remote) : 0;
}
