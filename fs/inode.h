/* inode.h - the FUSE inode table: one struct per backing object the kernel knows.
 *
 * Shape after libfuse's example/passthrough_ll.c: each inode holds an O_PATH fd on its
 * backing object (so it follows renames and keeps the backing inode number from being
 * reused), is keyed by (st_dev, st_ino), and lives while the kernel's lookup count is
 * above zero. Three virtual inodes (.kcachefs, .kcachefs/stats and .kcachefs/metrics.prom)
 * have fd -1 and are never freed.
 *
 * The fuse_ino_t the kernel sees (the node id) is not the struct's address, as in
 * passthrough_ll, but a slot of the table tagged with that slot's generation:
 * generation << 32 | slot. So the ids depend only on the table's contents, and a new
 * process given the slots, generations and lookup counts (a live upgrade) answers the ids
 * the kernel holds; an id whose slot is empty or holds a later generation is known to be
 * stale. Fixed ids, generation 0: the root FUSE_ROOT_ID (1), .kcachefs 2, its stats 3 and
 * metrics.prom 4; every other inode has a generation of at least 1.
 */
#ifndef KC_INODE_H
#define KC_INODE_H

#define FUSE_USE_VERSION 312
#include <fuse_lowlevel.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/stat.h>

#include "name.h"

struct kc_inode;
struct kc_inode_table;

/* What keeps a record of the table outside it (the inode ledger, fs/life/ledger.h), told of
 * each change with the table's lock held: sync (in changed what it is), count (its lookup
 * count changed), clear (slot is free or taken by a new inode). The table does not know what
 * the record is; arg is the journal's. */
struct kc_inode_journal {
	void (*sync)(void *arg, struct kc_inode_table *t, const struct kc_inode *in);
	void (*count)(void *arg, struct kc_inode_table *t, const struct kc_inode *in);
	void (*clear)(void *arg, uint32_t slot);
};

enum kc_virtual { KC_VIRT_NONE = 0, KC_VIRT_CTL_DIR, KC_VIRT_STATS, KC_VIRT_METRICS };

struct kc_inode {
	int fd;              /* O_PATH on the backing object; -1 for virtual inodes */
	dev_t dev;
	ino_t ino;
	mode_t type;         /* S_IFMT bits */
	uint64_t nlookup;    /* kernel references; guarded by the table lock */
	uint32_t slot, gen;  /* its node id: gen << 32 | slot (see above); fixed while it lives */
	enum kc_virtual virt;
	/* Role in the cache, refreshed at lookup, create and rename (table lock): */
	int entry;           /* a directory that is a kernel entry */
	enum kc_role role;   /* a file's role inside its entry */
	int parent_fd;       /* staged roles: O_PATH fd of the entry directory, else -1 */
	int staging;         /* an uncommitted stage temporary */
	int pending;         /* the kernel.cubin of entry (dev, ino) before it is published:
			      * fd and parent_fd are the entry directory (see ops.c) */
	uint64_t recipe_id;  /* pending: the recipe it stands for (part of its key) */
	int stored;          /* pending: its cubin's bytes and size were given to the kernel */
	int cubin_fd;        /* pending: O_PATH fd of the cubin it became (-1 before): its
			      * attributes stay this inode's after a re-stage removes it */
	dev_t cubin_dev;     /* pending, once cubin_fd is set: that cubin's object, by */
	ino_t cubin_ino;     /* which a lookup of it finds this inode (kc_inode_ref) */
	uint64_t last_use;   /* the table's clock at its last lookup, or a lookup inside it */
	uint64_t dropped_use; /* last_use when the kernel was last asked to forget it */
	ino_t entry_ino;     /* a file in an entry: the entry directory's inode number */
	int write_failed;    /* a plain file a write to failed or fell short since it was last
			      * emptied: a rename onto a staged name does not stage it (EIO) */
	int opens;           /* client handles open on it (kc_inode_opened); table lock */
	int unhashed;        /* let go of (kc_inode_unlinked): out of the tree, fd a placeholder,
			      * every request on it answered ESTALE until the kernel forgets it */
	int discarded;       /* a client's file consumed by a stage (its bytes were copied, or
			      * dropped): the kernel may still show it under the staged name it
			      * was renamed to, so opens get ESTALE (the kernel looks the name up
			      * again) and writes EBADF (atomic) */
};

#define KC_INODE_CHUNK 4096u   /* slots per chunk of the node-id table */
#define KC_INODE_CHUNKS 65536u /* chunks: at most 2^28 slots */
#define KC_INODE_FIRST_SLOT 5u /* slots 1-4: the root and the virtual inodes */

struct kc_inode_slot {
	struct kc_inode *in; /* NULL: free (written under the lock, read atomically) */
	uint32_t gen;        /* generation of the inode in it, or of the last one */
};

struct kc_inode_table {
	pthread_mutex_t lock;
	uint32_t epoch;      /* of the generations it hands out (idtable.h's kc_gen_next): a
			      * daemon restarted on a held mount takes the holder's (holder.h) */
	struct kc_inode_slot **chunks; /* KC_INODE_CHUNKS pointers; a chunk is never moved or
					* freed before the table, so lookups need no lock */
	uint32_t next_slot;  /* slots below it have been used */
	uint32_t *free_slots; /* a stack of free slots (n_free of cap_free) */
	size_t n_free, cap_free;
	void *tree;          /* tsearch tree of struct kc_inode *, keyed by (dev, ino) */
	uint64_t count;
	uint64_t max;        /* inodes kept before the kernel is asked to forget the least
			      * recently used (notify.c); 0: no bound */
	uint64_t clock;      /* ticks once per lookup (atomic) */
	void *unhashed;      /* tsearch tree (by address) of the inodes let go of, not forgotten */
	void *published;     /* tsearch tree of the pending inodes whose cubin is published,
			      * keyed by (cubin_dev, cubin_ino); each is in tree too */
	const struct kc_inode_journal *journal; /* told of changes under the lock, or NULL */
	void *journal_arg;
	int placeholder_fd;  /* O_PATH on the store's lock file: what an unhashed inode's fd
			      * becomes (-1: none could be opened, and no inode is let go of) */
	struct kc_inode root, ctl_dir, stats, metrics;
};

/* Inodes in the table (the kernel holds a reference to each): a gauge, read without the
 * lock. */
uint64_t kc_inode_count(struct kc_inode_table *t);

/* Set up with root_fd (O_PATH or O_RDONLY on the backing root; the table dups it).
 * Returns 0 or -errno. */
int kc_inode_table_init(struct kc_inode_table *t, int root_fd);
/* Free every inode (after the session ended). */
void kc_inode_table_destroy(struct kc_inode_table *t);

/* The inode behind a kernel node id (FUSE_ROOT_ID or an id this table handed out), or NULL
 * for an id whose slot is empty or holds another generation (stale). No lock taken: the
 * kernel's reference keeps the inode alive. */
struct kc_inode *kc_inode_get(struct kc_inode_table *t, fuse_ino_t ino);

/* Take a reference of the daemon's own on in, dropped with kc_inode_forget(t, in, 1): in,
 * and so its node id, stays valid while the holder needs it, even after the kernel forgot
 * it. No effect on virtual inodes. */
void kc_inode_hold(struct kc_inode_table *t, struct kc_inode *in);
/* The node id of in, for the kernel. */
fuse_ino_t kc_inode_ino(struct kc_inode_table *t, const struct kc_inode *in);

/* Find or create the inode of the object behind fd (O_PATH, consumed: kept or closed) with
 * attributes st, and count one kernel reference. A published cubin whose pending inode the
 * kernel still holds (kc_inode_published) is that inode: one kernel inode, and so one set
 * of flock and fcntl locks, from the first lookup of a kernel.cubin on. Returns the inode,
 * or NULL with -errno in *err. */
struct kc_inode *kc_inode_ref(struct kc_inode_table *t, int fd, const struct stat *st,
			      int *err);

/* Find or create the pending-cubin inode of the entry directory behind entry_fd (stat
 * entry_st) for one recipe of it, and count one kernel reference. A re-staged recipe gets
 * another inode, so no page cache or size is shared between recipes. Returns it, or NULL
 * with -errno in *err. */
struct kc_inode *kc_inode_ref_pending(struct kc_inode_table *t, int entry_fd,
				      const struct stat *entry_st, uint64_t recipe_id, int *err);

/* The pending inode in became the published cubin behind cubin_fd (O_PATH, consumed: kept,
 * or closed when in has one already, which stays: it is set once): from here on a lookup of
 * that cubin answers in (kc_inode_ref), and the journal records it. Returns 0, or -EEXIST
 * (in had its cubin) or -EINVAL (in is not pending, or cubin_fd is not an open file); then
 * cubin_fd is closed. */
int kc_inode_published(struct kc_inode_table *t, struct kc_inode *in, int cubin_fd);

/* Find the inode of (dev, ino) if the kernel knows it, and hold it (kc_inode_hold): a
 * FORGET from the kernel cannot free it until kc_inode_let_go. Returns NULL when the
 * kernel does not know (dev, ino). (There is no unheld find: a request on one inode that
 * looked up another, unheld, met that one freed by a concurrent FORGET.) */
struct kc_inode *kc_inode_find_held(struct kc_inode_table *t, dev_t dev, ino_t ino);

/* Find the pending inode of the entry (dev, ino) for recipe_id (kc_inode_ref_pending) if
 * the kernel knows it, and hold it as kc_inode_find_held does. Returns NULL when not. */
struct kc_inode *kc_inode_find_pending_held(struct kc_inode_table *t, dev_t dev, ino_t ino,
					    uint64_t recipe_id);

/* Let go of the hold kc_inode_find_held or kc_inode_find_pending_held took (in may be NULL
 * or the root, which it does not hold); frees in when the kernel forgot it meanwhile. */
void kc_inode_let_go(struct kc_inode_table *t, struct kc_inode *in);

/* Mark in as used now (a lookup inside a directory uses the directory). */
void kc_inode_touch(struct kc_inode_table *t, struct kc_inode *in);

/* Candidates for the kernel to forget so that at most keep inodes stay, least recently
 * used first: files, and entry directories (other directories may be working directories
 * or mount points, which an invalidation would unhash). Inodes already asked and not used
 * since count as gone (their forget is on its way) and are left out, as are the root and
 * pending inodes whose cubin is not published yet. *need is how many of them must be asked. Each is held (kc_inode_hold;
 * the caller forgets each once). Returns a malloc'ed array of *got, or NULL on ENOMEM. */
struct kc_inode **kc_inode_to_forget(struct kc_inode_table *t, uint64_t keep, size_t *got,
				     size_t *need);
/* Record that the kernel was asked to forget in (kc_inode_to_forget leaves it out until it
 * is used again). */
void kc_inode_asked(struct kc_inode *in);

/* Record where an inode now lives: directory name (entry flag), or file name inside a
 * parent (role, and parent_fd dup'ed for staged roles). staging marks a stage temporary. */
void kc_inode_place(struct kc_inode_table *t, struct kc_inode *in, const struct kc_inode *parent,
		    const char *name, int staging);

/* For a file with a staged role: a new fd (caller closes) on its entry directory, and the
 * role. Returns -1 (role untouched or KC_ROLE_PLAIN) for any other inode. */
int kc_inode_entry_fd(struct kc_inode_table *t, struct kc_inode *in, enum kc_role *role);

/* A client handle on in was opened (delta 1) or released (-1). Returns how many are left
 * open. No effect (0) on virtual inodes. */
int kc_inode_opened(struct kc_inode_table *t, struct kc_inode *in, int delta);

/* Call after in's object may have lost its last name (unlink, a rename over it, a stage that
 * consumed it, the release of the last client handle). If it has no name left, no client
 * handle open and holds data blocks, the daemon lets go of it now, so that its space is free
 * when the call returns: its fd is swapped for a placeholder (the number stays, so no
 * request in flight reaches another file), it leaves the tree (a name that later holds a new
 * object with the same inode number gets a new inode), and requests on it are answered
 * ESTALE (ops.c) until the kernel forgets it. An empty file stays until FORGET (it frees
 * nothing, and an open racing its unlink then succeeds as on a local filesystem), and so do
 * directories, pending and virtual inodes. */
void kc_inode_unlinked(struct kc_inode_table *t, struct kc_inode *in);

/* Drop n kernel references; frees the inode at zero. */
void kc_inode_forget(struct kc_inode_table *t, struct kc_inode *in, uint64_t n);

/* A live upgrade (handover.c). The slots handed out so far (slots below it were used) and
 * each one's generation (0 for a slot never used); the fixed slots below
 * KC_INODE_FIRST_SLOT are not counted as handed out. */
uint32_t kc_inode_slots_used(struct kc_inode_table *t);
uint32_t kc_inode_slot_gen(struct kc_inode_table *t, uint32_t slot);
/* Call fn(in, arg) for every inode of a slot of its own (not the root, not the virtual
 * ones), under the table lock; stops at and returns the first nonzero return. */
int kc_inode_foreach(struct kc_inode_table *t, int (*fn)(struct kc_inode *in, void *arg),
		     void *arg);
/* In a fresh table: slots below used were handed out, with generations gens[slot]
 * (gens has used entries). Returns 0 or -ENOMEM. */
int kc_inode_restore_slots(struct kc_inode_table *t, uint32_t used, const uint32_t *gens);
/* Put a copy of rec (its fds owned by the table from here; slot, gen, nlookup and every
 * field as given, but a pending inode's cubin_dev and cubin_ino, read from its cubin_fd) at
 * its id. Returns the new inode, or NULL with -EEXIST (the slot is taken, or another inode
 * has its key), -EINVAL (a fixed slot, or one past kc_inode_restore_slots's) or -ENOMEM in
 * *err; then rec's fds are not taken. */
struct kc_inode *kc_inode_restore(struct kc_inode_table *t, const struct kc_inode *rec, int *err);
/* After the last kc_inode_restore: the slots left empty become free for new inodes. */
int kc_inode_restore_done(struct kc_inode_table *t);

#endif
