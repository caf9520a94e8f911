/* fs.h - the FUSE filesystem's shared state and entry points (fs/; the daemon's life in
 * fs/life/ reads it: life.h).
 *
 * Owns: the mount's config, backing store, cache, inode table and notifier (one struct
 * kc_fs per mount, created in kcachefs.c and handed to libfuse as userdata).
 */
#ifndef KC_FS_H
#define KC_FS_H

#define FUSE_USE_VERSION 312
#include <fuse_lowlevel.h>

#include "cache.h"
#include "config.h"
#include "idtable.h"
#include "inode.h"
#include "notify.h"
#include "store.h"
#include "util.h"

enum { KC_HANDLE_FILE = 1, KC_HANDLE_DIR = 2 };

#define KC_TIMEOUT_PLAIN 1.0     /* seconds: ordinary files and directories */
#define KC_TIMEOUT_PUBLISHED 3600.0 /* published cubins are immutable */

struct kc_fs {
	struct kc_config cfg;
	struct kc_store store;
	struct kc_cache cache;
	struct kc_inode_table inodes;
	struct kc_notifier notifier;
	struct kc_evict evict;     /* the bounded cache (-o max_size, -o max_entries) */
	struct fuse_session *se;
	struct kc_idtable handles; /* the kernel's file and directory handles (fi->fh): ids of
				    * struct kc_fh (KC_HANDLE_FILE) and dir.c's (KC_HANDLE_DIR) */
	struct timespec started; /* mount time, shown as .kcachefs times */
	/* waiter.c: the sweeper of waiters interrupted by a signal their process survived */
	struct kc_ticker sweeper;
	unsigned parked; /* requests parked in waiter.c and not yet answered (atomic) */
	int stale_ids;   /* the kernel may hold ids of a daemon that died here (stale.h): set
			  * before the first request is read */
	int draining;    /* set while a live upgrade drains this daemon (fs/life/upgrade.h): no new
			  * request is read, and the compiles that the requests in hand wait for
			  * are finished here (atomic) */
	unsigned request_budget; /* seconds a parked request may wait before it is answered
				  * ETIMEDOUT, under the kernel's request timeout (reqtimeout.h);
				  * 0: no bound */
};

/* Seconds a daemon may keep the kernel's requests queued unanswered (a live upgrade's
 * handover, a stop that leaves the mount to the holder) under a kernel request timeout:
 * a request's budget less 3 s for the next daemon's start (at least 1); 0 without one. */
static inline unsigned kc_fs_queue_bound(const struct kc_fs *fs)
{
	if (!fs->request_budget)
		return 0;
	return fs->request_budget > 4 ? fs->request_budget - 3 : 1;
}

/* The low-level operations (ops.c). */
extern const struct fuse_lowlevel_ops kc_fs_ops;

/* Requests parked on a compile (waiter.c). */

/* Park a getattr (fi NULL) or an open (fi its file info) of a pending cubin inode until
 * the entry's compile ends; answered with kc_reply_published_* or the compile's error. */
void kc_park(fuse_req_t req, struct kc_inode *pending, struct fuse_file_info *fi);
/* Answers the lookup of kernel.cubin in entry now, starting its compile if it must be
 * compiled: the published cubin, or a pending inode while its compile runs (ops.c's). */
typedef void kc_answer_lookup_fn(fuse_req_t req, struct kc_inode *entry);
/* A waiter for the lookup of kernel.cubin in entry (the kernel holds entry meanwhile), to
 * pass to kc_cache_lookup_cubin with a cluster store: once queued (KC_PENDING) it answers
 * req with the published cubin when its flight has fetched it, or through answer when the
 * flight compiles, or within LOOKUP_PARK_MS + a sweep interval (waiter.c). Owned by the
 * caller until queued (drop it with kc_lookup_waiter_drop when it was not); NULL on
 * ENOMEM. */
struct kc_waiter *kc_lookup_waiter(fuse_req_t req, struct kc_inode *entry,
				   kc_answer_lookup_fn *answer);
void kc_lookup_waiter_drop(struct kc_waiter *w);
/* Start/stop the thread that lets go of parked waiters whose process is killed after an
 * interrupt it survived (EINTR), and answers ETIMEDOUT, with a log line naming the sysctls,
 * those parked for fs->request_budget seconds, before the kernel's request timeout would
 * abort the mount. Start returns 0 or -errno. */
int kc_sweeper_start(struct kc_fs *fs);
void kc_sweeper_stop(struct kc_fs *fs);

/* Published cubins (cubin.c). */

/* Answer the open of the published cubin of inode in (a published or a pending inode),
 * opened read-only as fd (consumed): verified against its record (-o verify_keys: against
 * the entry's name too), with keep_cache and no FLUSH. A corrupt cubin is answered EIO and
 * the kernel's entry of it invalidated, so that the next open compiles it again. */
void kc_cubin_open(fuse_req_t req, struct kc_inode *in, int fd, struct fuse_file_info *fi);
/* Answers for a pending inode once its entry's cubin is published. Return 0 when answered,
 * or -ENOENT without answering when no cubin is published (wait again). */
int kc_reply_published_attr(fuse_req_t req, struct kc_inode *pending);
int kc_reply_published_open(fuse_req_t req, struct kc_inode *pending, struct fuse_file_info *fi);
/* A lookup found entry's kernel.cubin published: if the kernel holds the pending inode of
 * its recipe and no request of that inode has opened the cubin yet (the compile's waiters
 * are answered just after the publish), that inode takes it now (as the waiters' answers
 * do), so the lookup answers it (kc_inode_ref): the kernel keeps one inode of the cubin. */
void kc_cubin_adopt(struct kc_fs *fs, struct kc_inode *entry);

/* A directory handle (dir.c): the snapshot of names its readdir answers from. */
struct dir_item {
	ino_t ino;
	unsigned char type;
	char *name;          /* owned */
};

struct kc_dh {
	int fd;              /* O_RDONLY on the directory (fsyncdir), -1 for virtual */
	struct dir_item *items; /* owned */
	size_t n;
};

/* Directory handles (dir.c): opendir (after ops.c refused compiles), readdir, releasedir,
 * fsyncdir. */
void kc_dir_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi);
void kc_dir_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
		 struct fuse_file_info *fi);
void kc_dir_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi);
void kc_dir_fsync(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi);

/* .kcachefs control directory (ctl.c). */
#define KC_CTL_NAME ".kcachefs"
#define KC_CTL_STATS "stats"          /* for people; truncating it zeroes the counters */
#define KC_CTL_METRICS "metrics.prom" /* the Prometheus text format */

/* Attributes of a virtual inode. */
void kc_ctl_attr(struct kc_fs *fs, const struct kc_inode *in, struct stat *st);
/* Render the text of the virtual file in (stats or metrics.prom) into a malloc'ed buffer
 * (*len bytes). Returns NULL on ENOMEM. */
char *kc_ctl_stats_text(struct kc_fs *fs, const struct kc_inode *in, size_t *len);
/* Zero the counters (truncation of .kcachefs/stats by the daemon's user). */
void kc_ctl_reset(struct kc_fs *fs);

#endif
