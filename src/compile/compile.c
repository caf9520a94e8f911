/* compile.c - see compile.h */
#define _GNU_SOURCE
#include "compile.h"

#include <elf.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/pidfd.h>
#include <sys/stat.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "io.h"
#include "log.h"
#include "nvrtc_wire.h"
#include "sandbox.h"
#include "util.h"

#define LOG_MAX (1u << 20)
#define LOG_TAIL (64u << 10) /* of a cut output, the end kept */
#ifndef EM_CUDA
#define EM_CUDA 190
#endif

/* Running compilers by slot: a slot is reserved (-1) before the spawn, holds the pid while
 * it runs, and gives a sandboxed compile its uid (first_uid + slot), so that no two
 * running compiles share one. */
static pthread_mutex_t running_lock = PTHREAD_MUTEX_INITIALIZER;
static pid_t running_here[KC_COMPILE_SLOTS];
static pid_t *running = running_here; /* memory shared with the watcher once it runs */
static int shutting_down;
/* A stop that lets the cluster's shares finish (kc_compile_stop_demand): every compile but
 * a dependency pass is killed and refused. deps_slot[i]: slot i runs a dependency pass. */
static int demand_stopped;
static char deps_slot[KC_COMPILE_SLOTS];

/* Whether the compile in slot must end now (running_lock held). */
static int slot_stopped(int slot)
{
	return shutting_down || (demand_stopped && !deps_slot[slot]);
}

/* What a watcher is started with (kc_compile_watch), to start another like it. */
static uid_t watch_first;
static int watch_lock_fd = -1;

static int start_watcher(int *watcher_fd)
{
	return kc_sandbox_watch(watch_first, KC_COMPILE_SLOTS, running, KC_COMPILE_SLOTS,
				watch_lock_fd, watcher_fd);
}

/* Waits for the watcher (arg: its pidfd) to be gone while the daemon lives: one killed
 * (by hand, the OOM killer) is replaced at once, so that a daemon that dies later still
 * takes its compiles with it. The watcher of a daemon's clean exit goes after it. */
static void *rewatch_main(void *arg)
{
	int fd = (int)(intptr_t)arg;
	for (;;) {
		struct pollfd p = {.fd = fd, .events = POLLIN};
		if (poll(&p, 1, -1) <= 0) {
			if (errno == EINTR)
				continue;
			break;
		}
		close(fd);
		int err = start_watcher(&fd);
		kc_log(err || fd < 0 ? KC_LOG_WARN : KC_LOG_INFO,
		       "the watcher of the compiles is gone; %s", err || fd < 0 ?
		       "no other could be started: a compile outlives a daemon that dies, until "
		       "the next start" : "another one watches now");
		if (err || fd < 0)
			return NULL;
	}
	close(fd);
	return NULL;
}

int kc_compile_watch(unsigned first_uid, int lock_fd)
{
	pid_t *shared = mmap(NULL, sizeof(running_here), PROT_READ | PROT_WRITE,
			     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (shared == MAP_FAILED)
		return -errno;
	pthread_mutex_lock(&running_lock);
	memcpy(shared, running, sizeof(running_here));
	running = shared;
	pthread_mutex_unlock(&running_lock);
	watch_first = first_uid ? (uid_t)first_uid : KC_SANDBOX_AS_DAEMON;
	watch_lock_fd = lock_fd;
	int fd = -1, err = start_watcher(&fd);
	pthread_t th;
	pthread_attr_t attr;
	if (err || fd < 0)
		return err;
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	if (pthread_create(&th, &attr, rewatch_main, (void *)(intptr_t)fd) != 0)
		close(fd); /* this watcher still watches; a killed one is not replaced */
	pthread_attr_destroy(&attr);
	return 0;
}

static int reserve_slot(int deps_only)
{
	pthread_mutex_lock(&running_lock);
	int slot = -1;
	int refused = shutting_down || (demand_stopped && !deps_only);
	for (int i = 0; !refused && i < (int)KC_COMPILE_SLOTS; i++) {
		if (running[i] == 0) {
			running[i] = -1;
			deps_slot[i] = (char)deps_only;
			slot = i;
			break;
		}
	}
	pthread_mutex_unlock(&running_lock);
	return slot;
}

/* The compiler of a slot (arg: &running[slot]) exists from here on: a stop kills it, also
 * before its exec. If the daemon began stopping since the reservation, it is killed now. */
static void track_started(pid_t pid, void *arg)
{
	pthread_mutex_lock(&running_lock);
	*(pid_t *)arg = pid;
	if (slot_stopped((int)((pid_t *)arg - running))) {
		/* the group, once the child made it; the child before that */
		kill(-pid, SIGKILL);
		kill(pid, SIGKILL);
	}
	pthread_mutex_unlock(&running_lock);
}

int kc_compile_owns(pid_t tid)
{
	char path[64], line[512];
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)tid);
	FILE *f = fopen(path, "re");
	char *paren = f && fgets(line, sizeof(line), f) ? strrchr(line, ')') : NULL;
	int pgrp = 0, owns = 0;
	if (f)
		fclose(f);
	/* after the name: " S ppid pgrp ..." */
	if (!paren || sscanf(paren + 1, " %*c %*d %d", &pgrp) != 1 || pgrp <= 0)
		return 0;
	pthread_mutex_lock(&running_lock);
	for (unsigned i = 0; i < KC_COMPILE_SLOTS && !owns; i++)
		owns = running[i] == pgrp;
	pthread_mutex_unlock(&running_lock);
	return owns;
}

static void release_slot(int slot)
{
	pthread_mutex_lock(&running_lock);
	running[slot] = 0;
	pthread_mutex_unlock(&running_lock);
}

/* Set how far the stop goes (running_lock not held) and kill what it ends. */
static void stop_compiles(int all)
{
	pthread_mutex_lock(&running_lock);
	if (all)
		shutting_down = 1;
	else
		demand_stopped = 1;
	for (int i = 0; i < (int)KC_COMPILE_SLOTS; i++)
		if (running[i] > 0 && slot_stopped(i)) {
			kill(-running[i], SIGKILL);
			kill(running[i], SIGKILL);
		}
	pthread_mutex_unlock(&running_lock);
}

void kc_compile_stop_demand(void)
{
	stop_compiles(0);
}

void kc_compile_shutdown(void)
{
	stop_compiles(1);
}

/* Read the compiler's output from fd (the daemon's own descriptor of it: a compiler that
 * owns its scratch directory could replace the name). */
static void read_log(int fd, struct kc_compile_outcome *out)
{
	struct stat st;
	char note[128];
	out->log = malloc(LOG_MAX + sizeof(note));
	if (out->log && fstat(fd, &st) == 0) {
		int cut = (size_t)st.st_size > LOG_MAX;
		/* Cut in the middle: the head, and the last LOG_TAIL bytes, where compilers put
		 * their summary (the errors after pages of warnings that echo a source line). */
		size_t head = cut ? LOG_MAX - LOG_TAIL : LOG_MAX;
		ssize_t n = pread(fd, out->log, head, 0);
		out->log_len = n > 0 ? (size_t)n : 0;
		if (cut) {
			char *nl = memrchr(out->log, '\n', out->log_len);
			out->log_len = nl ? (size_t)(nl - out->log + 1) : out->log_len;
			char *tail = malloc(LOG_TAIL);
			ssize_t t = tail ? pread(fd, tail, LOG_TAIL, st.st_size - LOG_TAIL) : -1;
			char *start = t > 0 ? memchr(tail, '\n', (size_t)t) : NULL;
			size_t tl = start ? (size_t)(tail + t - start - 1) : 0;
			int m = snprintf(note, sizeof(note),
					 "[kcachefs: %lld bytes of the compiler's output left out here]\n",
					 (long long)st.st_size - (long long)(out->log_len + tl));
			memcpy(out->log + out->log_len, note, (size_t)m);
			out->log_len += (size_t)m;
			if (tl) {
				memcpy(out->log + out->log_len, start + 1, tl);
				out->log_len += tl;
			}
			free(tail);
		}
		out->log[out->log_len] = '\0';
	}
}

/* The compiler saw its scratch directory as KC_COMPILE_CWD: say where it is. */
static void log_with_scratch(struct kc_compile_outcome *out, const char *scratch)
{
	static const char cwd[] = KC_COMPILE_CWD;
	char *buf = NULL;
	size_t used = 0, pos = 0;
	if (!out->log || !memmem(out->log, out->log_len, cwd, sizeof(cwd) - 1))
		return;
	FILE *f = open_memstream(&buf, &used);
	if (!f)
		return;
	for (const char *m; (m = memmem(out->log + pos, out->log_len - pos, cwd, sizeof(cwd) - 1));) {
		fwrite(out->log + pos, 1, (size_t)(m - out->log) - pos, f);
		fputs(scratch, f);
		pos = (size_t)(m - out->log) + sizeof(cwd) - 1;
	}
	fwrite(out->log + pos, 1, out->log_len - pos, f);
	if (fclose(f) != 0) {
		free(buf);
		return;
	}
	free(out->log);
	out->log = buf;
	out->log_len = used;
}

/* The checks of a cubin's ELF header eh (whatever of it was read: have bytes) against the
 * file's size. */
static int elf_check(const Elf64_Ehdr *eh, size_t have, unsigned long long size, char *why,
		     size_t whylen)
{
	if (size == 0) {
		snprintf(why, whylen, "cubin is empty");
		return -EINVAL;
	}
	if (have < sizeof(*eh) || memcmp(eh->e_ident, ELFMAG, SELFMAG) != 0 ||
	    eh->e_ident[EI_CLASS] != ELFCLASS64) {
		snprintf(why, whylen, "cubin is not a 64-bit ELF file (%llu bytes)", size);
		return -EINVAL;
	}
	if (eh->e_machine != EM_CUDA) {
		snprintf(why, whylen, "ELF machine is %u, not EM_CUDA", eh->e_machine);
		return -EINVAL;
	}
	unsigned long long sh_end = eh->e_shoff + (unsigned long long)eh->e_shnum * eh->e_shentsize;
	unsigned long long ph_end = eh->e_phoff + (unsigned long long)eh->e_phnum * eh->e_phentsize;
	if (sh_end > size || ph_end > size || sh_end < eh->e_shoff || ph_end < eh->e_phoff) {
		snprintf(why, whylen, "cubin is truncated (%llu bytes, headers need %llu)", size,
			 sh_end > ph_end ? sh_end : ph_end);
		return -EINVAL;
	}
	return 0;
}

int kc_cubin_check(int fd, char *why, size_t whylen)
{
	Elf64_Ehdr eh;
	struct stat st;

	if (fstat(fd, &st) != 0) {
		snprintf(why, whylen, "cannot stat cubin: %s", strerror(errno));
		return -EINVAL;
	}
	ssize_t n = st.st_size ? pread(fd, &eh, sizeof(eh), 0) : 0;
	return elf_check(&eh, n > 0 ? (size_t)n : 0, (unsigned long long)st.st_size, why, whylen);
}

int kc_cubin_check_buf(const void *data, size_t len, char *why, size_t whylen)
{
	Elf64_Ehdr eh;
	size_t have = len < sizeof(eh) ? len : sizeof(eh);
	memset(&eh, 0, sizeof(eh));
	if (have)
		memcpy(&eh, data, have);
	return elf_check(&eh, have, len, why, whylen);
}

static int low_on_space(const char *dir)
{
	struct statvfs sv;
	if (statvfs(dir, &sv) != 0)
		return 0;
	return (unsigned long long)sv.f_bavail * sv.f_frsize < (8ull << 20) ||
	       (sv.f_files > 0 && sv.f_favail < 16);
}

/* Resource limits of a compiler and its tools (they inherit them): address space half of
 * the node's memory (at least 4 GiB), so that one source (#include "/dev/zero") cannot push
 * the node's GPU jobs into the OOM killer; files it writes at most 4 GiB; CPU time the
 * timeout plus a minute per process (the wall-clock timeout kills the group anyway; this
 * stops a tool that outlives it; a warm NVRTC worker, which serves many compiles, gets
 * KC_NVRTC_WORKER_CPU instead of the minute); KC_COMPILE_NOFILE open files; no core dumps. */
static void compiler_limits(struct kc_spawn *sp, unsigned timeout_s, unsigned extra_cpu_s)
{
	long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
	rlim_t half = pages > 0 && page > 0 ? (rlim_t)pages * (rlim_t)page / 2 : 0;
	rlim_t as = half > KC_COMPILE_AS_MIN ? half : KC_COMPILE_AS_MIN;
	rlim_t cpu = (rlim_t)timeout_s + extra_cpu_s;
	sp->as = (struct rlimit){as, as};
	sp->fsize = (struct rlimit){KC_COMPILE_FSIZE, KC_COMPILE_FSIZE};
	sp->cpu = (struct rlimit){cpu, cpu};
	sp->nofile = (struct rlimit){KC_COMPILE_NOFILE, KC_COMPILE_NOFILE};
	/* Compiles are background work: at a lower priority they leave the CPU to the daemon's
	 * request threads and the jobs on the node first. */
	sp->nice = KC_COMPILE_NICE;
}

/* The include directories among the compiler's arguments, NULL-terminated (malloc'd array
 * of pointers into args), or NULL when out of memory. */
static const char **include_dirs(const struct kc_argv *args)
{
	const char **dirs = calloc(args->n + 1, sizeof(*dirs));
	size_t n = 0;
	for (size_t i = 0; dirs && i < args->n; i++)
		if ((dirs[n] = kc_flags_include_dir(args->v[i])))
			n++;
	return dirs;
}

static void track_started(pid_t pid, void *arg);

/* Spawn the compiler as uid (KC_SANDBOX_AS_DAEMON: as the daemon) in slot (its pid is
 * tracked there from the clone on; -1: not tracked), in the directory cwd_fd, with stdin
 * in_fd (<= 0: /dev/null) and extra_cpu_s CPU seconds beyond the timeout; returns its pid,
 * or -errno with why filled (bad_dir: an include directory it cannot reach). */
static pid_t spawn_compiler(const struct kc_compile_spec *spec, char *const argv[], int log_fd,
			    uid_t uid, int slot, int cwd_fd, int in_fd, unsigned extra_cpu_s,
			    int *bad_dir, char *why, size_t whylen)
{
	char env_path[4096], env_home[4200], env_cuda[4200];
	char *envp[8];
	int ne = 0;
	const char *home = getenv("HOME");
	const char *cuda = getenv("CUDA_HOME");
	const char *slash = strrchr(spec->nvcc, '/');

	snprintf(env_path, sizeof(env_path), "PATH=%.*s:/usr/local/bin:/usr/bin:/bin",
		 slash ? (int)(slash - spec->nvcc) : 0, spec->nvcc);
	snprintf(env_home, sizeof(env_home), "HOME=%s", uid != KC_SANDBOX_AS_DAEMON ? KC_COMPILE_CWD
					 : home ? home : "/");
	envp[ne++] = env_path;
	envp[ne++] = "TMPDIR=" KC_COMPILE_CWD;
	envp[ne++] = env_home;
	envp[ne++] = "LC_ALL=C";
	if (cuda) {
		snprintf(env_cuda, sizeof(env_cuda), "CUDA_HOME=%s", cuda);
		envp[ne++] = env_cuda;
	}
	envp[ne] = NULL;

	const char **dirs = include_dirs(spec->args);
	if (!dirs) {
		*bad_dir = -1;
		snprintf(why, whylen, "out of memory");
		return -ENOMEM;
	}
	struct kc_spawn sp = {
		.path = argv[0], .argv = argv, .envp = envp, .cwd_fd = cwd_fd,
		.out_fd = log_fd, .in_fd = in_fd, .uid = uid, .gid = (gid_t)uid, .ns_flags = spec->ns_flags,
		.dirs = dirs, .start_timeout_s = spec->timeout_s,
		.started = slot >= 0 ? track_started : NULL, .arg = &running[slot >= 0 ? slot : 0],
	};
	compiler_limits(&sp, spec->timeout_s, extra_cpu_s);
	sp.idle = spec->idle && !(spec->promote && atomic_load(spec->promote));
	pid_t pid = kc_sandbox_spawn(&sp, bad_dir, why, whylen);
	free(dirs);
	return pid;
}

/* Wait for pid with a timeout; kills its group on timeout. Returns 0 with *status, or
 * -ETIMEDOUT (killed and reaped). */
static int wait_compiler(pid_t pid, unsigned timeout_s, int *status)
{
	int pfd = pidfd_open(pid, 0);
	int timed_out = 0;

	if (pfd >= 0) {
		struct pollfd p = {.fd = pfd, .events = POLLIN};
		double deadline = kc_mono_s() + timeout_s;
		for (;;) {
			double left = deadline - kc_mono_s();
			if (left <= 0) {
				timed_out = 1;
				break;
			}
			int r = poll(&p, 1, left > 1e6 ? 1000000000 : (int)(left * 1000) + 1);
			if (r > 0)
				break;
			if (r < 0 && errno != EINTR)
				break;
		}
		close(pfd);
	} else {
		/* No pidfd (kernel < 5.3, or out of descriptors): poll the child instead. */
		double deadline = kc_mono_s() + timeout_s;
		for (;;) {
			pid_t r = waitpid(pid, status, WNOHANG);
			if (r == pid) {
				kill(-pid, SIGKILL);
				return 0;
			}
			if (r < 0 && errno != EINTR)
				break;
			if (kc_mono_s() >= deadline) {
				timed_out = 1;
				break;
			}
			usleep(10000);
		}
	}
	if (timed_out)
		kill(-pid, SIGKILL);
	while (waitpid(pid, status, 0) < 0 && errno == EINTR)
		;
	/* Reap the group: no compiler helper (cicc, ptxas) outlives its nvcc. */
	kill(-pid, SIGKILL);
	return timed_out ? -ETIMEDOUT : 0;
}

/* Whether the compiler's output holds text, anywhere: it may echo NUL bytes of a source. */
static int says(const struct kc_compile_outcome *out, const char *text)
{
	return out->log && memmem(out->log, out->log_len, text, strlen(text)) != NULL;
}

/* Write the source into the scratch directory; a sandboxed compiler (uid) owns the
 * directory and the source, nothing else. Returns 0 or -errno. */
static int stage_source(const struct kc_compile_spec *spec, uid_t uid)
{
	int fd = openat(spec->scratch_fd, "kernel.cu", O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC,
			0600);
	int err = fd < 0 ? -errno : kc_write_all(fd, spec->source, spec->source_len);
	if (!err && uid != KC_SANDBOX_AS_DAEMON &&
	    (fchown(fd, uid, (gid_t)uid) != 0 || fchown(spec->scratch_fd, uid, (gid_t)uid) != 0))
		err = -errno;
	if (fd >= 0)
		close(fd);
	return err;
}

/* Copy the compiler's cubin into spec->out_fd, a file only the daemon ever had: what is
 * hashed and published is then what was checked, whatever the compiler's uid does with its
 * own file later. Returns 0, or -EINVAL with why filled. */
static int take_cubin(const struct kc_compile_spec *spec, uid_t uid, char *why, size_t whylen)
{
	/* O_NONBLOCK and O_NOFOLLOW: the compiler owned the directory and could leave a FIFO
	 * or a link there */
	int fd = openat(spec->scratch_fd, "kernel.cubin",
			O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
	struct stat st;
	if (fd < 0) {
		snprintf(why, whylen, "wrote no cubin");
		return -EINVAL;
	}
	int err = 0;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_nlink != 1 ||
	    (uid != KC_SANDBOX_AS_DAEMON && st.st_uid != uid)) {
		snprintf(why, whylen, "left a kernel.cubin that is not a file of its own");
		err = -EINVAL;
	}
	char buf[1 << 16];
	off_t copied = 0;
	while (!err) {
		ssize_t n = read(fd, buf, sizeof(buf));
		if (n == 0)
			break;
		if (n < 0 && errno == EINTR)
			continue;
		err = n < 0 ? -errno : kc_write_all(spec->out_fd, buf, (size_t)n);
		copied += n > 0 ? n : 0;
		if (err)
			snprintf(why, whylen, "cubin cannot be copied: %s", strerror(-err));
	}
	close(fd);
	if (!err && copied != st.st_size) {
		snprintf(why, whylen, "cubin changed while it was copied");
		err = -EINVAL;
	}
	return err ? -EINVAL : kc_cubin_check(spec->out_fd, why, whylen);
}

/* The trace the dependency pass wrote (deps_only): into out->deps, less the lines of paths
 * under the scratch (its source, temporaries and outputs: another node's are elsewhere);
 * out->deps left NULL when it is not the pass's own regular file. */
static void take_deps(const struct kc_compile_spec *spec, uid_t uid,
		      struct kc_compile_outcome *out)
{
	struct stat st;
	char *trace = NULL;
	size_t len = 0;
	int fd = openat(spec->scratch_fd, "kernel.trace", O_RDONLY | O_CLOEXEC | O_NOFOLLOW |
			O_NONBLOCK);
	if (fd < 0)
		return;
	int own = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 1 &&
		  (uid == KC_SANDBOX_AS_DAEMON || st.st_uid == uid);
	if (!own || kc_read_all(fd, 64u << 20, &trace, &len) != 0)
		trace = NULL;
	close(fd);
	if (!trace)
		return;
	size_t sl = strlen(spec->scratch), kept = 0;
	for (size_t off = 0; off < len;) {
		char *line = trace + off, *nl = memchr(line, '\n', len - off);
		size_t ll = nl ? (size_t)(nl - line) + 1 : len - off;
		off += ll;
		int scratch = ll > 2 + sl && strncmp(line + 2, spec->scratch, sl) == 0 &&
			      (line[2 + sl] == '/' || line[2 + sl] == '\n') &&
			      !memmem(line, ll, "/..", 3); /* not one that climbs out of it */
		/* nor a directory above it: realpath(3) of the source (/proc/self/cwd/...)
		 * reads each, and where a node keeps its scratch is no input of the compile */
		size_t pl = ll - 2 - (line[ll - 1] == '\n');
		scratch = scratch || (pl < sl && strncmp(line + 2, spec->scratch, pl) == 0 &&
				      (spec->scratch[pl] == '/' || pl == 1));
		if (!scratch) {
			memmove(trace + kept, line, ll);
			kept += ll;
		}
	}
	trace[kept] = '\0';
	out->deps = trace;
	out->deps_len = kept;
}

/* The compiler exited with status code != 0: rejected only when it said why, else a
 * transient failure (out->status, out->why). */
void kc_compile_classify_exit(int code, int low_space, struct kc_compile_outcome *out)
{
	/* Rejected only when the compiler said why: an "error" in its output, with disk
	 * space to spare. A full disk can also leave no log at all, and nvcc frees its
	 * temporaries before it exits, so free space alone is not proof. */
	int space = low_space || says(out, "No space left on device");
	/* a tool of nvcc's killed (the OOM killer, a memory limit) is no verdict either:
	 * gcc says "Killed signal terminated program cc1plus" */
	int killed = says(out, "signal terminated program") || says(out, "std::bad_alloc") ||
		     says(out, "out of memory") || says(out, "Out of memory");
	int reported = says(out, "error");
	snprintf(out->why, sizeof(out->why), "compiler exited with status %d%s",
		 code,
		 space ? " (out of disk space)"
		 : killed ? " (one of its tools was killed or ran out of memory)"
		 : reported ? "" : " without reporting an error");
	out->status = space || killed || !reported ? KC_COMPILE_TRANSIENT
						   : KC_COMPILE_REJECTED;
}

int kc_compile_classify(int wait_err, int status, unsigned timeout_s, int low_space,
			struct kc_compile_outcome *out)
{
	if (wait_err == -ETIMEDOUT) {
		out->timed_out = 1;
		snprintf(out->why, sizeof(out->why), "timed out after %u s and was killed",
			 timeout_s);
		return 0;
	}
	if (WIFSIGNALED(status)) {
		snprintf(out->why, sizeof(out->why), "compiler killed by signal %d (%s)",
			 WTERMSIG(status), strsignal(WTERMSIG(status)));
		return 0;
	}
	if (WEXITSTATUS(status) != 0) {
		kc_compile_classify_exit(WEXITSTATUS(status), low_space, out);
		return 0;
	}
	return 1;
}

/* The key of the worker of this compile (nvrtc_pool.h): uid, the compiler's generation, the
 * compiler and its flags, a line each (flags hold no newline). malloc'd, or NULL. */
static char *worker_key(const struct kc_compile_spec *spec, uid_t uid)
{
	char *key = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&key, &len);
	if (!f)
		return NULL;
	fprintf(f, "%u\n%lu\n%s\n", (unsigned)uid, spec->compiler_gen, spec->nvcc);
	for (size_t i = 0; i < spec->args->n; i++)
		fprintf(f, "%s\n", spec->args->v[i]);
	if (fclose(f) != 0) {
		free(key);
		return NULL;
	}
	return key;
}

/* Start w (kcachefs-nvrtc --serve) as a compile of slot would run: its uid, sandbox and
 * limits, in its own scratch directory, its stdin a socket whose other end w keeps.
 * Returns 0 or -errno with why filled. */
static int start_worker(const struct kc_compile_spec *spec, struct kc_nvrtc_worker *w, int slot,
			char *why, size_t whylen)
{
	int sv[2], bad_dir;
	char *argv[] = {(char *)spec->nvcc, "--serve", NULL};
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
		snprintf(why, whylen, "socketpair: %s", strerror(errno));
		return -errno;
	}
	w->log_fd = openat(w->scratch_fd, "worker.log", O_RDWR | O_CREAT | O_EXCL | O_APPEND |
			   O_NOFOLLOW | O_CLOEXEC, 0600);
	if (w->log_fd < 0) {
		int err = errno;
		close(sv[0]);
		close(sv[1]);
		snprintf(why, whylen, "cannot create its log: %s", strerror(err));
		return -err;
	}
	pid_t pid = spawn_compiler(spec, argv, w->log_fd, w->uid, slot, w->scratch_fd, sv[1],
				   KC_NVRTC_WORKER_CPU, &bad_dir, why, whylen);
	close(sv[1]);
	if (pid < 0) {
		close(sv[0]);
		return (int)pid;
	}
	w->pid = pid;
	w->sock = sv[0];
	kc_log(KC_LOG_INFO, "NVRTC worker pid %d started (compile uid %d, scratch %s)", (int)pid,
	       w->uid == KC_SANDBOX_AS_DAEMON ? -1 : (int)w->uid, w->scratch);
	/* Recorded so that a daemon restarted after a crash kills it (store.c). */
	int fd = openat(w->scratch_fd, "pgid", O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW |
			O_CLOEXEC, 0600);
	if (fd >= 0) {
		dprintf(fd, "%d\n", (int)pid);
		close(fd);
	}
	return 0;
}

/* Move len bytes between buf and the socket fd (out: send, else receive) by deadline
 * (monotonic seconds). Returns 0, -ETIMEDOUT, -EPIPE (the other end closed), or -errno. */
static int xfer(int fd, void *buf, size_t len, double deadline, int out)
{
	char *p = buf;
	while (len > 0) {
		double left = deadline - kc_mono_s();
		if (left <= 0)
			return -ETIMEDOUT;
		struct pollfd pf = {.fd = fd, .events = out ? POLLOUT : POLLIN};
		int r = poll(&pf, 1, left > 1e6 ? 1000000000 : (int)(left * 1000) + 1);
		if (r < 0 && errno != EINTR)
			return -errno;
		if (r <= 0)
			continue;
		ssize_t n = out ? send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT)
				: recv(fd, p, len, MSG_DONTWAIT);
		if (n < 0 && (errno == EINTR || errno == EAGAIN))
			continue;
		if (n < 0)
			return errno == ECONNRESET ? -EPIPE : -errno;
		if (n == 0)
			return -EPIPE;
		p += n;
		len -= (size_t)n;
	}
	return 0;
}

/* One request to w and its reply: the log (NVRTC's) appended to w's log file, the cubin
 * into *cubin (malloc'd). Returns 0, -ETIMEDOUT, -EPIPE (it closed: crashed), -EPROTO (a
 * reply it should not give), or -errno. */
static int exchange(const struct kc_compile_spec *spec, struct kc_nvrtc_worker *w,
		    double deadline, struct kc_nvrtc_rep *rep, char **cubin)
{
	size_t args_len = 0;
	for (size_t i = 0; i < spec->args->n; i++)
		args_len += strlen(spec->args->v[i]) + 1;
	char *args = malloc(args_len + 1), *p = args;
	if (!args)
		return -ENOMEM;
	for (size_t i = 0; i < spec->args->n; i++)
		p = stpcpy(p, spec->args->v[i]) + 1;
	struct kc_nvrtc_req req = {.magic = KC_NVRTC_REQ_MAGIC, .nargs = (uint32_t)spec->args->n,
				   .args_len = args_len, .source_len = spec->source_len};
	int err = xfer(w->sock, &req, sizeof(req), deadline, 1);
	if (!err)
		err = xfer(w->sock, args, args_len, deadline, 1);
	free(args);
	if (!err)
		err = xfer(w->sock, (void *)spec->source, spec->source_len, deadline, 1);
	if (!err)
		err = xfer(w->sock, rep, sizeof(*rep), deadline, 0);
	if (err)
		return err;
	if (rep->magic != KC_NVRTC_REP_MAGIC || rep->cubin_len > KC_COMPILE_FSIZE ||
	    rep->log_len > KC_NVRTC_MAX_LOG || (rep->status == 0) != (rep->cubin_len > 0))
		return -EPROTO;
	char buf[1 << 16];
	for (uint64_t left = rep->log_len; left > 0 && !err;) {
		size_t n = left < sizeof(buf) ? (size_t)left : sizeof(buf);
		err = xfer(w->sock, buf, n, deadline, 0);
		if (!err)
			err = kc_write_all(w->log_fd, buf, n);
		left -= n;
	}
	if (!err && rep->cubin_len) {
		*cubin = malloc(rep->cubin_len);
		err = *cubin ? xfer(w->sock, *cubin, rep->cubin_len, deadline, 0) : -ENOMEM;
	}
	return err;
}

/* Run the compile in a warm worker (spec->warm), holding slot (uid). Returns 1 with out
 * filled, or 0 when no worker can take it: then a process of its own compiles. */
static int run_warm(const struct kc_compile_spec *spec, struct kc_compile_outcome *out,
		    int slot, uid_t uid)
{
	char why[200];
	char *key = worker_key(spec, uid);
	if (!key)
		return 0;
	double t0 = kc_mono_s();
	struct kc_nvrtc_worker *w = kc_nvrtc_pool_take(spec->pool, key);
	if (!w) {
		w = kc_nvrtc_pool_new(spec->pool, key, uid, why, sizeof(why));
		if (w && start_worker(spec, w, slot, why, sizeof(why)) != 0) {
			kc_log(KC_LOG_WARN, "an NVRTC worker cannot start (%s): this compile runs "
			       "in a process of its own", why);
			kc_nvrtc_pool_put(spec->pool, w, 0);
			w = NULL;
		} else if (!w) {
			kc_log(KC_LOG_INFO, "no warm NVRTC worker (%s): this compile runs in a "
			       "process of its own", why);
		}
		if (!w) {
			pthread_mutex_lock(&running_lock);
			running[slot] = -1; /* a child that failed to start was reaped */
			pthread_mutex_unlock(&running_lock);
			free(key);
			return 0;
		}
	} else {
		pthread_mutex_lock(&running_lock); /* a stop kills it as it kills a compiler */
		running[slot] = w->pid;
		if (slot_stopped(slot))
			kill(-w->pid, SIGKILL);
		pthread_mutex_unlock(&running_lock);
	}
	free(key);

	struct kc_nvrtc_rep rep;
	char *cubin = NULL;
	memset(&rep, 0, sizeof(rep));
	if (ftruncate(w->log_fd, 0) != 0)
		kc_log(KC_LOG_DEBUG, "NVRTC worker log: %s", strerror(errno));
	int err = exchange(spec, w, t0 + spec->timeout_s, &rep, &cubin);
	int keep = !err;
	pid_t pid = w->pid;
	if (err) {
		/* Ended or broken. A worker that closed its socket is exiting: wait for its exit
		 * (its signal names the crash; on a loaded node the last steps of an exit can
		 * take a while), at most till the compile's deadline; then kill the group and
		 * reap it. */
		int status = 0, pfd = pidfd_open(w->pid, 0);
		struct pollfd pf = {.fd = pfd, .events = POLLIN};
		double left = t0 + spec->timeout_s - kc_mono_s();
		int ms = left < 1 ? 1000 : left > 1e6 ? 1000000000 : (int)(left * 1000);
		while (err == -EPIPE && pfd >= 0 && poll(&pf, 1, ms) < 0 && errno == EINTR)
			;
		if (pfd >= 0)
			close(pfd);
		pid_t gone = waitpid(w->pid, &status, WNOHANG);
		kill(-w->pid, SIGKILL);
		kill(w->pid, SIGKILL);
		if (gone != w->pid)
			while (waitpid(w->pid, gone == 0 ? &(int){0} : &status, 0) < 0 &&
			       errno == EINTR)
				;
		if (err == -ETIMEDOUT) {
			out->timed_out = 1;
			snprintf(out->why, sizeof(out->why), "timed out after %u s and was killed",
				 spec->timeout_s);
		} else if (gone == w->pid && WIFSIGNALED(status)) {
			snprintf(out->why, sizeof(out->why), "compiler killed by signal %d (%s)",
				 WTERMSIG(status), strsignal(WTERMSIG(status)));
		} else if (gone == w->pid) {
			snprintf(out->why, sizeof(out->why), "the NVRTC worker exited with status %d "
				 "during the compile", WEXITSTATUS(status));
		} else {
			snprintf(out->why, sizeof(out->why), "the NVRTC worker failed its protocol "
				 "(%s) and was killed", strerror(-err));
		}
		kc_log(KC_LOG_WARN, "NVRTC worker pid %d (%lu compiles): %s", (int)w->pid,
		       w->served, out->why);
		pid = w->pid;
		w->pid = 0; /* reaped */
	}
	pthread_mutex_lock(&running_lock);
	running[slot] = -1;
	pthread_mutex_unlock(&running_lock);
	if (err) /* as after any compile: nothing of its uid outlives it */
		kc_sandbox_kill_uids(uid, 1);
	out->seconds = kc_mono_s() - t0;
	if (!err)
		w->served++;
	/* which worker: a second compile of the same flags names the same pid */
	dprintf(w->log_fd, "kcachefs: warm NVRTC worker pid %d, its compile %lu%s\n",
		err ? (int)pid : (int)w->pid, w->served + (err ? 1 : 0),
		err ? ": the worker was stopped" : "");
	read_log(w->log_fd, out);
	log_with_scratch(out, w->scratch);
	if (!err) {
		keep = rep.cpu_usec < (uint64_t)KC_NVRTC_WORKER_CPU * 1000000u;
		if (rep.status != 0) {
			kc_compile_classify_exit(rep.status, low_on_space(spec->scratch), out);
		} else if (kc_cubin_check_buf(cubin, rep.cubin_len, why, sizeof(why)) != 0 ||
			   (err = kc_write_all(spec->out_fd, cubin, rep.cubin_len)) != 0) {
			snprintf(out->why, sizeof(out->why), "compiler exited 0 but %.200s",
				 err ? strerror(-err) : why);
		} else {
			out->status = KC_COMPILE_OK;
			snprintf(out->why, sizeof(out->why), "ok");
		}
	}
	free(cubin);
	kc_nvrtc_pool_put(spec->pool, w, keep);
	if (err)
		kc_nvrtc_pool_forget_uid(spec->pool, uid);
	return 1;
}

int kc_compile_run(const struct kc_compile_spec *spec, struct kc_compile_outcome *out)
{
	struct kc_argv argv = {0};
	int status = 0, bad_dir;
	char why[sizeof(out->why)];

	memset(out, 0, sizeof(*out));
	out->status = KC_COMPILE_TRANSIENT;
	int slot = reserve_slot(spec->deps_only);
	if (slot < 0) {
		snprintf(out->why, sizeof(out->why), "daemon is shutting down or runs %u compiles",
			 KC_COMPILE_SLOTS);
		return 0;
	}
	uid_t uid = spec->first_uid ? (uid_t)(spec->first_uid + (unsigned)slot)
				    : KC_SANDBOX_AS_DAEMON;
	char who[100];
	/* A user or group given an id of the range since the mount would share the compile */
	if (uid != KC_SANDBOX_AS_DAEMON && kc_sandbox_id_taken((unsigned)uid, who, sizeof(who))) {
		release_slot(slot);
		kc_log(KC_LOG_ERR, "compile uid %u now belongs to %s: compiles refused until the "
		       "range (compile_uids=) is free again", (unsigned)uid, who);
		snprintf(out->why, sizeof(out->why), "compile uid %u belongs to %.100s",
			 (unsigned)uid, who);
		return 0;
	}
	if (spec->warm && spec->pool && !spec->deps_only && run_warm(spec, out, slot, uid)) {
		release_slot(slot);
		return 0;
	}
	if (spec->deps_only && !spec->tracer) {
		release_slot(slot);
		snprintf(out->why, sizeof(out->why), "has no tracer: kcachefs-trace is not next to "
			 "kcachefs");
		return 0;
	}
	int err = stage_source(spec, uid);
	if (err) {
		release_slot(slot);
		snprintf(out->why, sizeof(out->why), "cannot write scratch source: %s", strerror(-err));
		return 0;
	}
	/* The dependency pass is the same compile under the tracer, into a cubin of its own */
	if ((spec->deps_only && (kc_argv_push(&argv, spec->tracer) ||
				 kc_argv_push(&argv, "kernel.trace"))) ||
	    kc_argv_push(&argv, spec->nvcc) || kc_argv_push(&argv, KC_COMPILE_CWD "/kernel.cu") ||
	    kc_argv_push(&argv, "-cubin") || kc_argv_push(&argv, "-o") ||
	    kc_argv_push(&argv, spec->deps_only ? KC_COMPILE_CWD "/pass.cubin"
						: KC_COMPILE_CWD "/kernel.cubin") ||
	    kc_argv_extend(&argv, spec->args)) {
		release_slot(slot);
		kc_argv_free(&argv);
		return -ENOMEM;
	}

	double t0 = kc_mono_s();
	/* The output file, opened here and kept: read back through this descriptor. */
	int log_fd = openat(spec->scratch_fd, "compile.log",
			    O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (log_fd < 0) {
		release_slot(slot);
		kc_argv_free(&argv);
		snprintf(out->why, sizeof(out->why), "cannot create the compile log: %s",
			 strerror(errno));
		return 0;
	}
	pid_t pid = spawn_compiler(spec, argv.v, log_fd, uid, slot, spec->scratch_fd, -1, 60,
				   &bad_dir, why, sizeof(why));
	kc_argv_free(&argv);
	if (pid < 0) {
		release_slot(slot);
		close(log_fd);
		char as[48] = "";
		if (uid != KC_SANDBOX_AS_DAEMON)
			snprintf(as, sizeof(as), bad_dir >= 0 ? " for the compiler's uid %u"
				 : " (as uid %u)", (unsigned)uid);
		snprintf(out->why, sizeof(out->why), "%s%.200s%s",
			 bad_dir >= 0 ? "include directory " : "compiler ", why, as);
		return 0;
	}
	if (spec->idle && spec->group) { /* a client that began to wait meanwhile promotes it */
		atomic_store(spec->group, (int)pid);
		if (spec->promote && atomic_load(spec->promote))
			kc_compile_promote(pid);
	}
	/* Recorded so that a daemon restarted after a crash can kill this group (store.c). */
	int fd = openat(spec->scratch_fd, "pgid", O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW |
			O_CLOEXEC, 0600);
	if (fd >= 0) {
		dprintf(fd, "%d\n", (int)pid);
		close(fd);
	}
	pthread_mutex_lock(&running_lock);
	if (slot_stopped(slot))
		snprintf(out->why, sizeof(out->why), "daemon is shutting down");
	pthread_mutex_unlock(&running_lock);
	int w = wait_compiler(pid, spec->timeout_s, &status);
	if (spec->idle && spec->group)
		atomic_store(spec->group, 0);
	pthread_mutex_lock(&running_lock);
	running[slot] = -1; /* reaped: its pid may be another process's soon */
	pthread_mutex_unlock(&running_lock);
	kc_sandbox_kill_uids(uid, 1); /* a process that left the group (setsid) ends here too */
	kc_nvrtc_pool_forget_uid(spec->pool, uid); /* its idle workers were among them */
	release_slot(slot);
	out->seconds = kc_mono_s() - t0;
	read_log(log_fd, out);
	close(log_fd);
	log_with_scratch(out, spec->scratch);

	if (out->why[0])
		return 0;
	int failed = w != -ETIMEDOUT && WIFEXITED(status) && WEXITSTATUS(status) != 0;
	if (!kc_compile_classify(w, status, spec->timeout_s,
				 failed && low_on_space(spec->scratch), out))
		return 0;
	if (spec->deps_only) {
		take_deps(spec, uid, out);
		if (!out->deps) {
			snprintf(out->why, sizeof(out->why), "compiler exited 0 but its trace "
				 "is missing");
			return 0;
		}
	} else if (take_cubin(spec, uid, why, sizeof(why)) != 0) {
		snprintf(out->why, sizeof(out->why), "compiler exited 0 but %.200s", why);
		return 0;
	}
	out->status = KC_COMPILE_OK;
	snprintf(out->why, sizeof(out->why), "ok");
	return 0;
}

/* Whether the string s (n bytes) names a file of a root by another path. */
static int names_root_file(const char *s, size_t n, const struct kc_argv *roots)
{
	for (size_t r = 0; r < roots->n; r++) {
		size_t rl = strlen(roots->v[r]);
		if (rl < n && strncmp(s, roots->v[r], rl) == 0 && s[rl] == '/')
			return 0; /* this node's own path */
	}
	for (size_t i = 1; i < n; i++) {
		if (s[i] != '/')
			continue;
		for (size_t r = 0; r < roots->n; r++) {
			char here[PATH_MAX];
			struct stat st;
			if ((size_t)snprintf(here, sizeof(here), "%s%.*s", roots->v[r], (int)(n - i),
					     s + i) < sizeof(here) &&
			    stat(here, &st) == 0 && S_ISREG(st.st_mode))
				return 1;
		}
	}
	return 0;
}

int kc_cubin_foreign_path(const void *cubin, size_t len, const struct kc_argv *roots,
			  char *path, size_t pathlen)
{
	const char *p = cubin, *end = p + len;
	int looked = 0;
	if (!roots->n)
		return 0;
	for (const char *s = memchr(p, '/', len); s && looked < 64;
	     s = s + 1 < end ? memchr(s + 1, '/', (size_t)(end - s - 1)) : NULL) {
		if (s > p && s[-1] != '\0')
			continue; /* not the start of a string */
		const char *nul = memchr(s, '\0', (size_t)(end - s));
		size_t n = nul ? (size_t)(nul - s) : 0;
		if (n < 4 || n >= PATH_MAX)
			continue;
		int slashes = 0, printable = 1;
		const char *last = s;
		for (const char *c = s; c < nul && printable; c++) {
			printable = *c > ' ' && *c < 127;
			if (*c == '/') {
				slashes++;
				last = c;
			}
		}
		if (!printable || slashes < 2 || !memchr(last, '.', (size_t)(nul - last)))
			continue;
		looked++;
		if (names_root_file(s, n, roots)) {
			snprintf(path, pathlen, "%.*s", (int)n, s);
			return 1;
		}
	}
	return 0;
}

int kc_compile_probe(const char *compiler, const struct kc_argv *args, unsigned uid,
		     int ns_flags, int *bad_dir, char *why, size_t whylen)
{
	char *argv[] = {(char *)compiler, "--version", NULL};
	int status = 0;
	int root = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	int out = open("/dev/null", O_WRONLY | O_CLOEXEC);
	struct kc_compile_spec spec = {.nvcc = compiler, .args = args, .scratch_fd = root,
				       .timeout_s = 60, .ns_flags = ns_flags};
	pid_t pid = -EMFILE;
	*bad_dir = -1;
	if (root >= 0 && out >= 0)
		pid = spawn_compiler(&spec, argv, out, (uid_t)uid, -1, root, -1, 60, bad_dir, why,
				     whylen);
	else
		snprintf(why, whylen, "out of descriptors");
	if (root >= 0)
		close(root);
	if (out >= 0)
		close(out);
	if (pid < 0)
		return (int)pid;
	int w = wait_compiler(pid, spec.timeout_s, &status);
	kc_sandbox_kill_uids((uid_t)uid, 1);
	if (w != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		snprintf(why, whylen, "--version %s %d", WIFEXITED(status) ? "exited with status"
			 : "was killed by signal", WIFEXITED(status) ? WEXITSTATUS(status)
			 : WTERMSIG(status));
		return -EACCES;
	}
	return 0;
}

void kc_compile_outcome_free(struct kc_compile_outcome *out)
{
	free(out->log);
	out->log = NULL;
	out->log_len = 0;
	free(out->deps);
	out->deps = NULL;
	out->deps_len = 0;
}

void kc_compile_promote(pid_t group)
{
	if (group <= 0)
		return;
	DIR *d = opendir("/proc");
	struct dirent *e;
	while (d && (e = readdir(d))) {
		char path[64], buf[512];
		pid_t pid = (pid_t)atoi(e->d_name);
		if (pid <= 0)
			continue;
		snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
		int fd = open(path, O_RDONLY | O_CLOEXEC);
		ssize_t n = fd >= 0 ? read(fd, buf, sizeof(buf) - 1) : -1;
		if (fd >= 0)
			close(fd);
		if (n <= 0)
			continue;
		buf[n] = '\0';
		const char *rp = strrchr(buf, ')'); /* after the command, which may hold anything */
		int pgrp = 0;
		if (!rp || sscanf(rp + 1, " %*c %*d %d", &pgrp) != 1 || pgrp != group)
			continue;
		struct sched_param none_prio = {0};
		sched_setscheduler(pid, SCHED_OTHER, &none_prio);
		setpriority(PRIO_PROCESS, (id_t)pid, KC_COMPILE_NICE);
	}
	if (d)
		closedir(d);
}
