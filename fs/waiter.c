/* waiter.c - requests parked on a compile.
 *
 * The kernel.cubin of an entry whose recipe is staged but not yet compiled is looked up at
 * once, as a "pending" inode with attribute timeout 0 (so the kernel never uses its
 * placeholder size). Its getattr and open are the requests that wait: each is parked here
 * as a waiter on the entry's single flight and answered from the compile thread. So no FUSE
 * worker thread waits; every waiting process has its own request (the kernel merges
 * concurrent lookups of one name, not opens or getattrs), and a waiter whose process is
 * killed is answered EINTR within a sweep interval, while the others keep waiting.
 *
 * With a cluster store, the lookup of such a cubin is parked too, as long as its flight
 * may end in a fetch (a few milliseconds): it is answered with the published cubin, so its
 * readers see one inode, as on a warm node, and the kernel merges their lookups into one.
 * The lookup holds its directory's lock (shared) in the kernel, so it is answered with the
 * pending inode as soon as the flight compiles instead (kc_flight_compiling), or after
 * LOOKUP_PARK_MS in any case (a slow store, a wait on another node's lease).
 *
 * Under a kernel request timeout (fs.fuse.*_request_timeout, src/mount/reqtimeout.h) a request
 * kept past it aborts the whole mount; so a waiter parked for fs->request_budget seconds
 * is answered ETIMEDOUT by the sweeper, whatever it waits for (a compile queued behind
 * others, a compile waiting on another node's lease), and the compile goes on for the
 * next opener.
 */
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fs.h"
#include "log.h"
#include "reqtimeout.h"

#define SWEEP_INTERVAL_MS 100
#define LOOKUP_PARK_MS 200 /* a parked lookup's longest wait, plus up to a sweep interval */

enum waiter_kind { W_GETATTR, W_OPEN, W_LOOKUP };

struct req_waiter {
	struct kc_waiter base;
	fuse_req_t req;
	struct kc_fs *fs;
	struct kc_inode *in; /* the pending inode (a lookup: its entry directory); the kernel
			      * holds it while the request waits */
	enum waiter_kind kind; /* W_OPEN: fi is its file info */
	struct fuse_file_info fi;
	pid_t tid;           /* the waiting thread */
	int retries;         /* published cubins that were gone when opened */
	struct timespec parked_at; /* CLOCK_MONOTONIC */
	int expired;         /* set by the sweep: parked for fs->request_budget */
	int released;        /* set by the sweep: a lookup parked for LOOKUP_PARK_MS */
	kc_answer_lookup_fn *answer; /* a lookup's answer once it is not a fetched cubin */
};

/* Nonzero if thread tid is gone, or a signal is pending for it that will kill its process:
 * SIGKILL (the kernel turns every fatal signal with default action into it, except those
 * that dump core), or any pending signal that is not blocked, ignored or caught and whose
 * default action ends the process (core-dump signals such as SIGQUIT and SIGABRT). */
static int being_killed(pid_t tid)
{
	/* Signals whose default action is to continue, stop or ignore (signal(7)). */
	const unsigned long long harmless = 1ull << (SIGCHLD - 1) | 1ull << (SIGCONT - 1) |
					    1ull << (SIGSTOP - 1) | 1ull << (SIGTSTP - 1) |
					    1ull << (SIGTTIN - 1) | 1ull << (SIGTTOU - 1) |
					    1ull << (SIGURG - 1) | 1ull << (SIGWINCH - 1);
	unsigned long long pending = 0, blocked = 0, ignored = 0, caught = 0, mask;
	char path[64], line[256];

	snprintf(path, sizeof(path), "/proc/%d/status", (int)tid);
	FILE *f = fopen(path, "re");
	if (!f)
		return 1;
	while (fgets(line, sizeof(line), f)) {
		if (sscanf(line, "SigPnd: %llx", &mask) == 1 || sscanf(line, "ShdPnd: %llx", &mask) == 1)
			pending |= mask;
		else if (sscanf(line, "SigBlk: %llx", &mask) == 1)
			blocked = mask;
		else if (sscanf(line, "SigIgn: %llx", &mask) == 1)
			ignored = mask;
		else if (sscanf(line, "SigCgt: %llx", &mask) == 1)
			caught = mask;
	}
	fclose(f);
	if (pending & (1ull << (SIGKILL - 1)))
		return 1;
	return (pending & ~blocked & ~ignored & ~caught & ~harmless) != 0;
}

/* w was answered: forget it. */
static void waiter_free(struct req_waiter *w)
{
	__atomic_fetch_sub(&w->fs->parked, 1, __ATOMIC_RELAXED);
	free(w);
}

/* Queue w on its entry's compile, or answer it now if there is nothing to wait for. */
static void wait_or_answer(struct req_waiter *w)
{
	for (;;) {
		int r = kc_cache_lookup_cubin(&w->fs->cache, w->in->fd, &w->base, NULL);
		if (r == KC_PENDING)
			return;
		if (r < 0) {
			fuse_reply_err(w->req, -r);
			break;
		}
		r = w->kind == W_OPEN ? kc_reply_published_open(w->req, w->in, &w->fi)
				      : kc_reply_published_attr(w->req, w->in);
		if (r == 0)
			break;
		if (++w->retries > 3) { /* published and gone again, repeatedly */
			fuse_reply_err(w->req, EIO);
			break;
		}
	}
	waiter_free(w);
}

/* Answer the parked lookup w: the cubin, or a pending inode while its compile runs. While a
 * handover drains this daemon, a lookup whose flight compiles waits for the compile's end
 * instead: the pending inode's getattr and open would not be read here, and the compile,
 * left with no request in hand, would be dropped and done again by the next daemon. */
static void answer_lookup(struct req_waiter *w)
{
	if (w->base.fetch_only && __atomic_load_n(&w->fs->draining, __ATOMIC_SEQ_CST)) {
		uint64_t recipe_id;
		w->base.fetch_only = 0;
		w->released = 0;
		if (kc_cache_lookup_cubin(&w->fs->cache, w->in->fd, &w->base, &recipe_id) == KC_PENDING)
			return; /* queued for the compile's end */
	}
	w->answer(w->req, w->in);
	waiter_free(w);
}

static void ready(struct kc_waiter *base, int result)
{
	struct req_waiter *w = (struct req_waiter *)base;
	if (w->kind == W_LOOKUP && (result >= 0 || result == -EAGAIN || result == -EINPROGRESS)) {
		/* Fetched and published, or to be compiled: the cubin or a pending inode. */
		if (result >= 0 && w->base.fetch_only)
			atomic_fetch_add(&w->fs->cache.stats.remote_lookups, 1);
		answer_lookup(w);
		return;
	}
	if (result < 0 && result != -EAGAIN) {
		fuse_reply_err(w->req, -result);
		waiter_free(w);
		return;
	}
	/* Published (or the recipe changed under the compile): look again and answer. */
	wait_or_answer(w);
}

/* A new waiter for req on in, counted in fs->parked; NULL on ENOMEM. */
static struct req_waiter *waiter_new(fuse_req_t req, struct kc_inode *in, enum waiter_kind kind)
{
	struct req_waiter *w = calloc(1, sizeof(*w));
	if (!w)
		return NULL;
	w->base.done = ready;
	w->base.fetch_only = kind == W_LOOKUP;
	w->req = req;
	w->fs = fuse_req_userdata(req);
	w->in = in;
	w->kind = kind;
	w->tid = fuse_req_ctx(req)->pid;
	clock_gettime(CLOCK_MONOTONIC, &w->parked_at);
	__atomic_fetch_add(&w->fs->parked, 1, __ATOMIC_RELAXED);
	return w;
}

void kc_park(fuse_req_t req, struct kc_inode *pending, struct fuse_file_info *fi)
{
	/* A compile that reads a pending cubin would wait on itself, or on another compile
	 * waiting on it. Sandboxed ones were refused by their uid already; those that run as
	 * the daemon (compile_uids=daemon) are known by their process group. */
	struct kc_fs *fs = fuse_req_userdata(req);
	if (!fs->cfg.compile_uids && kc_compile_owns(fuse_req_ctx(req)->pid)) {
		kc_log(KC_LOG_INFO, "a compile asked for a kernel.cubin that is being compiled: "
		       "refused (EDEADLK)");
		return (void)fuse_reply_err(req, EDEADLK);
	}
	struct req_waiter *w = waiter_new(req, pending, fi ? W_OPEN : W_GETATTR);
	if (!w)
		return (void)fuse_reply_err(req, ENOMEM);
	if (fi)
		w->fi = *fi;
	wait_or_answer(w);
}

struct kc_waiter *kc_lookup_waiter(fuse_req_t req, struct kc_inode *entry,
				   kc_answer_lookup_fn *answer)
{
	struct req_waiter *w = waiter_new(req, entry, W_LOOKUP);
	if (!w)
		return NULL;
	w->answer = answer;
	return &w->base;
}

void kc_lookup_waiter_drop(struct kc_waiter *base)
{
	if (base)
		waiter_free((struct req_waiter *)base);
}

/* The kernel interrupts a request once, on the first signal. A waiter that survives the
 * signal keeps waiting (stat() on a local filesystem does not fail with EINTR); one whose
 * process is being killed, then or later, is let go. A waiter parked for the request
 * budget is let go too (expired set). Checked under the flight table's lock, so the
 * request cannot be answered meanwhile; arg is the monotonic time now. */
static int waiter_to_go(struct kc_waiter *base, void *arg)
{
	struct req_waiter *w = (struct req_waiter *)base;
	const struct timespec *now = arg;
	unsigned budget = w->fs->request_budget;
	long parked_ns = (now->tv_sec - w->parked_at.tv_sec) * 1000000000L +
			 (now->tv_nsec - w->parked_at.tv_nsec);
	if (w->base.fetch_only && parked_ns >= LOOKUP_PARK_MS * 1000000L) {
		w->released = 1;
		return 1;
	}
	if (budget && parked_ns >= (long)budget * 1000000000L) {
		w->expired = 1;
		return 1;
	}
	return fuse_req_interrupted(w->req) && being_killed(w->tid);
}

/* Answer w, parked too long for the kernel's request timeout, before that aborts the
 * mount. */
static void answer_expired(struct req_waiter *w)
{
	char label[512];
	kc_cache_entry_label(&w->fs->cache, w->in->fd, label, sizeof(label));
	kc_log(KC_LOG_WARN, "%s of %s/kernel.cubin (pid %d) answered ETIMEDOUT after %u s "
	       "waiting for its compile: the kernel aborts this mount when a request waits %u s "
	       "(sysctls fs.fuse.default_request_timeout and fs.fuse.max_request_timeout); set "
	       "them to 0 (off) or to at least %u and remount, for compiles that long",
	       w->kind == W_OPEN ? "open" : w->kind == W_LOOKUP ? "lookup" : "stat", label, (int)w->tid, w->fs->request_budget,
	       w->fs->cfg.request_timeout,
	       kc_reqtimeout_needed((w->fs->cfg.compile_timeout_asked
					     ? w->fs->cfg.compile_timeout_asked
					     : w->fs->cfg.compile_timeout) + 1));
	fuse_reply_err(w->req, ETIMEDOUT);
}

/* One sweep of the parked waiters, every SWEEP_INTERVAL_MS (the sweeper's tick). */
static long sweep_tick(void *arg)
{
	struct kc_fs *fs = arg;
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	struct kc_waiter *gone = kc_flight_sweep(&fs->cache.flights, waiter_to_go, &now);
	while (gone) {
		struct req_waiter *w = (struct req_waiter *)gone;
		gone = gone->next;
		if (w->released) {
			answer_lookup(w);
			continue;
		}
		if (w->expired)
			answer_expired(w);
		else
			fuse_reply_err(w->req, EINTR);
		waiter_free(w);
	}
	return SWEEP_INTERVAL_MS;
}

int kc_sweeper_start(struct kc_fs *fs)
{
	return kc_ticker_start(&fs->sweeper, SWEEP_INTERVAL_MS, sweep_tick, fs);
}

void kc_sweeper_stop(struct kc_fs *fs)
{
	kc_ticker_stop(&fs->sweeper);
}
