/* tree.c - see tree.h */
#define _GNU_SOURCE
#include "tree.h"

#include "flags.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
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

/* One remembered digest: the file as it was when hashed (hex[0] == '\0': a free slot). */
struct memo_rec {
	dev_t dev;
	ino_t ino;
	off_t size;
	struct timespec mtim, ctim;
	char hex[KC_SHA256_HEXLEN + 1];
};

/* An open-addressing hash table keyed by (dev, ino), linear probing, at most half full. */
struct kc_tree_memo {
	char *path; /* the shim's memo file, or NULL: in memory only */
	pthread_mutex_t lock;
	struct memo_rec *slots;
	size_t cap, n, max; /* cap: a power of two, or 0 */
	size_t learned;     /* records put since load */
	size_t hits, misses;
};

static size_t rec_hash(dev_t dev, ino_t ino, size_t cap)
{
	uint64_t h = ((uint64_t)dev * 0x9E3779B97F4A7C15ull) ^ (uint64_t)ino;
	h ^= h >> 33;
	h *= 0xFF51AFD7ED558CCDull;
	h ^= h >> 33;
	return (size_t)h & (cap - 1);
}

/* The slot of (dev, ino) in m, or the free slot where it would go; m->cap > 0. */
static struct memo_rec *rec_slot(struct kc_tree_memo *m, dev_t dev, ino_t ino)
{
	for (size_t i = rec_hash(dev, ino, m->cap);; i = (i + 1) & (m->cap - 1)) {
		struct memo_rec *r = &m->slots[i];
		if (!r->hex[0] || (r->dev == dev && r->ino == ino))
			return r;
	}
}

static int same_ts(const struct timespec *a, const struct timespec *b)
{
	return a->tv_sec == b->tv_sec && a->tv_nsec == b->tv_nsec;
}

/* Put rec into m (lock held): replaces the record of its file; a memo at its bound is
 * emptied first (the digests are only an optimisation: they are taken again). */
static void memo_put_locked(struct kc_tree_memo *m, const struct memo_rec *rec)
{
	struct memo_rec *r = m->cap ? rec_slot(m, rec->dev, rec->ino) : NULL;
	if (!r || !r->hex[0]) {
		if (m->n >= m->max) {
			memset(m->slots, 0, m->cap * sizeof(*m->slots));
			m->n = 0;
		}
		if ((m->n + 1) * 2 > m->cap) {
			size_t cap = m->cap ? m->cap * 2 : 1024;
			struct memo_rec *s = calloc(cap, sizeof(*s)), *old = m->slots;
			if (!s)
				return;
			size_t ocap = m->cap;
			m->slots = s;
			m->cap = cap;
			for (size_t i = 0; i < ocap; i++)
				if (old[i].hex[0])
					*rec_slot(m, old[i].dev, old[i].ino) = old[i];
			free(old);
		}
		r = rec_slot(m, rec->dev, rec->ino);
		m->n++;
	}
	*r = *rec;
	m->learned++;
}

/* The memoized digest of the file st describes into hex: 1, or 0 (not known as it is). */
static int memo_find(struct kc_tree_memo *m, const struct stat *st, char *hex)
{
	int found = 0;
	pthread_mutex_lock(&m->lock);
	const struct memo_rec *r = m->cap ? rec_slot(m, st->st_dev, st->st_ino) : NULL;
	if (r && r->hex[0] && r->size == st->st_size && same_ts(&r->mtim, &st->st_mtim) &&
	    same_ts(&r->ctim, &st->st_ctim)) {
		memcpy(hex, r->hex, KC_SHA256_HEXLEN + 1);
		found = 1;
		m->hits++;
	}
	pthread_mutex_unlock(&m->lock);
	return found;
}

/* Remember hex for the file st describes. */
static void memo_add(struct kc_tree_memo *m, const struct stat *st, const char *hex)
{
	struct memo_rec rec = {.dev = st->st_dev, .ino = st->st_ino, .size = st->st_size,
			       .mtim = st->st_mtim, .ctim = st->st_ctim};
	memcpy(rec.hex, hex, KC_SHA256_HEXLEN + 1);
	pthread_mutex_lock(&m->lock);
	memo_put_locked(m, &rec);
	pthread_mutex_unlock(&m->lock);
}

struct kc_tree_memo *kc_tree_memo_new(size_t max_files)
{
	struct kc_tree_memo *m = calloc(1, sizeof(*m));
	if (!m)
		return NULL;
	m->max = max_files ? max_files : 1;
	pthread_mutex_init(&m->lock, NULL);
	return m;
}

struct kc_tree_memo *kc_tree_memo_load(const char *path)
{
	struct kc_tree_memo *m = kc_tree_memo_new(KC_TREE_MEMO_MAX);
	if (!m || !(m->path = strdup(path))) {
		kc_tree_memo_free(m);
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
	unsigned long long dev, ino;
	long long size, ms, mn, cs, cn;
	char hex[KC_SHA256_HEXLEN + 2];
	while (m->n < KC_TREE_MEMO_MAX &&
	       fscanf(f, "%llu %llu %lld %lld %lld %lld %lld %65s\n", &dev, &ino, &size, &ms, &mn,
		      &cs, &cn, hex) == 8) {
		if (strlen(hex) != KC_SHA256_HEXLEN)
			break;
		struct memo_rec r = {.dev = (dev_t)dev, .ino = (ino_t)ino, .size = (off_t)size,
				     .mtim = {(time_t)ms, (long)mn}, .ctim = {(time_t)cs, (long)cn}};
		memcpy(r.hex, hex, KC_SHA256_HEXLEN + 1);
		memo_put_locked(m, &r);
	}
	fclose(f);
	m->learned = 0;
	return m;
}

int kc_tree_memo_save(struct kc_tree_memo *m)
{
	if (!m || !m->path || !m->learned)
		return 0;
	char dir[PATH_MAX], tmp[PATH_MAX + 16];
	snprintf(dir, sizeof(dir), "%s", m->path);
	char *slash = strrchr(dir, '/');
	if (slash && slash != dir) { /* with its parents: $XDG_CACHE_HOME may not exist yet
				     * (the XDG spec says to make it, mode 0700) */
		*slash = '\0';
		for (char *p = dir + 1;; p++) {
			if (*p != '/' && *p != '\0')
				continue;
			char was = *p;
			*p = '\0';
			if (mkdir(dir, 0700) != 0 && errno != EEXIST)
				return -errno;
			*p = was;
			if (!was)
				break;
		}
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
	pthread_mutex_lock(&m->lock);
	for (size_t i = 0; i < m->cap; i++) {
		const struct memo_rec *r = &m->slots[i];
		if (r->hex[0])
			fprintf(f, "%llu %llu %lld %lld %ld %lld %ld %s\n",
				(unsigned long long)r->dev, (unsigned long long)r->ino,
				(long long)r->size, (long long)r->mtim.tv_sec, r->mtim.tv_nsec,
				(long long)r->ctim.tv_sec, r->ctim.tv_nsec, r->hex);
	}
	pthread_mutex_unlock(&m->lock);
	int err = fclose(f) != 0 ? -errno : 0;
	if (!err && rename(tmp, m->path) != 0)
		err = -errno;
	if (err)
		unlink(tmp);
	return err;
}

void kc_tree_memo_counts(struct kc_tree_memo *m, size_t *hits, size_t *misses)
{
	*hits = *misses = 0;
	if (!m)
		return;
	pthread_mutex_lock(&m->lock);
	*hits = m->hits;
	*misses = m->misses;
	pthread_mutex_unlock(&m->lock);
}

void kc_tree_memo_free(struct kc_tree_memo *m)
{
	if (!m)
		return;
	pthread_mutex_destroy(&m->lock);
	free(m->path);
	free(m->slots);
	free(m);
}

int kc_tree_roots(const char *flags, size_t len, struct kc_argv *roots)
{
	for (size_t off = 0; flags && off < len;) {
		const char *line = flags + off, *nl = memchr(line, '\n', len - off), *d, *dir;
		size_t dl, ll = nl ? (size_t)(nl - line) : len - off;
		off += ll + 1;
		if (ll && line[ll - 1] == '\r')
			ll--;
		if (kc_tree_root_line(line, ll, &d, &dir, &dl)) {
			while (dl > 1 && dir[dl - 1] == '/')
				dl--;
			char *copy = strndup(dir, dl);
			int err = copy ? kc_argv_push(roots, copy) : -ENOMEM;
			free(copy);
			if (err)
				return err;
		}
	}
	return 0;
}

int kc_tree_local_type(unsigned long type)
{
	static const unsigned long local[] = {
		0xEF53,     /* ext2/3/4 */
		0x58465342, /* xfs */
		0x9123683E, /* btrfs */
		0x01021994, /* tmpfs */
		0x858458F6, /* ramfs */
		0x794C7630, /* overlayfs */
		0x2FC12FC1, /* zfs */
		0xF2F52010, /* f2fs */
		0xCA451A4E, /* bcachefs */
		0x73717368, /* squashfs */
	};
	for (size_t i = 0; i < sizeof(local) / sizeof(*local); i++)
		if (type == local[i])
			return 1;
	return 0;
}

/* The granularity of the filesystem clock that stamped ts, at most: the largest power of ten
 * (in ns) that divides its nanoseconds, 2 s when they are 0 (FAT's 2 s, ext4's 1 s with small
 * inodes). A fine stamp that happens to end in zeros only gets a wider margin. */
static long long stamp_granule_ns(const struct timespec *ts)
{
	if (ts->tv_nsec == 0)
		return 2000000000ll;
	long long g = 1;
	for (long n = ts->tv_nsec; n % 10 == 0; n /= 10)
		g *= 10;
	return g;
}

#define TIMESTAMP_TOKEN "__TIMESTAMP__"

/* What kc_tree_file_digest has seen of a file's bytes so far. */
struct stamp_look {
	char tail[sizeof(TIMESTAMP_TOKEN)]; /* the last bytes of the chunk before */
	size_t tail_len;
	off_t seen;  /* bytes seen */
	int program; /* an ELF file: not looked into */
	int found;
};

/* kc_sha256_fd_seen's observer: look for TIMESTAMP_TOKEN, across chunks too. */
static void look_for_stamp(const char *data, size_t len, void *arg)
{
	struct stamp_look *l = arg;
	const size_t tl = sizeof(TIMESTAMP_TOKEN) - 1;
	if (l->seen == 0 && len >= 4 && memcmp(data, "\x7f" "ELF", 4) == 0)
		l->program = 1; /* a program: no preprocessor reads it */
	l->seen += (off_t)len;
	if (l->program || l->found)
		return;
	char edge[2 * sizeof(TIMESTAMP_TOKEN)]; /* the chunk before's tail, this one's head */
	size_t head = len < tl - 1 ? len : tl - 1;
	memcpy(edge, l->tail, l->tail_len);
	memcpy(edge + l->tail_len, data, head);
	l->found = memmem(edge, l->tail_len + head, TIMESTAMP_TOKEN, tl) ||
		   memmem(data, len, TIMESTAMP_TOKEN, tl);
	if (len >= tl - 1) {
		l->tail_len = tl - 1;
		memcpy(l->tail, data + len - l->tail_len, l->tail_len);
	} else { /* a short chunk: the last bytes of the tail before and of it */
		size_t all = l->tail_len + head, keep = all < tl - 1 ? all : tl - 1;
		memcpy(l->tail, edge + all - keep, keep);
		l->tail_len = keep;
	}
}

int kc_tree_file_digest(int fd, const struct stat *st, char hex[KC_SHA256_HEXLEN + 1],
			uint64_t *size)
{
	struct stamp_look look = {.tail_len = 0};
	int err = kc_sha256_fd_seen(fd, hex, size, (int64_t)st->st_size, look_for_stamp, &look);
	if (err || !look.found)
		return err;
	char text[KC_SHA256_HEXLEN + 80];
	int len = snprintf(text, sizeof(text), "%s " TIMESTAMP_TOKEN " %lld.%09ld", hex,
			   (long long)st->st_mtim.tv_sec, st->st_mtim.tv_nsec);
	return kc_sha256_buf(text, (size_t)len, hex) ? -ENOMEM : 0;
}

int kc_tree_lease(int fd)
{
	return fcntl(fd, F_SETSIG, SIGURG) == 0 && fcntl(fd, F_SETLEASE, F_RDLCK) == 0;
}

int kc_tree_memoizable(int fd, const struct stat *before, const struct timespec *now,
		       int leased)
{
	struct stat after;
	struct statfs fs;
	if (!leased || fcntl(fd, F_GETLEASE) != F_RDLCK)
		return 0; /* a writer could have written it unstamped, before or during the read */
	if (fstatfs(fd, &fs) != 0 || !kc_tree_local_type((unsigned long)fs.f_type))
		return 0;
	if (fstat(fd, &after) != 0 || before->st_dev != after.st_dev ||
	    before->st_ino != after.st_ino || before->st_size != after.st_size ||
	    !same_ts(&before->st_mtim, &after.st_mtim) || !same_ts(&before->st_ctim, &after.st_ctim))
		return 0; /* changed while it was read */
	long long c = (long long)before->st_ctim.tv_sec * 1000000000ll + before->st_ctim.tv_nsec;
	long long t = (long long)now->tv_sec * 1000000000ll + now->tv_nsec;
	if (c + stamp_granule_ns(&before->st_ctim) > t)
		return 0; /* a write after the read, in the same granule, could keep every field */
	return 1;
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
	if (!walk->memo || !memo_find(walk->memo, st, f->hex)) {
		int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
		struct stat fst;
		struct timespec now;
		if (fd < 0 || fstat(fd, &fst) != 0 || !S_ISREG(fst.st_mode) ||
		    fst.st_dev == walk->avoid) {
			walk->err = fd < 0 ? -errno : -EXDEV;
			if (fd >= 0)
				close(fd);
			return 1;
		}
		clock_gettime(CLOCK_REALTIME_COARSE, &now);
		int leased = walk->memo && kc_tree_lease(fd);
		walk->err = kc_tree_file_digest(fd, &fst, f->hex, &size);
		if (!walk->err && walk->memo) {
			pthread_mutex_lock(&walk->memo->lock);
			walk->memo->misses++;
			pthread_mutex_unlock(&walk->memo->lock);
			if (size == (uint64_t)fst.st_size && kc_tree_memoizable(fd, &fst, &now, leased))
				memo_add(walk->memo, &fst, f->hex);
		}
		close(fd);
		if (walk->err)
			return 1;
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

int kc_tree_check_roots(const char *flags, size_t len, struct kc_tree_memo *memo, char *why,
			size_t whylen)
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
		int err = kc_tree_digest(dir, (dev_t)-1, memo, got);
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
