/* staging.c - staged files checked and committed (cache.h: kc_cache_stage, kc_cache_stage_copy, kc_cache_unstage) */
#define _GNU_SOURCE
#include "cache_i.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "io.h"
#include "key.h"
#include "log.h"

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
	if (kc_cache_entry_name(c, entry_fd, name) != 0) {
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
		if (!kc_cache_staged_recipe(entry_fd))
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
	kc_cache_write_log(c, entry_fd, head, NULL, 0);
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
