/* hash.c - see hash.h */
#include "hash.h"

#include <errno.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <unistd.h>

int kc_sha256_init(struct kc_sha256 *h)
{
	EVP_MD_CTX *ctx = EVP_MD_CTX_new();
	if (!ctx)
		return -ENOMEM;
	if (EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1) {
		EVP_MD_CTX_free(ctx);
		return -ENOMEM;
	}
	h->ctx = ctx;
	return 0;
}

void kc_sha256_update(struct kc_sha256 *h, const void *data, size_t len)
{
	EVP_DigestUpdate(h->ctx, data, len);
}

void kc_sha256_field(struct kc_sha256 *h, const void *data, size_t len)
{
	char num[32];
	int n = snprintf(num, sizeof(num), "%zu\n", len);
	kc_sha256_update(h, num, (size_t)n);
	kc_sha256_update(h, data, len);
	kc_sha256_update(h, "\n", 1);
}

void kc_sha256_final(struct kc_sha256 *h, char hex[KC_SHA256_HEXLEN + 1])
{
	static const char digits[] = "0123456789abcdef";
	unsigned char md[EVP_MAX_MD_SIZE];
	unsigned int n = 0;

	EVP_DigestFinal_ex(h->ctx, md, &n);
	EVP_MD_CTX_free(h->ctx);
	h->ctx = NULL;
	for (unsigned i = 0; i < n && i < KC_SHA256_HEXLEN / 2; i++) {
		hex[2 * i] = digits[md[i] >> 4];
		hex[2 * i + 1] = digits[md[i] & 15];
	}
	hex[KC_SHA256_HEXLEN] = '\0';
}

int kc_sha256_buf(const void *data, size_t len, char hex[KC_SHA256_HEXLEN + 1])
{
	struct kc_sha256 h;
	int err = kc_sha256_init(&h);
	if (err)
		return err;
	kc_sha256_update(&h, data, len);
	kc_sha256_final(&h, hex);
	return 0;
}

int kc_sha256_fd(int fd, char hex[KC_SHA256_HEXLEN + 1], uint64_t *size)
{
	return kc_sha256_fd_sized(fd, hex, size, -1);
}

int kc_sha256_fd_sized(int fd, char hex[KC_SHA256_HEXLEN + 1], uint64_t *size, int64_t expect)
{
	return kc_sha256_fd_seen(fd, hex, size, expect, NULL, NULL);
}

int kc_sha256_fd_seen(int fd, char hex[KC_SHA256_HEXLEN + 1], uint64_t *size, int64_t expect,
		      void (*seen)(const char *data, size_t len, void *arg), void *arg)
{
	struct kc_sha256 h;
	char buf[65536];
	off_t off = 0;
	int err = kc_sha256_init(&h);

	if (err)
		return err;
	for (;;) {
		ssize_t n = pread(fd, buf, sizeof(buf), off);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			err = -errno;
			kc_sha256_final(&h, hex);
			return err;
		}
		if (n == 0)
			break;
		kc_sha256_update(&h, buf, (size_t)n);
		if (seen)
			seen(buf, (size_t)n, arg);
		off += n;
		if ((size_t)n < sizeof(buf) && off == expect)
			break; /* a short read that ends where the stat said: at the end */
	}
	kc_sha256_final(&h, hex);
	if (size)
		*size = (uint64_t)off;
	return 0;
}
