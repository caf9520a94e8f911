/* test_flags.c - the compiler-argument allow-list and the kernel.flags reader. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "flags.h"
#include "tap.h"

/* The arguments DeepGEMM's JIT passes to nvcc (as DeepGEMM prints them on an H200 node). */
static const char *const deepgemm[] = {
	"-std=c++20",
	"--diag-suppress=39,161,174,177,186,940",
	"--ptxas-options=--register-usage-level=10",
	"--gpu-architecture=sm_90a",
	"--compiler-options=-fPIC,-O3,-fconcepts,-Wno-deprecated-declarations,-Wno-abi",
	"-O3",
	"--expt-relaxed-constexpr",
	"--expt-extended-lambda",
};
#define N_DEEPGEMM (sizeof(deepgemm) / sizeof(deepgemm[0]))

/* What DeepGEMM's NVRTC compiler (csrc/jit/compiler.hpp at 54e2261) adds to the flags above
 * that it keeps (-std=, --diag-suppress=, --ptxas-options=): its include directories, the
 * architecture, and NVRTC's own options (--pch-verbose=true with DG_JIT_DEBUG). */
static const char *const deepgemm_nvrtc[] = {
	"-I/usr/local/lib/python3/dist-packages/deep_gemm/include",
	"-I/usr/local/cuda/include",
	"--gpu-architecture=sm_90a",
	"-default-device",
	"--pch",
	"--pch-verbose=true",
	"--device-int128",
};
#define N_DEEPGEMM_NVRTC (sizeof(deepgemm_nvrtc) / sizeof(deepgemm_nvrtc[0]))

/* arg as printable text for a TAP description (no control characters, no '#'). */
static const char *printable(const char *arg)
{
	static char buf[256];
	size_t i;
	for (i = 0; arg[i] && i < sizeof(buf) - 1; i++) {
		unsigned char c = (unsigned char)arg[i];
		buf[i] = (c < 0x20 || c == 0x7f || c == '#') ? '?' : (char)c;
	}
	buf[i] = '\0';
	return buf;
}

static void allowed(const char *arg)
{
	char why[512] = "";
	char msg[512];
	int err = kc_flag_check(arg, why, sizeof(why));
	snprintf(msg, sizeof(msg), "allowed: %s", printable(arg));
	CHECK(err == 0, msg);
	if (err)
		printf("# refused with: %s\n", why);
}

/* want: -EPERM for what would turn the compiler against the node, -EINVAL otherwise */
static void refused_as(const char *arg, int want)
{
	char why[512] = "";
	char quoted[512];
	char msg[600];

	int err = kc_flag_check(arg, why, sizeof(why));
	snprintf(msg, sizeof(msg), "refused with %s: '%s'", want == -EPERM ? "-EPERM" : "-EINVAL",
		 printable(arg));
	CHECK(err == want, msg);
	snprintf(quoted, sizeof(quoted), "'%s'", arg);
	snprintf(msg, sizeof(msg), "why names the flag: '%s'", printable(arg));
	CHECK(strstr(why, quoted) != NULL, msg);
}

#define refused(arg) refused_as((arg), -EPERM)
#define unsupported(arg) refused_as((arg), -EINVAL)

static void test_check(void)
{
	for (size_t i = 0; i < N_DEEPGEMM; i++)
		allowed(deepgemm[i]);
	allowed("-I/usr/include");
	allowed("--include-path=/usr/include");
	allowed("-DNDEBUG");
	allowed("-DKC_BLOCK=128");
	allowed("-arch=sm_90");
	allowed("--gpu-architecture=compute_90");
	allowed("-arch=sm_100f");
	allowed("-Xptxas=-v");
	allowed("-lineinfo");

	refused("-o");
	unsupported("-o x"); /* a blank: refused before anything else */
	refused("-ox");
	refused("x");
	refused("--output-file=x");
	refused("--output-file");
	refused("-ccbin=/bin/sh");
	refused("-ccbin");
	refused("--compiler-bindir=/x");
	refused("--run");
	refused("-run");
	refused("@file");
	refused("--options-file=x");
	refused("-optf=x");
	allowed("-I/does/not/exist"); /* only the form here: existence is checked at compile */
	unsupported("-Irelative");
	unsupported("--include-path=relative");
	allowed("-I/etc/passwd"); /* likewise */
	refused("--compiler-options=-fplugin=x.so");
	refused("--compiler-options=-fPIC,-fplugin=x.so"); /* a bad one after a good one */
	refused("-Xcompiler=-B/tmp");
	refused("--compiler-options=-Wl,-rpath");
	refused("--compiler-options=-specs=/tmp/x");
	refused("--compiler-options=x.o");
	refused("--ptxas-options=-o,/tmp/x");
	refused("--ptxas-options=-v,--output-file=/tmp/x");
	refused("-Xptxas=-o,/tmp/x");
	refused("extra.cu");
	refused("/tmp/extra.cu");
	unsupported("-arch=bogus");
	unsupported("-arch=sm_");
	unsupported("-arch=sm_90x");
	unsupported("--gpu-architecture=sm_90a,sm_80");
	unsupported("--frobnicate");
	refused("-cubin");
	refused("-ptx");
	refused("-Xlinker=-rpath");
	refused("-lcuda");
	refused("-include=/etc/passwd");
	unsupported("");
	unsupported("-O3\x01");
	unsupported("-DX\nY");
	unsupported("-DX\x7f");
	unsupported("-D"); /* prefix with no value */

	/* nvcc runs sub-commands through a shell: -D values go in double quotes, -Xcompiler and
	 * -Xptxas values in none. Every character a shell reads is refused. */
	refused("-DX=$(id>/tmp/kc-pwned)");
	refused("-DX=`id`");
	refused("-DX=\"a\"");
	refused("-DX='a'");
	refused("-Xptxas=-v;id>/tmp/kc-pwned;echo");
	refused("--compiler-options=-Wall|id");
	refused("--compiler-options=-Wall&&id");
	refused("-DX=a>b");
	refused("-DX=(1)");
	refused("-DX=\\n");
	refused("-DX=*");
	refused("-DX=~root");
	refused("-DX=!1");
	refused("-DX={1}");
	refused("-DX=#1");
	unsupported("-DX=a b");
	unsupported("-Xcompiler=-Wall\t-o");
	unsupported("-DX=\xc3\xa9");
	allowed("-DX=a.b:c/d+e.f@g%h-i_j");
	unsupported("-DX=a,b"); /* nvcc would split it at the comma */
	unsupported("-I/a,/b");
	unsupported("--include-path=/a,/b");
	unsupported("-UX,Y");
	unsupported("-DX=a^b"); /* outside the allowed set, not a shell character */
	/* prefixes refuse only what they name */
	unsupported("-code=sm_90a");
	unsupported("-cudart=static");
	unsupported("--keep-device-functions");
	refused("-c");
	refused("-c=x");
	refused("--keep");
	refused("--keep-dir=/tmp");
	refused("-MD");
	refused("-lcuda");
	refused("-odir=/tmp");
	refused("-optf=/tmp/x");

	/* nvcc honours "\," and would pass "-Wl,-O1" on to the host compiler */
	char why[512] = "";
	CHECK(kc_flag_check("--compiler-options=-Wl\\,-O1", why, sizeof(why)) == -EPERM, "refused: --compiler-options=-Wl\\,-O1");

	/* why is always NUL-terminated within whylen */
	char small[8];
	memset(small, 'Z', sizeof(small));
	int err = kc_flag_check("--frobnicate-something-long", small, 6);
	CHECK(err == -EINVAL, "refused with a short why buffer");
	CHECK(memchr(small, '\0', 6) != NULL && small[6] == 'Z' && small[7] == 'Z',
	      "short why is NUL-terminated and not overrun");
}

static void test_parse(void)
{
	struct kc_argv a = {0};
	char why[512] = "";
	int err;

	const char text[] = "-O3\n\n  -std=c++17  \r\n\t--expt-relaxed-constexpr\r\n\r\n   \n";
	err = kc_flags_parse(text, sizeof(text) - 1, &a, why, sizeof(why));
	CHECK(err == 0, "parse: blanks, CRLF and empty lines tolerated");
	CHECK(a.n == 3, "parse: three arguments");
	CHECK(a.n == 3 && strcmp(a.v[0], "-O3") == 0 && strcmp(a.v[1], "-std=c++17") == 0 &&
		      strcmp(a.v[2], "--expt-relaxed-constexpr") == 0,
	      "parse: arguments trimmed and in order");
	CHECK(a.v && a.v[a.n] == NULL, "parse: vector is NULL-terminated");
	kc_argv_free(&a);
	CHECK(a.v == NULL && a.n == 0, "argv_free empties the vector");

	/* files taken: how many arguments, and the last of them (NULL: not looked at) */
	static const struct {
		const char *text, *last, *what;
		size_t len; /* 0: the whole text */
		size_t n;
	} taken[] = {
		{"-O3\n-G", "-G", "parse: last line without a newline", 0, 2},
		/* len is honoured: the bytes after it are not read */
		{"-O3\n--frobnicate\n", NULL, "parse: stops at len", 4, 1},
		{"", NULL, "parse: empty buffer gives no arguments", 0, 0},
		{"\n \r\n\t\n", NULL, "parse: only blank lines gives no arguments", 0, 0},
		{"# kcachefs-nvcc: release 13.0\n  # -o /etc/passwd\n-O3\n#-ccbin=/x\n", "-O3",
		 "parse: '#' lines (also indented) are comments, not arguments", 0, 1},
	};
	for (size_t i = 0; i < sizeof(taken) / sizeof(taken[0]); i++) {
		size_t len = taken[i].len ? taken[i].len : strlen(taken[i].text);
		err = kc_flags_parse(taken[i].text, len, &a, why, sizeof(why));
		CHECK(err == 0 && a.n == taken[i].n &&
			      (!taken[i].last || strcmp(a.v[a.n - 1], taken[i].last) == 0),
		      taken[i].what);
		kc_argv_free(&a);
	}

	/* every DeepGEMM flag, one per line */
	char dg[2048] = "";
	for (size_t i = 0; i < N_DEEPGEMM; i++) {
		strcat(dg, deepgemm[i]);
		strcat(dg, "\n");
	}
	err = kc_flags_parse(dg, strlen(dg), &a, why, sizeof(why));
	CHECK(err == 0 && a.n == N_DEEPGEMM, "parse: DeepGEMM flags file");
	CHECK(kc_flags_have_arch(&a), "have_arch: DeepGEMM flags choose an architecture");
	kc_argv_free(&a);

	/* refused files: -EINVAL, the out vector emptied (also one that held an argument), and
	 * why naming the cause */
#define NUL_FILE "-O3\n\0-G\n"
#define BAD_FILE "-O3\n-std=c++17\n-o\n-G\n"
#define BADLAST_FILE "-O3\nkernel2.cu"
	static const struct {
		const char *text, *cause, *what;
		size_t len;
		int held;
	} refused[] = {
		{NUL_FILE, "NUL", "a NUL byte", sizeof(NUL_FILE) - 1, 0},
		{NUL_FILE, NULL, "a NUL byte (non-empty out)", sizeof(NUL_FILE) - 1, 1},
		{BAD_FILE, "'-o'", "a refused line", sizeof(BAD_FILE) - 1, 0},
		{BAD_FILE, NULL, "a refused line (non-empty out)", sizeof(BAD_FILE) - 1, 1},
		{BADLAST_FILE, NULL, "a refused last line", sizeof(BADLAST_FILE) - 1, 0},
		/* one token per line: '#' after an argument is not a comment */
		{"-O3 # note\n", NULL, "'#' after an argument", 11, 0},
	};
	for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
		char what[160];
		if (refused[i].held)
			kc_argv_push(&a, "-G");
		why[0] = '\0';
		err = kc_flags_parse(refused[i].text, refused[i].len, &a, why, sizeof(why));
		snprintf(what, sizeof(what), "parse: %s refuses the file", refused[i].what);
		CHECK(err == -EINVAL, what);
		snprintf(what, sizeof(what), "parse: %s leaves out empty and freed", refused[i].what);
		CHECK(a.n == 0 && a.v == NULL, what);
		if (refused[i].cause) {
			snprintf(what, sizeof(what), "parse: why names %s", refused[i].cause);
			CHECK(strstr(why, refused[i].cause) != NULL, what);
		}
		kc_argv_free(&a);
	}

	/* a line longer than 4096 bytes */
	size_t biglen = 5000;
	char *big = malloc(biglen + 2);
	if (big) {
		big[0] = '-';
		big[1] = 'D';
		memset(big + 2, 'x', biglen - 2);
		big[biglen] = '\n';
		big[biglen + 1] = '\0';
		err = kc_flags_parse(big, biglen + 1, &a, why, sizeof(why));
		CHECK(err == -EINVAL && a.n == 0, "parse: a 5000-byte line is refused");
		kc_argv_free(&a);
		free(big);
	}

	/* the sample kernels' flags files parse */
	const char *dir = getenv("KC_TEST_KERNELS");
	char path[4096];
	snprintf(path, sizeof(path), "%s/vector_add.flags", dir ? dir : "tests/kernels");
	int fd = open(path, O_RDONLY);
	char fbuf[4096];
	ssize_t n = fd >= 0 ? read(fd, fbuf, sizeof(fbuf)) : -1;
	if (fd >= 0)
		close(fd);
	CHECK(n > 0, "read tests/kernels/vector_add.flags");
	if (n > 0) {
		err = kc_flags_parse(fbuf, (size_t)n, &a, why, sizeof(why));
		CHECK(err == 0 && a.n >= 1, "parse: vector_add.flags is accepted");
		CHECK(!kc_flags_have_arch(&a), "have_arch: vector_add.flags picks no architecture");
		kc_argv_free(&a);
	}
}

static void test_split(void)
{
	struct kc_argv a = {0};
	char why[512] = "";
	int err;

	err = kc_flags_split("  -O3\t-std=c++17   --expt-relaxed-constexpr ", &a, why, sizeof(why));
	CHECK(err == 0 && a.n == 3, "split: three arguments");
	CHECK(a.n == 3 && strcmp(a.v[0], "-O3") == 0 && strcmp(a.v[1], "-std=c++17") == 0 &&
		      strcmp(a.v[2], "--expt-relaxed-constexpr") == 0 && a.v[3] == NULL,
	      "split: arguments in order, NULL-terminated");
	kc_argv_free(&a);

	err = kc_flags_split("", &a, why, sizeof(why));
	CHECK(err == 0 && a.n == 0, "split: empty string gives no arguments");
	kc_argv_free(&a);

	err = kc_flags_split("-O3 -ccbin=/bin/sh -G", &a, why, sizeof(why));
	CHECK(err == -EINVAL && a.n == 0 && a.v == NULL, "split: a refused argument refuses all");
	CHECK(strstr(why, "'-ccbin=/bin/sh'") != NULL, "split: why names the refused argument");
	kc_argv_free(&a);
}

static void test_argv_arch(void)
{
	struct kc_argv a = {0}, b = {0};

	CHECK(!kc_flags_have_arch(&a), "have_arch: empty vector");
	kc_argv_push(&a, "-O3");
	kc_argv_push(&a, "-DARCH=sm_90");
	CHECK(!kc_flags_have_arch(&a), "have_arch: no architecture flag");
	kc_argv_push(&b, "-arch=sm_90");
	CHECK(kc_flags_have_arch(&b), "have_arch: -arch=");
	kc_argv_free(&b);
	kc_argv_push(&b, "-G");
	kc_argv_push(&b, "--gpu-architecture=sm_90a");
	CHECK(kc_flags_have_arch(&b), "have_arch: --gpu-architecture= not first");

	/* push copies and grows past the first allocation */
	char tmp[16];
	for (int i = 0; i < 40; i++) {
		snprintf(tmp, sizeof(tmp), "-DN%d", i);
		kc_argv_push(&a, tmp);
	}
	strcpy(tmp, "-Dchanged");
	CHECK(a.n == 42 && strcmp(a.v[41], "-DN39") == 0 && a.v[42] == NULL,
	      "push: 42 copies, NULL-terminated");
	CHECK(kc_argv_extend(&a, &b) == 0 && a.n == 44 && strcmp(a.v[43], "--gpu-architecture=sm_90a") == 0,
	      "extend: appends every string of src");
	CHECK(kc_flags_have_arch(&a), "have_arch: after extend");
	kc_argv_free(&a);
	kc_argv_free(&b);
}

static void test_include_dir(void)
{
	CHECK(strcmp(kc_flags_include_dir("-I/usr") ?: "", "/usr") == 0, "include dir: -I<dir>");
	CHECK(strcmp(kc_flags_include_dir("--include-path=/tmp") ?: "", "/tmp") == 0,
	      "include dir: --include-path=<dir>");
	CHECK(kc_flags_include_dir("-I") == NULL && kc_flags_include_dir("-O3") == NULL &&
		      kc_flags_include_dir("--include-paths") == NULL,
	      "include dir: none in -I alone, -O3, a longer option");
}

static void test_nvrtc(void)
{
	struct kc_argv in = {0}, out = {0};
	char why[512] = "";
	/* DeepGEMM's flags: device-side ones kept, host-side ones dropped */
	for (size_t i = 0; i < N_DEEPGEMM; i++)
		kc_argv_push(&in, deepgemm[i]);
	kc_argv_push(&in, "-Xptxas=-v");
	kc_argv_push(&in, "-DKC=1");
	kc_argv_push(&in, "-use_fast_math");
	kc_argv_push(&in, KC_FLAG_BACKEND "nvrtc");
	CHECK(kc_flags_to_nvrtc(&in, &out, why, sizeof(why)) == 0, "nvrtc: DeepGEMM's flags translate");
	char joined[2048] = "";
	for (size_t i = 0; i < out.n; i++) {
		strcat(joined, out.v[i]);
		strcat(joined, "|");
	}
	CHECK(strcmp(joined, "-std=c++20|--diag-suppress=39,161,174,177,186,940|"
			     "--ptxas-options=--register-usage-level=10|--gpu-architecture=sm_90a|"
			     "--ptxas-options=-v|-DKC=1|--use_fast_math|") == 0,
	      "nvrtc: kept in order, -Xptxas/-use_fast_math respelled; -O3, host options, "
	      "--expt-*, the backend choice dropped");
	kc_argv_free(&out);
	kc_argv_free(&in);

	kc_argv_push(&in, "-O3");
	kc_argv_push(&in, "-Irel-is-refused-earlier-but-not-here");
	kc_argv_push(&in, "-G");
	CHECK(kc_flags_to_nvrtc(&in, &out, why, sizeof(why)) == 0 && out.n == 2,
	      "nvrtc: -I and -G kept, -O3 dropped");
	kc_argv_free(&out);
	kc_argv_free(&in);

	kc_argv_push(&in, "-Xptxas=-v,-O3");
	CHECK(kc_flags_to_nvrtc(&in, &out, why, sizeof(why)) == 0 && out.n == 2 &&
		      strcmp(out.v[0], "--ptxas-options=-v") == 0 &&
		      strcmp(out.v[1], "--ptxas-options=-O3") == 0,
	      "nvrtc: a comma list of ptxas options becomes one option each");
	kc_argv_free(&out);
	kc_argv_free(&in);
	kc_argv_push(&in, "--Werror=all-warnings");
	CHECK(kc_flags_to_nvrtc(&in, &out, why, sizeof(why)) == -EINVAL,
	      "nvrtc: warnings as errors are not dropped: refused (a source nvcc fails is not published)");
	kc_argv_free(&in);

	kc_argv_push(&in, "-lineinfo");
	kc_argv_push(&in, "--resource-usage");
	kc_argv_push(&in, "-Og");
	CHECK(kc_flags_to_nvrtc(&in, &out, why, sizeof(why)) == -EINVAL && strstr(why, "'-Og'") &&
		      out.n == 0 && out.v == NULL,
	      "nvrtc: an argument with no equivalent is named, and out is freed");
	kc_argv_free(&in);

	kc_argv_push(&in, "-DA");
	kc_argv_push(&in, KC_FLAG_BACKEND "nvcc");
	kc_argv_push(&in, KC_FLAG_BACKEND "nvrtc");
	CHECK(kc_flags_backend(&in) && strcmp(kc_flags_backend(&in), "nvrtc") == 0,
	      "backend: the last choice wins");
	kc_argv_free(&in);
	CHECK(kc_flags_backend(&in) == NULL, "backend: none chosen");
	allowed(KC_FLAG_BACKEND "nvcc");
	allowed(KC_FLAG_BACKEND "nvrtc");
	unsupported(KC_FLAG_BACKEND "clang");
	unsupported(KC_FLAG_BACKEND);
}

/* NVRTC's own options, as DeepGEMM's NVRTC compiler passes them: allowed and kept. PCH files
 * go only where automatic PCH puts them (the compile's TMPDIR, its scratch directory): an
 * option that names a PCH file or directory is refused. */
static void test_nvrtc_own_options(void)
{
	struct kc_argv in = {0}, out = {0};
	char why[512] = "", joined[2048] = "";

	/* NVRTC's other spellings of the same options */
	static const char *const other[] = {
		"--device-as-default-execution-space", "-device-int128", "-pch",
		"-pch-verbose=false", "-pch-messages=false", "-instantiate-templates-in-pch=false",
	};
	for (size_t i = 0; i < N_DEEPGEMM_NVRTC; i++) {
		allowed(deepgemm_nvrtc[i]);
		kc_argv_push(&in, deepgemm_nvrtc[i]);
	}
	for (size_t i = 0; i < sizeof(other) / sizeof(other[0]); i++) {
		allowed(other[i]);
		kc_argv_push(&in, other[i]);
	}
	CHECK(kc_flags_to_nvrtc(&in, &out, why, sizeof(why)) == 0,
	      "nvrtc: DeepGEMM's NVRTC options translate");
	for (size_t i = 0; i < out.n; i++) {
		strcat(joined, out.v[i]);
		strcat(joined, "|");
	}
	CHECK(strcmp(joined, "-I/usr/local/lib/python3/dist-packages/deep_gemm/include|"
			     "-I/usr/local/cuda/include|--gpu-architecture=sm_90a|-default-device|"
			     "--pch|--pch-verbose=true|--device-int128|-default-device|"
			     "--device-int128|--pch|--pch-verbose=false|--pch-messages=false|"
			     "--instantiate-templates-in-pch=false|") == 0,
	      "nvrtc: kept in order, short and long spellings as NVRTC takes them");
	kc_argv_free(&out);
	kc_argv_free(&in);

	/* a PCH file or directory of the client's choosing is written or read outside the
	 * scratch directory: refused, whatever the spelling */
	refused("--pch-dir=/tmp");
	refused("-pch-dir=/tmp");
	refused("--pch-dir");
	refused("--create-pch=/home/u/x.pch");
	refused("-create-pch=/home/u/x.pch");
	refused("--use-pch=/home/u/x.pch");
	refused("-use-pch=/home/u/x.pch");
	unsupported("--pch=/tmp");
	unsupported("--pch-verbose=yes");
	unsupported("-default-device=1");
	unsupported("--device-int128=1");
	kc_flag_check("--create-pch=/x.pch", why, sizeof(why));
	CHECK(strstr(why, "writes a PCH file") != NULL, "why: --create-pch writes a PCH file");
	kc_flag_check("--pch-dir=/x", why, sizeof(why));
	CHECK(strstr(why, "names where PCH files are written") != NULL,
	      "why: --pch-dir names where PCH files are written");
	kc_flag_check("--use-pch=/x.pch", why, sizeof(why));
	CHECK(strstr(why, "reads a PCH file") != NULL, "why: --use-pch reads a PCH file");
	/* -I beside them follows the rules of every -I */
	unsupported("-Irelative/include");
	unsupported("-I/usr/local/cuda/include,/etc");

	const char *flags = "-default-device\n--device-int128\n--pch\n-I/usr/local/cuda/include\n"
			    "-I/usr/local/cuda/include/cccl\n--kcachefs-compiler=nvrtc\n";
	CHECK(kc_flags_parse(flags, strlen(flags), &in, why, sizeof(why)) == 0 && in.n == 6,
	      "parse: a kernel.flags with NVRTC's options is staged");
	kc_argv_free(&in);
	flags = "--pch\n--pch-dir=/tmp\n";
	CHECK(kc_flags_parse(flags, strlen(flags), &in, why, sizeof(why)) == -EINVAL &&
		      strstr(why, "'--pch-dir=/tmp'") && in.n == 0,
	      "parse: a kernel.flags with --pch-dir= is refused and names it");
	kc_argv_free(&in);
}

int main(void)
{
	test_check();
	test_parse();
	test_split();
	test_argv_arch();
	test_nvrtc();
	test_nvrtc_own_options();
	test_include_dir();
	return tap_done();
}
