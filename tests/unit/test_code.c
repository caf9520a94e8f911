/* test_code.c - the code form of a source (comments blanked, code.h), the keys compile ahead
 * files recipes under, the move of flags onto other include roots, and the history record
 * (history.h): bounds, and a parse that trusts nothing. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "code.h"
#include "history.h"
#include "tap.h"

static int blank_is(const char *src, const char *want)
{
	char *out = NULL;
	size_t len = 0;
	int r = kc_code_blank(src, strlen(src), &out, &len);
	int ok = r == 1 && len == strlen(want) && memcmp(out, want, len) == 0;
	if (r == 1 && !ok)
		fprintf(stderr, "# got [%s] want [%s]\n", out, want);
	free(out);
	return ok;
}

static int unsure(const char *src)
{
	char *out = NULL;
	size_t len = 0;
	int r = kc_code_blank(src, strlen(src), &out, &len);
	free(out);
	return r == 0;
}

static const char D1[] = "1111111111111111111111111111111111111111111111111111111111111111";
static const char D2[] = "2222222222222222222222222222222222222222222222222222222222222222";

static char *flags_of(const char *digest, const char *dir, const char *extra)
{
	static char buf[4][1024];
	static int k;
	char *b = buf[k++ % 4];
	snprintf(b, 1024, "# kcachefs-nvcc: nvcc 13.0\n# include-root %s %s\n-std=c++20\n-I%s\n%s",
		 digest, dir, dir, extra);
	return b;
}

static int keys(const char *src, const char *flags, const struct kc_config *cfg,
		const char *compiler, struct kc_code *k)
{
	return kc_code_keys(src, strlen(src), flags, strlen(flags), cfg, compiler, k, NULL, NULL);
}

int main(void)
{
	/* what the preprocessor would not see is blanked; lines and columns stay */
	CHECK(blank_is("// Includes' hash value: abc\nint x;\n", "\nint x;\n"),
	      "a first-line comment (DeepGEMM's) is blanked, its line kept");
	CHECK(blank_is("int /* a */ x;", "int         x;"), "a block comment keeps its columns");
	CHECK(unsure("a /* one\ntwo */ b\n"),
	      "a block comment over lines with a token after it: unsure");
	CHECK(blank_is("int x; // trailing\n", "int x;\n"), "trailing blanks are cut");
	CHECK(blank_is("s = \"// not a comment /* */\";\n", "s = \"// not a comment /* */\";\n"),
	      "comment openers in a string literal stay");
	CHECK(blank_is("c = '\"'; // x\n", "c = '\"';\n"), "a quote in a character literal");
	CHECK(blank_is("s = \"a\\\"b // c\";\n", "s = \"a\\\"b // c\";\n"),
	      "an escaped quote does not end the string");
	CHECK(unsure("#define F(x) \\\n  (x)\n"), "a line splice in code: unsure");
	CHECK(blank_is("#include <a/b.h> // why\n", "#include <a/b.h>\n"),
	      "a comment after a header name is blanked");
	/* idempotent: a code form is its own */
	{
		const char *src = "// head\nint a; /* x\n y */\nint b; // t\n";
		char *one = NULL, *two = NULL;
		size_t l1 = 0, l2 = 0;
		int ok = kc_code_blank(src, strlen(src), &one, &l1) == 1 &&
			 kc_code_blank(one, l1, &two, &l2) == 1 && l1 == l2 && memcmp(one, two, l1) == 0;
		CHECK(ok, "the code form of a code form is itself");
		free(one);
		free(two);
	}
	/* where the lexer cannot be sure, there is no code form */
	CHECK(unsure("auto s = R\"(// not a comment)\";\n"), "a raw string literal: unsure");
	CHECK(unsure("int n = 1'000; // x\n"), "a digit separator: unsure");
	CHECK(unsure("// a comment \\\nint hidden;\n"), "a spliced line comment: unsure");
	CHECK(unsure("int a; /\\\n* c */\n"), "a splice inside a comment opener: unsure");
	CHECK(unsure("int a; \\  \nint b;\n"), "a backslash with blanks before its newline: unsure");
	CHECK(unsure("s = \"?\?/\";\n"), "a trigraph: unsure");
	CHECK(unsure("s = \"open\nint a;\n"), "a string open at a line's end: unsure");
	CHECK(unsure("int a; /* open\n"), "a block comment open at the end: unsure");
	CHECK(unsure("#include <a//b.h>\n"), "a comment opener in a header name: unsure");
	/* what an adversarial review found: each of these compiles otherwise than its blanked
	 * form would, so none may have a code form */
	CHECK(unsure("#define V 1\n#define X \\/**/\n#undef V\n"),
	      "a backslash before a comment (its blanking makes a splice): unsure");
	CHECK(unsure("x; //\r p[0]=2;\n"), "a lone carriage return ends a line for GCC: unsure");
	CHECK(unsure("int a; /* one\ntwo */ #undef V\n"),
	      "a block comment over lines with a '#' after it: unsure");
	CHECK(unsure("#define X 1 /* a\n b */\n"), "a block comment over lines in a directive: unsure");
	CHECK(unsure("/**/#include <h//v1.cuh>\n"), "a header name after a comment: unsure");
	CHECK(unsure("%:include <h.cuh>\n"), "the digraph of '#': unsure");
	CHECK(unsure("#if __has_include(<h//v1.cuh>)\n#endif\n"),
	      "a comment opener in __has_include's header name: unsure");
	CHECK(unsure("S(1.'0'//')\n"), "a quote inside a pp-number: unsure");
	CHECK(unsure("R\\\n\"(a\"//)\"\n"), "a raw string behind a splice: unsure");
	CHECK(unsure("int i = 0; if (i < n) // check\n"),
	      "a '<' with a comment opener after it on its line: unsure");
	CHECK(blank_is("a /* one\ntwo */\nb\n", "a\n\nb\n"),
	      "a block comment over lines, alone on its last line, is blanked");
	CHECK(blank_is("x = f('a') + g<int>(1); // c\n", "x = f('a') + g<int>(1);\n"),
	      "a character literal and a closed '<...>' before a comment");
	{
		const char with_nul[] = "int a;\0// x\n";
		char *out = NULL;
		size_t len = 0;
		CHECK(kc_code_blank(with_nul, sizeof(with_nul) - 1, &out, &len) == 0, "a NUL: unsure");
		free(out);
	}

	/* keys */
	struct kc_config cfg = {.arch = "sm_90a"};
	struct kc_code k1, k2, k3, k4;
	const char *src = "// Includes' hash value: 1\n#include <x.cuh>\nint f() { return X; }\n";
	const char *src2 = "// Includes' hash value: 2\n#include <x.cuh>\nint f() { return X; }\n";
	const char *other = "// Includes' hash value: 1\n#include <x.cuh>\nint f() { return X + 0; }\n";
	CHECK(keys(src, flags_of(D1, "/a/inc", ""), &cfg, "nvcc 1", &k1) == 1 &&
	      keys(src2, flags_of(D1, "/b/venv/inc", ""), &cfg, "nvcc 1", &k2) == 1,
	      "a recipe with include roots has keys");
	CHECK(strcmp(k1.code, k2.code) == 0 && strcmp(k1.shape, k2.shape) == 0 &&
	      strcmp(k1.context, k2.context) == 0,
	      "sources that differ in a comment, headers at another path: one code key");
	CHECK(keys(other, flags_of(D1, "/a/inc", ""), &cfg, "nvcc 1", &k3) == 1 &&
	      strcmp(k3.code, k1.code) != 0 && strcmp(k3.shape, k1.shape) != 0,
	      "sources that differ in code never share a code key or shape");
	CHECK(keys(src, flags_of(D2, "/a/inc", ""), &cfg, "nvcc 1", &k4) == 1 &&
	      strcmp(k4.code, k1.code) != 0 && strcmp(k4.shape, k1.shape) == 0 &&
	      strcmp(k4.context, k1.context) != 0,
	      "other header bytes: another code key and context, the same shape");
	CHECK(keys(src, flags_of(D1, "/a/inc", ""), &cfg, "nvcc 2", &k4) == 1 &&
	      strcmp(k4.code, k1.code) != 0 && strcmp(k4.context, k1.context) != 0 &&
	      strcmp(k4.shape, k1.shape) == 0,
	      "another compiler: another code key and context, the same shape");
	CHECK(keys(src, flags_of(D1, "/a/inc", "-O2\n"), &cfg, "nvcc 1", &k4) == 1 &&
	      strcmp(k4.shape, k1.shape) != 0, "other flags: another shape");
	CHECK(keys(src, flags_of(D1, "/a/inc", "-lineinfo\n"), &cfg, "nvcc 1", &k4) == 0,
	      "flags that put paths into the cubin: no code key");
	CHECK(keys(src, "-std=c++20\n-I/a/inc\n", &cfg, "nvcc 1", &k4) == 0,
	      "no include root named by content: no code key");
	CHECK(keys("auto s = R\"(x)\";\n", flags_of(D1, "/a/inc", ""), &cfg, "nvcc 1", &k4) == 0,
	      "no code form: no code key");
	struct kc_config kp = {.arch = "sm_90a", .key_paths = 1};
	CHECK(keys(src, flags_of(D1, "/a/inc", ""), &kp, "nvcc 1", &k4) == 0,
	      "-o key_paths: no code key");

	/* moved onto another context's roots, by place */
	{
		const char *from = flags_of(D1, "/old/inc", "-O3\n");
		const char *to = flags_of(D2, "/new/site/inc", "");
		char *moved = NULL;
		size_t ml = 0;
		CHECK(kc_code_move_roots(from, strlen(from), to, strlen(to), &moved, &ml) == 1 &&
		      strstr(moved, "# include-root 2222") && strstr(moved, "-I/new/site/inc\n") &&
		      !strstr(moved, "/old/") && strstr(moved, "-O3\n"),
		      "a history's flags moved onto this context's roots");
		CHECK(keys(src, moved, &cfg, "nvcc 1", &k4) == 1 &&
		      keys(src, flags_of(D2, "/elsewhere", "-O3\n"), &cfg, "nvcc 1", &k3) == 1 &&
		      strcmp(k4.code, k3.code) == 0,
		      "the moved recipe has the code key a client's stage of it will have");
		free(moved);
		const char *two = "# include-root 1111111111111111111111111111111111111111111111111111111111111111 /a\n"
				  "# include-root 2222222222222222222222222222222222222222222222222222222222222222 /b\n-I/a\n-I/b\n";
		CHECK(kc_code_move_roots(two, strlen(two), to, strlen(to), &moved, &ml) == 0,
		      "another number of roots: not moved");
	}

	/* the history record */
	struct kc_history h, p;
	char why[300], *data = NULL;
	size_t len = 0;
	kc_history_init(&h, k1.context);
	CHECK(kc_history_add(&h, "f\n", 2, "s", 1, k1.shape) == 1 &&
	      kc_history_add(&h, "f\n", 2, "s", 1, k1.shape) == 0 &&
	      kc_history_add(&h, "g\n", 2, "t", 1, k3.shape) == 1 && h.n == 2,
	      "a history adds each shape once, in order");
	CHECK(kc_history_format(&h, &data, &len) == 0 &&
	      kc_history_parse(data, len, k1.context, &p, why, sizeof(why)) == 0 && p.n == 2 &&
	      memcmp(p.r[1].flags, "g\n", 2) == 0 && memcmp(p.r[1].source, "t", 1) == 0,
	      "a history formats and parses back");
	kc_history_free(&p);
	CHECK(kc_history_parse(data, len, k4.context, &p, why, sizeof(why)) == -EBADMSG,
	      "a history under another context's name is refused");
	int cut_ok = 1;
	for (size_t cut = 0; cut < len; cut++) {
		if (kc_history_parse(data, cut, NULL, &p, why, sizeof(why)) != -EBADMSG)
			cut_ok = 0, kc_history_free(&p);
	}
	CHECK(cut_ok, "every cut of a history record is refused");
	{
		char *big = malloc(KC_HISTORY_MAX_BYTES + 100);
		memcpy(big, data, len);
		memset(big + len, 'x', KC_HISTORY_MAX_BYTES + 100 - len);
		CHECK(kc_history_parse(big, KC_HISTORY_MAX_BYTES + 100, NULL, &p, why, sizeof(why)) ==
			      -EBADMSG && strstr(why, "over"),
		      "an oversized history record is refused");
		free(big);
	}
	char forged[200];
	snprintf(forged, sizeof(forged), "kcachefs-history-v1\n%s\n99999\n", k1.context);
	CHECK(kc_history_parse(forged, strlen(forged), NULL, &p, why, sizeof(why)) == -EBADMSG,
	      "a count past the bound is refused");
	free(data);
	kc_history_free(&h);
	kc_history_init(&h, k1.context);
	int added = 0, r = 0;
	char sh[KC_SHA256_HEXLEN + 1];
	for (int i = 0; i < KC_HISTORY_MAX_RECIPES + 10; i++) {
		snprintf(sh, sizeof(sh), "%064d", i);
		if ((r = kc_history_add(&h, "f\n", 2, "s", 1, sh)) == 1)
			added++;
	}
	CHECK(added == KC_HISTORY_MAX_RECIPES && r == -E2BIG, "a history keeps at most its bound");
	kc_history_free(&h);
	return tap_done();
}
