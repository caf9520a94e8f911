/* remote_shards.h - sharding in the cluster store layer, above every backend (remote.h):
 * a remote= value of several stores joined by '|' is one backend whose keyed operations
 * each go to the shard that rendezvous hashing picks for the key.
 *
 * A shard has a name, its backend's canonical URL ("redis://10.0.0.5:6379/0"): the key
 * lives on the shard with the highest weight, the first 64 bits of SHA-256 over (name,
 * key), length-prefixed; ties (never in practice) go to the smaller name. So nodes that
 * list the same shards in any order, or spelled alike in any way that canonicalises the
 * same, agree, and adding an n-th shard moves only about 1/n of keys. The pick is part of
 * the cluster's on-store layout: nodes of different versions share a store, so it never
 * changes (tests/unit/test_remote_redis.c pins it with fixed vectors).
 *
 * Each shard keeps its own connections and logs its own faults (once per shard per cause,
 * and "answers again"); a shard that is down costs only the keys it holds.
 */
#ifndef KC_REMOTE_SHARDS_H
#define KC_REMOTE_SHARDS_H

#include <stddef.h>

#include "remote.h"

#define KC_REMOTE_MAX_SHARDS 64  /* shards in one remote= value */
#define KC_REMOTE_VALUE_MAX 8192 /* bytes of a remote= value that is split into shards */

/* One shard's text in a remote= value: n bytes at s (not NUL-terminated; may be 0). */
struct kc_remote_piece {
	const char *s;
	size_t n;
};

/* Split value on '|' into pieces (an array of KC_REMOTE_MAX_SHARDS, the caller's), in
 * order. Returns the count (>= 1), or -EINVAL with why: value NULL or empty ("remote: empty
 * URL"), over KC_REMOTE_VALUE_MAX bytes, more than KC_REMOTE_MAX_SHARDS pieces. An empty
 * piece is not refused here: the caller names it ("shard N is empty"). */
int kc_remote_shards_split(const char *value, struct kc_remote_piece *pieces, char *why,
			   size_t whylen);

/* The index (< n) of the shard that holds key: rendezvous (highest random weight) hashing
 * of (names[i], key). n >= 1; names distinct. */
size_t kc_remote_shards_pick(const char *const *names, size_t n, const char *key);

/* One backend over n (2..KC_REMOTE_MAX_SHARDS) shards: shards[i] named names[i] (distinct:
 * the caller refuses duplicates). Takes the shards, whatever it returns (destroyed with it,
 * or at once on failure); names are copied. All shards are backends of one kind with the
 * same timeout_ms; the returned backend's secret, held_max_ms and note_max_ms reach every
 * shard before its next operation. describe: "NAME1|NAME2 (2 shards)". Returns the backend
 * (owned; destroy with ops->destroy), or NULL with errno ENOMEM (why filled). */
struct kc_remote_backend *kc_remote_shards_new(struct kc_remote_backend **shards,
					       const char *const *names, size_t n, char *why,
					       size_t whylen);

#endif
