/* kcachefs-trace.c - kcachefs-trace: run a compile and write down every path it looked up.
 *
 *   kcachefs-trace OUT PROGRAM [ARGS...]
 *
 * Runs PROGRAM (an absolute path) with ARGS, and every process it starts, under ptrace,
 * and writes to OUT (created, mode 0600, relative to the working directory) one line per
 * file-system lookup of a path that any of them made:
 *
 *   o <path>   an open that may read (open, openat, openat2; not one for writing only,
 *              nor creat: a log appended to decides no output): the bytes it read, or the
 *              absence it found (a header search is a row of failed opens)
 *   s <path>   a stat or an access test (stat, lstat, newfstatat, statx, access,
 *              faccessat, faccessat2: an include directory tested, a program searched)
 *   x <path>   an exec (execve, execveat: a program of the toolchain), and the interpreter
 *              the kernel opens for it, which no system call of the tracee names: a
 *              script's "#!" program, an ELF program's PT_INTERP (its dynamic loader)
 *   l <path>   a readlink (readlink, readlinkat): cc1plus canonicalizes the names of system
 *              headers with realpath(3) and opens the canonical name, so a symbolic link on
 *              the way is seen only here (17,000 calls on CUB's block_sum)
 *   d <path>   a directory read (getdents64: the directory's descriptor, as /proc names it)
 *
 * Relative paths are made absolute against the process's working directory or the
 * directory descriptor it named, as /proc/PID shows them at the call.
 *
 * Only those system calls stop the tracee: a seccomp filter (SECCOMP_RET_TRACE, installed
 * in the child before it runs PROGRAM, inherited by every process it starts) passes every
 * other call through without a stop, so a compile runs at nearly its own speed. The idea
 * of a seccomp-filtered ptrace is the one of strace --seccomp-bpf; nothing of strace is
 * used.
 *
 * It exits as PROGRAM did (its status, or 128 + the signal that ended it); 125 when it
 * could not trace (ptrace or seccomp refused: a container's policy), with why on stderr,
 * so a caller never takes an untraced run for a traced one. Tracees are killed with it
 * (PTRACE_O_EXITKILL).
 */
#define _GNU_SOURCE
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#if defined(__x86_64__)
#define TRACE_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define TRACE_ARCH AUDIT_ARCH_AARCH64
#else
#error "kcachefs-trace: no seccomp architecture for this machine"
#endif

#ifndef __NR_faccessat2
#define __NR_faccessat2 439
#endif
#ifndef __NR_openat2
#define __NR_openat2 437
#endif

#define TRACE_FAILED 125 /* exit status: could not trace */

/* A traced call: its number, the argument that holds the path (or the descriptor for
 * getdents64), the argument that holds the directory descriptor (-1: none, relative to
 * the working directory), the argument that holds open(2)'s flags (-1: none), the line's
 * kind. */
struct traced {
	long nr;
	int path_arg, dirfd_arg, flags_arg;
	char kind;
};

static const struct traced calls[] = {
#ifdef __NR_open
	{__NR_open, 0, -1, 1, 'o'},
#endif
#ifdef __NR_stat
	{__NR_stat, 0, -1, -1, 's'},
#endif
#ifdef __NR_lstat
	{__NR_lstat, 0, -1, -1, 's'},
#endif
#ifdef __NR_access
	{__NR_access, 0, -1, -1, 's'},
#endif
#ifdef __NR_readlink
	{__NR_readlink, 0, -1, -1, 'l'},
#endif
	{__NR_readlinkat, 1, 0, -1, 'l'},
	{__NR_openat, 1, 0, 2, 'o'},
	{__NR_openat2, 1, 0, -1, 'o'},
	{__NR_newfstatat, 1, 0, -1, 's'},
	{__NR_statx, 1, 0, -1, 's'},
	{__NR_faccessat, 1, 0, -1, 's'},
	{__NR_faccessat2, 1, 0, -1, 's'},
	{__NR_execve, 0, -1, -1, 'x'},
	{__NR_execveat, 1, 0, -1, 'x'},
	{__NR_getdents64, -1, 0, -1, 'd'},
};
#define NCALLS (sizeof(calls) / sizeof(calls[0]))

static const struct traced *traced_of(long nr)
{
	for (size_t i = 0; i < NCALLS; i++)
		if (calls[i].nr == nr)
			return &calls[i];
	return NULL;
}

/* The filter: another architecture's calls fail (ENOSYS: a 32-bit call would name its
 * paths unseen), the traced ones stop, the rest run. */
static int install_filter(void)
{
	struct sock_filter f[4 + NCALLS + 2];
	size_t n = 0;
	f[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS,
					      offsetof(struct seccomp_data, arch));
	f[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, TRACE_ARCH, 1, 0);
	f[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS);
	f[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS,
					      offsetof(struct seccomp_data, nr));
	for (size_t i = 0; i < NCALLS; i++) /* a match jumps to the TRACE return */
		f[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K,
						      (unsigned)calls[i].nr,
						      (unsigned char)(NCALLS - i), 0);
	f[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
	f[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_TRACE);
	struct sock_fprog prog = {.len = (unsigned short)n, .filter = f};
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
		return -1;
	return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

/* Read the NUL-terminated string at addr of pid into buf (PATH_MAX). Returns its length,
 * or -1. Reads page by page: a string that ends just before an unmapped page is read. */
static ssize_t read_string(pid_t pid, unsigned long addr, char *buf, size_t cap)
{
	size_t got = 0;
	while (got < cap - 1) {
		size_t page = 4096 - ((addr + got) & 4095);
		size_t want = page < cap - 1 - got ? page : cap - 1 - got;
		struct iovec local = {buf + got, want}, remote = {(void *)(addr + got), want};
		ssize_t r = process_vm_readv(pid, &local, 1, &remote, 1, 0);
		if (r <= 0)
			return -1;
		char *nul = memchr(buf + got, '\0', (size_t)r);
		if (nul)
			return nul - buf;
		got += (size_t)r;
	}
	return -1; /* longer than PATH_MAX: the call fails with ENAMETOOLONG anyway */
}

/* The directory a relative path of pid starts from: its working directory, or the
 * directory descriptor dirfd. Returns the length written to dir, or -1. */
static ssize_t base_dir(pid_t pid, long dirfd, char *dir, size_t cap)
{
	char link[64];
	if (dirfd == AT_FDCWD || dirfd == -1)
		snprintf(link, sizeof(link), "/proc/%d/cwd", (int)pid);
	else
		snprintf(link, sizeof(link), "/proc/%d/fd/%d", (int)pid, (int)dirfd);
	ssize_t n = readlink(link, dir, cap - 1);
	if (n > 0)
		dir[n] = '\0';
	return n > 0 ? n : -1;
}

/* Write the interpreter the kernel opens to run the program at path (an exec's "x" line)
 * to out, and its own, at most 4 deep: a script's "#!" path, or an ELF file's PT_INTERP.
 * Read as the tracer, which is the tracee's uid. */
static void record_interp(FILE *out, const char *path, int depth)
{
	unsigned char head[4096];
	char interp[PATH_MAX];
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
	if (fd < 0 || depth > 4) {
		if (fd >= 0)
			close(fd);
		return;
	}
	ssize_t n = pread(fd, head, sizeof(head) - 1, 0);
	interp[0] = '\0';
	if (n > 2 && head[0] == '#' && head[1] == '!') {
		head[n] = '\0';
		const char *p = (const char *)head + 2;
		p += strspn(p, " \t");
		size_t len = strcspn(p, " \t\n");
		if (len && len < sizeof(interp)) {
			memcpy(interp, p, len);
			interp[len] = '\0';
		}
	} else if (n >= (ssize_t)sizeof(Elf64_Ehdr) && memcmp(head, ELFMAG, SELFMAG) == 0 &&
		   head[EI_CLASS] == ELFCLASS64) {
		const Elf64_Ehdr *eh = (const Elf64_Ehdr *)head;
		for (unsigned i = 0; i < eh->e_phnum && !interp[0]; i++) {
			Elf64_Phdr ph;
			if (pread(fd, &ph, sizeof(ph), (off_t)(eh->e_phoff + (uint64_t)i * eh->e_phentsize)) !=
			    (ssize_t)sizeof(ph))
				break;
			if (ph.p_type == PT_INTERP && ph.p_filesz > 1 && ph.p_filesz < sizeof(interp) &&
			    pread(fd, interp, ph.p_filesz, (off_t)ph.p_offset) == (ssize_t)ph.p_filesz)
				interp[ph.p_filesz - 1] = '\0';
		}
	}
	close(fd);
	if (interp[0] == '/') {
		fprintf(out, "x %s\n", interp);
		record_interp(out, interp, depth + 1);
	}
}

/* Write the lookup of pid's stopped call (info) to out. A path that cannot be read (a bad
 * pointer: the call fails with EFAULT) is not written; an empty one with AT_EMPTY_PATH is
 * a call on a descriptor, not a lookup. */
static void record(FILE *out, pid_t pid, const struct __ptrace_syscall_info *info)
{
	const struct traced *t = traced_of((long)info->seccomp.nr);
	char path[PATH_MAX], dir[PATH_MAX];
	if (!t)
		return;
	if (t->flags_arg >= 0 && (info->seccomp.args[t->flags_arg] & O_ACCMODE) == O_WRONLY)
		return; /* written, not read */
	if (t->kind == 'd') {
		if (base_dir(pid, (long)info->seccomp.args[0], dir, sizeof(dir)) > 0)
			fprintf(out, "d %s\n", dir);
		return;
	}
	ssize_t n = read_string(pid, info->seccomp.args[t->path_arg], path, sizeof(path));
	if (n <= 0)
		return;
	char full[2 * PATH_MAX];
	if (path[0] == '/') {
		snprintf(full, sizeof(full), "%s", path);
	} else {
		long dirfd = t->dirfd_arg >= 0 ? (long)(int)info->seccomp.args[t->dirfd_arg]
					       : AT_FDCWD;
		if (base_dir(pid, dirfd, dir, sizeof(dir)) <= 0)
			return;
		snprintf(full, sizeof(full), "%s%s%s", dir, dir[1] ? "/" : "", path);
	}
	fprintf(out, "%c %s\n", t->kind, full);
	if (t->kind == 'x')
		record_interp(out, full, 0);
}

/* Run the child's side: be traced, filter, exec. Never returns. */
static void child(char **argv)
{
	if (ptrace(PTRACE_TRACEME, 0, NULL, NULL) != 0) {
		fprintf(stderr, "kcachefs-trace: ptrace refused: %s\n", strerror(errno));
		_exit(TRACE_FAILED);
	}
	raise(SIGSTOP); /* the tracer sets its options */
	if (install_filter() != 0) {
		fprintf(stderr, "kcachefs-trace: seccomp filter refused: %s\n", strerror(errno));
		_exit(TRACE_FAILED);
	}
	execv(argv[0], argv);
	fprintf(stderr, "kcachefs-trace: cannot run %s: %s\n", argv[0], strerror(errno));
	_exit(127);
}

int main(int argc, char **argv)
{
	if (argc < 3 || argv[2][0] != '/') {
		fprintf(stderr, "usage: kcachefs-trace OUT /ABSOLUTE/PROGRAM [ARGS...]\n");
		return 2;
	}
	int fd = open(argv[1], O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
	FILE *out = fd >= 0 ? fdopen(fd, "w") : NULL;
	if (!out) {
		fprintf(stderr, "kcachefs-trace: cannot create %s: %s\n", argv[1], strerror(errno));
		return TRACE_FAILED;
	}
	pid_t main_pid = fork();
	if (main_pid < 0) {
		fprintf(stderr, "kcachefs-trace: fork: %s\n", strerror(errno));
		return TRACE_FAILED;
	}
	if (main_pid == 0)
		child(argv + 2);

	int st;
	if (waitpid(main_pid, &st, __WALL) != main_pid || !WIFSTOPPED(st)) {
		/* the child could not be traced and said why */
		return WIFEXITED(st) ? WEXITSTATUS(st) : TRACE_FAILED;
	}
	if (ptrace(PTRACE_SETOPTIONS, main_pid, NULL,
		   PTRACE_O_TRACESECCOMP | PTRACE_O_TRACEFORK | PTRACE_O_TRACEVFORK |
			   PTRACE_O_TRACECLONE | PTRACE_O_TRACEEXEC | PTRACE_O_EXITKILL) != 0) {
		fprintf(stderr, "kcachefs-trace: ptrace options: %s\n", strerror(errno));
		kill(main_pid, SIGKILL);
		return TRACE_FAILED;
	}
	ptrace(PTRACE_CONT, main_pid, NULL, NULL);

	int result = TRACE_FAILED;
	for (;;) {
		pid_t pid = waitpid(-1, &st, __WALL);
		if (pid < 0) {
			if (errno == EINTR)
				continue;
			break; /* ECHILD: every tracee is gone */
		}
		if (WIFEXITED(st) || WIFSIGNALED(st)) {
			if (pid == main_pid)
				result = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
			continue;
		}
		if (!WIFSTOPPED(st))
			continue;
		int sig = WSTOPSIG(st), event = (unsigned)st >> 16, deliver = 0;
		if (sig == SIGTRAP && event == PTRACE_EVENT_SECCOMP) {
			struct __ptrace_syscall_info info;
			if (ptrace(PTRACE_GET_SYSCALL_INFO, pid, sizeof(info), &info) > 0 &&
			    info.op == PTRACE_SYSCALL_INFO_SECCOMP)
				record(out, pid, &info);
		} else if (sig == SIGTRAP && event) {
			/* fork, clone, exec: the new process is traced from its first stop */
		} else if (sig == SIGSTOP || sig == SIGTRAP) {
			/* a new tracee's first stop, or an exec's legacy trap */
		} else {
			deliver = sig;
		}
		ptrace(PTRACE_CONT, pid, NULL, (void *)(long)deliver);
	}
	if (fclose(out) != 0) {
		fprintf(stderr, "kcachefs-trace: cannot write %s: %s\n", argv[1], strerror(errno));
		return TRACE_FAILED;
	}
	return result;
}
