/* notify.h - kernel cache invalidations sent from a thread of their own.
 *
 * fuse_lowlevel_notify_inval_entry must not run inside a request that holds the same
 * directory lock (libfuse's fuse_lowlevel.h warns of the deadlock), so requests queue the
 * (parent, name) here and return; a one-thread kc_pool sends them afterwards, in order.
 */
#ifndef KC_NOTIFY_H
#define KC_NOTIFY_H

#define FUSE_USE_VERSION 312
#include <fuse_lowlevel.h>

#include "inode.h"
#include "pool.h"
#include "store.h"

struct kc_notifier {
	struct fuse_session *se;
	struct kc_inode_table *inodes; /* borrowed */
	struct kc_pool *pool; /* one worker; NULL when not started */
	const struct kc_store *store; /* borrowed: paths of inodes relative to its root */
	int relief_queued;    /* a relief is queued or running (atomic) */
	int relief_wanted;    /* the table went over the bound since the last pass (atomic) */
	uint64_t reliefs;     /* reliefs run (atomic; shown in stats) */
	int sending;          /* notifications being written to the kernel now (atomic) */
	unsigned long conn;   /* the kernel's connection number (/sys/fs/fuse/connections) */
};

/* Start the sender. Returns 0 or -errno. */
int kc_notifier_start(struct kc_notifier *n, struct fuse_session *se,
		      struct kc_inode_table *inodes, const struct kc_store *store);
/* Queue an invalidation of name in directory parent (copied). The parent inode is held
 * until it is sent: a node id is the inode's address, and one freed meanwhile (the kernel
 * forgot the directory) could be reused by another inode the invalidation would then hit.
 * Dropped on ENOMEM. */
void kc_notifier_inval_entry(struct kc_notifier *n, fuse_ino_t parent, const char *name);
/* Queue an invalidation of the kernel's attributes and pages (mapped ones too) of inode
 * ino, held until sent: what a refused write through a cached descriptor left there is
 * read again from the daemon. Dropped on ENOMEM. */
void kc_notifier_inval_inode(struct kc_notifier *n, fuse_ino_t ino);
/* Invalidate the kernel's dentry of rel (a path relative to the backing root) now, from
 * a thread that serves no request (it waits for the directory's lock). Returns 0 when
 * sent, or -errno (-ENOENT: the kernel does not know its directory). */
int kc_notifier_inval_path(struct kc_notifier *n, const char *rel);
/* Have the sender invalidate the kernel's dentry of every name in the root directory (the
 * backing root's entries), for a daemon started again after one died (holder.h): those
 * dentries, and all below them, carry the dead daemon's node ids. A path walk that meets
 * one is retried on ESTALE, but the lookup of the last name of a mkdir, a create or a
 * rename is not (the kernel's filename_create), so without this a mkdir in a directory the
 * kernel held failed with ESTALE. Requests served before the sender is through can still
 * meet such a dentry. Logs "the kernel looks the root's names up again" when done, or why
 * the root could not be read. Returns 0 when queued, or -ENOMEM. */
int kc_notifier_inval_root(struct kc_notifier *n);

/* Keep the inode table near its bound (inodes->max): when more inodes than that are known
 * to the kernel, have the sender (at most one relief at a time) invalidate the kernel's
 * dentries of the least recently used, until a quarter of the bound is free again, so the
 * kernel forgets those it does not use (open files and working directories keep theirs).
 * A call while a relief runs asks it for one more pass after a pause of 1 ms: none is
 * lost, so the table comes back under the bound once lookups stop and the kernel's
 * forgets arrive. The bound holds in that steady state; while lookups outpace the relief
 * (its invalidations wait for the directory locks those lookups hold) the table can run
 * over it for a while. Each known inode holds a descriptor, so without this a node with
 * many entries would run out of descriptors (EMFILE) and fail lookups. Cheap when under
 * the bound: call after every new kernel reference. */
void kc_notifier_relieve(struct kc_notifier *n);
/* Remember the connection of the mount on mountpoint (from /proc/self/mountinfo; no FUSE
 * request is made), for kc_notifier_stop. Call after mounting. */
void kc_notifier_note_connection(struct kc_notifier *n, const char *mountpoint);

/* Stop, after the session loop ended: what is still queued is dropped (the kernel's caches
 * go with the mount). A notification already being written can wait forever on a
 * directory lock that a request holds which the loop read and dropped at its exit (libfuse
 * does not answer those); if one is still in the kernel after a second, the connection is
 * aborted through fusectl (mounted if needed), which fails that request and frees it. */
void kc_notifier_stop(struct kc_notifier *n);

#endif
