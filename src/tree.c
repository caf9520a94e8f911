/* tree.c - see tree.h */
#define _GNU_SOURCE
#include "tree.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#define FUSE_SUPER_MAGIC 0x65735546 /* linux/magic.h */

int kc_tree_is_mount_root(const char *dir)
{
	struct statfs fs;
	struct stat st;
	char stats[PATH_MAX + 32];

	snprintf(stats, sizeof(stats), "%s/.kcachefs/stats", strcmp(dir, "/") ? dir : "");
	return statfs(dir, &fs) == 0 && fs.f_type == FUSE_SUPER_MAGIC && stat(stats, &st) == 0 &&
	       S_ISREG(st.st_mode);
}

/* One remembered digest: the file as it was when hashed. */
struct memo_rec {
	dev_t dev;
	ino_t ino;
	off_t size;
	struct timespec mtim, ctim;
	char hex[KC_SHA256_HEXLEN + 1];
};

struct kc_tree_memo {
	char *path;
	struct memo_rec *old; /* loaded, sorted by (dev, ino) */
	size_t n_old;
	struct memo_rec *add; /* learned in this process */
	size_t n_add, cap_add;
	size_t hits, misses;
};

static int rec_cmp(const void *a, const void *b)
{
	const struct memo_rec *x = a, *y = b;
	if (x->dev != y->dev)
		return x->dev < y->dev ? -1 : 1;
	return x->ino < y->ino ? -1 : x->ino > y->ino;
}

static int same_ts(const struct timespec *a, const struct timespec *b)
{
	return a->tv_sec == b->tv_sec && a->tv_nsec == b->tv_nsec;
}

/* The memoized digest of the file st describes into hex: 1, or 0 (not known as it is). */
static int memo_find(struct kc_tree_memo *m, const struct stat *st, char *hex)
{
	struct memo_rec key = {.dev = st->st_dev, .ino = st->st_ino};
	const struct memo_rec *r = m && m->n_old ? bsearch(&key, m->old, m->n_old, sizeof(key),
							   rec_cmp)
					       : NULL;
	if (!r || r->size != st->st_size || !same_ts(&r->mtim, &st->st_mtim) ||
	    !same_ts(&r->ctim, &st->st_ctim))
		return 0;
	memcpy(hex, r->hex, KC_SHA256_HEXLEN + 1);
	return 1;
}

/* Remember hex for the file st describes, unless its ctime is not behind changed_before. */
static void memo_add(struct kc_tree_memo *m, const struct stat *st,
		     const struct timespec *changed_before, const char *hex)
{
	if (!m || st->st_ctim.tv_sec > changed_before->tv_sec ||
	    (st->st_ctim.tv_sec == changed_before->tv_sec &&
	     st->st_ctim.tv_nsec >= changed_before->tv_nsec))
		return;
	if (m->n_add == m->cap_add) {
		size_t cap = m->cap_add ? m->cap_add * 2 : 256;
		struct memo_rec *a = realloc(m->add, cap * sizeof(*a));
		if (!a)
			return;
		m->add = a;
		m->cap_add = cap;
	}
	struct memo_rec *r = &m->add[m->n_add++];
	*r = (struct memo_rec){.dev = st->st_dev, .ino = st->st_ino, .size = st->st_size,
			       .mtim = st->st_mtim, .ctim = st->st_ctim};
	memcpy(r->hex, hex, KC_SHA256_HEXLEN + 1);
}

struct kc_tree_memo *kc_tree_memo_load(const char *path)
{
	struct kc_tree_memo *m = calloc(1, sizeof(*m));
	if (!m || !(m->path = strdup(path))) {
		free(m);
		return NULL;
	}
	int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	struct stat st;
	FILE *f = NULL;
	if (fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() &&
	    !(st.st_mode & 022))
		f = fdopen(fd, "r");
	if (!f) {
		if (fd >= 0)
			close(fd);
		return m;
	}
	size_t cap = 0;
	unsigned long long dev, ino;
	long long size, ms, mn, cs, cn;
	char hex[KC_SHA256_HEXLEN + 2];
	while (m->n_old < KC_TREE_MEMO_MAX &&
	       fscanf(f, "%llu %llu %lld %lld %lld %lld %lld %65s\n", &dev, &ino, &size, &ms, &mn,
		      &cs, &cn, hex) == 8) {
		if (strlen(hex) != KC_SHA256_HEXLEN)
			break;
		if (m->n_old == cap) {
			cap = cap ? cap * 2 : 1024;
			struct memo_rec *o = realloc(m->old, cap * sizeof(*o));
			if (!o)
				break;
			m->old = o;
		}
		struct memo_rec *r = &m->old[m->n_old++];
		*r = (struct memo_rec){.dev = (dev_t)dev, .ino = (ino_t)ino, .size = (off_t)size,
				       .mtim = {(time_t)ms, (long)mn}, .ctim = {(time_t)cs, (long)cn}};
		memcpy(r->hex, hex, KC_SHA256_HEXLEN + 1);
	}
	fclose(f);
	if (m->n_old)
		qsort(m->old, m->n_old, sizeof(*m->old), rec_cmp);
	return m;
}

static void memo_put_rec(FILE *f, const struct memo_rec *r)
{
	fprintf(f, "%llu %llu %lld %lld %ld %lld %ld %s\n", (unsigned long long)r->dev,
		(unsigned long long)r->ino, (long long)r->size, (long long)r->mtim.tv_sec,
		r->mtim.tv_nsec, (long long)r->ctim.tv_sec, r->ctim.tv_nsec, r->hex);
}

int kc_tree_memo_save(struct kc_tree_memo *m)
{
	if (!m || !m->n_add)
		return 0;
	char dir[PATH_MAX], tmp[PATH_MAX + 16];
	snprintf(dir, sizeof(dir), "%s", m->path);
	char *slash = strrchr(dir, '/');
	if (slash && slash != dir) {
		*slash = '\0';
		if (mkdir(dir, 0700) != 0 && errno != EEXIST)
			return -errno;
	}
	snprintf(tmp, sizeof(tmp), "%s.XXXXXX", m->path);
	int fd = mkstemp(tmp);
	if (fd < 0)
		return -errno;
	FILE *f = fdopen(fd, "w");
	if (!f) {
		int err = -errno;
		close(fd);
		unlink(tmp);
		return err;
	}
	qsort(m->add, m->n_add, sizeof(*m->add), rec_cmp);
	size_t kept = 0;
	for (size_t i = 0; i < m->n_add; i++, kept++)
		memo_put_rec(f, &m->add[i]);
	for (size_t i = 0; i < m->n_old && kept < KC_TREE_MEMO_MAX; i++) /* not superseded */
		if (!bsearch(&m->old[i], m->add, m->n_add, sizeof(*m->add), rec_cmp)) {
			memo_put_rec(f, &m->old[i]);
			kept++;
		}
	int err = fclose(f) != 0 ? -errno : 0;
	if (!err && rename(tmp, m->path) != 0)
		err = -errno;
	if (err)
		unlink(tmp);
	return err;
}

void kc_tree_memo_counts(const struct kc_tree_memo *m, size_t *hits, size_t *misses)
{
	*hits = m ? m->hits : 0;
	*misses = m ? m->misses : 0;
}

void kc_tree_memo_free(struct kc_tree_memo *m)
{
	if (!m)
		return;
	free(m->path);
	free(m->old);
	free(m->add);
	free(m);
}

/* One file of the tree: its path relative to the root and the digest of its bytes. */
struct tree_file {
	char *rel;
	char hex[KC_SHA256_HEXLEN + 1];
};

/* The walk's state: nftw's callback takes no user pointer. */
static __thread struct tree_walk {
	struct tree_file *files;
	size_t n, cap;
	size_t root_len;
	dev_t avoid, root_dev;
	uint64_t bytes;
	struct kc_tree_memo *memo;
	int err;
} *walk;

static int tree_visit(const char *path, const struct stat *st, int type, struct FTW *ftw)
{
	(void)ftw;
	if (type == FTW_DNR) { /* a directory whose headers could change unseen */
		walk->err = -EACCES;
		return 1;
	}
	if ((type == FTW_F || type == FTW_D) && st->st_dev == walk->avoid) {
		walk->err = -EXDEV; /* into the mount: looking there would compile its entries */
		return 1;
	}
	if (type == FTW_D && st->st_dev != walk->root_dev && kc_tree_is_mount_root(path)) {
		walk->err = -EXDEV; /* a kcachefs mount below (the daemon's own, maybe) */
		return 1;
	}
	if (type != FTW_F || !S_ISREG(st->st_mode))
		return 0;
	if (walk->n >= KC_TREE_MAX_FILES || walk->bytes + (uint64_t)st->st_size > KC_TREE_MAX_BYTES) {
		walk->err = -E2BIG;
		return 1;
	}
	if (walk->n == walk->cap) {
		size_t cap = walk->cap ? walk->cap * 2 : 256;
		struct tree_file *f = realloc(walk->files, cap * sizeof(*f));
		if (!f) {
			walk->err = -ENOMEM;
			return 1;
		}
		walk->files = f;
		walk->cap = cap;
	}
	struct tree_file *f = &walk->files[walk->n];
	uint64_t size = (uint64_t)st->st_size;
	if (memo_find(walk->memo, st, f->hex)) {
		walk->memo->hits++;
	} else {
		int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
		struct stat fst;
		struct timespec changed_before;
		if (fd < 0 || fstat(fd, &fst) != 0 || !S_ISREG(fst.st_mode) ||
		    fst.st_dev == walk->avoid) {
			walk->err = fd < 0 ? -errno : -EXDEV;
			if (fd >= 0)
				close(fd);
			return 1;
		}
		clock_gettime(CLOCK_REALTIME_COARSE, &changed_before);
		walk->err = kc_sha256_fd(fd, f->hex, &size);
		close(fd);
		if (walk->err)
			return 1;
		if (walk->memo) {
			walk->memo->misses++;
			memo_add(walk->memo, &fst, &changed_before, f->hex);
		}
	}
	if (!(f->rel = strdup(path + walk->root_len))) {
		walk->err = -ENOMEM;
		return 1;
	}
	walk->bytes += size;
	walk->n++;
	return 0;
}

static int cmp_files(const void *a, const void *b)
{
	return strcmp(((const struct tree_file *)a)->rel, ((const struct tree_file *)b)->rel);
}

int kc_tree_digest(const char *dir, dev_t avoid, struct kc_tree_memo *memo,
		   char hex[KC_SHA256_HEXLEN + 1])
{
	struct tree_walk w = {.root_len = strlen(dir), .avoid = avoid, .memo = memo};
	struct kc_sha256 h;
	struct stat st;
	int err;

	if (stat(dir, &st) != 0)
		return -errno;
	w.root_dev = st.st_dev;
	while (w.root_len > 1 && dir[w.root_len - 1] == '/')
		w.root_len--; /* "dir/" names the files as "dir" does */
	walk = &w;
	if (nftw(dir, tree_visit, 64, 0) < 0 && !w.err)
		w.err = -errno;
	walk = NULL;
	err = w.err;
	if (!err) {
		if (w.n)
			qsort(w.files, w.n, sizeof(*w.files), cmp_files);
		err = kc_sha256_init(&h);
	}
	if (!err) {
		kc_sha256_update(&h, "kcachefs-tree-v1\n", 17);
		for (size_t i = 0; i < w.n; i++) {
			kc_sha256_field(&h, w.files[i].rel, strlen(w.files[i].rel));
			kc_sha256_field(&h, w.files[i].hex, KC_SHA256_HEXLEN);
		}
		kc_sha256_final(&h, hex);
	}
	for (size_t i = 0; i < w.n; i++)
		free(w.files[i].rel);
	free(w.files);
	return err;
}

int kc_tree_root_line(const char *line, size_t ll, const char **digest, const char **dir,
		      size_t *dl)
{
	const size_t tl = strlen(KC_TREE_ROOT_TAG);
	if (ll < tl + KC_SHA256_HEXLEN + 2 || memcmp(line, KC_TREE_ROOT_TAG, tl) != 0 ||
	    line[tl + KC_SHA256_HEXLEN] != ' ' || line[tl + KC_SHA256_HEXLEN + 1] != '/')
		return 0;
	*digest = line + tl;
	*dir = line + tl + KC_SHA256_HEXLEN + 1;
	*dl = ll - tl - KC_SHA256_HEXLEN - 1;
	return 1;
}

int kc_tree_check_roots(const char *flags, size_t len, char *why, size_t whylen)
{
	const size_t tl = strlen(KC_TREE_ROOT_TAG);
	for (size_t off = 0; off < len;) {
		const char *line = flags + off, *nl = memchr(line, '\n', len - off);
		size_t ll = nl ? (size_t)(nl - line) : len - off;
		off += ll + 1;
		if (ll && line[ll - 1] == '\r')
			ll--;
		if (ll < tl || memcmp(line, KC_TREE_ROOT_TAG, tl) != 0)
			continue;
		char want[KC_SHA256_HEXLEN + 1], got[KC_SHA256_HEXLEN + 1], dir[PATH_MAX];
		const char *d, *rd;
		size_t rdl;
		if (!kc_tree_root_line(line, ll, &d, &rd, &rdl) || rdl >= sizeof(dir) ||
		    memchr(rd, '\0', rdl)) {
			snprintf(why, whylen, "malformed '%s' line (want a digest and an absolute "
				 "directory)", KC_TREE_ROOT_TAG "...");
			return -EINVAL;
		}
		memcpy(want, d, KC_SHA256_HEXLEN);
		want[KC_SHA256_HEXLEN] = '\0';
		memcpy(dir, rd, rdl);
		dir[rdl] = '\0';
		int err = kc_tree_digest(dir, (dev_t)-1, NULL, got);
		if (!err && strcmp(want, got) != 0)
			err = -ESTALE;
		if (err) {
			snprintf(why, whylen, "include root %s: %s", dir,
				 err == -ESTALE ? "its headers are no longer the bytes kernel.flags "
						  "names (changed since staged)"
				 : err == -EXDEV ? "reaches into a kcachefs mount"
				 : err == -E2BIG ? "too many files or bytes to hash"
						 : strerror(-err));
			return err;
		}
	}
	return 0;
}
