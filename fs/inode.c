/* inode.c - see inode.h */
#define _GNU_SOURCE
#include "inode.h"
#include "idtable.h"
#include "store.h"
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <search.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int inode_cmp(const void *a, const void *b)
{
	const struct kc_inode *x = a, *y = b;
	int c = kc_file_id_cmp(x->dev, x->ino, y->dev, y->ino);
	if (c)
		return c;
	if (x->pending != y->pending)
		return x->pending - y->pending;
	return x->recipe_id < y->recipe_id ? -1 : x->recipe_id > y->recipe_id;
}

/* The journal's hooks (lock held; none without a journal). */
static void journal_sync(struct kc_inode_table *t, const struct kc_inode *in)
{
	if (t->journal)
		t->journal->sync(t->journal_arg, t, in);
}

static void journal_count(struct kc_inode_table *t, const struct kc_inode *in)
{
	if (t->journal)
		t->journal->count(t->journal_arg, t, in);
}

static void journal_clear(struct kc_inode_table *t, uint32_t slot)
{
	if (t->journal)
		t->journal->clear(t->journal_arg, slot);
}

static int by_address(const void *a, const void *b)
{
	return a < b ? -1 : a > b;
}

/* The order of the published tree: by the cubin a pending inode became. */
static int by_cubin(const void *a, const void *b)
{
	const struct kc_inode *x = a, *y = b;
	return kc_file_id_cmp(x->cubin_dev, x->cubin_ino, y->cubin_dev, y->cubin_ino);
}

/* Take in out of the published tree, if it is there (lock held). */
static void unpublish(struct kc_inode_table *t, struct kc_inode *in)
{
	if (!in->pending || in->cubin_fd < 0)
		return;
	struct kc_inode **found = tfind(in, &t->published, by_cubin);
	if (found && *found == in)
		tdelete(in, &t->published, by_cubin);
}

/* The slot's cell, or NULL when its chunk was never made (alloc 0) or cannot be. Call with
 * the lock held when alloc is set. */
static struct kc_inode_slot *slot_cell(struct kc_inode_table *t, uint32_t slot, int alloc)
{
	uint32_t c = slot / KC_INODE_CHUNK;
	if (c >= KC_INODE_CHUNKS)
		return NULL;
	struct kc_inode_slot *chunk = __atomic_load_n(&t->chunks[c], __ATOMIC_ACQUIRE);
	if (!chunk && alloc) {
		chunk = calloc(KC_INODE_CHUNK, sizeof(*chunk));
		if (chunk)
			__atomic_store_n(&t->chunks[c], chunk, __ATOMIC_RELEASE);
	}
	return chunk ? &chunk[slot % KC_INODE_CHUNK] : NULL;
}

/* Give in a slot and a new generation of it (lock held). Returns 0 or -ENOMEM. */
static int slot_take(struct kc_inode_table *t, struct kc_inode *in)
{
	uint32_t slot;
	if (t->n_free)
		slot = t->free_slots[--t->n_free];
	else if (t->next_slot < KC_INODE_CHUNK * KC_INODE_CHUNKS)
		slot = t->next_slot++;
	else
		return -ENOMEM;
	struct kc_inode_slot *cell = slot_cell(t, slot, 1);
	if (!cell) {
		if (slot == t->next_slot - 1)
			t->next_slot--;
		else
			t->free_slots[t->n_free++] = slot;
		return -ENOMEM;
	}
	in->slot = slot;
	journal_clear(t, slot); /* the slot's last occupant's record */
	in->gen = kc_gen_next(cell->gen, t->epoch); /* never 0: that is the fixed ids' */
	__atomic_store_n(&cell->gen, in->gen, __ATOMIC_RELAXED);
	__atomic_store_n(&cell->in, in, __ATOMIC_RELEASE);
	return 0;
}

/* Free in's slot (lock held); its generation stays, so its old id reads as stale. */
static void slot_put(struct kc_inode_table *t, struct kc_inode *in)
{
	struct kc_inode_slot *cell = slot_cell(t, in->slot, 0);
	if (!cell || cell->in != in)
		return;
	journal_clear(t, in->slot);
	__atomic_store_n(&cell->in, NULL, __ATOMIC_RELEASE);
	if (t->n_free == t->cap_free) {
		size_t cap = t->cap_free ? t->cap_free * 2 : 1024;
		uint32_t *v = realloc(t->free_slots, cap * sizeof(*v));
		if (!v)
			return; /* the slot is lost, not reused: harmless */
		t->free_slots = v;
		t->cap_free = cap;
	}
	t->free_slots[t->n_free++] = in->slot;
}

static void init_virtual(struct kc_inode_table *t, struct kc_inode *in, enum kc_virtual v,
			 mode_t type, uint32_t slot)
{
	memset(in, 0, sizeof(*in));
	in->slot = slot;
	in->gen = 0;
	struct kc_inode_slot *cell = slot_cell(t, slot, 1);
	if (cell)
		cell->in = in;
	in->fd = -1;
	in->parent_fd = -1;
	in->virt = v;
	in->type = type;
	in->nlookup = 1;
}

int kc_inode_table_init(struct kc_inode_table *t, int root_fd)
{
	struct stat st;

	memset(t, 0, sizeof(*t));
	t->placeholder_fd = -1;
	t->root.fd = -1;
	pthread_mutex_init(&t->lock, NULL);
	t->chunks = calloc(KC_INODE_CHUNKS, sizeof(*t->chunks));
	if (!t->chunks)
		return -ENOMEM;
	t->next_slot = KC_INODE_FIRST_SLOT;
	init_virtual(t, &t->ctl_dir, KC_VIRT_CTL_DIR, S_IFDIR, 2);
	init_virtual(t, &t->stats, KC_VIRT_STATS, S_IFREG, 3);
	init_virtual(t, &t->metrics, KC_VIRT_METRICS, S_IFREG, 4);
	init_virtual(t, &t->root, KC_VIRT_NONE, S_IFDIR, FUSE_ROOT_ID);
	if (!slot_cell(t, FUSE_ROOT_ID, 0))
		return -ENOMEM;
	t->root.nlookup = 2;
	t->root.fd = fcntl(root_fd, F_DUPFD_CLOEXEC, 0);
	if (t->root.fd < 0 || fstat(t->root.fd, &st) != 0)
		return -errno;
	t->root.dev = st.st_dev;
	t->root.ino = st.st_ino;
	/* The store's empty lock file: the daemon's own, named (an unnamed file would keep the
	 * backing disk from being remounted read-only), and what a request that raced with the
	 * swap does to it harms nothing (opens check the object: ops.c). */
	t->placeholder_fd = openat(t->root.fd, KC_STATE_DIR "/lock", O_PATH | O_NOFOLLOW |
				   O_CLOEXEC);
	return 0;
}

static void leave_inode(void *p)
{
	(void)p; /* freed through the tree that owns it */
}

static void free_inode(void *p)
{
	struct kc_inode *in = p;
	close(in->fd);
	if (in->parent_fd >= 0)
		close(in->parent_fd);
	if (in->cubin_fd >= 0)
		close(in->cubin_fd);
	free(in);
}

void kc_inode_table_destroy(struct kc_inode_table *t)
{
	tdestroy(t->published, leave_inode);
	t->published = NULL;
	tdestroy(t->tree, free_inode);
	t->tree = NULL;
	tdestroy(t->unhashed, free_inode);
	t->unhashed = NULL;
	if (t->placeholder_fd >= 0)
		close(t->placeholder_fd);
	t->placeholder_fd = -1;
	if (t->root.fd >= 0)
		close(t->root.fd);
	t->root.fd = -1;
	if (t->chunks)
		for (uint32_t c = 0; c < KC_INODE_CHUNKS; c++)
			free(t->chunks[c]);
	free(t->chunks);
	t->chunks = NULL;
	free(t->free_slots);
	t->free_slots = NULL;
	t->n_free = t->cap_free = 0;
	pthread_mutex_destroy(&t->lock);
}

struct kc_inode *kc_inode_get(struct kc_inode_table *t, fuse_ino_t ino)
{
	uint32_t slot = (uint32_t)ino, gen = (uint32_t)((uint64_t)ino >> 32);
	if (slot == 0 || (gen == 0) != (slot < KC_INODE_FIRST_SLOT))
		return NULL; /* generation 0 is the fixed ids' only */
	struct kc_inode_slot *cell = slot_cell(t, slot, 0);
	if (!cell || __atomic_load_n(&cell->gen, __ATOMIC_ACQUIRE) != gen)
		return NULL;
	return __atomic_load_n(&cell->in, __ATOMIC_ACQUIRE);
}

fuse_ino_t kc_inode_ino(struct kc_inode_table *t, const struct kc_inode *in)
{
	(void)t;
	return (fuse_ino_t)((uint64_t)in->gen << 32 | in->slot);
}

/* Find or create the inode for key (fd is consumed), counting one kernel reference. */
static struct kc_inode *ref_key(struct kc_inode_table *t, const struct kc_inode *key, int fd,
				mode_t type, int *err)
{
	pthread_mutex_lock(&t->lock);
	struct kc_inode **found = tfind(key, &t->tree, inode_cmp);
	if (!found && !key->pending) { /* a published cubin the kernel knows as pending */
		struct kc_inode cubin = {.cubin_dev = key->dev, .cubin_ino = key->ino};
		found = tfind(&cubin, &t->published, by_cubin);
	}
	if (found) {
		struct kc_inode *in = *found;
		in->nlookup++;
		journal_count(t, in);
		pthread_mutex_unlock(&t->lock);
		kc_inode_touch(t, in);
		close(fd);
		return in;
	}
	struct kc_inode *in = calloc(1, sizeof(*in));
	if (in) {
		in->fd = fd;
		in->dev = key->dev; /* the tree key: set before tsearch orders by it */
		in->ino = key->ino;
		in->pending = key->pending;
		in->recipe_id = key->recipe_id;
		in->type = type;
		in->nlookup = 1;
		in->parent_fd = -1;
		in->cubin_fd = -1;
	}
	if (!in || slot_take(t, in) != 0) {
		pthread_mutex_unlock(&t->lock);
		free(in);
		close(fd);
		*err = -ENOMEM;
		return NULL;
	}
	if (!tsearch(in, &t->tree, inode_cmp)) {
		slot_put(t, in);
		pthread_mutex_unlock(&t->lock);
		free(in);
		close(fd);
		*err = -ENOMEM;
		return NULL;
	}
	t->count++;
	pthread_mutex_unlock(&t->lock);
	kc_inode_touch(t, in);
	return in;
}

struct kc_inode *kc_inode_ref(struct kc_inode_table *t, int fd, const struct stat *st, int *err)
{
	struct kc_inode key = {.dev = st->st_dev, .ino = st->st_ino};

	if (st->st_dev == t->root.dev && st->st_ino == t->root.ino) {
		close(fd);
		pthread_mutex_lock(&t->lock);
		t->root.nlookup++;
		pthread_mutex_unlock(&t->lock);
		return &t->root;
	}
	return ref_key(t, &key, fd, st->st_mode & S_IFMT, err);
}

struct kc_inode *kc_inode_ref_pending(struct kc_inode_table *t, int entry_fd,
				      const struct stat *entry_st, uint64_t recipe_id, int *err)
{
	struct kc_inode key = {.dev = entry_st->st_dev, .ino = entry_st->st_ino, .pending = 1,
			       .recipe_id = recipe_id};
	int fd = fcntl(entry_fd, F_DUPFD_CLOEXEC, 0);
	if (fd < 0) {
		*err = -errno;
		return NULL;
	}
	struct kc_inode *in = ref_key(t, &key, fd, S_IFREG, err);
	if (in) {
		pthread_mutex_lock(&t->lock);
		in->role = KC_ROLE_CUBIN;
		if (in->parent_fd < 0)
			in->parent_fd = fcntl(entry_fd, F_DUPFD_CLOEXEC, 0);
		pthread_mutex_unlock(&t->lock);
	}
	return in;
}

int kc_inode_published(struct kc_inode_table *t, struct kc_inode *in, int cubin_fd)
{
	struct stat st;
	if (cubin_fd < 0)
		return -EINVAL;
	if (!in->pending || fstat(cubin_fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		close(cubin_fd);
		return -EINVAL;
	}
	pthread_mutex_lock(&t->lock);
	int err = in->cubin_fd >= 0 ? -EEXIST : 0;
	if (!err) {
		in->cubin_dev = st.st_dev;
		in->cubin_ino = st.st_ino;
		__atomic_store_n(&in->cubin_fd, cubin_fd, __ATOMIC_SEQ_CST);
		/* Without memory for it, a later lookup gets an inode of its own, as before. */
		tsearch(in, &t->published, by_cubin);
		journal_sync(t, in);
	}
	pthread_mutex_unlock(&t->lock);
	if (err)
		close(cubin_fd);
	return err;
}

/* The inode of key in the tree, held (kc_inode_hold), or NULL. */
static struct kc_inode *find_key_held(struct kc_inode_table *t, const struct kc_inode *key)
{
	pthread_mutex_lock(&t->lock);
	struct kc_inode **found = tfind(key, &t->tree, inode_cmp);
	struct kc_inode *in = found ? *found : NULL;
	if (in) {
		in->nlookup++;
		journal_count(t, in);
	}
	pthread_mutex_unlock(&t->lock);
	return in;
}

struct kc_inode *kc_inode_find_held(struct kc_inode_table *t, dev_t dev, ino_t ino)
{
	struct kc_inode key = {.dev = dev, .ino = ino};
	if (dev == t->root.dev && ino == t->root.ino)
		return &t->root; /* never freed */
	return find_key_held(t, &key);
}

struct kc_inode *kc_inode_find_pending_held(struct kc_inode_table *t, dev_t dev, ino_t ino,
					    uint64_t recipe_id)
{
	struct kc_inode key = {.dev = dev, .ino = ino, .pending = 1, .recipe_id = recipe_id};
	return find_key_held(t, &key);
}

void kc_inode_let_go(struct kc_inode_table *t, struct kc_inode *in)
{
	if (in && in != &t->root)
		kc_inode_forget(t, in, 1);
}

void kc_inode_touch(struct kc_inode_table *t, struct kc_inode *in)
{
	__atomic_store_n(&in->last_use, __atomic_add_fetch(&t->clock, 1, __ATOMIC_RELAXED),
			 __ATOMIC_RELAXED);
}

struct gather {
	struct kc_inode **v;
	size_t n, asked;
	struct kc_inode_table *t;
};

static void gather_one(const void *node, VISIT which, void *closure)
{
	struct gather *g = closure;
	struct kc_inode *in = *(struct kc_inode *const *)node;
	if ((which != postorder && which != leaf) || (in->pending && in->cubin_fd < 0) ||
	    (in->type == S_IFDIR && !in->entry))
		return;
	if (__atomic_load_n(&in->last_use, __ATOMIC_RELAXED) == in->dropped_use) {
		g->asked++;
		return;
	}
	in->nlookup++;
	journal_count(g->t, in);
	g->v[g->n++] = in;
}

static int older(const void *a, const void *b)
{
	uint64_t x = (*(struct kc_inode *const *)a)->last_use;
	uint64_t y = (*(struct kc_inode *const *)b)->last_use;
	return x < y ? -1 : x > y;
}

struct kc_inode **kc_inode_to_forget(struct kc_inode_table *t, uint64_t keep, size_t *got,
				     size_t *need)
{
	/* Hold every candidate while sorting outside the lock, then let go of the rest. */
	pthread_mutex_lock(&t->lock);
	uint64_t count = t->count;
	struct gather g = {malloc((count + 1) * sizeof(*g.v)), 0, 0, t};
	if (g.v)
		twalk_r(t->tree, gather_one, &g);
	pthread_mutex_unlock(&t->lock);
	if (!g.v)
		return NULL;
	uint64_t left = count > g.asked ? count - g.asked : 0;
	*need = left > keep ? (size_t)(left - keep) : 0;
	qsort(g.v, g.n, sizeof(*g.v), older);
	*got = g.n;
	return g.v;
}

void kc_inode_asked(struct kc_inode *in)
{
	in->dropped_use = __atomic_load_n(&in->last_use, __ATOMIC_RELAXED);
}

void kc_inode_place(struct kc_inode_table *t, struct kc_inode *in, const struct kc_inode *parent,
		    const char *name, int staging)
{
	if (in == &t->root || in->virt || in->pending)
		return;
	int entry = 0, parent_fd = -1;
	enum kc_role role = KC_ROLE_PLAIN;
	if (in->type == S_IFDIR)
		entry = kc_name_classify(name, NULL) == KC_NAME_ENTRY;
	else if (parent->entry && in->type == S_IFREG)
		role = kc_name_role(name);
	if (kc_role_is_staged(role))
		parent_fd = fcntl(parent->fd, F_DUPFD_CLOEXEC, 0);

	pthread_mutex_lock(&t->lock);
	int old = in->parent_fd;
	in->entry = entry;
	in->role = role;
	in->entry_ino = parent->entry ? parent->ino : 0;
	in->parent_fd = parent_fd;
	in->staging = staging;
	journal_sync(t, in);
	pthread_mutex_unlock(&t->lock);
	if (old >= 0)
		close(old);
}

void kc_inode_hold(struct kc_inode_table *t, struct kc_inode *in)
{
	if (in->virt)
		return;
	pthread_mutex_lock(&t->lock);
	in->nlookup++;
	journal_count(t, in);
	pthread_mutex_unlock(&t->lock);
}

void kc_inode_forget(struct kc_inode_table *t, struct kc_inode *in, uint64_t n)
{
	if (in->virt)
		return;
	pthread_mutex_lock(&t->lock);
	in->nlookup = in->nlookup > n ? in->nlookup - n : 0;
	journal_count(t, in);
	int gone = in->nlookup == 0 && in != &t->root;
	if (gone && in->unhashed) /* out of the tree already; its key may be another's now */
		gone = tdelete(in, &t->unhashed, by_address) != NULL;
	else if (gone && !tdelete(in, &t->tree, inode_cmp))
		gone = 0; /* not in the tree: never free what the tree might still reach */
	else if (gone)
		t->count--;
	if (gone) {
		unpublish(t, in);
		slot_put(t, in);
	}
	pthread_mutex_unlock(&t->lock);
	if (gone)
		free_inode(in);
}

int kc_inode_entry_fd(struct kc_inode_table *t, struct kc_inode *in, enum kc_role *role)
{
	pthread_mutex_lock(&t->lock);
	int fd = in->parent_fd >= 0 ? fcntl(in->parent_fd, F_DUPFD_CLOEXEC, 0) : -1;
	*role = in->role;
	pthread_mutex_unlock(&t->lock);
	return fd;
}

uint64_t kc_inode_count(struct kc_inode_table *t)
{
	return __atomic_load_n(&t->count, __ATOMIC_RELAXED);
}

int kc_inode_opened(struct kc_inode_table *t, struct kc_inode *in, int delta)
{
	if (in->virt)
		return 0;
	pthread_mutex_lock(&t->lock);
	in->opens += delta;
	int left = in->opens;
	pthread_mutex_unlock(&t->lock);
	return left;
}

void kc_inode_unlinked(struct kc_inode_table *t, struct kc_inode *in)
{
	struct stat st;
	if (!in || in == &t->root || in->virt || in->pending || in->type == S_IFDIR ||
	    t->placeholder_fd < 0)
		return;
	pthread_mutex_lock(&t->lock);
	/* An object with no data blocks (an empty lock file) frees nothing by going: it stays
	 * until FORGET, so an open that looked its name up just before the unlink opens it, as
	 * on a local filesystem, instead of meeting ESTALE (the kernel retries ESTALE once, and
	 * a lock file unlinked and recreated in a loop can meet it twice). */
	if (!in->unhashed && in->opens == 0 &&
	    fstatat(in->fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) == 0 &&
	    st.st_nlink == 0 && st.st_blocks > 0) {
		struct kc_inode **found = tfind(in, &t->tree, inode_cmp);
		if (found && *found == in && tsearch(in, &t->unhashed, by_address)) {
			tdelete(in, &t->tree, inode_cmp);
			t->count--;
			in->unhashed = 1;
			journal_sync(t, in); /* no record: its object goes */
			/* The last reference to the object goes; the number stays in->fd's. */
			dup3(t->placeholder_fd, in->fd, O_CLOEXEC);
		}
	}
	pthread_mutex_unlock(&t->lock);
}

uint32_t kc_inode_slots_used(struct kc_inode_table *t)
{
	pthread_mutex_lock(&t->lock);
	uint32_t n = t->next_slot;
	pthread_mutex_unlock(&t->lock);
	return n;
}

uint32_t kc_inode_slot_gen(struct kc_inode_table *t, uint32_t slot)
{
	struct kc_inode_slot *cell = slot_cell(t, slot, 0);
	return cell ? __atomic_load_n(&cell->gen, __ATOMIC_ACQUIRE) : 0;
}

int kc_inode_foreach(struct kc_inode_table *t, int (*fn)(struct kc_inode *in, void *arg),
		     void *arg)
{
	int r = 0;
	pthread_mutex_lock(&t->lock);
	for (uint32_t slot = KC_INODE_FIRST_SLOT; slot < t->next_slot && !r; slot++) {
		struct kc_inode_slot *cell = slot_cell(t, slot, 0);
		if (cell && cell->in)
			r = fn(cell->in, arg);
	}
	pthread_mutex_unlock(&t->lock);
	return r;
}

int kc_inode_restore_slots(struct kc_inode_table *t, uint32_t used, const uint32_t *gens)
{
	pthread_mutex_lock(&t->lock);
	int err = 0;
	for (uint32_t slot = KC_INODE_FIRST_SLOT; slot < used && !err; slot++) {
		struct kc_inode_slot *cell = slot_cell(t, slot, 1);
		if (!cell)
			err = -ENOMEM;
		else
			cell->gen = gens[slot];
	}
	if (!err && used > t->next_slot)
		t->next_slot = used;
	pthread_mutex_unlock(&t->lock);
	return err;
}

struct kc_inode *kc_inode_restore(struct kc_inode_table *t, const struct kc_inode *rec, int *err)
{
	if (rec->slot < KC_INODE_FIRST_SLOT || rec->gen == 0) {
		*err = -EINVAL;
		return NULL;
	}
	struct kc_inode *in = malloc(sizeof(*in));
	if (!in) {
		*err = -ENOMEM;
		return NULL;
	}
	*in = *rec;
	struct stat st;
	int published = in->pending && in->cubin_fd >= 0 && fstat(in->cubin_fd, &st) == 0;
	if (published) {
		in->cubin_dev = st.st_dev;
		in->cubin_ino = st.st_ino;
	}
	pthread_mutex_lock(&t->lock);
	struct kc_inode_slot *cell = rec->slot < t->next_slot ? slot_cell(t, rec->slot, 1) : NULL;
	*err = !cell ? -EINVAL : cell->in ? -EEXIST : 0;
	if (!*err) {
		struct kc_inode **put = tsearch(in, in->unhashed ? &t->unhashed : &t->tree,
						in->unhashed ? by_address : inode_cmp);
		*err = !put ? -ENOMEM : *put != in ? -EEXIST : 0; /* another inode has its key */
	}
	if (!*err && published)
		tsearch(in, &t->published, by_cubin); /* without memory: as in kc_inode_published */
	if (!*err) {
		cell->gen = in->gen;
		__atomic_store_n(&cell->in, in, __ATOMIC_RELEASE);
		if (!in->unhashed)
			t->count++;
		if (in->last_use > t->clock)
			t->clock = in->last_use;
	}
	pthread_mutex_unlock(&t->lock);
	if (*err) {
		free(in);
		return NULL;
	}
	return in;
}

int kc_inode_restore_done(struct kc_inode_table *t)
{
	pthread_mutex_lock(&t->lock);
	for (uint32_t slot = t->next_slot; slot-- > KC_INODE_FIRST_SLOT;) {
		struct kc_inode_slot *cell = slot_cell(t, slot, 0);
		if (cell && !cell->in && t->n_free == t->cap_free) {
			size_t cap = t->cap_free ? t->cap_free * 2 : 1024;
			uint32_t *v = realloc(t->free_slots, cap * sizeof(*v));
			if (!v) {
				pthread_mutex_unlock(&t->lock);
				return -ENOMEM;
			}
			t->free_slots = v;
			t->cap_free = cap;
		}
		if (cell && !cell->in)
			t->free_slots[t->n_free++] = slot;
	}
	pthread_mutex_unlock(&t->lock);
	return 0;
}
