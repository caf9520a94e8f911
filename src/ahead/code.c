/* code.c - see code.h */
#define _GNU_SOURCE
#include "code.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "key.h"
#include "tree.h"

/* Whether ch may end a pp-number or an identifier just before a quote: a quote there is a
 * digit separator (1'000, 1.'0) or a prefixed literal (u'x', u8'x'), not a char literal. */
static int number_char(unsigned char ch)
{
	return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
	       ch == '_' || ch == '.' || ch >= 0x80;
}

/* Whether the '<' at s[i] is followed, on its line and before a '>', by a comment opener:
 * a header name (#include <a//b.h>, __has_include(<...>), after a comment or a digraph) is
 * not lexed as code, so any such '<' makes the lexer unsure. */
static int angle_holds_opener(const char *s, size_t len, size_t i)
{
	for (size_t k = i + 1; k + 1 < len && s[k] != '\n' && s[k] != '>'; k++)
		if (s[k] == '/' && (s[k + 1] == '/' || s[k + 1] == '*'))
			return 1;
	return 0;
}

/* Whether the line of s that holds position i has a '#' before i (a directive, perhaps
 * after a comment). */
static int hash_before(const char *s, size_t i)
{
	while (i > 0 && s[i - 1] != '\n')
		if (s[--i] == '#')
			return 1;
	return 0;
}

enum lex { CODE, STR, CHR, LINE_COMMENT, BLOCK_COMMENT };

/* What the lexer accepts is a subset of C++ it is sure of: a source with anything else has
 * no code form. It refuses a backslash outside string and character literals (a line
 * splice: it may hide or make a comment, a raw string, a directive's end), a carriage
 * return (GCC ends lines at a lone one), a NUL, "??" (trigraphs, read by -std=c++14 and
 * older), "%:" (the digraph of '#'), a raw string literal, a quote after a pp-number or
 * identifier character (a digit separator, 1.'0, u'x'), a '<' followed by a comment opener
 * before its '>' on its line (a header name is not code), a literal open at a line's end,
 * and a block comment over several lines that has anything after it on its last line, or
 * that starts on a line holding a '#' (where the comment's newlines would end a directive
 * the preprocessor goes on reading). */
int kc_code_blank(const char *s, size_t len, char **out, size_t *outlen)
{
	if (memchr(s, '\0', len) || memchr(s, '\r', len) || memmem(s, len, "??", 2) ||
	    memmem(s, len, "%:", 2))
		return 0;
	char *o = malloc(len + 1);
	if (!o)
		return -ENOMEM;
	enum lex st = CODE;
	size_t n = 0;
	int sure = 1, multi = 0, directive = 0;
	for (size_t i = 0; i < len && sure; i++) {
		char ch = s[i], next = i + 1 < len ? s[i + 1] : '\0';
		if (ch == '\n')
			while (n > 0 && (o[n - 1] == ' ' || o[n - 1] == '\t' || o[n - 1] == '\f' ||
					 o[n - 1] == '\v'))
				n--; /* trailing blanks: no token follows them */
		if (ch == '\\' && st != STR && st != CHR) {
			sure = 0; /* a line splice, or a backslash that may become one */
			break;
		}
		switch (st) {
		case CODE:
			if (ch == '/' && (next == '/' || next == '*')) {
				st = next == '/' ? LINE_COMMENT : BLOCK_COMMENT;
				multi = 0;
				directive = st == BLOCK_COMMENT && hash_before(s, i);
				o[n++] = ' ';
				o[n++] = ' ';
				i++;
				continue;
			}
			if (ch == '"' && i > 0 && s[i - 1] == 'R')
				sure = 0; /* a raw string literal: its text is not lexed */
			else if (ch == '\'' && i > 0 &&
				 (number_char((unsigned char)s[i - 1]) ||
				  ((s[i - 1] == '+' || s[i - 1] == '-') && i > 1 &&
				   strchr("eEpP", s[i - 2]))))
				sure = 0; /* inside a pp-number, or a prefixed literal */
			else if (ch == '<' && angle_holds_opener(s, len, i))
				sure = 0;
			st = ch == '"' ? STR : ch == '\'' ? CHR : CODE;
			o[n++] = ch;
			break;
		case STR:
		case CHR:
			if (ch == '\n') {
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
			if (ch == '\n') {
				st = CODE;
				o[n++] = '\n';
			} else {
				o[n++] = ' ';
			}
			break;
		case BLOCK_COMMENT:
			if (ch == '*' && next == '/') {
				st = CODE;
				o[n++] = ' ';
				o[n++] = ' ';
				i++;
				if (multi) { /* nothing may follow it on its line, nor may it end a directive */
					size_t k = i + 1;
					while (k < len && (s[k] == ' ' || s[k] == '\t'))
						k++;
					if (directive || (k < len && s[k] != '\n'))
						sure = 0;
				}
			} else {
				multi |= ch == '\n';
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
