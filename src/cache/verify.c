/* verify.c - published cubins checked before they are served (cache.h: kc_cache_verify_open,
 * kc_cache_verify_name; cache_i.h), and the compiler's identity checked before a compile. */
#define _GNU_SOURCE
#include "cache_i.h"

#include <errno.h>
#include <fcntl.h>
#include <search.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "key.h"
#include "log.h"
#include "util.h"

struct verified {
	dev_t dev;
	ino_t ino;
	struct timespec ctime;
	off_t size;
};

static int verified_cmp(const void *a, const void *b)
{
	const struct verified *x = a, *y = b;
	return kc_file_id_cmp(x->dev, x->ino, y->dev, y->ino);
}

/* cache_i.h. A changed compiler drops every checked cubin: each is checked again at its
 * next open (check_published). */
int kc_cache_compiler_check(struct kc_cache *c)
{
	int r = kc_compiler_refresh(c->cfg->compiler);
	if (r == 1) {
		atomic_store(&c->compiler_changed, 1);
		pthread_mutex_lock(&c->verified_lock);
		tdestroy(c->verified, free);
		c->verified = NULL;
		c->verified_epoch++;
		pthread_mutex_unlock(&c->verified_lock);
	}
	return r;
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

/* Remember st as checked, unless the checked cubins were dropped since epoch (any: -1). */
static void mark_verified_since(struct kc_cache *c, const struct stat *st, unsigned long epoch)
{
	struct verified *n = malloc(sizeof(*n));
	if (!n)
		return;
	*n = (struct verified){st->st_dev, st->st_ino, st->st_ctim, st->st_size};
	pthread_mutex_lock(&c->verified_lock);
	struct verified **v = epoch == (unsigned long)-1 || epoch == c->verified_epoch
				      ? tsearch(n, &c->verified, verified_cmp)
				      : NULL;
	if (v && *v != n) {
		**v = *n;
		free(n);
	} else if (!v) {
		free(n);
	}
	pthread_mutex_unlock(&c->verified_lock);
}

static void mark_verified(struct kc_cache *c, const struct stat *st)
{
	mark_verified_since(c, st, (unsigned long)-1);
}

unsigned long kc_cache_verified_epoch(struct kc_cache *c)
{
	pthread_mutex_lock(&c->verified_lock);
	unsigned long epoch = c->verified_epoch;
	pthread_mutex_unlock(&c->verified_lock);
	return epoch;
}

void kc_cache_mark_published(struct kc_cache *c, int fd, unsigned long epoch)
{
	struct stat st;
	if (fstat(fd, &st) == 0)
		mark_verified_since(c, &st, epoch);
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
		kc_store_unlink_if_same(entry_fd, KC_CUBIN_NAME, st);
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
int kc_cache_staged_recipe(int entry_fd)
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
		kc_store_unlink_if_same(entry_fd, KC_CUBIN_NAME, st);
	}
	return stale;
}

/* Check the published cubin of an entry. Returns 0 (serve it), -ENOENT (none, or a bad or
 * stale one was removed so that the recipe is compiled again), -EIO (bad, cannot rebuild). */
int kc_cache_check_published(struct kc_cache *c, int entry_fd)
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
	if (rec.origin != KC_ORIGIN_COMPILED && kc_cache_staged_recipe(entry_fd)) {
		/* Not the mount's compile of this recipe (placed in the backing directory, or left
		 * by an older kcachefs): never served as if it were. */
		char label[512];
		kc_cache_entry_label(c, entry_fd, label, sizeof(label));
		kc_log(KC_LOG_WARN, "%s: kernel.cubin was not compiled by the mount but the entry "
		       "has a recipe; removed, compiling the recipe", label);
		kc_store_unlink_if_same(entry_fd, KC_CUBIN_NAME, &st);
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
	if (entry_fd < 0 || kc_cache_entry_name(c, entry_fd, name) != 0 || fstat(fd, &st) != 0)
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
