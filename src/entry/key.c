/* key.c - see key.h */
#define _GNU_SOURCE
#include "key.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flags.h"
#include "tree.h"

/* Flags with which nvcc writes file paths into the cubin (its line table). */
static const char *const path_flags[] = {
	"-lineinfo", "--generate-line-info", "-G", "--device-debug", "-g", "--debug", NULL,
};

/* Whether text (len bytes) has, as a word between blanks, '=' and ',' (so also inside
 * -Xptxas=-g,-v), a flag of path_flags. Erring on the side of keeping paths costs only
 * sharing. */
static int has_path_flag(const char *text, size_t len)
{
	static const char sep[] = " \t\r\n=,";
	for (size_t i = 0; i < len;) {
		while (i < len && text[i] && strchr(sep, text[i]))
			i++;
		size_t start = i;
		while (i < len && (!text[i] || !strchr(sep, text[i])))
			i++;
		for (int k = 0; i > start && path_flags[k]; k++)
			if (strlen(path_flags[k]) == i - start &&
			    memcmp(text + start, path_flags[k], i - start) == 0)
				return 1;
	}
	return 0;
}

/* The line's length without its newline (and a '\r' before it). */
static size_t line_len(const char *line, size_t left)
{
	const char *nl = memchr(line, '\n', left);
	size_t ll = nl ? (size_t)(nl - line) : left;
	return ll && line[ll - 1] == '\r' ? ll - 1 : ll;
}

/* The digest of the include root line of flags whose dir is dir (dl bytes), or NULL. */
static const char *root_digest(const char *flags, size_t len, const char *dir, size_t dl)
{
	for (size_t off = 0; off < len;) {
		const char *line = flags + off, *d, *rd;
		const char *nl = memchr(line, '\n', len - off);
		size_t rdl, ll = line_len(line, len - off);
		off = nl ? (size_t)(nl - flags) + 1 : len;
		if (kc_tree_root_line(line, ll, &d, &rd, &rdl) && rdl == dl && memcmp(rd, dir, dl) == 0)
			return d;
	}
	return NULL;
}

int kc_key_keeps_paths(const char *flags, size_t len, const char *extra, int key_paths)
{
	return key_paths || has_path_flag(flags, len) ||
	       (extra && has_path_flag(extra, strlen(extra)));
}

static int keep_line(FILE *f, const struct kc_flags_line *l, void *arg)
{
	(void)f, (void)l, (void)arg;
	return 0;
}

int kc_key_rewrite(const char *flags, size_t len,
		   int (*fn)(FILE *f, const struct kc_flags_line *l, void *arg), void *arg,
		   char **out, size_t *outlen)
{
	char *buf = NULL;
	size_t used = 0;
	FILE *f = open_memstream(&buf, &used);
	if (!f)
		return -ENOMEM;
	for (size_t off = 0; off < len;) {
		const char *line = flags + off, *nl = memchr(line, '\n', len - off);
		size_t ll = line_len(line, len - off);
		off = nl ? (size_t)(nl - flags) + 1 : len;
		char copy[4200];
		snprintf(copy, sizeof(copy), "%.*s", (int)(ll < 4100 ? ll : 4100), line);
		/* a line with a NUL or longer than copy is kept as it is (no flag of the mount's) */
		const char *inc = ll < 4100 && strlen(copy) == ll ? kc_flags_include_dir(copy) : NULL;
		struct kc_flags_line l = {line, ll, inc ? copy : NULL, inc};
		if (!fn(f, &l, arg))
			fprintf(f, "%.*s\n", (int)ll, line);
	}
	if (fclose(f) != 0) {
		free(buf);
		return -ENOMEM;
	}
	*out = buf;
	*outlen = used;
	return 0;
}

/* kc_key_canonical's rewrite of a line: a root line loses its dir, an include argument of
 * a root's dir names the root's digest (arg: the flags text, whose roots those are). */
struct canon_arg {
	const char *flags;
	size_t len;
};

static int canon_line(FILE *f, const struct kc_flags_line *l, void *arg)
{
	const struct canon_arg *c = arg;
	const char *d, *dir, *digest;
	size_t dl;
	if (kc_tree_root_line(l->line, l->ll, &d, &dir, &dl)) {
		fprintf(f, "%s%.*s\n", KC_TREE_ROOT_TAG, KC_SHA256_HEXLEN, d);
		return 1;
	}
	if (l->inc && (digest = root_digest(c->flags, c->len, l->inc, strlen(l->inc)))) {
		fprintf(f, "%.*s%.*s\n", (int)(l->inc - l->copy), l->copy, KC_SHA256_HEXLEN, digest);
		return 1;
	}
	return 0;
}

int kc_key_canonical(const char *flags, size_t len, const char *extra, int key_paths,
		     char **out, size_t *outlen)
{
	int roots = 0, keep_paths = kc_key_keeps_paths(flags, len, extra, key_paths);
	const char *d, *dir;
	size_t dl;

	for (size_t off = 0; off < len && !roots;) {
		const char *nl = memchr(flags + off, '\n', len - off);
		roots = kc_tree_root_line(flags + off, line_len(flags + off, len - off), &d, &dir, &dl);
		off = nl ? (size_t)(nl - flags) + 1 : len;
	}
	if (!roots)
		return 0;
	if (keep_paths) /* as it is, each line with a newline */
		return kc_key_rewrite(flags, len, keep_line, NULL, out, outlen) ? -ENOMEM : 1;
	struct canon_arg c = {flags, len};
	return kc_key_rewrite(flags, len, canon_line, &c, out, outlen) ? -ENOMEM : 1;
}

int kc_key_compute(const void *source, size_t source_len, const void *flags, size_t flags_len,
		   char hex[KC_SHA256_HEXLEN + 1])
{
	struct kc_sha256 h;
	char *canon = NULL;
	size_t canon_len = 0;
	int v2 = kc_key_canonical(flags, flags_len, NULL, 0, &canon, &canon_len);
	int err = v2 < 0 ? v2 : kc_sha256_init(&h);

	if (err) {
		free(canon);
		return err;
	}
	kc_sha256_update(&h, v2 ? "kcachefs-key-v2\n" : "kcachefs-key-v1\n", 16);
	kc_sha256_field(&h, source, source_len);
	if (v2)
		kc_sha256_field(&h, canon, canon_len);
	else
		kc_sha256_field(&h, flags, flags_len);
	kc_sha256_final(&h, hex);
	free(canon);
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
		 "%.64s%s (-o verify_keys; see src/entry/key.h)", (int)(n >= 16 && n <= 64 ? n : 64),
		 key, hash, n > 64 ? "...: longer than a SHA-256" : "");
	return 0;
}
