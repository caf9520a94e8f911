/* code.c - see code.h */
#define _GNU_SOURCE
#include "code.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "key.h"
#include "tree.h"

static int ident_char(char ch)
{
	return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
	       ch == '_';
}

/* Whether s[i] is a backslash that ends its line, possibly with blanks before the newline
 * (GCC splices those too): 1 splice right at the newline, 2 with blanks between, 0 none. */
static int splice_at(const char *s, size_t len, size_t i)
{
	if (s[i] != '\\')
		return 0;
	size_t k = i + 1;
	while (k < len && (s[k] == ' ' || s[k] == '\t' || s[k] == '\r' || s[k] == '\f' ||
			   s[k] == '\v'))
		k++;
	if (k >= len || s[k] != '\n')
		return 0;
	return k == i + 1 ? 1 : 2;
}

/* Whether a line of src that starts at start (len bytes in all) is an #include, #include_next
 * or #import directive whose <header-name> holds a comment opener. */
static int header_name_holds_opener(const char *s, size_t len, size_t start)
{
	size_t i = start, end;
	const char *nl = memchr(s + start, '\n', len - start);
	end = nl ? (size_t)(nl - s) : len;
	while (i < end && (s[i] == ' ' || s[i] == '\t'))
		i++;
	if (i >= end || s[i] != '#')
		return 0;
	i++;
	while (i < end && (s[i] == ' ' || s[i] == '\t'))
		i++;
	if (!((end - i >= 7 && memcmp(s + i, "include", 7) == 0) ||
	      (end - i >= 6 && memcmp(s + i, "import", 6) == 0)))
		return 0;
	const char *lt = memchr(s + i, '<', end - i);
	if (!lt)
		return 0;
	const char *gt = memchr(lt, '>', (size_t)(s + end - lt));
	size_t stop = gt ? (size_t)(gt - s) : end;
	for (size_t k = (size_t)(lt - s); k + 1 < stop; k++)
		if (s[k] == '/' && (s[k + 1] == '/' || s[k + 1] == '*'))
			return 1;
	return 0;
}

enum lex { CODE, STR, CHR, LINE_COMMENT, BLOCK_COMMENT };

int kc_code_blank(const char *s, size_t len, char **out, size_t *outlen)
{
	if (memchr(s, '\0', len) || memmem(s, len, "??", 2))
		return 0; /* a NUL, or what may be a trigraph (-std=c++14 and older read them) */
	char *o = malloc(len + 1);
	if (!o)
		return -ENOMEM;
	enum lex st = CODE;
	size_t n = 0, line_start = 0;
	int sure = 1;
	for (size_t i = 0; i < len && sure; i++) {
		char ch = s[i], next = i + 1 < len ? s[i + 1] : '\0';
		int splice = splice_at(s, len, i);
		if (i == line_start && header_name_holds_opener(s, len, i))
			sure = 0;
		if (ch == '\n') {
			line_start = i + 1;
			while (n > 0 && (o[n - 1] == ' ' || o[n - 1] == '\t' || o[n - 1] == '\f' ||
					 o[n - 1] == '\v'))
				n--; /* trailing blanks: no token follows them */
		}
		switch (st) {
		case CODE:
			if (splice == 2 || (splice && ((i > 0 && s[i - 1] == '/') ||
						       (i + 2 < len && (s[i + 2] == '/' || s[i + 2] == '*'))))) {
				sure = 0;
			} else if (ch == '/' && (next == '/' || next == '*')) {
				st = next == '/' ? LINE_COMMENT : BLOCK_COMMENT;
				o[n++] = ' ';
				o[n++] = ' ';
				i++;
				continue;
			} else if (ch == '"') {
				if (i > 0 && s[i - 1] == 'R')
					sure = 0; /* a raw string literal: its text is not lexed */
				st = STR;
			} else if (ch == '\'') {
				if (i > 0 && ident_char(s[i - 1]))
					sure = 0; /* a digit separator (1'000) or u'x': not lexed here */
				st = CHR;
			}
			o[n++] = ch;
			break;
		case STR:
		case CHR:
			if (ch == '\n' || splice) {
				sure = 0; /* an open literal at a line's end */
			} else if (ch == '\\' && i + 1 < len) {
				o[n++] = ch;
				o[n++] = s[++i];
				if (s[i] == '\n')
					sure = 0;
				continue;
			} else if (ch == (st == STR ? '"' : '\'')) {
				st = CODE;
			}
			o[n++] = ch;
			break;
		case LINE_COMMENT:
			if (splice) {
				sure = 0; /* a spliced line comment goes on to the next line */
			} else if (ch == '\n') {
				st = CODE;
				o[n++] = '\n';
			} else {
				o[n++] = ' ';
			}
			break;
		case BLOCK_COMMENT:
			if (splice) {
				sure = 0;
			} else if (ch == '*' && next == '/') {
				st = CODE;
				o[n++] = ' ';
				o[n++] = ' ';
				i++;
			} else {
				o[n++] = ch == '\n' ? '\n' : ' ';
			}
			break;
		}
	}
	if (!sure || st == STR || st == CHR || st == BLOCK_COMMENT) {
		free(o);
		return 0;
	}
	while (n > 0 && (o[n - 1] == ' ' || o[n - 1] == '\t' || o[n - 1] == '\f' || o[n - 1] == '\v'))
		n--;
	o[n] = '\0';
	*out = o;
	*outlen = n;
	return 1;
}

/* The line of text at *off (len bytes in all): its start and length without the newline
 * (nor a '\r' before it); *off moves past it. */
static const char *next_line(const char *text, size_t len, size_t *off, size_t *ll)
{
	const char *line = text + *off, *nl = memchr(line, '\n', len - *off);
	size_t l = nl ? (size_t)(nl - line) : len - *off;
	*off = nl ? (size_t)(nl - text) + 1 : len;
	*ll = l && line[l - 1] == '\r' ? l - 1 : l;
	return line;
}

/* The include roots of flags: their digests and dirs (pointers into flags), in order.
 * Returns how many (at most max + 1: more than max). */
static unsigned roots_of(const char *flags, size_t len, const char **digest, const char **dir,
			 size_t *dl, unsigned max)
{
	unsigned n = 0;
	for (size_t off = 0; off < len;) {
		size_t ll;
		const char *line = next_line(flags, len, &off, &ll), *d, *r;
		size_t rl;
		if (!kc_tree_root_line(line, ll, &d, &r, &rl))
			continue;
		if (n == max)
			return max + 1;
		digest[n] = d;
		dir[n] = r;
		dl[n] = rl;
		n++;
	}
	return n;
}

/* text (len bytes) with each of the n digests replaced by "@root<i>", into f. */
static void by_place(FILE *f, const char *text, size_t len, const char **digest, unsigned n)
{
	for (size_t i = 0; i < len;) {
		unsigned k = n;
		if (len - i >= KC_SHA256_HEXLEN)
			for (k = 0; k < n; k++)
				if (memcmp(text + i, digest[k], KC_SHA256_HEXLEN) == 0)
					break;
		if (k < n) {
			fprintf(f, "@root%u", k);
			i += KC_SHA256_HEXLEN;
		} else {
			fputc(text[i++], f);
		}
	}
}

int kc_code_keys(const char *source, size_t source_len, const char *flags, size_t flags_len,
		 const struct kc_config *cfg, const char *compiler, struct kc_code *k,
		 char **blank, size_t *blen)
{
	const char *digest[KC_CODE_MAX_ROOTS], *dir[KC_CODE_MAX_ROOTS];
	size_t dl[KC_CODE_MAX_ROOTS];
	unsigned n = roots_of(flags, flags_len, digest, dir, dl, KC_CODE_MAX_ROOTS);
	if (n == 0 || n > KC_CODE_MAX_ROOTS ||
	    kc_key_keeps_paths(flags, flags_len, cfg->flags, cfg->key_paths))
		return 0;
	char *code = NULL, *canon = NULL, *shape = NULL;
	size_t code_len = 0, canon_len = 0, shape_len = 0;
	int r = kc_code_blank(source, source_len, &code, &code_len);
	if (r <= 0)
		return r;
	r = kc_key_canonical(flags, flags_len, cfg->flags, cfg->key_paths, &canon, &canon_len);
	if (r <= 0) {
		free(code);
		return r;
	}
	FILE *f = open_memstream(&shape, &shape_len);
	if (f)
		by_place(f, canon, canon_len, digest, n);
	struct kc_sha256 h[3];
	const char *mflags = cfg->flags ? cfg->flags : "";
	const char *backend = cfg->backend_nvrtc ? "nvrtc" : "nvcc";
	static const char *const tags[3] = {"kcachefs-code-v1\n", "kcachefs-shape-v1\n",
					    "kcachefs-context-v1\n"};
	int err = !f || fclose(f) != 0 ? -ENOMEM : 0;
	for (int i = 0; i < 3 && !err; i++) {
		if ((err = kc_sha256_init(&h[i])) != 0) {
			while (i-- > 0)
				kc_sha256_final(&h[i], k->code);
			break;
		}
		kc_sha256_update(&h[i], tags[i], strlen(tags[i]));
		if (i != 1)
			kc_sha256_field(&h[i], compiler, strlen(compiler));
		kc_sha256_field(&h[i], cfg->arch, strlen(cfg->arch));
		kc_sha256_field(&h[i], backend, strlen(backend));
		kc_sha256_field(&h[i], mflags, strlen(mflags));
	}
	if (!err) {
		kc_sha256_field(&h[0], canon, canon_len);
		kc_sha256_field(&h[0], code, code_len);
		kc_sha256_field(&h[1], shape, shape_len);
		kc_sha256_field(&h[1], code, code_len);
		for (unsigned i = 0; i < n; i++)
			kc_sha256_field(&h[2], digest[i], KC_SHA256_HEXLEN);
		kc_sha256_final(&h[0], k->code);
		kc_sha256_final(&h[1], k->shape);
		kc_sha256_final(&h[2], k->context);
		k->roots = n;
	}
	free(canon);
	free(shape);
	if (!err && blank) {
		*blank = code;
		*blen = code_len;
	} else {
		free(code);
	}
	return err ? err : 1;
}

/* kc_code_move_roots's rewrite of a line: the i-th root line becomes to's i-th, an include
 * argument of the i-th root's dir names to's i-th dir. */
struct move_arg {
	const char *fd_[KC_CODE_MAX_ROOTS], *fdir[KC_CODE_MAX_ROOTS];
	const char *td[KC_CODE_MAX_ROOTS], *tdir[KC_CODE_MAX_ROOTS];
	size_t fdl[KC_CODE_MAX_ROOTS], tdl[KC_CODE_MAX_ROOTS];
	unsigned n, root;
};

static int move_line(FILE *f, const struct kc_flags_line *l, void *arg)
{
	struct move_arg *m = arg;
	const char *d, *r;
	size_t rl;
	if (kc_tree_root_line(l->line, l->ll, &d, &r, &rl)) {
		fprintf(f, "%s%.*s %.*s\n", KC_TREE_ROOT_TAG, KC_SHA256_HEXLEN, m->td[m->root],
			(int)m->tdl[m->root], m->tdir[m->root]);
		m->root++;
		return 1;
	}
	for (unsigned k = 0; l->inc && k < m->n; k++)
		if (strlen(l->inc) == m->fdl[k] && memcmp(l->inc, m->fdir[k], m->fdl[k]) == 0) {
			fprintf(f, "%.*s%.*s\n", (int)(l->inc - l->copy), l->copy, (int)m->tdl[k],
				m->tdir[k]);
			return 1;
		}
	return 0;
}

int kc_code_move_roots(const char *flags, size_t len, const char *to, size_t to_len,
		       char **out, size_t *outlen)
{
	struct move_arg m = {.root = 0};
	m.n = roots_of(flags, len, m.fd_, m.fdir, m.fdl, KC_CODE_MAX_ROOTS);
	if (m.n == 0 || m.n > KC_CODE_MAX_ROOTS ||
	    roots_of(to, to_len, m.td, m.tdir, m.tdl, KC_CODE_MAX_ROOTS) != m.n)
		return 0;
	return kc_key_rewrite(flags, len, move_line, &m, out, outlen) ? -ENOMEM : 1;
}
