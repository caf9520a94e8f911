/* nvrtc_pool.c - see nvrtc_pool.h */
#define _GNU_SOURCE
#include "nvrtc_pool.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "sandbox.h"
#include "util.h"

struct kc_nvrtc_pool {
	pthread_mutex_t lock;
	pthread_cond_t cond;         /* the reaper's wake-up (CLOCK_MONOTONIC) */
	struct kc_store *store;
	unsigned max, idle_s, alive;
	unsigned long started;
	struct kc_nvrtc_worker *list; /* most recently used first */
	int reaper_running, stopping;
	pthread_t reaper;
};

/* Kill w's process group, reap it, remove its directory, free it. w is off the list. */
static void stop(struct kc_nvrtc_worker *w, const char *why)
{
	if (w->pid > 0) {
		kill(-w->pid, SIGKILL);
		kill(w->pid, SIGKILL);
		while (waitpid(w->pid, NULL, 0) < 0 && errno == EINTR)
			;
		kc_log(KC_LOG_INFO, "NVRTC worker pid %d (compile uid %d) stopped after %lu "
		       "compiles: %s", (int)w->pid, w->uid == KC_SANDBOX_AS_DAEMON ? -1 : (int)w->uid,
		       w->served, why);
	}
	if (w->sock >= 0)
		close(w->sock);
	if (w->log_fd >= 0)
		close(w->log_fd);
	if (w->scratch_fd >= 0) {
		close(w->scratch_fd);
		kc_store_remove_tree(w->scratch);
	}
	free(w->key);
	free(w);
}

/* Take w off the list (lock held). */
static void unlink_worker(struct kc_nvrtc_pool *p, struct kc_nvrtc_worker *w)
{
	for (struct kc_nvrtc_worker **pp = &p->list; *pp; pp = &(*pp)->next)
		if (*pp == w) {
			*pp = w->next;
			p->alive--;
			return;
		}
}

/* Stops the workers idle for idle_s, then sleeps till the next one's time. */
static void *reaper_main(void *arg)
{
	struct kc_nvrtc_pool *p = arg;
	pthread_mutex_lock(&p->lock);
	while (!p->stopping) {
		double now = kc_mono_s(), next = now + p->idle_s;
		struct kc_nvrtc_worker *gone = NULL;
		for (struct kc_nvrtc_worker **pp = &p->list; *pp;) {
			struct kc_nvrtc_worker *w = *pp;
			if (!w->busy && w->idle_since + p->idle_s <= now) {
				*pp = w->next;
				p->alive--;
				w->next = gone;
				gone = w;
				continue;
			}
			if (!w->busy && w->idle_since + p->idle_s < next)
				next = w->idle_since + p->idle_s;
			pp = &w->next;
		}
		if (gone) { /* stopped without the lock: a reap waits for the kernel */
			pthread_mutex_unlock(&p->lock);
			char why[64];
			snprintf(why, sizeof(why), "idle for %u s", p->idle_s);
			while (gone) {
				struct kc_nvrtc_worker *w = gone;
				gone = w->next;
				stop(w, why);
			}
			pthread_mutex_lock(&p->lock);
			continue;
		}
		struct timespec ts;
		double at = next + 0.01;
		ts.tv_sec = (time_t)at;
		ts.tv_nsec = (long)((at - (double)ts.tv_sec) * 1e9);
		pthread_cond_timedwait(&p->cond, &p->lock, &ts);
	}
	pthread_mutex_unlock(&p->lock);
	return NULL;
}

struct kc_nvrtc_pool *kc_nvrtc_pool_create(struct kc_store *store, unsigned max,
					   unsigned idle_s)
{
	struct kc_nvrtc_pool *p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	pthread_mutex_init(&p->lock, NULL);
	kc_cond_init_mono(&p->cond);
	p->store = store;
	p->max = max ? max : 1;
	p->idle_s = idle_s ? idle_s : 1;
	return p;
}

void kc_nvrtc_pool_destroy(struct kc_nvrtc_pool *p)
{
	if (!p)
		return;
	pthread_mutex_lock(&p->lock);
	p->stopping = 1;
	struct kc_nvrtc_worker *list = p->list;
	p->list = NULL;
	p->alive = 0;
	pthread_cond_broadcast(&p->cond);
	int joined = p->reaper_running;
	pthread_mutex_unlock(&p->lock);
	if (joined)
		pthread_join(p->reaper, NULL);
	while (list) {
		struct kc_nvrtc_worker *w = list;
		list = w->next;
		stop(w, "the mount ends");
	}
	pthread_cond_destroy(&p->cond);
	pthread_mutex_destroy(&p->lock);
	free(p);
}

/* 0 while w's process lives; else it is reaped (status into *status) and 1. */
static int gone_while_idle(struct kc_nvrtc_worker *w, int *status)
{
	pid_t r;
	while ((r = waitpid(w->pid, status, WNOHANG)) < 0 && errno == EINTR)
		;
	return r == w->pid;
}

struct kc_nvrtc_worker *kc_nvrtc_pool_take(struct kc_nvrtc_pool *p, const char *key)
{
	pthread_mutex_lock(&p->lock);
	struct kc_nvrtc_worker *w = p->list;
	for (; w; w = w->next)
		if (!w->busy && strcmp(w->key, key) == 0)
			break;
	if (w) {
		int status = 0;
		if (gone_while_idle(w, &status)) {
			unlink_worker(p, w);
			pthread_mutex_unlock(&p->lock);
			char why[96];
			snprintf(why, sizeof(why), "it had %s %d while idle",
				 WIFSIGNALED(status) ? "been killed by signal" : "exited with status",
				 WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
			w->pid = -w->pid; /* reaped: stop() only cleans up */
			kc_log(KC_LOG_WARN, "NVRTC worker pid %d: %s; another one starts", -w->pid,
			       why);
			stop(w, why);
			return NULL;
		}
		w->busy = 1;
		unlink_worker(p, w); /* to the front: most recently used */
		w->next = p->list;
		p->list = w;
		p->alive++;
	}
	pthread_mutex_unlock(&p->lock);
	return w;
}

struct kc_nvrtc_worker *kc_nvrtc_pool_new(struct kc_nvrtc_pool *p, const char *key, uid_t uid,
					  char *why, size_t whylen)
{
	struct kc_nvrtc_worker *w = calloc(1, sizeof(*w)), *evict = NULL;
	if (!w || !(w->key = strdup(key))) {
		free(w);
		snprintf(why, whylen, "out of memory");
		return NULL;
	}
	w->sock = w->log_fd = w->scratch_fd = -1;
	w->uid = uid;
	w->busy = 1;
	pthread_mutex_lock(&p->lock);
	if (p->alive >= p->max) {
		for (struct kc_nvrtc_worker *o = p->list; o; o = o->next)
			if (!o->busy)
				evict = o; /* the last idle one: least recently used */
		if (!evict) {
			pthread_mutex_unlock(&p->lock);
			snprintf(why, whylen, "all %u NVRTC workers are busy", p->max);
			free(w->key);
			free(w);
			return NULL;
		}
		unlink_worker(p, evict);
	}
	w->next = p->list;
	p->list = w;
	p->alive++;
	p->started++;
	if (!p->reaper_running && pthread_create(&p->reaper, NULL, reaper_main, p) == 0)
		p->reaper_running = 1;
	pthread_mutex_unlock(&p->lock);
	if (evict)
		stop(evict, "its room was needed (the least recently used of the workers)");
	int fd = kc_store_scratch(p->store, w->scratch, sizeof(w->scratch));
	if (fd < 0 || (uid != KC_SANDBOX_AS_DAEMON && fchown(fd, uid, (gid_t)uid) != 0)) {
		snprintf(why, whylen, "cannot make its scratch directory: %s",
			 strerror(fd < 0 ? -fd : errno));
		if (fd >= 0) {
			close(fd);
			kc_store_remove_tree(w->scratch);
		}
		kc_nvrtc_pool_put(p, w, 0);
		return NULL;
	}
	w->scratch_fd = fd;
	return w;
}

void kc_nvrtc_pool_put(struct kc_nvrtc_pool *p, struct kc_nvrtc_worker *w, int keep)
{
	pthread_mutex_lock(&p->lock);
	if (keep && !p->stopping) {
		w->busy = 0;
		w->idle_since = kc_mono_s();
		pthread_cond_broadcast(&p->cond);
		pthread_mutex_unlock(&p->lock);
		return;
	}
	if (!p->stopping)
		unlink_worker(p, w);
	pthread_mutex_unlock(&p->lock);
	stop(w, "its compile failed, or it was retired");
}

void kc_nvrtc_pool_forget_uid(struct kc_nvrtc_pool *p, uid_t uid)
{
	struct kc_nvrtc_worker *gone = NULL;
	if (!p || uid == KC_SANDBOX_AS_DAEMON)
		return;
	pthread_mutex_lock(&p->lock);
	for (struct kc_nvrtc_worker **pp = &p->list; *pp;) {
		struct kc_nvrtc_worker *w = *pp;
		if (w->uid == uid && !w->busy) {
			*pp = w->next;
			p->alive--;
			w->next = gone;
			gone = w;
		} else {
			pp = &w->next;
		}
	}
	pthread_mutex_unlock(&p->lock);
	while (gone) {
		struct kc_nvrtc_worker *w = gone;
		gone = w->next;
		stop(w, "every process of its uid was killed at the end of a compile of that uid");
	}
}

void kc_nvrtc_pool_counts(struct kc_nvrtc_pool *p, unsigned *alive, unsigned long *started)
{
	pthread_mutex_lock(&p->lock);
	*alive = p->alive;
	*started = p->started;
	pthread_mutex_unlock(&p->lock);
}
