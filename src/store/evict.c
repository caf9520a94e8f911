/* evict.c - see evict.h */
#define _GNU_SOURCE
#include "evict.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <search.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "name.h"
#include "util.h"

#define USED_XATTR "user.kcachefs.used"

struct rec {
	dev_t dev;
	ino_t ino;
	uint64_t bytes;
	int64_t used;      /* milliseconds since the epoch */
	int64_t persisted; /* seconds: the last use a restart reads back (USED_XATTR, else the
			    * cubin's mtime) */
	unsigned pins;     /* files being staged in it */
	int indexed;       /* a published entry, counted in entries and bytes */
	char *path;        /* relative to the backing root as last seen; NULL while pinned */
	struct file_handle *handle; /* finds it wherever it was moved since (NULL: none) */
};

/* Trees moved into tmp/ whose removal failed (e.g. EMFILE): retried by the cleaner. */
struct trash {
	struct trash *next;
	char name[64];
};

static int rec_cmp(const void *a, const void *b)
{
	const struct rec *x = a, *y = b;
	return kc_file_id_cmp(x->dev, x->ino, y->dev, y->ino);
}

static struct rec *find(struct kc_evict *e, dev_t dev, ino_t ino)
{
	struct rec key = {.dev = dev, .ino = ino};
	struct rec **r = tfind(&key, &e->tree, rec_cmp);
	return r ? *r : NULL;
}

static struct rec *find_or_add(struct kc_evict *e, dev_t dev, ino_t ino)
{
	struct rec *r = find(e, dev, ino);
	if (r)
		return r;
	r = calloc(1, sizeof(*r));
	if (!r)
		return NULL;
	r->dev = dev;
	r->ino = ino;
	if (!tsearch(r, &e->tree, rec_cmp)) {
		free(r);
		return NULL;
	}
	return r;
}

/* Remove r from the index's counts, and from the tree unless it is pinned. */
static void drop(struct kc_evict *e, struct rec *r)
{
	if (r->indexed) {
		e->entries--;
		e->bytes -= r->bytes;
		r->indexed = 0;
	}
	if (r->pins)
		return;
	tdelete(r, &e->tree, rec_cmp);
	free(r->path);
	free(r->handle);
	free(r);
}

/* A handle of the directory dfd for open_by_handle_at (malloc'ed), or NULL. */
static struct file_handle *handle_of(int dfd)
{
	struct file_handle *h = malloc(sizeof(*h) + MAX_HANDLE_SZ);
	int mount_id;
	if (h) {
		h->handle_bytes = MAX_HANDLE_SZ;
		if (name_to_handle_at(dfd, "", h, &mount_id, AT_EMPTY_PATH) != 0) {
			free(h);
			h = NULL;
		} else { /* 8 bytes on ext4: keep what it needs, not MAX_HANDLE_SZ */
			struct file_handle *fit = realloc(h, sizeof(*h) + h->handle_bytes);
			h = fit ? fit : h;
		}
	}
	return h;
}

/* Over the bounds (low: over the low watermarks, KC_EVICT_LOW_PERCENT of each, rounded
 * up so that a small max_entries=2 keeps 2, not 1). */
static int over(const struct kc_evict *e, int low)
{
	uint64_t bytes = e->max_bytes, entries = e->max_entries;
	if (low) {
		bytes -= bytes / 100 * (100 - KC_EVICT_LOW_PERCENT);
		entries -= entries * (100 - KC_EVICT_LOW_PERCENT) / 100;
	}
	return (bytes && e->bytes > bytes) || (entries && e->entries > entries);
}

int kc_evict_init(struct kc_evict *e, struct kc_store *store, struct kc_flight_table *flights,
		  struct kc_stats *stats, uint64_t max_bytes, uint64_t max_entries)
{
	memset(e, 0, sizeof(*e));
	e->store = store;
	e->stats = stats;
	e->flights = flights;
	e->max_bytes = max_bytes;
	e->max_entries = max_entries;
	pthread_mutex_init(&e->lock, NULL);
	return 0;
}

/* The path of dir relative to the backing root, or -1 if it is not in the tree (the
 * state directory is not). */
static int rel_path(struct kc_evict *e, int dir, char *out, size_t len)
{
	if (kc_store_rel_path(e->store, dir, out, len) != 0)
		return -1;
	return strncmp(out, KC_STATE_DIR "/", sizeof(KC_STATE_DIR)) == 0 ? -1 : 0;
}

/* Measure the directory open on dfd (O_RDONLY, not read yet: its entries are read here)
 * and update the index. now_used: mark it used now (a publish), else take the persisted
 * last use or the cubin's mtime (a scan). */
static void measure(struct kc_evict *e, int dfd, int now_used)
{
	char rel[4096];
	struct stat st;
	if (fstat(dfd, &st) != 0 || !S_ISDIR(st.st_mode))
		return;
	int known = rel_path(e, dfd, rel, sizeof(rel)) == 0;
	const char *base = strrchr(rel, '/');
	base = base ? base + 1 : rel;
	uint64_t bytes = 0;
	int64_t cubin_mtime = -1, persisted = 0;
	if (known && kc_name_classify(base, NULL) == KC_NAME_ENTRY) {
		/* read on dfd itself (the caller's own, at its start), not through a DIR of a
		 * dup: a publish's note is on every fetched kernel's path */
		char ents[4096] __attribute__((aligned(8)));
		ssize_t got;
		while ((got = getdents64(dfd, ents, sizeof(ents))) > 0) {
			for (ssize_t off = 0; off < got;) {
				const struct dirent64 *de = (const struct dirent64 *)(ents + off);
				struct stat fst;
				off += de->d_reclen;
				if (de->d_type != DT_REG && de->d_type != DT_UNKNOWN)
					continue; /* ".", "..", and what a stat would not count either */
				if (fstatat(dfd, de->d_name, &fst, AT_SYMLINK_NOFOLLOW) != 0 ||
				    !S_ISREG(fst.st_mode))
					continue;
				bytes += (uint64_t)fst.st_size;
				if (strcmp(de->d_name, KC_CUBIN_NAME) == 0)
					cubin_mtime = fst.st_mtim.tv_sec;
			}
		}
		char buf[32];
		ssize_t n = fgetxattr(dfd, USED_XATTR, buf, sizeof(buf) - 1);
		if (n > 0) {
			buf[n] = '\0';
			persisted = strtoll(buf, NULL, 10);
		}
	}
	int64_t now = kc_wall_ms();
	struct file_handle *handle = cubin_mtime >= 0 ? handle_of(dfd) : NULL;
	pthread_mutex_lock(&e->lock);
	struct rec *r = find(e, st.st_dev, st.st_ino);
	if (cubin_mtime < 0) { /* not a published entry (any more) */
		if (r)
			drop(e, r);
		pthread_mutex_unlock(&e->lock);
		return;
	}
	r = r ? r : find_or_add(e, st.st_dev, st.st_ino);
	char *path = strdup(rel);
	if (!r || !path) {
		free(path);
		free(handle);
		pthread_mutex_unlock(&e->lock);
		return;
	}
	free(r->path);
	r->path = path;
	if (handle) {
		free(r->handle);
		r->handle = handle;
	}
	if (!r->indexed) {
		r->indexed = 1;
		e->entries++;
		r->bytes = 0;
		r->used = now_used ? now : (persisted > 0 ? persisted : cubin_mtime) * 1000;
		if (r->used > now)
			r->used = now; /* a time in the future (a clock step, a forged mtime) */
		/* what a restart would read back as the last use: the record, else the cubin's
		 * mtime (so a cubin published now is not written to at its first lookups) */
		r->persisted = persisted > 0 ? persisted : cubin_mtime;
		if (r->persisted > now / 1000) /* a future mtime would stop the writes */
			r->persisted = now / 1000;
	} else if (now_used) {
		r->used = now;
	}
	e->bytes += bytes - r->bytes;
	r->bytes = bytes;
	if (e->max_bytes && bytes > e->max_bytes && now_used)
		kc_log(KC_LOG_WARN, "%s: %" PRIu64 " bytes, more than max_size %" PRIu64 " on its own: "
		       "it is evicted once unused for %d s", rel, bytes, e->max_bytes,
		       KC_EVICT_GRACE);
	if (over(e, 0) && e->started)
		kc_ticker_wake(&e->cleaner);
	pthread_mutex_unlock(&e->lock);
}

void kc_evict_note(struct kc_evict *e, int dir, const char *name)
{
	int fd = openat(dir, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return;
	measure(e, fd, 1);
	close(fd);
}

void kc_evict_note_fd(struct kc_evict *e, int entry_fd)
{
	kc_evict_note(e, entry_fd, ".");
}

void kc_evict_touch(struct kc_evict *e, dev_t dev, ino_t ino)
{
	int64_t now = kc_wall_ms();
	char full[8192], buf[32];
	pthread_mutex_lock(&e->lock);
	struct rec *r = find(e, dev, ino);
	int persist = r && r->indexed && now / 1000 - r->persisted >= KC_EVICT_PERSIST;
	if (r && r->indexed)
		r->used = now;
	if (persist) {
		r->persisted = now / 1000;
		snprintf(full, sizeof(full), "%s/%s", e->store->root_path, r->path);
	}
	pthread_mutex_unlock(&e->lock);
	if (persist) {
		int n = snprintf(buf, sizeof(buf), "%" PRId64, now / 1000);
		if (lsetxattr(full, USED_XATTR, buf, (size_t)n, 0) != 0)
			kc_log(KC_LOG_DEBUG, "%s: cannot record its last use: %s", full, strerror(errno));
	}
}

void kc_evict_forget(struct kc_evict *e, dev_t dev, ino_t ino)
{
	pthread_mutex_lock(&e->lock);
	struct rec *r = find(e, dev, ino);
	if (r)
		drop(e, r);
	pthread_mutex_unlock(&e->lock);
}

int kc_evict_pin(struct kc_evict *e, dev_t dev, ino_t ino)
{
	pthread_mutex_lock(&e->lock);
	struct rec *r = find_or_add(e, dev, ino);
	if (r)
		r->pins++;
	pthread_mutex_unlock(&e->lock);
	return r ? 0 : -ENOMEM;
}

void kc_evict_unpin(struct kc_evict *e, dev_t dev, ino_t ino)
{
	pthread_mutex_lock(&e->lock);
	struct rec *r = find(e, dev, ino);
	if (r && r->pins && --r->pins == 0 && !r->indexed)
		drop(e, r);
	pthread_mutex_unlock(&e->lock);
}

void kc_evict_sample(struct kc_evict *e, struct kc_evict_stats *out)
{
	pthread_mutex_lock(&e->lock);
	out->entries = e->entries;
	out->bytes = e->bytes;
	out->scanned = e->scanned;
	pthread_mutex_unlock(&e->lock);
}

/* The start-up scan: nftw's callback takes no user pointer. */
static __thread struct kc_evict *scanning;

static int scan_visit(const char *path, const struct stat *st, int type, struct FTW *ftw)
{
	(void)st;
	if (type != FTW_D)
		return FTW_CONTINUE;
	const char *base = path + ftw->base;
	if (ftw->level == 1 && strcmp(base, KC_STATE_DIR) == 0)
		return FTW_SKIP_SUBTREE;
	if (ftw->level == 0 || kc_name_classify(base, NULL) != KC_NAME_ENTRY)
		return FTW_CONTINUE;
	int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd >= 0) {
		measure(scanning, fd, 0);
		close(fd);
	}
	return kc_ticker_stopping(&scanning->cleaner) ? FTW_STOP : FTW_SKIP_SUBTREE;
}

/* One victim, removed under the flight table's lock (no compile of it can start). */
struct victim {
	struct kc_evict *e;
	dev_t dev;
	ino_t ino;
	int64_t before;    /* only if last used before this (ms) */
	uint64_t bytes;
	int64_t used;
	char path[4096];   /* relative to the root */
	char trash[64];    /* its name in tmp/ once moved */
};

/* The current path of r relative to the root, through its handle (the entry, or a
 * directory above it, may have been renamed since it was indexed). Returns 0, -ENOENT when
 * it is gone or outside the tree, or -1 when the handle cannot be used (not privileged):
 * the recorded path then stands. */
static int current_path(struct kc_evict *e, struct rec *r, char *out, size_t len)
{
	if (!r->handle)
		return -1;
	int fd = open_by_handle_at(e->store->root_fd, r->handle, O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (fd < 0)
		return errno == ESTALE || errno == ENOENT ? -ENOENT : -1;
	int ok = rel_path(e, fd, out, len) == 0;
	close(fd);
	return ok ? 0 : -ENOENT;
}

static int move_out(void *arg)
{
	struct victim *v = arg;
	struct kc_evict *e = v->e;
	struct stat st;
	char path[4096];
	int ret = -EAGAIN;
	pthread_mutex_lock(&e->lock);
	struct rec *r = find(e, v->dev, v->ino);
	if (!r || !r->indexed || r->pins || r->used >= v->before || !r->path)
		goto out;
	int where = current_path(e, r, path, sizeof(path));
	if (where == -ENOENT) { /* removed, or evicted with an entry around it */
		drop(e, r);
		goto out;
	}
	if (where == 0 && strcmp(path, r->path) != 0) {
		char *moved = strdup(path);
		if (moved) {
			free(r->path);
			r->path = moved;
		}
	}
	if (fstatat(e->store->root_fd, r->path, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
	    st.st_dev != v->dev || st.st_ino != v->ino)
		goto out;
	snprintf(v->path, sizeof(v->path), "%s", r->path);
	snprintf(v->trash, sizeof(v->trash), "evicted.%ju.%" PRIu64, (uintmax_t)v->ino,
		 ++e->trashed);
	if (renameat(e->store->root_fd, v->path, e->store->tmp_fd, v->trash) != 0) {
		ret = -errno;
		goto out;
	}
	/* A client may have swapped another directory in under that name meanwhile: then
	 * that one is put back, and nothing is evicted. */
	if (fstatat(e->store->tmp_fd, v->trash, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
	    st.st_dev != v->dev || st.st_ino != v->ino) {
		if (renameat2(e->store->tmp_fd, v->trash, e->store->root_fd, v->path,
			      RENAME_NOREPLACE) != 0)
			kc_log(KC_LOG_ERR, "%s: moved aside by a race with a rename, and cannot be put "
			       "back (%s); it is in %s/tmp/%s", v->path, strerror(errno),
			       KC_STATE_DIR, v->trash);
		goto out;
	}
	v->bytes = r->bytes;
	v->used = r->used;
	atomic_fetch_add(&e->stats->evictions, 1);
	atomic_fetch_add(&e->stats->evicted_bytes, r->bytes);
	drop(e, r);
	ret = 0;
out:
	pthread_mutex_unlock(&e->lock);
	return ret;
}

/* Remove tmp/name; on failure keep it on the retry list. Cleaner thread only. */
static void remove_trash(struct kc_evict *e, const char *name)
{
	char path[4200];
	snprintf(path, sizeof(path), "%s/%s/tmp/%s", e->store->root_path, KC_STATE_DIR, name);
	if (kc_store_remove_tree(path) == 0)
		return;
	kc_log(KC_LOG_WARN, "cannot remove evicted %s yet: %s", path, strerror(errno));
	struct trash *t = calloc(1, sizeof(*t));
	if (t) {
		snprintf(t->name, sizeof(t->name), "%s", name);
		t->next = e->trash;
		e->trash = t;
	}
}

/* Try the removals that failed before again. Cleaner thread only. */
static void retry_trash(struct kc_evict *e)
{
	struct trash *list = e->trash;
	e->trash = NULL;
	while (list) {
		struct trash *t = list;
		list = t->next;
		remove_trash(e, t->name);
		free(t);
	}
}

static int oldest_first(const void *a, const void *b)
{
	const struct victim *x = a, *y = b;
	return x->used < y->used ? -1 : x->used > y->used;
}

struct listing {
	struct victim *v;
	size_t n;
};

static void list_one(const void *node, VISIT which, void *closure)
{
	struct rec *r = *(struct rec *const *)node;
	struct listing *l = closure;
	if ((which == postorder || which == leaf) && r->indexed && !r->pins) {
		l->v[l->n].dev = r->dev;
		l->v[l->n].ino = r->ino;
		l->v[l->n].used = r->used;
		l->n++;
	}
}

/* Evict the least recently used entries until under the low watermark. Returns how many
 * went. */
static unsigned evict_pass(struct kc_evict *e)
{
	pthread_mutex_lock(&e->lock);
	struct listing l = {malloc((e->entries + 1) * sizeof(*l.v)), 0};
	if (l.v)
		twalk_r(e->tree, list_one, &l);
	pthread_mutex_unlock(&e->lock);
	if (!l.v)
		return 0;
	qsort(l.v, l.n, sizeof(*l.v), oldest_first);
	unsigned gone = 0;
	int64_t before = kc_wall_ms() - KC_EVICT_GRACE * 1000;
	for (size_t i = 0; i < l.n && !kc_ticker_stopping(&e->cleaner); i++) {
		pthread_mutex_lock(&e->lock);
		int more = over(e, 1);
		pthread_mutex_unlock(&e->lock);
		if (!more)
			break;
		struct victim *v = &l.v[i];
		v->e = e;
		v->before = before;
		struct kc_flight_key key = {v->dev, v->ino};
		if (kc_flight_run_if_idle(e->flights, &key, move_out, v) != 0)
			continue; /* compiling, staging, used again, or gone */
		remove_trash(e, v->trash);
		kc_log(KC_LOG_INFO, "%s: evicted (%" PRIu64 " bytes, last used %.1f s ago)",
		       v->path, v->bytes, (double)(kc_wall_ms() - v->used) / 1000);
		if (e->evicted)
			e->evicted(e->arg, v->path);
		gone++;
	}
	free(l.v);
	return gone;
}

/* The start-up scan (nothing is evicted before it ends). */
static void scan(struct kc_evict *e)
{
	scanning = e;
	if (nftw(e->store->root_path, scan_visit, 32, FTW_PHYS | FTW_ACTIONRETVAL) != 0 &&
	    !kc_ticker_stopping(&e->cleaner))
		kc_log(KC_LOG_WARN, "scan of %s for eviction: %s", e->store->root_path,
		       strerror(errno));
	pthread_mutex_lock(&e->lock);
	e->scanned = 1;
	kc_log(KC_LOG_INFO, "%" PRIu64 " published entries, %" PRIu64 " bytes", e->entries,
	       e->bytes);
	pthread_mutex_unlock(&e->lock);
}

/* The cleaner's tick: the scan first; then, while over a bound, one eviction pass, again
 * at once while passes evict, in 1 s when nothing could go (all compiling, staged or just
 * used); under the bounds, idle until an entry noted over a bound (kc_evict_note) wakes
 * it. */
static long clean_tick(void *arg)
{
	struct kc_evict *e = arg;
	if (!e->scanned)
		scan(e);
	pthread_mutex_lock(&e->lock);
	int over_now = over(e, 0);
	pthread_mutex_unlock(&e->lock);
	if (!over_now)
		return KC_TICK_IDLE;
	retry_trash(e);
	unsigned gone = evict_pass(e);
	return gone ? 0 : 1000;
}

int kc_evict_start(struct kc_evict *e)
{
	int err = kc_ticker_start(&e->cleaner, 0, clean_tick, e);
	if (err)
		return err;
	pthread_mutex_lock(&e->lock);
	e->started = 1;
	pthread_mutex_unlock(&e->lock);
	return 0;
}

static void free_rec(void *p)
{
	struct rec *r = p;
	free(r->path);
	free(r->handle);
	free(r);
}

void kc_evict_stop(struct kc_evict *e)
{
	pthread_mutex_lock(&e->lock);
	e->started = 0; /* an entry noted wakes the cleaner no more */
	pthread_mutex_unlock(&e->lock);
	kc_ticker_stop(&e->cleaner);
}

/* The last uses since the hourly writes, written at a clean stop (twalk_r closure). */
static void persist_one(const void *node, VISIT which, void *closure)
{
	struct rec *r = *(struct rec *const *)node;
	struct kc_evict *e = closure;
	if ((which != postorder && which != leaf) || !r->indexed || !r->path ||
	    r->used / 1000 <= r->persisted)
		return;
	char full[8192], buf[32];
	snprintf(full, sizeof(full), "%s/%s", e->store->root_path, r->path);
	int n = snprintf(buf, sizeof(buf), "%" PRId64, r->used / 1000);
	if (lsetxattr(full, USED_XATTR, buf, (size_t)n, 0) == 0)
		r->persisted = r->used / 1000;
}

void kc_evict_destroy(struct kc_evict *e)
{
	kc_evict_stop(e);
	if (e->store && e->store->root_path)
		twalk_r(e->tree, persist_one, e);
	while (e->trash) { /* tmp/ is emptied when the store closes */
		struct trash *t = e->trash;
		e->trash = t->next;
		free(t);
	}
	tdestroy(e->tree, free_rec);
	e->tree = NULL;
	pthread_mutex_destroy(&e->lock);
}

int kc_parse_size(const char *text, uint64_t *out)
{
	char *end;
	if (!text || text[0] < '0' || text[0] > '9')
		return -EINVAL;
	errno = 0;
	unsigned long long v = strtoull(text, &end, 10);
	unsigned shift = 0;
	switch (*end) {
	case 'K': case 'k': shift = 10; end++; break;
	case 'M': case 'm': shift = 20; end++; break;
	case 'G': case 'g': shift = 30; end++; break;
	case 'T': case 't': shift = 40; end++; break;
	}
	if (errno || *end || v == 0 || v > (UINT64_MAX >> shift))
		return -EINVAL;
	*out = (uint64_t)v << shift;
	return 0;
}
