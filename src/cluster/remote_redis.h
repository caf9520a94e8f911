/* remote_redis.h - one Redis or Valkey server of the cluster store (remote.h's interface),
 * through hiredis. Several servers joined by '|' in remote= are shards: remote.c opens one
 * of these backends per shard and remote_shards.c routes each key to its shard; the URLs
 * and the auth file are read by remote_redis_addr.c.
 *
 * Owns: a small pool of connections to the server, a copy of the ACL credentials.
 * Thread-safe: each operation takes an idle connection from the mutex-protected pool (or
 * opens one), uses it alone, and gives it back when the exchange went well; any error
 * closes it, so the next operation reconnects. At most KC_REDIS_POOL idle connections are
 * kept; concurrent operations beyond that open (and then close) connections of their own.
 * Host names resolve through the system resolver, whose own timeout (resolv.conf) is not
 * bounded by remote_timeout: give addresses.
 *
 * Keys on the server: "kcachefs:obj:<key>" (objects, SET NX, no expiry: the operator's
 * maxmemory-policy allkeys-lru evicts them) and "kcachefs:lease:<key>" (a lease: the
 * holder's token with PX ttl; or, after a failed compile, "failed:<token>" with PX fail_ms).
 * Taking, renewing and releasing leases are Lua scripts (EVAL) that compare the token
 * first, as in Redis's documented single-instance lock.
 *
 * Errors, beyond remote.h's: each operation is one deadline of timeout_ms covering
 * connect, AUTH, SELECT and the command; an answer that has not come by then is
 * -ETIMEDOUT, also when a server trickles bytes. A connection lost in the middle of an
 * exchange is -ENOTCONN. Redis's error replies map by their code: OOM, READONLY and
 * MISCONF -> -ENOSPC (writes refused); NOAUTH, WRONGPASS, NOPERM -> -EACCES; LOADING, BUSY,
 * MASTERDOWN, TRYAGAIN -> -EAGAIN (a passing fault of the server: the caller counts it as
 * one); others -> -EIO. A reply of a type the command cannot give, more bytes than one
 * reply, an array of more than 16 elements, or a reply over 512 MiB -> -EPROTO. A key
 * that is not 64 lowercase hex digits, a token not 32 of them, a zero ttl, or an object of
 * 512 MiB or more (Redis's own bulk limit) -> -EINVAL.
 * Faults are logged once per server (so once per shard) per cause (and again after a
 * minute), and "answers again" once it recovers; the password never reaches a log line.
 */
#ifndef KC_REMOTE_REDIS_H
#define KC_REMOTE_REDIS_H

#include <stddef.h>

#include "remote.h"
#include "remote_redis_addr.h"

#define KC_REDIS_POOL 8 /* idle connections kept per server (per shard) */

/* Open the backend of the one server at addr (copied). user, pass: the credentials of
 * remote_auth= (kc_redis_auth_read), copied (the copy of pass is wiped on destroy); pass
 * NULL: no AUTH; user NULL: AUTH PASSWORD. Connects lazily. describe: addr->canon. Returns
 * the backend (owned; destroy with ops->destroy), or NULL with why filled and errno EINVAL
 * for a zero timeout_ms, ENOMEM. */
struct kc_remote_backend *kc_remote_redis_open(const struct kc_redis_addr *addr,
					       const char *user, const char *pass,
					       unsigned timeout_ms, char *why, size_t whylen);

#endif
