/* ledger.c - see ledger.h */
#define _GNU_SOURCE
#include "ledger.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "inode.h"
#include "log.h"

#define LEDGER_MAGIC 0x474c434bu /* "KCLG" */
#define LEDGER_VERSION 2u
#define RECORDS_AT 4096u /* the records start a page after the header */

struct kc_ledger_rec {
	uint64_t id;       /* the node id recorded (gen << 32 | slot), 0: none; written last */
	uint64_t nlookup;  /* its lookup count */
	uint64_t dev, ino; /* the backing object */
	uint64_t entry_ino;
	uint32_t type;     /* S_IFMT bits */
	uint32_t entry;    /* a directory that is a kernel entry */
	int32_t handle_type;
	uint32_t handle_bytes;
	unsigned char handle[MAX_HANDLE_SZ];
};

struct ledger_head {
	uint32_t magic, version, rec_size, slots;
	uint32_t high; /* slots below it may hold records (the table's high-water mark) */
	uint32_t pad;
	uint64_t root_dev, root_ino; /* the backing root the records were made under */
};

static size_t map_len(void)
{
	return RECORDS_AT + (size_t)KC_LEDGER_SLOTS * sizeof(struct kc_ledger_rec);
}

static struct ledger_head *head(struct kc_ledger *l)
{
	return l->map;
}

int kc_ledger_open(struct kc_ledger *l, int memfd, int root_fd)
{
	memset(l, 0, sizeof(*l));
	l->fd = -1;
	/* open_by_handle_at takes no O_PATH descriptor (EBADF): a directory opened for reading */
	l->root_fd = openat(root_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	size_t len = map_len();
	union {
		struct file_handle fh;
		char buf[sizeof(struct file_handle) + MAX_HANDLE_SZ];
	} h = {.fh.handle_bytes = MAX_HANDLE_SZ};
	struct stat st;
	const char *what = "the root's file handle";
	int err = l->root_fd < 0 || name_to_handle_at(l->root_fd, "", &h.fh, &l->mount_id,
						     AT_EMPTY_PATH) != 0;
	if (!err && (what = "its size", fstat(memfd, &st) != 0 ||
		     ((size_t)st.st_size < KC_LEDGER_AT + len &&
		      ftruncate(memfd, (off_t)(KC_LEDGER_AT + len)) != 0)))
		err = 1;
	if (!err && (what = "its mapping",
		     (l->map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE,
				    memfd, KC_LEDGER_AT)) == MAP_FAILED))
		err = 1;
	if (err) {
		int e = errno;
		kc_log(KC_LOG_WARN, "no inode ledger (%s: %s): after a crash, the node ids the kernel "
		       "holds are answered ESTALE", what, strerror(e));
		l->map = NULL;
		close(memfd);
		if (l->root_fd >= 0)
			close(l->root_fd);
		l->root_fd = -1;
		return -e;
	}
	struct ledger_head *hd = head(l);
	struct stat rst;
	int same_root = fstat(l->root_fd, &rst) == 0 && hd->root_dev == (uint64_t)rst.st_dev &&
			hd->root_ino == (uint64_t)rst.st_ino;
	if (hd->magic != LEDGER_MAGIC || hd->version != LEDGER_VERSION ||
	    hd->rec_size != sizeof(struct kc_ledger_rec) || hd->slots != KC_LEDGER_SLOTS ||
	    !same_root) {
		/* New, another build's, or made under another backing directory (a restart with
		 * another configuration): start empty (a hole reads as zeros). */
		if (hd->magic)
			kc_log(KC_LOG_INFO, "the inode ledger is %s: not restored", same_root ?
			       "of another build" : "of another backing directory");
		if (fallocate(memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, KC_LEDGER_AT,
			      (off_t)len) != 0)
			memset(hd, 0, RECORDS_AT); /* records stay, but no high-water mark covers them */
		hd->high = 0;
		hd->root_dev = (uint64_t)rst.st_dev;
		hd->root_ino = (uint64_t)rst.st_ino;
		hd->rec_size = sizeof(struct kc_ledger_rec);
		hd->slots = KC_LEDGER_SLOTS;
		hd->version = LEDGER_VERSION;
		hd->magic = LEDGER_MAGIC;
	}
	l->v = (struct kc_ledger_rec *)((char *)l->map + RECORDS_AT);
	l->fd = memfd;
	return 0;
}

void kc_ledger_close(struct kc_ledger *l)
{
	if (l->map)
		munmap(l->map, map_len());
	if (l->fd >= 0)
		close(l->fd);
	if (l->root_fd >= 0)
		close(l->root_fd);
	l->root_fd = -1;
	l->map = NULL;
	l->v = NULL;
	l->fd = -1;
}

static int recorded(struct kc_inode_table *t, const struct kc_inode *in)
{
	if (in->fd < 0 || in->virt || in->pending || in->unhashed || in->discarded ||
	    in->staging || in == &t->root)
		return 0;
	mode_t type = in->type & S_IFMT;
	return type == S_IFDIR || type == S_IFLNK || (type == S_IFREG && in->role == KC_ROLE_PLAIN);
}

void kc_ledger_clear(struct kc_ledger *l, uint32_t slot)
{
	if (l && l->v && slot < KC_LEDGER_SLOTS)
		__atomic_store_n(&l->v[slot].id, 0, __ATOMIC_RELEASE);
}

void kc_ledger_count(struct kc_ledger *l, struct kc_inode_table *t, const struct kc_inode *in)
{
	if (!l || !l->v || in->slot >= KC_LEDGER_SLOTS)
		return;
	struct kc_ledger_rec *r = &l->v[in->slot];
	if (__atomic_load_n(&r->id, __ATOMIC_RELAXED) == kc_inode_ino(t, in))
		__atomic_store_n(&r->nlookup, in->nlookup, __ATOMIC_RELAXED);
}

void kc_ledger_sync(struct kc_ledger *l, struct kc_inode_table *t, const struct kc_inode *in)
{
	if (!l || !l->v || in->slot >= KC_LEDGER_SLOTS || in->virt)
		return;
	struct kc_ledger_rec *r = &l->v[in->slot];
	uint64_t id = kc_inode_ino(t, in);
	int same = __atomic_load_n(&r->id, __ATOMIC_RELAXED) == id;
	if (!recorded(t, in)) {
		if (same)
			__atomic_store_n(&r->id, 0, __ATOMIC_RELEASE);
		return;
	}
	if (same) { /* what a lookup or a rename may change */
		r->entry = (uint32_t)in->entry;
		r->entry_ino = in->entry_ino;
		__atomic_store_n(&r->nlookup, in->nlookup, __ATOMIC_RELAXED);
		return;
	}
	__atomic_store_n(&r->id, 0, __ATOMIC_RELEASE);
	__atomic_thread_fence(__ATOMIC_RELEASE); /* cleared before any field changes */
	union {
		struct file_handle fh;
		char buf[sizeof(struct file_handle) + MAX_HANDLE_SZ];
	} h = {.fh.handle_bytes = MAX_HANDLE_SZ};
	int mount_id;
	if (name_to_handle_at(in->fd, "", &h.fh, &mount_id, AT_EMPTY_PATH) != 0 ||
	    mount_id != l->mount_id)
		return; /* not kept: ESTALE after a crash, as without a ledger */
	r->nlookup = in->nlookup;
	r->dev = in->dev;
	r->ino = in->ino;
	r->entry_ino = in->entry_ino;
	r->type = in->type & S_IFMT;
	r->entry = (uint32_t)in->entry;
	r->handle_type = h.fh.handle_type;
	r->handle_bytes = h.fh.handle_bytes;
	memcpy(r->handle, h.fh.f_handle, h.fh.handle_bytes);
	struct ledger_head *hd = head(l);
	if (in->slot >= hd->high)
		hd->high = in->slot + 1;
	__atomic_store_n(&r->id, id, __ATOMIC_RELEASE);
}

/* Open the object of record r, or -errno (-ESTALE: gone; -EPERM: no CAP_DAC_READ_SEARCH;
 * -ENOENT: another object now). */
static int open_record(struct kc_ledger *l, const struct kc_ledger_rec *r)
{
	if (r->handle_bytes > MAX_HANDLE_SZ)
		return -EINVAL;
	union {
		struct file_handle fh;
		char buf[sizeof(struct file_handle) + MAX_HANDLE_SZ];
	} h;
	h.fh.handle_bytes = r->handle_bytes;
	h.fh.handle_type = r->handle_type;
	memcpy(h.fh.f_handle, r->handle, r->handle_bytes);
	int fd = open_by_handle_at(l->root_fd, &h.fh, O_PATH | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	struct stat st;
	/* An object with no name left (unlinked; a client's file a stage consumed, which the
	 * kernel may still show under the staged name) is not restored: ESTALE, as before. */
	if (fstat(fd, &st) != 0 || (uint64_t)st.st_dev != r->dev || (uint64_t)st.st_ino != r->ino ||
	    (uint32_t)(st.st_mode & S_IFMT) != r->type || st.st_nlink == 0) {
		close(fd);
		return -ENOENT;
	}
	return fd;
}

long kc_ledger_restore(struct kc_ledger *l, struct kc_inode_table *t)
{
	if (!l->v)
		return -EINVAL;
	uint32_t high = head(l)->high;
	if (high > KC_LEDGER_SLOTS)
		high = KC_LEDGER_SLOTS;
	if (high <= KC_INODE_FIRST_SLOT)
		return 0;
	uint32_t *gens = calloc(high, sizeof(*gens));
	if (!gens)
		return -ENOMEM;
	for (uint32_t slot = KC_INODE_FIRST_SLOT; slot < high; slot++) {
		uint64_t id = __atomic_load_n(&l->v[slot].id, __ATOMIC_ACQUIRE);
		if ((uint32_t)id == slot && id >> 32)
			gens[slot] = (uint32_t)(id >> 32);
		else if (id)
			kc_ledger_clear(l, slot); /* not a record of this slot: never trusted */
	}
	long restored = 0, gone = 0, err = kc_inode_restore_slots(t, high, gens);
	for (uint32_t slot = KC_INODE_FIRST_SLOT; slot < high && !err; slot++) {
		if (!gens[slot])
			continue;
		const struct kc_ledger_rec *r = &l->v[slot];
		int fd = open_record(l, r);
		if (fd == -EPERM) {
			kc_log(KC_LOG_WARN, "the inode ledger cannot be read back without "
			       "CAP_DAC_READ_SEARCH (open_by_handle_at): the dead daemon's node ids "
			       "are answered ESTALE");
			err = -EPERM;
			break;
		}
		struct kc_inode rec = {
			.fd = fd, .dev = (dev_t)r->dev, .ino = (ino_t)r->ino, .type = (mode_t)r->type,
			.nlookup = r->nlookup ? r->nlookup : 1, .slot = slot, .gen = gens[slot],
			.entry = (int)r->entry, .entry_ino = (ino_t)r->entry_ino, .parent_fd = -1,
			.cubin_fd = -1, .role = KC_ROLE_PLAIN,
		};
		int rerr = fd < 0 ? fd : 0;
		struct kc_inode *in = fd >= 0 ? kc_inode_restore(t, &rec, &rerr) : NULL;
		if (in)
			kc_inode_touch(t, in); /* a use of its own: relief may ask the kernel for it */
		else if (fd >= 0)
			close(fd);
		if (rerr) {
			gone++;
			kc_ledger_clear(l, slot);
			gens[slot] = 0;
		} else {
			restored++;
		}
	}
	free(gens);
	if (err == -EPERM)
		for (uint32_t slot = KC_INODE_FIRST_SLOT; slot < high; slot++)
			kc_ledger_clear(l, slot);
	int derr = kc_inode_restore_done(t);
	if (err || derr)
		return err ? err : derr;
	kc_log(KC_LOG_INFO, "inode ledger: %ld node ids of the dead daemon restored, %ld of "
	       "objects gone or changed (answered ESTALE)", restored, gone);
	return restored;
}

static int record_one(struct kc_inode *in, void *arg)
{
	struct kc_inode_table *t = arg;
	kc_ledger_sync(t->journal_arg, t, in);
	return 0;
}

/* The table's journal (inode.h): these hooks, on the ledger. */
static void hook_sync(void *l, struct kc_inode_table *t, const struct kc_inode *in)
{
	kc_ledger_sync(l, t, in);
}

static void hook_count(void *l, struct kc_inode_table *t, const struct kc_inode *in)
{
	kc_ledger_count(l, t, in);
}

static void hook_clear(void *l, uint32_t slot)
{
	kc_ledger_clear(l, slot);
}

static const struct kc_inode_journal ledger_journal = {hook_sync, hook_count, hook_clear};

void kc_ledger_attach(struct kc_ledger *l, struct kc_inode_table *t)
{
	if (!l->v)
		return;
	pthread_mutex_lock(&t->lock);
	t->journal = &ledger_journal;
	t->journal_arg = l;
	/* Records of ids this table does not hold (another daemon's) go. */
	uint32_t high = head(l)->high < KC_LEDGER_SLOTS ? head(l)->high : KC_LEDGER_SLOTS;
	for (uint32_t slot = KC_INODE_FIRST_SLOT; slot < high; slot++) {
		uint64_t id = __atomic_load_n(&l->v[slot].id, __ATOMIC_RELAXED);
		if (id && kc_inode_get(t, (fuse_ino_t)id) == NULL)
			kc_ledger_clear(l, slot);
	}
	pthread_mutex_unlock(&t->lock);
	kc_inode_foreach(t, record_one, t);
}
