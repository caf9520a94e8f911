/* test_sandbox.c - kc_sandbox_spawn, kc_sandbox_kill_uids and kc_sandbox_watch: identity,
 * namespaces, limits, descriptors, the directory check, each way a start can fail, and the
 * compile of a daemon that is killed. Run as root for the
 * identity checks (CI is); otherwise they are skipped. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sandbox.h"
#include "tap.h"

/* The uids the identity checks run as and kill: a range this test claims as a daemon does
 * (kc_sandbox_claim_uids), past the daemons' default ranges, so that a daemon running
 * beside the test never has a compile killed by it. */
#define UID_BASE (2147418112u + 100u * 256u) /* KC_DEFAULT_COMPILE_UIDS + 100 ranges */
static uid_t UID = UID_BASE;

static char out_path[64];

/* Run argv[0] in the sandbox with its output in out_path; returns the pid or -errno. */
static pid_t start(char *const argv[], uid_t uid, int ns, const char *const *dirs, int *bad_dir,
		   char *why, size_t whylen)
{
	char *const envp[] = {"PATH=/usr/bin:/bin", NULL};
	int out = open(out_path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	int cwd = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	struct kc_spawn sp = {
		.path = argv[0], .argv = argv, .envp = envp, .cwd_fd = cwd, .out_fd = out,
		.uid = uid, .gid = (gid_t)uid, .ns_flags = ns, .nice = 5, .dirs = dirs,
		.as = {RLIM_INFINITY, RLIM_INFINITY}, .fsize = {1 << 20, 1 << 20},
		.cpu = {100, 100}, .nofile = {64, 64},
	};
	pid_t pid = kc_sandbox_spawn(&sp, bad_dir, why, whylen);
	close(out);
	close(cwd);
	return pid;
}

static char *output(void)
{
	static char buf[4096];
	FILE *f = fopen(out_path, "re");
	size_t n = f ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
	buf[n] = '\0';
	if (f)
		fclose(f);
	return buf;
}

/* Processes of uid that still run (zombies, which only wait for their parent, do not),
 * only those named comm if comm is not NULL. */
static int running_of_uid(uid_t uid, const char *comm)
{
	char cmd[240];
	snprintf(cmd, sizeof(cmd), "ps -e -o uid=,stat=,comm= | awk '$1 == %u && $2 !~ /^Z/%s%s%s' "
		 "| wc -l", (unsigned)uid, comm ? " && $3 == \"" : "", comm ? comm : "",
		 comm ? "\"" : "");
	FILE *f = popen(cmd, "r");
	int n = -1;
	if (f && fscanf(f, "%d", &n) != 1)
		n = -1;
	if (f)
		pclose(f);
	return n;
}

static int live_of_uid(uid_t uid)
{
	return running_of_uid(uid, NULL);
}

/* Nonzero once uid runs exactly the three sleeps of daemon_with_compile's compile and no
 * other process: the shell that starts them forks and execs on the way (setsid -f), so a
 * count of its processes alone passes through 3 before it settles there. */
static int compile_settled(uid_t uid)
{
	return running_of_uid(uid, "sleep") == 3 && live_of_uid(uid) == 3;
}

static int exit_status(pid_t pid)
{
	int status = -1;
	while (pid > 0 && waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	return status;
}

/* A thread that starts a sleep as the uid at arg, and exits without waiting for it. */
static void *start_and_go(void *arg)
{
	char why[256];
	int bad_dir;
	char *const nap[] = {"/bin/sleep", "1000.4244", NULL};
	static pid_t pid;
	pid = start(nap, *(uid_t *)arg, 0, NULL, &bad_dir, why, sizeof(why));
	return &pid;
}

/* A daemon, forked here: it claims the uid claim, starts a watcher holding that claim and
 * the groups in shared memory, then starts a compile as uid (a shell with a child in its
 * group, one that left it, and itself a sleep), and waits to be killed. Returns its pid
 * (or -1) once the three processes of uid run, or after 10 s. */
static pid_t daemon_with_compile(uid_t uid, int ns, uid_t claim)
{
	pid_t *groups = mmap(NULL, sizeof(pid_t), PROT_READ | PROT_WRITE,
			     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (groups == MAP_FAILED)
		return -1;
	*groups = 0;
	pid_t d = fork();
	if (d == 0) {
		char why[256];
		int bad_dir, fd = kc_sandbox_claim_uids(claim, 1);
		if (fd < 0 || kc_sandbox_watch(uid, 1, groups, 1, fd, NULL) != 0)
			_exit(1);
		close(fd); /* the watcher holds the claim */
		char *const tools[] = {"/bin/sh", "-c", "sleep 1000.4243 & setsid -f sleep 1000.4243;"
				       " exec sleep 1000.4243", NULL};
		pid_t pid = start(tools, uid, ns, NULL, &bad_dir, why, sizeof(why));
		*groups = pid;
		for (;;)
			pause();
	}
	for (int i = 0; d > 0 && i < 1000 && !compile_settled(uid); i++)
		usleep(10000);
	munmap(groups, sizeof(pid_t));
	return d;
}

int main(void)
{
	char why[512];
	int bad_dir;
	int root = geteuid() == 0;

	snprintf(out_path, sizeof(out_path), "/tmp/kc-test-sandbox.%d", (int)getpid());
	/* a descriptor of the daemon's without O_CLOEXEC, as libraries leave them */
	int leaky = open("/dev/null", O_RDONLY);
	CHECK(leaky >= 0 && dup2(leaky, 100) == 100, "a descriptor without O_CLOEXEC at 100");

	int uids_claim = -EBUSY;
	for (unsigned k = 0; root && k < 64 && uids_claim == -EBUSY; k++)
		if ((uids_claim = kc_sandbox_claim_uids(UID_BASE + k * 256u, 256)) >= 0)
			UID = UID_BASE + k * 256u;
	if (root)
		CHECK(uids_claim >= 0, "claim_uids: a range of the test's own");

	char why_ns[200] = "";
	int ns = root ? kc_sandbox_namespaces(why_ns, sizeof(why_ns)) : 0;
	if (root)
		CHECK(ns != 0, "namespaces: root gets network and IPC namespaces");
	char *const inspect[] = {"/bin/sh", "-c",
		"echo uid=$(id -u) groups=$(id -G) nofile=$(ulimit -n) fsize=$(ulimit -f) "
		"nice=$(nice) pgid=$(ps -o pgid= $$ | tr -d ' ') pid=$$; "
		"echo net=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '); "
		"echo fds=$(ls /proc/self/fd | tr '\\n' ' ')", NULL};
	pid_t pid = start(inspect, root ? UID : KC_SANDBOX_AS_DAEMON, ns, NULL, &bad_dir, why,
			  sizeof(why));
	int status = exit_status(pid);
	char *out = output();
	CHECK(pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0, "spawn: the program ran");
	char want[200];
	if (root) {
		snprintf(want, sizeof(want), "uid=%u groups=%u ", UID, UID);
		CHECK(strstr(out, want), "identity: its own uid, its gid, no other group");
		CHECK(strstr(out, "net=lo\n"), "network: only a loopback of its own");
	} else {
		CHECK(1, "identity and network # SKIP not root");
	}
	CHECK(strstr(out, "nofile=64 ") && strstr(out, "fsize=2048 ") && strstr(out, "nice=5 "),
	      "limits and nice value are set before the program starts");
	snprintf(want, sizeof(want), "pgid=%d pid=%d", (int)pid, (int)pid);
	CHECK(strstr(out, want), "process group: its own, which it leads");
	CHECK(strstr(out, "fds=0 1 2 3\n"), "descriptors: stdin, stdout, stderr only (3 is ls's)");
	if (!strstr(out, "fds=0 1 2 3\n") || !strstr(out, "nofile=64"))
		printf("# output: %s\n", out);

	char *const missing[] = {"/nonexistent/kc-compiler", NULL};
	pid = start(missing, KC_SANDBOX_AS_DAEMON, 0, NULL, &bad_dir, why, sizeof(why));
	CHECK(pid == -ENOENT && bad_dir == -1 && strstr(why, "cannot run /nonexistent/kc-compiler"),
	      "exec failure: -ENOENT, why names the program");

	char *const t[] = {"/bin/true", NULL};
	const char *const dirs[] = {"/usr", "/nonexistent-kc-dir", NULL};
	pid = start(t, KC_SANDBOX_AS_DAEMON, 0, dirs, &bad_dir, why, sizeof(why));
	CHECK(pid == -ENOENT && bad_dir == 1 && strncmp(why, "/nonexistent-kc-dir: ", 21) == 0,
	      "directories: a missing one is -ENOENT, with its index and name");
	const char *const file[] = {"/etc/passwd", NULL};
	pid = start(t, KC_SANDBOX_AS_DAEMON, 0, file, &bad_dir, why, sizeof(why));
	CHECK(pid == -ENOTDIR && bad_dir == 0, "directories: a file is -ENOTDIR");
	if (root) {
		const char *const closed[] = {"/root/.", NULL};
		pid = start(t, UID, ns, closed, &bad_dir, why, sizeof(why));
		CHECK(pid == -EACCES && bad_dir == 0, "directories: checked as the uid (/root: EACCES)");
		char searchless[] = "/tmp/kc-test-sandbox-dir.XXXXXX"; /* 0700, in an open parent */
		const char *const there[] = {mkdtemp(searchless), NULL};
		pid = start(t, UID, ns, there, &bad_dir, why, sizeof(why));
		CHECK(there[0] && pid == -EACCES && bad_dir == 0,
		      "directories: one the uid may see but not search is EACCES");
		rmdir(searchless);
	}

	if (root) {
		/* a process of the uid that left the group: only kc_sandbox_kill_uids ends it */
		char *const away[] = {"/usr/bin/setsid", "-f", "/bin/sleep", "1000.4242", NULL};
		pid = start(away, UID + 1, ns, NULL, &bad_dir, why, sizeof(why));
		exit_status(pid);
		for (int i = 0; i < 100 && live_of_uid(UID + 1) != 1; i++)
			usleep(10000);
		CHECK(live_of_uid(UID + 1) == 1, "kill_uids: the process left the group and runs");
		CHECK(kc_sandbox_count_uids(UID, 2) == 1 && kc_sandbox_count_uids(UID, 1) == 0,
		      "count_uids: that one, in its uid only");
		kc_sandbox_kill_uids(UID + 1, 1);
		for (int i = 0; i < 100 && live_of_uid(UID + 1) != 0; i++)
			usleep(10000);
		CHECK(live_of_uid(UID + 1) == 0 && kc_sandbox_count_uids(UID, 2) == 0,
		      "kill_uids: none is left");
		kc_sandbox_kill_uids(0, 1);
		kc_sandbox_kill_uids(KC_SANDBOX_AS_DAEMON, 1);
		CHECK(kill(getpid(), 0) == 0, "kill_uids: the caller lives");
	}
	if (root) {
		/* the compiler dies with the thread that started it: its death signal is set after
		 * its change of uid, which clears one set before */
		pthread_t th;
		void *got = NULL;
		uid_t as = UID + 3;
		if (pthread_create(&th, NULL, start_and_go, &as) == 0)
			pthread_join(th, &got);
		pid_t napper = got ? *(pid_t *)got : -1;
		int status = -1;
		for (int i = 0; napper > 0 && i < 1000 && waitpid(napper, &status, WNOHANG) == 0; i++)
			usleep(10000);
		if (napper > 0 && status == -1) { /* still runs after 10 s */
			kill(napper, SIGKILL);
			exit_status(napper);
		}
		CHECK(napper > 0 && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
		      "pdeathsig: the compiler of a thread that ended is killed, as its uid");
		kc_sandbox_kill_uids(UID + 3, 1); /* on failure */
	}
	if (root) {
		/* a daemon SIGKILLed with a compile running: its watcher ends every process of
		 * the compile (the shell, its child, the one that left the group), then lets the
		 * daemon's claim go */
		uid_t claim = UID + 201 * 256;
		pid_t d = daemon_with_compile(UID + 2, ns, claim);
		CHECK(d > 0 && compile_settled(UID + 2),
		      "watch: a daemon with a watcher runs a compile of three processes");
		CHECK(kc_sandbox_claim_uids(claim, 1) == -EBUSY, "watch: the daemon's claim is held");
		if (d > 0) {
			kill(d, SIGKILL);
			exit_status(d);
		}
		int fd = -EBUSY;
		for (int i = 0; i < 1000 && (live_of_uid(UID + 2) != 0 || fd < 0); i++) {
			usleep(10000);
			if (fd < 0)
				fd = kc_sandbox_claim_uids(claim, 1);
		}
		CHECK(d > 0 && live_of_uid(UID + 2) == 0,
		      "watch: no process of the compile outlives the killed daemon");
		CHECK(fd > 0, "watch: the claim is free once the watcher is done");
		if (fd > 0)
			close(fd);
		kc_sandbox_kill_uids(UID + 2, 1); /* on failure */
	}
	if (root) {
		uid_t far = UID + 200 * 256; /* no daemon's default range */
		int a = kc_sandbox_claim_uids(far, 256);
		int b = kc_sandbox_claim_uids(far, 256);
		int c = kc_sandbox_claim_uids(far + 100, 256);
		int d = kc_sandbox_claim_uids(far - 255, 256);
		int e = kc_sandbox_claim_uids(far + 256, 256);
		CHECK(a > 0 && b == -EBUSY, "claim_uids: a range held is -EBUSY to the next claim");
		CHECK(c == -EBUSY && d == -EBUSY, "claim_uids: so is a range that overlaps it");
		CHECK(e > 0, "claim_uids: the range after it is free");
		close(a);
		close(e);
		b = kc_sandbox_claim_uids(far, 256);
		CHECK(b > 0, "claim_uids: free again once the holder closes it");
		close(b);
		char who[100];
		CHECK(kc_sandbox_id_taken(0, who, sizeof(who)) && strstr(who, "'root'") &&
			      !kc_sandbox_id_taken(UID + 200 * 256, who, sizeof(who)),
		      "id_taken: root's uid is taken, one of the ranges is not");
	}
	unlink(out_path);
	close(leaky);
	close(100);
	return tap_done();
}
