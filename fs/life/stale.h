/* stale.h - requests that name the node ids or file handles of a dead daemon.
 *
 * A daemon restarted on a mount the kernel kept (holder.h) starts with an empty inode table
 * and no open handles, in another epoch (idtable.h), while the kernel still holds the ids
 * and handles the dead daemon gave it. Such a request is answered here, before libfuse sees
 * it: a node id the table does not know gets ESTALE (the kernel then looks the name up
 * again, from the root down), a FORGET of one is dropped, a handle the table does not know
 * gets EBADF (its release and flush: 0, nothing to free). None of them can reach another
 * object: the new epoch's ids differ from every id of the dead daemon's.
 */
#ifndef KC_STALE_H
#define KC_STALE_H

#include <stddef.h>

#include "fs.h"

/* Look at the request buf (n bytes, just read from the session's descriptor fd). Returns n
 * when libfuse is to handle it as it is, a smaller length when it was rewritten (a batch of
 * FORGETs without the unknown ids), or 0 when it was answered here (written to fd) or
 * dropped. Does nothing while fs->stale_ids is 0 (a daemon that never lost one). */
size_t kc_stale_filter(struct kc_fs *fs, int fd, void *buf, size_t n);

#endif
