/* remote_redis.c - see remote_redis.h. Placeholder until the Redis backend lands. */
#include "remote_redis.h"

#include <errno.h>
#include <stdio.h>

struct kc_remote_backend *kc_remote_redis_open(const char *url, const char *auth_file,
					       unsigned timeout_ms, char *why, size_t whylen)
{
	(void)url;
	(void)auth_file;
	(void)timeout_ms;
	snprintf(why, whylen, "Redis backend not built yet");
	errno = EINVAL;
	return NULL;
}
