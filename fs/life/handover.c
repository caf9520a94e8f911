/* handover.c - see handover.h */
#define _GNU_SOURCE
#include "handover.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "stage.h"

#define STATE_MAGIC 0x4b435354u /* "KCST" */

/* Writing. */

void kc_hbuf_raw(struct kc_hbuf *b, const void *p, size_t len)
{
	if (b->err)
		return;
	if (b->len + len > b->cap) {
		size_t cap = b->cap ? b->cap : 4096;
		while (cap < b->len + len)
			cap *= 2;
		unsigned char *n = realloc(b->p, cap);
		if (!n) {
			b->err = -ENOMEM;
			return;
		}
		b->p = n;
		b->cap = cap;
	}
	memcpy(b->p + b->len, p, len);
	b->len += len;
}

void kc_hbuf_u32(struct kc_hbuf *b, uint32_t v)
{
	kc_hbuf_raw(b, &v, sizeof(v));
}

static void put_u64(struct kc_hbuf *b, uint64_t v)
{
	kc_hbuf_raw(b, &v, sizeof(v));
}

static void put_i32(struct kc_hbuf *b, int32_t v)
{
	kc_hbuf_raw(b, &v, sizeof(v));
}

void kc_hbuf_bytes(struct kc_hbuf *b, const void *p, size_t len)
{
	kc_hbuf_u32(b, (uint32_t)len);
	kc_hbuf_raw(b, p, len);
}

void kc_hbuf_free(struct kc_hbuf *b)
{
	free(b->p);
	memset(b, 0, sizeof(*b));
}

void kc_hfds_free(struct kc_hfds *f)
{
	free(f->v);
	memset(f, 0, sizeof(*f));
}

/* Index of fd in the list (added), -1 for fd < 0, or -2 on ENOMEM. */
static int32_t fd_index(struct kc_hfds *f, int fd)
{
	if (fd < 0)
		return -1;
	if (f->n == f->cap) {
		size_t cap = f->cap ? f->cap * 2 : 256;
		int *v = realloc(f->v, cap * sizeof(*v));
		if (!v)
			return -2;
		f->v = v;
		f->cap = cap;
	}
	f->v[f->n] = fd;
	return (int32_t)f->n++;
}

/* Reading: every get checks the bounds; a short read sets err, and later gets give 0. */

struct rd {
	const unsigned char *p;
	size_t len, off;
	int err;
};

static void get(struct rd *r, void *out, size_t len)
{
	if (r->err || r->len - r->off < len) {
		r->err = -EPROTO;
		memset(out, 0, len);
		return;
	}
	memcpy(out, r->p + r->off, len);
	r->off += len;
}

static uint32_t get_u32(struct rd *r)
{
	uint32_t v;
	get(r, &v, sizeof(v));
	return v;
}

static uint64_t get_u64(struct rd *r)
{
	uint64_t v;
	get(r, &v, sizeof(v));
	return v;
}

static int32_t get_i32(struct rd *r)
{
	int32_t v;
	get(r, &v, sizeof(v));
	return v;
}

/* A length-prefixed byte string of at most max bytes: a pointer into the input. */
static const unsigned char *get_bytes(struct rd *r, uint32_t *len, uint32_t max)
{
	*len = get_u32(r);
	if (r->err || *len > max || r->len - r->off < *len) {
		r->err = -EPROTO;
		*len = 0;
		return NULL;
	}
	const unsigned char *p = r->p + r->off;
	r->off += *len;
	return p;
}

/* The offer. */

void kc_handover_offer_put(struct kc_hbuf *b, const struct kc_handover_offer *o)
{
	kc_hbuf_u32(b, o->format);
	put_i32(b, o->pid);
	kc_hbuf_bytes(b, o->args, o->args_len);
	kc_hbuf_bytes(b, o->cwd, strlen(o->cwd) + 1);
	kc_hbuf_bytes(b, o->init_in, o->init_in_len);
	kc_hbuf_bytes(b, o->init_out, o->init_out_len);
}

int kc_handover_offer_get(const unsigned char *p, size_t len, struct kc_handover_offer *o)
{
	struct rd r = {p, len, 0, 0};
	uint32_t n;
	memset(o, 0, sizeof(*o));
	o->format = get_u32(&r);
	o->pid = get_i32(&r);
	const unsigned char *args = get_bytes(&r, &o->args_len, 1u << 20);
	const unsigned char *cwd = get_bytes(&r, &n, 1u << 16);
	if (!r.err && (n == 0 || cwd[n - 1] != '\0' ||
		       (o->args_len && args[o->args_len - 1] != '\0')))
		r.err = -EPROTO;
	if (!r.err) {
		o->args = malloc(o->args_len + 1);
		o->cwd = strdup((const char *)cwd);
		if (!o->args || !o->cwd)
			r.err = -ENOMEM;
		else
			memcpy(o->args, args, o->args_len);
	}
	const unsigned char *in = get_bytes(&r, &o->init_in_len, KC_HANDOVER_INIT_MAX);
	if (in)
		memcpy(o->init_in, in, o->init_in_len);
	const unsigned char *out = get_bytes(&r, &o->init_out_len, KC_HANDOVER_INIT_MAX);
	if (out)
		memcpy(o->init_out, out, o->init_out_len);
	if (!r.err && r.off != len)
		r.err = -EPROTO;
	if (r.err)
		kc_handover_offer_free(o);
	return r.err;
}

void kc_handover_offer_free(struct kc_handover_offer *o)
{
	free(o->args);
	free(o->cwd);
	memset(o, 0, sizeof(*o));
}

/* The state. */

struct put_ctx {
	struct kc_hbuf *b;
	struct kc_hfds *fds;
	struct kc_inode_table *t;
	uint32_t n;
	char *why;
	size_t whylen;
};

static int put_inode(struct kc_inode *in, void *arg)
{
	struct put_ctx *c = arg;
	struct kc_hbuf *b = c->b;
	int32_t fd = fd_index(c->fds, in->fd), parent = fd_index(c->fds, in->parent_fd),
		cubin = fd_index(c->fds, in->cubin_fd);
	if (fd == -2 || parent == -2 || cubin == -2)
		return -ENOMEM;
	kc_hbuf_u32(b, in->slot);
	kc_hbuf_u32(b, in->gen);
	put_u64(b, in->nlookup);
	put_u64(b, (uint64_t)in->dev);
	put_u64(b, (uint64_t)in->ino);
	kc_hbuf_u32(b, (uint32_t)in->type);
	kc_hbuf_u32(b, (uint32_t)in->entry);
	kc_hbuf_u32(b, (uint32_t)in->role);
	kc_hbuf_u32(b, (uint32_t)in->staging);
	kc_hbuf_u32(b, (uint32_t)in->pending);
	put_u64(b, in->recipe_id);
	kc_hbuf_u32(b, (uint32_t)in->stored);
	put_u64(b, in->last_use);
	put_u64(b, in->dropped_use);
	put_u64(b, (uint64_t)in->entry_ino);
	kc_hbuf_u32(b, (uint32_t)in->write_failed);
	kc_hbuf_u32(b, (uint32_t)in->opens);
	kc_hbuf_u32(b, (uint32_t)in->unhashed);
	kc_hbuf_u32(b, (uint32_t)in->discarded);
	put_i32(b, fd);
	put_i32(b, parent);
	put_i32(b, cubin);
	c->n++;
	return b->err;
}

static int check_fh(struct kc_fh *fh, void *arg)
{
	struct put_ctx *c = arg;
	if (fh->kind != FH_STAGE)
		return 0;
	snprintf(c->why, c->whylen, "a %s is being staged through an open descriptor (its "
		 "writer's process %d): try again once it is closed", kc_role_name(fh->role),
		 (int)(fh->writer_tgid ? fh->writer_tgid : fh->creator_tgid));
	return -EBUSY;
}

static int put_fh(struct kc_fh *fh, void *arg)
{
	struct put_ctx *c = arg;
	struct kc_hbuf *b = c->b;
	int32_t fd = fd_index(c->fds, fh->fd);
	if (fd == -2)
		return -ENOMEM;
	put_u64(b, fh->id);
	kc_hbuf_u32(b, (uint32_t)fh->kind);
	put_u64(b, fh->in ? (uint64_t)kc_inode_ino(c->t, fh->in) : 0);
	put_i32(b, fd);
	kc_hbuf_bytes(b, fh->buf ? fh->buf : "", fh->buf ? fh->len : 0);
	c->n++;
	return b->err;
}

static int put_handle(uint64_t id, void *p, int kind, void *arg)
{
	struct put_ctx *c = arg;
	struct kc_hbuf *b = c->b;
	if (kind != KC_HANDLE_DIR)
		return 0;
	struct kc_dh *dh = p;
	int32_t fd = fd_index(c->fds, dh->fd);
	if (fd == -2)
		return -ENOMEM;
	put_u64(b, id);
	put_i32(b, fd);
	kc_hbuf_u32(b, (uint32_t)dh->n);
	for (size_t i = 0; i < dh->n; i++) {
		put_u64(b, (uint64_t)dh->items[i].ino);
		kc_hbuf_u32(b, dh->items[i].type);
		kc_hbuf_bytes(b, dh->items[i].name, strlen(dh->items[i].name) + 1);
	}
	c->n++;
	return b->err;
}

/* Put a count placeholder at b's end; returns its offset. */
static size_t count_at(struct kc_hbuf *b)
{
	size_t at = b->len;
	kc_hbuf_u32(b, 0);
	return at;
}

static void set_count(struct kc_hbuf *b, size_t at, uint32_t n)
{
	if (!b->err)
		memcpy(b->p + at, &n, sizeof(n));
}

int kc_handover_busy(struct kc_fs *fs, char *why, size_t whylen)
{
	struct put_ctx c = {NULL, NULL, &fs->inodes, 0, why, whylen};
	return kc_fh_foreach(check_fh, &c);
}

int kc_handover_state_put(struct kc_fs *fs, int fuse_fd, struct kc_hbuf *b, struct kc_hfds *fds,
			  char *why, size_t whylen)
{
	struct kc_inode_table *t = &fs->inodes;
	struct put_ctx c = {b, fds, t, 0, why, whylen};
	int err = kc_fh_foreach(check_fh, &c);
	if (err)
		return err;
	if (fd_index(fds, fuse_fd) != 0)
		return -ENOMEM;
	kc_hbuf_u32(b, STATE_MAGIC);
	uint32_t used = kc_inode_slots_used(t);
	kc_hbuf_u32(b, used);
	for (uint32_t s = 0; s < used; s++)
		kc_hbuf_u32(b, kc_inode_slot_gen(t, s));
	pthread_mutex_lock(&t->lock);
	put_u64(b, t->root.nlookup);
	pthread_mutex_unlock(&t->lock);

	size_t at = count_at(b);
	c.n = 0;
	err = kc_inode_foreach(t, put_inode, &c);
	set_count(b, at, c.n);
	at = count_at(b);
	c.n = 0;
	if (!err)
		err = kc_fh_foreach(put_fh, &c);
	set_count(b, at, c.n);
	at = count_at(b);
	c.n = 0;
	if (!err)
		err = kc_idtable_foreach(&fs->handles, put_handle, &c);
	set_count(b, at, c.n);
	if (!err)
		err = b->err;
	if (err == -ENOMEM)
		snprintf(why, whylen, "out of memory");
	return err;
}

/* The descriptor at index i, taken from fds (-1 there after); -1 for index -1; -2 for an
 * index out of range or taken twice. */
static int take_fd(int *fds, size_t nfds, int32_t i)
{
	if (i == -1)
		return -1;
	if (i < 0 || (size_t)i >= nfds || fds[i] < 0)
		return -2;
	int fd = fds[i];
	fds[i] = -1;
	return fd;
}

static int restore_inodes(struct kc_fs *fs, struct rd *r, int *fds, size_t nfds, char *why,
			  size_t whylen)
{
	struct kc_inode_table *t = &fs->inodes;
	uint32_t used = get_u32(r);
	if (r->err || used > KC_INODE_CHUNK * KC_INODE_CHUNKS || used > (r->len - r->off) / 4)
		return -EPROTO;
	uint32_t *gens = malloc(((size_t)used + 1) * sizeof(*gens));
	if (!gens)
		return -ENOMEM;
	for (uint32_t s = 0; s < used; s++)
		gens[s] = get_u32(r);
	uint64_t root_nlookup = get_u64(r);
	int err = r->err ? r->err : kc_inode_restore_slots(t, used, gens);
	free(gens);
	if (err)
		return err;
	pthread_mutex_lock(&t->lock);
	t->root.nlookup = root_nlookup;
	pthread_mutex_unlock(&t->lock);
	uint32_t n = get_u32(r);
	for (uint32_t i = 0; i < n && !r->err; i++) {
		struct kc_inode in = {0};
		in.slot = get_u32(r);
		in.gen = get_u32(r);
		in.nlookup = get_u64(r);
		in.dev = (dev_t)get_u64(r);
		in.ino = (ino_t)get_u64(r);
		in.type = (mode_t)get_u32(r);
		in.entry = (int)get_u32(r);
		in.role = (enum kc_role)get_u32(r);
		in.staging = (int)get_u32(r);
		in.pending = (int)get_u32(r);
		in.recipe_id = get_u64(r);
		in.stored = (int)get_u32(r);
		in.last_use = get_u64(r);
		in.dropped_use = get_u64(r);
		in.entry_ino = (ino_t)get_u64(r);
		in.write_failed = (int)get_u32(r);
		in.opens = (int)get_u32(r);
		in.unhashed = (int)get_u32(r);
		in.discarded = (int)get_u32(r);
		int32_t fi = get_i32(r), pi = get_i32(r), ci = get_i32(r);
		if (r->err)
			break;
		in.fd = take_fd(fds, nfds, fi);
		in.parent_fd = take_fd(fds, nfds, pi);
		in.cubin_fd = take_fd(fds, nfds, ci);
		if (in.fd < 0 || in.parent_fd == -2 || in.cubin_fd == -2) {
			snprintf(why, whylen, "inode %u.%u: a descriptor index that is not there",
				 in.slot, in.gen);
			if (in.fd >= 0)
				close(in.fd);
			if (in.parent_fd >= 0)
				close(in.parent_fd);
			if (in.cubin_fd >= 0)
				close(in.cubin_fd);
			return -EPROTO;
		}
		if (!kc_inode_restore(t, &in, &err)) {
			snprintf(why, whylen, "inode %u.%u: %s", in.slot, in.gen, strerror(-err));
			close(in.fd);
			if (in.parent_fd >= 0)
				close(in.parent_fd);
			if (in.cubin_fd >= 0)
				close(in.cubin_fd);
			return err == -ENOMEM ? err : -EPROTO;
		}
	}
	return r->err ? r->err : kc_inode_restore_done(t);
}

static int restore_fhs(struct kc_fs *fs, struct rd *r, int *fds, size_t nfds, char *why,
		       size_t whylen)
{
	uint32_t n = get_u32(r);
	for (uint32_t i = 0; i < n && !r->err; i++) {
		uint64_t id = get_u64(r);
		uint32_t kind = get_u32(r);
		uint64_t ino = get_u64(r);
		int32_t fi = get_i32(r);
		uint32_t len;
		const unsigned char *buf = get_bytes(r, &len, 1u << 30);
		if (r->err)
			break;
		struct kc_inode *in = ino ? kc_inode_get(&fs->inodes, ino) : NULL;
		int fd = take_fd(fds, nfds, fi);
		if ((kind != FH_PLAIN && kind != FH_STATS) || fd == -2 || (ino && !in)) {
			snprintf(why, whylen, "file handle %llx: a kind, descriptor or inode that "
				 "is not there", (unsigned long long)id);
			if (fd >= 0)
				close(fd);
			return -EPROTO;
		}
		struct kc_fh *fh = kc_fh_adopt(fs, id, (enum fh_kind)kind, fd);
		if (!fh) {
			snprintf(why, whylen, "file handle %llx: cannot be put back",
				 (unsigned long long)id);
			if (fd >= 0)
				close(fd);
			return -EPROTO;
		}
		fh->in = in; /* its count is in the inode's opens, carried as they were */
		if (len && !(fh->buf = malloc(len)))
			return -ENOMEM;
		if (len) {
			memcpy(fh->buf, buf, len);
			fh->len = len;
		}
	}
	return r->err;
}

static int restore_dhs(struct kc_fs *fs, struct rd *r, int *fds, size_t nfds, char *why,
		       size_t whylen)
{
	uint32_t n = get_u32(r);
	for (uint32_t i = 0; i < n && !r->err; i++) {
		uint64_t id = get_u64(r);
		int32_t fi = get_i32(r);
		uint32_t items = get_u32(r);
		if (r->err || items > (r->len - r->off) / 16)
			return -EPROTO;
		struct kc_dh *dh = calloc(1, sizeof(*dh));
		if (!dh || (items && !(dh->items = calloc(items, sizeof(*dh->items))))) {
			free(dh);
			return -ENOMEM;
		}
		dh->fd = take_fd(fds, nfds, fi);
		for (uint32_t k = 0; k < items && !r->err; k++) {
			dh->items[k].ino = (ino_t)get_u64(r);
			dh->items[k].type = (unsigned char)get_u32(r);
			uint32_t len;
			const unsigned char *name = get_bytes(r, &len, 4096);
			if (!r->err && (len == 0 || name[len - 1] != '\0'))
				r->err = -EPROTO;
			if (!r->err && !(dh->items[k].name = strdup((const char *)name)))
				r->err = -ENOMEM;
			if (!r->err)
				dh->n = k + 1;
		}
		if (r->err || dh->fd == -2 || kc_idtable_put(&fs->handles, id, dh, KC_HANDLE_DIR)) {
			snprintf(why, whylen, "directory handle %llx cannot be put back",
				 (unsigned long long)id);
			for (size_t k = 0; k < dh->n; k++)
				free(dh->items[k].name);
			free(dh->items);
			if (dh->fd >= 0)
				close(dh->fd);
			free(dh);
			return r->err ? r->err : -EPROTO;
		}
	}
	return r->err;
}

int kc_handover_state_restore(struct kc_fs *fs, const unsigned char *p, size_t len, int *fds,
			      size_t nfds, int *fuse_fd, char *why, size_t whylen)
{
	struct rd r = {p, len, 0, 0};
	int err = 0;
	*fuse_fd = nfds ? take_fd(fds, nfds, 0) : -2;
	if (get_u32(&r) != STATE_MAGIC || *fuse_fd < 0) {
		snprintf(why, whylen, "not a kcachefs state, or no /dev/fuse descriptor");
		err = -EPROTO;
	}
	if (!err)
		err = restore_inodes(fs, &r, fds, nfds, why, whylen);
	if (!err)
		err = restore_fhs(fs, &r, fds, nfds, why, whylen);
	if (!err)
		err = restore_dhs(fs, &r, fds, nfds, why, whylen);
	if (!err && r.off != len)
		err = -EPROTO;
	if (err && !why[0])
		snprintf(why, whylen, "%s", err == -ENOMEM ? "out of memory"
							    : "the state's bytes are malformed");
	for (size_t i = 0; i < nfds; i++) /* those no record took */
		if (fds[i] >= 0) {
			close(fds[i]);
			fds[i] = -1;
		}
	return err;
}
