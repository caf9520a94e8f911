/* history.c - see history.h */
#define _GNU_SOURCE
#include "history.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t recipe_bytes(size_t flags_len, size_t source_len)
{
	return 44 + flags_len + source_len; /* two lengths, a blank and a newline */
}

void kc_history_init(struct kc_history *h, const char *context)
{
	memset(h, 0, sizeof(*h));
	snprintf(h->context, sizeof(h->context), "%s", context);
	h->bytes = strlen(KC_HISTORY_MAGIC) + KC_SHA256_HEXLEN + 1 + 8;
}

long kc_history_find(const struct kc_history *h, const char *shape)
{
	for (size_t i = 0; i < h->n; i++)
		if (strcmp(h->r[i].shape, shape) == 0)
			return (long)i;
	return -1;
}

static int push(struct kc_history *h, const char *flags, size_t flags_len, const char *source,
		size_t source_len, const char *shape)
{
	if (h->n == h->cap) {
		size_t cap = h->cap ? h->cap * 2 : 16;
		struct kc_history_recipe *r = realloc(h->r, cap * sizeof(*r));
		if (!r)
			return -ENOMEM;
		h->r = r;
		h->cap = cap;
	}
	struct kc_history_recipe *r = &h->r[h->n];
	memset(r, 0, sizeof(*r));
	r->flags = malloc(flags_len + 1);
	r->source = malloc(source_len + 1);
	if (!r->flags || !r->source) {
		free(r->flags);
		free(r->source);
		return -ENOMEM;
	}
	memcpy(r->flags, flags, flags_len);
	r->flags[flags_len] = '\0';
	memcpy(r->source, source, source_len);
	r->source[source_len] = '\0';
	r->flags_len = flags_len;
	r->source_len = source_len;
	if (shape)
		snprintf(r->shape, sizeof(r->shape), "%s", shape);
	h->bytes += recipe_bytes(flags_len, source_len);
	h->n++;
	return 0;
}

int kc_history_add(struct kc_history *h, const char *flags, size_t flags_len,
		   const char *source, size_t source_len, const char *shape)
{
	if (kc_history_find(h, shape) >= 0)
		return 0;
	if (h->n >= KC_HISTORY_MAX_RECIPES ||
	    h->bytes + recipe_bytes(flags_len, source_len) > KC_HISTORY_MAX_BYTES)
		return -E2BIG;
	int err = push(h, flags, flags_len, source, source_len, shape);
	return err ? err : 1;
}

int kc_history_format(const struct kc_history *h, char **out, size_t *len)
{
	char *buf = NULL;
	size_t used = 0;
	FILE *f = open_memstream(&buf, &used);
	if (!f)
		return -ENOMEM;
	fprintf(f, "%s%s\n%zu\n", KC_HISTORY_MAGIC, h->context, h->n);
	for (size_t i = 0; i < h->n; i++) {
		fprintf(f, "%zu %zu\n", h->r[i].flags_len, h->r[i].source_len);
		fwrite(h->r[i].flags, 1, h->r[i].flags_len, f);
		fwrite(h->r[i].source, 1, h->r[i].source_len, f);
	}
	if (fclose(f) != 0) {
		free(buf);
		return -ENOMEM;
	}
	*out = buf;
	*len = used;
	return 0;
}

/* A decimal number at *p ending at the byte stop (within end), at most max: 0 with *v, or
 * -1. *p moves past stop. */
static int number(const char **p, const char *end, char stop, uint64_t max, uint64_t *v)
{
	const char *s = *p;
	uint64_t n = 0;
	if (s >= end || *s < '0' || *s > '9' || (*s == '0' && s + 1 < end && s[1] != stop))
		return -1;
	while (s < end && *s >= '0' && *s <= '9') {
		n = n * 10 + (uint64_t)(*s - '0');
		if (n > max)
			return -1;
		s++;
	}
	if (s >= end || *s != stop)
		return -1;
	*p = s + 1;
	*v = n;
	return 0;
}

static int is_hex64(const char *s, const char *end)
{
	if (end - s < KC_SHA256_HEXLEN + 1 || s[KC_SHA256_HEXLEN] != '\n')
		return 0;
	for (int i = 0; i < KC_SHA256_HEXLEN; i++)
		if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
			return 0;
	return 1;
}

int kc_history_parse(const char *data, size_t len, const char *want, struct kc_history *h,
		     char *why, size_t whylen)
{
	const char *p = data, *end = data + len;
	size_t ml = strlen(KC_HISTORY_MAGIC);
	uint64_t n, fl, sl;
	memset(h, 0, sizeof(*h));
	if (len > KC_HISTORY_MAX_BYTES) {
		snprintf(why, whylen, "%zu bytes, over the %u a history may have", len,
			 KC_HISTORY_MAX_BYTES);
		return -EBADMSG;
	}
	if (len < ml || memcmp(p, KC_HISTORY_MAGIC, ml) != 0 || !is_hex64(p + ml, end)) {
		snprintf(why, whylen, "not a history record");
		return -EBADMSG;
	}
	p += ml;
	char context[KC_SHA256_HEXLEN + 1];
	memcpy(context, p, KC_SHA256_HEXLEN);
	context[KC_SHA256_HEXLEN] = '\0';
	p += KC_SHA256_HEXLEN + 1;
	if (want && strcmp(want, context) != 0) {
		snprintf(why, whylen, "it is the history of context %.16s, not %.16s", context, want);
		return -EBADMSG;
	}
	kc_history_init(h, context);
	if (number(&p, end, '\n', KC_HISTORY_MAX_RECIPES, &n) != 0) {
		snprintf(why, whylen, "a bad count of recipes");
		return -EBADMSG;
	}
	for (uint64_t i = 0; i < n; i++) {
		if (number(&p, end, ' ', KC_HISTORY_MAX_BYTES, &fl) != 0 ||
		    number(&p, end, '\n', KC_HISTORY_MAX_BYTES, &sl) != 0 ||
		    (uint64_t)(end - p) < fl + sl) {
			snprintf(why, whylen, "recipe %" PRIu64 " of %" PRIu64 " is cut or malformed",
				 i + 1, n);
			kc_history_free(h);
			return -EBADMSG;
		}
		int err = push(h, p, fl, p + fl, sl, NULL);
		if (err) {
			kc_history_free(h);
			return err;
		}
		p += fl + sl;
	}
	if (p != end) {
		snprintf(why, whylen, "%zu bytes after its last recipe", (size_t)(end - p));
		kc_history_free(h);
		return -EBADMSG;
	}
	return 0;
}

void kc_history_free(struct kc_history *h)
{
	for (size_t i = 0; i < h->n; i++) {
		free(h->r[i].flags);
		free(h->r[i].source);
	}
	free(h->r);
	h->r = NULL;
	h->n = h->cap = 0;
}
