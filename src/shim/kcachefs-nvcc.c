/* kcachefs-nvcc.c - kcachefs-nvcc: an nvcc that compiles each kernel once per node.
 *
 * Point a JIT client's compiler at it (DG_JIT_NVCC_COMPILER=kcachefs-nvcc). A call
 * "X.cu -cubin -o OUT <flags>" whose OUT lies on a kcachefs mount (or with KCACHEFS_MOUNT
 * set) is served by the mount: the source and flags are staged into
 * <mount>/kcachefs-nvcc/kernel.nvcc.<key> (key: src/entry/key.h over the staged bytes, whose
 * kernel.flags names the mount's compiler and fingerprints the include trees), the entry's
 * kernel.cubin is opened (the mount compiles it once; concurrent shims wait on the same
 * compile), checked to be the compile of this very recipe (KC_IOC_GET_KEY), and its bytes
 * are put at OUT atomically, with the compiler's warnings on stderr.
 *
 * Everything else is the real nvcc's (src/compile/nvcc.h finds it as the daemon does, or
 * KCACHEFS_NVCC names it), exec'd with the same arguments: calls that are not a
 * single-source cubin compile, calls off the mount, calls the mount cannot reproduce (local
 * includes, NVCC_APPEND_FLAGS and the like, flags it does not take), calls it cannot serve
 * (a warning says why), and calls whose compile the mount saw fail, so that errors and exit
 * status are nvcc's own.
 *
 * Exit status: nvcc's; 0 when the mount served the call; 1 for a refused flag (one that would
 * turn the compiler against the node) or another error of the shim itself, with a line
 * "kcachefs-nvcc: ..." on stderr.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <dirent.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "identity.h"
#include "io.h"
#include "key.h"
#include "name.h"
#include "nvcc.h"
#include "shim.h"

#define SHIM_MAX_SOURCE (256u << 20) /* bytes of source the shim reads; the mount caps lower */

static const char *real_nvcc;

/* One line on stderr: "kcachefs-nvcc: " prefix, the message, suffix. */
static void say(const char *prefix, const char *suffix, const char *fmt, va_list ap)
{
	fprintf(stderr, "kcachefs-nvcc: %s", prefix);
	vfprintf(stderr, fmt, ap);
	fprintf(stderr, "%s\n", suffix);
}

/* An error of the shim itself: says why, returns the exit status 1. */
static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	say("", "", fmt, ap);
	va_end(ap);
	return 1;
}

/* Replace this process with the real nvcc, same arguments. */
static int run_nvcc(char **argv)
{
	if (!real_nvcc)
		return fail("cannot find the real nvcc (set KCACHEFS_NVCC or CUDA_HOME)");
	argv[0] = (char *)real_nvcc;
	execv(real_nvcc, argv);
	return fail("cannot run %s: %s", real_nvcc, strerror(errno));
}

/* Stage one file of the entry: write it and close it; the close is the commit. Returns 0
 * (staged, or the same bytes were already there), -EEXIST (other bytes are staged) or
 * -errno. */
static int stage(int entry_fd, const char *name, const char *buf, size_t len)
{
	int fd = openat(entry_fd, name, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return -errno;
	int err = kc_write_all(fd, buf, len);
	if (close(fd) != 0 && !err)
		err = -errno;
	return err;
}

/* The directory part of path: "." when it has none. */
static void parent_dir(const char *path, char *out, size_t len)
{
	const char *slash = strrchr(path, '/');
	if (!slash)
		snprintf(out, len, ".");
	else if (slash == path)
		snprintf(out, len, "/");
	else
		snprintf(out, len, "%.*s", (int)(slash - path), path);
}

/* Write bytes to path through a temporary in its directory and a rename. */
static int put_output(const char *path, const char *buf, size_t len)
{
	char tmp[PATH_MAX];
	const char *slash = strrchr(path, '/');
	int dirlen = slash ? (int)(slash - path + 1) : 0;
	unsigned rnd = 0;
	int fd = -1;

	for (int tries = 0; fd < 0 && tries < 100; tries++) {
		if (getrandom(&rnd, sizeof(rnd), 0) != sizeof(rnd))
			rnd = (unsigned)getpid() * 2654435761u + (unsigned)tries;
		if (snprintf(tmp, sizeof(tmp), "%.*s.kcachefs-nvcc.%08x", dirlen, path, rnd) >=
		    (int)sizeof(tmp))
			return -ENAMETOOLONG;
		fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
		if (fd < 0 && errno != EEXIST)
			return -errno;
	}
	if (fd < 0)
		return -EEXIST;
	if (fd < 0)
		return -errno;
	int err = kc_write_all(fd, buf, len);
	if (close(fd) != 0 && !err)
		err = -errno;
	if (!err && rename(tmp, path) != 0)
		err = -errno;
	if (err)
		unlink(tmp);
	return err;
}

/* The first line of the entry's kernel.log: the mount's summary of the last compile
 * ("kcachefs: compile ...: published (ok) in ..." or "...: rejected (compiler exited with
 * status 2) in ...", see cache.c), and the rest: the compiler's own output. Returns the
 * whole log (malloc'd, *len bytes, *head the length of the first line) or NULL. */
static char *read_log(int entry_fd, size_t *len, size_t *head)
{
	int fd = openat(entry_fd, KC_LOG_NAME, O_RDONLY | O_CLOEXEC);
	char *log = NULL;

	if (fd < 0)
		return NULL;
	if (kc_read_all(fd, 16u << 20, &log, len) != 0)
		log = NULL;
	close(fd);
	if (log) {
		char *nl = memchr(log, '\n', *len);
		*head = nl ? (size_t)(nl - log + 1) : *len;
	}
	return log;
}

/* Nonzero if the entry's last compile was rejected by the compiler (errors in the source). */
static int rejected(int entry_fd)
{
	size_t len = 0, head = 0;
	char *log = read_log(entry_fd, &len, &head);
	int r = log && memmem(log, head, ": rejected (", 12) != NULL;
	free(log);
	return r;
}

/* Print the compiler's output of a published compile (its warnings) as nvcc would, naming
 * the caller's input instead of the mount's scratch copy. Only a log the daemon wrote (owned
 * by owner) is printed: in a shared mount the entry's owner could put another there. */
static void print_log(int entry_fd, uid_t owner, const char *input)
{
	size_t len = 0, head = 0, body_len = 0;
	struct stat st;
	if (fstatat(entry_fd, KC_LOG_NAME, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_uid != owner)
		return;
	char *log = read_log(entry_fd, &len, &head);
	if (!log)
		return;
	char *body = kc_shim_log_rewrite(log + head, len - head, input, &body_len);
	if (body)
		fwrite(body, 1, body_len, stderr);
	else
		fwrite(log + head, 1, len - head, stderr);
	free(body);
	free(log);
}

#define TO_NVCC (-1) /* serve(): hand the call to the real nvcc */

/* Say why the mount cannot serve this call; the caller hands it to nvcc. */
static int to_nvcc(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int to_nvcc(const char *fmt, ...)
{
	char suffix[4200];
	va_list ap;
	snprintf(suffix, sizeof(suffix), "; compiling with %s instead",
		 real_nvcc ? real_nvcc : "nvcc");
	va_start(ap, fmt);
	say("warning: ", suffix, fmt, ap);
	va_end(ap);
	return TO_NVCC;
}

/* Nonzero if path names kernel.cu/.flags/.cubin/.log inside a kernel entry: a file the
 * mount manages, which nvcc would meet as such (e.g. a published cubin is read-only). */
static int output_is_staged(const char *path)
{
	char dir[PATH_MAX];
	const char *base = strrchr(path, '/');
	parent_dir(path, dir, sizeof(dir));
	const char *entry = strrchr(dir, '/');
	return kc_name_role(base ? base + 1 : path) != KC_ROLE_PLAIN &&
	       kc_name_classify(entry ? entry + 1 : dir, NULL) == KC_NAME_ENTRY;
}

/* From the mount's .kcachefs/metrics.prom (one read): the uid the daemon runs as (the file's
 * owner), and what it compiles with (its kcachefs_info) as "<compiler>", with
 * "; mount flags: <flags>" after it when -o flags= adds arguments to every compile.
 * Returns 0 or -errno. */
static int mount_info(int root_fd, uid_t *owner, char *out, size_t len)
{
	char *text = NULL, compiler[KC_COMPILER_ID_MAX], flags[4096];
	size_t n = 0;
	struct stat st;
	int fd = openat(root_fd, ".kcachefs/metrics.prom", O_RDONLY | O_CLOEXEC);
	int err = fd < 0 || fstat(fd, &st) != 0 ? -errno : kc_read_all(fd, 1u << 20, &text, &n);
	if (fd >= 0)
		close(fd);
	if (!err)
		err = kc_shim_info_label(text, n, "compiler", compiler, sizeof(compiler));
	if (!err) {
		*owner = st.st_uid;
		if (kc_shim_info_label(text, n, "flags", flags, sizeof(flags)) == 0 && *flags)
			snprintf(out, len, "%s; mount flags: %s", compiler, flags);
		else
			snprintf(out, len, "%s", compiler);
	}
	free(text);
	return err;
}

/* Environment variables through which the caller's nvcc would compile differently from the
 * mount's: such a call is nvcc's own. */
static const char *nvcc_environment(void)
{
	/* nvcc's own, the host preprocessor's, and those nvcc.profile reads */
	static const char *const vars[] = {
		"NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN", "CPATH", "C_INCLUDE_PATH",
		"CPLUS_INCLUDE_PATH", "INCLUDES", "SYSTEM_INCLUDES", "LIBRARIES", "CUDAFE_FLAGS",
		"PTXAS_FLAGS", "CICC_PATH", "NVVMIR_LIBRARY_DIR", NULL,
	};
	for (int i = 0; vars[i]; i++) {
		const char *v = getenv(vars[i]);
		if (v && *v)
			return vars[i];
	}
	return NULL;
}

/* Nonzero if an include directory of call lies on a kcachefs mount: fingerprinting it
 * would look up (and so compile) every cubin there. */
static int includes_on_a_mount(const struct kc_shim_call *call)
{
	for (size_t i = 0; i < call->flags.n; i++) {
		const char *a = call->flags.v[i];
		const char *dir = strncmp(a, "-I", 2) == 0 ? a + 2
				  : strncmp(a, "--include-path=", 15) == 0 ? a + 15 : NULL;
		char *root = dir ? kc_shim_find_mount(dir) : NULL;
		if (root) {
			free(root);
			return 1;
		}
	}
	return 0;
}

/* 1 if name in the entry holds exactly buf. */
static int holds(int entry_fd, const char *name, const char *buf, size_t len)
{
	char *have = NULL;
	size_t n = 0;
	int fd = openat(entry_fd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
	int same = fd >= 0 && kc_read_all(fd, len + 1, &have, &n) == 0 && n == len &&
		   memcmp(have, buf, len) == 0;
	if (fd >= 0)
		close(fd);
	free(have);
	return same;
}

/* 1 if the entry's staged recipe has key: another user's copy of the same bytes (its
 * include roots at other paths) is the same recipe, and its cubin is this call's. */
static int keyed(int entry_fd, const char *key, size_t max)
{
	char *src = NULL, *fl = NULL, have[KC_SHA256_HEXLEN + 1];
	size_t sl = 0, fll = 0;
	int same = 0, fd = openat(entry_fd, KC_SOURCE_NAME, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
	if (fd >= 0 && kc_read_all(fd, max, &src, &sl) == 0) {
		close(fd);
		fd = openat(entry_fd, KC_FLAGS_NAME, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
		same = fd >= 0 && kc_read_all(fd, max, &fl, &fll) == 0 &&
		       kc_key_compute(src, sl, fl, fll, have) == 0 && strcmp(have, key) == 0;
	}
	if (fd >= 0)
		close(fd);
	free(src);
	free(fl);
	return same;
}

/* Open (creating) KC_SHIM_DIR/name under root_fd, on the mount's own device dev.
 * KC_SHIM_DIR is created sticky and writable by everyone, like /tmp, so that every user of a
 * shared mount can add entries and no one can remove another's (an operator creates it as
 * root: mkdir -m 1777). Only a real directory owned by root or the caller is trusted, and
 * symbolic links are not followed: another user could point them at a filesystem of their
 * own. Returns an O_PATH fd, or -errno (ENOTDIR, ELOOP, EPERM for an untrusted directory). */
static int open_entry(int root_fd, dev_t dev, const char *name)
{
	struct stat st;
	int err = 0;

	if (mkdirat(root_fd, KC_SHIM_DIR, 01777) == 0)
		fchmodat(root_fd, KC_SHIM_DIR, 01777, 0); /* past the umask */
	else if (errno != EEXIST)
		return -errno;
	int dir_fd = openat(root_fd, KC_SHIM_DIR, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (dir_fd < 0)
		return -errno;
	if (fstat(dir_fd, &st) != 0 || st.st_dev != dev ||
	    (st.st_uid != 0 && st.st_uid != geteuid()))
		err = -EPERM;
	if (!err && mkdirat(dir_fd, name, 0755) != 0 && errno != EEXIST)
		err = -errno;
	int entry_fd = err ? -1
			   : openat(dir_fd, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (!err && entry_fd < 0)
		err = -errno;
	if (!err && (fstat(entry_fd, &st) != 0 || st.st_dev != dev))
		err = -EXDEV;
	close(dir_fd);
	if (err && entry_fd >= 0)
		close(entry_fd);
	return err ? err : entry_fd;
}

/* Nonzero if the source is alone in its directory: nothing there that an #include "..."
 * (however spelt: through a macro, a comment, a continued line) could find first, as nvcc
 * looks next to the source before the -I directories and the mount compiles elsewhere.
 * Compiler outputs (.cubin, .ptx, .fatbin, .o) and the shim's own temporaries do not count. */
static int source_alone(const char *input, const char *dir)
{
	const char *base = strrchr(input, '/');
	base = base ? base + 1 : input;
	DIR *d = opendir(dir);
	struct dirent *e;
	int alone = d != NULL;

	while (alone && (e = readdir(d))) {
		const char *n = e->d_name, *dot = strrchr(n, '.');
		if (strcmp(n, ".") == 0 || strcmp(n, "..") == 0 || strcmp(n, base) == 0 ||
		    strncmp(n, ".kcachefs-nvcc.", 15) == 0)
			continue;
		if (dot && (strcmp(dot, ".cubin") == 0 || strcmp(dot, ".ptx") == 0 ||
			    strcmp(dot, ".fatbin") == 0 || strcmp(dot, ".o") == 0))
			continue;
		alone = 0;
	}
	if (d)
		closedir(d);
	return alone;
}

/* The file digests of the caller's include trees remembered between calls (tree.h):
 * $KCACHEFS_NVCC_MEMO, else $XDG_CACHE_HOME (or ~/.cache)/kcachefs-nvcc/tree-memo; NULL
 * (no memo) when there is no home or out of memory. */
static struct kc_tree_memo *open_memo(void)
{
	char path[PATH_MAX];
	const char *env = getenv("KCACHEFS_NVCC_MEMO"), *xdg = getenv("XDG_CACHE_HOME");
	const char *home = getenv("HOME");
	int n;
	if (env && *env)
		n = snprintf(path, sizeof(path), "%s", env);
	else if (xdg && *xdg == '/')
		n = snprintf(path, sizeof(path), "%s/kcachefs-nvcc/tree-memo", xdg);
	else if (home && *home == '/')
		n = snprintf(path, sizeof(path), "%s/.cache/kcachefs-nvcc/tree-memo", home);
	else
		return NULL;
	return n < (int)sizeof(path) ? kc_tree_memo_load(path) : NULL;
}

/* Serve one compile call through the mount at root. Returns the exit status, or TO_NVCC
 * when the mount cannot serve it (a warning says why, except for calls that are simply not
 * the mount's: a missing source, an output that is not a plain file, local includes). */
static int serve(struct kc_shim_call *call, const char *root)
{
	char why[512], key[KC_SHA256_HEXLEN + 1], got[KC_SHA256_HEXLEN];
	char name[NAME_MAX + 1], compiler[KC_COMPILER_ID_MAX + 4200], dir[PATH_MAX];
	char *source = NULL, *flags = NULL, *cubin = NULL;
	size_t source_len = 0, flags_len = 0, cubin_len = 0;
	int err, status = TO_NVCC, entry_fd = -1, fd = -1, root_fd = -1;
	struct stat st, root_st;
	uid_t owner = 0;

	err = kc_shim_targets(call, why, sizeof(why));
	if (err == -ENOMEM)
		return fail("out of memory");
	if (err)
		return to_nvcc("%s", why);
	err = kc_shim_check(call, why, sizeof(why));
	if (err == -EPERM)
		return fail("%s", why);
	if (err)
		return to_nvcc("%s", why);
	if (lstat(call->output, &st) == 0 && (!S_ISREG(st.st_mode) || access(call->output, W_OK)))
		return TO_NVCC; /* a directory, a link, read-only...: what nvcc does is nvcc's */
	if (nvcc_environment() || includes_on_a_mount(call) || output_is_staged(call->output))
		return TO_NVCC;
	fd = open(call->input, O_RDONLY | O_CLOEXEC);
	if (fd < 0 || kc_read_all(fd, SHIM_MAX_SOURCE, &source, &source_len) != 0 || !source_len)
		goto out; /* nvcc reports a missing or unreadable source in its own words */
	close(fd);
	fd = -1;
	parent_dir(call->input, dir, sizeof(dir));
	if (!source_alone(call->input, dir) || kc_shim_local_includes(source, source_len, dir))
		goto out; /* includes next to the source: only a compile in place finds them */
	root_fd = open(root, O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (root_fd < 0 || fstat(root_fd, &root_st) != 0) {
		status = to_nvcc("cannot open the mount %s: %s", root, strerror(errno));
		goto out;
	}
	if ((err = mount_info(root_fd, &owner, compiler, sizeof(compiler))) != 0) {
		status = to_nvcc("cannot read the compiler of the mount %s: %s", root, strerror(-err));
		goto out;
	}
	struct kc_tree_memo *memo = open_memo();
	err = kc_shim_flags_file(call, compiler, root_st.st_dev, memo, &flags, &flags_len);
	if (!err)
		kc_tree_memo_save(memo); /* only an optimisation: a failure costs reading again */
	kc_tree_memo_free(memo);
	if (!err)
		err = kc_key_compute(source, source_len, flags, flags_len, key);
	if (err) {
		status = to_nvcc("cannot compute the key of %s: %s", call->input,
				 err == -E2BIG ? "an include directory holds too many files"
				 : err == -EXDEV ? "an include directory reaches into the mount"
						 : strerror(-err));
		goto out;
	}
	snprintf(name, sizeof(name), "%s%s", KC_SHIM_ENTRY_PREFIX, key);
	entry_fd = open_entry(root_fd, root_st.st_dev, name);
	if (entry_fd < 0) {
		status = to_nvcc("cannot use %s/%s/%s: %s", root, KC_SHIM_DIR, name,
				 entry_fd == -EPERM ? "the directory is not owned by root or you"
						    : strerror(-entry_fd));
		goto out;
	}
	/* Stage the recipe unless it is there already, or one with the same key (another user
	 * may own the entry, and name the same headers at another path). */
	err = 0;
	if ((!holds(entry_fd, KC_FLAGS_NAME, flags, flags_len) ||
	     !holds(entry_fd, KC_SOURCE_NAME, source, source_len)) &&
	    !keyed(entry_fd, key, source_len + flags_len + 65536)) {
		err = stage(entry_fd, KC_FLAGS_NAME, flags, flags_len);
		if (!err)
			err = stage(entry_fd, KC_SOURCE_NAME, source, source_len);
	}
	if (err) {
		status = to_nvcc("cannot stage into %s/%s/%s: %s", root, KC_SHIM_DIR, name,
				 err == -EEXIST ? "it holds another source, flags or cubin"
						: strerror(-err));
		goto out;
	}
	fd = openat(entry_fd, KC_CUBIN_NAME, O_RDONLY | O_CLOEXEC);
	if (fd < 0 && errno == EIO) {
		/* The mount's compile failed. nvcc runs it once more here: its errors and exit
		 * status are then exactly nvcc's, and a failure that came from the mount's side
		 * (a header only the caller sees, a timeout) does not stop the job. */
		if (!rejected(entry_fd))
			to_nvcc("the mount's compile of %s/%s/%s failed (see its kernel.log)", root,
				KC_SHIM_DIR, name);
		goto out;
	}
	if (fd < 0) {
		status = to_nvcc("%s/%s/%s/%s: %s", root, KC_SHIM_DIR, name, KC_CUBIN_NAME,
				 strerror(errno));
		goto out;
	}
	/* The cubin this descriptor reads must be the mount's compile of our own recipe: a file
	 * of the mount itself (its device), whose daemon names the recipe it came from. */
	if (fstat(fd, &st) != 0 || st.st_dev != root_st.st_dev ||
	    ioctl(fd, KC_IOC_GET_KEY, got) != 0 || memcmp(got, key, KC_SHA256_HEXLEN) != 0) {
		status = to_nvcc("the cubin of %s/%s/%s is not compiled from this source and flags",
				 root, KC_SHIM_DIR, name);
		goto out;
	}
	err = kc_read_all(fd, SIZE_MAX, &cubin, &cubin_len);
	if (!err)
		err = put_output(call->output, cubin, cubin_len);
	if (err) {
		status = fail("cannot write %s: %s", call->output, strerror(-err));
		goto out;
	}
	print_log(entry_fd, owner, call->input);
	status = 0;
out:
	if (root_fd >= 0)
		close(root_fd);
	if (fd >= 0)
		close(fd);
	if (entry_fd >= 0)
		close(entry_fd);
	free(source);
	free(flags);
	free(cubin);
	return status;
}

/* Nonzero if path is this very program. */
static int is_self(const char *path)
{
	struct stat a, b;
	return stat(path, &a) == 0 && stat("/proc/self/exe", &b) == 0 && a.st_dev == b.st_dev &&
	       a.st_ino == b.st_ino;
}

int main(int argc, char **argv)
{
	struct kc_shim_call call;
	char cwd[PATH_MAX];
	const char *env = getenv("KCACHEFS_NVCC");

	/* The real nvcc must not lead back here (a copy named nvcc on PATH, KCACHEFS_NVCC
	 * naming the shim): the shim marks the environment of what it runs. */
	if (getenv("KCACHEFS_NVCC_SHIM") || (env && *env && is_self(env)))
		return fail("the compiler it runs is kcachefs-nvcc again; set KCACHEFS_NVCC to "
			    "the real nvcc");
	real_nvcc = env && *env ? env : kc_nvcc_find("/proc/self/exe");
	setenv("KCACHEFS_NVCC_SHIM", "1", 1);
	if (!getcwd(cwd, sizeof(cwd)))
		return run_nvcc(argv); /* relative paths cannot be made absolute: nvcc's call */
	int r = kc_shim_parse(argc - 1, argv + 1, cwd, &call);
	if (r < 0)
		return fail("out of memory");
	if (r == 0)
		return run_nvcc(argv);

	char *root = NULL;
	const char *mount = getenv("KCACHEFS_MOUNT");
	if (mount && *mount) {
		char *want = realpath(mount, NULL);
		root = want ? kc_shim_find_mount(want) : NULL;
		if (!root || strcmp(root, want) != 0) {
			to_nvcc("KCACHEFS_MOUNT=%s is not the root of a kcachefs mount", mount);
			free(root);
			root = NULL;
		}
		free(want);
	} else {
		char dir[PATH_MAX];
		parent_dir(call.output, dir, sizeof(dir));
		root = kc_shim_find_mount(dir);
	}
	int status = root ? serve(&call, root) : TO_NVCC;
	free(root);
	kc_shim_call_free(&call);
	return status != TO_NVCC ? status : run_nvcc(argv);
}
