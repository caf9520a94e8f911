/* cache.c - see cache.h (and cache_i.h for what the hub's files share) */
#define _GNU_SOURCE
#include "cache_i.h"

#include <errno.h>
#include <fcntl.h>
#include <search.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "key.h"
#include "log.h"

int kc_cache_init(struct kc_cache *c, const struct kc_config *cfg, struct kc_store *store,
		  struct kc_remote_tier *remote)
{
	memset(c, 0, sizeof(*c));
	c->cfg = cfg;
	c->store = store;
	kc_flight_table_init(&c->flights);
	pthread_mutex_init(&c->publish_lock, NULL);
	pthread_mutex_init(&c->verified_lock, NULL);
	pthread_mutex_init(&c->holdoff_lock, NULL);
	pthread_mutex_init(&c->shares_lock, NULL);
	c->remote = remote;
	kc_slots_init(&c->slots, cfg->jobs);
	c->tree_memo = kc_tree_memo_new(KC_TREE_MEMO_DAEMON);
	c->pool = kc_pool_create(cfg->jobs + (remote ? KC_REMOTE_WAITERS : 0));
	if (!c->pool)
		return -errno;
	if (remote && !(c->shares = kc_pool_create(cfg->jobs)))
		return -errno;
	kc_cache_ahead_open(c); /* a failure is said; the mount goes on without it */
	/* at most one warm NVRTC worker per job slot: each serves one compile at a time */
	if (cfg->nvrtc && !cfg->nvrtc_cold &&
	    !(c->nvrtc = kc_nvrtc_pool_create(store, cfg->jobs ? cfg->jobs : 1,
					      cfg->nvrtc_idle ? cfg->nvrtc_idle
							      : KC_NVRTC_IDLE_DEFAULT)))
		kc_log(KC_LOG_WARN, "no warm NVRTC workers (out of memory): a process per compile");
	return 0;
}

unsigned kc_cache_settle(struct kc_cache *c, double timeout_s)
{
	return c->shares ? kc_pool_wait_idle(c->shares, timeout_s > 0 ? timeout_s : 0) : 0;
}

void kc_cache_stop(struct kc_cache *c)
{
	if (c->stopped)
		return;
	__atomic_store_n(&c->stopped, 1, __ATOMIC_SEQ_CST);
	kc_cache_ahead_stop(c); /* no compile ahead starts from here on */
	kc_compile_stop_demand(); /* dependency passes, the shares', run on */
	if (c->remote)
		kc_remote_tier_stop(c->remote); /* compiles waiting on other nodes go on here */
	if (c->pool)
		kc_pool_destroy(c->pool);
	c->pool = NULL;
	kc_cache_ahead_drain(c); /* its workers, which may queue shares too */
}

unsigned kc_cache_cut_shares(struct kc_cache *c, double grace_s)
{
	atomic_store(&c->shares_cut, 1);
	kc_compile_shutdown(); /* the dependency passes still running */
	unsigned left = kc_cache_settle(c, grace_s);
	if (!left)
		return 0;
	pthread_mutex_lock(&c->shares_lock);
	for (struct compile_job *j = c->shares_in_hand; j; j = j->share_next)
		kc_log(KC_LOG_WARN, "cluster store: %s not shared: the daemon stopped while its "
		       "share waited on the store (-o stop_timeout=%u); its lease expires",
		       j->label, c->cfg->stop_timeout);
	pthread_mutex_unlock(&c->shares_lock);
	return left;
}

void kc_cache_shutdown(struct kc_cache *c)
{
	kc_cache_stop(c);
	atomic_store(&c->shares_cut, 1);
	kc_compile_shutdown(); /* the dependency passes still running too */
	if (c->shares)
		kc_pool_destroy(c->shares); /* after the compiles, which queue shares */
	c->shares = NULL;
	kc_cache_ahead_close(c); /* after the shares, whose history puts read it */
	kc_nvrtc_pool_destroy(c->nvrtc); /* after the compiles: none is busy now */
	c->nvrtc = NULL;
	kc_slots_destroy(&c->slots);
	tdestroy(c->verified, free);
	c->verified = NULL;
	while (c->holdoffs) {
		struct holdoff *h = c->holdoffs;
		c->holdoffs = h->next;
		free(h);
	}
	kc_flight_table_destroy(&c->flights);
	kc_tree_memo_free(c->tree_memo);
	c->tree_memo = NULL;
}

struct recheck_arg {
	int entry_fd;
};

static int recheck_published(void *arg)
{
	struct recheck_arg *r = arg;
	struct stat st;
	return fstatat(r->entry_fd, KC_CUBIN_NAME, &st, AT_SYMLINK_NOFOLLOW) == 0 ? KC_FLIGHT_DONE
										   : 0;
}

uint64_t kc_recipe_id(const char *recipe_hex)
{
	uint64_t id = 0;
	for (int i = 0; i < 16 && recipe_hex[i]; i++) {
		char ch = recipe_hex[i];
		id = id << 4 | (uint64_t)(ch <= '9' ? ch - '0' : ch - 'a' + 10);
	}
	return id;
}

uint64_t kc_cache_cubin_recipe_id(int fd)
{
	struct kc_record rec;
	if (kc_record_read(fd, &rec) != 0 || !rec.recipe[0])
		return 0;
	return kc_recipe_id(rec.recipe);
}

int kc_cache_lookup_cubin(struct kc_cache *c, int entry_fd, struct kc_waiter *w,
			  uint64_t *recipe_id)
{
	struct stat est;
	char label[512];

	if (fstat(entry_fd, &est) != 0)
		return -errno;
	for (int attempt = 0; attempt < 4; attempt++) {
		int err = kc_cache_check_published(c, entry_fd);
		if (err == 0) {
			atomic_fetch_add(&c->stats.hits, 1);
			return 0;
		}
		if (kc_log_enabled(KC_LOG_DEBUG)) {
			kc_cache_entry_label(c, entry_fd, label, sizeof(label));
			kc_log(KC_LOG_DEBUG, "%s: kernel.cubin not published", label);
		}
		if (err != -ENOENT)
			return err;
		/* A request that waits (w) on a compile already in flight joins it without
		 * loading the recipe (a joining node's 8 readers of one kernel park 2 requests
		 * each): the leader loaded and checked it, a recipe changed since makes the
		 * flight publish nothing (-EAGAIN: its waiters come back here), and what it
		 * publishes is checked against the recipe (kc_cache_check_published) before any
		 * waiter is answered. */
		struct kc_flight_key running = {est.st_dev, est.st_ino};
		if (w && !recipe_id &&
		    kc_flight_join_running(&c->flights, &running, w) == KC_FLIGHT_JOINED) {
			atomic_fetch_add(&c->stats.waits, 1);
			return KC_PENDING;
		}

		/* A stat of the compiler per miss: a replaced one is not taken for the one whose
		 * rejections and cubins are recorded (its own are looked up instead). */
		kc_cache_compiler_check(c);
		struct compile_job *j = calloc(1, sizeof(*j));
		if (!j)
			return -ENOMEM;
		j->share_fd = -1;
		err = kc_recipe_load(entry_fd, c->cfg, &j->recipe);
		if (err) {
			free(j);
			if (err == -ENOENT) /* a refusal since the last stage: kernel.log says why */
				return kc_store_is_refused(entry_fd) ? -EIO : -ENOENT;
			kc_cache_entry_label(c, entry_fd, label, sizeof(label));
			kc_log(KC_LOG_WARN, "%s: cannot read recipe: %s", label, strerror(-err));
			return -EIO;
		}
		if (c->cfg->verify_keys) { /* also what came in by a directory rename */
			char why[400], name[256];
			kc_cache_entry_label(c, entry_fd, label, sizeof(label));
			int named = kc_cache_entry_name(c, entry_fd, name) == 0;
			if (!named)
				snprintf(why, sizeof(why), "its path is too long to check its key");
			if (!named ||
			    kc_key_names(name, j->recipe.source, j->recipe.source_len, j->recipe.flags,
					 j->recipe.flags_len, why, sizeof(why)) != 1) {
				kc_log(KC_LOG_WARN, "%s: not compiled: %s", label, why);
				kc_recipe_free(&j->recipe);
				free(j);
				atomic_fetch_add(&c->stats.rejected_lookups, 1);
				return -EIO;
			}
		}
		struct kc_flight_key key = {est.st_dev, est.st_ino};
		if (kc_store_rejection(entry_fd, j->recipe.hash, &j->rejection) ||
		    kc_cache_held_off(c, &key, j->recipe.hash)) {
			kc_recipe_free(&j->recipe);
			free(j);
			atomic_fetch_add(&c->stats.rejected_lookups, 1);
			return -EIO;
		}
		struct recheck_arg ra = {entry_fd};
		int r = kc_flight_join(&c->flights, &key, w, recheck_published, &ra);
		if (recipe_id && (r == KC_FLIGHT_JOINED || r == KC_FLIGHT_LEADER))
			*recipe_id = kc_recipe_id(j->recipe.hash);
		if (r != KC_FLIGHT_LEADER) {
			kc_recipe_free(&j->recipe);
			free(j);
		}
		if (r == KC_FLIGHT_JOINED) {
			if (w)
				atomic_fetch_add(&c->stats.waits, 1);
			return KC_PENDING;
		}
		if (r < 0)
			return r;
		if (r != KC_FLIGHT_LEADER)
			continue; /* published meanwhile: verify it */
		atomic_fetch_add(&c->stats.misses, 1);
		if (kc_log_enabled(KC_LOG_DEBUG)) {
			kc_cache_entry_label(c, entry_fd, label, sizeof(label));
			kc_log(KC_LOG_DEBUG, "%s: compile queued (recipe %.16s)", label, j->recipe.hash);
		}
		j->c = c;
		j->key = key;
		j->slots = kc_cache_job_slots(c);
		j->entry_fd = fcntl(entry_fd, F_DUPFD_CLOEXEC, 0);
		if (j->entry_fd < 0 || kc_pool_submit(c->pool, kc_cache_compile_job, j) != 0) {
			if (j->entry_fd >= 0)
				close(j->entry_fd);
			kc_recipe_free(&j->recipe);
			free(j);
			kc_flight_finish(&c->flights, &key, -EIO);
		}
		return KC_PENDING;
	}
	return -EIO;
}

void kc_cache_gauges(struct kc_cache *c, struct kc_stats_gauges *g)
{
	kc_pool_load(c->pool, &g->queued, &g->inflight);
	if (kc_cache_job_slots(c)) { /* workers fetch and wait too: count compiles by their slots */
		unsigned waiting;
		kc_slots_load(kc_cache_job_slots(c), &waiting, &g->inflight);
		g->queued += waiting;
	}
	g->flights = kc_flight_count(&c->flights);
	g->remote_set = c->remote != NULL;
	g->remote_up = c->remote ? (unsigned)kc_remote_tier_up(c->remote) : 0;
	kc_cache_ahead_gauges(c, g);
}
