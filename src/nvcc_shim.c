/* nvcc_shim.c - kcachefs-nvcc: an nvcc that compiles each kernel once per node.
 *
 * Point a JIT client's compiler at it (DG_JIT_NVCC_COMPILER=kcachefs-nvcc). A call
 * "X.cu -cubin -o OUT <flags>" whose OUT lies on a kcachefs mount (or with KCACHEFS_MOUNT
 * set) is served by the mount: the source and flags are staged into
 * <mount>/kcachefs-nvcc/kernel.<stem>.<key> (key: src/key.h over the staged bytes, whose
 * kernel.flags names the compiler version and fingerprints the include trees), the entry's
 * kernel.cubin is opened (the mount compiles it once; concurrent shims wait on the same
 * compile), and its bytes are put at OUT atomically, with the compiler's log on stderr and
 * the compile's exit status. Every other call, and every call whose OUT is not on a
 * kcachefs mount, is handed to the real nvcc (src/nvcc.h finds it as the daemon does, or
 * KCACHEFS_NVCC names it) with the same arguments.
 *
 * Exit status: the compiler's (0 on success), 1 for errors of the shim itself, each with a
 * line "kcachefs-nvcc: ..." on stderr.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io.h"
#include "key.h"
#include "name.h"
#include "nvcc.h"
#include "shim.h"

#define SHIM_MAX_SOURCE (256u << 20) /* bytes of source the shim reads; the mount caps lower */

static const char *real_nvcc;

static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fputs("kcachefs-nvcc: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
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

/* Read a whole file (at most max bytes). Returns 0 or -errno (-EFBIG above max). */
static int read_all(int fd, size_t max, char **out, size_t *len)
{
	size_t cap = 1 << 16, used = 0;
	char *buf = malloc(cap);

	if (!buf)
		return -ENOMEM;
	for (;;) {
		if (used == cap) {
			if (cap >= max) {
				free(buf);
				return -EFBIG;
			}
			char *b = realloc(buf, cap * 2);
			if (!b) {
				free(buf);
				return -ENOMEM;
			}
			buf = b;
			cap *= 2;
		}
		ssize_t n = read(fd, buf + used, cap - used);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			int err = -errno;
			free(buf);
			return err;
		}
		if (n == 0)
			break;
		used += (size_t)n;
	}
	*out = buf;
	*len = used;
	return 0;
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

	if (snprintf(tmp, sizeof(tmp), "%.*s.%s.kcachefs-nvcc.%d", dirlen, path,
		     slash ? slash + 1 : path, (int)getpid()) >= (int)sizeof(tmp))
		return -ENAMETOOLONG;
	int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
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

/* Print kernel.log as nvcc would print the compiler's output. Its first line is the
 * mount's summary ("kcachefs: compile ...: rejected (compiler exited with status 2) in ...", see cache.c); it is printed
 * too when the compile failed for another cause than the compiler's verdict (killed, timed
 * out, refused flags), which the compiler's own output would not explain. Returns the exit
 * status the summary names, 1 when it names none. */
static int print_log(int entry_fd, const char *input)
{
	int fd = openat(entry_fd, KC_LOG_NAME, O_RDONLY | O_CLOEXEC);
	char *log = NULL;
	size_t len = 0;
	int status = 1;

	if (fd < 0 || read_all(fd, 16u << 20, &log, &len) != 0) {
		if (fd >= 0)
			close(fd);
		return status;
	}
	close(fd);
	char *nl = memchr(log, '\n', len);
	size_t head = nl ? (size_t)(nl - log + 1) : len;
	char *mark = memmem(log, head, "exited with status ", 19);
	if (mark)
		status = atoi(mark + 19);
	if (status <= 0 || status > 255)
		status = 1;
	if (!memmem(log, head, ": published (", 13) && !memmem(log, head, ": rejected (", 12))
		fwrite(log, 1, head, stderr);
	size_t body_len = 0;
	char *body = kc_shim_log_rewrite(log + head, len - head, input, &body_len);
	if (body)
		fwrite(body, 1, body_len, stderr);
	else
		fwrite(log + head, 1, len - head, stderr);
	free(body);
	free(log);
	return status;
}

/* Serve one compile call through the mount at root. Returns the exit status, or -1 when
 * the entry holds other bytes than ours (the caller then runs nvcc itself). */
static int serve(const struct kc_shim_call *call, const char *root)
{
	char why[512], key[KC_SHA256_HEXLEN + 1], name[NAME_MAX + 1], compiler[200];
	char *source = NULL, *flags = NULL;
	size_t source_len = 0, flags_len = 0;
	int err, status = 1, entry_fd = -1;

	if (kc_shim_check(call, why, sizeof(why)))
		return fail("%s", why);
	int fd = open(call->input, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return fail("%s: %s", call->input, strerror(errno));
	err = read_all(fd, SHIM_MAX_SOURCE, &source, &source_len);
	close(fd);
	if (err)
		return fail("%s: %s", call->input, strerror(-err));
	if (!real_nvcc || kc_nvcc_version(real_nvcc, compiler, sizeof(compiler)) != 0)
		snprintf(compiler, sizeof(compiler), "unavailable");
	err = kc_shim_flags_file(call, compiler, &flags, &flags_len);
	if (!err)
		err = kc_key_compute(source, source_len, flags, flags_len, key);
	if (err) {
		fail("cannot compute the key of %s: %s", call->input, strerror(-err));
		goto out;
	}
	kc_shim_entry_name(call->input, key, name, sizeof(name));

	int root_fd = open(root, O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (root_fd < 0) {
		fail("%s: %s", root, strerror(errno));
		goto out;
	}
	if (mkdirat(root_fd, KC_SHIM_DIR, 0755) != 0 && errno != EEXIST)
		err = -errno;
	int dir_fd = err ? -1 : openat(root_fd, KC_SHIM_DIR, O_PATH | O_DIRECTORY | O_CLOEXEC);
	close(root_fd);
	if (dir_fd >= 0 && mkdirat(dir_fd, name, 0755) != 0 && errno != EEXIST)
		err = -errno;
	if (dir_fd >= 0 && !err)
		entry_fd = openat(dir_fd, name, O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (dir_fd < 0 || entry_fd < 0) {
		fail("cannot create %s/%s/%s: %s", root, KC_SHIM_DIR, name,
		     strerror(err ? -err : errno));
		if (dir_fd >= 0)
			close(dir_fd);
		goto out;
	}
	close(dir_fd);
	err = stage(entry_fd, KC_FLAGS_NAME, flags, flags_len);
	if (!err)
		err = stage(entry_fd, KC_SOURCE_NAME, source, source_len);
	if (err == -EEXIST) {
		fail("%s/%s/%s holds another source or flags than its key names; "
		     "compiling with %s instead", root, KC_SHIM_DIR, name,
		     real_nvcc ? real_nvcc : "nvcc");
		status = -1;
		goto out;
	}
	if (err) {
		fail("cannot stage %s into %s/%s/%s: %s", call->input, root, KC_SHIM_DIR, name,
		     strerror(-err));
		goto out;
	}

	char *cubin = NULL;
	size_t cubin_len = 0;
	fd = openat(entry_fd, KC_CUBIN_NAME, O_RDONLY | O_CLOEXEC);
	if (fd < 0 && errno == EIO) {
		status = print_log(entry_fd, call->input);
		goto out;
	}
	if (fd < 0) {
		fail("%s/%s/%s/%s: %s", root, KC_SHIM_DIR, name, KC_CUBIN_NAME, strerror(errno));
		goto out;
	}
	err = read_all(fd, SIZE_MAX, &cubin, &cubin_len);
	close(fd);
	if (!err)
		err = put_output(call->output, cubin, cubin_len);
	free(cubin);
	if (err) {
		fail("cannot write %s: %s", call->output, strerror(-err));
		goto out;
	}
	print_log(entry_fd, call->input);
	status = 0;
out:
	if (entry_fd >= 0)
		close(entry_fd);
	free(source);
	free(flags);
	return status;
}

int main(int argc, char **argv)
{
	struct kc_shim_call call;
	char cwd[PATH_MAX];
	const char *env = getenv("KCACHEFS_NVCC");

	real_nvcc = env && *env ? env : kc_nvcc_find("/proc/self/exe");
	if (!getcwd(cwd, sizeof(cwd)))
		return fail("cannot read the working directory: %s", strerror(errno));
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
		int ok = root && strcmp(root, want) == 0;
		free(want);
		if (!ok) {
			free(root);
			kc_shim_call_free(&call);
			return fail("KCACHEFS_MOUNT=%s is not the root of a kcachefs mount", mount);
		}
	} else {
		char dir[PATH_MAX];
		parent_dir(call.output, dir, sizeof(dir));
		root = kc_shim_find_mount(dir);
	}
	int status = root ? serve(&call, root) : -1;
	free(root);
	kc_shim_call_free(&call);
	return status >= 0 ? status : run_nvcc(argv);
}
