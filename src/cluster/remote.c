/* remote.c - kc_remote_backend_open (remote.h): the backend a -o remote= URL names. A dir:
 * value is one path (a path may hold '|'); a Redis value is one or more servers joined by
 * '|', each opened as a backend of its own and, when there are several, joined into one
 * sharded backend (remote_shards.h). */
#include "remote.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "remote_dir.h"
#include "remote_redis.h"
#include "remote_shards.h"
#include "util.h"

/* Open each of the n shards at addrs with the credentials into shards[]: n, or -errno
 * (errno's value) with the ones opened destroyed. */
static int open_redis_shards(const struct kc_redis_addr *addrs, int n, const char *user,
			     const char *pass, unsigned timeout_ms,
			     struct kc_remote_backend **shards, char *why, size_t whylen)
{
	for (int i = 0; i < n; i++) {
		shards[i] = kc_remote_redis_open(&addrs[i], user, pass, timeout_ms, why, whylen);
		if (!shards[i]) {
			int e = errno;

			while (i-- > 0)
				shards[i]->ops->destroy(shards[i]);
			return -e;
		}
	}
	return n;
}

/* A Redis value: parse every shard's URL, read the auth file once, open a backend per
 * shard, and shard them when there are several. */
static struct kc_remote_backend *open_redis(const char *url, const char *auth_file,
					    unsigned timeout_ms, char *why, size_t whylen)
{
	struct kc_remote_backend *shards[KC_REMOTE_MAX_SHARDS], *b = NULL;
	const char *names[KC_REMOTE_MAX_SHARDS];
	struct kc_redis_addr *addrs = NULL;
	char *user = NULL, *pass = NULL;
	int n, rc;

	n = rc = kc_redis_parse(url, &addrs, why, whylen);
	if (rc > 0 && auth_file) {
		rc = kc_redis_auth_read(auth_file, &user, &pass, why, whylen);
		if (rc && rc != -ENOMEM)
			rc = -EACCES; /* remote.h: an auth file that cannot be used */
	}
	if (rc >= 0)
		rc = open_redis_shards(addrs, n, user, pass, timeout_ms, shards, why, whylen);
	if (rc == 1) {
		b = shards[0];
	} else if (rc > 1) {
		for (int i = 0; i < n; i++)
			names[i] = addrs[i].canon;
		b = kc_remote_shards_new(shards, names, (size_t)n, why, whylen);
		rc = b ? 0 : -errno;
	}
	kc_secret_free(pass, pass ? strlen(pass) : 0);
	free(user);
	free(addrs);
	if (!b)
		errno = -rc;
	return b;
}

struct kc_remote_backend *kc_remote_backend_open(const char *url, const char *auth_file,
						 unsigned timeout_ms, char *why, size_t whylen)
{
	if (strncmp(url, "dir:", 4) == 0) {
		if (auth_file) {
			snprintf(why, whylen, "remote_auth= is for Redis; a dir: store has none");
			errno = EINVAL;
			return NULL;
		}
		return kc_remote_dir_open(url + 4, timeout_ms, why, whylen);
	}
	if (strncmp(url, "redis://", 8) == 0 || strncmp(url, "redis+unix://", 13) == 0)
		return open_redis(url, auth_file, timeout_ms, why, whylen);
	snprintf(why, whylen, "remote=%s: unknown store (dir:PATH, redis://HOST[:PORT][/DB] or "
		 "redis+unix:///PATH)", url);
	errno = EINVAL;
	return NULL;
}
