/* waiter.c - requests parked on a compile.
 *
 * The kernel.cubin of an entry whose recipe is staged but not yet compiled is looked up at
 * once, as a "pending" inode with attribute timeout 0 (so the kernel never uses its
 * placeholder size). Its getattr and open are the requests that wait: each is parked here
 * as a waiter on the entry's single flight and answered from the compile thread. So no FUSE
 * worker thread waits; every waiting process has its own request (the kernel merges
 * concurrent lookups of one name, not opens or getattrs), and a waiter whose process is
 * killed is answered EINTR at once, while the others keep waiting.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fs.h"
#include "log.h"

#define SWEEP_INTERVAL_NS 200000000L

struct req_waiter {
	struct kc_waiter base;
	fuse_req_t req;
	struct kc_fs *fs;
	struct kc_inode *in; /* the pending inode: the kernel holds it while the request waits */
	int open;            /* 1: an open (fi is its file info), 0: a getattr */
	struct fuse_file_info fi;
	pid_t tid;           /* the waiting thread */
};

/* Nonzero if thread tid is gone or has SIGKILL pending, i.e. its process is being killed (a
 * fatal signal with default action is turned into SIGKILL for every thread by the kernel). */
static int being_killed(pid_t tid)
{
	char path[64], line[256];
	int killed = 0;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)tid);
	FILE *f = fopen(path, "re");
	if (!f)
		return 1;
	while (fgets(line, sizeof(line), f)) {
		unsigned long long mask;
		if ((sscanf(line, "SigPnd: %llx", &mask) == 1 ||
		     sscanf(line, "ShdPnd: %llx", &mask) == 1) &&
		    (mask & (1ull << (9 - 1))))
			killed = 1;
	}
	fclose(f);
	return killed;
}

static void answer(struct req_waiter *w, int result)
{
	if (result < 0)
		fuse_reply_err(w->req, -result);
	else if (w->open)
		kc_reply_published_open(w->req, w->in, &w->fi);
	else
		kc_reply_published_attr(w->req, w->in);
	free(w);
}

static void ready(struct kc_waiter *base, int result);

/* Queue w on its entry's compile, or answer it now if there is nothing to wait for. */
static void wait_or_answer(struct req_waiter *w)
{
	int r = kc_cache_lookup_cubin(&w->fs->cache, w->in->fd, &w->base);
	if (r == KC_PENDING)
		return;
	fuse_req_interrupt_func(w->req, NULL, NULL);
	answer(w, r);
}

static void ready(struct kc_waiter *base, int result)
{
	struct req_waiter *w = (struct req_waiter *)base;
	if (result == -EAGAIN) /* the recipe changed under the compile: look again */
		return wait_or_answer(w);
	answer(w, result);
}

/* The kernel sends one interrupt per request. A dying process is let go now; one that may
 * survive the signal keeps waiting (stat() on a local filesystem does not fail with EINTR),
 * flagged so that the sweeper lets it go if it is killed later. */
static void interrupted(fuse_req_t req, void *data)
{
	struct req_waiter *w = data;
	struct kc_fs *fs = fuse_req_userdata(req);

	if (!being_killed(fuse_req_ctx(req)->pid)) {
		kc_flight_flag(&fs->cache.flights, &w->base);
		return;
	}
	if (kc_flight_cancel(&fs->cache.flights, &w->base)) {
		fuse_reply_err(req, EINTR);
		free(w);
	}
}

void kc_park(fuse_req_t req, struct kc_inode *pending, struct fuse_file_info *fi)
{
	struct req_waiter *w = calloc(1, sizeof(*w));
	if (!w)
		return (void)fuse_reply_err(req, ENOMEM);
	w->base.done = ready;
	w->req = req;
	w->fs = fuse_req_userdata(req);
	w->in = pending;
	w->open = fi != NULL;
	if (fi)
		w->fi = *fi;
	w->tid = fuse_req_ctx(req)->pid;
	/* Registered before the waiter is queued: an interrupt that comes first finds nothing
	 * to cancel, one that comes later finds it under the flight table's lock. */
	fuse_req_interrupt_func(req, interrupted, w);
	wait_or_answer(w);
}

static int killed_waiter(struct kc_waiter *base, void *arg)
{
	(void)arg;
	return being_killed(((struct req_waiter *)base)->tid);
}

static void *sweeper(void *arg)
{
	struct kc_fs *fs = arg;

	pthread_mutex_lock(&fs->sweep_lock);
	while (!fs->sweep_stop) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		ts.tv_nsec += SWEEP_INTERVAL_NS;
		if (ts.tv_nsec >= 1000000000L) {
			ts.tv_sec++;
			ts.tv_nsec -= 1000000000L;
		}
		pthread_cond_timedwait(&fs->sweep_cond, &fs->sweep_lock, &ts);
		pthread_mutex_unlock(&fs->sweep_lock);
		struct kc_waiter *gone = kc_flight_sweep(&fs->cache.flights, killed_waiter, NULL);
		while (gone) {
			struct req_waiter *w = (struct req_waiter *)gone;
			gone = gone->next;
			fuse_reply_err(w->req, EINTR);
			free(w);
		}
		pthread_mutex_lock(&fs->sweep_lock);
	}
	pthread_mutex_unlock(&fs->sweep_lock);
	return NULL;
}

int kc_sweeper_start(struct kc_fs *fs)
{
	pthread_mutex_init(&fs->sweep_lock, NULL);
	pthread_cond_init(&fs->sweep_cond, NULL);
	fs->sweep_stop = 0;
	int err = pthread_create(&fs->sweep_thread, NULL, sweeper, fs);
	fs->sweep_started = err == 0;
	return -err;
}

void kc_sweeper_stop(struct kc_fs *fs)
{
	if (!fs->sweep_started)
		return;
	pthread_mutex_lock(&fs->sweep_lock);
	fs->sweep_stop = 1;
	pthread_cond_signal(&fs->sweep_cond);
	pthread_mutex_unlock(&fs->sweep_lock);
	pthread_join(fs->sweep_thread, NULL);
	fs->sweep_started = 0;
}
