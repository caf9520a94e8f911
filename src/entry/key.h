/* key.h - the key of a kernel entry: the <hash> of kernel.<name>.<hash> computed from the
 * recipe staged in it, for clients that name entries by content (the kcachefs-nvcc shim
 * does).
 *
 * key = lowercase hex SHA-256 (OpenSSL EVP) over "kcachefs-key-v1\n", then kernel.cu and
 * then kernel.flags, each as a field: its decimal byte length, '\n', the bytes, '\n'. The
 * exact staged bytes count, comment lines of kernel.flags included, so whatever a client
 * wants in the identity (the compiler identity, include roots) goes there.
 *
 * A kernel.flags with "# include-root <digest> <dir>" lines (tree.h: the digest is that of
 * the bytes under dir) is keyed by its canonical form instead (kc_key_canonical), under
 * "kcachefs-key-v2\n": each such line loses its dir, and each -I<dir> / --include-path=<dir>
 * argument whose dir has a line becomes -I<digest>, so the key is a function of bytes, not
 * of where they are installed. Unless the flags put paths into the output (-lineinfo,
 * --generate-line-info, -G, --device-debug, -g, --debug: nvcc writes the header paths into
 * the cubin's line table): then the paths stay. The daemon takes each digest again before
 * it compiles (kc_tree_check_roots), so an entry cannot claim bytes it does not hold.
 */
#ifndef KC_KEY_H
#define KC_KEY_H

#include <stddef.h>
#include <stdio.h>
#include <sys/ioctl.h>

#include "hash.h"

/* ioctl on a descriptor of an open kernel.cubin of a kcachefs mount: fills 64 bytes (no
 * NUL) with the key of the recipe that cubin was compiled from. Fails with ENODATA for a
 * cubin a client published (it is no compile of any recipe), ENOTTY off a kcachefs mount.
 * Clients that name entries by key compare it with their own before trusting the bytes. */
#define KC_IOC_GET_KEY _IOR('k', 1, char[KC_SHA256_HEXLEN])

/* The canonical form of a kernel.flags text (flags, len bytes) as above, with extra (the
 * mount's -o flags=, may be NULL) also searched for flags that put paths into the output;
 * with key_paths (the mount's -o key_paths) the paths stay whatever the flags: a cubin whose
 * device code expands __FILE__ (DeepGEMM's DG_DEVICE_ASSERT) names its include root's path,
 * which the default accepts, as ccache's base_dir does (doc/cluster.md).
 * Returns 1 with *out (malloc'd, the caller frees it) / *outlen when the text names include
 * roots (a v2 key); 0 when it names none (keyed as it is, *out untouched); -ENOMEM. */
int kc_key_canonical(const char *flags, size_t len, const char *extra, int key_paths,
		     char **out, size_t *outlen);

/* A line of a kernel.flags text as kc_key_rewrite hands it over: the line (ll bytes, no
 * newline) and, when it is an include argument (-I<dir>, --include-path=<dir>), a copy of
 * it (copy, NUL-terminated) and its dir within that copy (inc); else both NULL. */
struct kc_flags_line {
	const char *line;
	size_t ll;
	const char *copy, *inc;
};

/* Rewrite a kernel.flags text (flags, len bytes) line by line into *out (malloc'd) /
 * *outlen: fn(f, l, arg) writes a line's replacement, with its newline, to f and returns
 * 1, or returns 0 to keep the line as it is. A line with a NUL or of 4100 bytes or more is
 * never an include argument. Returns 0 or -ENOMEM. */
int kc_key_rewrite(const char *flags, size_t len,
		   int (*fn)(FILE *f, const struct kc_flags_line *l, void *arg), void *arg,
		   char **out, size_t *outlen);

/* Whether the canonical form of flags (len bytes; extra and key_paths as above) keeps the
 * include roots' paths: key_paths, or a flag that puts paths into the output. */
int kc_key_keeps_paths(const char *flags, size_t len, const char *extra, int key_paths);

/* Compute the key of (source, flags), canonical when flags names include roots.
 * Returns 0 or -ENOMEM. */
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
