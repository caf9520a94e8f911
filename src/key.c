/* key.c - see key.h */
#include "key.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

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

int kc_key_hash_matches(const char *entry_name, const char *key)
{
	const char *dot = strrchr(entry_name, '.');
	const char *hash = dot ? dot + 1 : "";
	size_t n = strlen(hash);
	return n >= 16 && n <= KC_SHA256_HEXLEN && strncmp(key, hash, n) == 0;
}

int kc_key_names(const char *entry_name, const void *source, size_t source_len,
		 const void *flags, size_t flags_len, char *why, size_t whylen)
{
	char key[KC_SHA256_HEXLEN + 1];
	const char *dot = strrchr(entry_name, '.');
	const char *hash = dot ? dot + 1 : "";
	size_t n = strlen(hash);
	if (kc_key_compute(source, source_len, flags, flags_len, key) != 0)
		return -ENOMEM;
	if (kc_key_hash_matches(entry_name, key))
		return 1;
	snprintf(why, whylen, "the key of kernel.cu and kernel.flags is %.*s, not the entry's "
		 "%.64s%s (-o verify_keys; see src/key.h)", (int)(n >= 16 && n <= 64 ? n : 64),
		 key, hash, n > 64 ? "...: longer than a SHA-256" : "");
	return 0;
}
