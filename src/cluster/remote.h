/* remote.h - the cluster store shared by the nodes of a cluster: the backend interface
 * that each kind of store implements (remote_dir.c: a directory on a shared filesystem;
 * remote_redis.c: one Redis/Valkey server through hiredis) and that the store layer's
 * sharding (remote_shards.c: several servers, each key on the one rendezvous hashing picks)
 * implements over them.
 *
 * A backend stores opaque, immutable objects under a key (64 lowercase hex digits, the
 * SHA-256 object key) and short-lived leases on keys. It knows nothing of cubins,
 * manifests or signatures: the object's format and its verification belong to the caller
 * (remote_object.c), which treats every backend fault as a miss. Every operation is bounded
 * by the backend's per-operation timeout; a backend never blocks longer than that, never
 * retries on its own, and is safe to call from several threads at once.
 *
 * Errors, for every operation: -ETIMEDOUT (no answer within the timeout), -ECONNREFUSED /
 * -EHOSTUNREACH / -ENOTCONN (the store cannot be reached), -EPROTO (an answer that is not
 * what the protocol says: garbage), -ENOSPC (the store is full or refuses writes: Redis OOM,
 * a full filesystem), -EACCES (authentication or permissions), -ENOMEM; anything else is
 * -EIO. Only the ones named per operation below mean something other than "a fault".
 *
 * Leases follow Redis's documented single-instance lock: the value is a random token of
 * the taker's, set only if absent, with an expiry; renewed and released only by the
 * holder of the token (compare-and-act, atomically on the store). A lease or failure note
 * is stored as a record of remote_object.h (kc_lease_record): signed with the -o remote_key
 * secret when the backend has one, its ttl bounded. A record that does not check (unsigned
 * or badly signed with a key, malformed, claiming a ttl over the bound, a Redis key without
 * a TTL, a dir: file whose mtime is more than KC_REMOTE_SKEW_MS ahead of the store's clock)
 * is treated as absent: a take replaces it, atomically (one taker among racers).
 *
 * Liveness: a holder's renewal (every KC_REMOTE_RENEW_MS, remote_tier.c) also proves that
 * it lives. A held lease whose holder has not been heard from for KC_REMOTE_ALIVE_MS is
 * dead, whatever its ttl: a take replaces it at once. Redis keeps a short-TTL liveness key
 * beside the lease; a dir: lease file carries a counter the holder bumps, which takers
 * watch change by their own monotonic clock (no clock is compared across nodes).
 */
#ifndef KC_REMOTE_H
#define KC_REMOTE_H

#include <stddef.h>

#define KC_REMOTE_KEYLEN 64    /* hex digits of an object key */
#define KC_REMOTE_TOKENLEN 32  /* hex digits of a lease token */
#define KC_REMOTE_RENEW_MS 1000 /* a holder renews its lease (and proves it lives) this often */
#define KC_REMOTE_ALIVE_MS 3000 /* a holder not heard from for this long is dead */
#define KC_REMOTE_SKEW_MS 2000  /* clock difference allowed between a dir: store's writers */
#define KC_REMOTE_RECORD_MAX_MS 86400000u /* the default bound of a record's ttl */

/* What a lease peek sees. */
enum kc_lease_state {
	KC_LEASE_NONE,   /* nobody holds the key (never taken, released, or expired) */
	KC_LEASE_HELD,   /* a holder compiles it now */
	KC_LEASE_FAILED, /* the last holder's compile failed; the note expires within seconds */
};

struct kc_remote_backend;
struct kc_object_secret;
struct kc_remote_watch; /* a backend's own: what one waiter listens on */

#define KC_REMOTE_WATCH_POLL_MS 50 /* a dir: watch stats the index this often */

struct kc_remote_backend_ops {
	/* The object under key: 0 and *data (malloc'd, owned by the caller) / *len; -ENOENT
	 * when there is none (also: flushed, evicted, a name listed but gone, ESTALE). */
	int (*get)(struct kc_remote_backend *b, const char *key, char **data, size_t *len);
	/* Store an object under key, never replacing one: 0 when stored, -EEXIST when an
	 * object is already there (the caller's is dropped: the first published wins). */
	int (*put)(struct kc_remote_backend *b, const char *key, const void *data, size_t len);
	/* Optional (NULL: indexes are first-come). Store an object under key, replacing the one
	 * there, atomically (a reader gets the old or the new, whole): 0 or a fault. Only for
	 * indexes, which list several manifests (remote_tier.h). */
	int (*replace)(struct kc_remote_backend *b, const char *key, const void *data,
		       size_t len);
	/* Take the lease on key with token for ttl_ms: 0 taken; -EBUSY another holder has it
	 * (or a failure note stands: *state says which). */
	int (*lease_take)(struct kc_remote_backend *b, const char *key, const char *token,
			  unsigned ttl_ms, enum kc_lease_state *state);
	/* Extend our lease to ttl_ms from now: 0; -ENOLCK when the key is no longer ours
	 * (expired and taken over). */
	int (*lease_renew)(struct kc_remote_backend *b, const char *key, const char *token,
			   unsigned ttl_ms);
	/* Give our lease up: remove it, or (fail_ms > 0) replace it by a failure note that
	 * expires after fail_ms. 0; -ENOLCK when it was no longer ours (nothing changed). */
	int (*lease_release)(struct kc_remote_backend *b, const char *key, const char *token,
			     unsigned fail_ms);
	/* What stands on key now: 0 and *state. */
	int (*lease_peek)(struct kc_remote_backend *b, const char *key, enum kc_lease_state *state);
	/* Optional (NULL: the caller polls). Listen for the notice that key's object is
	 * stored or its lease given up: 0 and *w (owned; end it with watch_end), or a fault
	 * (-ENOTSUP: this store gives no notices). Started before the caller's look, it misses
	 * no notice that comes after it. */
	int (*watch_start)(struct kc_remote_backend *b, const char *key,
			   struct kc_remote_watch **w);
	/* Wait at most ms for a notice on w: 0 one came (only a hint: a notice can be
	 * planted by anyone who can write the store, so the caller looks and verifies as
	 * ever), -ETIMEDOUT none came; a fault otherwise (w is then of no use: end it and
	 * poll). Never blocks longer than ms (plus the backend's timeout on dir:). */
	int (*watch_wait)(struct kc_remote_backend *b, struct kc_remote_watch *w, unsigned ms);
	void (*watch_end)(struct kc_remote_backend *b, struct kc_remote_watch *w);
	/* Optional: tell the watchers of key that its object is stored or its lease given
	 * up (Redis: a PUBLISH; dir: nothing to do, the index file is the notice). 0 or a
	 * fault, which costs the watchers only their fallback poll. */
	int (*notify)(struct kc_remote_backend *b, const char *key);
	/* One line for logs and stats: "redis://10.0.0.5:6379 (2 shards)", "dir:/shared/kc". */
	const char *(*describe)(struct kc_remote_backend *b);
	void (*destroy)(struct kc_remote_backend *b);
};

struct kc_remote_backend {
	const struct kc_remote_backend_ops *ops;
	unsigned timeout_ms; /* bound of each operation (-o remote_timeout=) */
	/* How lease records are signed and checked; set by the opener before the first lease
	 * operation (kc_remote_backend_open sets no secret and KC_REMOTE_RECORD_MAX_MS). */
	const struct kc_object_secret *secret; /* borrowed; NULL or len 0: unsigned records */
	unsigned held_max_ms; /* a lease record claiming a longer ttl is ignored (ms) */
	unsigned note_max_ms; /* a failure note claiming a longer ttl is ignored (ms) */
};

/* Open the backend that url names (-o remote=): "dir:PATH" (one path, which may hold '|'),
 * "redis://HOST[:PORT][/DB]", "redis+unix:///PATH[?db=N]", several of the redis forms
 * joined by '|' (shards chosen by rendezvous hashing of the key: remote_shards.h; the auth
 * file is read once for all of them). auth_file: NULL, or a file holding "USER PASSWORD" or
 * "PASSWORD" for Redis (refused unless only root can read it). Connecting is lazy: a
 * store that is down at start is not an error. Returns the backend (owned; destroy with
 * ops->destroy), or NULL with why filled and errno EINVAL for a malformed URL, an unknown
 * scheme or remote_auth= with a dir: store (usage errors), EACCES for an auth file that
 * others can read or that cannot be read, ENOMEM. */
struct kc_remote_backend *kc_remote_backend_open(const char *url, const char *auth_file,
						 unsigned timeout_ms, char *why, size_t whylen);

#endif
