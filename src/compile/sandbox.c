/* sandbox.c - see sandbox.h */
#define _GNU_SOURCE
#include "sandbox.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <pwd.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

#define KC_SANDBOX_NS (CLONE_NEWNET | CLONE_NEWIPC)

enum stage { STAGE_SETUP = -1, STAGE_IDENTITY = -2, STAGE_EXEC = -3, STAGE_START = -4 };
/* >= 0: a dir */

/* What a child that could not start its program sends back before it exits. */
struct failure {
	int err;
	int stage;
};

static void fail_child(int pipe_fd, int err, int stage)
{
	struct failure f = {.err = err, .stage = stage};
	ssize_t n = write(pipe_fd, &f, sizeof(f));
	(void)n;
	_exit(127);
}

/* fork semantics (a copy of the address space) in new namespaces: glibc's clone() wants a
 * stack of its own, fork() takes no flags. */
static pid_t clone_ns(int ns_flags)
{
	return (pid_t)syscall(SYS_clone, (unsigned long)(SIGCHLD | ns_flags), NULL, NULL, NULL,
			      NULL);
}

/* The child, between clone and exec: system calls only. parent: the daemon's pid. */
static void child(const struct kc_spawn *sp, int pipe_fd, int devnull, pid_t parent)
{
	struct sigaction dfl;
	sigset_t none;

	memset(&dfl, 0, sizeof(dfl));
	dfl.sa_handler = SIG_DFL;
	for (int s = 1; s < NSIG; s++)
		sigaction(s, &dfl, NULL); /* SIGKILL, SIGSTOP and libc's own refuse: harmless */
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	if (setpgid(0, 0) != 0 || dup2(sp->in_fd > 0 ? sp->in_fd : devnull, 0) < 0 || dup2(sp->out_fd, 1) < 0 ||
	    dup2(sp->out_fd, 2) < 0 || fchdir(sp->cwd_fd) != 0)
		fail_child(pipe_fd, errno, STAGE_SETUP);
	/* Nothing of the daemon's stays open, not even while a check below waits on a
	 * directory that does not answer: not /dev/fuse, not its locks, not the store. */
	if (pipe_fd != 3 && (pipe_fd = dup3(pipe_fd, 3, O_CLOEXEC)) != 3)
		fail_child(pipe_fd, errno, STAGE_SETUP);
	if (syscall(SYS_close_range, 4u, ~0u, 0u) != 0)
		for (int fd = 4; fd < 65536; fd++) /* kernels before 5.9 */
			close(fd);
	struct rlimit core = {0, 0};
	if (setrlimit(RLIMIT_AS, &sp->as) != 0 || setrlimit(RLIMIT_FSIZE, &sp->fsize) != 0 ||
	    setrlimit(RLIMIT_CPU, &sp->cpu) != 0 || setrlimit(RLIMIT_NOFILE, &sp->nofile) != 0 ||
	    setrlimit(RLIMIT_CORE, &core) != 0)
		fail_child(pipe_fd, errno, STAGE_SETUP);
	setpriority(PRIO_PROCESS, 0, sp->nice);
	if (sp->idle) { /* lowering a policy needs no privilege; refused, it runs at nice */
		struct sched_param none_prio = {0};
		sched_setscheduler(0, SCHED_IDLE, &none_prio);
	}
	umask(077); /* the daemon runs with 0 (fs/kcachefs.c); a compiler's files are its own */
	/* Raw system calls: glibc's setuid() would try to reach threads the child lacks. */
	if (sp->uid != KC_SANDBOX_AS_DAEMON &&
	    (syscall(SYS_setgroups, 0, NULL) != 0 ||
	     syscall(SYS_setresgid, sp->gid, sp->gid, sp->gid) != 0 ||
	     syscall(SYS_setresuid, sp->uid, sp->uid, sp->uid) != 0))
		fail_child(pipe_fd, errno, STAGE_IDENTITY);
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
		fail_child(pipe_fd, errno, STAGE_IDENTITY);
	/* Dies with the thread that cloned it, which waits for it to the end (a pool worker,
	 * or the thread of a start-up probe): this covers a daemon killed before the child's
	 * pid was recorded for the watcher (kc_sandbox_watch). Set after the identity, which
	 * clears it (prctl(2): a change of the effective or filesystem uid or gid); a parent
	 * gone before this line is seen by getppid. */
	if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0 || getppid() != parent)
		fail_child(pipe_fd, ESRCH, STAGE_SETUP);
	for (int i = 0; sp->dirs && sp->dirs[i]; i++) {
		struct stat st;
		if (stat(sp->dirs[i], &st) != 0)
			fail_child(pipe_fd, errno, i);
		if (!S_ISDIR(st.st_mode))
			fail_child(pipe_fd, ENOTDIR, i);
		if (access(sp->dirs[i], X_OK) != 0) /* there, but not to be searched by uid */
			fail_child(pipe_fd, errno, i);
	}
	execve(sp->path, sp->argv, sp->envp);
	fail_child(pipe_fd, errno, STAGE_EXEC);
}

pid_t kc_sandbox_spawn(const struct kc_spawn *sp, int *bad_dir, char *why, size_t whylen)
{
	int p[2];

	*bad_dir = -1;
	if (pipe2(p, O_CLOEXEC) != 0) {
		snprintf(why, whylen, "cannot start %s: %s", sp->path, strerror(errno));
		return -errno;
	}
	int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
	if (devnull < 0) {
		int err = errno;
		close(p[0]);
		close(p[1]);
		snprintf(why, whylen, "cannot open /dev/null: %s", strerror(err));
		return -err;
	}
	pid_t parent = getpid();
	pid_t pid = clone_ns(sp->ns_flags);
	if (pid == 0) {
		close(p[0]);
		child(sp, p[1], devnull, parent);
	}
	int clone_err = errno;
	close(p[1]);
	close(devnull);
	if (pid < 0) {
		close(p[0]);
		snprintf(why, whylen, "cannot start %s: %s", sp->path, strerror(clone_err));
		return -clone_err;
	}
	if (sp->started)
		sp->started(pid, sp->arg);
	/* The pipe closes at the exec (O_CLOEXEC), or brings why there was none. */
	struct failure f = {.err = ETIMEDOUT, .stage = STAGE_START};
	struct pollfd pfd = {.fd = p[0], .events = POLLIN};
	int ms = sp->start_timeout_s ? (int)sp->start_timeout_s * 1000 : -1;
	ssize_t n = -1;
	int r;
	while ((r = poll(&pfd, 1, ms)) < 0 && errno == EINTR)
		;
	if (r > 0)
		while ((n = read(p[0], &f, sizeof(f))) < 0 && errno == EINTR)
			;
	close(p[0]);
	if (r > 0 && n != (ssize_t)sizeof(f))
		return pid;
	if (r <= 0)
		kill(-pid, SIGKILL);
	while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
		;
	if (f.stage >= 0) {
		*bad_dir = f.stage;
		snprintf(why, whylen, "%s: %s", sp->dirs[f.stage], strerror(f.err));
	}
	else if (f.stage == STAGE_IDENTITY)
		snprintf(why, whylen, "cannot run as uid %u: %s", (unsigned)sp->uid, strerror(f.err));
	else if (f.stage == STAGE_START)
		snprintf(why, whylen, "%s did not start within %u s (an include directory that "
			 "does not answer?)", sp->path, sp->start_timeout_s);
	else if (f.stage == STAGE_EXEC)
		snprintf(why, whylen, "cannot run %s: %s", sp->path, strerror(f.err));
	else
		snprintf(why, whylen, "cannot set up the process of %s: %s", sp->path,
			 strerror(f.err));
	return f.err > 0 ? -f.err : -EIO;
}

int kc_sandbox_namespaces(char *why, size_t whylen)
{
	pid_t pid = clone_ns(KC_SANDBOX_NS);
	if (pid == 0)
		_exit(0);
	if (pid < 0) {
		snprintf(why, whylen, "new network and IPC namespaces: %s", strerror(errno));
		return 0;
	}
	int status = 0;
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	return KC_SANDBOX_NS;
}

int kc_sandbox_claim_uids(uid_t first, unsigned count)
{
	struct stat st;
	if (mkdir(KC_SANDBOX_RUN_DIR, 0700) != 0 && errno != EEXIST)
		return -errno;
	/* Made by someone else, a user could hold every range, or swap the file. */
	if (lstat(KC_SANDBOX_RUN_DIR, &st) != 0)
		return -errno;
	if (!S_ISDIR(st.st_mode) || st.st_uid != 0 || (st.st_mode & 022))
		return -EPERM;
	int fd = open(KC_SANDBOX_RUN_DIR "/compile-uids", O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW,
		      0600);
	if (fd < 0)
		return -errno;
	/* One byte a uid: the kernel finds ranges that overlap. */
	struct flock lk = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = (off_t)first,
			   .l_len = (off_t)count};
	if (fcntl(fd, F_OFD_SETLK, &lk) != 0) {
		int err = errno == EAGAIN || errno == EACCES ? EBUSY : errno;
		close(fd);
		return -err;
	}
	return fd;
}

int kc_sandbox_id_taken(unsigned id, char *who, size_t len)
{
	char buf[16384];
	struct passwd pw, *pwp = NULL;
	struct group gr, *grp = NULL;
	if (getpwuid_r((uid_t)id, &pw, buf, sizeof(buf), &pwp) == 0 && pwp) {
		snprintf(who, len, "the user '%.64s'", pwp->pw_name);
		return 1;
	}
	if (getgrgid_r((gid_t)id, &gr, buf, sizeof(buf), &grp) == 0 && grp) {
		snprintf(who, len, "the group '%.64s'", grp->gr_name);
		return 1;
	}
	return 0;
}

unsigned kc_sandbox_count_uids(uid_t first, unsigned count)
{
	DIR *proc = opendir("/proc");
	struct dirent *de;
	unsigned n = 0;

	while (proc && (de = readdir(proc)) != NULL) {
		struct stat st;
		char path[300], stat_line[512];
		if (de->d_name[0] < '1' || de->d_name[0] > '9' ||
		    fstatat(dirfd(proc), de->d_name, &st, 0) != 0 || st.st_uid < first ||
		    st.st_uid - first >= count)
			continue;
		snprintf(path, sizeof(path), "/proc/%s/stat", de->d_name);
		FILE *f = fopen(path, "re");
		char *paren = f && fgets(stat_line, sizeof(stat_line), f) ? strrchr(stat_line, ')')
									  : NULL;
		n += paren && paren[1] == ' ' && paren[2] != 'Z'; /* a zombie waits for its parent */
		if (f)
			fclose(f);
	}
	if (proc)
		closedir(proc);
	return n;
}

void kc_sandbox_kill_uids(uid_t first, unsigned count)
{
	if (first == KC_SANDBOX_AS_DAEMON || first == 0 || count == 0)
		return;
	pid_t pid = clone_ns(0);
	if (pid == 0) {
		/* kill(-1) reaches every process the caller may signal: as uid, all of uid's. The
		 * saved uid stays root, to take the next. */
		for (unsigned i = 0; i < count; i++) {
			if (syscall(SYS_setresuid, first + i, first + i, 0) != 0)
				_exit(1);
			kill(-1, SIGKILL);
			if (syscall(SYS_setresuid, 0, 0, 0) != 0)
				_exit(1);
		}
		_exit(0);
	}
	while (pid > 0 && waitpid(pid, NULL, 0) < 0 && errno == EINTR)
		;
}

/* Close the descriptors from to to (none when to < from). */
static void close_span(int from, int to)
{
	if (to >= from && syscall(SYS_close_range, (unsigned)from, (unsigned)to, 0u) != 0)
		for (int fd = from; fd <= to && fd < 65536; fd++) /* kernels before 5.9 */
			close(fd);
}

/* Close every descriptor but a and b (either may be -1). */
static void close_all_but(int a, int b)
{
	int lo = a < b ? a : b, hi = a < b ? b : a, from = 0;
	if (lo >= 0) {
		close_span(from, lo - 1);
		from = lo + 1;
	}
	if (hi >= 0 && hi != lo) {
		close_span(from, hi - 1);
		from = hi + 1;
	}
	close_span(from, INT_MAX);
}

/* Make this process's command line (in ps, pgrep, /proc/PID/cmdline) "kcachefs-watch of
 * pid <daemon>", over the daemon's arguments that it has a copy of: a watcher is then never
 * taken for the daemon it watches. Writes into the argument area that /proc/self/stat
 * gives (fields 48 and 49); system calls only. */
static void retitle(pid_t daemon)
{
	char st[1024], title[64] = "kcachefs-watch of pid ", digits[16];
	int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
	ssize_t n = fd >= 0 ? read(fd, st, sizeof(st) - 1) : -1;
	if (fd >= 0)
		close(fd);
	if (n <= 0)
		return;
	st[n] = '\0';
	char *p = strrchr(st, ')');
	unsigned long field[50] = {0};
	for (int f = 3; p && f <= 49; f++) { /* p at the space before field f */
		while (*p && *p != ' ')
			p++;
		while (*p == ' ')
			p++;
		for (; *p >= '0' && *p <= '9'; p++)
			field[f] = field[f] * 10 + (unsigned long)(*p - '0');
	}
	char *start = (char *)field[48], *end = (char *)field[49];
	if (!p || !start || end <= start)
		return;
	int d = 0, t = (int)strlen(title);
	for (unsigned v = (unsigned)daemon; d == 0 || v; v /= 10)
		digits[d++] = (char)('0' + v % 10);
	while (d && t < (int)sizeof(title) - 1)
		title[t++] = digits[--d];
	title[t] = '\0';
	size_t len = (size_t)(end - start);
	memset(start, 0, len);
	memcpy(start, title, (size_t)t < len - 1 ? (size_t)t : len - 1);
}

/* The watcher: waits for the daemon (pidfd, else a look each second), then kills. */
static void watcher(pid_t daemon, int pidfd, uid_t first, unsigned count,
		    const volatile pid_t *groups, unsigned ngroups, int keep_fd)
{
	struct sigaction ign;
	memset(&ign, 0, sizeof(ign));
	ign.sa_handler = SIG_IGN;
	/* Not stopped by what stops the daemon cleanly (a terminal's ^C, systemd's SIGTERM): it
	 * ends by itself once the daemon is gone. */
	int quiet[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGUSR1, SIGUSR2};
	for (size_t i = 0; i < sizeof(quiet) / sizeof(quiet[0]); i++)
		sigaction(quiet[i], &ign, NULL);
	setsid();
	prctl(PR_SET_NAME, "kcachefs-watch", 0, 0, 0);
	retitle(daemon);
	/* Nothing of the daemon's stays open: not /dev/fuse (the mount would outlive it), not
	 * the store, not the log's pipe. */
	close_all_but(pidfd, keep_fd);
	struct pollfd p = {.fd = pidfd, .events = POLLIN};
	while (poll(&p, 1, 1000) <= 0)
		if (pidfd < 0 && kill(daemon, 0) != 0 && errno == ESRCH)
			break;
	for (unsigned i = 0; i < ngroups; i++) {
		pid_t g = groups[i];
		if (g > 0) { /* the group, once the child made it; the child before that */
			kill(-g, SIGKILL);
			kill(g, SIGKILL);
		}
	}
	kc_sandbox_kill_uids(first, count);
	_exit(0);
}

int kc_sandbox_watch(uid_t first, unsigned count, const volatile pid_t *groups,
		     unsigned ngroups, int keep_fd, int *watcher_fd)
{
	pid_t daemon = getpid(), w = 0;
	int pidfd = (int)syscall(SYS_pidfd_open, daemon, 0u); /* -1 before Linux 5.3 */
	int tell[2] = {-1, -1}; /* the middle process tells the watcher's pid through it */
	if (watcher_fd)
		*watcher_fd = -1;
	if (watcher_fd && pipe2(tell, O_CLOEXEC) != 0)
		tell[0] = tell[1] = -1;
	/* Twice: the watcher is then nobody's child here, so no wait of the daemon's (nor a
	 * check for children it left) ever sees it. */
	pid_t mid = clone_ns(0);
	if (mid == 0) {
		w = clone_ns(0);
		if (w == 0)
			watcher(daemon, pidfd, first, count, groups, ngroups, keep_fd);
		if (w > 0 && tell[1] >= 0 && write(tell[1], &w, sizeof(w)) != sizeof(w))
			_exit(1);
		_exit(w > 0 ? 0 : 1);
	}
	int err = mid < 0 ? -errno : 0, status = 0;
	if (tell[1] >= 0)
		close(tell[1]);
	while (mid > 0 && waitpid(mid, &status, 0) < 0 && errno == EINTR)
		;
	if (pidfd >= 0)
		close(pidfd);
	if (!err && !(WIFEXITED(status) && WEXITSTATUS(status) == 0))
		err = -EAGAIN;
	if (!err && tell[0] >= 0 && read(tell[0], &w, sizeof(w)) == sizeof(w) && w > 0)
		*watcher_fd = (int)syscall(SYS_pidfd_open, w, 0u);
	if (tell[0] >= 0)
		close(tell[0]);
	return err;
}
