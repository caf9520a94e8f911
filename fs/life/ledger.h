/* ledger.h - the inode ledger: which node ids the kernel holds, and what each names, kept in
 * memory that outlives the daemon, so that a daemon started again after a crash answers the
 * dead one's ids instead of ESTALE.
 *
 * ESTALE is enough where the kernel can look a name up again (holder.h, stale.h), but not
 * for a dentry that has no name to look up: the root of a bind mount of a directory inside
 * the mount (a container's volume of /mnt/kcache/triton, a Kubernetes subPath) answered
 * ESTALE for good after a crash, and a file locked with flock or fcntl became a new kernel
 * inode at its next lookup, so a second process got the lock the first still held.
 *
 * The ledger is an array in the holder's memfd (holder.h; the holder keeps it, and so does
 * systemd's fd store), one record per slot of the inode table (inode.h): the node id, the
 * lookup count and a file handle (name_to_handle_at(2)) of the backing object. A daemon
 * keeps it current under the table's lock; a daemon started again after a crash opens each
 * recorded object by its handle (open_by_handle_at(2): needs CAP_DAC_READ_SEARCH, so a
 * daemon not run as root has no ledger), checks it is the same inode, and restores it at
 * its id (kc_inode_restore), as a live upgrade does with the state it is handed, with a
 * use of its own so that the inode bound's relief (notify.h) can ask the kernel to forget
 * it. A ledger made under another backing directory (a restart with another
 * configuration) or by another build (another LEDGER_VERSION or record size: ledger.c) is
 * not restored, and says so in the log.
 *
 * Recorded: directories, symbolic links and regular files, the files of kernel entries
 * included: kernel.cu, kernel.flags, kernel.log, a published kernel.cubin (a compile's or
 * a client's), and a pending cubin once its cubin is published (kc_inode_published; it is
 * what a lookup of that cubin answers, so a lock on it keeps later openers out): it is
 * restored as it was, pending with its recipe and its cubin, and answers reads and
 * attributes from that cubin. An inode that keeps its entry's descriptor (kernel.cu,
 * kernel.flags, kernel.cubin, published or pending: parent_fd) is recorded by its entry's
 * handle, opened again by its role's name there, and restored only while that name still
 * names the recorded object: a cubin compiled again, a source staged again, or an evicted
 * entry is not. Not recorded (ESTALE after a crash, as before, and
 * the kernel looks their names up again): pending cubins still compiling (no descriptor
 * of one can be open, so no lock is held on one; their compile dies with the daemon),
 * stage temporaries (a kernel.cu, kernel.flags or kernel.cubin written through the mount,
 * until a lookup finds it staged: their state lived in the dead daemon), files let go of
 * or consumed by a stage, objects other than directories, regular files and links, and
 * the virtual inodes, whose ids are fixed.
 *
 * A record is written id last (release) and cleared id first, so a daemon that dies while
 * writing one leaves no record or the old one, never a mix; the lookup count is one 8-byte
 * store, and is never below the kernel's (it counts before the reply), so a restored inode
 * may outlive the kernel's last FORGET (a leak until the next restart), never the reverse.
 */
#ifndef KC_LEDGER_H
#define KC_LEDGER_H

#include <stdint.h>

struct kc_inode;
struct kc_inode_table;

#define KC_LEDGER_AT 65536u        /* offset of the ledger in the holder's memfd */
#define KC_LEDGER_SLOTS (1u << 21) /* slots recorded (the memfd is sparse); later ones are not */

struct kc_ledger {
	int fd;                  /* the memfd (owned), or -1: no ledger */
	void *map;               /* KC_LEDGER_AT onward, mapped shared */
	struct kc_ledger_rec *v; /* the records, by slot */
	int mount_id;            /* of the backing root: handles of other mounts are not kept */
	int root_fd;             /* the backing root opened for reading (owned), for
				  * open_by_handle_at, which takes no O_PATH descriptor */
};

/* Map the ledger in memfd (consumed: owned by l from here, closed on error) for a table on
 * the backing root root_fd (borrowed; any descriptor of it). Returns 0, or -errno (said in
 * the log): then l has no ledger and nothing is recorded. kc_ledger_close releases it. */
int kc_ledger_open(struct kc_ledger *l, int memfd, int root_fd);
/* Unmap and close (the holder keeps its own descriptor, and so the records). */
void kc_ledger_close(struct kc_ledger *l);

/* Restore into t (fresh: nothing served yet) every inode the ledger records, each at its
 * id with its lookup count, opened by its handle; clear the records of those that cannot
 * be (gone, another inode now, no permission). Returns the number restored, or -errno (no
 * CAP_DAC_READ_SEARCH: -EPERM; said in the log). Call before kc_ledger_attach. */
long kc_ledger_restore(struct kc_ledger *l, struct kc_inode_table *t);

/* Keep l current with t from here on (l becomes t's journal, inode.h), first recording
 * every inode t holds now (restored by a live upgrade or from the ledger). */
void kc_ledger_attach(struct kc_ledger *l, struct kc_inode_table *t);

/* The journal's hooks (inode.h), called with the table's lock held; no effect without a
 * ledger.
 * kc_ledger_sync: record in (or clear its slot, when in is not recorded: see above) after
 * a change of what it is; kc_ledger_count: its lookup count changed; kc_ledger_clear: its
 * slot is free or taken by a new inode. */
void kc_ledger_sync(struct kc_ledger *l, struct kc_inode_table *t, const struct kc_inode *in);
void kc_ledger_count(struct kc_ledger *l, struct kc_inode_table *t, const struct kc_inode *in);
void kc_ledger_clear(struct kc_ledger *l, uint32_t slot);

#endif
