/* remote_redis.h - the L2 backend on Redis or Valkey (remote.h's interface), through hiredis.
 *
 * Owns: the shards of one remote= value, a small pool of connections per shard, the ACL
 * credentials read from remote_auth=. Thread-safe: each operation takes an idle connection
 * from its shard's mutex-protected pool (or opens one), uses it alone, and gives it back
 * when the exchange went well; any error closes it, so the next operation reconnects.
 * At most KC_REDIS_POOL idle connections are kept per shard; concurrent operations beyond
 * that open (and then close) connections of their own.
 *
 * URLs: "redis://HOST[:PORT][/DB]" (PORT 6379 and DB 0 by default; HOST a name, an IPv4
 * address or a bracketed IPv6 one) and "redis+unix:///PATH[?db=N]"; several joined by '|'
 * are independent shards. A key lives on the shard that rendezvous hashing picks: the
 * highest SHA-256 weight of (the shard's canonical URL, the key), so nodes that list the
 * same shards in any order agree, and adding an n-th shard moves only about 1/n of keys.
 * Credentials never appear in the URL (redis://user:pass@... is refused); TLS (rediss://)
 * and Redis Cluster are not supported. Host names resolve through the system resolver,
 * whose own timeout (resolv.conf) is not bounded by remote_timeout: give addresses.
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
 * Faults are logged once per shard per cause (and again after a minute), and "answers
 * again" once it recovers; the password never reaches a log line.
 */
#ifndef KC_REMOTE_REDIS_H
#define KC_REMOTE_REDIS_H

#include <stddef.h>

#include "remote.h"

#define KC_REDIS_POOL 8        /* idle connections kept per shard */
#define KC_REDIS_MAX_SHARDS 64 /* shards in one remote= value */

/* One shard's address, parsed from its URL. */
struct kc_redis_addr {
	int is_unix;    /* 1: redis+unix:// (path), 0: redis:// (host, port) */
	char host[256]; /* a name or an address; an IPv6 one without its brackets */
	int port;       /* 1..65535 */
	char path[108]; /* absolute socket path (sizeof sun_path) */
	int db;         /* SELECTed after connecting when not 0 */
	char canon[320]; /* canonical URL: the shard's name in logs and in rendezvous hashing */
};

/* Parse a remote= value of one or more Redis URLs joined by '|'. Returns the shard count
 * (>= 1) with *addrs (malloc'd array, owned by the caller), or -EINVAL with why filled
 * (which shard, what is wrong: never echoing a password) for anything malformed: an unknown
 * scheme, credentials in the URL, an empty shard, a bad host, port or db, a relative or
 * too long socket path, a query other than db=, duplicates, more than KC_REDIS_MAX_SHARDS;
 * -ENOMEM. */
int kc_redis_parse(const char *url, struct kc_redis_addr **addrs, char *why, size_t whylen);

/* The index (< n) of the shard that holds key: rendezvous (highest random weight) hashing
 * of (addrs[i].canon, key). n >= 1. */
size_t kc_redis_pick(const struct kc_redis_addr *addrs, size_t n, const char *key);

/* Read remote_auth=FILE: one line "USER PASSWORD" (a Redis 6+ ACL user) or "PASSWORD"
 * (the default user's requirepass). Returns 0 with *user (NULL for the one-word form) and
 * *pass malloc'd (owned by the caller; wipe the password before freeing it), or -EINVAL
 * with why for a file that is not regular, not owned by root or by this process's user,
 * that group or others may access (any of mode 077), over 4 KiB, with more lines or words,
 * or empty; -errno when it cannot be opened or read (ELOOP: a symbolic link). The file is
 * read by kc_secret_read (util.h), which wipes every copy. */
int kc_redis_auth_read(const char *path, char **user, char **pass, char *why, size_t whylen);

/* Open the Redis backend (remote.h's kc_remote_backend_open calls it for redis URLs):
 * parse url, read auth_file (NULL: no AUTH). Connects lazily. NULL with errno EINVAL and
 * why filled for a malformed URL, a bad auth file or a zero timeout_ms; errno ENOMEM. */
struct kc_remote_backend *kc_remote_redis_open(const char *url, const char *auth_file,
					       unsigned timeout_ms, char *why, size_t whylen);

#endif
