/* fs.h - the FUSE adapter's shared state and entry points.
 *
 * Owns: the mount's config, backing store, cache, inode table and notifier (one struct
 * kc_fs per mount, created in main.c and handed to libfuse as userdata).
 */
#ifndef KC_FS_H
#define KC_FS_H

#define FUSE_USE_VERSION 312
#include <fuse_lowlevel.h>

#include "cache.h"
#include "config.h"
#include "inode.h"
#include "notify.h"
#include "store.h"

#define KC_TIMEOUT_PLAIN 1.0     /* seconds: ordinary files and directories */
#define KC_TIMEOUT_PUBLISHED 3600.0 /* published cubins are immutable */

struct kc_fs {
	struct kc_config cfg;
	struct kc_store store;
	struct kc_cache cache;
	struct kc_inode_table inodes;
	struct kc_notifier notifier;
	struct fuse_session *se;
	struct timespec started; /* mount time, shown as .kcachefs times */
};

/* The low-level operations (ops.c). */
extern const struct fuse_lowlevel_ops kc_fs_ops;

/* .kcachefs control directory (ctl.c). */
#define KC_CTL_NAME ".kcachefs"
#define KC_CTL_STATS "stats"

/* Attributes of a virtual inode. */
void kc_ctl_attr(struct kc_fs *fs, const struct kc_inode *in, struct stat *st);
/* Render the stats text into a malloc'ed buffer (*len bytes). Returns NULL on ENOMEM. */
char *kc_ctl_stats_text(struct kc_fs *fs, size_t *len);

#endif
