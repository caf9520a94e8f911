/* fuzz_redis_url.c - libFuzzer target: the Redis URL parser of -o remote= (kc_redis_parse:
 * the store layer's split on '|' and each shard's URL). Any bytes as a URL: no crash, no
 * undefined behaviour; a refusal is -EINVAL with a reason; an accepted list has
 * 1..KC_REMOTE_MAX_SHARDS shards whose canonical forms parse back to themselves (so every
 * node that writes one shard list places keys alike), and the rendezvous pick over them
 * names one of them. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "remote_redis_addr.h"
#include "remote_shards.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *url = malloc(size + 1), why[256];
	const char *names[KC_REMOTE_MAX_SHARDS];
	struct kc_redis_addr *a = NULL, *b = NULL;
	int n;

	if (!url)
		return 0;
	memcpy(url, data, size);
	url[size] = '\0';
	why[0] = 0;
	n = kc_redis_parse(url, &a, why, sizeof(why));
	if (n < 0) {
		if ((n != -EINVAL && n != -ENOMEM) || a || (n == -EINVAL && !why[0]))
			abort();
	} else {
		if (n < 1 || n > KC_REMOTE_MAX_SHARDS || !a)
			abort();
		for (int i = 0; i < n; i++) {
			if (kc_redis_parse(a[i].canon, &b, why, sizeof(why)) != 1 ||
			    strcmp(b->canon, a[i].canon) || b->port != a[i].port || b->db != a[i].db)
				abort();
			free(b);
			names[i] = a[i].canon;
		}
		if (kc_remote_shards_pick(names, (size_t)n, "0123456789abcdef0123456789abcdef"
					  "0123456789abcdef0123456789abcdef") >= (size_t)n)
			abort();
		free(a);
	}
	free(url);
	return 0;
}
