/* compile.c - see compile.h */
#define _GNU_SOURCE
#include "compile.h"

#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "io.h"
#include "log.h"

#define LOG_MAX (1u << 20)
#define LOG_TAIL (64u << 10) /* of a cut output, the end kept */
#define KC_COMPILE_CWD "/proc/self/cwd" /* the scratch directory as the compiler sees it */
#define MAX_RUNNING 256
#ifndef EM_CUDA
#define EM_CUDA 190
#endif

static pthread_mutex_t running_lock = PTHREAD_MUTEX_INITIALIZER;
static pid_t running[MAX_RUNNING];
static int shutting_down;

static int track(pid_t pid)
{
	pthread_mutex_lock(&running_lock);
	int ok = 0;
	for (int i = 0; !shutting_down && i < MAX_RUNNING; i++) {
		if (running[i] == 0) {
			running[i] = pid;
			ok = 1;
			break;
		}
	}
	pthread_mutex_unlock(&running_lock);
	return ok;
}

static void untrack(pid_t pid)
{
	pthread_mutex_lock(&running_lock);
	for (int i = 0; i < MAX_RUNNING; i++)
		if (running[i] == pid)
			running[i] = 0;
	pthread_mutex_unlock(&running_lock);
}

void kc_compile_shutdown(void)
{
	pthread_mutex_lock(&running_lock);
	shutting_down = 1;
	for (int i = 0; i < MAX_RUNNING; i++)
		if (running[i] > 0)
			kill(-running[i], SIGKILL);
	pthread_mutex_unlock(&running_lock);
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
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

int kc_cubin_check(int fd, char *why, size_t whylen)
{
	Elf64_Ehdr eh;
	struct stat st;

	if (fstat(fd, &st) != 0) {
		snprintf(why, whylen, "cannot stat cubin: %s", strerror(errno));
		return -EINVAL;
	}
	if (st.st_size == 0) {
		snprintf(why, whylen, "cubin is empty");
		return -EINVAL;
	}
	if (pread(fd, &eh, sizeof(eh), 0) != (ssize_t)sizeof(eh) ||
	    memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 || eh.e_ident[EI_CLASS] != ELFCLASS64) {
		snprintf(why, whylen, "cubin is not a 64-bit ELF file (%lld bytes)",
			 (long long)st.st_size);
		return -EINVAL;
	}
	if (eh.e_machine != EM_CUDA) {
		snprintf(why, whylen, "ELF machine is %u, not EM_CUDA", eh.e_machine);
		return -EINVAL;
	}
	unsigned long long sh_end = eh.e_shoff + (unsigned long long)eh.e_shnum * eh.e_shentsize;
	unsigned long long ph_end = eh.e_phoff + (unsigned long long)eh.e_phnum * eh.e_phentsize;
	if (sh_end > (unsigned long long)st.st_size || ph_end > (unsigned long long)st.st_size) {
		snprintf(why, whylen, "cubin is truncated (%lld bytes, headers need %llu)",
			 (long long)st.st_size, sh_end > ph_end ? sh_end : ph_end);
		return -EINVAL;
	}
	return 0;
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
 * stops a tool that outlives it); KC_COMPILE_NOFILE open files; no core dumps. Set right
 * after the spawn, before nvcc starts its tools. */
static void limit_compiler(pid_t pid, unsigned timeout_s)
{
	long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
	rlim_t half = pages > 0 && page > 0 ? (rlim_t)pages * (rlim_t)page / 2 : 0;
	rlim_t as = half > KC_COMPILE_AS_MIN ? half : KC_COMPILE_AS_MIN;
	rlim_t cpu = (rlim_t)timeout_s + 60;
	struct rlimit mem = {as, as}, fsize = {KC_COMPILE_FSIZE, KC_COMPILE_FSIZE}, core = {0, 0};
	struct rlimit cpu_l = {cpu, cpu}, files = {KC_COMPILE_NOFILE, KC_COMPILE_NOFILE};
	prlimit(pid, RLIMIT_AS, &mem, NULL);
	prlimit(pid, RLIMIT_FSIZE, &fsize, NULL);
	prlimit(pid, RLIMIT_CPU, &cpu_l, NULL);
	prlimit(pid, RLIMIT_NOFILE, &files, NULL);
	prlimit(pid, RLIMIT_CORE, &core, NULL);
}

/* Spawn the compiler; returns its pid or -errno. */
static pid_t spawn_compiler(const struct kc_compile_spec *spec, char *const argv[], int log_fd)
{
	char env_path[4096], env_tmp[4200], env_home[4200], env_cuda[4200];
	char *envp[8];
	int ne = 0;
	const char *home = getenv("HOME");
	const char *cuda = getenv("CUDA_HOME");
	const char *slash = strrchr(spec->nvcc, '/');
	posix_spawn_file_actions_t fa;
	posix_spawnattr_t attr;
	sigset_t none, all;
	pid_t pid;

	snprintf(env_path, sizeof(env_path), "PATH=%.*s:/usr/local/bin:/usr/bin:/bin",
		 slash ? (int)(slash - spec->nvcc) : 0, spec->nvcc);
	snprintf(env_tmp, sizeof(env_tmp), "TMPDIR=" KC_COMPILE_CWD);
	snprintf(env_home, sizeof(env_home), "HOME=%s", spec->setpriv ? KC_COMPILE_CWD
					 : home ? home : "/");
	envp[ne++] = env_path;
	envp[ne++] = env_tmp;
	envp[ne++] = env_home;
	envp[ne++] = "LC_ALL=C";
	if (cuda) {
		snprintf(env_cuda, sizeof(env_cuda), "CUDA_HOME=%s", cuda);
		envp[ne++] = env_cuda;
	}
	envp[ne] = NULL;

	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
	posix_spawn_file_actions_adddup2(&fa, log_fd, 1);
	posix_spawn_file_actions_adddup2(&fa, 1, 2);
	posix_spawn_file_actions_addchdir_np(&fa, spec->scratch);
	posix_spawnattr_init(&attr);
	sigemptyset(&none);
	sigfillset(&all);
	posix_spawnattr_setsigmask(&attr, &none);
	posix_spawnattr_setsigdefault(&attr, &all);
	posix_spawnattr_setpgroup(&attr, 0);
	posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK |
						POSIX_SPAWN_SETSIGDEF);
	int err = posix_spawn(&pid, spec->setpriv ? spec->setpriv : spec->nvcc, &fa, &attr, argv,
			      envp);
	posix_spawn_file_actions_destroy(&fa);
	posix_spawnattr_destroy(&attr);
	/* Compiles are background work: at a lower priority they leave the CPU to the daemon's
	 * request threads and the jobs on the node first. Its children (cicc, ptxas) inherit
	 * it. */
	if (!err) {
		setpriority(PRIO_PROCESS, (id_t)pid, KC_COMPILE_NICE);
		limit_compiler(pid, spec->timeout_s);
	}
	return err ? -err : pid;
}

/* Wait for pid with a timeout; kills its group on timeout. Returns 0 with *status, or
 * -ETIMEDOUT (killed and reaped). */
static int wait_compiler(pid_t pid, unsigned timeout_s, int *status)
{
	int pfd = pidfd_open(pid, 0);
	int timed_out = 0;

	if (pfd >= 0) {
		struct pollfd p = {.fd = pfd, .events = POLLIN};
		double deadline = now_s() + timeout_s;
		for (;;) {
			double left = deadline - now_s();
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
		double deadline = now_s() + timeout_s;
		for (;;) {
			pid_t r = waitpid(pid, status, WNOHANG);
			if (r == pid) {
				kill(-pid, SIGKILL);
				return 0;
			}
			if (r < 0 && errno != EINTR)
				break;
			if (now_s() >= deadline) {
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

int kc_compile_run(const struct kc_compile_spec *spec, struct kc_compile_outcome *out)
{
	char src[4200], cubin[4200];
	struct kc_argv argv = {0};
	int status = 0;

	memset(out, 0, sizeof(*out));
	out->status = KC_COMPILE_TRANSIENT;
	pthread_mutex_lock(&running_lock);
	int stopping = shutting_down;
	pthread_mutex_unlock(&running_lock);
	if (stopping) {
		snprintf(out->why, sizeof(out->why), "daemon is shutting down");
		return 0;
	}
	snprintf(src, sizeof(src), KC_COMPILE_CWD "/kernel.cu");
	snprintf(cubin, sizeof(cubin), KC_COMPILE_CWD "/kernel.cubin");

	int fd = openat(spec->scratch_fd, "kernel.cu", O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC,
			0600);
	int err = fd < 0 ? -errno : kc_write_all(fd, spec->source, spec->source_len);
	/* An unprivileged compiler owns its scratch directory and source, nothing else. */
	if (!err && spec->setpriv &&
	    (fchown(fd, spec->uid, spec->gid) != 0 || fchown(spec->scratch_fd, spec->uid, spec->gid) != 0))
		err = -errno;
	if (fd >= 0)
		close(fd);
	if (err) {
		snprintf(out->why, sizeof(out->why), "cannot write scratch source: %s", strerror(-err));
		return 0;
	}
	char reuid[32], regid[32];
	snprintf(reuid, sizeof(reuid), "--reuid=%u", spec->uid);
	snprintf(regid, sizeof(regid), "--regid=%u", spec->gid);
	if (spec->setpriv &&
	    (kc_argv_push(&argv, spec->setpriv) || kc_argv_push(&argv, reuid) ||
	     kc_argv_push(&argv, regid) || kc_argv_push(&argv, "--clear-groups") ||
	     kc_argv_push(&argv, "--no-new-privs") || kc_argv_push(&argv, "--"))) {
		kc_argv_free(&argv);
		return -ENOMEM;
	}
	if (kc_argv_push(&argv, spec->nvcc) || kc_argv_push(&argv, src) ||
	    kc_argv_push(&argv, "-cubin") || kc_argv_push(&argv, "-o") ||
	    kc_argv_push(&argv, cubin) || kc_argv_extend(&argv, spec->args)) {
		kc_argv_free(&argv);
		return -ENOMEM;
	}

	double t0 = now_s();
	/* The output file, opened here and kept: read back through this descriptor. */
	int log_fd = openat(spec->scratch_fd, "compile.log",
			    O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (log_fd < 0) {
		kc_argv_free(&argv);
		snprintf(out->why, sizeof(out->why), "cannot create the compile log: %s",
			 strerror(errno));
		return 0;
	}
	pid_t pid = spawn_compiler(spec, argv.v, log_fd);
	kc_argv_free(&argv);
	if (pid < 0) {
		close(log_fd);
		snprintf(out->why, sizeof(out->why), "compiler %s cannot run: %s", spec->nvcc,
			 strerror((int)-pid));
		return 0;
	}
	/* Recorded so that a daemon restarted after a crash can kill this group (store.c). */
	fd = openat(spec->scratch_fd, "pgid", O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
		    0600);
	if (fd >= 0) {
		dprintf(fd, "%d\n", (int)pid);
		close(fd);
	}
	if (!track(pid)) {
		kill(-pid, SIGKILL);
		snprintf(out->why, sizeof(out->why), "daemon is shutting down or runs %d compiles",
			 MAX_RUNNING);
	}
	int w = wait_compiler(pid, spec->timeout_s, &status);
	untrack(pid);
	out->seconds = now_s() - t0;
	read_log(log_fd, out);
	close(log_fd);
	log_with_scratch(out, spec->scratch);

	if (out->why[0])
		return 0;
	if (w == -ETIMEDOUT) {
		out->timed_out = 1;
		snprintf(out->why, sizeof(out->why), "timed out after %u s and was killed",
			 spec->timeout_s);
		return 0;
	}
	if (WIFSIGNALED(status)) {
		snprintf(out->why, sizeof(out->why), "compiler killed by signal %d (%s)",
			 WTERMSIG(status), strsignal(WTERMSIG(status)));
		return 0;
	}
	if (WEXITSTATUS(status) != 0) {
		/* Rejected only when the compiler said why: an "error" in its output, with disk
		 * space to spare. A full disk can also leave no log at all, and nvcc frees its
		 * temporaries before it exits, so free space alone is not proof. */
		int space = low_on_space(spec->scratch) || says(out, "No space left on device");
		/* a tool of nvcc's killed (the OOM killer, a memory limit) is no verdict either:
		 * gcc says "Killed signal terminated program cc1plus" */
		int killed = says(out, "signal terminated program") || says(out, "std::bad_alloc") ||
			     says(out, "out of memory") || says(out, "Out of memory");
		int reported = says(out, "error");
		snprintf(out->why, sizeof(out->why), "compiler exited with status %d%s",
			 WEXITSTATUS(status),
			 space ? " (out of disk space)"
			 : killed ? " (one of its tools was killed or ran out of memory)"
			 : reported ? "" : " without reporting an error");
		out->status = space || killed || !reported ? KC_COMPILE_TRANSIENT
							   : KC_COMPILE_REJECTED;
		return 0;
	}
	/* O_NONBLOCK: an unprivileged compiler owns the directory and could leave a FIFO */
	fd = openat(spec->scratch_fd, "kernel.cubin", O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
	if (fd < 0) {
		snprintf(out->why, sizeof(out->why), "compiler exited 0 but wrote no cubin");
		return 0;
	}
	char why[200];
	err = kc_cubin_check(fd, why, sizeof(why));
	close(fd);
	if (err) {
		snprintf(out->why, sizeof(out->why), "compiler exited 0 but %s", why);
		return 0;
	}
	out->status = KC_COMPILE_OK;
	snprintf(out->why, sizeof(out->why), "ok");
	return 0;
}

void kc_compile_outcome_free(struct kc_compile_outcome *out)
{
	free(out->log);
	out->log = NULL;
	out->log_len = 0;
}
