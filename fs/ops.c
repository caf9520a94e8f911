/* ops.c - the FUSE low-level operations: translate each request into calls on the backing
 * store (an O_PATH fd per inode, *at() system calls) and on the kernel cache (src/cache/cache.h).
 *
 * Kernel-entry rules live in the core; what is here is the FUSE side of them:
 *  - lookup of kernel.cubin in an entry is the single-flight point. A lookup that must wait
 *    for a compile is answered at once with a pending inode (with a cluster store, once the
 *    flight turns out to compile rather than fetch: waiter.c); its getattr and open are not
 *    answered in their worker thread: they are parked as waiters (waiter.c) and answered
 *    from the compile thread (cubin.c, or EINTR if their process is being killed), so
 *    waiters hold no FUSE thread and the size the kernel learns is the compiled size;
 *  - kernel.cu, kernel.flags and kernel.cubin opened for writing in an entry go to a private
 *    stage temporary per open, committed at close (flush) or by rename;
 *  - published cubins get long entry/attr timeouts and keep_cache; recipe files timeout 0.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "stage.h"
#include "key.h"
#include "log.h"

static struct kc_fs *fs_of(fuse_req_t req)
{
	return fuse_req_userdata(req);
}

static struct kc_inode *inode_of(fuse_req_t req, fuse_ino_t ino)
{
	return kc_inode_get(&fs_of(req)->inodes, ino);
}

static struct kc_fh *fh_of(fuse_req_t req, struct fuse_file_info *fi)
{
	return kc_fh_get(fs_of(req), fi->fh);
}

/* Answer ESTALE and return 1 for an inode the daemon let go of (kc_inode_unlinked): its
 * object has no name and is gone. Else 0. */
static int stale(fuse_req_t req, struct kc_inode *in)
{
	if (!__atomic_load_n(&in->unhashed, __ATOMIC_SEQ_CST))
		return 0;
	fuse_reply_err(req, ESTALE);
	return 1;
}

/* Hand fh, open on in, to the kernel: in counts it until its release. */
static void count_open(fuse_req_t req, struct kc_inode *in, struct kc_fh *fh)
{
	fh->in = in;
	kc_inode_opened(&fs_of(req)->inodes, in, 1);
}

/* The object that was stat'ed as st before a call took one of its names: let go of it if
 * that was its last (kc_inode_unlinked). With discarded, it is a client's file that a stage
 * consumed: the kernel moved its dentry onto the staged name, so until that dentry goes,
 * its inode is refused (opens ESTALE, writes EBADF). */
static void name_gone(struct kc_fs *fs, const struct stat *st, int discarded)
{
	struct kc_inode *in = kc_inode_find_held(&fs->inodes, st->st_dev, st->st_ino);
	struct stat now;
	if (!in || in == &fs->inodes.root)
		return;
	if (discarded && fstatat(in->fd, "", &now, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) == 0 &&
	    now.st_nlink == 0)
		__atomic_store_n(&in->discarded, 1, __ATOMIC_SEQ_CST);
	kc_inode_unlinked(&fs->inodes, in);
	kc_inode_let_go(&fs->inodes, in);
}

static int is_ctl_name(struct kc_fs *fs, struct kc_inode *parent, const char *name)
{
	return parent == &fs->inodes.root && strcmp(name, KC_CTL_NAME) == 0;
}

/* Names that no request may create, remove or rename: the control directory. */
static int reserved(struct kc_fs *fs, struct kc_inode *parent, const char *name)
{
	return parent->virt || is_ctl_name(fs, parent, name);
}

/* kernel.cu, kernel.flags or kernel.cubin inside an entry: only regular files staged
 * through the mount may carry these names. */
static int staged_name(const struct kc_inode *parent, const char *name)
{
	return parent->entry && kc_role_is_staged(kc_name_role(name));
}

static double timeout_for(const struct kc_inode *in)
{
	if (in->staging || in->role == KC_ROLE_SOURCE || in->role == KC_ROLE_FLAGS ||
	    in->role == KC_ROLE_LOG)
		return 0.0;
	if (in->role == KC_ROLE_CUBIN)
		return KC_TIMEOUT_PUBLISHED;
	return KC_TIMEOUT_PLAIN;
}

/* Answer EACCES and return 1 if req comes from a compile (a uid of the daemon's own
 * compile_uids range, or of any default range, another daemon's): a compile has no
 * business on the mount, may not write into it, and would deadlock waiting on a compile
 * there. Else 0. Every operation that starts from a path (lookup, opendir, ...) asks. */
static int kc_refuse_compile(fuse_req_t req)
{
	unsigned first = fs_of(req)->cfg.compile_uids;
	uid_t uid = fuse_req_ctx(req)->uid;
	/* its own range, and every default one: another daemon's compiles have no business
	 * here either */
	if ((!first || uid < first || uid - first >= KC_COMPILE_SLOTS) &&
	    (uid < KC_DEFAULT_COMPILE_UIDS ||
	     uid - KC_DEFAULT_COMPILE_UIDS >= KC_DEFAULT_COMPILE_RANGES * KC_COMPILE_SLOTS))
		return 0;
	kc_log(KC_LOG_DEBUG, "a request of compile uid %u refused", (unsigned)uid);
	fuse_reply_err(req, EACCES);
	return 1;
}

static void own_by_caller(fuse_req_t req, int dirfd, const char *name, int flags)
{
	if (geteuid() != 0)
		return;
	const struct fuse_ctx *ctx = fuse_req_ctx(req);
	if (fchownat(dirfd, name, ctx->uid, ctx->gid, flags) != 0)
		kc_log(KC_LOG_DEBUG, "chown %s: %s", name, strerror(errno));
}

/* Look name up in parent on the backing store and take a kernel reference. */
static int do_lookup(struct kc_fs *fs, struct kc_inode *parent, const char *name,
		     struct fuse_entry_param *e)
{
	struct stat st;
	int err = 0;

	memset(e, 0, sizeof(*e));
	int fd = openat(parent->fd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0) {
		if (errno == EMFILE || errno == ENFILE)
			kc_log(KC_LOG_ERR, "out of file descriptors with %llu inodes known to the "
			       "kernel: raise the daemon's open file limit (LimitNOFILE)",
			       (unsigned long long)fs->inodes.count);
		return -errno;
	}
	if (fstatat(fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) {
		err = -errno;
		close(fd);
		return err;
	}
	struct kc_inode *in = kc_inode_ref(&fs->inodes, fd, &st, &err);
	if (!in)
		return err;
	kc_inode_touch(&fs->inodes, parent);
	kc_notifier_relieve(&fs->notifier);
	kc_inode_place(&fs->inodes, in, parent, name, 0);
	if (in->entry)
		kc_evict_touch(&fs->evict, st.st_dev, st.st_ino);
	e->ino = kc_inode_ino(&fs->inodes, in);
	e->attr = st;
	e->attr_timeout = e->entry_timeout = timeout_for(in);
	return 0;
}

static void reply_lookup(fuse_req_t req, struct kc_inode *parent, const char *name)
{
	struct fuse_entry_param e;
	int err = do_lookup(fs_of(req), parent, name, &e);
	if (err)
		fuse_reply_err(req, -err);
	else
		fuse_reply_entry(req, &e);
}

static void reply_virtual_entry(fuse_req_t req, struct kc_inode *in)
{
	struct fuse_entry_param e = {0};
	e.ino = kc_inode_ino(&fs_of(req)->inodes, in);
	kc_ctl_attr(fs_of(req), in, &e.attr);
	e.attr_timeout = e.entry_timeout = KC_TIMEOUT_PLAIN;
	fuse_reply_entry(req, &e);
}

/* The entry for a kernel.cubin that is staged but not compiled yet: a pending inode with
 * timeouts 0, so the kernel asks again (getattr, which waits in waiter.c) before it uses
 * the placeholder size, and finds the published inode at the next lookup. */
static void reply_pending_entry(fuse_req_t req, struct kc_inode *entry, uint64_t recipe_id)
{
	struct kc_fs *fs = fs_of(req);
	struct fuse_entry_param e = {0};
	struct stat est;
	int err = 0;

	if (fstat(entry->fd, &est) != 0)
		return (void)fuse_reply_err(req, errno);
	struct kc_inode *in = kc_inode_ref_pending(&fs->inodes, entry->fd, &est, recipe_id, &err);
	if (!in)
		return (void)fuse_reply_err(req, -err);
	kc_inode_touch(&fs->inodes, entry);
	kc_notifier_relieve(&fs->notifier);
	e.ino = kc_inode_ino(&fs->inodes, in);
	e.attr.st_ino = est.st_ino ^ 0x5a5a5a5aULL;
	e.attr.st_mode = S_IFREG | 0444;
	e.attr.st_nlink = 1;
	e.attr.st_uid = est.st_uid;
	e.attr.st_gid = est.st_gid;
	e.attr.st_mtim = e.attr.st_ctim = e.attr.st_atim = est.st_mtim;
	e.attr_timeout = e.entry_timeout = 0;
	if (fuse_reply_entry(req, &e) != 0)
		kc_inode_forget(&fs->inodes, in, 1);
}

/* Answer the lookup of kernel.cubin in entry with r, kc_cache_lookup_cubin's result. */
static void answer_cubin_lookup(fuse_req_t req, struct kc_inode *entry, int r, uint64_t recipe_id)
{
	if (r == KC_PENDING)
		return reply_pending_entry(req, entry, recipe_id);
	if (r < 0)
		return (void)fuse_reply_err(req, -r);
	kc_cubin_adopt(fs_of(req), entry); /* the inode it had while it compiled, if any */
	reply_lookup(req, entry, KC_CUBIN_NAME);
}

/* kc_answer_lookup_fn: the cubin, or a pending inode while its compile runs; the cache's
 * errno otherwise (kc_cache_lookup_cubin). */
static void reply_cubin_entry(fuse_req_t req, struct kc_inode *entry)
{
	uint64_t recipe_id = 0;
	int r = kc_cache_lookup_cubin(&fs_of(req)->cache, entry->fd, NULL, &recipe_id);
	answer_cubin_lookup(req, entry, r, recipe_id);
}

/* kernel.cubin in an entry. Published: the real file. Staged: start its compile and answer
 * a pending inode now; with a cluster store, park the lookup while the flight may end in a
 * fetch (waiter.c), so that it is answered with the fetched cubin. */
static void lookup_cubin(fuse_req_t req, struct kc_inode *entry)
{
	struct kc_fs *fs = fs_of(req);
	if (!fs->cache.remote)
		return reply_cubin_entry(req, entry);
	struct kc_waiter *w = kc_lookup_waiter(req, entry, reply_cubin_entry);
	uint64_t recipe_id = 0;
	int r = kc_cache_lookup_cubin(&fs->cache, entry->fd, w, &recipe_id);
	if (r == KC_PENDING && w)
		return; /* parked: answered from the flight or the sweeper */
	kc_lookup_waiter_drop(w);
	answer_cubin_lookup(req, entry, r, recipe_id);
}

static void kc_lookup(fuse_req_t req, fuse_ino_t parent_ino, const char *name)
{
	if (kc_refuse_compile(req))
		return;
	struct kc_fs *fs = fs_of(req);
	struct kc_inode *parent = inode_of(req, parent_ino);

	if (is_ctl_name(fs, parent, name))
		return reply_virtual_entry(req, &fs->inodes.ctl_dir);
	if (parent->virt) {
		if (parent->virt == KC_VIRT_CTL_DIR && strcmp(name, KC_CTL_STATS) == 0)
			return reply_virtual_entry(req, &fs->inodes.stats);
		if (parent->virt == KC_VIRT_CTL_DIR && strcmp(name, KC_CTL_METRICS) == 0)
			return reply_virtual_entry(req, &fs->inodes.metrics);
		return (void)fuse_reply_err(req, ENOENT);
	}
	if (parent->entry && strcmp(name, KC_CUBIN_NAME) == 0)
		return lookup_cubin(req, parent);
	reply_lookup(req, parent, name);
}

static void kc_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup)
{
	kc_inode_forget(&fs_of(req)->inodes, inode_of(req, ino), nlookup);
	fuse_reply_none(req);
}

static void kc_forget_multi(fuse_req_t req, size_t count, struct fuse_forget_data *forgets)
{
	for (size_t i = 0; i < count; i++)
		kc_inode_forget(&fs_of(req)->inodes, inode_of(req, forgets[i].ino),
				forgets[i].nlookup);
	fuse_reply_none(req);
}

/* ---- attributes ---- */

static void kc_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	if (kc_refuse_compile(req))
		return;
	struct kc_inode *in = inode_of(req, ino);
	struct stat st;

	if (stale(req, in))
		return;
	if (in->virt) {
		kc_ctl_attr(fs_of(req), in, &st);
		return (void)fuse_reply_attr(req, &st, KC_TIMEOUT_PLAIN);
	}
	if (in->pending && !fi) {
		int cubin_fd = __atomic_load_n(&in->cubin_fd, __ATOMIC_SEQ_CST);
		if (cubin_fd < 0)
			return kc_park(req, in, NULL); /* answered with the compiled size */
		if (fstat(cubin_fd, &st) != 0)
			return (void)fuse_reply_err(req, errno);
		/* Stored: this inode's bytes are that cubin's for good (cubin_fd is set once), so
		 * its attributes are as immutable as a published cubin's: the other readers that
		 * hold this inode need not ask again (a joining node's 8 readers asked 8 times). */
		return (void)fuse_reply_attr(req, &st, KC_TIMEOUT_PUBLISHED);
	}
	int r = fi && (fh_of(req, fi)->kind == FH_STAGE || in->pending)
			? fstat(fh_of(req, fi)->fd, &st)
			: fstatat(in->fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW);
	if (r != 0)
		return (void)fuse_reply_err(req, errno);
	fuse_reply_attr(req, &st, timeout_for(in));
}

static void kc_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr, int to_set,
		       struct fuse_file_info *fi)
{
	if (kc_refuse_compile(req))
		return;
	struct kc_inode *in = inode_of(req, ino);
	struct kc_fh *fh = fi ? fh_of(req, fi) : NULL;
	char path[32];
	int r = 0;

	if (stale(req, in))
		return;
	if (in->virt == KC_VIRT_STATS && (to_set & FUSE_SET_ATTR_SIZE) && attr->st_size == 0 &&
	    !(to_set & (FUSE_SET_ATTR_MODE | FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID))) {
		kc_ctl_reset(fs_of(req)); /* truncate -s 0 .kcachefs/stats */
		struct stat st;
		kc_ctl_attr(fs_of(req), in, &st);
		return (void)fuse_reply_attr(req, &st, KC_TIMEOUT_PLAIN);
	}
	/* A published cubin is immutable: no mode, owner, size or time changes. */
	if (in->virt || (in->pending && !fh) ||
	    (in->role == KC_ROLE_CUBIN && !in->staging && !(fh && fh->kind == FH_STAGE)))
		return (void)fuse_reply_err(req, EPERM);
	kc_fd_path(in->fd, path);
	if (to_set & FUSE_SET_ATTR_MODE)
		r = fh && fh->kind != FH_STATS ? fchmod(fh->fd, attr->st_mode)
					       : chmod(path, attr->st_mode);
	if (!r && (to_set & (FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID))) {
		uid_t uid = (to_set & FUSE_SET_ATTR_UID) ? attr->st_uid : (uid_t)-1;
		gid_t gid = (to_set & FUSE_SET_ATTR_GID) ? attr->st_gid : (gid_t)-1;
		r = fchownat(in->fd, "", uid, gid, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW);
	}
	if (!r && (to_set & FUSE_SET_ATTR_SIZE)) {
		int err = fh ? kc_stage_prepare_write(fs_of(req), in, fh) : 0;
		if (err) {
			errno = -err;
			r = -1;
		} else if (fh && fh->kind == FH_STAGE) {
			r = ftruncate(fh->fd, attr->st_size);
			if (r != 0)
				fh->failed = errno; /* a stage of a length never asked for */
			else
				kc_stage_note_writer(req, fh);
		} else if (kc_role_is_staged(in->role) && !in->staging) {
			errno = EPERM; /* a staged file or published cubin changes only by staging */
			r = -1;
		} else {
			r = fh ? ftruncate(fh->fd, attr->st_size) : truncate(path, attr->st_size);
			if (r == 0 && attr->st_size == 0) /* emptied: what failed is gone */
				__atomic_store_n(&in->write_failed, 0, __ATOMIC_SEQ_CST);
		}
	}
	if (!r && (to_set & (FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME))) {
		struct timespec tv[2] = {{.tv_nsec = UTIME_OMIT}, {.tv_nsec = UTIME_OMIT}};
		if (to_set & FUSE_SET_ATTR_ATIME_NOW)
			tv[0].tv_nsec = UTIME_NOW;
		else if (to_set & FUSE_SET_ATTR_ATIME)
			tv[0] = attr->st_atim;
		if (to_set & FUSE_SET_ATTR_MTIME_NOW)
			tv[1].tv_nsec = UTIME_NOW;
		else if (to_set & FUSE_SET_ATTR_MTIME)
			tv[1] = attr->st_mtim;
		r = fh && fh->kind != FH_STATS ? futimens(fh->fd, tv)
					       : utimensat(AT_FDCWD, path, tv, 0);
	}
	if (r != 0)
		return (void)fuse_reply_err(req, errno);
	kc_getattr(req, ino, fi);
}

/* ---- namespace ---- */

static void kc_mkdir(fuse_req_t req, fuse_ino_t parent_ino, const char *name, mode_t mode)
{
	if (kc_refuse_compile(req))
		return;
	struct kc_fs *fs = fs_of(req);
	struct kc_inode *parent = inode_of(req, parent_ino);
	const char *why = NULL;

	if (reserved(fs, parent, name))
		return (void)fuse_reply_err(req, is_ctl_name(fs, parent, name) ? EEXIST : EPERM);
	if (kc_name_classify(name, &why) == KC_NAME_BAD_ENTRY) {
		kc_log(KC_LOG_WARN, "mkdir '%s' refused: not a valid kernel entry name (%s)", name,
		       why);
		return (void)fuse_reply_err(req, EINVAL);
	}
	if (staged_name(parent, name))
		return (void)fuse_reply_err(req, EPERM);
	if (mkdirat(parent->fd, name, mode) != 0)
		return (void)fuse_reply_err(req, errno);
	own_by_caller(req, parent->fd, name, AT_SYMLINK_NOFOLLOW);
	reply_lookup(req, parent, name);
}

static void kc_symlink(fuse_req_t req, const char *link, fuse_ino_t parent_ino, const char *name)
{
	if (kc_refuse_compile(req))
		return;
	struct kc_fs *fs = fs_of(req);
	struct kc_inode *parent = inode_of(req, parent_ino);

	if (reserved(fs, parent, name) || staged_name(parent, name))
		return (void)fuse_reply_err(req, EPERM);
	if (kc_name_classify(name, NULL) != KC_NAME_PLAIN) {
		/* A link named like an entry would lead clients out of the mount's control. */
		kc_log(KC_LOG_WARN, "symlink '%s' refused: a name of the kernel.<name>.<hash> form "
		       "is for entry directories", name);
		return (void)fuse_reply_err(req, EINVAL);
	}
	if (symlinkat(link, parent->fd, name) != 0)
		return (void)fuse_reply_err(req, errno);
	own_by_caller(req, parent->fd, name, AT_SYMLINK_NOFOLLOW);
	reply_lookup(req, parent, name);
}

/* mknod: a regular file with a staged name is an empty file staged at once (committed
 * when mknod returns, as a close would); no other kind of file takes such a name. */
static void kc_mknod(fuse_req_t req, fuse_ino_t parent_ino, const char *name, mode_t mode,
		     dev_t rdev)
{
	if (kc_refuse_compile(req))
		return;
	struct kc_fs *fs = fs_of(req);
	struct kc_inode *parent = inode_of(req, parent_ino);

	if (reserved(fs, parent, name))
		return (void)fuse_reply_err(req, is_ctl_name(fs, parent, name) ? EEXIST : EPERM);
	if (staged_name(parent, name)) {
		if (!S_ISREG(mode)) {
			kc_log(KC_LOG_WARN, "mknod '%s' refused (EPERM): only a regular file is "
			       "staged", name);
			return (void)fuse_reply_err(req, EPERM);
		}
		if (faccessat(parent->fd, name, F_OK, AT_SYMLINK_NOFOLLOW) == 0)
			return (void)fuse_reply_err(req, EEXIST);
		struct kc_fh *fh = kc_fh_new(fs, FH_STAGE, -1);
		if (!fh)
			return (void)fuse_reply_err(req, ENOMEM);
		fh->role = kc_name_role(name);
		fh->entry_fd = fcntl(parent->fd, F_DUPFD_CLOEXEC, 0);
		int err = fh->entry_fd < 0 ? -errno : kc_stage_begin(fs, fh, -1, mode);
		if (!err) {
			own_by_caller(req, fs->store.tmp_fd, fh->tmpname, 0);
			err = kc_stage_commit(fs, fh);
		}
		kc_fh_free(fs, fh);
		if (err)
			return (void)fuse_reply_err(req, -err);
		return reply_lookup(req, parent, name);
	}
	if (!S_ISREG(mode) && kc_name_classify(name, NULL) != KC_NAME_PLAIN) {
		kc_log(KC_LOG_WARN, "mknod '%s' refused: a name of the kernel.<name>.<hash> form "
		       "is for entry directories", name);
		return (void)fuse_reply_err(req, EINVAL);
	}
	if (mknodat(parent->fd, name, mode, rdev) != 0)
		return (void)fuse_reply_err(req, errno);
	own_by_caller(req, parent->fd, name, AT_SYMLINK_NOFOLLOW);
	reply_lookup(req, parent, name);
}

static void kc_readlink(fuse_req_t req, fuse_ino_t ino)
{
	if (kc_refuse_compile(req))
		return;
	struct kc_inode *in = inode_of(req, ino);
	char buf[PATH_MAX + 1];
	if (stale(req, in))
		return;
	if (in->virt)
		return (void)fuse_reply_err(req, EINVAL);
	ssize_t n = readlinkat(in->fd, "", buf, sizeof(buf) - 1);
	if (n < 0)
		return (void)fuse_reply_err(req, errno);
	buf[n] = '\0';
	fuse_reply_readlink(req, buf);
}

static void kc_link(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent_ino, const char *name)
{
	if (kc_refuse_compile(req))
		return;
	struct kc_fs *fs = fs_of(req);
	struct kc_inode *in = inode_of(req, ino);
	struct kc_inode *newparent = inode_of(req, newparent_ino);
	char path[32];

	if (stale(req, in))
		return;
	/* A second name would give one file two roles; staged files enter only by staging. */
	if (in->virt || reserved(fs, newparent, name))
		return (void)fuse_reply_err(req, EPERM);
	if (staged_name(newparent, name) || kc_role_is_staged(in->role)) {
		kc_log(KC_LOG_WARN, "link to '%s' refused (EPERM): %s", name,
		       kc_role_is_staged(in->role)
			       ? "a staged or published file has no second name (copy it)"
			       : "kernel.cu, kernel.flags and kernel.cubin are staged by writing "
				 "or by rename, never linked");
		return (void)fuse_reply_err(req, EPERM);
	}
	if (__atomic_load_n(&in->discarded, __ATOMIC_SEQ_CST))
		return (void)fuse_reply_err(req, ESTALE);
	kc_fd_path(in->fd, path);
	if (linkat(AT_FDCWD, path, newparent->fd, name, AT_SYMLINK_FOLLOW) != 0)
		return (void)fuse_reply_err(req, errno);
	reply_lookup(req, newparent, name);
}

/* A recipe file left an entry: drop what was compiled from it. */
static void recipe_removed(fuse_req_t req, fuse_ino_t entry_ino, struct kc_inode *entry,
			   const char *name)
{
	struct kc_fs *fs = fs_of(req);
	enum kc_role role = kc_name_role(name);
	if (!entry->entry || (role != KC_ROLE_SOURCE && role != KC_ROLE_FLAGS))
		return;
	if (kc_cache_unstage(&fs->cache, entry->fd))
		kc_notifier_inval_entry(&fs->notifier, entry_ino, KC_CUBIN_NAME);
}

static void kc_unlink(fuse_req_t req, fuse_ino_t parent_ino, const char *name)
{
	if (kc_refuse_compile(req))
		return;
	struct kc_fs *fs = fs_of(req);
	struct kc_inode *parent = inode_of(req, parent_ino);

	if (reserved(fs, parent, name))
		return (void)fuse_reply_err(req, EPERM);
	struct stat st;
	int known = fstatat(parent->fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0;
	if (unlinkat(parent->fd, name, 0) != 0)
		return (void)fuse_reply_err(req, errno);
	if (known) /* its space is free when unlink returns */
		name_gone(fs, &st, 0);
	recipe_removed(req, parent_ino, parent, name);
	if (parent->entry)
		kc_evict_note_fd(&fs->evict, parent->fd);
	fuse_reply_err(req, 0);
}

static void kc_rmdir(fuse_req_t req, fuse_ino_t parent_ino, const char *name)
{
	if (kc_refuse_compile(req))
		return;
	struct kc_fs *fs = fs_of(req);
	struct kc_inode *parent = inode_of(req, parent_ino);

	if (reserved(fs, parent, name))
		return (void)fuse_reply_err(req, is_ctl_name(fs, parent, name) ? EBUSY : EPERM);
	struct stat st;
	if (fstatat(parent->fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0)
		return (void)fuse_reply_err(req, errno);
	if (unlinkat(parent->fd, name, AT_REMOVEDIR) != 0)
		return (void)fuse_reply_err(req, errno);
	kc_evict_forget(&fs->evict, st.st_dev, st.st_ino);
	fuse_reply_err(req, 0);
}

/* Refresh the role of the known inode at parent/name, if any, and return it held (the
 * caller lets go, kc_inode_let_go). Unheld, it could be freed under this call: another
 * rename over the same name makes the kernel FORGET it meanwhile (a daemon crash in
 * kc_inode_place, seen once under test_renames_over_final_names_never_show_partial_files). */
static struct kc_inode *replace_one(struct kc_fs *fs, struct kc_inode *parent, const char *name)
{
	struct stat st;
	if (fstatat(parent->fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0)
		return NULL;
	struct kc_inode *in = kc_inode_find_held(&fs->inodes, st.st_dev, st.st_ino);
	if (in)
		kc_inode_place(&fs->inodes, in, parent, name, 0);
	return in;
}

/* After a successful rename: the moved inode's role follows its new name, and when a
 * directory moved, so do the roles of the files it holds that the kernel knows (a
 * directory renamed into an entry makes its kernel.cu staged, and the reverse). */
static void replace_role(struct kc_fs *fs, struct kc_inode *newparent, const char *newname)
{
	static const char *const staged[] = {KC_SOURCE_NAME, KC_FLAGS_NAME, KC_CUBIN_NAME,
					     KC_LOG_NAME};
	struct kc_inode *in = replace_one(fs, newparent, newname);
	if (in && in->type == S_IFDIR)
		for (unsigned i = 0; i < sizeof(staged) / sizeof(staged[0]); i++)
			kc_inode_let_go(&fs->inodes, replace_one(fs, in, staged[i]));
	kc_inode_let_go(&fs->inodes, in);
}

/* A directory may not take a bad kernel.<name>.<hash> name, nor a symlink any name of that
 * form. Returns 0 or -EINVAL (logged). */
static int name_refused(const struct stat *st, const char *newname)
{
	const char *why = NULL;
	if (S_ISLNK(st->st_mode) && kc_name_classify(newname, NULL) != KC_NAME_PLAIN) {
		kc_log(KC_LOG_WARN, "rename of a symlink to '%s' refused: a name of the "
		       "kernel.<name>.<hash> form is for entry directories", newname);
		return -EINVAL;
	}
	if (S_ISDIR(st->st_mode) && kc_name_classify(newname, &why) == KC_NAME_BAD_ENTRY) {
		kc_log(KC_LOG_WARN, "rename to '%s' refused: not a valid kernel entry name (%s)",
		       newname, why);
		return -EINVAL;
	}
	return 0;
}

/* Why a rename that would change which bytes kernel.cu, kernel.flags or kernel.cubin of an
 * entry name, from either side of the call, is refused (EPERM), or NULL when it may go on:
 * the one way in is a regular file renamed onto such a name, which stages a copy of it. */
static const char *staged_rename_refusal(const struct kc_inode *parent, const char *name,
					 const struct stat *st, const struct kc_inode *newparent,
					 const char *newname, unsigned int flags)
{
	int from = staged_name(parent, name), to = staged_name(newparent, newname);
	if (!from && !to)
		return NULL;
	if (flags & (RENAME_EXCHANGE | RENAME_WHITEOUT))
		return "kernel.cu, kernel.flags and kernel.cubin are never exchanged (a staged "
		       "file changes only by staging)";
	if (from)
		return "a staged or published file keeps its name (unlink it to re-stage, or "
		       "copy it)";
	if (!S_ISREG(st->st_mode))
		return "only a regular file is staged";
	return NULL;
}

static void kc_rename(fuse_req_t req, fuse_ino_t parent_ino, const char *name,
		      fuse_ino_t newparent_ino, const char *newname, unsigned int flags)
{
	if (kc_refuse_compile(req))
		return;
	struct kc_fs *fs = fs_of(req);
	struct kc_inode *parent = inode_of(req, parent_ino);
	struct kc_inode *newparent = inode_of(req, newparent_ino);
	enum kc_role role = newparent->entry ? kc_name_role(newname) : KC_ROLE_PLAIN;
	struct stat st, tst;
	int err = 0;

	if (reserved(fs, parent, name) || reserved(fs, newparent, newname))
		return (void)fuse_reply_err(req, EPERM);
	if (fstatat(parent->fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0)
		return (void)fuse_reply_err(req, errno);
	const char *why = staged_rename_refusal(parent, name, &st, newparent, newname, flags);
	if (why) {
		kc_log(KC_LOG_WARN, "rename of '%s' to '%s' refused (EPERM): %s", name, newname, why);
		return (void)fuse_reply_err(req, EPERM);
	}
	if (kc_role_is_staged(role)) {
		/* Renaming a file onto kernel.cu/.flags/.cubin stages a copy of it. */
		struct kc_inode *src = kc_inode_find_held(&fs->inodes, st.st_dev, st.st_ino);
		if ((flags & RENAME_NOREPLACE) &&
		    fstatat(newparent->fd, newname, &tst, AT_SYMLINK_NOFOLLOW) == 0)
			err = -EEXIST;
		else if (src && __atomic_load_n(&src->write_failed, __ATOMIC_SEQ_CST)) {
			kc_log(KC_LOG_WARN, "rename of '%s' to '%s' refused (EIO): a write to it "
			       "failed, so it is not what its writer meant to stage", name, newname);
			err = -EIO;
		} else
			err = kc_stage_result(fs, kc_cache_stage_copy(&fs->cache, role, parent->fd,
								      name, newparent->fd),
					      newparent_ino, newname);
		kc_inode_let_go(&fs->inodes, src);
		if (!err)
			name_gone(fs, &st, 1); /* the entry holds a copy: the client's file goes */
	} else if (!(err = name_refused(&st, newname)) && (flags & RENAME_EXCHANGE)) {
		/* The other side takes name. */
		if (fstatat(newparent->fd, newname, &tst, AT_SYMLINK_NOFOLLOW) != 0)
			err = -errno;
		else
			err = name_refused(&tst, name);
	}
	/* A file the rename replaces is not let go of here (kc_inode_unlinked): a reader that
	 * looked the name up just before opens it next, and would get ESTALE; the kernel's
	 * one retry can meet the next rename over the name again (writers renaming over
	 * final names, readers opening them). Its space comes back at the kernel's FORGET. */
	if (!err && !kc_role_is_staged(role) &&
	    renameat2(parent->fd, name, newparent->fd, newname, flags) != 0)
		err = -errno;
	if (err)
		return (void)fuse_reply_err(req, -err);
	if (parent != newparent || strcmp(name, newname) != 0)
		recipe_removed(req, parent_ino, parent, name);
	replace_role(fs, newparent, newname);
	if (flags & RENAME_EXCHANGE)
		replace_role(fs, parent, name);
	/* The index of published entries follows: an entry moved in (or out), or a cubin
	 * moved out of its entry. */
	if (S_ISDIR(st.st_mode))
		kc_evict_note(&fs->evict, newparent->fd, newname);
	if (parent->entry)
		kc_evict_note(&fs->evict, parent->fd, ".");
	if (flags & RENAME_EXCHANGE)
		kc_evict_note(&fs->evict, parent->fd, name);
	fuse_reply_err(req, 0);
}

/* ---- files ---- */

/* Open a staged file for writing: a private stage, seeded with the bytes of seed_fd
 * unless O_TRUNC, committed at close. Consumes entry_fd. Replies. */
static void open_stage(fuse_req_t req, struct fuse_file_info *fi, struct kc_inode *in,
		       enum kc_role role, int entry_fd, int seed_fd)
{
	struct kc_fs *fs = fs_of(req);
	struct kc_fh *fh = kc_fh_new(fs, FH_STAGE, -1);
	struct stat st;
	int err = !fh ? -ENOMEM : fstat(seed_fd, &st) ? -errno : 0;

	if (!err) {
		fh->role = role;
		fh->entry_fd = entry_fd;
		if (fi->flags & O_TRUNC) /* emptied: a change its opener's close commits */
			kc_stage_note_writer(req, fh);
		err = kc_stage_begin(fs, fh, (fi->flags & O_TRUNC) ? -1 : seed_fd, st.st_mode | 0600);
	}
	fi->direct_io = 1; /* the stage's bytes stay out of the staged inode's page cache */
	if (err) {
		if (fh)
			kc_fh_free(fs, fh);
		else
			close(entry_fd);
		return (void)fuse_reply_err(req, -err);
	}
	count_open(req, in, fh);
	fi->fh = fh->id;
	if (fuse_reply_open(req, fi) != 0)
		kc_fh_release(fs, fh);
}

/* Open in's object through path (its fd's /proc path) with flags. The object must still
 * be in's: an inode let go of by a concurrent unlink has a placeholder there (ESTALE).
 * Returns the fd or -errno. */
static int open_object(const struct kc_inode *in, const char *path, int flags)
{
	struct stat st;
	int fd = open(path, flags | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	if (fstat(fd, &st) != 0 || st.st_dev != in->dev || st.st_ino != in->ino) {
		close(fd);
		return -ESTALE;
	}
	return fd;
}

static void kc_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	if (kc_refuse_compile(req))
		return;
	struct kc_fs *fs = fs_of(req);
	struct kc_inode *in = inode_of(req, ino);
	/* O_TRUNC changes the file even with O_RDONLY (Linux truncates): a write too. */
	int writing = (fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC);
	char path[32];
	enum kc_role role;

	if (in->virt == KC_VIRT_CTL_DIR)
		return (void)fuse_reply_err(req, EISDIR);
	if (in->virt) {
		/* Only stats opens for writing (the kernel checked the caller is the daemon's
		 * user), so that it can be truncated: that zeroes the counters. */
		if (writing && in->virt != KC_VIRT_STATS)
			return (void)fuse_reply_err(req, EACCES);
		if (fi->flags & O_TRUNC)
			kc_ctl_reset(fs);
		struct kc_fh *fh = kc_fh_new(fs, FH_STATS, -1);
		if (!fh || !(fh->buf = kc_ctl_stats_text(fs, in, &fh->len))) {
			if (fh)
				kc_fh_free(fs, fh);
			return (void)fuse_reply_err(req, ENOMEM);
		}
		fi->fh = fh->id;
		fi->direct_io = 1;
		return (void)fuse_reply_open(req, fi);
	}
	/* A file consumed by a stage, still under the staged name in the kernel's dentry: the
	 * kernel retries the open with a fresh lookup, which finds what the name holds. */
	if (stale(req, in))
		return;
	if (__atomic_load_n(&in->discarded, __ATOMIC_SEQ_CST))
		return (void)fuse_reply_err(req, ESTALE);
	/* A published or pending cubin is read-only: a write would reach the kernel's cached
	 * pages and size of the published inode before any commit could refuse it. */
	if (writing && in->role == KC_ROLE_CUBIN && !in->staging)
		return (void)fuse_reply_err(req, EPERM);
	if (in->pending) {
		/* Its cubin published (a lookup after the compile answers this inode too:
		 * kc_inode_ref): open it at once, as the published inode would be opened. */
		if (__atomic_load_n(&in->cubin_fd, __ATOMIC_SEQ_CST) >= 0 &&
		    kc_reply_published_open(req, in, fi) == 0)
			return;
		return kc_park(req, in, fi); /* opened once the compile is published */
	}
	kc_fd_path(in->fd, path);
	int entry_fd = writing ? kc_inode_entry_fd(&fs->inodes, in, &role) : -1;
	if (entry_fd >= 0) {
		int seed = open_object(in, path, O_RDONLY);
		if (seed < 0) {
			close(entry_fd);
			return (void)fuse_reply_err(req, -seed);
		}
		open_stage(req, fi, in, role, entry_fd, seed);
		close(seed);
		return;
	}
	int fd = open_object(in, path, fi->flags & ~(O_CREAT | O_EXCL | O_NOCTTY | O_NOFOLLOW));
	if (fd < 0)
		return (void)fuse_reply_err(req, -fd);
	if (fi->flags & O_TRUNC) /* emptied: what failed is gone */
		__atomic_store_n(&in->write_failed, 0, __ATOMIC_SEQ_CST);
	if (in->role == KC_ROLE_CUBIN && !in->staging)
		return kc_cubin_open(req, in, fd, fi);
	struct kc_fh *fh = kc_fh_new(fs, FH_PLAIN, fd);
	if (!fh) {
		close(fd);
		return (void)fuse_reply_err(req, ENOMEM);
	}
	count_open(req, in, fh);
	fi->fh = fh->id;
	if (fuse_reply_open(req, fi) != 0)
		kc_fh_release(fs, fh);
}

static void kc_create(fuse_req_t req, fuse_ino_t parent_ino, const char *name, mode_t mode,
		      struct fuse_file_info *fi)
{
	if (kc_refuse_compile(req))
		return;
	struct kc_fs *fs = fs_of(req);
	struct kc_inode *parent = inode_of(req, parent_ino);
	enum kc_role role = parent->entry ? kc_name_role(name) : KC_ROLE_PLAIN;
	struct fuse_entry_param e = {0};
	struct kc_fh *fh;
	struct stat st;
	char path[32];
	int err = 0;

	if (reserved(fs, parent, name))
		return (void)fuse_reply_err(req, is_ctl_name(fs, parent, name) ? EEXIST : EPERM);
	if (kc_role_is_staged(role)) {
		/* New kernel.cu/.flags/.cubin: the inode is the stage temporary until commit. */
		fh = kc_fh_new(fs, FH_STAGE, -1);
		if (!fh)
			return (void)fuse_reply_err(req, ENOMEM);
		fh->role = role;
		fh->entry_fd = fcntl(parent->fd, F_DUPFD_CLOEXEC, 0);
		err = fh->entry_fd < 0 ? -errno : kc_stage_begin(fs, fh, -1, mode);
		if (!err) {
			own_by_caller(req, fs->store.tmp_fd, fh->tmpname, 0);
			/* A creator killed before it wrote anything commits nothing either. Its
			 * ordinary close does not commit: a shell's "> kernel.cu" closes the created
			 * descriptor after dup2 and before writing through the copy. */
			fh->creator_tgid = kc_stage_tgid(req);
		}
		/* The stage's bytes stay out of the page cache of the inode, which becomes the
		 * published one when the stage is committed. */
		fi->direct_io = 1;
	} else {
		int fd = openat(parent->fd, name, (fi->flags | O_CREAT | O_CLOEXEC) & ~O_NOFOLLOW,
				mode);
		if (fd < 0)
			return (void)fuse_reply_err(req, errno);
		own_by_caller(req, parent->fd, name, AT_SYMLINK_NOFOLLOW);
		fh = kc_fh_new(fs, FH_PLAIN, fd);
		if (!fh) {
			close(fd);
			return (void)fuse_reply_err(req, ENOMEM);
		}
	}
	int pfd = -1;
	if (!err) {
		kc_fd_path(fh->fd, path);
		pfd = open(path, O_PATH | O_CLOEXEC);
		if (pfd < 0 || fstat(fh->fd, &st) != 0)
			err = -errno;
	}
	struct kc_inode *in = NULL;
	if (!err)
		in = kc_inode_ref(&fs->inodes, pfd, &st, &err);
	else if (pfd >= 0)
		close(pfd);
	if (!in) {
		kc_fh_free(fs, fh);
		return (void)fuse_reply_err(req, -err);
	}
	kc_notifier_relieve(&fs->notifier);
	kc_inode_place(&fs->inodes, in, parent, name, fh->kind == FH_STAGE);
	e.ino = kc_inode_ino(&fs->inodes, in);
	e.attr = st;
	e.attr_timeout = e.entry_timeout = timeout_for(in);
	count_open(req, in, fh);
	fi->fh = fh->id;
	if (fuse_reply_create(req, &e, fi) != 0) {
		kc_fh_release(fs, fh);
		kc_inode_forget(&fs->inodes, in, 1);
	}
}

static void kc_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
		    struct fuse_file_info *fi)
{
	struct kc_fh *fh = fh_of(req, fi);
	(void)ino;
	if (fh->kind == FH_STATS) {
		size_t start = (size_t)off < fh->len ? (size_t)off : fh->len;
		size_t n = fh->len - start < size ? fh->len - start : size;
		/* Reply from a copy: once the kernel has the reply, the reader may close and
		 * the RELEASE free fh on another thread before this writev returns. */
		char *copy = malloc(n ? n : 1);
		if (!copy)
			return (void)fuse_reply_err(req, ENOMEM);
		memcpy(copy, fh->buf + start, n);
		fuse_reply_buf(req, copy, n);
		free(copy);
		return;
	}
	struct fuse_bufvec buf = FUSE_BUFVEC_INIT(size);
	buf.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
	buf.buf[0].fd = fh->fd;
	buf.buf[0].pos = off;
	fuse_reply_data(req, &buf, FUSE_BUF_SPLICE_MOVE);
}

/* The error that stopped a copy of in_buf to fd at done bytes of it (offset off): the
 * write of the rest, tried once more, says it; EIO if it cannot be told. */
static int rest_errno(int fd, const struct fuse_bufvec *in_buf, size_t done, off_t off)
{
	const struct fuse_buf *b = &in_buf->buf[0];
	if (in_buf->count != 1 || (b->flags & FUSE_BUF_IS_FD) || done >= b->size)
		return EIO;
	ssize_t r = pwrite(fd, (const char *)b->mem + done, b->size - done, off + (off_t)done);
	return r < 0 ? errno : EIO;
}

/* Nonzero if a write of n bytes at off may have been cut short by the kernel before it got
 * here: it ends at (or past) the writer's file size limit (RLIMIT_FSIZE), where the kernel
 * stops a write and fails the next with EFBIG, without telling the daemon. */
static int cut_by_fsize_limit(fuse_req_t req, off_t off, size_t n)
{
	struct rlimit lim;
	if (prlimit(fuse_req_ctx(req)->pid, RLIMIT_FSIZE, NULL, &lim) != 0 ||
	    lim.rlim_cur == RLIM_INFINITY)
		return 0;
	return (unsigned long long)off + n >= (unsigned long long)lim.rlim_cur;
}

static void kc_write_buf(fuse_req_t req, fuse_ino_t ino, struct fuse_bufvec *in_buf, off_t off,
			 struct fuse_file_info *fi)
{
	struct kc_fs *fs = fs_of(req);
	struct kc_fh *fh = fh_of(req, fi);

	if (fh->kind == FH_STATS) { /* truncation resets; so does writing "0" (echo 0 >) */
		char head[4] = {0};
		size_t n = fuse_buf_size(in_buf);
		struct fuse_bufvec dst = FUSE_BUFVEC_INIT(sizeof(head) - 1);
		dst.buf[0].mem = head;
		if (off != 0 || n > 2 || fuse_buf_copy(&dst, in_buf, 0) < 1 ||
		    !(strcmp(head, "0") == 0 || strcmp(head, "0\n") == 0))
			return (void)fuse_reply_err(req, EINVAL);
		kc_ctl_reset(fs);
		return (void)fuse_reply_write(req, n);
	}
	int err = kc_stage_prepare_write(fs, inode_of(req, ino), fh);
	if (err == -EBADF) /* the kernel wrote the refused bytes into its pages already */
		kc_notifier_inval_inode(&fs->notifier, ino);
	if (err)
		return (void)fuse_reply_err(req, -err);
	struct fuse_bufvec out = FUSE_BUFVEC_INIT(fuse_buf_size(in_buf));
	out.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
	out.buf[0].fd = fh->fd;
	out.buf[0].pos = off;
	size_t want = fuse_buf_size(in_buf);
	ssize_t n = fuse_buf_copy(&out, in_buf, 0);
	if (fh->kind == FH_STAGE && (n < 0 || (size_t)n < want)) {
		/* A stage with a hole in it is no stage: it is discarded at close, and this
		 * write's error is the client's (a short copy stopped at an error: find it). */
		fh->failed = n < 0 ? (int)-n : rest_errno(fh->fd, in_buf, (size_t)n, off);
		kc_log(KC_LOG_INFO, "a write to a %s stage failed (%s): nothing of it is staged",
		       kc_role_name(fh->role), strerror(fh->failed));
		return (void)fuse_reply_err(req, fh->failed);
	}
	if (n < 0 || (size_t)n < want) /* a hole: this file is not staged by a rename */
		__atomic_store_n(&inode_of(req, ino)->write_failed, 1, __ATOMIC_SEQ_CST);
	if (n < 0)
		return (void)fuse_reply_err(req, (int)-n);
	if (fh->kind == FH_STAGE && cut_by_fsize_limit(req, off, (size_t)n)) {
		/* Its writer was told EFBIG, or will be: the stage is not what it meant. */
		fh->failed = EFBIG;
		kc_log(KC_LOG_INFO, "a write to a %s stage reached its writer's file size limit "
		       "(RLIMIT_FSIZE): nothing of it is staged", kc_role_name(fh->role));
	}
	if (fh->kind == FH_STAGE)
		kc_stage_note_writer(req, fh);
	fuse_reply_write(req, (size_t)n);
}

/* KC_IOC_GET_KEY on an open kernel.cubin: the key of the recipe it was compiled from
 * (key.h), read from the file itself, so the answer is about the very bytes this
 * descriptor reads. ENODATA for a cubin a client published; ENOTTY for other ioctls. */
static void kc_ioctl(fuse_req_t req, fuse_ino_t ino, unsigned int cmd, void *arg,
		     struct fuse_file_info *fi, unsigned flags, const void *in_buf, size_t in_bufsz,
		     size_t out_bufsz)
{
	struct kc_inode *in = inode_of(req, ino);
	struct kc_fh *fh = fi ? fh_of(req, fi) : NULL;
	char val[KC_SHA256_HEXLEN + 1];
	(void)arg, (void)flags, (void)in_buf, (void)in_bufsz;

	if (cmd != KC_IOC_GET_KEY)
		return (void)fuse_reply_err(req, ENOTTY);
	if (in->role != KC_ROLE_CUBIN || !fh || fh->kind != FH_PLAIN || fh->fd < 0)
		return (void)fuse_reply_err(req, ENODATA);
	if (out_bufsz < KC_SHA256_HEXLEN)
		return (void)fuse_reply_err(req, EINVAL);
	ssize_t n = fgetxattr(fh->fd, KC_KEY_XATTR, val, sizeof(val));
	if (n != KC_SHA256_HEXLEN)
		return (void)fuse_reply_err(req, n < 0 && errno != ENODATA ? errno : ENODATA);
	fuse_reply_ioctl(req, 0, val, KC_SHA256_HEXLEN);
}

static void kc_flush(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	struct kc_fh *fh = fh_of(req, fi);
	int err = 0;
	(void)ino;
	/* close() by the process that wrote the stage commits it, and the commit's error
	 * (EEXIST, EINVAL) is close()'s, unless it wrote through a copy it inherited from a
	 * creator that still holds one (a sibling may write next: "{ cat a; cat b; } >
	 * kernel.cu" staged a's bytes alone); so does the creator's close of a stage never
	 * written (an empty file), unless it still holds a dup to write through. Other closes
	 * do not: a child that exec()s or exits closes its inherited copy while the writer is
	 * still writing. What no writer's close committed is committed at release (the last
	 * close). */
	int killed_creator = fh->kind == FH_STAGE && !fh->done && !fh->dirty &&
			     fh->creator_tgid == kc_stage_tgid(req) && kc_stage_writer_killed(req);
	if (fh->kind == FH_STAGE && !fh->done && fh->failed) {
		/* A write to it failed: whoever closes, it is not committed, and the writer's
		 * error is close()'s too. */
		kc_stage_discard(fs_of(req), fh, "a write to it failed");
		err = -fh->failed;
	} else if (killed_creator) {
		kc_stage_discard(fs_of(req), fh, "its creator was killed before writing");
	} else if (fh->kind == FH_STAGE && !fh->done &&
		   (fh->dirty ? kc_stage_is_writer(req, fh)
			      : fh->creator_tgid == kc_stage_tgid(req) &&
					!kc_stage_held_elsewhere(req, fh))) {
		if (kc_stage_writer_killed(req)) {
			/* A killed writer's files are closed for it: its stage is not complete. */
			kc_stage_discard(fs_of(req), fh, "its writer was killed by a signal");
		} else if (!fh->dirty || !kc_stage_held_by_creator(req, fh)) {
			err = kc_stage_commit(fs_of(req), fh);
		}
	}
	fuse_reply_err(req, -err);
}

static void kc_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	struct kc_fs *fs = fs_of(req);
	struct kc_fh *fh = fh_of(req, fi);
	(void)ino;
	if (fh->kind == FH_STAGE && !fh->done && fh->failed) {
		kc_stage_discard(fs, fh, "a write to it failed");
	} else if (fh->kind == FH_STAGE && !fh->done) {
		int err = kc_stage_commit(fs, fh);
		if (err)
			kc_log(KC_LOG_INFO, "stage committed at release refused: %s", strerror(-err));
	}
	kc_fh_release(fs, fh);
	fuse_reply_err(req, 0);
}

static void kc_fsync(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi)
{
	struct kc_fh *fh = fh_of(req, fi);
	(void)ino;
	if (fh->kind == FH_STATS)
		return (void)fuse_reply_err(req, 0);
	int r = datasync ? fdatasync(fh->fd) : fsync(fh->fd);
	fuse_reply_err(req, r == 0 ? 0 : errno);
}

static void kc_statfs(fuse_req_t req, fuse_ino_t ino)
{
	if (kc_refuse_compile(req))
		return;
	struct statvfs sv;
	(void)ino;
	if (fstatvfs(fs_of(req)->store.root_fd, &sv) != 0)
		return (void)fuse_reply_err(req, errno);
	fuse_reply_statfs(req, &sv);
}

static void kc_init(void *userdata, struct fuse_conn_info *conn)
{
	(void)userdata;
	/* O_TRUNC reaches open() instead of a separate setattr: a stage knows it starts empty. */
	if (conn->capable & FUSE_CAP_ATOMIC_O_TRUNC)
		conn->want |= FUSE_CAP_ATOMIC_O_TRUNC;
	/* Writes go through to the backing file at once: sizes are never stale. */
	conn->want &= ~FUSE_CAP_WRITEBACK_CACHE;
	/* Lookups in one directory run in parallel: a cubin lookup parked on its compile must
	 * not block other lookups and readdir in that entry. */
	if (conn->capable & FUSE_CAP_PARALLEL_DIROPS)
		conn->want |= FUSE_CAP_PARALLEL_DIROPS;
}

/* Directory handles are dir.c's; a compile may not open one. */
static void kc_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	if (kc_refuse_compile(req))
		return;
	kc_dir_open(req, ino, fi);
}

const struct fuse_lowlevel_ops kc_fs_ops = {
	.init = kc_init,
	.lookup = kc_lookup,
	.forget = kc_forget,
	.forget_multi = kc_forget_multi,
	.getattr = kc_getattr,
	.setattr = kc_setattr,
	.readlink = kc_readlink,
	.mkdir = kc_mkdir,
	.symlink = kc_symlink,
	.mknod = kc_mknod,
	.link = kc_link,
	.unlink = kc_unlink,
	.rmdir = kc_rmdir,
	.rename = kc_rename,
	.open = kc_open,
	.create = kc_create,
	.read = kc_read,
	.write_buf = kc_write_buf,
	.flush = kc_flush,
	.ioctl = kc_ioctl,
	.release = kc_release,
	.fsync = kc_fsync,
	.opendir = kc_opendir,
	.readdir = kc_dir_read,
	.releasedir = kc_dir_release,
	.fsyncdir = kc_dir_fsync,
	.statfs = kc_statfs,
};
