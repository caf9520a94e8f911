/* key.h - the key of a kernel entry: the <hash> of kernel.<name>.<hash> computed from the
 * recipe staged in it, for clients that name entries by content (the kcachefs-nvcc shim
 * does).
 *
 * key = lowercase hex SHA-256 (OpenSSL EVP) over "kcachefs-key-v1\n", then kernel.cu and
 * then kernel.flags, each as a field: its decimal byte length, '\n', the bytes, '\n'. The
 * exact staged bytes count, comment lines of kernel.flags included, so whatever a client
 * wants in the identity (the compiler version, include-tree fingerprints) goes there.
 */
#ifndef KC_KEY_H
#define KC_KEY_H

#include <stddef.h>
#include <sys/ioctl.h>

#include "hash.h"

/* ioctl on a descriptor of an open kernel.cubin of a kcachefs mount: fills 64 bytes (no
 * NUL) with the key of the recipe that cubin was compiled from. Fails with ENODATA for a
 * cubin a client published (it is no compile of any recipe), ENOTTY off a kcachefs mount.
 * Clients that name entries by key compare it with their own before trusting the bytes. */
#define KC_IOC_GET_KEY _IOR('k', 1, char[KC_SHA256_HEXLEN])

/* Compute the key of (source, flags). Returns 0 or -ENOMEM. */
int kc_key_compute(const void *source, size_t source_len, const void *flags, size_t flags_len,
		   char hex[KC_SHA256_HEXLEN + 1]);

/* Whether the <hash> of entry_name (kernel.<name>.<hash>) is a prefix of 16 to 64 digits of
 * key (64 hex digits). */
int kc_key_hash_matches(const char *entry_name, const char *key);

/* -o verify_keys: whether the entry named entry_name (kernel.<name>.<hash>) may hold the
 * recipe (source, flags): its <hash> must be the first strlen(<hash>) digits of the key
 * (so at most 64; 16 to 64 lowercase hex). Returns 1 if it may, 0 if not (why says so),
 * -ENOMEM. */
int kc_key_names(const char *entry_name, const void *source, size_t source_len,
		 const void *flags, size_t flags_len, char *why, size_t whylen);

#endif
