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
	int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
	struct stat fst;
	if (fd < 0 || fstat(fd, &fst) != 0 || !S_ISREG(fst.st_mode) || fst.st_dev == walk->avoid) {
		walk->err = fd < 0 ? -errno : -EXDEV;
		if (fd >= 0)
			close(fd);
		return 1;
	}
	struct tree_file *f = &walk->files[walk->n];
	uint64_t size = 0;
	walk->err = kc_sha256_fd(fd, f->hex, &size);
	close(fd);
	if (walk->err)
		return 1;
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

int kc_tree_digest(const char *dir, dev_t avoid, char hex[KC_SHA256_HEXLEN + 1])
{
	struct tree_walk w = {.root_len = strlen(dir), .avoid = avoid};
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
		int err = kc_tree_digest(dir, (dev_t)-1, got);
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
