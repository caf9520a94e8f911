/* test_remote_object.c - the cluster store's objects: keys, build, parse, and every kind of
 * corruption refused. */
#define _GNU_SOURCE
#include <elf.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "remote_object.h"
#include "tap.h"

static const struct kc_object_secret no_secret = {NULL, 0};
static const unsigned char secret_bytes[] = "a cluster secret of 32 bytes....";
static const struct kc_object_secret secret = {secret_bytes, 32};
static const unsigned char other_bytes[] = "another secret, also 32 bytes...";
static const struct kc_object_secret other = {other_bytes, 32};

/* A small, complete CUDA ELF: header, 200 bytes of payload, no tables. */
static void make_cubin(unsigned char *buf, size_t len, unsigned char fill)
{
	Elf64_Ehdr eh;
	memset(&eh, 0, sizeof(eh));
	memcpy(eh.e_ident, ELFMAG, SELFMAG);
	eh.e_ident[EI_CLASS] = ELFCLASS64;
	eh.e_machine = EM_CUDA;
	eh.e_ehsize = sizeof(eh);
	memset(buf, fill, len);
	memcpy(buf, &eh, sizeof(eh));
}

static int parses(const char *d, size_t n, enum kc_object_kind kind, const char *key,
		  const struct kc_object_secret *s)
{
	struct kc_object o;
	char why[300];
	return kc_object_parse(d, n, kind, key, s, &o, why, sizeof(why));
}

/* Whether every copy of obj with one byte flipped, outside [skip_from, skip_to) (the
 * manifest, which only the signature and the caller's own manifest cover), is refused. */
static int flips_refused(const char *obj, size_t len, const char *key,
			 const struct kc_object_secret *s, size_t skip_from, size_t skip_to)
{
	char *bad = malloc(len);
	int all = 1;
	for (size_t i = 0; i < len; i++) {
		if (i >= skip_from && i < skip_to)
			continue;
		memcpy(bad, obj, len);
		bad[i] ^= 0x01;
		if (parses(bad, len, KC_OBJECT_CUBIN, key, s) != -EBADMSG) {
			all = 0;
			printf("# flip at %zu accepted\n", i);
		}
	}
	free(bad);
	return all;
}

int main(void)
{
	char rkey[KC_SHA256_HEXLEN + 1], mkey[KC_SHA256_HEXLEN + 1], okey[KC_SHA256_HEXLEN + 1],
		okey2[KC_SHA256_HEXLEN + 1], why[300];
	unsigned char cubin[264], cubin2[264];
	const char manifest[] =
		"1111111111111111111111111111111111111111111111111111111111111111 /opt/inc/a.h\n"
		"2222222222222222222222222222222222222222222222222222222222222222 /opt/inc/b.h\n";
	size_t mlen = strlen(manifest);
	struct kc_object o;
	char *obj, *bad;
	size_t len;

	make_cubin(cubin, sizeof(cubin), 0x5a);
	make_cubin(cubin2, sizeof(cubin2), 0x33);
	kc_sha256_buf("recipe", 6, rkey);

	/* keys */
	CHECK(kc_object_manifest_key(rkey, mkey) == 0 && strlen(mkey) == 64 &&
		      strcmp(mkey, rkey) != 0, "manifest key is derived from the recipe hash");
	CHECK(kc_object_cubin_key(mkey, manifest, mlen, okey) == 0 &&
		      kc_object_cubin_key(mkey, manifest, mlen - 2, okey2) == 0 &&
		      strcmp(okey, okey2) != 0 && strcmp(okey, mkey) != 0,
	      "object key depends on the manifest");
	kc_object_cubin_key(mkey, manifest, mlen, okey2);
	CHECK(strcmp(okey, okey2) == 0, "object key is deterministic");

	/* manifest syntax */
	CHECK(kc_object_manifest_check("", 0, why, sizeof(why)) == 0, "empty manifest is valid");
	CHECK(kc_object_manifest_check(manifest, mlen, why, sizeof(why)) == 0,
	      "sorted manifest is valid");
	{
		char m[400];
		snprintf(m, sizeof(m), "%s%s", manifest + mlen / 2, manifest);
		CHECK(kc_object_manifest_check(m, strlen(m), why, sizeof(why)) == -EBADMSG,
		      "unsorted manifest refused");
		snprintf(m, sizeof(m), "%s%s", manifest, manifest + mlen / 2);
		CHECK(kc_object_manifest_check(m, strlen(m), why, sizeof(why)) == -EBADMSG,
		      "repeated path refused");
		CHECK(kc_object_manifest_check(manifest, mlen - 1, why, sizeof(why)) == -EBADMSG,
		      "unterminated line refused");
		snprintf(m, sizeof(m), "%s", manifest);
		m[70] = '\0';
		CHECK(kc_object_manifest_check(m, mlen, why, sizeof(why)) == -EBADMSG,
		      "NUL in a path refused");
		snprintf(m, sizeof(m), "%s", manifest);
		m[65] = 'o';
		CHECK(kc_object_manifest_check(m, mlen, why, sizeof(why)) == -EBADMSG,
		      "relative path refused");
		m[65] = '/';
		m[3] = 'A';
		CHECK(kc_object_manifest_check(m, mlen, why, sizeof(why)) == -EBADMSG,
		      "uppercase digest refused");
	}

	/* round trips */
	CHECK(kc_object_build(KC_OBJECT_CUBIN, okey, manifest, mlen, cubin, sizeof(cubin),
			      &no_secret, &obj, &len) == 0, "build an unsigned cubin object");
	CHECK(kc_object_parse(obj, len, KC_OBJECT_CUBIN, okey, &no_secret, &o, why,
			      sizeof(why)) == 0 && o.cubin_len == sizeof(cubin) &&
		      memcmp(o.cubin, cubin, sizeof(cubin)) == 0 && o.manifest_len == mlen &&
		      memcmp(o.manifest, manifest, mlen) == 0 && !o.signed_,
	      "unsigned object round-trips");
	CHECK(parses(obj, len, KC_OBJECT_CUBIN, okey, &secret) == -EBADMSG,
	      "unsigned object refused when a key is set");
	CHECK(parses(obj, len, KC_OBJECT_INDEX, okey, &no_secret) == -EBADMSG,
	      "cubin object refused as an index");
	CHECK(parses(obj, len, KC_OBJECT_CUBIN, mkey, &no_secret) == -EBADMSG,
	      "object refused under another key");
	free(obj);

	CHECK(kc_object_build(KC_OBJECT_CUBIN, okey, manifest, mlen, cubin, sizeof(cubin), &secret,
			      &obj, &len) == 0, "build a signed cubin object");
	CHECK(kc_object_parse(obj, len, KC_OBJECT_CUBIN, okey, &secret, &o, why, sizeof(why)) ==
			      0 && o.signed_ && memcmp(o.cubin, cubin, sizeof(cubin)) == 0,
	      "signed object round-trips");
	CHECK(parses(obj, len, KC_OBJECT_CUBIN, okey, &other) == -EBADMSG,
	      "signed object refused with another secret");

	/* truncated at every length, and one byte too many */
	int all_refused = 1;
	for (size_t n = 0; n < len; n++)
		if (parses(obj, n, KC_OBJECT_CUBIN, okey, &secret) != -EBADMSG)
			all_refused = 0;
	CHECK(all_refused, "every truncation refused");
	bad = malloc(len + 1);
	memcpy(bad, obj, len);
	bad[len] = '\n';
	CHECK(parses(bad, len + 1, KC_OBJECT_CUBIN, okey, &secret) == -EBADMSG,
	      "trailing byte refused");
	free(bad);
	free(obj);

	/* a flipped byte anywhere: signed refuses every one; unsigned every one outside what
	 * only the (absent) signature covers */
	CHECK(kc_object_build(KC_OBJECT_CUBIN, okey, manifest, mlen, cubin, sizeof(cubin), &secret,
			      &obj, &len) == 0 && flips_refused(obj, len, okey, &secret, 0, 0),
	      "every flipped byte refused (signed)");
	free(obj);
	CHECK(kc_object_build(KC_OBJECT_CUBIN, okey, manifest, mlen, cubin, sizeof(cubin),
			      &no_secret, &obj, &len) == 0, "build unsigned again");
	size_t manifest_at = len - sizeof(cubin) - mlen - KC_SHA256_HEXLEN - 1;
	CHECK(flips_refused(obj, len, okey, &no_secret, manifest_at, manifest_at + mlen),
	      "every flipped byte of header, cubin and SHA-256 refused (unsigned)");
	free(obj);

	/* a valid cubin of another kernel under the key: its own SHA-256 verifies, the
	 * signature (over the key) does not */
	CHECK(kc_object_build(KC_OBJECT_CUBIN, okey, manifest, mlen, cubin2, sizeof(cubin2),
			      &other, &obj, &len) == 0 &&
		      parses(obj, len, KC_OBJECT_CUBIN, okey, &secret) == -EBADMSG,
	      "another kernel's cubin signed with another secret refused");
	free(obj);
	CHECK(kc_object_build(KC_OBJECT_CUBIN, mkey, manifest, mlen, cubin2, sizeof(cubin2),
			      &secret, &obj, &len) == 0 &&
		      parses(obj, len, KC_OBJECT_CUBIN, okey, &secret) == -EBADMSG,
	      "an object stored under another key refused");
	{ /* the same object with its header's key rewritten: the signature covers the key */
		memcpy(obj + strlen(KC_OBJECT_MAGIC) + 6, okey, KC_SHA256_HEXLEN);
		CHECK(parses(obj, len, KC_OBJECT_CUBIN, okey, &secret) == -EBADMSG,
		      "rewritten key refused by the signature");
	}
	free(obj);

	/* not a CUDA ELF */
	{
		unsigned char notelf[300];
		memset(notelf, 'x', sizeof(notelf));
		CHECK(kc_object_build(KC_OBJECT_CUBIN, okey, manifest, mlen, notelf,
				      sizeof(notelf), &secret, &obj, &len) == 0 &&
			      kc_object_parse(obj, len, KC_OBJECT_CUBIN, okey, &secret, &o, why,
					      sizeof(why)) == -EBADMSG && strstr(why, "ELF"),
		      "a signed object whose bytes are no CUDA ELF refused");
		free(obj);
		CHECK(kc_object_build(KC_OBJECT_CUBIN, okey, manifest, mlen, cubin, 40, &secret,
				      &obj, &len) == 0 &&
			      parses(obj, len, KC_OBJECT_CUBIN, okey, &secret) == -EBADMSG,
		      "a truncated ELF refused");
		free(obj);
	}

	/* index objects */
	CHECK(kc_object_build(KC_OBJECT_INDEX, mkey, manifest, mlen, cubin, 10, &secret, &obj,
			      &len) == -EINVAL, "an index carries no cubin");
	CHECK(kc_object_build(KC_OBJECT_INDEX, mkey, manifest, mlen, NULL, 0, &secret, &obj,
			      &len) == 0 &&
		      kc_object_parse(obj, len, KC_OBJECT_INDEX, mkey, &secret, &o, why,
				      sizeof(why)) == 0 && o.cubin == NULL && o.manifest_len == mlen,
	      "index round-trips");
	CHECK(parses(obj, len, KC_OBJECT_CUBIN, mkey, &secret) == -EBADMSG,
	      "index refused as a cubin object");
	free(obj);
	{ /* an index with a broken manifest, signed by the right key, is still refused */
		char m[200];
		snprintf(m, sizeof(m), "%s", manifest + mlen / 2);
		snprintf(m + strlen(m), sizeof(m) - strlen(m), "%s", manifest);
		m[strlen(m) - 1] = '\0';
		CHECK(kc_object_build(KC_OBJECT_INDEX, mkey, m, strlen(m), NULL, 0, &secret, &obj,
				      &len) == 0 &&
			      parses(obj, len, KC_OBJECT_INDEX, mkey, &secret) == -EBADMSG,
		      "signed index with a malformed manifest refused");
		free(obj);
	}

	/* garbage */
	{
		char g[4096];
		unsigned x = 12345;
		int refused = 1;
		for (int round = 0; round < 200; round++) {
			size_t n = (size_t)(x % sizeof(g));
			for (size_t i = 0; i < n; i++) {
				x = x * 1103515245u + 12345u;
				g[i] = (char)(x >> 16);
			}
			if (round % 2) /* a right magic, garbage after it */
				memcpy(g, KC_OBJECT_MAGIC "cubin ", n > 25 ? 25 : n);
			if (parses(g, n, KC_OBJECT_CUBIN, okey, &no_secret) != -EBADMSG)
				refused = 0;
		}
		CHECK(refused, "garbage refused");
		const char *big = KC_OBJECT_MAGIC "cubin 1111111111111111111111111111111111111111111111111111111111111111 99999999999999999999999 0 0\n";
		CHECK(parses(big, strlen(big), KC_OBJECT_CUBIN,
			     "1111111111111111111111111111111111111111111111111111111111111111",
			     &no_secret) == -EBADMSG, "overflowing length refused");
		const char *lz = KC_OBJECT_MAGIC "cubin 1111111111111111111111111111111111111111111111111111111111111111 00 0 0\n";
		CHECK(parses(lz, strlen(lz), KC_OBJECT_CUBIN,
			     "1111111111111111111111111111111111111111111111111111111111111111",
			     &no_secret) == -EBADMSG, "leading zero refused");
	}
	return tap_done();
}
