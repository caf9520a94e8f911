/* dir.c - directory handles: a snapshot of the backing directory taken at opendir and at
 * every rewind (as POSIX allows), with the mount's virtual names added. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fs.h"



static struct kc_fs *fs_of(fuse_req_t req)
{
	return fuse_req_userdata(req);
}

static struct kc_inode *inode_of(fuse_req_t req, fuse_ino_t ino)
{
	return kc_inode_get(&fs_of(req)->inodes, ino);
}


static void dh_clear(struct kc_dh *dh)
{
	for (size_t i = 0; i < dh->n; i++)
		free(dh->items[i].name);
	free(dh->items);
	dh->items = NULL;
	dh->n = 0;
}

static int dh_add(struct kc_dh *dh, size_t *cap, const char *name, ino_t ino, unsigned char type)
{
	if (dh->n == *cap) {
		size_t ncap = *cap ? *cap * 2 : 32;
		struct dir_item *items = realloc(dh->items, ncap * sizeof(*items));
		if (!items)
			return -ENOMEM;
		dh->items = items;
		*cap = ncap;
	}
	char *copy = strdup(name);
	if (!copy)
		return -ENOMEM;
	dh->items[dh->n++] = (struct dir_item){ino, type, copy};
	return 0;
}

/* Read the whole directory now (a snapshot, as POSIX allows between rewinds) and add the
 * virtual names: .kcachefs at the root, kernel.cubin in an entry whose recipe is staged. */
static int dh_fill(struct kc_fs *fs, struct kc_inode *in, struct kc_dh *dh)
{
	size_t cap = 0;
	int err = 0, has_cubin = 0;

	dh_clear(dh);
	if (in->virt) {
		if (dh_add(dh, &cap, ".", 2, DT_DIR) || dh_add(dh, &cap, "..", 1, DT_DIR) ||
		    dh_add(dh, &cap, KC_CTL_STATS, 3, DT_REG) ||
		    dh_add(dh, &cap, KC_CTL_METRICS, 4, DT_REG))
			return -ENOMEM;
		return 0;
	}
	int fd = fcntl(dh->fd, F_DUPFD_CLOEXEC, 0);
	DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
	if (!d) {
		err = -errno;
		if (fd >= 0)
			close(fd);
		return err;
	}
	rewinddir(d);
	for (;;) {
		errno = 0;
		struct dirent *de = readdir(d);
		if (!de) {
			err = errno ? -errno : 0;
			break;
		}
		if (in == &fs->inodes.root && strcmp(de->d_name, KC_STATE_DIR) == 0)
			continue; /* the store's state directory; .kcachefs is added below */
		if (strcmp(de->d_name, KC_CUBIN_NAME) == 0)
			has_cubin = 1;
		if ((err = dh_add(dh, &cap, de->d_name, de->d_ino, de->d_type)) != 0)
			break;
	}
	closedir(d);
	if (!err && in == &fs->inodes.root)
		err = dh_add(dh, &cap, KC_CTL_NAME, 2, DT_DIR);
	if (!err && in->entry && !has_cubin && kc_cache_cubin_pending(&fs->cache, in->fd))
		err = dh_add(dh, &cap, KC_CUBIN_NAME, in->ino ^ 0x5a5a5a5aULL, DT_REG);
	return err;
}

void kc_dir_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	struct kc_inode *in = inode_of(req, ino);
	char path[32];
	struct kc_dh *dh = calloc(1, sizeof(*dh));

	if (!dh)
		return (void)fuse_reply_err(req, ENOMEM);
	dh->fd = -1;
	if (!in->virt) {
		kc_fd_path(in->fd, path);
		dh->fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
		if (dh->fd < 0) {
			int err = errno;
			free(dh);
			return (void)fuse_reply_err(req, err);
		}
	}
	fi->fh = kc_idtable_add(&fs_of(req)->handles, dh, KC_HANDLE_DIR);
	if (!fi->fh) {
		if (dh->fd >= 0)
			close(dh->fd);
		free(dh);
		return (void)fuse_reply_err(req, ENOMEM);
	}
	fuse_reply_open(req, fi);
}

void kc_dir_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
		       struct fuse_file_info *fi)
{
	struct kc_dh *dh = kc_idtable_get(&fs_of(req)->handles, fi->fh, KC_HANDLE_DIR);
	char *buf;
	size_t used = 0;

	if (off == 0) {
		int err = dh_fill(fs_of(req), inode_of(req, ino), dh);
		if (err)
			return (void)fuse_reply_err(req, -err);
	}
	buf = malloc(size);
	if (!buf)
		return (void)fuse_reply_err(req, ENOMEM);
	for (size_t i = (size_t)off; i < dh->n; i++) {
		struct stat st = {.st_ino = dh->items[i].ino,
				  .st_mode = (mode_t)dh->items[i].type << 12};
		size_t n = fuse_add_direntry(req, buf + used, size - used, dh->items[i].name, &st,
					     (off_t)(i + 1));
		if (n > size - used)
			break;
		used += n;
	}
	fuse_reply_buf(req, buf, used);
	free(buf);
}

void kc_dir_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	struct kc_dh *dh = kc_idtable_get(&fs_of(req)->handles, fi->fh, KC_HANDLE_DIR);
	(void)ino;
	kc_idtable_remove(&fs_of(req)->handles, fi->fh);
	dh_clear(dh);
	if (dh->fd >= 0)
		close(dh->fd);
	free(dh);
	fuse_reply_err(req, 0);
}

void kc_dir_fsync(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi)
{
	struct kc_dh *dh = kc_idtable_get(&fs_of(req)->handles, fi->fh, KC_HANDLE_DIR);
	(void)ino;
	if (dh->fd < 0)
		return (void)fuse_reply_err(req, 0);
	int r = datasync ? fdatasync(dh->fd) : fsync(dh->fd);
	fuse_reply_err(req, r == 0 ? 0 : errno);
}

