/* remote_shards.c - sharding in the cluster store layer (see remote_shards.h): the split of
 * a remote= value on '|', the rendezvous pick, and the backend that forwards each keyed
 * operation to its key's shard. */
#include "remote_shards.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hash.h"

int kc_remote_shards_split(const char *value, struct kc_remote_piece *pieces, char *why,
			   size_t whylen)
{
	size_t n = 1;
	const char *p;

	if (!value || !*value) {
		snprintf(why, whylen, "remote: empty URL");
		return -EINVAL;
	}
	if (strlen(value) > KC_REMOTE_VALUE_MAX) {
		snprintf(why, whylen, "remote: the URL is longer than %d bytes",
			 KC_REMOTE_VALUE_MAX);
		return -EINVAL;
	}
	for (p = value; *p; p++)
		n += *p == '|';
	if (n > KC_REMOTE_MAX_SHARDS) {
		snprintf(why, whylen, "remote: %zu shards, at most %d", n, KC_REMOTE_MAX_SHARDS);
		return -EINVAL;
	}
	p = value;
	for (size_t i = 0; i < n; i++) {
		const char *bar = strchr(p, '|');

		pieces[i].s = p;
		pieces[i].n = bar ? (size_t)(bar - p) : strlen(p);
		p += pieces[i].n + 1;
	}
	return (int)n;
}

/* The weight of (shard, key): the first 64 bits of SHA-256 over both, length-prefixed. */
static uint64_t weight(const char *name, const char *key)
{
	struct kc_sha256 h;
	char hex[KC_SHA256_HEXLEN + 1];

	if (kc_sha256_init(&h))
		return 0; /* out of memory: every shard weighs the same, the first wins */
	kc_sha256_field(&h, name, strlen(name));
	kc_sha256_field(&h, key, strlen(key));
	kc_sha256_final(&h, hex);
	hex[16] = 0;
	return strtoull(hex, NULL, 16);
}

size_t kc_remote_shards_pick(const char *const *names, size_t n, const char *key)
{
	size_t best = 0;
	uint64_t bw = 0;

	for (size_t i = 0; i < n; i++) {
		uint64_t w = weight(names[i], key);
		/* Ties (never in practice) go to the smaller name: order-free. */
		if (i == 0 || w > bw || (w == bw && strcmp(names[i], names[best]) < 0)) {
			best = i;
			bw = w;
		}
	}
	return best;
}

/* ---- the sharded backend ---- */

struct sharded {
	struct kc_remote_backend base;    /* first: the ops get &base */
	struct kc_remote_backend_ops ops; /* the optional ops the shards have */
	struct kc_remote_backend **shards;
	char **names;
	size_t n;
	pthread_mutex_t lock; /* guards pushing the record settings to the shards */
	const struct kc_object_secret *pushed_secret;
	unsigned pushed_held, pushed_note;
	char desc[600];
};

/* A watch on the sharded backend: the shard it listens on and that shard's own watch. */
struct kc_remote_watch {
	struct kc_remote_backend *shard;
	struct kc_remote_watch *inner;
};

/* key's shard, holding the record settings the caller gave the sharded backend. */
static struct kc_remote_backend *shard_of(struct kc_remote_backend *base, const char *key)
{
	struct sharded *sb = (struct sharded *)base;

	pthread_mutex_lock(&sb->lock);
	if (sb->pushed_secret != base->secret || sb->pushed_held != base->held_max_ms ||
	    sb->pushed_note != base->note_max_ms) {
		for (size_t i = 0; i < sb->n; i++) {
			sb->shards[i]->secret = base->secret;
			sb->shards[i]->held_max_ms = base->held_max_ms;
			sb->shards[i]->note_max_ms = base->note_max_ms;
		}
		sb->pushed_secret = base->secret;
		sb->pushed_held = base->held_max_ms;
		sb->pushed_note = base->note_max_ms;
	}
	pthread_mutex_unlock(&sb->lock);
	return sb->shards[kc_remote_shards_pick((const char *const *)sb->names, sb->n, key)];
}

static int s_get(struct kc_remote_backend *b, const char *key, char **data, size_t *len)
{
	struct kc_remote_backend *s = shard_of(b, key);

	return s->ops->get(s, key, data, len);
}

static int s_put(struct kc_remote_backend *b, const char *key, const void *data, size_t len)
{
	struct kc_remote_backend *s = shard_of(b, key);

	return s->ops->put(s, key, data, len);
}

static int s_replace(struct kc_remote_backend *b, const char *key, const void *data, size_t len)
{
	struct kc_remote_backend *s = shard_of(b, key);

	return s->ops->replace(s, key, data, len);
}

static int s_lease_take(struct kc_remote_backend *b, const char *key, const char *token,
			unsigned ttl_ms, enum kc_lease_state *state)
{
	struct kc_remote_backend *s = shard_of(b, key);

	return s->ops->lease_take(s, key, token, ttl_ms, state);
}

static int s_lease_renew(struct kc_remote_backend *b, const char *key, const char *token,
			 unsigned ttl_ms)
{
	struct kc_remote_backend *s = shard_of(b, key);

	return s->ops->lease_renew(s, key, token, ttl_ms);
}

static int s_lease_release(struct kc_remote_backend *b, const char *key, const char *token,
			   unsigned fail_ms)
{
	struct kc_remote_backend *s = shard_of(b, key);

	return s->ops->lease_release(s, key, token, fail_ms);
}

static int s_lease_peek(struct kc_remote_backend *b, const char *key, enum kc_lease_state *state)
{
	struct kc_remote_backend *s = shard_of(b, key);

	return s->ops->lease_peek(s, key, state);
}

static int s_watch_start(struct kc_remote_backend *b, const char *key,
			 struct kc_remote_watch **w)
{
	struct kc_remote_backend *s = shard_of(b, key);
	struct kc_remote_watch *nw = calloc(1, sizeof(*nw));
	int rc;

	*w = NULL;
	if (!nw)
		return -ENOMEM;
	nw->shard = s;
	rc = s->ops->watch_start(s, key, &nw->inner);
	if (rc) {
		free(nw);
		return rc;
	}
	*w = nw;
	return 0;
}

static int s_watch_wait(struct kc_remote_backend *b, struct kc_remote_watch *w, unsigned ms)
{
	(void)b;
	return w->shard->ops->watch_wait(w->shard, w->inner, ms);
}

static void s_watch_end(struct kc_remote_backend *b, struct kc_remote_watch *w)
{
	(void)b;
	if (!w)
		return;
	w->shard->ops->watch_end(w->shard, w->inner);
	free(w);
}

static int s_notify(struct kc_remote_backend *b, const char *key)
{
	struct kc_remote_backend *s = shard_of(b, key);

	return s->ops->notify(s, key);
}

static const char *s_describe(struct kc_remote_backend *b)
{
	return ((struct sharded *)b)->desc;
}

/* Destroy the first n of shards and free the array. */
static void destroy_shards(struct kc_remote_backend **shards, size_t n)
{
	for (size_t i = 0; shards && i < n; i++)
		if (shards[i])
			shards[i]->ops->destroy(shards[i]);
	free(shards);
}

static void s_destroy(struct kc_remote_backend *b)
{
	struct sharded *sb = (struct sharded *)b;

	if (!sb)
		return;
	destroy_shards(sb->shards, sb->n);
	for (size_t i = 0; sb->names && i < sb->n; i++)
		free(sb->names[i]);
	free(sb->names);
	pthread_mutex_destroy(&sb->lock);
	free(sb);
}

static const struct kc_remote_backend_ops sharded_ops = {
	.get = s_get,
	.put = s_put,
	.replace = s_replace,
	.lease_take = s_lease_take,
	.lease_renew = s_lease_renew,
	.lease_release = s_lease_release,
	.lease_peek = s_lease_peek,
	.watch_start = s_watch_start,
	.watch_wait = s_watch_wait,
	.watch_end = s_watch_end,
	.notify = s_notify,
	.describe = s_describe,
	.destroy = s_destroy,
};

/* "NAME1|NAME2 (2 shards)"; a list too long to show names the first: "NAME1|... (n shards)". */
static void describe_shards(struct sharded *sb)
{
	size_t dl = 0;

	for (size_t i = 0; i < sb->n; i++) {
		size_t left = sizeof(sb->desc) - dl;
		int w = snprintf(sb->desc + dl, left, "%s%s", i ? "|" : "", sb->names[i]);

		if (w < 0 || (size_t)w + 20 >= left) {
			dl = (size_t)snprintf(sb->desc, sizeof(sb->desc), "%s|...", sb->names[0]);
			break;
		}
		dl += (size_t)w;
	}
	snprintf(sb->desc + dl, sizeof(sb->desc) - dl, " (%zu shards)", sb->n);
}

struct kc_remote_backend *kc_remote_shards_new(struct kc_remote_backend **shards,
					       const char *const *names, size_t n, char *why,
					       size_t whylen)
{
	struct sharded *sb = calloc(1, sizeof(*sb));
	const struct kc_remote_backend_ops *one = shards[0]->ops;

	if (!sb || !(sb->shards = calloc(n, sizeof(*sb->shards))) ||
	    !(sb->names = calloc(n, sizeof(*sb->names)))) {
		if (sb)
			free(sb->shards);
		free(sb);
		destroy_shards(shards, n);
		snprintf(why, whylen, "remote: out of memory");
		errno = ENOMEM;
		return NULL;
	}
	pthread_mutex_init(&sb->lock, NULL);
	sb->n = n;
	memcpy(sb->shards, shards, n * sizeof(*shards));
	for (size_t i = 0; i < n; i++) {
		sb->names[i] = strdup(names[i]);
		if (!sb->names[i]) {
			s_destroy(&sb->base);
			snprintf(why, whylen, "remote: out of memory");
			errno = ENOMEM;
			return NULL;
		}
	}
	sb->ops = sharded_ops;
	if (!one->replace)
		sb->ops.replace = NULL;
	if (!one->watch_start || !one->watch_wait || !one->watch_end)
		sb->ops.watch_start = NULL;
	if (!one->notify)
		sb->ops.notify = NULL;
	sb->base.ops = &sb->ops;
	sb->base.timeout_ms = shards[0]->timeout_ms;
	sb->base.held_max_ms = shards[0]->held_max_ms;
	sb->base.note_max_ms = shards[0]->note_max_ms;
	sb->pushed_held = ~0u; /* the first operation gives every shard the same settings */
	describe_shards(sb);
	return &sb->base;
}
