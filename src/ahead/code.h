/* code.h - a recipe as the compiler sees it, and the keys compile ahead files it under.
 *
 * The C preprocessor replaces every comment by a space before anything else reads the
 * text (translation phase 3), so no compiler output depends on a comment's words. The
 * *code form* of a source is its bytes with every comment's characters blanked (spaces; its
 * newlines kept, so every line and column stays where it was) and each line's trailing
 * blanks cut. Two sources with one code form are one compile: DeepGEMM writes its
 * include tree's hash into the first line of every kernel.cu as a comment, so that line is
 * all that differs between two images' sources of one kernel.
 *
 * The lexer is conservative: it accepts a subset of C++ it is sure of, and a source with
 * anything else (a backslash outside a literal, which may splice lines; a carriage return;
 * a trigraph or the digraph "%:"; a raw string literal; a quote inside a pp-number or after
 * a prefix; a '<' followed by a comment opener on its line, as in a header name; a block
 * comment over lines with anything after it, or in a directive; a NUL) has no code form,
 * and only its exact bytes name it, as before (code.c says why each).
 *
 * Keys (lowercase hex SHA-256, each a sequence of hash.h fields after its tag), for a
 * recipe whose kernel.flags names include roots by content (key.h) and keeps no paths:
 *   code    "kcachefs-code-v1": compiler identity, arch, backend, mount flags, canonical
 *           flags, code form. A function of what the compiler sees: what the cluster store
 *           and the compiles ahead file a cubin under.
 *   shape   "kcachefs-shape-v1": arch, backend, mount flags, canonical flags with each
 *           include root's digest replaced by its place (@root0, @root1, ...), code form.
 *           The same kernel of another image: its headers' bytes and compiler set aside.
 *   context "kcachefs-context-v1": compiler identity, arch, backend, mount flags, the
 *           include roots' digests in their order: the headers and toolchain an image
 *           compiles under (a history is kept per context, history.h).
 */
#ifndef KC_CODE_H
#define KC_CODE_H

#include <stddef.h>

#include "config.h"
#include "hash.h"

#define KC_CODE_MAX_ROOTS 64 /* include roots of one recipe that compile ahead follows */

struct kc_code {
	char code[KC_SHA256_HEXLEN + 1];
	char shape[KC_SHA256_HEXLEN + 1];
	char context[KC_SHA256_HEXLEN + 1];
	unsigned roots; /* include roots the flags name (>= 1) */
};

/* The code form of src (len bytes) into *out (malloc'd, NUL-terminated, the caller frees
 * it) / *outlen. Returns 1; 0 when the lexer cannot be sure (above: *out untouched);
 * -ENOMEM. Idempotent: a code form is its own code form. */
int kc_code_blank(const char *src, size_t len, char **out, size_t *outlen);

/* The keys of the recipe (source, flags) for the mount's cfg and the compiler identity
 * compiler (kc_config_compiler_id's), with the code form into *blank / *blen (malloc'd,
 * the caller frees it) when blank is not NULL. Returns 1 with k filled; 0 when the recipe
 * has none (no code form, no include root, more than KC_CODE_MAX_ROOTS, or flags that keep
 * paths in the output or the key: key.h); -ENOMEM. */
int kc_code_keys(const char *source, size_t source_len, const char *flags, size_t flags_len,
		 const struct kc_config *cfg, const char *compiler, struct kc_code *k,
		 char **blank, size_t *blen);

/* The flags of another context's recipe (flags, len bytes) moved onto the include roots of
 * to (to_len bytes: a recipe's flags of this context), by place: the i-th root line of
 * flags becomes to's i-th (its digest and dir), and an -I or --include-path= of the i-th
 * root's dir names to's i-th dir. Returns 1 with *out (malloc'd) / *outlen; 0 when the two
 * name different numbers of roots; -ENOMEM. */
int kc_code_move_roots(const char *flags, size_t len, const char *to, size_t to_len,
		       char **out, size_t *outlen);

#endif
