/* ahead.c - compile ahead: the histories of what clients asked under each context, and the
 * compiles of another context's history started before a client asks (cache_i.h).
 *
 * A trigger is a client's compile whose shape (code.h) is in the history of another
 * context: an image's kernels asked again under new headers. The other recipes of that
 * history are planned under the new context's include roots and queued, each an entry of
 * .kcachefs/ahead/entries/<code key> holding its code form and its moved flags, compiled as
 * any entry is (job.c's run_compile, the same checks and publish; with a cluster store under
 * the same key and lease a client's compile of that code takes). A client's later compile of
 * one finds it by its code key (kc_cache_ahead_wait): published, it is copied into the
 * client's entry; running, the client waits for that one compile; queued, it is dropped and
 * the client compiles at once.
 *
 * Demand first: compiles ahead have workers and slots of their own (-o jobs each), start
 * only while a job slot is idle (no client's compile queued, fewer than jobs compiles
 * running in all), and run in the idle scheduling class; a client that waits for one
 * promotes it to the normal class.
 */
#define _GNU_SOURCE
#include "cache_i.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "history.h"
#include "io.h"
#include "remote_object.h"
#include "log.h"
#include "util.h"

#define AHEAD_DIR KC_STATE_DIR "/ahead"
#define AHEAD_HISTORIES 16   /* histories kept (the newest; a file each) */
#define AHEAD_KEEP 1024      /* entries compiled ahead kept across starts (the newest) */
#define AHEAD_ITEMS_MAX 4096 /* items remembered in memory; finished ones go first */

enum item_state { QUEUED, RUNNING, DONE, FAILED, DROPPED };

struct ahead_item {
	struct ahead_item *next;
	struct kc_cache *c;
	char code[KC_SHA256_HEXLEN + 1];
	enum item_state state;
	struct kc_flight_key key; /* its entry, once RUNNING */
	char *source, *flags;     /* what to compile, owned until begun */
	size_t source_len, flags_len;
	int used;                 /* a client's compile took its cubin */
	double seconds;           /* its compiler run */
	atomic_int group, promote; /* compile.h */
};

struct context {
	struct kc_history h;
	unsigned long stamp;   /* the order contexts were last added to (newest: highest) */
	char from[KC_SHA256_HEXLEN + 1]; /* the context it was compiled ahead from, or "" */
	int put_queued;        /* a put of it to the cluster store is queued */
	int unshared;          /* it holds recipes the store's copy may lack */
	int store_asked;       /* the store's histories were read for it (once) */
};

struct kc_ahead {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	pthread_mutex_t save_lock; /* orders the saves of histories */
	struct kc_pool *pool;
	struct kc_slots slots;
	int entries_fd, history_fd;
	struct context ctx[AHEAD_HISTORIES];
	size_t nctx;
	unsigned long stamp;
	struct ahead_item *items;
	size_t nitems;
	unsigned running;
	int stopping;
};

static int ts_cmp(const struct timespec *x, const struct timespec *y)
{
	return x->tv_sec != y->tv_sec ? (x->tv_sec < y->tv_sec ? -1 : 1)
	       : x->tv_nsec != y->tv_nsec ? (x->tv_nsec < y->tv_nsec ? -1 : 1) : 0;
}

/* The regular file dir/name, at most max bytes, into *data / *len. Returns 0 or -errno. */
static int read_file_at(int dir, const char *name, size_t max, char **data, size_t *len)
{
	int fd = openat(dir, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	int err = kc_read_all(fd, max, data, len);
	close(fd);
	return err;
}

/* The shapes of h's recipes under the mount's config; a recipe that has none (its record
 * was made by another version, or a forged one) makes the history refused. */
static int shape_all(struct kc_cache *c, struct kc_history *h)
{
	char compiler[KC_COMPILER_ID_MAX];
	kc_config_compiler_id(c->cfg, compiler);
	for (size_t i = 0; i < h->n; i++) {
		struct kc_code k;
		char *blank = NULL;
		size_t blen = 0;
		int r = kc_code_keys(h->r[i].source, h->r[i].source_len, h->r[i].flags,
				     h->r[i].flags_len, c->cfg, compiler, &k, &blank, &blen);
		/* a history holds code forms: a source with a comment was not written by a mount */
		int same = r == 1 && blen == h->r[i].source_len &&
			   memcmp(blank, h->r[i].source, blen) == 0;
		free(blank);
		if (r < 0)
			return r;
		if (!same)
			return -EBADMSG;
		memcpy(h->r[i].shape, k.shape, sizeof(k.shape));
	}
	return 0;
}

static struct context *find_context(struct kc_ahead *a, const char *context)
{
	for (size_t i = 0; i < a->nctx; i++)
		if (strcmp(a->ctx[i].h.context, context) == 0)
			return &a->ctx[i];
	return NULL;
}

/* A context for a new history: a free one, or the oldest's, whose file is removed. */
static struct context *new_context(struct kc_ahead *a, const char *context)
{
	struct context *x;
	if (a->nctx < AHEAD_HISTORIES) {
		x = &a->ctx[a->nctx++];
	} else {
		x = &a->ctx[0];
		for (size_t i = 1; i < a->nctx; i++)
			if (a->ctx[i].stamp < x->stamp)
				x = &a->ctx[i];
		unlinkat(a->history_fd, x->h.context, 0);
		kc_history_free(&x->h);
	}
	memset(x, 0, sizeof(*x));
	kc_history_init(&x->h, context);
	x->stamp = ++a->stamp;
	return x;
}

/* Load the histories in .kcachefs/ahead/history/, the newest AHEAD_HISTORIES (by mtime);
 * a refused file is said and removed. */
static void load_histories(struct kc_cache *c, struct kc_ahead *a)
{
	struct {
		char name[KC_SHA256_HEXLEN + 1];
		struct timespec mtime;
	} found[AHEAD_HISTORIES * 2];
	size_t n = 0;
	int dfd = fcntl(a->history_fd, F_DUPFD_CLOEXEC, 0);
	DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
	struct dirent *e;
	while (d && (e = readdir(d))) {
		struct stat st;
		if (e->d_name[0] == '.' || strlen(e->d_name) != KC_SHA256_HEXLEN ||
		    fstatat(a->history_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
		    !S_ISREG(st.st_mode))
			continue;
		size_t at = n; /* keep the newest: replace the oldest when full */
		if (n == sizeof(found) / sizeof(*found)) {
			at = 0;
			for (size_t i = 1; i < n; i++)
				if (ts_cmp(&found[i].mtime, &found[at].mtime) < 0)
					at = i;
			if (ts_cmp(&st.st_mtim, &found[at].mtime) < 0)
				continue;
		} else {
			n++;
		}
		snprintf(found[at].name, sizeof(found[at].name), "%s", e->d_name);
		found[at].mtime = st.st_mtim;
	}
	if (d)
		closedir(d);
	else if (dfd >= 0)
		close(dfd);
	/* oldest first, so that the newest get the highest stamps */
	for (size_t i = 0; i < n; i++)
		for (size_t k = i + 1; k < n; k++)
			if (ts_cmp(&found[k].mtime, &found[i].mtime) < 0) {
				__typeof__(found[0]) t = found[i];
				found[i] = found[k];
				found[k] = t;
			}
	for (size_t i = 0; i < n; i++) {
		char *data = NULL, why[300] = "";
		size_t len = 0;
		struct kc_history h;
		int err = read_file_at(a->history_fd, found[i].name, KC_HISTORY_MAX_BYTES, &data,
					  &len);
		if (!err && (err = kc_history_parse(data, len, found[i].name, &h, why,
						    sizeof(why))) == 0 &&
		    (err = shape_all(c, &h)) != 0) {
			snprintf(why, sizeof(why), "a recipe in it is not a code form");
			kc_history_free(&h);
		}
		free(data);
		if (err) {
			kc_log(KC_LOG_WARN, "compile ahead: history %.16s not loaded (%s): removed",
			       found[i].name, why[0] ? why : strerror(-err));
			unlinkat(a->history_fd, found[i].name, 0);
			continue;
		}
		struct context *x = new_context(a, h.context);
		kc_history_free(&x->h);
		x->h = h;
	}
}

/* Remove the entries compiled ahead that hold no cubin (a compile cut by a stop), and past
 * AHEAD_KEEP the oldest. */
static void tidy_entries(struct kc_cache *c, struct kc_ahead *a)
{
	char path[4200];
	size_t n = 0, cap = 0;
	struct kept {
		char name[KC_SHA256_HEXLEN + 1];
		struct timespec mtime;
	} *all = NULL;
	int dfd = fcntl(a->entries_fd, F_DUPFD_CLOEXEC, 0);
	DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
	struct dirent *e;
	while (d && (e = readdir(d))) {
		struct stat st;
		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "%s/%s/%s", c->store->root_path, AHEAD_DIR "/entries",
			 e->d_name);
		char cubin[300];
		snprintf(cubin, sizeof(cubin), "%s/" KC_CUBIN_NAME, e->d_name);
		if (strlen(e->d_name) != KC_SHA256_HEXLEN ||
		    fstatat(a->entries_fd, cubin, &st, AT_SYMLINK_NOFOLLOW) != 0) {
			kc_store_remove_tree(path);
			continue;
		}
		if (n == cap) {
			struct kept *m = realloc(all, (cap = cap ? cap * 2 : 64) * sizeof(*all));
			if (!m)
				break;
			all = m;
		}
		snprintf(all[n].name, sizeof(all[n].name), "%s", e->d_name);
		all[n++].mtime = st.st_mtim;
	}
	if (d)
		closedir(d);
	else if (dfd >= 0)
		close(dfd);
	while (n > AHEAD_KEEP) {
		size_t old = 0;
		for (size_t i = 1; i < n; i++)
			if (ts_cmp(&all[i].mtime, &all[old].mtime) < 0)
				old = i;
		snprintf(path, sizeof(path), "%s/%s/%s", c->store->root_path, AHEAD_DIR "/entries",
			 all[old].name);
		kc_store_remove_tree(path);
		all[old] = all[--n];
	}
	free(all);
}

/* Merge a history record of context (data/len, from the cluster store: nothing in it
 * trusted) into this node's: its recipes this node's lacks are added, in its order.
 * Returns 0, or -EBADMSG (refused: logged). */
static int merge_history(struct kc_cache *c, struct kc_ahead *a, const char *context,
			 const char *data, size_t len)
{
	struct kc_history h;
	char why[300] = "";
	int err = kc_history_parse(data, len, context, &h, why, sizeof(why));
	if (!err && (err = shape_all(c, &h)) != 0) {
		snprintf(why, sizeof(why), "a recipe in it is not a code form");
		kc_history_free(&h);
	}
	if (err) {
		kc_log(KC_LOG_WARN, "compile ahead: the cluster store's history %.16s refused: %s",
		       context, why[0] ? why : strerror(-err));
		atomic_fetch_add(&c->stats.remote_rejected, 1);
		return -EBADMSG;
	}
	pthread_mutex_lock(&a->lock);
	struct context *x = find_context(a, context);
	if (!x)
		x = new_context(a, context);
	for (size_t i = 0; i < h.n; i++)
		kc_history_add(&x->h, h.r[i].flags, h.r[i].flags_len, h.r[i].source,
			       h.r[i].source_len, h.r[i].shape);
	x->store_asked = 1;
	pthread_mutex_unlock(&a->lock);
	kc_history_free(&h);
	return 0;
}

/* Read the histories the cluster stored last (oldest first, so that the newest are the
 * newest here too) into this node's. Returns how many were merged. */
static unsigned load_store_histories(struct kc_cache *c, struct kc_ahead *a)
{
	char list[KC_HISTORIES_PER_KEY][KC_SHA256_HEXLEN + 1];
	size_t n = 0;
	unsigned merged = 0;
	pthread_mutex_lock(&a->lock); /* what exists now has seen the store's histories */
	for (size_t i = 0; i < a->nctx; i++)
		a->ctx[i].store_asked = 1;
	pthread_mutex_unlock(&a->lock);
	if (kc_remote_tier_histories(c->remote, list, KC_HISTORIES_PER_KEY, &n) != 0)
		return 0;
	while (n-- > 0) {
		char *data = NULL;
		size_t len = 0;
		if (kc_remote_tier_history_get(c->remote, list[n], &data, &len) == 0 &&
		    merge_history(c, a, list[n], data, len) == 0)
			merged++;
		free(data);
	}
	return merged;
}

static void load_store_job(void *arg)
{
	struct kc_cache *c = arg;
	unsigned n = load_store_histories(c, c->ahead);
	kc_log(KC_LOG_INFO, "compile ahead: %u histories read from the cluster store", n);
}

/* The cluster's part of a history that grew: the store's record of it (other nodes of the
 * image add theirs) merged in, and the whole put back. arg: its context (malloc'd). */
static void put_job(void *arg)
{
	char *context = arg;
	struct kc_cache *c = *(struct kc_cache **)(context + KC_SHA256_HEXLEN + 1);
	struct kc_ahead *a = c->ahead;
	char *data = NULL;
	size_t len = 0;
	pthread_mutex_lock(&a->lock);
	struct context *x = find_context(a, context);
	if (x)
		x->put_queued = x->unshared = 0;
	pthread_mutex_unlock(&a->lock);
	if (kc_remote_tier_history_get(c->remote, context, &data, &len) == 0)
		merge_history(c, a, context, data, len);
	free(data);
	data = NULL;
	pthread_mutex_lock(&a->lock);
	x = find_context(a, context);
	int err = x ? kc_history_format(&x->h, &data, &len) : -ENOENT;
	pthread_mutex_unlock(&a->lock);
	if (!err)
		err = kc_remote_tier_history_put(c->remote, context, data, len);
	if (err && err != -EROFS && err != -ENOENT)
		kc_log(KC_LOG_WARN, "compile ahead: history %.16s not stored in the cluster store: "
		       "%s", context, strerror(-err));
	free(data);
	free(context);
}

/* Queue put_job for context unless one is queued. a->lock held. */
static void queue_put(struct kc_cache *c, struct context *x)
{
	if (!c->remote || !c->shares || x->put_queued || !x->unshared)
		return;
	char *arg = malloc(KC_SHA256_HEXLEN + 1 + sizeof(c));
	if (!arg)
		return;
	memcpy(arg, x->h.context, KC_SHA256_HEXLEN + 1);
	memcpy(arg + KC_SHA256_HEXLEN + 1, &c, sizeof(c));
	if (kc_pool_submit(c->shares, put_job, arg) == 0)
		x->put_queued = 1;
	else
		free(arg);
}

int kc_cache_ahead_open(struct kc_cache *c)
{
	if (!c->cfg->ahead)
		return 0;
	struct kc_ahead *a = calloc(1, sizeof(*a));
	if (!a)
		return -ENOMEM;
	a->entries_fd = a->history_fd = -1;
	int err = 0;
	if ((mkdirat(c->store->root_fd, AHEAD_DIR, 0700) != 0 && errno != EEXIST) ||
	    (mkdirat(c->store->root_fd, AHEAD_DIR "/entries", 0700) != 0 && errno != EEXIST) ||
	    (mkdirat(c->store->root_fd, AHEAD_DIR "/history", 0700) != 0 && errno != EEXIST) ||
	    (a->entries_fd = openat(c->store->root_fd, AHEAD_DIR "/entries",
				    O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)) < 0 ||
	    (a->history_fd = openat(c->store->root_fd, AHEAD_DIR "/history",
				    O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)) < 0)
		err = -errno;
	if (!err && !(a->pool = kc_pool_create(c->cfg->jobs)))
		err = -errno;
	if (err) {
		kc_log(KC_LOG_WARN, "compile ahead is off: %s/%s: %s", c->store->root_path,
		       AHEAD_DIR, strerror(-err));
		if (a->entries_fd >= 0)
			close(a->entries_fd);
		if (a->history_fd >= 0)
			close(a->history_fd);
		free(a);
		return err;
	}
	pthread_mutex_init(&a->lock, NULL);
	pthread_mutex_init(&a->save_lock, NULL);
	pthread_cond_init(&a->cond, NULL);
	kc_slots_init(&a->slots, c->cfg->jobs);
	load_histories(c, a);
	tidy_entries(c, a);
	c->ahead = a;
	if (c->remote) /* behind the mount: a first compile that comes first reads them itself */
		kc_pool_submit(a->pool, load_store_job, c);
	return 0;
}

void kc_cache_ahead_stop(struct kc_cache *c)
{
	struct kc_ahead *a = c->ahead;
	if (!a)
		return;
	pthread_mutex_lock(&a->lock);
	a->stopping = 1;
	pthread_cond_broadcast(&a->cond);
	pthread_mutex_unlock(&a->lock);
}

static void item_free(struct ahead_item *it)
{
	free(it->source);
	free(it->flags);
	free(it);
}

void kc_cache_ahead_drain(struct kc_cache *c)
{
	struct kc_ahead *a = c->ahead;
	if (!a || !a->pool)
		return;
	kc_cache_ahead_stop(c);
	kc_pool_destroy(a->pool); /* what is queued returns at once: stopping */
	a->pool = NULL;
}

void kc_cache_ahead_close(struct kc_cache *c)
{
	struct kc_ahead *a = c->ahead;
	if (!a)
		return;
	kc_cache_ahead_drain(c);
	while (a->items) {
		struct ahead_item *it = a->items;
		a->items = it->next;
		item_free(it);
	}
	for (size_t i = 0; i < a->nctx; i++)
		kc_history_free(&a->ctx[i].h);
	kc_slots_destroy(&a->slots);
	close(a->entries_fd);
	close(a->history_fd);
	pthread_mutex_destroy(&a->lock);
	pthread_mutex_destroy(&a->save_lock);
	pthread_cond_destroy(&a->cond);
	free(a);
	c->ahead = NULL;
}

static struct ahead_item *find_item(struct kc_ahead *a, const char *code)
{
	for (struct ahead_item *it = a->items; it; it = it->next)
		if (strcmp(it->code, code) == 0)
			return it;
	return NULL;
}

/* Forget finished items past AHEAD_ITEMS_MAX (their entries stay on disk). */
static void prune_items(struct kc_ahead *a)
{
	for (struct ahead_item **p = &a->items; *p && a->nitems > AHEAD_ITEMS_MAX;) {
		struct ahead_item *it = *p;
		if (it->state == QUEUED || it->state == RUNNING) {
			p = &it->next;
			continue;
		}
		*p = it->next;
		item_free(it);
		a->nitems--;
	}
}

/* Whether the entry of code holds a published cubin. */
static int entry_published(struct kc_ahead *a, const char *code)
{
	char cubin[KC_SHA256_HEXLEN + 16];
	struct stat st;
	snprintf(cubin, sizeof(cubin), "%s/" KC_CUBIN_NAME, code);
	return fstatat(a->entries_fd, cubin, &st, AT_SYMLINK_NOFOLLOW) == 0;
}

/* Save x's history (its file, whole). save_lock orders saves: the last one written holds
 * the last state. */
static void save_history(struct kc_cache *c, struct kc_ahead *a, const char *context)
{
	char *data = NULL;
	size_t len = 0;
	int err = -ENOENT;
	pthread_mutex_lock(&a->save_lock);
	pthread_mutex_lock(&a->lock);
	struct context *x = find_context(a, context);
	if (x)
		err = kc_history_format(&x->h, &data, &len);
	pthread_mutex_unlock(&a->lock);
	if (!err)
		err = kc_store_write_atomic(c->store, a->history_fd, context, data, len);
	pthread_mutex_unlock(&a->save_lock);
	if (err && err != -ENOENT)
		kc_log(KC_LOG_WARN, "compile ahead: cannot save history %.16s: %s", context,
		       strerror(-err));
	free(data);
}

/* Plan the recipes of from's history under the include roots of r (a recipe of x's
 * context), but the one of shape skip and those x asked already: new QUEUED items at the
 * head of a->items, the last planned first. Returns how many. */
static unsigned plan(struct kc_cache *c, struct kc_ahead *a, struct context *from,
		     struct context *x, const struct kc_recipe *r, const char *skip)
{
	char compiler[KC_COMPILER_ID_MAX];
	unsigned n = 0;
	kc_config_compiler_id(c->cfg, compiler);
	for (size_t i = 0; i < from->h.n && n < c->cfg->ahead; i++) {
		struct kc_history_recipe *hr = &from->h.r[i];
		if (strcmp(hr->shape, skip) == 0 || kc_history_find(&x->h, hr->shape) >= 0)
			continue; /* the trigger, or asked here already */
		char *flags = NULL;
		size_t flags_len = 0;
		struct kc_code k;
		if (kc_code_move_roots(hr->flags, hr->flags_len, r->flags, r->flags_len, &flags,
				       &flags_len) != 1)
			continue;
		if (kc_code_keys(hr->source, hr->source_len, flags, flags_len, c->cfg, compiler, &k,
				 NULL, NULL) != 1 ||
		    strcmp(k.context, x->h.context) != 0 || find_item(a, k.code) ||
		    entry_published(a, k.code)) {
			free(flags);
			continue;
		}
		struct ahead_item *it = calloc(1, sizeof(*it));
		if (it)
			it->source = malloc(hr->source_len + 1);
		if (!it || !it->source) {
			free(it);
			free(flags);
			break;
		}
		memcpy(it->source, hr->source, hr->source_len + 1);
		it->source_len = hr->source_len;
		it->flags = flags;
		it->flags_len = flags_len;
		it->c = c;
		memcpy(it->code, k.code, sizeof(k.code));
		it->state = QUEUED;
		it->next = a->items;
		a->items = it;
		a->nitems++;
		n++;
	}
	return n;
}

/* The newest history other than x's that holds shape, unless x triggered once already.
 * a->lock held. */
static struct context *trigger_of(struct kc_ahead *a, struct context *x, const char *shape)
{
	struct context *from = NULL;
	for (size_t i = 0; !x->from[0] && i < a->nctx; i++) {
		struct context *o = &a->ctx[i];
		if (o != x && (!from || o->stamp > from->stamp) &&
		    kc_history_find(&o->h, shape) >= 0)
			from = o;
	}
	return from;
}

void kc_cache_ahead_note(struct kc_cache *c, const struct kc_recipe *r,
			 const struct kc_code *k, const char *blank, size_t blen, kc_job_fn run)
{
	struct kc_ahead *a = c->ahead;
	if (!a)
		return;
	pthread_mutex_lock(&a->lock);
	struct context *x = find_context(a, k->context);
	if (!x)
		x = new_context(a, k->context);
	x->stamp = ++a->stamp;
	int added = kc_history_add(&x->h, r->flags, r->flags_len, blank, blen, k->shape);
	x->unshared |= added == 1;
	struct context *from = trigger_of(a, x, k->shape);
	if (!from && !x->from[0] && c->remote && !x->store_asked) {
		/* A context new here, which no history of this node's knows: the cluster may
		 * have stored one since the start (once per context: a few gets). */
		x->store_asked = 1;
		char ctx[KC_SHA256_HEXLEN + 1];
		memcpy(ctx, k->context, sizeof(ctx));
		pthread_mutex_unlock(&a->lock);
		load_store_histories(c, a);
		pthread_mutex_lock(&a->lock);
		x = find_context(a, ctx);
		if (!x) { /* pushed out meanwhile: it was the oldest of AHEAD_HISTORIES */
			pthread_mutex_unlock(&a->lock);
			return;
		}
		from = trigger_of(a, x, k->shape);
	}
	struct ahead_item *first = a->items;
	unsigned planned = 0;
	char from_ctx[KC_SHA256_HEXLEN + 1] = "";
	size_t from_n = 0;
	if (from) {
		memcpy(x->from, from->h.context, sizeof(x->from));
		memcpy(from_ctx, from->h.context, sizeof(from_ctx));
		from_n = from->h.n;
		planned = plan(c, a, from, x, r, k->shape);
		atomic_fetch_add(&c->stats.ahead_triggers, 1);
	}
	/* the items planned now are the first `planned` of the list, newest first: queue them
	 * oldest first, in the order the history asked them */
	struct ahead_item *queue[KC_HISTORY_MAX_RECIPES];
	unsigned q = 0;
	for (struct ahead_item *it = a->items; it != first && q < planned; it = it->next)
		queue[q++] = it;
	prune_items(a);
	pthread_mutex_unlock(&a->lock);
	if (from)
		kc_log(KC_LOG_INFO, "compile ahead: recipe %.16s was asked under context %.16s, "
		       "and under %.16s before with %zu others: %u of them compiled ahead now, "
		       "under this context's headers", r->hash, k->context, from_ctx,
		       from_n ? from_n - 1 : 0, planned);
	while (q > 0) {
		struct ahead_item *it = queue[--q];
		if (kc_pool_submit(a->pool, run, it) != 0) {
			pthread_mutex_lock(&a->lock);
			it->state = DROPPED;
			pthread_mutex_unlock(&a->lock);
		}
	}
	if (added == 1)
		save_history(c, a, k->context);
}

void kc_cache_ahead_share(struct kc_cache *c, const char *context)
{
	struct kc_ahead *a = c->ahead;
	if (!a || !c->remote)
		return;
	pthread_mutex_lock(&a->lock);
	struct context *x = find_context(a, context);
	if (x)
		queue_put(c, x);
	pthread_mutex_unlock(&a->lock);
}

/* Whether the entry compiled ahead behind fd holds a recipe whose code key is code, its
 * name: its cubin was checked against that recipe, so a directory renamed over another
 * code's name (the backing directory is root's, but is written to) is not taken for it.
 * One that is not is said and removed. */
static int entry_is_code(struct kc_cache *c, int fd, const char *code)
{
	struct kc_recipe r;
	struct kc_code k;
	char compiler[KC_COMPILER_ID_MAX];
	kc_config_compiler_id(c->cfg, compiler);
	int loaded = kc_recipe_load(fd, c->cfg, &r) == 0;
	int ok = loaded && kc_code_keys(r.source, r.source_len, r.flags, r.flags_len, c->cfg,
					compiler, &k, NULL, NULL) == 1 &&
		 strcmp(k.code, code) == 0;
	if (loaded)
		kc_recipe_free(&r);
	if (ok)
		return 1;
	char path[4200];
	snprintf(path, sizeof(path), "%s/%s/%s", c->store->root_path, AHEAD_DIR "/entries", code);
	kc_log(KC_LOG_WARN, "compile ahead: %s holds the recipe of another code key: removed, "
	       "not served", path);
	kc_store_remove_tree(path);
	return 0;
}

/* A client's compile waiting for a compile ahead (kc_cache_ahead_wait). */
struct blocking {
	struct kc_waiter w;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	int done;
};

static void blocking_done(struct kc_waiter *w, int result)
{
	struct blocking *b = (struct blocking *)w;
	(void)result; /* the entry itself says whether it was published */
	pthread_mutex_lock(&b->lock);
	b->done = 1;
	pthread_cond_signal(&b->cond);
	pthread_mutex_unlock(&b->lock);
}

int kc_cache_ahead_wait(struct kc_cache *c, const char *code)
{
	struct kc_ahead *a = c->ahead;
	if (!a)
		return -1;
	struct blocking b = {.w = {.done = blocking_done, .internal = 1}, .done = 0};
	int joined = 0;
	pthread_mutex_init(&b.lock, NULL);
	pthread_cond_init(&b.cond, NULL);
	pthread_mutex_lock(&a->lock);
	struct ahead_item *it = find_item(a, code);
	if (it && it->state == QUEUED) {
		it->state = DROPPED; /* the client's compile runs now, not later a second time */
		pthread_cond_broadcast(&a->cond);
	} else if (it && it->state == RUNNING) {
		atomic_store(&it->promote, 1); /* a client waits: it is no idle work now */
		kc_compile_promote(atomic_load(&it->group));
		joined = kc_flight_join_running(&c->flights, &it->key, &b.w) == KC_FLIGHT_JOINED;
	}
	pthread_mutex_unlock(&a->lock);
	if (joined) {
		pthread_mutex_lock(&b.lock);
		while (!b.done)
			pthread_cond_wait(&b.cond, &b.lock);
		pthread_mutex_unlock(&b.lock);
	}
	pthread_mutex_destroy(&b.lock);
	pthread_cond_destroy(&b.cond);
	int fd = openat(a->entries_fd, code, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (fd >= 0 && (kc_cache_check_published(c, fd) != 0 || !entry_is_code(c, fd, code))) {
		close(fd);
		fd = -1;
	}
	return fd;
}

void kc_cache_ahead_used(struct kc_cache *c, const char *code)
{
	struct kc_ahead *a = c->ahead;
	if (!a)
		return;
	pthread_mutex_lock(&a->lock);
	struct ahead_item *it = find_item(a, code);
	if (it)
		it->used = 1;
	pthread_mutex_unlock(&a->lock);
	atomic_fetch_add(&c->stats.ahead_used, 1);
}

/* Whether a job slot is idle for a compile ahead now: no client's compile waits for one,
 * and fewer than -o jobs compiles run in all. a->lock held. */
static int slot_idle(struct kc_cache *c, struct kc_ahead *a)
{
	unsigned waiting = 0, running = 0;
	if (kc_cache_job_slots(c))
		kc_slots_load(kc_cache_job_slots(c), &waiting, &running);
	else
		kc_pool_load(c->pool, &waiting, &running);
	return waiting == 0 && running + a->running < c->cfg->jobs;
}

static int recheck_none(void *arg)
{
	(void)arg;
	return 0;
}

/* Make the entry of it (its kernel.cu and kernel.flags, written whole before they get
 * their names). Returns an O_PATH fd on it, or -errno. */
static int make_entry(struct kc_cache *c, struct kc_ahead *a, struct ahead_item *it)
{
	char path[4200];
	snprintf(path, sizeof(path), "%s/%s/%s", c->store->root_path, AHEAD_DIR "/entries",
		 it->code);
	kc_store_remove_tree(path); /* one a stop cut, or a failed one's */
	if (mkdirat(a->entries_fd, it->code, 0700) != 0)
		return -errno;
	int dfd = openat(a->entries_fd, it->code, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (dfd < 0)
		return -errno;
	int err = kc_store_write_atomic(c->store, dfd, KC_SOURCE_NAME, it->source, it->source_len);
	if (!err)
		err = kc_store_write_atomic(c->store, dfd, KC_FLAGS_NAME, it->flags, it->flags_len);
	if (err) {
		close(dfd);
		return err;
	}
	return dfd;
}

struct compile_job *kc_cache_ahead_begin(struct ahead_item *it)
{
	struct kc_cache *c = it->c;
	struct kc_ahead *a = c->ahead;
	pthread_mutex_lock(&a->lock);
	while (it->state == QUEUED && !a->stopping && !slot_idle(c, a))
		kc_cond_wait_briefly(&a->cond, &a->lock);
	int go = it->state == QUEUED && !a->stopping;
	pthread_mutex_unlock(&a->lock);
	if (!go)
		return NULL;
	struct compile_job *j = calloc(1, sizeof(*j));
	int fd = j ? make_entry(c, a, it) : -ENOMEM;
	struct stat st;
	int err = fd < 0 ? fd : fstat(fd, &st) != 0 ? -errno : kc_recipe_load(fd, c->cfg, &j->recipe);
	if (err) {
		kc_log(KC_LOG_WARN, "compile ahead: %.16s not compiled: its entry: %s", it->code,
		       strerror(-err));
		if (fd >= 0)
			close(fd);
		free(j);
		pthread_mutex_lock(&a->lock);
		it->state = FAILED;
		pthread_mutex_unlock(&a->lock);
		atomic_fetch_add(&c->stats.ahead_failures, 1);
		return NULL;
	}
	j->c = c;
	j->key = (struct kc_flight_key){st.st_dev, st.st_ino};
	j->entry_fd = fd;
	j->ahead = it;
	j->share_fd = -1;
	j->slots = kc_cache_job_slots(c) ? &a->slots : NULL;
	j->group = &it->group;
	j->promote = &it->promote;
	pthread_mutex_lock(&a->lock);
	/* a client's compile may have taken it while the entry was made */
	int r = it->state == QUEUED && !a->stopping
			? kc_flight_join(&c->flights, &j->key, NULL, recheck_none, NULL)
			: 0;
	if (r == KC_FLIGHT_LEADER) {
		it->state = RUNNING;
		it->key = j->key;
		a->running++;
		free(it->source);
		free(it->flags);
		it->source = it->flags = NULL;
	} else if (it->state == QUEUED) {
		it->state = DROPPED;
	}
	pthread_mutex_unlock(&a->lock);
	if (r != KC_FLIGHT_LEADER) {
		close(fd);
		kc_recipe_free(&j->recipe);
		free(j);
		return NULL;
	}
	return j;
}

void kc_cache_ahead_end(struct kc_cache *c, struct ahead_item *it, int result, double seconds)
{
	struct kc_ahead *a = c->ahead;
	pthread_mutex_lock(&a->lock);
	it->state = result == 0 ? DONE : FAILED;
	it->seconds = seconds;
	a->running--;
	pthread_cond_broadcast(&a->cond);
	pthread_mutex_unlock(&a->lock);
	atomic_fetch_add(result == 0 ? &c->stats.ahead_compiles : &c->stats.ahead_failures, 1);
}

void kc_cache_ahead_gauges(struct kc_cache *c, struct kc_stats_gauges *g)
{
	struct kc_ahead *a = c->ahead;
	if (!a)
		return;
	g->ahead_set = 1;
	pthread_mutex_lock(&a->lock);
	for (struct ahead_item *it = a->items; it; it = it->next) {
		g->ahead_queued += it->state == QUEUED;
		g->ahead_running += it->state == RUNNING;
		if (it->state == DONE && !it->used) {
			g->ahead_unused++;
			g->ahead_unused_seconds += it->seconds;
		}
	}
	pthread_mutex_unlock(&a->lock);
}
