/* remote_redis.h - the Redis/Valkey backend of the cluster store (remote.h), through
 * hiredis: "redis://HOST[:PORT][/DB]", "redis+unix:///PATH[?db=N]", several joined by '|'
 * (shards by rendezvous hashing of the key).
 */
#ifndef KC_REMOTE_REDIS_H
#define KC_REMOTE_REDIS_H

#include <stddef.h>

#include "remote.h"

/* Open the Redis backend of url (see kc_remote_backend_open for url and auth_file).
 * Returns the backend, or NULL with errno EINVAL and why filled. */
struct kc_remote_backend *kc_remote_redis_open(const char *url, const char *auth_file,
					       unsigned timeout_ms, char *why, size_t whylen);

#endif
