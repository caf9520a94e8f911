/* remote.c - kc_remote_backend_open (remote.h): the backend a -o remote= URL names. */
#include "remote.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "remote_dir.h"
#include "remote_redis.h"

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
		return kc_remote_redis_open(url, auth_file, timeout_ms, why, whylen);
	snprintf(why, whylen, "remote=%s: unknown store (dir:PATH, redis://HOST[:PORT][/DB] or "
		 "redis+unix:///PATH)", url);
	errno = EINVAL;
	return NULL;
}
