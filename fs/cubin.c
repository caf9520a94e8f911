/* cubin.c - published cubins: the open of one (checked against its record, served from the
 * kernel's page cache), and the answers of getattr and open requests that waited for one
 * (waiter.c parks them; the compile thread calls these once the cubin is published).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "stage.h"
#include "log.h"

static struct kc_fs *fs_of(fuse_req_t req)
{
	return fuse_req_userdata(req);
}

void kc_cubin_open(fuse_req_t req, struct kc_inode *in, int fd, struct fuse_file_info *fi)
{
	struct kc_fs *fs = fs_of(req);
	enum kc_role role;
	int entry_fd = -1;
	/* The common case, a cubin verified before and unchanged since, needs no entry. */
	int err = kc_cache_verify_open(&fs->cache, fd, -1);
	if (err) { /* check again with the entry at hand, so that a bad cubin is dealt with */
		entry_fd = kc_inode_entry_fd(&fs->inodes, in, &role);
		err = kc_cache_verify_open(&fs->cache, fd, entry_fd);
	}
	if (!err && fs->cfg.verify_keys) { /* the entry's name, now, must say what this is */
		if (entry_fd < 0)
			entry_fd = kc_inode_entry_fd(&fs->inodes, in, &role);
		int v = kc_cache_verify_name(&fs->cache, fd, entry_fd, fuse_req_ctx(req)->uid);
		if (v) {
			close(fd);
			if (entry_fd >= 0)
				close(entry_fd);
			return (void)fuse_reply_err(req, -v);
		}
	}
	struct kc_fh *fh = err ? NULL : kc_fh_new(fs, FH_PLAIN, fd);

	if (err && entry_fd >= 0) { /* make the next open look it up (and compile) again */
		struct stat est;
		struct kc_inode *entry = fstat(entry_fd, &est) == 0
						 ? kc_inode_find_held(&fs->inodes, est.st_dev, est.st_ino)
						 : NULL;
		if (entry)
			kc_notifier_inval_entry(&fs->notifier, kc_inode_ino(&fs->inodes, entry),
						KC_CUBIN_NAME);
		kc_inode_let_go(&fs->inodes, entry);
	}
	if (entry_fd >= 0)
		close(entry_fd);
	if (!fh) {
		close(fd);
		return (void)fuse_reply_err(req, err ? -err : ENOMEM);
	}
	fh->in = in; /* counted: an unlinked cubin stays readable while open */
	kc_inode_opened(&fs->inodes, in, 1);
	fi->fh = fh->id;
	/* Immutable: the kernel's pages of this inode (a pending inode's were stored from this
	 * recipe's cubin by open_published) stay valid. */
	fi->keep_cache = 1;
	/* Read-only and immutable: the close of this descriptor has nothing to flush, so the
	 * kernel need not send FLUSH (FOPEN_NOFLUSH, Linux 5.17+; older kernels ignore it). */
	fi->noflush = 1;
	atomic_fetch_add(&fs->cache.stats.cubin_opens, 1);
	ino_t entry_ino = in->pending ? in->ino : in->entry_ino;
	if (entry_ino)
		kc_evict_touch(&fs->evict, in->dev, entry_ino);
	fuse_reply_open(req, fi);
}

/* Open the published cubin a pending inode stands for. Returns the fd, -ENOENT when none
 * is published (the caller waits again), or -ESTALE when the published one is of another
 * recipe (the entry was re-staged, or compiled by a compiler that replaced the one of this
 * inode's recipe: this inode's cubin is gone; the kernel, answered ESTALE, looks the name
 * up again). On the first success the
 * cubin's bytes are stored in the kernel's page cache of the pending inode, which also
 * sets its size: every later reader (read, mmap, splice) sees the whole file. */
static int open_published(struct kc_fs *fs, struct kc_inode *pending)
{
	int fd = openat(pending->fd, KC_CUBIN_NAME, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	if (kc_cache_cubin_recipe_id(fd) != pending->recipe_id) {
		close(fd);
		return -ESTALE;
	}
	char path[32];
	kc_fd_path(fd, path);
	int first = !__atomic_exchange_n(&pending->stored, 1, __ATOMIC_SEQ_CST);
	/* From here a lookup of this cubin answers this inode, and the inode ledger keeps it
	 * across a crash (kc_inode_published, which takes the first: one that comes second
	 * closes its descriptor). Every caller that returns a cubin makes sure of it, so that
	 * a lookup after this (kc_cubin_adopt) finds it set. */
	if (first || __atomic_load_n(&pending->cubin_fd, __ATOMIC_SEQ_CST) < 0)
		kc_inode_published(&fs->inodes, pending, open(path, O_PATH | O_CLOEXEC));
	if (first) {
		struct stat st;
		if (fstat(fd, &st) == 0 && st.st_size > 0) {
			struct fuse_bufvec buf = FUSE_BUFVEC_INIT((size_t)st.st_size);
			buf.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
			buf.buf[0].fd = fd;
			buf.buf[0].pos = 0;
			int err = fuse_lowlevel_notify_store(fs->se, kc_inode_ino(&fs->inodes, pending),
							     0, &buf, 0);
			if (err && err != -ENOENT)
				kc_log(KC_LOG_WARN, "storing a compiled cubin in the kernel: %s",
				       strerror(-err));
		}
	}
	return fd;
}

void kc_cubin_adopt(struct kc_fs *fs, struct kc_inode *entry)
{
	struct stat est;
	int fd = openat(entry->fd, KC_CUBIN_NAME, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0)
		return;
	uint64_t recipe_id = kc_cache_cubin_recipe_id(fd); /* 0: a client's cubin */
	close(fd);
	if (!recipe_id || fstat(entry->fd, &est) != 0)
		return;
	struct kc_inode *pending = kc_inode_find_pending_held(&fs->inodes, est.st_dev, est.st_ino,
							      recipe_id);
	if (pending && __atomic_load_n(&pending->cubin_fd, __ATOMIC_SEQ_CST) < 0 &&
	    (fd = open_published(fs, pending)) >= 0)
		close(fd);
	kc_inode_let_go(&fs->inodes, pending);
}

int kc_reply_published_attr(fuse_req_t req, struct kc_inode *pending)
{
	struct stat st;
	int fd = open_published(fs_of(req), pending);
	if (fd == -ENOENT)
		return fd;
	if (fd < 0) /* ESTALE: as in kc_reply_published_open */
		return (void)fuse_reply_err(req, -fd), 0;
	int err = fstat(fd, &st) == 0 ? 0 : errno;
	close(fd);
	if (err)
		fuse_reply_err(req, err);
	else
		fuse_reply_attr(req, &st, 0);
	return 0;
}

int kc_reply_published_open(fuse_req_t req, struct kc_inode *pending, struct fuse_file_info *fi)
{
	int fd = open_published(fs_of(req), pending);
	if (fd == -ENOENT)
		return fd;
	/* ESTALE: the recipe this inode stands for was compiled under another identity (a
	 * compiler replaced during the wait) or re-staged; the kernel looks the name up again
	 * and opens what it names now (do_filp_open's LOOKUP_REVAL retry). */
	if (fd < 0)
		return (void)fuse_reply_err(req, -fd), 0;
	kc_cubin_open(req, pending, fd, fi);
	return 0;
}
