/* stale.c - see stale.h */
#define _GNU_SOURCE
#include "stale.h"

#include <errno.h>
#include <linux/fuse.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "log.h"

static int node_known(struct kc_fs *fs, uint64_t ino)
{
	return ino == 0 || kc_inode_get(&fs->inodes, ino) != NULL;
}

static int handle_known(struct kc_fs *fs, uint64_t fh)
{
	return fh == 0 || kc_idtable_has(&fs->handles, fh);
}

static void answer(int fd, uint64_t unique, int err)
{
	struct fuse_out_header out = {.len = sizeof(out), .error = -err, .unique = unique};
	if (write(fd, &out, sizeof(out)) != (ssize_t)sizeof(out) && errno != ENOENT)
		kc_log(KC_LOG_DEBUG, "stale: reply to request %llu: %s",
		       (unsigned long long)unique, strerror(errno));
}

static uint64_t u64_at(const void *body, size_t len, size_t off)
{
	uint64_t v = 0;
	if (off + sizeof(v) <= len)
		memcpy(&v, (const char *)body + off, sizeof(v));
	return v;
}

static uint32_t u32_at(const void *body, size_t len, size_t off)
{
	uint32_t v = 0;
	if (off + sizeof(v) <= len)
		memcpy(&v, (const char *)body + off, sizeof(v));
	return v;
}

/* The handle a request names, or 0 (none, or not one given). */
static uint64_t handle_of(uint32_t opcode, const void *body, size_t len)
{
	switch (opcode) {
	case FUSE_READ: case FUSE_WRITE: case FUSE_RELEASE: case FUSE_RELEASEDIR:
	case FUSE_FLUSH: case FUSE_FSYNC: case FUSE_FSYNCDIR: case FUSE_READDIR:
	case FUSE_READDIRPLUS: case FUSE_LSEEK: case FUSE_FALLOCATE: case FUSE_GETLK:
	case FUSE_SETLK: case FUSE_SETLKW: case FUSE_IOCTL: case FUSE_POLL:
	case FUSE_COPY_FILE_RANGE:
		return u64_at(body, len, 0); /* fh is the first field of each */
	case FUSE_GETATTR:
		return u32_at(body, len, offsetof(struct fuse_getattr_in, getattr_flags)) &
		       FUSE_GETATTR_FH ? u64_at(body, len, offsetof(struct fuse_getattr_in, fh)) : 0;
	case FUSE_SETATTR:
		return u32_at(body, len, offsetof(struct fuse_setattr_in, valid)) & FATTR_FH
			       ? u64_at(body, len, offsetof(struct fuse_setattr_in, fh)) : 0;
	default:
		return 0;
	}
}

/* A second node id the request names, or 0. */
static uint64_t other_node_of(uint32_t opcode, const void *body, size_t len)
{
	switch (opcode) {
	case FUSE_RENAME: case FUSE_RENAME2:
		return u64_at(body, len, 0); /* newdir */
	case FUSE_LINK:
		return u64_at(body, len, offsetof(struct fuse_link_in, oldnodeid));
	case FUSE_COPY_FILE_RANGE:
		return u64_at(body, len, offsetof(struct fuse_copy_file_range_in, nodeid_out));
	default:
		return 0;
	}
}

/* Keep the FORGETs of a batch whose ids are known. Returns the new length of buf. */
static size_t batch_forget(struct kc_fs *fs, void *buf, size_t n)
{
	struct fuse_in_header *h = buf;
	size_t at = sizeof(*h) + sizeof(struct fuse_batch_forget_in);
	if (n < at)
		return n;
	struct fuse_batch_forget_in *b = (void *)((char *)buf + sizeof(*h));
	struct fuse_forget_one *one = (void *)((char *)buf + at);
	uint32_t kept = 0, count = b->count;
	if ((n - at) / sizeof(*one) < count)
		count = (uint32_t)((n - at) / sizeof(*one));
	for (uint32_t i = 0; i < count; i++)
		if (node_known(fs, one[i].nodeid))
			one[kept++] = one[i];
	if (kept == count)
		return n;
	b->count = kept;
	h->len = (uint32_t)(at + kept * sizeof(*one));
	return kept ? h->len : 0;
}

size_t kc_stale_filter(struct kc_fs *fs, int fd, void *buf, size_t n)
{
	if (!__atomic_load_n(&fs->stale_ids, __ATOMIC_RELAXED) || n < sizeof(struct fuse_in_header))
		return n;
	struct fuse_in_header *h = buf;
	const void *body = (const char *)buf + sizeof(*h);
	size_t len = n - sizeof(*h);
	switch (h->opcode) {
	case FUSE_INIT: case FUSE_DESTROY: case FUSE_INTERRUPT: case FUSE_NOTIFY_REPLY:
		return n;
	case FUSE_FORGET:
		return node_known(fs, h->nodeid) ? n : 0;
	case FUSE_BATCH_FORGET:
		return batch_forget(fs, buf, n);
	default:
		break;
	}
	int release = h->opcode == FUSE_RELEASE || h->opcode == FUSE_RELEASEDIR ||
		      h->opcode == FUSE_FLUSH;
	int err = 0;
	if (!node_known(fs, h->nodeid) || !node_known(fs, other_node_of(h->opcode, body, len)))
		err = ESTALE;
	else if (!handle_known(fs, handle_of(h->opcode, body, len)))
		err = EBADF;
	if (!err)
		return n;
	if (release)
		err = 0; /* nothing of it is here to free */
	kc_log(KC_LOG_DEBUG, "request %u on node %llu of a daemon that died: %s", h->opcode,
	       (unsigned long long)h->nodeid, err ? strerror(err) : "nothing to release");
	answer(fd, h->unique, err);
	return 0;
}
