/* test_nvrtc_pool.c - the table of warm NVRTC workers (nvrtc_pool.h) with stand-in worker
 * processes (children that wait to be killed): one compile at a time per worker, the key
 * and the uid part of it, the least recently used idle worker stopped for room, idle
 * workers stopped, a uid's workers forgotten, and every stopped worker reaped and its
 * scratch directory removed. The real workers run in test_nvrtc_warm.py. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "nvrtc_pool.h"
#include "sandbox.h"
#include "tap.h"

/* A stand-in for kcachefs-nvrtc --serve: a child of its own group that waits. */
static void start(struct kc_nvrtc_worker *w)
{
	pid_t pid = fork();
	if (pid == 0) {
		setpgid(0, 0);
		for (;;)
			pause();
	}
	w->pid = pid;
}

/* pid was reaped by the table: no such child any more. */
static int reaped(pid_t pid)
{
	return waitpid(pid, NULL, WNOHANG) < 0 && errno == ECHILD;
}

static int dir_gone(const char *path)
{
	struct stat st;
	return stat(path, &st) != 0 && errno == ENOENT;
}

int main(void)
{
	char root[] = "/tmp/kc-test-nvrtc-pool.XXXXXX", why[256];
	struct kc_store s;
	if (!mkdtemp(root) || kc_store_open(&s, root, why, sizeof(why)) != 0) {
		CHECK(0, "a store for the scratch directories");
		return tap_done();
	}
	const uid_t me = KC_SANDBOX_AS_DAEMON;
	struct kc_nvrtc_pool *p = kc_nvrtc_pool_create(&s, 2, 3600);
	CHECK(p != NULL, "a table of two workers");

	CHECK(kc_nvrtc_pool_take(p, "A") == NULL, "no worker of a key yet");
	struct kc_nvrtc_worker *a = kc_nvrtc_pool_new(p, "A", me, why, sizeof(why));
	CHECK(a && a->scratch_fd >= 0 && !dir_gone(a->scratch), "a new worker has a scratch "
	      "directory of its own");
	start(a);
	pid_t a_pid = a->pid;
	char a_dir[sizeof(a->scratch)];
	snprintf(a_dir, sizeof(a_dir), "%s", a->scratch);
	CHECK(kc_nvrtc_pool_take(p, "A") == NULL, "a busy worker is not handed to a second "
	      "compile");
	kc_nvrtc_pool_put(p, a, 1);
	CHECK(kc_nvrtc_pool_take(p, "A") == a, "given back idle, it serves the next compile");
	CHECK(kc_nvrtc_pool_take(p, "B") == NULL, "nor is it handed to another key");
	kc_nvrtc_pool_put(p, a, 1);

	struct kc_nvrtc_worker *b = kc_nvrtc_pool_new(p, "B", 4242, why, sizeof(why));
	CHECK(b != NULL, "a second worker, of another uid");
	start(b);
	kc_nvrtc_pool_put(p, b, 1);
	unsigned alive;
	unsigned long started;
	kc_nvrtc_pool_counts(p, &alive, &started);
	CHECK(alive == 2 && started == 2, "two workers");

	/* Full: a third key stops the least recently used idle worker, A. */
	struct kc_nvrtc_worker *c = kc_nvrtc_pool_new(p, "C", me, why, sizeof(why));
	CHECK(c != NULL, "a third key gets room");
	start(c);
	CHECK(reaped(a_pid) && dir_gone(a_dir), "the least recently used idle worker was "
	      "killed, reaped and its directory removed");
	CHECK(kc_nvrtc_pool_take(p, "A") == NULL, "and is gone from the table");

	/* Full and all busy: no room. */
	CHECK(kc_nvrtc_pool_take(p, "B") == b, "B taken");
	CHECK(kc_nvrtc_pool_new(p, "D", me, why, sizeof(why)) == NULL && strstr(why, "busy"),
	      "with every worker busy there is no room, and why says so");
	kc_nvrtc_pool_put(p, b, 1);

	/* A failed compile's worker is stopped, not kept. */
	pid_t c_pid = c->pid;
	kc_nvrtc_pool_put(p, c, 0);
	CHECK(reaped(c_pid), "put without keep stops the worker");

	/* A worker that died while idle is not handed out. */
	pid_t b_pid = b->pid;
	kill(b_pid, SIGKILL);
	struct timespec pause_ts = {0, 20000000};
	siginfo_t info = {0};
	for (int i = 0; i < 3000; i++) { /* till it is a zombie, left for the table to reap */
		if (waitid(P_PID, (id_t)b_pid, &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
		    info.si_pid == b_pid)
			break;
		nanosleep(&pause_ts, NULL);
	}
	CHECK(kc_nvrtc_pool_take(p, "B") == NULL && reaped(b_pid), "a worker dead while idle is "
	      "reaped, not handed out");

	/* A uid's idle workers are forgotten when its processes were killed. */
	struct kc_nvrtc_worker *u = kc_nvrtc_pool_new(p, "U", 4343, why, sizeof(why));
	start(u);
	pid_t u_pid = u->pid;
	kc_nvrtc_pool_put(p, u, 1);
	kc_nvrtc_pool_forget_uid(p, 4242);
	CHECK(!reaped(u_pid), "another uid's worker stays");
	kc_nvrtc_pool_forget_uid(p, 4343);
	CHECK(reaped(u_pid) && kc_nvrtc_pool_take(p, "U") == NULL, "forget_uid stops that uid's "
	      "workers");
	kc_nvrtc_pool_destroy(p);

	/* Idle workers are stopped after idle_s by the table's own thread. */
	p = kc_nvrtc_pool_create(&s, 2, 1);
	struct kc_nvrtc_worker *i = kc_nvrtc_pool_new(p, "I", me, why, sizeof(why));
	start(i);
	pid_t i_pid = i->pid;
	kc_nvrtc_pool_put(p, i, 1);
	for (int n = 0; n < 3000 && !reaped(i_pid); n++) /* an event: the bound ends a broken run */
		nanosleep(&pause_ts, NULL);
	CHECK(reaped(i_pid), "an idle worker is stopped after the idle time");
	kc_nvrtc_pool_counts(p, &alive, &started);
	CHECK(alive == 0, "and leaves the table");
	struct kc_nvrtc_worker *j = kc_nvrtc_pool_new(p, "J", me, why, sizeof(why));
	start(j);
	pid_t j_pid = j->pid;
	kc_nvrtc_pool_destroy(p); /* busy, too */
	CHECK(reaped(j_pid), "destroy stops every worker, busy ones too");

	kc_store_close(&s);
	CHECK(kc_store_remove_tree(root) == 0, "test directory removed");
	return tap_done();
}
