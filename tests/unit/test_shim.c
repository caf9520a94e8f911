/* test_shim.c - the kcachefs-nvcc shim's logic: which calls it takes over, how it
 * normalises and checks their flags, the kernel.flags it stages, the key and entry name,
 * and finding a mount. (The program itself is tested on real mounts: test_shim.py.) */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include "flags.h"
#include "key.h"
#include "name.h"
#include "shim.h"
#include "tree.h"
#include "stats.h"
#include "tap.h"
#include "tmptree.h"

static char tmpdir[] = "/tmp/kc-test-shim-XXXXXX";

/* Parse a blank-separated command line. */
static int parse(const char *line, struct kc_shim_call *call)
{
	char *copy = strdup(line), *save = NULL, *args[64];
	int n = 0;
	for (char *t = strtok_r(copy, " ", &save); t && n < 64; t = strtok_r(NULL, " ", &save))
		args[n++] = t;
	int r = kc_shim_parse(n, args, "/work/dir", call);
	free(copy);
	return r;
}

/* The flags of call joined by '|'. */
static const char *joined(const struct kc_shim_call *call)
{
	static char buf[2048];
	buf[0] = '\0';
	for (size_t i = 0; i < call->flags.n; i++) {
		if (i)
			strcat(buf, "|");
		strncat(buf, call->flags.v[i], sizeof(buf) - strlen(buf) - 2);
	}
	return buf;
}

static void test_parse(void)
{
	struct kc_shim_call c;

	/* DeepGEMM's call, as DeepGEMM prints it on an H200 node (the include directory made up) */
	CHECK(parse("/c/tmp/1-a-b-c/kernel.cu -cubin -o /c/tmp/1-a-b-c/kernel.cubin -std=c++20 "
		    "--diag-suppress=39,161,174,177,186,940 "
		    "--ptxas-options=--register-usage-level=10 -I/tmp "
		    "--gpu-architecture=sm_90a "
		    "--compiler-options=-fPIC,-O3,-fconcepts,-Wno-deprecated-declarations,-Wno-abi "
		    "-O3 --expt-relaxed-constexpr --expt-extended-lambda", &c) == 1,
	      "parse: DeepGEMM's compile call is taken over");
	CHECK(c.input && strcmp(c.input, "/c/tmp/1-a-b-c/kernel.cu") == 0, "parse: input");
	CHECK(c.output && strcmp(c.output, "/c/tmp/1-a-b-c/kernel.cubin") == 0, "parse: output");
	CHECK(c.flags.n == 9 && strcmp(c.flags.v[0], "-std=c++20") == 0 &&
		      strcmp(c.flags.v[8], "--expt-extended-lambda") == 0,
	      "parse: every other argument kept, in order, without -cubin");
	char why[512] = "";
	CHECK(kc_shim_check(&c, why, sizeof(why)) == 0, "check: DeepGEMM's flags pass the allow-list");
	kc_shim_call_free(&c);

	CHECK(parse("-o out.cubin -I inc -arch sm_90a -Xptxas -v --ptxas-options -O2 -D X=1 "
		    "-std c++17 k.cu --cubin", &c) == 1,
	      "parse: options in any order, separate values, --cubin");
	CHECK(strcmp(joined(&c), "-I/work/dir/inc|-arch=sm_90a|-Xptxas=-v|--ptxas-options=-O2|"
				 "-DX=1|-std=c++17") == 0,
	      "parse: separate values joined into one token, relative -I made absolute");
	kc_shim_call_free(&c);

	CHECK(parse("k.cu -cubin --output-file=o.cubin -Irel --include-path=/abs "
		    "--include-path=rel2", &c) == 1, "parse: --output-file=, joined include forms");
	CHECK(strcmp(c.output, "o.cubin") == 0, "parse: --output-file= value");
	CHECK(strcmp(joined(&c), "-I/work/dir/rel|--include-path=/abs|"
				 "--include-path=/work/dir/rel2") == 0,
	      "parse: joined relative include directories made absolute");
	kc_shim_call_free(&c);

	CHECK(parse("k.cu -cubin --output-file o.cubin", &c) == 1 && strcmp(c.output, "o.cubin") == 0,
	      "parse: --output-file with a separate value");
	kc_shim_call_free(&c);
	CHECK(parse("k.cu -cubin -o=o.cubin", &c) == 1 && strcmp(c.output, "o.cubin") == 0,
	      "parse: -o=");
	kc_shim_call_free(&c);

	/* calls that are handed to nvcc unchanged */
	static const char *const other[] = {
		"--version", "-V", "", "k.cu -ptx -o k.ptx", "k.cu -cubin", "k.cu -o k.cubin",
		"a.cu b.cu -cubin -o x.cubin", "k.cpp -cubin -o k.cubin", "k.cu -cubin -o",
		"k.cu -cubin -o a -o b", "k.cu -cubin -o k.cubin -I", "k.cu -cubin -cubin -o k.cubin",
		"-cubin -o k.cubin", "k.cu -cubin -o k.cubin -arch", "k.cu -cubin -o= ",
	};
	for (size_t i = 0; i < sizeof(other) / sizeof(other[0]); i++) {
		char what[160];
		snprintf(what, sizeof(what), "parse: '%s' goes to nvcc", other[i]);
		CHECK(parse(other[i], &c) == 0 && c.input == NULL && c.flags.n == 0, what);
	}
}

static void test_check(void)
{
	struct kc_shim_call c;
	char why[512];
	static const struct {
		const char *line, *word;
		int err;
	} refused[] = {
		{"k.cu -cubin -o k.cubin -ccbin /usr/bin/gcc", "host compiler", -EPERM},
		{"k.cu -cubin -o k.cubin --run", "runs a program", -EPERM},
		{"k.cu -cubin -o k.cubin -odir /tmp", "names an output", -EPERM},
		{"k.cu -cubin -o k.cubin --compiler-options=-fplugin=/x.so", "not allowed", -EPERM},
		{"k.cu -cubin -o k.cubin -Xcompiler -wrapper,/bin/sh", "not allowed", -EPERM},
		{"k.cu -cubin -o k.cubin --options-file /tmp/f", "from a file", -EPERM},
		{"k.cu -cubin -o k.cubin -M", "dependency", -EPERM},
		{"k.cu -cubin -o k.cubin -ptx", "output kind", -EPERM},
		{"k.cu -cubin -o k.cubin -I/a,/b", "split it at the comma", -EINVAL},
		{"k.cu -cubin -o k.cubin --frobnicate", "allow-list", -EINVAL},
	};
	for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
		char what[200];
		why[0] = '\0';
		int r = parse(refused[i].line, &c);
		snprintf(what, sizeof(what), "check: '%s' refused, saying '%s'", refused[i].line + 23,
			 refused[i].word);
		CHECK(r == 1 && kc_shim_check(&c, why, sizeof(why)) == refused[i].err &&
			      strstr(why, refused[i].word),
		      what);
		kc_shim_call_free(&c);
	}
	char *args[] = {"k.cu", "-cubin", "-o", "k.cubin", "-DX=a "};
	CHECK(kc_shim_parse(5, args, "/", &c) == 1 && kc_shim_check(&c, why, sizeof(why)) == -EINVAL &&
		      strstr(why, "blanks"),
	      "check: an argument with a trailing blank is refused");
	kc_shim_call_free(&c);
}

static void put(const char *rel, const char *text)
{
	tmptree_put(tmpdir, rel, text, 0644);
}

/* Keep the stamps of the file at rel (atime, mtime) while its bytes change: what rsync -t
 * and touch -r leave. */
static void put_keeping_times(const char *rel, const char *text)
{
	char path[512];
	struct stat st;
	snprintf(path, sizeof(path), "%s/%s", tmpdir, rel);
	stat(path, &st);
	put(rel, text);
	struct timespec keep[2] = {st.st_atim, st.st_mtim};
	utimensat(AT_FDCWD, path, keep, 0);
}

/* The same, but the new bytes written to another file renamed over it: another inode. */
static void replace_keeping_times(const char *rel, const char *text)
{
	char path[512], tmp[1200];
	struct stat st;
	snprintf(path, sizeof(path), "%s/%s", tmpdir, rel);
	snprintf(tmp, sizeof(tmp), "%s.new", rel);
	stat(path, &st);
	put(tmp, text);
	snprintf(tmp, sizeof(tmp), "%s/%s.new", tmpdir, rel);
	struct timespec keep[2] = {st.st_atim, st.st_mtim};
	utimensat(AT_FDCWD, tmp, keep, 0);
	if (rename(tmp, path) != 0)
		perror("rename");
}

struct check_arg {
	const char *flags;
	struct kc_tree_memo *memo;
	int rc[20];
};

static void *check_many(void *p)
{
	struct check_arg *a = p;
	char why[256];
	for (int i = 0; i < 20; i++)
		a->rc[i] = kc_tree_check_roots(a->flags, strlen(a->flags), a->memo, why, sizeof(why));
	return NULL;
}

/* The daemon's memo for its checks of include roots (kc_tree_check_roots): an unchanged
 * tree is stat'ed, not read; an edit that keeps size and mtime, or a file replaced by a
 * rename, is read again and fails the check. */
static void test_daemon_memo(void)
{
	char dir[128], flags[512], digest[KC_SHA256_HEXLEN + 1], why[256];
	size_t hits, misses;
	tmptree_mkdir(tmpdir, "dm");
	tmptree_mkdir(tmpdir, "dm/sub");
	put("dm/a.h", "int a;\n");
	put("dm/sub/b.h", "int b;\n");
	put("dm/sub/c.h", "int c;\n");
	snprintf(dir, sizeof(dir), "%s/dm", tmpdir);
	CHECK(kc_tree_digest(dir, (dev_t)-1, NULL, digest) == 0, "daemon memo: the tree's digest");
	snprintf(flags, sizeof(flags), "# include-root %s %s\n-I%s\n", digest, dir, dir);
	usleep(50000); /* the tree's ctimes behind the clock: memoizable */
	struct kc_tree_memo *memo = kc_tree_memo_new(KC_TREE_MEMO_DAEMON);
	CHECK(memo && kc_tree_check_roots(flags, strlen(flags), memo, why, sizeof(why)) == 0,
	      "daemon memo: the first check passes");
	kc_tree_memo_counts(memo, &hits, &misses);
	CHECK(hits == 0 && misses == 3, "daemon memo: every file read the first time");
	CHECK(kc_tree_check_roots(flags, strlen(flags), memo, why, sizeof(why)) == 0,
	      "daemon memo: the second check passes");
	kc_tree_memo_counts(memo, &hits, &misses);
	CHECK(hits == 3 && misses == 3, "daemon memo: an unchanged tree is not read again");
	CHECK(kc_tree_memo_save(memo) == 0, "daemon memo: saving one in memory writes nothing");

	put_keeping_times("dm/sub/b.h", "int x;\n");
	CHECK(kc_tree_check_roots(flags, strlen(flags), memo, why, sizeof(why)) == -ESTALE &&
		      strstr(why, "changed since staged"),
	      "daemon memo: an edit keeping size and mtime fails the check");
	kc_tree_memo_counts(memo, &hits, &misses);
	CHECK(hits == 5 && misses == 4, "daemon memo: only the edited file read again");
	put_keeping_times("dm/sub/b.h", "int b;\n");
	CHECK(kc_tree_check_roots(flags, strlen(flags), memo, why, sizeof(why)) == 0,
	      "daemon memo: the bytes put back pass again");

	usleep(50000); /* b.h, read when just written, is memoized by this check */
	CHECK(kc_tree_check_roots(flags, strlen(flags), memo, why, sizeof(why)) == 0,
	      "daemon memo: checked again");
	kc_tree_memo_counts(memo, &hits, &misses);
	size_t h0 = hits, m0 = misses;
	replace_keeping_times("dm/sub/c.h", "int y;\n");
	CHECK(kc_tree_check_roots(flags, strlen(flags), memo, why, sizeof(why)) == -ESTALE,
	      "daemon memo: a file replaced by rename (size and mtime kept) fails the check");
	kc_tree_memo_counts(memo, &hits, &misses);
	CHECK(hits == h0 + 2 && misses == m0 + 1, "daemon memo: only the replaced file read again");
	replace_keeping_times("dm/sub/c.h", "int c;\n");
	CHECK(kc_tree_check_roots(flags, strlen(flags), memo, why, sizeof(why)) == 0,
	      "daemon memo: the bytes put back by rename pass again");

	/* compiles check in parallel: one memo, several threads, every check right */
	usleep(50000);
	CHECK(kc_tree_check_roots(flags, strlen(flags), memo, why, sizeof(why)) == 0,
	      "daemon memo: checked again");
	struct check_arg args[4];
	pthread_t t[4];
	kc_tree_memo_counts(memo, &h0, &m0);
	for (int i = 0; i < 4; i++) {
		args[i] = (struct check_arg){.flags = flags, .memo = memo};
		pthread_create(&t[i], NULL, check_many, &args[i]);
	}
	int bad = 0;
	for (int i = 0; i < 4; i++) {
		pthread_join(t[i], NULL);
		for (int k = 0; k < 20; k++)
			bad += args[i].rc[k] != 0;
	}
	kc_tree_memo_counts(memo, &hits, &misses);
	CHECK(bad == 0 && hits + misses == h0 + m0 + 4 * 20 * 3 && misses == m0,
	      "daemon memo: parallel checks all pass, none reads a file");
	kc_tree_memo_free(memo);

	/* a memo at its bound is emptied and fills again: still right */
	memo = kc_tree_memo_new(2);
	CHECK(memo && kc_tree_check_roots(flags, strlen(flags), memo, why, sizeof(why)) == 0 &&
		      kc_tree_check_roots(flags, strlen(flags), memo, why, sizeof(why)) == 0,
	      "daemon memo: a memo smaller than the tree checks it");
	kc_tree_memo_counts(memo, &hits, &misses);
	CHECK(hits + misses == 6 && misses >= 4, "daemon memo: bounded, it reads what it forgot");
	put_keeping_times("dm/a.h", "int z;\n");
	CHECK(kc_tree_check_roots(flags, strlen(flags), memo, why, sizeof(why)) == -ESTALE,
	      "daemon memo: bounded, an edit still fails the check");
	kc_tree_memo_free(memo);
}

static void test_fingerprint_and_flags_file(void)
{
	char a[KC_SHA256_HEXLEN + 1], b[KC_SHA256_HEXLEN + 1], path[512];

	tmptree_mkdir(tmpdir, "inc");
	tmptree_mkdir(tmpdir, "inc/sub");
	put("inc/a.h", "int a;\n");
	put("inc/sub/b.h", "int b;\n");
	snprintf(path, sizeof(path), "%s/inc", tmpdir);
	CHECK(kc_tree_digest(path, (dev_t)-1, NULL, a) == 0 && strlen(a) == 64, "tree digest: computed");
	CHECK(kc_tree_digest(path, (dev_t)-1, NULL, b) == 0 && strcmp(a, b) == 0,
	      "tree digest: the same tree gives the same value");
	struct timeval tv[2] = {{1000, 0}, {1000, 0}};
	char file[600];
	snprintf(file, sizeof(file), "%s/inc/sub/b.h", tmpdir);
	utimes(file, tv);
	CHECK(kc_tree_digest(path, (dev_t)-1, NULL, b) == 0 && strcmp(a, b) == 0,
	      "tree digest: a header with another mtime (same bytes) keeps it");
	put("inc/sub/b.h", "int c;\n");
	utimes(file, tv);
	CHECK(kc_tree_digest(path, (dev_t)-1, NULL, b) == 0 && strcmp(a, b) != 0,
	      "tree digest: a header edited with its size and mtime kept changes it");
	memcpy(a, b, sizeof(a));
	/* the same bytes at another prefix, written at another time */
	char other[600], otherf[700];
	tmptree_mkdir(tmpdir, "copy");
	tmptree_mkdir(tmpdir, "copy/inc");
	tmptree_mkdir(tmpdir, "copy/inc/sub");
	snprintf(other, sizeof(other), "%s/copy/inc", tmpdir);
	put("copy/inc/a.h", "int a;\n");
	put("copy/inc/sub/b.h", "int c;\n");
	CHECK(kc_tree_digest(other, (dev_t)-1, NULL, b) == 0 && strcmp(a, b) == 0,
	      "tree digest: the same bytes at another path give the same value");
	put("copy/inc/sub/b.h", "int d;\n");
	CHECK(kc_tree_digest(other, (dev_t)-1, NULL, b) == 0 && strcmp(a, b) != 0,
	      "tree digest: one byte differs, another value");
	put("copy/inc/sub/b.h", "int c;\n");
	snprintf(otherf, sizeof(otherf), "%s/sub/b.h", other);
	char moved[700];
	snprintf(moved, sizeof(moved), "%s/b.h", other);
	rename(otherf, moved);
	CHECK(kc_tree_digest(other, (dev_t)-1, NULL, b) == 0 && strcmp(a, b) != 0,
	      "tree digest: the same bytes under another relative name, another value");
	unlink(moved);
	snprintf(otherf, sizeof(otherf), "%s/sub", other);
	rmdir(otherf);
	snprintf(moved, sizeof(moved), "%s/a.h", other);
	unlink(moved);
	rmdir(other);
	snprintf(other, sizeof(other), "%s/copy", tmpdir);
	rmdir(other);
	put("inc/c.h", "");
	CHECK(kc_tree_digest(path, (dev_t)-1, NULL, b) == 0 && strcmp(a, b) != 0,
	      "tree digest: a new header changes it");
	CHECK(kc_tree_digest(path, (dev_t)-1, NULL, a) == 0, "tree digest: taken again");
	CHECK(kc_tree_digest("/no/such/dir", (dev_t)-1, NULL, b) == -ENOENT,
	      "tree digest: a missing directory is -ENOENT");
	struct stat dst;
	stat(path, &dst);
	CHECK(kc_tree_digest(path, dst.st_dev, NULL, b) == -EXDEV,
	      "tree digest: a tree on the avoided device (the mount) is -EXDEV");
	char link[600];
	snprintf(link, sizeof(link), "%s/inc/dangling", tmpdir);
	CHECK(symlink("/no/such/target", link) == 0 && kc_tree_digest(path, (dev_t)-1, NULL, b) == 0 &&
		      strcmp(a, b) == 0,
	      "tree digest: a dangling link is skipped");
	snprintf(link, sizeof(link), "%s/inc/self", tmpdir);
	CHECK(symlink("self", link) == 0 && kc_tree_digest(path, (dev_t)-1, NULL, b) == -ELOOP,
	      "tree digest: a link to itself is -ELOOP (the call goes to nvcc)");
	unlink(link);

	/* the memo of file digests between calls: stat'ed, not read; an edit that keeps size
	 * and mtime changes ctime and is read again */
	char memo_path[600], ma[KC_SHA256_HEXLEN + 1], mb[KC_SHA256_HEXLEN + 1];
	size_t hits = 0, misses = 0;
	snprintf(memo_path, sizeof(memo_path), "%s/cache/tree-memo", tmpdir);
	usleep(50000); /* the tree's ctimes behind the clock: memoizable */
	struct kc_tree_memo *memo = kc_tree_memo_load(memo_path);
	CHECK(memo && kc_tree_digest(path, (dev_t)-1, memo, ma) == 0 && strcmp(ma, a) == 0 &&
		      kc_tree_memo_save(memo) == 0,
	      "memo: the digest through an empty memo is the tree's; saved (its directory made)");
	kc_tree_memo_counts(memo, &hits, &misses);
	CHECK(hits == 0 && misses == 3, "memo: every file read the first time");
	kc_tree_memo_free(memo);
	memo = kc_tree_memo_load(memo_path);
	CHECK(memo && kc_tree_digest(path, (dev_t)-1, memo, mb) == 0 && strcmp(mb, a) == 0,
	      "memo: loaded again, the same digest");
	kc_tree_memo_counts(memo, &hits, &misses);
	CHECK(hits == 3 && misses == 0, "memo: no file read the second time");
	kc_tree_memo_free(memo);
	struct stat est;
	stat(file, &est);
	put("inc/sub/b.h", "int x;\n"); /* same size as "int c;\n" */
	struct timespec keep[2] = {est.st_atim, est.st_mtim};
	utimensat(AT_FDCWD, file, keep, 0);
	memo = kc_tree_memo_load(memo_path);
	CHECK(memo && kc_tree_digest(path, (dev_t)-1, memo, mb) == 0 && strcmp(mb, a) != 0,
	      "memo: an edit with size and mtime kept is read again (its ctime moved)");
	kc_tree_memo_counts(memo, &hits, &misses);
	CHECK(hits == 2 && misses == 1, "memo: only the edited file read");
	{ /* a memo under directories that do not exist yet ($XDG_CACHE_HOME never made) */
		char deep[700];
		struct stat dst;
		snprintf(deep, sizeof(deep), "%s/xdg/new/kcachefs-nvcc/tree-memo", tmpdir);
		struct kc_tree_memo *dm = kc_tree_memo_load(deep);
		char dd[KC_SHA256_HEXLEN + 1];
		CHECK(dm && kc_tree_digest(path, (dev_t)-1, dm, dd) == 0 &&
			      kc_tree_memo_save(dm) == 0 && stat(deep, &dst) == 0 &&
			      S_ISREG(dst.st_mode),
		      "memo: saved under parents it made");
		kc_tree_memo_free(dm);
	}
	kc_tree_memo_free(memo);
	put("inc/sub/b.h", "int c;\n");
	chmod(memo_path, 0666);
	memo = kc_tree_memo_load(memo_path);
	CHECK(memo && kc_tree_digest(path, (dev_t)-1, memo, mb) == 0, "memo: writable by others");
	kc_tree_memo_counts(memo, &hits, &misses);
	CHECK(hits == 0 && misses == 3, "memo: a memo file others can write is not trusted");
	kc_tree_memo_free(memo);

	struct kc_shim_call c;
	char line[700];
	snprintf(line, sizeof(line), "k.cu -cubin -o k.cubin -O3 -I%s/inc -arch=sm_90a", tmpdir);
	char *flags = NULL;
	size_t len = 0;
	CHECK(parse(line, &c) == 1 &&
		      kc_shim_flags_file(&c, "release 13.0, V13.0.88", (dev_t)-1, NULL, &flags, &len) == 0,
	      "flags file: rendered");
	kc_tree_digest(path, (dev_t)-1, NULL, a);
	char want[1024];
	snprintf(want, sizeof(want),
		 "# kcachefs-nvcc: release 13.0, V13.0.88\n# include-root %s %s/inc\n"
		 "--kcachefs-compiler=nvcc\n-O3\n-I%s/inc\n-arch=sm_90a\n", a, tmpdir, tmpdir);
	CHECK(flags && len == strlen(want) && memcmp(flags, want, len) == 0,
	      "flags file: compiler line, include fingerprint, one argument per line");
	struct kc_argv parsed = {0};
	char why[256];
	CHECK(flags && kc_flags_parse(flags, len, &parsed, why, sizeof(why)) == 0 && parsed.n == 4 &&
		      strcmp(parsed.v[2] + 2, path) == 0,
	      "flags file: the mount reads back exactly the arguments");
	kc_argv_free(&parsed);

	char k1[KC_SHA256_HEXLEN + 1], k2[KC_SHA256_HEXLEN + 1];
	/* The key is a function of bytes: the same digest under another prefix is one key. */
	char fa[2048], fb[1024], fl[1024], fm[1024];
	snprintf(fa, sizeof(fa), "# c\n# include-root %s /a/inc\n-O3\n-I/a/inc\n", a);
	snprintf(fb, sizeof(fb), "# c\n# include-root %s /b/deep/inc\n-O3\n-I/b/deep/inc\n", a);
	CHECK(kc_key_compute("src", 3, fa, strlen(fa), k1) == 0 &&
		      kc_key_compute("src", 3, fb, strlen(fb), k2) == 0 && strcmp(k1, k2) == 0,
	      "key: one include root's bytes at two prefixes, one key");
	char *canon = NULL;
	size_t canon_len = 0;
	char cwant[512];
	snprintf(cwant, sizeof(cwant), "# c\n# include-root %s\n-O3\n-I%s\n", a, a);
	CHECK(kc_key_canonical(fb, strlen(fb), NULL, 0, &canon, &canon_len) == 1 &&
		      canon_len == strlen(cwant) && memcmp(canon, cwant, canon_len) == 0,
	      "key: the canonical flags name the root by its digest, no path left");
	free(canon);
	canon = NULL;
	CHECK(kc_key_canonical("-O3\n-I/a/inc\n", 13, NULL, 0, &canon, &canon_len) == 0 && !canon,
	      "key: flags without include roots are keyed as they are (v1)");
	snprintf(fm, sizeof(fm), "# c\n# include-root %.63s0 /a/inc\n-O3\n-I/a/inc\n", a);
	if (a[63] == '0')
		fm[strlen("# c\n# include-root ") + 63] = '1';
	CHECK(kc_key_compute("src", 3, fm, strlen(fm), k2) == 0 && strcmp(k1, k2) != 0,
	      "key: another digest at the same path, another key");
	snprintf(fl, sizeof(fl), "# c\n# include-root %s /a/inc\n-O3\n-lineinfo\n-I/a/inc\n", a);
	snprintf(fm, sizeof(fm), "# c\n# include-root %s /b/inc\n-O3\n-lineinfo\n-I/b/inc\n", a);
	CHECK(kc_key_compute("src", 3, fl, strlen(fl), k1) == 0 &&
		      kc_key_compute("src", 3, fm, strlen(fm), k2) == 0 && strcmp(k1, k2) != 0,
	      "key: with -lineinfo (paths in the cubin) the paths stay in the key");
	snprintf(fm, sizeof(fm), "# c\n# include-root %s /b/inc\n-Xptxas=-v,-lineinfo\n-I/b/inc\n", a);
	CHECK(kc_key_canonical(fm, strlen(fm), NULL, 0, &canon, &canon_len) == 1 &&
		      memmem(canon, canon_len, "/b/inc", 6) != NULL,
	      "key: -lineinfo handed to ptxas keeps the paths too");
	free(canon);
	CHECK(kc_key_canonical(fa, strlen(fa), "-O3 -G", 0, &canon, &canon_len) == 1 &&
		      memmem(canon, canon_len, "/a/inc", 6) != NULL,
	      "key: -G among the mount's flags keeps the paths in the recipe");
	free(canon);
	/* the daemon takes the digests again before compiling */
	snprintf(fa, sizeof(fa), "# include-root %s %s\n-I%s\n", a, path, path);
	CHECK(kc_tree_check_roots(fa, strlen(fa), NULL, why, sizeof(why)) == 0,
	      "check roots: the tree holds the bytes its line names");
	put("inc/c.h", "x");
	CHECK(kc_tree_check_roots(fa, strlen(fa), NULL, why, sizeof(why)) == -ESTALE &&
		      strstr(why, "changed since staged"),
	      "check roots: an edited tree is -ESTALE, and the reason says so");
	put("inc/c.h", "");
	CHECK(kc_tree_check_roots("# include-root 00 /x\n", 21, NULL, why, sizeof(why)) == -EINVAL,
	      "check roots: a malformed line is -EINVAL");
	CHECK(kc_key_compute("src", 3, flags, len, k1) == 0 &&
		      kc_key_compute("src", 3, flags, len, k2) == 0 && strcmp(k1, k2) == 0,
	      "key: stable");
	CHECK(kc_key_compute("src ", 4, flags, len, k2) == 0 && strcmp(k1, k2) != 0,
	      "key: another source, another key");
	CHECK(kc_key_compute("s", 1, "rc", 2, k1) == 0 && kc_key_compute("sr", 2, "c", 1, k2) == 0 &&
		      strcmp(k1, k2) != 0,
	      "key: the boundary between source and flags counts");
	/* -o verify_keys: the name's <hash> is a prefix (16 to 64 digits) of the key */
	static const struct {
		int digits;        /* of the key in the name; 66: the key and "00" */
		const char *source;
		int want;
		const char *what;
	} names[] = {
		{16, "src", 1, "verify_keys: a 16-digit prefix of the key names the recipe"},
		{64, "src", 1, "verify_keys: the whole key names it"},
		{64, "src!", 0, "verify_keys: another source does not match"},
		{66, "src", 0, "verify_keys: a hash longer than a SHA-256 never matches"},
		{15, "src", 0, "verify_keys: a prefix shorter than 16 digits never matches"},
	};
	char name[160], nwhy[400];
	kc_key_compute("src", 3, "-O3\n", 4, k1);
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		snprintf(name, sizeof(name), "kernel.k.%.*s%s", names[i].digits > 64 ? 64 : names[i].digits,
			 k1, names[i].digits > 64 ? "00" : "");
		nwhy[0] = '\0';
		int got = kc_key_names(name, names[i].source, strlen(names[i].source), "-O3\n", 4,
				       nwhy, sizeof(nwhy));
		CHECK(got == names[i].want && (got || strstr(nwhy, "verify_keys")), names[i].what);
	}
	free(flags);
	kc_shim_call_free(&c);

	/* known answers, computed independently with Python's hashlib from the encoding in
	 * key.h: sha256(b"kcachefs-key-v1\n3\nsrc\n2\n-G\n") */
	CHECK(kc_key_compute("src", 3, "-G", 2, k1) == 0 &&
		      strcmp(k1, "245fdffefc07b2d938d143ee8229156f94812941194faddb94eee1ffb94c2be9") == 0,
	      "key: known answer for (\"src\", \"-G\")");
	CHECK(kc_key_compute("", 0, "", 0, k1) == 0 &&
		      strcmp(k1, "062e56113f0cf1d75cafab7982f5777bbe217a560e3c39ab86b7e96437bca52e") == 0,
	      "key: known answer for the empty recipe");
}

static void test_local_includes(void)
{
	put("local.cuh", "#pragma once\n");
	static const struct {
		const char *src, *what;
		int want;
	} cases[] = {
		{"#include \"local.cuh\"\n", "local includes: a header next to the source", 1},
		{"  #  include \"local.cuh\" // x\n", "local includes: blanks around # and include", 1},
		{"#include <local.cuh>\n", "local includes: angle brackets are not searched there", 0},
		{"#include \"absent.cuh\"\n", "local includes: a name not in the directory", 0},
		{"// #include \"local.cuh\"\n", "local includes: a comment is not an include", 0},
		{"#include \"local.cuh", "local includes: an unterminated name", 0},
		{"#include \"\"\n", "local includes: an empty name", 0},
		{"#include <kc_test/scale.cuh>\nint x;\n", "local includes: DeepGEMM's kind", 0},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		CHECK(kc_shim_local_includes(cases[i].src, strlen(cases[i].src), tmpdir) ==
			      cases[i].want,
		      cases[i].what);
}

static void test_info_compiler(void)
{
	char out[256];
	const char text[] = "# HELP x\nkcachefs_hits_total 3\n# TYPE kcachefs_info gauge\n"
			    "kcachefs_info{version=\"0.1.0\",compiler=\"/opt/nvcc \\\"q\\\" \\\\ Build "
			    "cuda_13.0\",arch=\"sm_90a\"} 1\n";
	CHECK(kc_shim_info_label(text, sizeof(text) - 1, "compiler", out, sizeof(out)) == 0 &&
		      strcmp(out, "/opt/nvcc \"q\" \\ Build cuda_13.0") == 0,
	      "info: the compiler label, unescaped");
	CHECK(kc_shim_info_label("kcachefs_hits_total 3\n", 22, "compiler", out, sizeof(out)) == -ENOENT,
	      "info: no kcachefs_info line");
	/* round trip through the renderer of .kcachefs/metrics.prom */
	struct kc_stats st = {0};
	struct kc_stats_gauges g = {0};
	struct kc_stats_info info = {"0.1.0", "/odd \"path\"\\nvcc\nBuild x,flags=\"y", "sm_90a",
				     "-DA=\"b\" -lineinfo"};
	char buf[16384];
	size_t need = kc_stats_render(&st, &g, &info, KC_STATS_PROMETHEUS, buf, sizeof(buf));
	CHECK(need < sizeof(buf) && strlen(buf) == need, "info: rendered whole");
	CHECK(kc_shim_info_label(buf, need, "compiler", out, sizeof(out)) == 0 &&
		      strcmp(out, info.compiler) == 0,
	      "info: the rendered compiler reads back exactly (quotes, backslash, newline)");
	CHECK(kc_shim_info_label(buf, need, "flags", out, sizeof(out)) == 0 &&
		      strcmp(out, info.flags) == 0,
	      "info: the flags label, not a lookalike inside the compiler's value");
	CHECK(kc_shim_info_label(buf, need, "arch", out, sizeof(out)) == 0 &&
		      strcmp(out, "sm_90a") == 0,
	      "info: the arch label");
	CHECK(kc_shim_info_label(buf, need, "nolabel", out, sizeof(out)) == -ENOENT,
	      "info: a label that is not there");
	char small[64];
	size_t again = kc_stats_render(&st, &g, &info, KC_STATS_PROMETHEUS, small, sizeof(small));
	CHECK(again == need && strlen(small) == sizeof(small) - 1,
	      "render: truncated output is NUL-terminated and the needed length is returned");
	const char cut[] = "\nkcachefs_info{version=\"0\",compiler=\"/opt/nv";
	CHECK(kc_shim_info_label(cut, sizeof(cut) - 1, "compiler", out, sizeof(out)) == -ENOENT,
	      "info: a cut-off label");
}

/* .kcachefs/stats groups its lines and leaves out the groups of features that are off;
 * metrics.prom has every metric either way. */
static void test_stats_groups(void)
{
	struct kc_stats st = {0};
	struct kc_stats_gauges g = {0};
	struct kc_stats_info info = {"0.1.0", "nvcc", "sm_90a", ""};
	char text[8192], prom[16384];
	st.hits = 7;
	st.remote_hits = 5;
	kc_stats_render(&st, &g, &info, KC_STATS_TEXT, text, sizeof(text));
	kc_stats_render(&st, &g, &info, KC_STATS_PROMETHEUS, prom, sizeof(prom));
	CHECK(strstr(text, "\nlocal cache:\n  hits               7\n") &&
		      strstr(text, "\ncompiles:\n  ok ") && strstr(text, "\ninodes:\n  held "),
	      "stats: the groups of a plain mount, each line under its heading");
	CHECK(!strstr(text, "cluster store:") && !strstr(text, "eviction:"),
	      "stats: no cluster store and no eviction group when they are off");
	CHECK(strstr(prom, "\nkcachefs_remote_hits_total 5\n") &&
		      strstr(prom, "\nkcachefs_evictions_total 0\n") &&
		      strstr(prom, "\nkcachefs_max_size_bytes 0\n"),
	      "metrics: every metric, the cluster store's and eviction's too");
	g.remote_set = 1;
	g.max_entries = 200;
	kc_stats_render(&st, &g, &info, KC_STATS_TEXT, text, sizeof(text));
	const char *c = strstr(text, "\ncluster store:\n  up                 0\n  hits               5\n");
	const char *e = strstr(text, "\neviction:\n");
	CHECK(c && e && c < e && strstr(e, "  max entries        200\n"),
	      "stats: a store and a bound show their groups, in order");
	st.evictions = 3;
	g.remote_set = 0;
	g.max_entries = 0;
	kc_stats_render(&st, &g, &info, KC_STATS_TEXT, text, sizeof(text));
	CHECK(strstr(text, "\neviction:\n") && strstr(text, "  evictions          3\n"),
	      "stats: evictions made before the bound was lifted still show");
	char longid[700];
	memset(longid, 'c', sizeof(longid) - 1);
	longid[sizeof(longid) - 1] = '\0';
	info.compiler = longid;
	kc_stats_render(&st, &g, &info, KC_STATS_TEXT, text, sizeof(text));
	CHECK(strstr(text, longid) && strstr(text, "c\nlocal cache:\n"),
	      "stats: a compiler identity past 512 bytes is whole on its own line");
}

static void test_log_rewrite(void)
{
	static const struct {
		const char *in, *out, *what;
	} cases[] = {
		{"/b/.kcachefs/scratch/c12.3/kernel.cu(4): error: x\n1 error detected in the "
		 "compilation of \"/b/.kcachefs/scratch/c12.3/kernel.cu\".\n",
		 "/t/1/kernel.cu(4): error: x\n1 error detected in the compilation of "
		 "\"/t/1/kernel.cu\".\n",
		 "log: both scratch paths become the caller's input"},
		{"ptxas info: ok\n", "ptxas info: ok\n", "log: text without a scratch path is kept"},
		{"see /x/.kcachefs/scratch/a/b/kernel.cu\n", "see /x/.kcachefs/scratch/a/b/kernel.cu\n",
		 "log: a path with more than one directory below scratch is kept"},
		{"/x/.kcachefs/scratch/", "/x/.kcachefs/scratch/", "log: a cut-off path is kept"},
		{"", "", "log: empty"},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		size_t len = 0;
		char *out = kc_shim_log_rewrite(cases[i].in, strlen(cases[i].in), "/t/1/kernel.cu", &len);
		CHECK(out && len == strlen(cases[i].out) && memcmp(out, cases[i].out, len) == 0,
		      cases[i].what);
		free(out);
	}
}

static void test_find_mount(void)
{
	errno = 0;
	CHECK(kc_shim_find_mount(tmpdir) == NULL && errno == ENOENT,
	      "find_mount: a directory on no kcachefs mount gives ENOENT");
	errno = 0;
	CHECK(kc_shim_find_mount("/no/such/dir") == NULL && errno == ENOENT,
	      "find_mount: a missing directory gives NULL");
	/* a lookalike .kcachefs/stats on a non-FUSE filesystem is not a mount */
	tmptree_mkdir(tmpdir, ".kcachefs");
	put(".kcachefs/stats", "");
	char path[512];
	snprintf(path, sizeof(path), "%s/inc/sub", tmpdir);
	CHECK(kc_shim_find_mount(path) == NULL, "find_mount: .kcachefs/stats off FUSE is not a mount");
}

static void test_targets(void)
{
	static const struct {
		const char *line, *want; /* want: the joined flags after, or NULL: -EINVAL */
		const char *reason, *what;
	} cases[] = {
		{"k.cu -cubin -o k.cubin -gencode arch=compute_100a,code=sm_100a -O3",
		 "--gpu-architecture=sm_100a|-O3", NULL, "targets: one -gencode pair, the exact target"},
		{"k.cu -cubin -o k.cubin --generate-code=arch=compute_120f,code=[sm_120f]",
		 "--gpu-architecture=sm_120f", NULL, "targets: --generate-code, code in brackets"},
		{"k.cu -cubin -o k.cubin -arch=sm_120a", "-arch=sm_120a", NULL,
		 "targets: -arch=sm_120a as given"},
		{"k.cu -cubin -o k.cubin -gencode arch=compute_90a,code=sm_90a "
		 "-gencode arch=compute_100a,code=sm_100a", NULL, "2 -gencode targets",
		 "targets: several pairs go to nvcc"},
		{"k.cu -cubin -o k.cubin -gencode arch=compute_100a,code=[sm_100a,compute_100a]", NULL,
		 "PTX as well", "targets: a pair that asks for PTX goes to nvcc"},
		{"k.cu -cubin -o k.cubin -gencode arch=compute_90,code=sm_90a", NULL,
		 "another", "targets: another virtual architecture goes to nvcc"},
		{"k.cu -cubin -o k.cubin -arch=sm_90a -gencode arch=compute_90a,code=sm_90a", NULL,
		 "together with -arch", "targets: -gencode with -arch goes to nvcc"},
		{"k.cu -cubin -o k.cubin -gencode sm_90a", NULL, "not of the form",
		 "targets: a malformed value goes to nvcc"},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct kc_shim_call c;
		char why[256] = "";
		int ok = parse(cases[i].line, &c) == 1;
		int err = ok ? kc_shim_targets(&c, why, sizeof(why)) : -1;
		if (cases[i].want)
			ok = ok && err == 0 && strcmp(joined(&c), cases[i].want) == 0 &&
			     kc_shim_check(&c, why, sizeof(why)) == 0;
		else
			ok = ok && err == -EINVAL && strstr(why, cases[i].reason);
		CHECK(ok, cases[i].what);
		kc_shim_call_free(&c);
	}
}

int main(void)
{
	if (!mkdtemp(tmpdir)) {
		perror("mkdtemp");
		return 1;
	}
	test_parse();
	test_check();
	test_targets();
	test_fingerprint_and_flags_file();
	test_daemon_memo();
	test_local_includes();
	test_info_compiler();
	test_stats_groups();
	test_log_rewrite();
	test_find_mount();
	tmptree_remove(tmpdir);
	return tap_done();
}
