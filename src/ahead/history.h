/* history.h - which recipes an image asked for: the input of compile ahead.
 *
 * A history belongs to one context (code.h: the compiler identity and the include roots'
 * digests an image compiles under) and lists, in the order first asked, each recipe a
 * client asked the mount to compile or fetch there: its code form (code.h) and its
 * kernel.flags as staged (include roots with their dirs). When a recipe of a new context
 * has the shape of one in another context's history, the others of that history are what
 * the new image will most likely ask next.
 *
 * Serialized (the backing directory's .kcachefs/ahead/history/<context>, and the cluster
 * store's history record, remote_object.h):
 *   "kcachefs-history-v1\n" "<context: 64 hex>\n" "<n>\n"
 *   then n times: "<flags length> <source length>\n" <flags bytes> <source bytes>
 * Every length is checked on parse and nothing in it is trusted: a recipe whose source
 * is not a code form, whose flags name no include root, or past the bounds, makes the whole
 * record refused.
 */
#ifndef KC_HISTORY_H
#define KC_HISTORY_H

#include <stddef.h>

#include "hash.h"

#define KC_HISTORY_MAGIC "kcachefs-history-v1\n"
#define KC_HISTORY_MAX_RECIPES 512      /* recipes one history keeps: later ones are not added */
#define KC_HISTORY_MAX_BYTES (1u << 20) /* bytes of one serialized history, at most */

struct kc_history_recipe {
	char *flags;  /* owned */
	size_t flags_len;
	char *source; /* owned: a code form */
	size_t source_len;
	char shape[KC_SHA256_HEXLEN + 1]; /* code.h; filled by the owner (it needs the config) */
};

struct kc_history {
	char context[KC_SHA256_HEXLEN + 1];
	struct kc_history_recipe *r; /* owned, n of them, in the order first asked */
	size_t n, cap;
	size_t bytes; /* its serialized size */
};

/* An empty history of context. */
void kc_history_init(struct kc_history *h, const char *context);

/* Append a copy of (flags, source) unless a recipe with the same shape is there. Returns 1
 * (added), 0 (there already), -E2BIG (past KC_HISTORY_MAX_RECIPES or _BYTES: not added),
 * -ENOMEM. */
int kc_history_add(struct kc_history *h, const char *flags, size_t flags_len,
		   const char *source, size_t source_len, const char *shape);

/* The index of the recipe with shape in h, or -1. */
long kc_history_find(const struct kc_history *h, const char *shape);

/* Serialize h into *out (malloc'd) / *len. Returns 0 or -ENOMEM. */
int kc_history_format(const struct kc_history *h, char **out, size_t *len);

/* Parse data/len into h (initialised here; shapes left empty), whose context must be want
 * (NULL: any). Returns 0; -EBADMSG with why filled (malformed, another context, past the
 * bounds); -ENOMEM. */
int kc_history_parse(const char *data, size_t len, const char *want, struct kc_history *h,
		     char *why, size_t whylen);

void kc_history_free(struct kc_history *h);

#endif
