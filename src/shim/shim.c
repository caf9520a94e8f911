/* shim.c - see shim.h */
#define _GNU_SOURCE
#include "shim.h"
#include "tree.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* nvcc options written with their value as the next argument, and how kcachefs's
 * one-token form joins them: "-I" "dir" -> "-Idir", "-arch" "sm_90a" -> "-arch=sm_90a". */
static const char *const glued[] = {"-I", "-D", "-U", "-L", "-l", NULL};
static const char *const with_value[] = {
	"--include-path", "--define-macro", "--undefine-macro", "-arch", "--gpu-architecture",
	"-code", "--gpu-code", "-gencode", "--generate-code", "-Xcompiler", "--compiler-options",
	"-Xptxas", "--ptxas-options", "-Xnvlink", "--nvlink-options", "-Xlinker",
	"--linker-options", "-std", "--std", "-maxrregcount", "--maxrregcount", "-ccbin",
	"--compiler-bindir", "-isystem", "--system-include", "-include", "--pre-include", "-x",
	"--x", "-odir", "--output-directory", "-diag-suppress", "--diag-suppress", "--diag-warn",
	"--diag-error", "-t", "--threads", "-optf", "--options-file", "-MF",
	"--dependency-output", "-MT", "-ftz", "--ftz", "-prec-div", "--prec-div", "-prec-sqrt",
	"--prec-sqrt", "-fmad", "--fmad", "-rdc", "--relocatable-device-code", "-run-args",
	"--run-args", "-dopt", "--dopt", "--optimize", NULL,
};

static int in_list(const char *arg, const char *const *list)
{
	for (int i = 0; list[i]; i++)
		if (strcmp(arg, list[i]) == 0)
			return 1;
	return 0;
}

static int ends_with(const char *s, const char *suffix)
{
	size_t n = strlen(s), m = strlen(suffix);
	return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* Push opt and value as one token, making a relative include directory absolute. */
static int push_joined(struct kc_argv *a, const char *opt, const char *sep, const char *value,
		       const char *cwd)
{
	int include = strcmp(opt, "-I") == 0 || strcmp(opt, "--include-path") == 0;
	char *tok;
	int n;

	if (include && value[0] != '/' && value[0] != '\0' && cwd)
		n = asprintf(&tok, "%s%s%s/%s", opt, sep, cwd, value);
	else
		n = asprintf(&tok, "%s%s%s", opt, sep, value);
	if (n < 0)
		return -ENOMEM;
	int err = kc_argv_push(a, tok);
	free(tok);
	return err;
}

/* One token as given: "-Irel" and "--include-path=rel" get an absolute directory. */
static int push_token(struct kc_argv *a, const char *arg, const char *cwd)
{
	if (strncmp(arg, "-I", 2) == 0 && arg[2])
		return push_joined(a, "-I", "", arg + 2, cwd);
	if (strncmp(arg, "--include-path=", 15) == 0)
		return push_joined(a, "--include-path", "=", arg + 15, cwd);
	return kc_argv_push(a, arg);
}

int kc_shim_parse(int n, char *const *args, const char *cwd, struct kc_shim_call *call)
{
	int cubin = 0, inputs = 0, outputs = 0, err = 0;

	memset(call, 0, sizeof(*call));
	for (int i = 0; i < n && !err; i++) {
		const char *arg = args[i];
		if (strcmp(arg, "-cubin") == 0 || strcmp(arg, "--cubin") == 0) {
			cubin++;
		} else if (strcmp(arg, "-o") == 0 || strcmp(arg, "--output-file") == 0 ||
			   strncmp(arg, "-o=", 3) == 0 || strncmp(arg, "--output-file=", 14) == 0) {
			const char *eq = strchr(arg, '=');
			const char *value = eq ? eq + 1 : (i + 1 < n ? args[++i] : NULL);
			if (!value || !*value || outputs++)
				goto other;
			if (!(call->output = strdup(value)))
				err = -ENOMEM;
		} else if (arg[0] != '-') {
			if (!ends_with(arg, ".cu") || inputs++)
				goto other;
			if (!(call->input = strdup(arg)))
				err = -ENOMEM;
		} else if (in_list(arg, glued) || in_list(arg, with_value)) {
			if (i + 1 >= n)
				goto other;
			err = push_joined(&call->flags, arg, in_list(arg, glued) ? "" : "=",
					  args[++i], cwd);
		} else {
			err = push_token(&call->flags, arg, cwd);
		}
	}
	if (err) {
		kc_shim_call_free(call);
		return err;
	}
	if (cubin == 1 && inputs == 1 && outputs == 1)
		return 1;
other:
	kc_shim_call_free(call);
	return 0;
}

void kc_shim_call_free(struct kc_shim_call *call)
{
	free(call->input);
	free(call->output);
	kc_argv_free(&call->flags);
	call->input = call->output = NULL;
}

int kc_shim_check(const struct kc_shim_call *call, char *why, size_t whylen)
{
	for (size_t i = 0; i < call->flags.n; i++) {
		const char *arg = call->flags.v[i];
		size_t len = strlen(arg);
		if (len && (arg[0] == ' ' || arg[0] == '\t' || arg[len - 1] == ' ' ||
			    arg[len - 1] == '\t')) {
			snprintf(why, whylen, "flag '%s' refused: leading or trailing blanks", arg);
			return -EINVAL;
		}
		int err = kc_flag_check(arg, why, whylen);
		if (err)
			return err;
	}
	return 0;
}

/* The one target of a -gencode value "arch=compute_X,code=sm_X" (or "code=[sm_X]"): X
 * into target (as "sm_X"), or -EINVAL with why. */
static int gencode_target(const char *value, char *target, size_t tlen, char *why,
			  size_t whylen)
{
	char arch[32], code[64];
	const char *comma = strchr(value, ',');
	if (strncmp(value, "arch=compute_", 13) != 0 || !comma || comma - value - 13 >= 31 ||
	    strncmp(comma + 1, "code=", 5) != 0 || strlen(comma + 6) >= sizeof(code)) {
		snprintf(why, whylen, "-gencode '%s' is not of the form arch=compute_X,code=sm_X",
			 value);
		return -EINVAL;
	}
	snprintf(arch, sizeof(arch), "%.*s", (int)(comma - value - 13), value + 13);
	snprintf(code, sizeof(code), "%s", comma + 6);
	size_t cl = strlen(code);
	if (cl > 2 && code[0] == '[' && code[cl - 1] == ']') {
		memmove(code, code + 1, cl - 2);
		code[cl - 2] = '\0';
	}
	if (strstr(code, "compute_")) {
		snprintf(why, whylen, "-gencode '%s' asks for PTX as well, which a cubin cannot hold",
			 value);
		return -EINVAL;
	}
	if (strchr(code, ',')) {
		snprintf(why, whylen, "-gencode '%s' asks for several targets; a cubin holds one",
			 value);
		return -EINVAL;
	}
	if (strncmp(code, "sm_", 3) != 0 || strcmp(code + 3, arch) != 0) {
		snprintf(why, whylen, "-gencode '%s' compiles one architecture's code for another "
			 "(the mount compiles sm_X from compute_X)", value);
		return -EINVAL;
	}
	snprintf(target, tlen, "sm_%s", arch);
	return 0;
}

int kc_shim_targets(struct kc_shim_call *call, char *why, size_t whylen)
{
	static const char *const gen[] = {"-gencode=", "--generate-code=", NULL};
	static const char *const other[] = {"-arch=", "--gpu-architecture=", "-code=",
					    "--gpu-code=", NULL};
	size_t found = 0, at = 0, others = 0;
	const char *value = NULL;

	for (size_t i = 0; i < call->flags.n; i++) {
		for (int k = 0; gen[k]; k++)
			if (strncmp(call->flags.v[i], gen[k], strlen(gen[k])) == 0) {
				found++;
				at = i;
				value = call->flags.v[i] + strlen(gen[k]);
			}
		for (int k = 0; other[k]; k++)
			others += strncmp(call->flags.v[i], other[k], strlen(other[k])) == 0;
	}
	if (!found)
		return 0;
	if (found > 1) {
		snprintf(why, whylen, "%zu -gencode targets: a cubin holds one", found);
		return -EINVAL;
	}
	if (others) {
		snprintf(why, whylen, "-gencode together with -arch or -code");
		return -EINVAL;
	}
	char target[40], *tok;
	int err = gencode_target(value, target, sizeof(target), why, whylen);
	if (err)
		return err;
	if (asprintf(&tok, "--gpu-architecture=%s", target) < 0)
		return -ENOMEM;
	free(call->flags.v[at]);
	call->flags.v[at] = tok;
	return 0;
}

int kc_shim_flags_file(const struct kc_shim_call *call, const char *compiler, dev_t avoid,
		       struct kc_tree_memo *memo, char **out, size_t *out_len)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);
	int err = 0;

	if (!f)
		return -ENOMEM;
	fprintf(f, "# kcachefs-nvcc: %s\n", compiler);
	for (size_t i = 0; i < call->flags.n && !err; i++) {
		const char *dir = kc_flags_include_dir(call->flags.v[i]);
		char digest[KC_SHA256_HEXLEN + 1];
		if (dir && !(err = kc_tree_digest(dir, avoid, memo, digest)))
			fprintf(f, "%s%s %s\n", KC_TREE_ROOT_TAG, digest, dir);
	}
	/* the shim stands for nvcc, whatever the mount's default backend (a caller's own
	 * choice, later, wins) */
	fprintf(f, "%snvcc\n", KC_FLAG_BACKEND);
	for (size_t i = 0; i < call->flags.n; i++)
		fprintf(f, "%s\n", call->flags.v[i]);
	if (fclose(f) != 0 && !err)
		err = -ENOMEM;
	if (err) {
		free(buf);
		return err;
	}
	*out = buf;
	*out_len = len;
	return 0;
}

int kc_shim_local_includes(const char *src, size_t len, const char *src_dir)
{
	const char *p = src, *end = src + len;

	while (p < end) {
		const char *nl = memchr(p, '\n', (size_t)(end - p));
		const char *eol = nl ? nl : end, *q = p;
		p = eol + 1;
		while (q < eol && (*q == ' ' || *q == '\t'))
			q++;
		if (q >= eol || *q++ != '#')
			continue;
		while (q < eol && (*q == ' ' || *q == '\t'))
			q++;
		if (eol - q < 8 || memcmp(q, "include", 7) != 0)
			continue;
		q += 7;
		while (q < eol && (*q == ' ' || *q == '\t'))
			q++;
		if (q >= eol || *q++ != '"')
			continue;
		const char *close = memchr(q, '"', (size_t)(eol - q));
		if (!close || close == q)
			continue;
		char path[PATH_MAX];
		if (snprintf(path, sizeof(path), "%s/%.*s", src_dir, (int)(close - q), q) >=
		    (int)sizeof(path))
			continue;
		if (access(path, F_OK) == 0)
			return 1;
	}
	return 0;
}

int kc_shim_info_label(const char *stats, size_t len, const char *label, char *out,
		       size_t outlen)
{
	static const char mark[] = "\nkcachefs_info{";
	const char *p = memmem(stats, len, mark, sizeof(mark) - 1);
	const char *end = stats + len;
	char want[64];
	int wl = snprintf(want, sizeof(want), "%s=\"", label);

	if (!p || wl >= (int)sizeof(want))
		return -ENOENT;
	const char *line_end = memchr(p + 1, '\n', (size_t)(end - p - 1));
	if (!line_end)
		line_end = end;
	/* a label starts after '{' or ',' (so "flags" does not match inside another name) */
	for (p += sizeof(mark) - 1;; p++) {
		p = memmem(p, (size_t)(line_end - p), want, (size_t)wl);
		if (!p)
			return -ENOENT;
		if (p[-1] == '{' || p[-1] == ',')
			break;
	}
	size_t n = 0;
	for (p += wl; p < end && *p != '"' && *p != '\n'; p++) {
		char ch = *p;
		if (ch == '\\' && p + 1 < end) {
			ch = *++p;
			if (ch == 'n')
				ch = '\n';
		}
		if (n + 1 < outlen)
			out[n++] = ch;
	}
	if (p >= end || *p != '"')
		return -ENOENT;
	out[n] = '\0';
	return 0;
}

char *kc_shim_log_rewrite(const char *log, size_t len, const char *input, size_t *outlen)
{
	static const char mark[] = "/.kcachefs/scratch/", file[] = "/kernel.cu";
	char *buf = NULL;
	size_t used = 0, pos = 0;
	FILE *f = open_memstream(&buf, &used);

	if (!f)
		return NULL;
	for (;;) {
		const char *m = memmem(log + pos, len - pos, mark, sizeof(mark) - 1);
		if (!m)
			break;
		/* the path starts after a blank, quote or line start; its scratch dir is one name */
		const char *start = m;
		while (start > log + pos && !strchr(" \t\n\"'(", start[-1]))
			start--;
		const char *dir = m + sizeof(mark) - 1, *end = dir;
		while (end < log + len && *end != '/' && !strchr(" \t\n\"'", *end))
			end++;
		if ((size_t)(log + len - end) < sizeof(file) - 1 ||
		    memcmp(end, file, sizeof(file) - 1) != 0 || end == dir) {
			fwrite(log + pos, 1, (size_t)(dir - log) - pos, f); /* not ours: keep it */
			pos = (size_t)(dir - log);
			continue;
		}
		fwrite(log + pos, 1, (size_t)(start - log) - pos, f);
		fputs(input, f);
		pos = (size_t)(end - log) + sizeof(file) - 1;
	}
	fwrite(log + pos, 1, len - pos, f);
	if (fclose(f) != 0) {
		free(buf);
		return NULL;
	}
	*outlen = used;
	return buf;
}

char *kc_shim_find_mount(const char *dir)
{
	char *path = realpath(dir, NULL);

	if (!path)
		return NULL;
	for (;;) {
		if (kc_tree_is_mount_root(path))
			return path;
		char *slash = strrchr(path, '/');
		if (!slash || path[1] == '\0')
			break;
		if (slash == path)
			slash[1] = '\0'; /* "/a" -> "/" */
		else
			*slash = '\0';
	}
	free(path);
	errno = ENOENT;
	return NULL;
}
