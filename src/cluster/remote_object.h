/* remote_object.h - the objects of the cluster store and their keys; no I/O.
 *
 * Two levels, as ccache's direct mode: the lookup key must be known before compiling, but
 * the headers a compile reads are known only after it.
 *   manifest key = SHA-256("kcachefs-manifest-key-v3", the recipe's code key (code.h),
 *                  or its recipe hash where it has none). The recipe hash
 *                  (recipe.h) already covers source, entry and mount flags, compiler
 *                  identity (version and build, not its path), arch and backend, and the
 *                  bytes of the include roots a shim recipe names (key.h).
 *   index object   stored under the manifest key: its manifest is the compact one
 *                  (remote_manifest.h): "" or "<sha256 of the header list> @headers\n";
 *                  it carries no cubin.
 *   header list    an index-kind object under SHA-256("kcachefs-header-list-key-v1", its
 *                  digest): the headers the compile read outside the toolkit and the
 *                  include roots, each "<sha256-hex> <path>\n" (sorted); stored once,
 *                  shared by every kernel that reads the same headers.
 *   object key   = SHA-256("kcachefs-object-key-v1", manifest key, manifest). A node hashes
 *                  its own copies of the list's headers, builds its own compact manifest
 *                  and so its own object key: a node whose headers differ asks for another
 *                  key (a miss).
 *   cubin object   stored under the object key: the same compact manifest and the cubin.
 *   history        compile ahead's record of what an image asked (history.h), under the
 *                  key of its context, and the list of the contexts stored last.
 *
 * Serialized object (every length checked on parse, nothing trusted):
 *   "kcachefs-object-v1\n"
 *   "<kind> <key> <manifest length> <cubin length> <signed 0|1>\n"   kind: index | cubin
 *   <manifest bytes><cubin bytes>
 *   "<SHA-256 hex of the cubin bytes>\n"
 *   "<HMAC-SHA256 hex>\n"                     only when signed
 * The HMAC (-o remote_key=FILE) is over the magic, kind, key, manifest and cubin, each as a
 * length-prefixed field (hash.h's encoding), so no two objects sign alike.
 */
#ifndef KC_REMOTE_OBJECT_H
#define KC_REMOTE_OBJECT_H

#include <stddef.h>

#include "hash.h"
#include "remote.h"

#define KC_OBJECT_MAGIC "kcachefs-object-v1\n"
#define KC_OBJECT_MAX_MANIFEST (8u << 20)  /* bytes of a manifest accepted (a DeepGEMM kernel's
					    * traced list: about 0.8 MB) */
#define KC_OBJECT_MAX_CUBIN (256u << 20)   /* bytes of a cubin accepted */
#define KC_OBJECT_MIN_SECRET 16            /* bytes of a -o remote_key= secret, at least */

enum kc_object_kind {
	KC_OBJECT_INDEX, /* the header list under a manifest key; no cubin */
	KC_OBJECT_CUBIN, /* a compiled cubin under its object key */
	KC_OBJECT_HISTORY, /* compile ahead's records (history.h), in the manifest; no cubin:
			    * a history under kc_object_history_key, or the contexts of the
			    * histories stored last under kc_object_histories_key */
};

/* The HMAC secret (-o remote_key=); len 0: objects are neither signed nor required to be. */
struct kc_object_secret {
	const unsigned char *bytes; /* borrowed */
	size_t len;
};

/* A parsed, verified object: pointers into the buffer given to kc_object_parse. */
struct kc_object {
	enum kc_object_kind kind;
	const char *manifest;
	size_t manifest_len;
	const char *cubin; /* NULL for an index */
	size_t cubin_len;
	char sha256[KC_SHA256_HEXLEN + 1]; /* of the cubin bytes */
	int signed_;
};

/* The manifest key of a recipe (its 64-hex hash). Returns 0 or -ENOMEM. */
int kc_object_manifest_key(const char *recipe_hash, char key[KC_SHA256_HEXLEN + 1]);

/* The key of the header list whose SHA-256 is list_hash (64 hex). Returns 0 or -ENOMEM. */
int kc_object_list_key(const char *list_hash, char key[KC_SHA256_HEXLEN + 1]);

/* The key of the cluster's record of the header lists its nodes stored last: an index-kind
 * object whose manifest is up to KC_MANIFEST_PER_KEY compact lines, newest first, one per
 * image (remote_tier.h). A joining node reads it at start to check those lists against its
 * own headers before its first fetch asks. Returns 0 or -ENOMEM. */
int kc_object_lists_key(char key[KC_SHA256_HEXLEN + 1]);

/* The key of the history of context (64 hex, code.h): a history-kind object whose
 * manifest is the history's record (history.h). Returns 0 or -ENOMEM. */
int kc_object_history_key(const char *context, char key[KC_SHA256_HEXLEN + 1]);

/* The key of the cluster's record of the contexts whose histories were stored last: a
 * history-kind object whose manifest is up to KC_HISTORIES_PER_KEY lines "<context>\n",
 * newest first. Returns 0 or -ENOMEM. */
int kc_object_histories_key(char key[KC_SHA256_HEXLEN + 1]);
#define KC_HISTORIES_PER_KEY 8

/* The object key of (manifest key, manifest). Returns 0 or -ENOMEM. */
int kc_object_cubin_key(const char *manifest_key, const char *manifest, size_t manifest_len,
			char key[KC_SHA256_HEXLEN + 1]);

/* Check the syntax of a manifest: lines "<64 lowercase hex> /<path>\n" (or ">/<path>": a readlink, "+/<path>": a directory's names, remote_manifest.h), paths without NUL,
 * strictly sorted by path, or the one line "<64 lowercase hex> @headers\n" (compact), at most KC_OBJECT_MAX_MANIFEST bytes (empty is valid). Returns 0
 * or -EBADMSG with why filled. */
int kc_object_manifest_check(const char *manifest, size_t len, char *why, size_t whylen);

/* Serialize an object of kind under key (64 hex) into *out (malloc'd, owned by the caller)
 * / *out_len, signed when secret->len > 0. cubin must be NULL/0 for an index. Returns 0,
 * -EINVAL (a bad key, a cubin on an index, sizes over the limits) or -ENOMEM. */
int kc_object_build(enum kc_object_kind kind, const char *key, const char *manifest,
		    size_t manifest_len, const void *cubin, size_t cubin_len,
		    const struct kc_object_secret *secret, char **out, size_t *out_len);

/* Parse and verify data/len, fetched under want_key, as an object of kind: the format and
 * every length, the key equal to want_key, the manifest's syntax, the cubin's SHA-256, the
 * HMAC when secret->len > 0 (an unsigned object is then refused; compared in constant
 * time), and for a cubin object that its bytes are a complete CUDA ELF. Returns 0 with obj
 * filled (pointing into data), -EBADMSG with why filled (the caller counts it as rejected
 * and never serves it), or -ENOMEM. An unsigned object's manifest is covered only by its
 * key: the caller compares it with the manifest it derived the key from. */
int kc_object_parse(const char *data, size_t len, enum kc_object_kind kind,
		    const char *want_key, const struct kc_object_secret *secret,
		    struct kc_object *obj, char *why, size_t whylen);

/* Lease records (remote.h), the same text on every store:
 *   "<held|failed> <token: 32 hex> <ttl ms, decimal> <HMAC-SHA256 hex, or - unsigned>"
 * The HMAC, with the -o remote_key secret, is over a tag, the object key the record stands
 * on, the kind word, the token and the ttl (length-prefixed fields, as objects are), so a
 * record copied to another key, or with its kind or ttl changed, does not verify. */
#define KC_LEASE_RECORD_MAX 160 /* bytes of a record, with its NUL */

/* What kc_lease_check read from a record. */
struct kc_lease_seen {
	enum kc_lease_state state; /* KC_LEASE_HELD or KC_LEASE_FAILED */
	char token[KC_REMOTE_TOKENLEN + 1];
	unsigned ttl_ms;
};

/* Write the record of a lease (state HELD) or failure note (FAILED) on key for token with
 * ttl_ms into out, signed when secret->len > 0. Returns its length, or -EINVAL (a bad key
 * or token, a zero ttl, state NONE) or -ENOMEM. */
int kc_lease_record(const struct kc_object_secret *secret, const char *key,
		    enum kc_lease_state state, const char *token, unsigned ttl_ms,
		    char out[KC_LEASE_RECORD_MAX]);

/* Check the record rec/len found on key (up to its first newline; the dir: store keeps a
 * liveness line after it): its syntax, its ttl at most held_max_ms (a lease) or
 * note_max_ms (a note), and with a secret its HMAC (an unsigned record is refused;
 * compared in constant time). Returns 0 with *seen filled, -EBADMSG with why filled (the
 * store treats the record as absent: it is taken over), or -ENOMEM. */
int kc_lease_check(const struct kc_object_secret *secret, const char *key, const char *rec,
		   size_t len, unsigned held_max_ms, unsigned note_max_ms,
		   struct kc_lease_seen *seen, char *why, size_t whylen);

#endif
