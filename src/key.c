/* key.c - see key.h */
#include "key.h"

int kc_key_compute(const void *source, size_t source_len, const void *flags, size_t flags_len,
		   char hex[KC_SHA256_HEXLEN + 1])
{
	struct kc_sha256 h;
	int err = kc_sha256_init(&h);

	if (err)
		return err;
	kc_sha256_update(&h, "kcachefs-key-v1\n", 16);
	kc_sha256_field(&h, source, source_len);
	kc_sha256_field(&h, flags, flags_len);
	kc_sha256_final(&h, hex);
	return 0;
}
