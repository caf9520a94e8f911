/* kcachefs-nvrtc.c - kcachefs-nvrtc: the NVRTC compile backend, run by the daemon exactly as it
 * runs nvcc (its own process, scratch directory, timeout and log), so that a compiler crash
 * or hang costs one compile and never the mount.
 *
 *   kcachefs-nvrtc SOURCE -cubin -o OUT [nvcc flags...]
 *   kcachefs-nvrtc --version   (its version; "libnvrtc PATH", the library it loaded;
 *                               "NVRTC X.Y" last)
 *   kcachefs-nvrtc --serve     (a warm worker: compiles requests on fd 0, nvrtc_wire.h)
 *
 * A warm worker (nvrtc_pool.h starts them) keeps one NVRTC in one process, so automatic
 * PCH (--pch, in <cwd>/pch) made by one compile serves the next compile of the same
 * headers: NVRTC's precompiled header is reusable only inside the process that made it.
 * NVRTC does not check a PCH against the headers it was made from, so the worker does: it
 * notes every file NVRTC opens for reading, and every path it tried that was not there
 * (open() and fopen() of this program interpose libc's for libnvrtc), each with its stat;
 * before it reads the next request it stats them again, and when one changed, appeared or
 * went away it executes itself afresh (same pid, same socket, the request still unread),
 * so that a compile never sees a PCH of other headers than a fresh process would read.
 *
 * The flags are nvcc's, as the mount's allow-list passed them; kc_flags_to_nvrtc
 * (flags.h) turns them into NVRTC options, dropping what only steers the host side. The
 * toolkit's headers (<CUDA>/include and its cccl/) are on the include path, as nvcc puts
 * them. Output and status are shaped like nvcc's: the compile log on stderr, the cubin
 * written to OUT, exit status 0; 1 when the source is rejected (the log names each
 * error); 2 for a usage error or a flag NVRTC cannot take; 3 when the cubin cannot be
 * written.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <sys/syscall.h>
#include <fcntl.h>
#include <link.h>
#include <nvrtc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "flags.h"
#include "io.h"
#include "kc_build.h"
#include "nvrtc_wire.h"

/* Where a worker's automatic PCH goes: a directory of its private scratch (its cwd). */
#define KC_SERVE_PCH_DIR "/proc/self/cwd/pch"

/* dl_iterate_phdr callback: the path of the libnvrtc this process loaded, into *arg. */
static int find_libnvrtc(struct dl_phdr_info *info, size_t size, void *arg)
{
	(void)size;
	const char *slash = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
	if (!slash || strncmp(slash + 1, "libnvrtc.so", 11) != 0)
		return 0;
	*(const char **)arg = info->dlpi_name;
	return 1;
}

/* The files NVRTC looked at while a worker compiled (recording): path, whether it was
 * there, and its stat then. An open-addressed table keyed by path. */
struct seen {
	char *path;
	int there;
	dev_t dev;
	ino_t ino;
	off_t size;
	struct timespec mtim, ctim;
};
static struct seen *seen;
static size_t seen_cap, seen_n;
static int recording;

static size_t path_hash(const char *p)
{
	size_t h = 1469598103934665603ull;
	for (; *p; p++)
		h = (h ^ (unsigned char)*p) * 1099511628211ull;
	return h;
}

/* Fill what of st a change shows into e (there: st is valid). */
static void seen_set(struct seen *e, int there, const struct stat *st)
{
	e->there = there;
	if (there) {
		e->dev = st->st_dev;
		e->ino = st->st_ino;
		e->size = st->st_size;
		e->mtim = st->st_mtim;
		e->ctim = st->st_ctim;
	}
}

/* Note that path was opened (fd >= 0, its stat taken from fd) or was not there. The first
 * look at a path is kept: a PCH made from it holds what was read then. */
static void note(const char *path, int fd, int err)
{
	struct stat st;
	if (fd < 0 && err != ENOENT && err != ENOTDIR)
		return;
	if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)))
		return;
	if (strncmp(path, KC_SERVE_PCH_DIR, strlen(KC_SERVE_PCH_DIR)) == 0)
		return;
	if (seen_n * 2 >= seen_cap) {
		size_t cap = seen_cap ? seen_cap * 2 : 4096;
		struct seen *grown = calloc(cap, sizeof(*grown));
		if (!grown)
			return;
		for (size_t i = 0; i < seen_cap; i++) {
			if (!seen[i].path)
				continue;
			size_t j = path_hash(seen[i].path) & (cap - 1);
			while (grown[j].path)
				j = (j + 1) & (cap - 1);
			grown[j] = seen[i];
		}
		free(seen);
		seen = grown;
		seen_cap = cap;
	}
	size_t j = path_hash(path) & (seen_cap - 1);
	for (; seen[j].path; j = (j + 1) & (seen_cap - 1))
		if (strcmp(seen[j].path, path) == 0)
			return;
	if (!(seen[j].path = strdup(path)))
		return;
	seen_set(&seen[j], fd >= 0, &st);
	seen_n++;
}

/* libnvrtc's open() and fopen() (and the 64-bit names) come here: the real call, and a note
 * of a read while recording. */
static int opened(const char *path, int flags, mode_t mode)
{
	int fd = (int)syscall(SYS_openat, AT_FDCWD, path, flags, mode);
	int err = errno;
	if (recording && (flags & O_ACCMODE) == O_RDONLY && !(flags & O_CREAT))
		note(path, fd, err);
	errno = err;
	return fd;
}

/* By their symbol names: with _FILE_OFFSET_BITS=64 the headers would rename open to open64. */
int kc_open(const char *path, int flags, ...) __asm__("open");
int kc_open64(const char *path, int flags, ...) __asm__("open64");
FILE *kc_fopen(const char *path, const char *how) __asm__("fopen");
FILE *kc_fopen64(const char *path, const char *how) __asm__("fopen64");

/* open's mode argument: there only with O_CREAT or O_TMPFILE. */
#define OPEN_MODE(flags, mode)                                   \
	do {                                                     \
		if ((flags) & (O_CREAT | O_TMPFILE)) {           \
			va_list ap;                              \
			va_start(ap, flags);                     \
			(mode) = (mode_t)va_arg(ap, int);        \
			va_end(ap);                              \
		}                                                \
	} while (0)

int kc_open(const char *path, int flags, ...)
{
	mode_t mode = 0;
	OPEN_MODE(flags, mode);
	return opened(path, flags, mode);
}

int kc_open64(const char *path, int flags, ...)
{
	mode_t mode = 0;
	OPEN_MODE(flags, mode);
	return opened(path, flags, mode);
}

static FILE *fopened(const char *name, const char *path, const char *how)
{
	FILE *(*real)(const char *, const char *) =
		(FILE * (*)(const char *, const char *)) dlsym(RTLD_NEXT, name);
	FILE *f = real ? real(path, how) : NULL;
	int err = real ? errno : ENOSYS;
	if (recording && how[0] == 'r' && !strchr(how, '+'))
		note(path, f ? fileno(f) : -1, err);
	errno = err;
	return f;
}

FILE *kc_fopen(const char *path, const char *how)
{
	return fopened("fopen", path, how);
}

FILE *kc_fopen64(const char *path, const char *how)
{
	return fopened("fopen64", path, how);
}

/* The first path noted that is not as it was (changed, appeared, went away), or NULL. */
static const char *changed_header(void)
{
	for (size_t i = 0; i < seen_cap; i++) {
		struct stat st;
		struct seen *e = &seen[i], now;
		if (!e->path)
			continue;
		int there = stat(e->path, &st) == 0 && S_ISREG(st.st_mode);
		memset(&now, 0, sizeof(now));
		seen_set(&now, there, &st);
		if (there != e->there ||
		    (there && (now.dev != e->dev || now.ino != e->ino || now.size != e->size ||
			       now.mtim.tv_sec != e->mtim.tv_sec ||
			       now.mtim.tv_nsec != e->mtim.tv_nsec ||
			       now.ctim.tv_sec != e->ctim.tv_sec ||
			       now.ctim.tv_nsec != e->ctim.tv_nsec)))
			return e->path;
	}
	return NULL;
}

/* What one compile gave: status as the exit status (0, 1 rejected, 2 other), the log
 * (NVRTC's, then a line of ours when it failed) and the cubin, both malloc'd. */
struct result {
	int status;
	char *log;
	size_t log_len;
	char *cubin;
	size_t cubin_len;
};

/* Append a line to r's log. */
static void say(struct result *r, const char *fmt, const char *arg)
{
	char line[600];
	int n = snprintf(line, sizeof(line), fmt, arg);
	if (n < 0)
		return;
	n = n >= (int)sizeof(line) ? (int)sizeof(line) - 1 : n;
	char *grown = realloc(r->log, r->log_len + (size_t)n + 1);
	if (!grown)
		return;
	memcpy(grown + r->log_len, line, (size_t)n + 1);
	r->log = grown;
	r->log_len += (size_t)n;
}

/* Compile source (len bytes) with the nvcc flags given, plus extra (NULL-terminated NVRTC
 * options of our own, or NULL), into r. */
static void compile(const char *source, size_t len, const struct kc_argv *given,
		    const char *const *extra, struct result *r)
{
	struct kc_argv opts = {0};
	char why[512], inc[4200];
	nvrtcProgram prog = NULL;

	memset(r, 0, sizeof(*r));
	r->status = 2;
	if (kc_flags_to_nvrtc(given, &opts, why, sizeof(why)) != 0) {
		say(r, "kcachefs-nvrtc: error: %s\n", why);
		goto out;
	}
	const char *home = getenv("CUDA_HOME");
	if (!home || !*home)
		home = KC_CUDA_HOME;
	snprintf(inc, sizeof(inc), "--include-path=%s/include", home);
	kc_argv_push(&opts, inc);
	snprintf(inc, sizeof(inc), "--include-path=%s/include/cccl", home);
	kc_argv_push(&opts, inc);
	for (size_t i = 0; extra && extra[i]; i++)
		kc_argv_push(&opts, extra[i]);
	if (memchr(source, '\0', len)) { /* NVRTC takes a C string: it would stop there */
		say(r, "kcachefs-nvrtc: error: the source holds a NUL byte%s\n", "");
		goto out;
	}
	nvrtcResult rc = nvrtcCreateProgram(&prog, source, "kernel.cu", 0, NULL, NULL);
	if (rc != NVRTC_SUCCESS) {
		say(r, "kcachefs-nvrtc: error: %s\n", nvrtcGetErrorString(rc));
		prog = NULL;
		goto out;
	}
	recording = extra != NULL; /* a worker's: its PCH may hold what is read now */
	rc = nvrtcCompileProgram(prog, (int)opts.n, (const char *const *)opts.v);
	recording = 0;
	size_t log_len = 0;
	if (nvrtcGetProgramLogSize(prog, &log_len) == NVRTC_SUCCESS && log_len > 1) {
		char *log = malloc(log_len);
		if (log && nvrtcGetProgramLog(prog, log) == NVRTC_SUCCESS) {
			r->log = log;
			r->log_len = strlen(log);
		} else {
			free(log);
		}
	}
	if (rc != NVRTC_SUCCESS) {
		say(r, "kcachefs-nvrtc: error: %s\n", nvrtcGetErrorString(rc));
		r->status = rc == NVRTC_ERROR_COMPILATION ? 1 : 2;
		goto out;
	}
	if (nvrtcGetCUBINSize(prog, &r->cubin_len) != NVRTC_SUCCESS || r->cubin_len == 0 ||
	    !(r->cubin = malloc(r->cubin_len)) || nvrtcGetCUBIN(prog, r->cubin) != NVRTC_SUCCESS) {
		free(r->cubin);
		r->cubin = NULL;
		r->cubin_len = 0;
		say(r, "kcachefs-nvrtc: error: no cubin (is the architecture a real sm_XY, not "
		    "compute_XY?)%s\n", "");
		goto out;
	}
	r->status = 0;
out:
	if (prog)
		nvrtcDestroyProgram(&prog);
	kc_argv_free(&opts);
}

/* Read exactly len bytes of fd into buf. Returns 0, 1 at EOF before the first byte, or -1
 * (an error, or EOF inside the frame). */
static int read_exact(int fd, void *buf, size_t len)
{
	char *p = buf;
	size_t got = 0;
	while (got < len) {
		ssize_t n = read(fd, p + got, len - got);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return n == 0 && got == 0 ? 1 : -1;
		got += (size_t)n;
	}
	return 0;
}

/* Remove the files of the PCH directory: a PCH another process made is of no use here
 * (NVRTC warns that its heap address does not match) and only takes space. */
static void clear_pch_dir(void)
{
	DIR *d = opendir(KC_SERVE_PCH_DIR);
	struct dirent *de;
	while (d && (de = readdir(d)) != NULL)
		if (de->d_name[0] != '.')
			unlinkat(dirfd(d), de->d_name, 0);
	if (d)
		closedir(d);
}

/* --serve: answer requests (nvrtc_wire.h) on fd 0 till EOF, keeping this process's NVRTC,
 * and with it the precompiled headers of automatic PCH, from one request to the next. */
static int serve(void)
{
	static const char *const pch[] = {"--pch", "--pch-dir=" KC_SERVE_PCH_DIR, NULL};
	unsigned long long served = 0;
	if (mkdir(KC_SERVE_PCH_DIR, 0700) != 0)
		clear_pch_dir(); /* there: left by the process this one replaced */
	for (;;) {
		struct kc_nvrtc_req req;
		struct pollfd p = {.fd = 0, .events = POLLIN};
		while (poll(&p, 1, -1) < 0 && errno == EINTR)
			;
		const char *why = changed_header();
		if (why) { /* the request stays unread in the socket for the fresh process */
			static char *const again[] = {"kcachefs-nvrtc", "--serve", NULL};
			fprintf(stderr, "kcachefs-nvrtc --serve: %s changed since it was read: "
				"starting afresh, without the precompiled headers\n", why);
			fflush(stderr);
			execv("/proc/self/exe", again);
			fprintf(stderr, "kcachefs-nvrtc --serve: cannot start afresh: %s\n",
				strerror(errno));
			return 2;
		}
		int e = read_exact(0, &req, sizeof(req));
		if (e == 1)
			return 0;
		if (e != 0 || req.magic != KC_NVRTC_REQ_MAGIC ||
		    req.source_len > KC_NVRTC_MAX_SOURCE || req.args_len > KC_NVRTC_MAX_ARGS ||
		    req.nargs > req.args_len) {
			fprintf(stderr, "kcachefs-nvrtc --serve: a request it cannot read\n");
			return 2;
		}
		char *args = malloc(req.args_len + 1), *source = malloc(req.source_len + 1);
		if (!args || !source || read_exact(0, args, req.args_len) != 0 ||
		    read_exact(0, source, req.source_len) != 0) {
			fprintf(stderr, "kcachefs-nvrtc --serve: a request cut short\n");
			return 2;
		}
		args[req.args_len] = '\0';
		source[req.source_len] = '\0';
		struct kc_argv given = {0};
		size_t off = 0;
		for (uint32_t i = 0; i < req.nargs && off < req.args_len; i++) {
			if (kc_argv_push(&given, args + off))
				return 2;
			off += strlen(args + off) + 1;
		}
		struct result r;
		compile(source, req.source_len, &given, pch, &r);
		struct rusage ru;
		getrusage(RUSAGE_SELF, &ru);
		struct kc_nvrtc_rep rep = {
			.magic = KC_NVRTC_REP_MAGIC, .status = r.status, .log_len = r.log_len,
			.cubin_len = r.cubin_len, .served = ++served,
			.cpu_usec = (uint64_t)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000u +
				    (uint64_t)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec),
		};
		if (kc_write_all(0, &rep, sizeof(rep)) != 0 ||
		    (r.log_len && kc_write_all(0, r.log, r.log_len) != 0) ||
		    (r.cubin_len && kc_write_all(0, r.cubin, r.cubin_len) != 0))
			return 3;
		free(r.log);
		free(r.cubin);
		free(args);
		free(source);
		kc_argv_free(&given);
	}
}

int main(int argc, char **argv)
{
	int major = 0, minor = 0;
	nvrtcVersion(&major, &minor);
	if (argc == 2 && strcmp(argv[1], "--version") == 0) {
		/* The library's line lets the daemon digest the very file (identity.h). */
		const char *lib = NULL;
		dl_iterate_phdr(find_libnvrtc, &lib);
		printf("kcachefs-nvrtc %s (CUDA %s)\n", KC_VERSION, KC_CUDA_VERSION);
		if (lib)
			printf("libnvrtc %s\n", lib);
		printf("NVRTC %d.%d\n", major, minor);
		return 0;
	}
	if (argc == 2 && strcmp(argv[1], "--serve") == 0)
		return serve();
	if (argc < 5 || strcmp(argv[2], "-cubin") != 0 || strcmp(argv[3], "-o") != 0) {
		fprintf(stderr, "usage: %s SOURCE -cubin -o OUT [nvcc flags...] | --serve | "
			"--version\n", argv[0]);
		return 2;
	}
	const char *src_path = argv[1], *out_path = argv[4];
	struct kc_argv given = {0};
	size_t len = 0;

	for (int i = 5; i < argc; i++)
		if (kc_argv_push(&given, argv[i]))
			return 2;
	char *source = NULL;
	int in = open(src_path, O_RDONLY | O_CLOEXEC);
	int rerr = in < 0 ? -errno : kc_read_all(in, SIZE_MAX, &source, &len);
	if (in >= 0)
		close(in);
	if (rerr) {
		fprintf(stderr, "kcachefs-nvrtc: error: cannot read %s: %s\n", src_path,
			strerror(-rerr));
		return 2;
	}
	struct result r;
	compile(source, len, &given, NULL, &r);
	if (r.log_len)
		fwrite(r.log, 1, r.log_len, stderr);
	if (r.status != 0)
		return r.status;
	int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	int err = fd < 0 ? -errno : kc_write_all(fd, r.cubin, r.cubin_len);
	if (fd >= 0 && close(fd) != 0 && !err)
		err = -errno;
	if (err) {
		fprintf(stderr, "kcachefs-nvrtc: cannot write %s: %s\n", out_path, strerror(-err));
		return 3;
	}
	free(r.cubin);
	free(r.log);
	free(source);
	kc_argv_free(&given);
	return 0;
}
