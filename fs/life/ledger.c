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
/* 3: files of kernel entries (their role, the handle of their entry) and pending cubins
 * whose cubin is published are recorded; a build of version 2 would restore such a record
 * as a plain file, and one of 3 cannot read a record of 2 (another size). */
#define LEDGER_VERSION 3u
#define RECORDS_AT 4096u /* the records start a page after the header */

struct kc_ledger_rec {
	uint64_t id;        /* the node id recorded (gen << 32 | slot), 0: none; written last */
	uint64_t nlookup;   /* its lookup count */
	uint64_t dev, ino;  /* the inode's key: its backing object (a pending cubin's: its entry) */
	uint64_t entry_ino; /* a file in an entry, and a pending cubin: the entry directory */
	uint64_t cubin_ino; /* a pending cubin: the published cubin it became */
	uint64_t recipe_id; /* a pending cubin: the recipe it stands for */
	uint32_t type;      /* S_IFMT bits */
	uint32_t entry;     /* a directory that is a kernel entry */
	uint32_t role;      /* a file in an entry: its role (enum kc_role) */
	uint32_t pending;   /* a pending cubin (its cubin published) */
	int32_t handle_type;
	uint32_t handle_bytes;
	unsigned char handle[MAX_HANDLE_SZ]; /* of the backing object, or of the entry for an
					      * inode that keeps its entry's descriptor */
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

/* Does the inode keep a descriptor of its entry (kernel.cu, kernel.flags and kernel.cubin,
 * published or pending: inode.h's parent_fd)? Its record then holds the entry's handle, and
 * the file is opened again by its role's name there. */
static int by_entry(int pending, uint32_t role)
{
	return pending || kc_role_is_staged((enum kc_role)role);
}

/* The descriptor whose handle in's record holds (inode.h: a pending cubin's fd is its
 * entry's). */
static int handle_fd(const struct kc_inode *in)
{
	return in->pending ? in->fd : by_entry(0, in->role) ? in->parent_fd : in->fd;
}

static uint64_t entry_ino_of(const struct kc_inode *in)
{
	return in->pending ? (uint64_t)in->ino : (uint64_t)in->entry_ino;
}

static int recorded(struct kc_inode_table *t, const struct kc_inode *in)
{
	if (in->fd < 0 || in->virt || in->unhashed || in->discarded || in->staging ||
	    in == &t->root)
		return 0;
	if (in->pending) /* one still compiling: its state (the compile) dies with the daemon */
		return in->cubin_fd >= 0 && in->role == KC_ROLE_CUBIN;
	mode_t type = in->type & S_IFMT;
	return type == S_IFDIR || type == S_IFLNK ||
	       (type == S_IFREG && in->role <= KC_ROLE_LOG && handle_fd(in) >= 0 &&
		(!by_entry(0, in->role) || in->entry_ino));
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
	/* What a lookup or a rename may change, where the handle stays right: a role that
	 * changed (a directory renamed into an entry name) or an entry of another inode
	 * number wants another handle. */
	if (same && r->role == (uint32_t)in->role && r->pending == (uint32_t)in->pending &&
	    (!by_entry(in->pending, in->role) || r->entry_ino == entry_ino_of(in))) {
		r->entry = (uint32_t)in->entry;
		r->entry_ino = entry_ino_of(in);
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
	if (name_to_handle_at(handle_fd(in), "", &h.fh, &mount_id, AT_EMPTY_PATH) != 0 ||
	    mount_id != l->mount_id)
		return; /* not kept: ESTALE after a crash, as without a ledger */
	r->nlookup = in->nlookup;
	r->dev = in->dev;
	r->ino = in->ino;
	r->entry_ino = entry_ino_of(in);
	r->cubin_ino = in->pending ? (uint64_t)in->cubin_ino : 0;
	r->recipe_id = in->pending ? in->recipe_id : 0;
	r->type = in->type & S_IFMT;
	r->entry = (uint32_t)in->entry;
	r->role = (uint32_t)in->role;
	r->pending = (uint32_t)in->pending;
	r->handle_type = h.fh.handle_type;
	r->handle_bytes = h.fh.handle_bytes;
	memcpy(r->handle, h.fh.f_handle, h.fh.handle_bytes);
	struct ledger_head *hd = head(l);
	if (in->slot >= hd->high)
		hd->high = in->slot + 1;
	__atomic_store_n(&r->id, id, __ATOMIC_RELEASE);
}

/* Is fd's object (dev, ino) of type type, with a name left? */
static int is_object(int fd, uint64_t dev, uint64_t ino, uint32_t type)
{
	struct stat st;
	return fstat(fd, &st) == 0 && (uint64_t)st.st_dev == dev && (uint64_t)st.st_ino == ino &&
	       (uint32_t)(st.st_mode & S_IFMT) == type && st.st_nlink > 0;
}

/* Open what record r names, O_PATH: in rec->fd its object (a pending cubin's: its entry),
 * in rec->parent_fd its entry where the inode keeps one (else -1), in rec->cubin_fd a
 * pending cubin's published cubin (else -1). Returns 0, or -errno with none of them open
 * (-ESTALE: gone; -EPERM: no CAP_DAC_READ_SEARCH; -ENOENT: another object now, or no name
 * left). */
static int open_record(struct kc_ledger *l, const struct kc_ledger_rec *r, struct kc_inode *rec)
{
	rec->fd = rec->parent_fd = rec->cubin_fd = -1;
	if (r->handle_bytes > MAX_HANDLE_SZ || r->role > KC_ROLE_LOG ||
	    (r->pending && (r->role != KC_ROLE_CUBIN || r->type != S_IFREG)))
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
	/* An object with no name left (unlinked; a client's file a stage consumed, which the
	 * kernel may still show under the staged name) is not restored: ESTALE, as before. */
	if (!by_entry((int)r->pending, r->role)) {
		if (!is_object(fd, r->dev, r->ino, r->type)) {
			close(fd);
			return -ENOENT;
		}
		rec->fd = fd;
		return 0;
	}
	/* A file kept with its entry is restored only while its role's name in the entry
	 * still names it: one that a re-stage or a recompile replaced, or an eviction
	 * removed, is not (ESTALE: the kernel looks the name up again and finds what it
	 * names now). */
	int obj = -1;
	if (is_object(fd, r->dev, r->entry_ino, S_IFDIR))
		obj = openat(fd, kc_role_name((enum kc_role)r->role), O_PATH | O_NOFOLLOW | O_CLOEXEC);
	if (obj < 0 || !is_object(obj, r->dev, r->pending ? r->cubin_ino : r->ino, S_IFREG)) {
		if (obj >= 0)
			close(obj);
		close(fd);
		return -ENOENT;
	}
	if (!r->pending) {
		rec->fd = obj;
		rec->parent_fd = fd;
		return 0;
	}
	int parent = fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (parent < 0) {
		int e = -errno;
		close(obj);
		close(fd);
		return e;
	}
	rec->fd = fd; /* as kc_inode_ref_pending makes it */
	rec->parent_fd = parent;
	rec->cubin_fd = obj;
	return 0;
}

static void close_record(const struct kc_inode *rec)
{
	if (rec->fd >= 0)
		close(rec->fd);
	if (rec->parent_fd >= 0)
		close(rec->parent_fd);
	if (rec->cubin_fd >= 0)
		close(rec->cubin_fd);
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
		/* As a lookup makes it (ops.c's do_lookup and kc_inode_place, or
		 * kc_inode_ref_pending and the publish that set its cubin: cubin.c). */
		struct kc_inode rec = {
			.dev = (dev_t)r->dev, .ino = (ino_t)r->ino, .type = (mode_t)r->type,
			.nlookup = r->nlookup ? r->nlookup : 1, .slot = slot, .gen = gens[slot],
			.entry = (int)r->entry, .entry_ino = r->pending ? 0 : (ino_t)r->entry_ino,
			.role = (enum kc_role)r->role, .pending = (int)r->pending,
			.recipe_id = r->pending ? r->recipe_id : 0, .stored = (int)r->pending,
		};
		int rerr = open_record(l, r, &rec);
		if (rerr == -EPERM) {
			kc_log(KC_LOG_WARN, "the inode ledger cannot be read back without "
			       "CAP_DAC_READ_SEARCH (open_by_handle_at): the dead daemon's node ids "
			       "are answered ESTALE");
			err = -EPERM;
			break;
		}
		struct kc_inode *in = rerr ? NULL : kc_inode_restore(t, &rec, &rerr);
		if (in)
			kc_inode_touch(t, in); /* a use of its own: relief may ask the kernel for it */
		else
			close_record(&rec); /* none open when open_record failed */
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
