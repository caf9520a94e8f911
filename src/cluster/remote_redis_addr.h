/* remote_redis_addr.h - what names a Redis server of the cluster store: its URL, parsed to
 * an address and a canonical form, and the credentials of remote_auth=.
 *
 * URLs: "redis://HOST[:PORT][/DB]" (PORT 6379 and DB 0 by default; HOST a name, lowercased,
 * an IPv4 address or a bracketed IPv6 one) and "redis+unix:///PATH[?db=N]"; several joined
 * by '|' are independent shards (remote_shards.h), each named by its canonical URL.
 * Credentials never appear in the URL (redis://user:pass@... is refused); TLS (rediss://)
 * and Redis Cluster are not supported.
 */
#ifndef KC_REMOTE_REDIS_ADDR_H
#define KC_REMOTE_REDIS_ADDR_H

#include <stddef.h>

/* One server's address, parsed from its URL. */
struct kc_redis_addr {
	int is_unix;    /* 1: redis+unix:// (path), 0: redis:// (host, port) */
	char host[256]; /* a name or an address; an IPv6 one without its brackets */
	int port;       /* 1..65535 */
	char path[108]; /* absolute socket path (sizeof sun_path) */
	int db;         /* SELECTed after connecting when not 0 */
	char canon[320]; /* canonical URL: the shard's name in logs and in rendezvous hashing */
};

/* Parse one Redis URL, the n bytes at s (not NUL-terminated), the idx-th shard (1-based,
 * for messages) of a remote= value, into *a. Returns 0, or -EINVAL with why ("remote: shard
 * IDX: ...", never echoing a password): empty, an unknown scheme, credentials, a blank or
 * control character, a bad host, port or db, a relative or too long socket path, a query
 * other than db=. */
int kc_redis_addr_parse(const char *s, size_t n, int idx, struct kc_redis_addr *a, char *why,
			size_t whylen);

/* Parse a remote= value of one or more Redis URLs joined by '|' (split by
 * kc_remote_shards_split). Returns the shard count (>= 1) with *addrs (malloc'd array,
 * owned by the caller), or -EINVAL with why for anything malformed: kc_remote_shards_split's
 * and kc_redis_addr_parse's refusals, two shards whose canonical URLs are the same; -ENOMEM.
 * *addrs is NULL on error. */
int kc_redis_parse(const char *url, struct kc_redis_addr **addrs, char *why, size_t whylen);

/* Read remote_auth=FILE: one line "USER PASSWORD" (a Redis 6+ ACL user) or "PASSWORD"
 * (the default user's requirepass). Returns 0 with *user (NULL for the one-word form) and
 * *pass malloc'd (owned by the caller; wipe the password before freeing it), or -EINVAL
 * with why for a file that is not regular, not owned by root or by this process's user,
 * that group or others may access (any of mode 077), over 4 KiB, with more lines or words,
 * or empty; -errno when it cannot be opened or read (ELOOP: a symbolic link). The file is
 * read by kc_secret_read (util.h), which wipes every copy. */
int kc_redis_auth_read(const char *path, char **user, char **pass, char *why, size_t whylen);

#endif
