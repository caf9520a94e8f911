/* remote_object.c - see remote_object.h */
#include "remote_object.h"

#include <errno.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compile.h"
#include "remote_manifest.h"
#include "util.h"

static const char *const kind_names[] = {[KC_OBJECT_INDEX] = "index", [KC_OBJECT_CUBIN] = "cubin",
					 [KC_OBJECT_HISTORY] = "history"};

/* SHA-256 over tag, then the fields a (a string) and b/blen (b may be NULL: left out). */
static int derive(const char *tag, const char *a, const char *b, size_t blen,
		  char key[KC_SHA256_HEXLEN + 1])
{
	struct kc_sha256 h;
	int err = kc_sha256_init(&h);
	if (err)
		return err;
	kc_sha256_update(&h, tag, strlen(tag));
	kc_sha256_field(&h, a, strlen(a));
	if (b)
		kc_sha256_field(&h, b, blen);
	kc_sha256_final(&h, key);
	return 0;
}

int kc_object_manifest_key(const char *recipe_hash, char key[KC_SHA256_HEXLEN + 1])
{
	return derive("kcachefs-manifest-key-v3\n", recipe_hash, NULL, 0, key);
}

int kc_object_list_key(const char *list_hash, char key[KC_SHA256_HEXLEN + 1])
{
	return derive("kcachefs-header-list-key-v1\n", list_hash, NULL, 0, key);
}

int kc_object_lists_key(char key[KC_SHA256_HEXLEN + 1])
{
	return derive("kcachefs-header-lists-key-v1\n", "", NULL, 0, key);
}

int kc_object_history_key(const char *context, char key[KC_SHA256_HEXLEN + 1])
{
	return derive("kcachefs-history-key-v1\n", context, NULL, 0, key);
}

int kc_object_histories_key(char key[KC_SHA256_HEXLEN + 1])
{
	return derive("kcachefs-histories-key-v1\n", "", NULL, 0, key);
}

int kc_object_cubin_key(const char *manifest_key, const char *manifest, size_t manifest_len,
			char key[KC_SHA256_HEXLEN + 1])
{
	return derive("kcachefs-object-key-v1\n", manifest_key, manifest ? manifest : "",
		      manifest_len, key);
}

/* The compact form (remote_manifest.h): 1 to KC_MANIFEST_PER_KEY lines
 * "<sha256> @headers", no digest twice. Returns 0 or -EBADMSG with why. */
static int compact_check(const char *m, size_t len, char *why, size_t whylen)
{
	const size_t ll = KC_SHA256_HEXLEN + 1 + strlen(KC_MANIFEST_LIST_NAME) + 1;
	size_t n = len / ll;
	if (len % ll || n < 1 || n > KC_MANIFEST_PER_KEY) {
		snprintf(why, whylen, "compact manifest of %zu bytes is not 1 to %d lines", len,
			 KC_MANIFEST_PER_KEY);
		return -EBADMSG;
	}
	for (size_t i = 0; i < n; i++) {
		const char *l = m + i * ll;
		if (!kc_hex_lower(l, KC_SHA256_HEXLEN) || l[KC_SHA256_HEXLEN] != ' ' ||
		    memcmp(l + KC_SHA256_HEXLEN + 1, KC_MANIFEST_LIST_NAME,
			   strlen(KC_MANIFEST_LIST_NAME)) != 0 || l[ll - 1] != '\n') {
			snprintf(why, whylen, "compact manifest line %zu is not \"<sha256> %s\"",
				 i + 1, KC_MANIFEST_LIST_NAME);
			return -EBADMSG;
		}
		for (size_t j = 0; j < i; j++)
			if (memcmp(l, m + j * ll, KC_SHA256_HEXLEN) == 0) {
				snprintf(why, whylen, "compact manifest line %zu is repeated", i + 1);
				return -EBADMSG;
			}
	}
	return 0;
}

int kc_object_manifest_check(const char *m, size_t len, char *why, size_t whylen)
{
	const char *prev = NULL;
	size_t prev_len = 0, line = 0;

	if (len > KC_OBJECT_MAX_MANIFEST) {
		snprintf(why, whylen, "manifest of %zu bytes is over the limit", len);
		return -EBADMSG;
	}
	if (len > KC_SHA256_HEXLEN + 1 && m[KC_SHA256_HEXLEN + 1] == KC_MANIFEST_LIST_NAME[0])
		return compact_check(m, len, why, whylen);
	for (size_t off = 0; off < len; line++) {
		const char *nl = memchr(m + off, '\n', len - off);
		if (!nl) {
			snprintf(why, whylen, "manifest line %zu is not terminated", line + 1);
			return -EBADMSG;
		}
		size_t ll = (size_t)(nl - (m + off));
		const char *path = m + off + KC_SHA256_HEXLEN + 1;
		size_t path_len = ll > KC_SHA256_HEXLEN + 1 ? ll - KC_SHA256_HEXLEN - 1 : 0;
		if (ll < KC_SHA256_HEXLEN + 2 || !kc_hex_lower(m + off, KC_SHA256_HEXLEN) ||
		    m[off + KC_SHA256_HEXLEN] != ' ' ||
		    (path[0] != '/' && ((path[0] != '>' && path[0] != '+') || path_len < 2 ||
					path[1] != '/')) ||
		    memchr(path, '\0', path_len)) {
			snprintf(why, whylen, "manifest line %zu is not \"<sha256> /<path>\" (or "
				 ">/<path>, +/<path>)", line + 1);
			return -EBADMSG;
		}
		if (prev) {
			size_t n = prev_len < path_len ? prev_len : path_len;
			int c = memcmp(prev, path, n);
			if (c > 0 || (c == 0 && prev_len >= path_len)) {
				snprintf(why, whylen, "manifest line %zu is out of order or repeated",
					 line + 1);
				return -EBADMSG;
			}
		}
		prev = path;
		prev_len = path_len;
		off += ll + 1;
	}
	return 0;
}

/* The HMAC-SHA256 of n fields (each as hash.h encodes it: "<length>\n<bytes>\n") into
 * hex. Returns 0 or -ENOMEM. */
static int hmac_fields(const struct kc_object_secret *secret, const void *const *fields,
		       const size_t *lens, size_t n, char hex[KC_SHA256_HEXLEN + 1])
{
	static const char digits[] = "0123456789abcdef";
	EVP_MAC *mac = EVP_MAC_fetch(NULL, "HMAC", NULL);
	EVP_MAC_CTX *ctx = mac ? EVP_MAC_CTX_new(mac) : NULL;
	OSSL_PARAM params[] = {
		OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, "SHA256", 0),
		OSSL_PARAM_construct_end(),
	};
	unsigned char md[EVP_MAX_MD_SIZE];
	size_t mdlen = 0;
	int ok = ctx && EVP_MAC_init(ctx, secret->bytes, secret->len, params) == 1;

	for (size_t i = 0; ok && i < n; i++) {
		char num[32];
		int nl = snprintf(num, sizeof(num), "%zu\n", lens[i]);
		ok = EVP_MAC_update(ctx, (const unsigned char *)num, (size_t)nl) == 1 &&
		     (!lens[i] || EVP_MAC_update(ctx, fields[i], lens[i]) == 1) &&
		     EVP_MAC_update(ctx, (const unsigned char *)"\n", 1) == 1;
	}
	ok = ok && EVP_MAC_final(ctx, md, &mdlen, sizeof(md)) == 1 && mdlen == KC_SHA256_HEXLEN / 2;
	EVP_MAC_CTX_free(ctx);
	EVP_MAC_free(mac);
	if (!ok)
		return -ENOMEM;
	for (size_t i = 0; i < mdlen; i++) {
		hex[2 * i] = digits[md[i] >> 4];
		hex[2 * i + 1] = digits[md[i] & 15];
	}
	hex[KC_SHA256_HEXLEN] = '\0';
	return 0;
}

/* The HMAC-SHA256 of an object's fields into hex. Returns 0 or -ENOMEM. */
static int object_hmac(const struct kc_object_secret *secret, enum kc_object_kind kind,
		       const char *key, const char *manifest, size_t manifest_len,
		       const void *cubin, size_t cubin_len, char hex[KC_SHA256_HEXLEN + 1])
{
	const void *fields[] = {KC_OBJECT_MAGIC, kind_names[kind], key, manifest, cubin};
	size_t lens[] = {strlen(KC_OBJECT_MAGIC), strlen(kind_names[kind]), strlen(key),
			 manifest_len, cubin_len};
	return hmac_fields(secret, fields, lens, sizeof(lens) / sizeof(*lens), hex);
}

int kc_object_build(enum kc_object_kind kind, const char *key, const char *manifest,
		    size_t manifest_len, const void *cubin, size_t cubin_len,
		    const struct kc_object_secret *secret, char **out, size_t *out_len)
{
	char head[200], sha[KC_SHA256_HEXLEN + 1], mac[KC_SHA256_HEXLEN + 1];
	int sign = secret && secret->len > 0;

	if (!kc_hex_lower_str(key, KC_SHA256_HEXLEN) || (kind != KC_OBJECT_CUBIN && cubin_len) ||
	    manifest_len > KC_OBJECT_MAX_MANIFEST || cubin_len > KC_OBJECT_MAX_CUBIN)
		return -EINVAL;
	if (kc_sha256_buf(cubin_len ? cubin : "", cubin_len, sha) != 0 ||
	    (sign && object_hmac(secret, kind, key, manifest, manifest_len, cubin, cubin_len, mac)))
		return -ENOMEM;
	int hl = snprintf(head, sizeof(head), KC_OBJECT_MAGIC "%s %s %zu %zu %d\n",
			  kind_names[kind], key, manifest_len, cubin_len, sign);
	size_t total = (size_t)hl + manifest_len + cubin_len + KC_SHA256_HEXLEN + 1 +
		       (sign ? KC_SHA256_HEXLEN + 1 : 0);
	char *buf = malloc(total), *p = buf;
	if (!buf)
		return -ENOMEM;
	memcpy(p, head, (size_t)hl);
	p += hl;
	if (manifest_len)
		memcpy(p, manifest, manifest_len);
	p += manifest_len;
	if (cubin_len)
		memcpy(p, cubin, cubin_len);
	p += cubin_len;
	memcpy(p, sha, KC_SHA256_HEXLEN);
	p[KC_SHA256_HEXLEN] = '\n';
	p += KC_SHA256_HEXLEN + 1;
	if (sign) {
		memcpy(p, mac, KC_SHA256_HEXLEN);
		p[KC_SHA256_HEXLEN] = '\n';
	}
	*out = buf;
	*out_len = total;
	return 0;
}

/* Parse a decimal length at *p (no sign, no leading zero, at most max) ending at stop.
 * Returns 0 and advances *p past stop, or -1. */
static int parse_len(const char **p, const char *end, char stop, size_t max, size_t *v)
{
	const char *s = *p;
	size_t n = 0;
	if (s >= end || *s < '0' || *s > '9' || (*s == '0' && s + 1 < end && s[1] != stop))
		return -1;
	for (; s < end && *s >= '0' && *s <= '9'; s++) {
		n = n * 10 + (size_t)(*s - '0');
		if (n > max)
			return -1;
	}
	if (s >= end || *s != stop)
		return -1;
	*v = n;
	*p = s + 1;
	return 0;
}

#define REJECT(...) (snprintf(why, whylen, __VA_ARGS__), -EBADMSG)

int kc_object_parse(const char *data, size_t len, enum kc_object_kind kind,
		    const char *want_key, const struct kc_object_secret *secret,
		    struct kc_object *obj, char *why, size_t whylen)
{
	const char *p = data, *end = data + len;
	size_t ml, cl, kl = strlen(kind_names[kind]), sign;
	char sha[KC_SHA256_HEXLEN + 1], mac[KC_SHA256_HEXLEN + 1];
	int want_sign = secret && secret->len > 0;

	memset(obj, 0, sizeof(*obj));
	if (len < strlen(KC_OBJECT_MAGIC) || memcmp(p, KC_OBJECT_MAGIC, strlen(KC_OBJECT_MAGIC)))
		return REJECT("not a kcachefs object (%zu bytes without the magic)", len);
	p += strlen(KC_OBJECT_MAGIC);
	if ((size_t)(end - p) < kl + 1 || memcmp(p, kind_names[kind], kl) || p[kl] != ' ')
		return REJECT("not an object of kind %s", kind_names[kind]);
	p += kl + 1;
	if ((size_t)(end - p) < KC_SHA256_HEXLEN + 1 || p[KC_SHA256_HEXLEN] != ' ' ||
	    !kc_hex_lower(p, KC_SHA256_HEXLEN))
		return REJECT("malformed key in the object's header");
	if (memcmp(p, want_key, KC_SHA256_HEXLEN) != 0 || strlen(want_key) != KC_SHA256_HEXLEN)
		return REJECT("object is for key %.16s, not %.16s", p, want_key);
	p += KC_SHA256_HEXLEN + 1;
	if (parse_len(&p, end, ' ', KC_OBJECT_MAX_MANIFEST, &ml) ||
	    parse_len(&p, end, ' ', kind == KC_OBJECT_CUBIN ? KC_OBJECT_MAX_CUBIN : 0, &cl) ||
	    parse_len(&p, end, '\n', 1, &sign))
		return REJECT("malformed lengths in the object's header");
	size_t tail = KC_SHA256_HEXLEN + 1 + (sign ? KC_SHA256_HEXLEN + 1 : 0);
	if ((size_t)(end - p) != ml + cl + tail)
		return REJECT("object is %zu bytes, its header says %zu", len,
			      (size_t)(p - data) + ml + cl + tail);
	if (want_sign && !sign)
		return REJECT("object is not signed and -o remote_key is set");
	obj->kind = kind;
	obj->manifest = p;
	obj->manifest_len = ml;
	obj->cubin = kind == KC_OBJECT_CUBIN ? p + ml : NULL;
	obj->cubin_len = cl;
	obj->signed_ = (int)sign;
	p += ml + cl;
	if (p[KC_SHA256_HEXLEN] != '\n' || !kc_hex_lower(p, KC_SHA256_HEXLEN))
		return REJECT("malformed SHA-256 line");
	if (kc_sha256_buf(cl ? obj->cubin : "", cl, sha) != 0)
		return -ENOMEM;
	if (memcmp(sha, p, KC_SHA256_HEXLEN) != 0)
		return REJECT("the cubin's SHA-256 differs from the recorded one");
	memcpy(obj->sha256, sha, sizeof(sha));
	p += KC_SHA256_HEXLEN + 1;
	if (want_sign) {
		if (p[KC_SHA256_HEXLEN] != '\n')
			return REJECT("malformed signature line");
		if (object_hmac(secret, kind, want_key, obj->manifest, ml, obj->cubin, cl, mac))
			return -ENOMEM;
		if (CRYPTO_memcmp(mac, p, KC_SHA256_HEXLEN) != 0)
			return REJECT("the signature does not verify (another -o remote_key, or "
				      "the object was altered)");
	}
	if (kind != KC_OBJECT_HISTORY && kc_object_manifest_check(obj->manifest, ml, why, whylen))
		return -EBADMSG; /* a history's bytes are checked by its reader (history.h) */
	if (kind == KC_OBJECT_CUBIN) {
		char what[200];
		if (kc_cubin_check_buf(obj->cubin, cl, what, sizeof(what)))
			return REJECT("%s", what);
	}
	return 0;
}

static const char *const lease_words[] = {[KC_LEASE_HELD] = "held", [KC_LEASE_FAILED] = "failed"};

/* The HMAC of a lease record's fields: a tag, the key, its state word, token and ttl. */
static int lease_hmac(const struct kc_object_secret *secret, const char *key,
		      enum kc_lease_state state, const char *token, const char *ttl,
		      char hex[KC_SHA256_HEXLEN + 1])
{
	static const char tag[] = "kcachefs-lease-v1\n";
	const void *fields[] = {tag, key, lease_words[state], token, ttl};
	size_t lens[] = {strlen(tag), strlen(key), strlen(lease_words[state]), strlen(token),
			 strlen(ttl)};
	return hmac_fields(secret, fields, lens, sizeof(lens) / sizeof(*lens), hex);
}

int kc_lease_record(const struct kc_object_secret *secret, const char *key,
		    enum kc_lease_state state, const char *token, unsigned ttl_ms,
		    char out[KC_LEASE_RECORD_MAX])
{
	char ttl[16], mac[KC_SHA256_HEXLEN + 1] = "-";
	if (!kc_hex_lower_str(key, KC_SHA256_HEXLEN) || state == KC_LEASE_NONE || !ttl_ms ||
	    !token || strlen(token) != KC_REMOTE_TOKENLEN)
		return -EINVAL;
	snprintf(ttl, sizeof(ttl), "%u", ttl_ms);
	if (secret && secret->len > 0 && lease_hmac(secret, key, state, token, ttl, mac))
		return -ENOMEM;
	return snprintf(out, KC_LEASE_RECORD_MAX, "%s %s %s %s", lease_words[state], token, ttl,
			mac);
}

int kc_lease_check(const struct kc_object_secret *secret, const char *key, const char *rec,
		   size_t len, unsigned held_max_ms, unsigned note_max_ms,
		   struct kc_lease_seen *seen, char *why, size_t whylen)
{
	char buf[KC_LEASE_RECORD_MAX], word[8], token[KC_REMOTE_TOKENLEN + 2], ttl[16],
		mac[KC_SHA256_HEXLEN + 2], want[KC_SHA256_HEXLEN + 1];
	const char *nl = memchr(rec, '\n', len);
	size_t n = nl ? (size_t)(nl - rec) : len;
	unsigned long ms;
	char *end;

	memset(seen, 0, sizeof(*seen));
	if (n >= sizeof(buf) || memchr(rec, '\0', n))
		return REJECT("a lease record of %zu bytes", n);
	memcpy(buf, rec, n);
	buf[n] = '\0';
	if (sscanf(buf, "%7s %33s %15s %65s", word, token, ttl, mac) != 4 ||
	    strlen(token) != KC_REMOTE_TOKENLEN || strspn(token, "0123456789abcdef") !=
	    KC_REMOTE_TOKENLEN || ttl[0] < '1' || ttl[0] > '9')
		return REJECT("a malformed lease record");
	if (strcmp(word, "held") == 0)
		seen->state = KC_LEASE_HELD;
	else if (strcmp(word, "failed") == 0)
		seen->state = KC_LEASE_FAILED;
	else
		return REJECT("a lease record of unknown kind");
	errno = 0;
	ms = strtoul(ttl, &end, 10);
	if (errno || *end || ms > (seen->state == KC_LEASE_HELD ? held_max_ms : note_max_ms))
		return REJECT("a %s record whose ttl %s ms is over the bound of %u ms", word, ttl,
			      seen->state == KC_LEASE_HELD ? held_max_ms : note_max_ms);
	if (secret && secret->len > 0) {
		if (lease_hmac(secret, key, seen->state, token, ttl, want))
			return -ENOMEM;
		if (strlen(mac) != KC_SHA256_HEXLEN || CRYPTO_memcmp(mac, want, KC_SHA256_HEXLEN))
			return REJECT("a %s record not signed with -o remote_key", word);
	}
	memcpy(seen->token, token, KC_REMOTE_TOKENLEN + 1);
	seen->ttl_ms = (unsigned)ms;
	return 0;
}
