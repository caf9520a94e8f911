/* flags.c - see flags.h */
#include "flags.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FLAG_LINE_MAX 4096

int kc_argv_push(struct kc_argv *a, const char *arg)
{
	if (a->n + 2 > a->cap) {
		size_t cap = a->cap ? a->cap * 2 : 16;
		char **v = realloc(a->v, cap * sizeof(*v));
		if (!v)
			return -ENOMEM;
		a->v = v;
		a->cap = cap;
	}
	char *copy = strdup(arg);
	if (!copy)
		return -ENOMEM;
	a->v[a->n++] = copy;
	a->v[a->n] = NULL;
	return 0;
}

int kc_argv_extend(struct kc_argv *a, const struct kc_argv *src)
{
	for (size_t i = 0; i < src->n; i++) {
		int err = kc_argv_push(a, src->v[i]);
		if (err)
			return err;
	}
	return 0;
}

void kc_argv_free(struct kc_argv *a)
{
	for (size_t i = 0; i < a->n; i++)
		free(a->v[i]);
	free(a->v);
	a->v = NULL;
	a->n = a->cap = 0;
}

static int starts(const char *s, const char *prefix)
{
	return strncmp(s, prefix, strlen(prefix)) == 0;
}

static int refuse(char *why, size_t whylen, const char *arg, const char *reason)
{
	snprintf(why, whylen, "flag '%s' refused: %s", arg, reason);
	return -EINVAL;
}

/* A refusal of an argument that would turn the compiler against the node or the mount:
 * another output or input, a host compiler, a program, a plugin, options from a file. */
static int forbid(char *why, size_t whylen, const char *arg, const char *reason)
{
	refuse(why, whylen, arg, reason);
	return -EPERM;
}

/* Arguments allowed exactly as written. */
static const char *const exact_ok[] = {
	"--expt-relaxed-constexpr", "--expt-extended-lambda", "--extended-lambda",
	"-lineinfo", "--generate-line-info", "-use_fast_math", "--use_fast_math",
	"-G", "--device-debug", "-g", "--debug", "-w", "--disable-warnings", "--restrict",
	"-restrict", "--resource-usage", "-res-usage", "--extra-device-vectorization",
	"-Wno-deprecated-gpu-targets", "--Wno-deprecated-gpu-targets", "--display-error-number",
	"--no-display-error-number", "-O0", "-O1", "-O2", "-O3", "-std=c++11", "-std=c++14",
	"-std=c++17", "-std=c++20", "--std=c++11", "--std=c++14", "--std=c++17", "--std=c++20",
	"-rdc=false", "--relocatable-device-code=false", KC_FLAG_BACKEND "nvcc",
	KC_FLAG_BACKEND "nvrtc",
	/* NVRTC's own (DeepGEMM's NVRTC compiler passes them; nvcc refuses them itself).
	 * Automatic PCH writes its file in the compile's cwd, the private scratch directory,
	 * and removes it when the compile ends. */
	"-default-device", "--device-as-default-execution-space", "--device-int128",
	"-device-int128", "--pch", "-pch", "--pch-verbose=true", "--pch-verbose=false",
	"-pch-verbose=true", "-pch-verbose=false", "--pch-messages=true", "--pch-messages=false",
	"-pch-messages=true", "-pch-messages=false", "--instantiate-templates-in-pch=true",
	"--instantiate-templates-in-pch=false", "-instantiate-templates-in-pch=true",
	"-instantiate-templates-in-pch=false", NULL,
};

/* Arguments allowed with any value after the prefix (value checked separately where
 * it names a path). */
static const char *const prefix_ok[] = {
	"-D", "--define-macro=", "-U", "--undefine-macro=", "--diag-suppress=",
	"-diag-suppress=", "--diag-warn=", "--diag-error=", "--maxrregcount=", "-maxrregcount=",
	"--ftz=", "-ftz=", "--prec-div=", "-prec-div=", "--prec-sqrt=", "-prec-sqrt=", "--fmad=",
	"-fmad=", "--Werror=", "-Werror=", "--threads=", "-t=", "--optimize=", "-dopt=",
	"--dopt=", NULL,
};

/* Refused arguments. exact: the argument itself, or with "=value"; else any argument that
 * starts with prefix (so "-c" refuses "-c" but not "-code=", "-l" refuses "-lcuda"). */
static const struct {
	const char *prefix;
	int exact;
	const char *reason;
} refused[] = {
	{"-optf", 0, "reads arguments from a file"},
	{"-odir", 0, "names an output directory"},
	{"-o", 0, "names an output (the mount chooses where the cubin goes)"},
	{"--output-file", 0, "names an output (the mount chooses where the cubin goes)"},
	{"--output-directory", 0, "names an output directory"},
	{"-ccbin", 0, "picks a host compiler"},
	{"--compiler-bindir", 0, "picks a host compiler"},
	{"--run", 0, "runs a program"},
	{"-run", 0, "runs a program"},
	{"--keep-dir", 0, "writes intermediate files"},
	{"-keep-dir", 0, "writes intermediate files"},
	{"--keep", 1, "writes intermediate files"},
	{"-keep", 1, "writes intermediate files"},
	{"-save-temps", 1, "writes intermediate files"},
	{"--options-file", 0, "reads arguments from a file"},
	{"@", 0, "reads arguments from a file"},
	{"-Xlinker", 0, "passes options to the linker"},
	{"--linker-options", 0, "passes options to the linker"},
	{"-l", 0, "links a library"},
	{"-L", 0, "adds a library path"},
	{"-M", 0, "writes dependency files"},
	{"--dependency-output", 0, "writes dependency files"},
	{"--generate-dependencies", 0, "writes dependency files"},
	{"--generate-nonsystem-dependencies", 0, "writes dependency files"},
	{"--pre-include", 0, "includes a file outside the entry"},
	{"-include", 1, "includes a file outside the entry"},
	{"--dryrun", 1, "changes what the compiler does"},
	{"-dryrun", 1, "changes what the compiler does"},
	{"-cubin", 1, "the output kind is the mount's"},
	{"--cubin", 1, "the output kind is the mount's"},
	{"-ptx", 1, "the output kind is the mount's"},
	{"--ptx", 1, "the output kind is the mount's"},
	{"-fatbin", 1, "the output kind is the mount's"},
	{"--fatbin", 1, "the output kind is the mount's"},
	{"-c", 1, "the output kind is the mount's"},
	{"--compile", 1, "the output kind is the mount's"},
	{"-E", 1, "the output kind is the mount's"},
	{"--preprocess", 1, "the output kind is the mount's"},
	/* NVRTC's PCH files go in the compile's scratch directory (--pch) and nowhere else */
	{"--pch-dir", 0, "names where PCH files are written (with --pch: the scratch directory)"},
	{"-pch-dir", 0, "names where PCH files are written (with --pch: the scratch directory)"},
	{"--create-pch", 0, "writes a PCH file (with --pch: in the scratch directory)"},
	{"-create-pch", 0, "writes a PCH file (with --pch: in the scratch directory)"},
	{"--use-pch", 0, "reads a PCH file from outside the entry"},
	{"-use-pch", 0, "reads a PCH file from outside the entry"},
};

/* Host-compiler options accepted inside --compiler-options= / -Xcompiler=. */
static int host_option_ok(const char *opt)
{
	static const char *const bad_prefixes[] = {"-fplugin", "-wrapper", "-specs", "-B",
						   "-Wl,", "-Wa,", "-Wp,", "-o", "-x",
						   "-fdump", "-save-temps", "-M", "@",
						   "-fprofile", "-include", "-imacros", "-iplugin",
						   NULL};
	for (int i = 0; bad_prefixes[i]; i++)
		if (starts(opt, bad_prefixes[i]))
			return 0;
	if (opt[0] != '-' || strchr(opt, '\\'))
		return 0; /* nvcc turns "\\," into a comma inside one host option */
	if (strcmp(opt, "-Wl") == 0 || strcmp(opt, "-Wa") == 0 || strcmp(opt, "-Wp") == 0)
		return 0;
	if (starts(opt, "-f") || starts(opt, "-W") || starts(opt, "-O") || starts(opt, "-D") ||
	    starts(opt, "-U") || starts(opt, "-std=") || starts(opt, "-march=") ||
	    starts(opt, "-mtune=") || strcmp(opt, "-m64") == 0 || strcmp(opt, "-pthread") == 0 ||
	    strcmp(opt, "-g") == 0 || strcmp(opt, "-w") == 0)
		return 1;
	return 0;
}

static int ptxas_option_ok(const char *opt)
{
	return opt[0] == '-' && !strchr(opt, '\\') && !starts(opt, "-o") &&
	       !starts(opt, "--output") && !starts(opt, "--input-as-string") &&
	       !starts(opt, "-ias") && !starts(opt, "--options-file");
}

/* Check each comma-separated item of list (the value of arg) with item_ok. */
static int check_list(const char *arg, const char *list, int (*item_ok)(const char *),
		      const char *tool, char *why, size_t whylen)
{
	char buf[FLAG_LINE_MAX];
	char *save = NULL;

	if (strlen(list) >= sizeof(buf))
		return refuse(why, whylen, arg, "too long");
	strcpy(buf, list);
	for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
		if (!item_ok(t)) {
			char reason[256];
			snprintf(reason, sizeof(reason), "%s option '%.100s' is not allowed", tool, t);
			return forbid(why, whylen, arg, reason);
		}
	}
	return 0;
}

/* Only the form is checked here: a stat could reach into the daemon's own mount and wait
 * there, on a request thread. Whether the directory exists is checked when compiling
 * by the compiler's own uid (compile.c). */
static int check_include_dir(const char *arg, const char *dir, char *why, size_t whylen)
{
	if (dir[0] != '/')
		return refuse(why, whylen, arg, "include directories must be absolute paths");
	return 0;
}

static int check_arch(const char *arg, const char *val, char *why, size_t whylen)
{
	/* sm_90, sm_90a, sm_100f, compute_90 ... */
	const char *p = val;
	if (starts(p, "sm_"))
		p += 3;
	else if (starts(p, "compute_"))
		p += 8;
	else
		return refuse(why, whylen, arg, "architecture must look like sm_90a");
	const char *digits = p;
	while (*p >= '0' && *p <= '9')
		p++;
	if (p - digits < 2 || p - digits > 3)
		return refuse(why, whylen, arg, "architecture must look like sm_90a");
	if (*p == 'a' || *p == 'f')
		p++;
	if (*p)
		return refuse(why, whylen, arg, "architecture must look like sm_90a");
	return 0;
}

int kc_flag_check(const char *arg, char *why, size_t whylen)
{
	if (arg[0] == '\0')
		return refuse(why, whylen, arg, "empty argument");
	if (strlen(arg) >= FLAG_LINE_MAX)
		return refuse(why, whylen, arg, "too long");
	for (const char *p = arg; *p; p++) {
		if ((unsigned char)*p < 0x20 || *p == 0x7f)
			return refuse(why, whylen, arg, "control character");
		/* nvcc runs its sub-commands through a shell and puts -D values in double quotes
		 * and -Xcompiler/-Xptxas values in no quotes at all: a character the shell reads
		 * would run a command as the daemon's user. */
		if (strchr("$`;|&<>()\"'\\*?[]{}~!#", *p))
			return forbid(why, whylen, arg, "a shell metacharacter (nvcc runs a shell)");
		if (!isalnum((unsigned char)*p) && !strchr("_-.,=/+:@%", *p))
			return refuse(why, whylen, arg,
				      "only letters, digits and _-.,=/+:@% are allowed");
	}
	/* nvcc splits the values of -I, -D and -U at commas: one argument would be several */
	static const char *const split[] = {"-I", "--include-path=", "-D", "--define-macro=",
					    "-U", "--undefine-macro=", NULL};
	for (int i = 0; split[i]; i++)
		if (starts(arg, split[i]) && strchr(arg, ','))
			return refuse(why, whylen, arg, "nvcc would split it at the comma");
	for (int i = 0; exact_ok[i]; i++)
		if (strcmp(arg, exact_ok[i]) == 0)
			return 0;
	for (int i = 0; prefix_ok[i]; i++)
		if (starts(arg, prefix_ok[i]) && arg[strlen(prefix_ok[i])] != '\0')
			return 0;
	if (starts(arg, "-I") && arg[2])
		return check_include_dir(arg, arg + 2, why, whylen);
	if (starts(arg, "--include-path="))
		return check_include_dir(arg, arg + strlen("--include-path="), why, whylen);
	if (starts(arg, "--gpu-architecture="))
		return check_arch(arg, arg + strlen("--gpu-architecture="), why, whylen);
	if (starts(arg, "-arch="))
		return check_arch(arg, arg + strlen("-arch="), why, whylen);
	static const struct {
		const char *prefix, *tool;
		int (*ok)(const char *);
	} lists[] = {
		{"--compiler-options=", "host compiler", host_option_ok},
		{"-Xcompiler=", "host compiler", host_option_ok},
		{"--ptxas-options=", "ptxas", ptxas_option_ok},
		{"-Xptxas=", "ptxas", ptxas_option_ok},
	};
	for (size_t i = 0; i < sizeof(lists) / sizeof(lists[0]); i++)
		if (starts(arg, lists[i].prefix))
			return check_list(arg, arg + strlen(lists[i].prefix), lists[i].ok,
					  lists[i].tool, why, whylen);
	for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
		size_t pl = strlen(refused[i].prefix);
		if (refused[i].exact ? strncmp(arg, refused[i].prefix, pl) == 0 &&
					       (arg[pl] == '\0' || arg[pl] == '=')
				     : starts(arg, refused[i].prefix))
			return forbid(why, whylen, arg, refused[i].reason);
	}
	if (arg[0] != '-')
		return forbid(why, whylen, arg, "extra input files are not allowed");
	return refuse(why, whylen, arg, "not on the allow-list");
}

int kc_flags_parse(const char *buf, size_t len, struct kc_argv *out, char *why, size_t whylen)
{
	char line[FLAG_LINE_MAX + 1];
	size_t pos = 0;

	if (memchr(buf, '\0', len)) {
		snprintf(why, whylen, "kernel.flags refused: holds a NUL byte");
		kc_argv_free(out);
		return -EINVAL;
	}
	while (pos < len) {
		const char *nl = memchr(buf + pos, '\n', len - pos);
		size_t end = nl ? (size_t)(nl - buf) : len;
		size_t b = pos, e = end;
		while (b < e && (buf[b] == ' ' || buf[b] == '\t'))
			b++;
		while (e > b && (buf[e - 1] == ' ' || buf[e - 1] == '\t' || buf[e - 1] == '\r'))
			e--;
		pos = end + 1;
		if (e == b || buf[b] == '#')
			continue; /* empty line or comment */
		if (e - b > FLAG_LINE_MAX) {
			snprintf(why, whylen, "kernel.flags refused: a line is longer than %d bytes",
				 FLAG_LINE_MAX);
			kc_argv_free(out);
			return -EINVAL;
		}
		memcpy(line, buf + b, e - b);
		line[e - b] = '\0';
		int err = kc_flag_check(line, why, whylen);
		if (err == -EPERM)
			err = -EINVAL;
		if (!err)
			err = kc_argv_push(out, line);
		if (err) {
			kc_argv_free(out);
			return err;
		}
	}
	return 0;
}

int kc_flags_split(const char *str, struct kc_argv *out, char *why, size_t whylen)
{
	char *copy = strdup(str);
	char *save = NULL;
	int err = 0;

	if (!copy)
		return -ENOMEM;
	for (char *t = strtok_r(copy, " \t", &save); t && !err; t = strtok_r(NULL, " \t", &save)) {
		err = kc_flag_check(t, why, whylen);
		if (err == -EPERM)
			err = -EINVAL;
		if (!err)
			err = kc_argv_push(out, t);
	}
	free(copy);
	if (err)
		kc_argv_free(out);
	return err;
}

const char *kc_flags_arch(const struct kc_argv *args)
{
	const char *arch = NULL;
	for (size_t i = 0; i < args->n; i++) {
		if (starts(args->v[i], "--gpu-architecture="))
			arch = args->v[i] + strlen("--gpu-architecture=");
		else if (starts(args->v[i], "-arch="))
			arch = args->v[i] + strlen("-arch=");
	}
	return arch;
}

int kc_flags_have_arch(const struct kc_argv *args)
{
	return kc_flags_arch(args) != NULL;
}

const char *kc_flags_backend(const struct kc_argv *args)
{
	const char *backend = NULL;
	for (size_t i = 0; i < args->n; i++)
		if (starts(args->v[i], KC_FLAG_BACKEND))
			backend = args->v[i] + strlen(KC_FLAG_BACKEND);
	return backend;
}

/* Whether argument a is nvcc flag name: a name ending in '=' (and -D, -U, -I) is a prefix
 * that a value follows; any other is the whole argument. */
static int nvrtc_flag_is(const char *a, const char *name)
{
	size_t n = strlen(name);
	int prefix = name[n - 1] == '=' || strcmp(name, "-D") == 0 || strcmp(name, "-U") == 0 ||
		     strcmp(name, "-I") == 0;
	return prefix ? starts(a, name) && a[n] : strcmp(a, name) == 0;
}

/* The NVRTC spelling of nvcc argument a's flag, with *namelen the length of that flag in a;
 * NULL when NVRTC has no equivalent. */
static const char *nvrtc_spelling(const char *a, size_t *namelen)
{
	/* nvcc flags that NVRTC takes as they are */
	static const char *const same[] = {
		"-arch=", "--gpu-architecture=", "-std=", "--std=", "-D", "--define-macro=", "-U",
		"--undefine-macro=", "-I", "--include-path=", "-lineinfo", "--generate-line-info",
		"-G", "--device-debug", "--use_fast_math", "--ftz=", "--prec-div=", "--prec-sqrt=",
		"--fmad=", "--maxrregcount=", "--diag-suppress=", "--diag-error=", "-w",
		"--disable-warnings", "--restrict", "--ptxas-options=", "--display-error-number",
		"--no-display-error-number", "--dopt=", "-rdc=false", "-default-device",
		"--device-int128", "--pch", "--pch-verbose=", "--pch-messages=",
		"--instantiate-templates-in-pch=", NULL,
	};
	/* nvcc flags that NVRTC spells another way */
	static const struct {
		const char *nvcc, *nvrtc;
	} renamed[] = {
		{"-use_fast_math", "--use_fast_math"}, {"-ftz=", "--ftz="},
		{"-prec-div=", "--prec-div="}, {"-prec-sqrt=", "--prec-sqrt="},
		{"-fmad=", "--fmad="}, {"-maxrregcount=", "--maxrregcount="},
		{"-diag-suppress=", "--diag-suppress="}, {"-restrict", "--restrict"},
		{"-Xptxas=", "--ptxas-options="}, {"-dopt=", "--dopt="},
		{"--relocatable-device-code=false", "-rdc=false"},
		{"--device-as-default-execution-space", "-default-device"},
		{"-device-int128", "--device-int128"}, {"-pch", "--pch"},
		{"-pch-verbose=", "--pch-verbose="}, {"-pch-messages=", "--pch-messages="},
		{"-instantiate-templates-in-pch=", "--instantiate-templates-in-pch="},
	};
	for (size_t k = 0; same[k]; k++)
		if (nvrtc_flag_is(a, same[k])) {
			*namelen = strlen(same[k]);
			return same[k];
		}
	for (size_t k = 0; k < sizeof(renamed) / sizeof(renamed[0]); k++)
		if (nvrtc_flag_is(a, renamed[k].nvcc)) {
			*namelen = strlen(renamed[k].nvcc);
			return renamed[k].nvrtc;
		}
	return NULL;
}

int kc_flags_to_nvrtc(const struct kc_argv *in, struct kc_argv *out, char *why, size_t whylen)
{
	/* nvcc arguments for the host side, or what NVRTC does anyway: dropped */
	static const char *const host_only[] = {
		"-O0", "-O1", "-O2", "-O3", "--optimize=", "--compiler-options=", "-Xcompiler=", "--expt-relaxed-constexpr",
		"--expt-extended-lambda", "--extended-lambda", "-g", "--debug",
		"-Wno-deprecated-gpu-targets", "--Wno-deprecated-gpu-targets", "--threads=", "-t=",
		"--resource-usage", "-res-usage", "--extra-device-vectorization", "--diag-warn=",
		KC_FLAG_BACKEND, NULL,
	};
	for (size_t i = 0; i < in->n; i++) {
		const char *a = in->v[i];
		size_t pl;
		const char *to = nvrtc_spelling(a, &pl);
		int done = to != NULL;
		if (to) {
			/* nvcc takes a comma list of ptxas options; NVRTC one per argument */
			int list = strcmp(to, "--ptxas-options=") == 0;
			char buf[FLAG_LINE_MAX + 64], *save = NULL;
			snprintf(buf, sizeof(buf), "%s", a + pl);
			for (char *t = list ? strtok_r(buf, ",", &save) : buf; t;
			     t = list ? strtok_r(NULL, ",", &save) : NULL) {
				char one[FLAG_LINE_MAX + 64];
				snprintf(one, sizeof(one), "%s%s", to, t);
				if (kc_argv_push(out, one))
					goto nomem;
			}
		}
		for (int k = 0; host_only[k] && !done; k++) {
			const char *h = host_only[k];
			done = h[strlen(h) - 1] == '=' ? starts(a, h) : strcmp(a, h) == 0;
		}
		if (!done) {
			snprintf(why, whylen, "flag '%s' has no NVRTC equivalent", a);
			kc_argv_free(out);
			return -EINVAL;
		}
	}
	return 0;
nomem:
	kc_argv_free(out);
	return -ENOMEM;
}

const char *kc_flags_include_dir(const char *arg)
{
	if (starts(arg, "-I") && arg[2])
		return arg + 2;
	if (starts(arg, "--include-path="))
		return arg + strlen("--include-path=");
	return NULL;
}
