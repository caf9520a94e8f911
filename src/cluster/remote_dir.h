/* remote_dir.h - the cluster store (remote.h) in a directory of a shared filesystem (NFS,
 * Lustre, GPFS, CephFS): -o remote=dir:PATH.
 *
 * Layout under PATH (PATH itself is the operator's, never made here; what is under it is
 * created as needed; an operator cleans it by removing objects whose atime or mtime is old,
 * and *.tmp.* and lease files older than a day):
 *   objects/<first 2 hex of key>/<key>     immutable objects, never rewritten
 *   leases/<first 2 hex of key>/<key>      "held <token>\n" or "failed <token>\n"; expiry
 *                                          is the file's mtime + the ttl (taken or renewed)
 *   leases/.clock.<host>.<pid>             touched to read the shared filesystem's clock
 * Objects are written to a temporary beside their name, fsynced, and published by link()
 * (never replacing: EEXIST means another node's object won; on NFS a link that succeeded
 * but reported an error is recognised by the temporary's link count). Reads take the whole
 * file and any short read, ESTALE or vanished name is a miss.
 *
 * Leases: taken by linking a complete lease file to the lease's name (exclusive); renewed
 * by touching the file the holder checked holds its token (the filesystem's clock sets the
 * mtime, so nodes' clocks need not agree); released by unlinking it or replacing it with a
 * failure note. A lease is expired when its mtime plus its ttl (recorded in the file) is
 * before the filesystem's now, read by touching and stat-ing a clock file of this daemon.
 * Takeover of an expired lease: rename it away to a name of the taker's, check that what
 * was moved is the expired file that was judged (else link it back), remove it, then take
 * the lease by the exclusive link like anyone: of several takers only one link succeeds.
 *
 * Bound: each operation runs in a worker thread and the caller waits at most the timeout;
 * a worker stuck in the filesystem (a hung NFS server) is abandoned (it frees its own work
 * when the call returns) and at most KC_REMOTE_DIR_STUCK of them may be outstanding:
 * further operations fail at once with -ETIMEDOUT until they come back. A worker waits up
 * to 2 s, idle, for the next operation (at most 8 idle in the process); an operation that
 * finds no idle worker starts one, so none waits behind a stuck one.
 */
#ifndef KC_REMOTE_DIR_H
#define KC_REMOTE_DIR_H

#include <stddef.h>

#include "remote.h"

#define KC_REMOTE_DIR_STUCK 16       /* operations abandoned to a hung filesystem, at most */
#define KC_REMOTE_DIR_MAX (512u << 20) /* bytes of an object read, at most */

/* Open the store in directory path (absolute). Nothing is touched here, as a Redis backend
 * connects lazily: a filesystem that is down or hung fails the operations later. PATH must
 * exist (made by the operator: a store directory made by this node on a filesystem not yet
 * mounted would share nothing, so while it is missing every operation fails: the store is
 * down); its subdirectories are created by the first put or lease.
 * Returns the backend, or NULL with errno EINVAL and why filled for a relative or empty
 * path, or ENOMEM. */
struct kc_remote_backend *kc_remote_dir_open(const char *path, unsigned timeout_ms, char *why,
					     size_t whylen);

#endif
