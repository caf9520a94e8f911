/* hash.h - SHA-256 through OpenSSL's EVP interface.
 *
 * Owns: nothing global. Each kc_sha256 owns its EVP_MD_CTX until kc_sha256_final.
 */
#ifndef KC_HASH_H
#define KC_HASH_H

#include <stddef.h>
#include <stdint.h>

#define KC_SHA256_HEXLEN 64 /* hex digits; buffers hold KC_SHA256_HEXLEN + 1 */

struct kc_sha256 {
	void *ctx; /* EVP_MD_CTX * */
};

/* Start a digest. Returns 0, or -ENOMEM when OpenSSL cannot allocate. */
int kc_sha256_init(struct kc_sha256 *h);
void kc_sha256_update(struct kc_sha256 *h, const void *data, size_t len);
/* Add one length-prefixed field: its decimal byte length, '\n', the bytes, '\n'. Used by
 * every key the project defines (recipe, entry key), so that no two field lists encode
 * alike. */
void kc_sha256_field(struct kc_sha256 *h, const void *data, size_t len);
/* Finish into hex (lowercase, NUL-terminated) and free the context. */
void kc_sha256_final(struct kc_sha256 *h, char hex[KC_SHA256_HEXLEN + 1]);

/* Digest a buffer. Returns 0 or -ENOMEM. */
int kc_sha256_buf(const void *data, size_t len, char hex[KC_SHA256_HEXLEN + 1]);

/* Digest the whole file behind fd (read with pread from offset 0; the offset of fd is not
 * moved); *size (if not NULL) gets the byte count. Returns 0, -errno of a failed read, or
 * -ENOMEM. */
int kc_sha256_fd(int fd, char hex[KC_SHA256_HEXLEN + 1], uint64_t *size);
/* kc_sha256_fd of a file whose fstat gave expect bytes (-1: unknown): a read that returns
 * less than asked and ends at expect is taken as the end, without the read that would
 * return 0. A file that is longer, or shorter, is read to its end as kc_sha256_fd does. */
int kc_sha256_fd_sized(int fd, char hex[KC_SHA256_HEXLEN + 1], uint64_t *size, int64_t expect);
/* kc_sha256_fd_sized that also hands each chunk it read, in order, to seen(data, len, arg)
 * (may be NULL): a caller that needs to look at the bytes reads them once. */
int kc_sha256_fd_seen(int fd, char hex[KC_SHA256_HEXLEN + 1], uint64_t *size, int64_t expect,
		      void (*seen)(const char *data, size_t len, void *arg), void *arg);

#endif
