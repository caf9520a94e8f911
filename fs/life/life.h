/* life.h - the daemon's life apart from its requests: what crosses between fs/ (the FUSE
 * requests: ops.c, waiter.c, the inode table, the file handles) and fs/life/.
 *
 * Life is what happens to the daemon rather than to a request: it starts under a holder
 * that outlives a crash (holder.h) and keeps its inode ledger (ledger.h); it hands its
 * mount to a new build without unmounting (upgrade.h, carrying handover.h's state); a
 * daemon started again answers the dead one's ids (stale.h).
 *
 * The requests never call into this room. What crosses:
 * - main (fs/kcachefs.c) calls in: it starts the holder and the upgrade listener, takes a
 *   handover or a restart, opens and attaches the ledger, and stops them at the end;
 * - this room reads and restores the request side's state: the inode table (inode.h:
 *   kc_inode_foreach, kc_inode_restore*, and the table's journal, which the ledger is) and
 *   the file handles (stage.h: kc_fh_foreach, kc_fh_adopt);
 * - two flags of struct kc_fs (fs.h): draining, which upgrade.c sets while a handover
 *   drains the daemon and waiter.c reads (a parked lookup's compile is finished here),
 *   and stale_ids, which main sets when ids of a dead daemon may come and stale.c reads.
 */
#ifndef KC_LIFE_H
#define KC_LIFE_H

#include "handover.h"
#include "holder.h"
#include "ledger.h"
#include "stale.h"
#include "upgrade.h"

#endif
