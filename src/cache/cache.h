/* cache.h - the kernel cache: lookup of an entry's cubin with verification, the
 * single-flight compile of a staged recipe, publishing, and staging of client files.
 *
 * This is the whole behaviour of a kernel entry without FUSE: fs/ translates requests
 * into these calls. Entry directories are passed as fds on the backing store (O_PATH
 * allowed). Implemented by cache.c (init, lookup), verify.c (published cubins checked
 * before they are served), job.c (the compile job and publish) and staging.c (staged files
 * checked and committed), which share cache_i.h.
 */
#ifndef KC_CACHE_H
#define KC_CACHE_H

#include <pthread.h>
#include <stdatomic.h>

#include "config.h"
#include "evict.h"
#include "flight.h"
#include "name.h"
#include "nvrtc_pool.h"
#include "pool.h"
#include "remote_tier.h"
#include "stats.h"
#include "store.h"
#include "tree.h"

#define KC_PENDING 1 /* lookup result: the waiter will be called */

struct compile_job;

struct kc_cache {
	const struct kc_config *cfg; /* borrowed, outlives the cache */
	struct kc_store *store;      /* borrowed, outlives the cache */
	struct kc_flight_table flights;
	struct kc_pool *pool;        /* compile workers: cfg->jobs, or with a cluster store
				      * KC_REMOTE_WAITERS more, bounded by slots */
	struct kc_pool *shares;      /* with a cluster store: cfg->jobs workers that share the
				      * published compiles (share_published), else NULL */
	struct kc_slots slots;       /* cfg->jobs compiles at once; used with a cluster store
				      * only (without, the pool's size bounds them) */
	struct kc_stats stats;
	pthread_mutex_t publish_lock; /* orders publishes against recipe removal */
	pthread_mutex_t verified_lock;
	void *verified;              /* tsearch tree: cubins whose record matched */
	unsigned long verified_epoch; /* moves on at each emptying of verified (its lock) */
	pthread_mutex_t holdoff_lock;
	struct holdoff *holdoffs;    /* recent passing failures, see KC_RETRY_HOLDOFF */
	struct kc_evict *evict;      /* borrowed, may be NULL: told of every publish */
	atomic_int compiler_changed; /* the compiler identity changed during this mount */
	struct kc_remote_tier *remote; /* borrowed, may be NULL: the cluster store */
	struct kc_nvrtc_pool *nvrtc;  /* warm NVRTC workers, or NULL (no NVRTC backend, or
				       * -o nvrtc_idle=0) */
	struct kc_ahead *ahead;       /* compile ahead (ahead.c), or NULL: -o ahead=0 */
	int stopped;                  /* kc_cache_stop ran */
	atomic_int shares_cut;        /* a stop's bound passed: shares still in hand end now */
	pthread_mutex_t shares_lock;
	struct compile_job *shares_in_hand; /* queued or running shares (job.c), shares_lock */
	struct kc_tree_memo *tree_memo; /* file digests of the include roots checked before a
					 * compile (tree.h), or NULL (out of memory: read all) */
};

/* Seconds after a compile failed for a passing cause (timeout, killed, out of space) during
 * which lookups of that recipe get EIO without compiling again. Lookups queued behind the
 * failed one get its result instead of each running the compiler in turn. */
#define KC_RETRY_HOLDOFF 2.0

/* Start the compile workers, for the cluster store remote (borrowed, outlives the cache;
 * NULL for none). Returns 0 or -errno. */
int kc_cache_init(struct kc_cache *c, const struct kc_config *cfg, struct kc_store *store,
		  struct kc_remote_tier *remote);

/* Wait until the cluster store's share of every published compile (its dependency pass,
 * puts and lease release, which run after the openers were answered) has ended, at most
 * timeout_s seconds. Returns the shares still queued or running (0: none; 0 without a
 * store). */
unsigned kc_cache_settle(struct kc_cache *c, double timeout_s);

/* The first half of a stop: no compile starts from here on (compiles ahead included),
 * running compilers are killed and queued compiles fail (their waiters get -EIO now); the
 * cluster store's shares in hand (dependency passes, puts, lease releases) go on, so that
 * the stop can wait for them (kc_cache_settle) before kc_cache_shutdown. */
void kc_cache_stop(struct kc_cache *c);

/* Past a stop's bound (after kc_cache_stop): cut the shares still in hand (their
 * dependency passes are killed, their leases released, or left to expire where the store
 * does not answer), wait at most grace_s seconds for them to end, and name each one still
 * in hand in the log. Returns how many are: then kc_cache_shutdown would wait on a store
 * that does not answer, and the caller exits without it. */
unsigned kc_cache_cut_shares(struct kc_cache *c, double grace_s);

/* Kill running compilers, fail queued compiles (their waiters get -EIO), stop workers.
 * Shares still in hand are cut (each is logged, and its lease released) after
 * kc_cache_stop if it did not run yet. */
void kc_cache_shutdown(struct kc_cache *c);

/* Look up kernel.cubin in an entry, starting its compile if it must be compiled.
 * Returns 0 when a published, verified cubin is there (the caller stats it);
 * KC_PENDING when a compile is in flight: w (if not NULL) was queued on it, and w->done is
 * called later with 0 when published, -EIO when the compile failed, -EAGAIN when the recipe
 * changed during the compile and the lookup must be repeated; -ENOENT when nothing is
 * published and no recipe is staged; -EIO when nothing is published and no recipe is staged
 * because a kernel.cu or kernel.flags was refused since the last stage (kernel.log says
 * why), or when the
 * cubin is corrupt and cannot be rebuilt,
 * or the recipe was rejected by this compiler before (see kernel.log), or failed for a
 * passing cause less than KC_RETRY_HOLDOFF seconds ago. */
int kc_cache_lookup_cubin(struct kc_cache *c, int entry_fd, struct kc_waiter *w,
			  uint64_t *recipe_id);

/* The entry directory behind entry_fd as a path relative to the backing root, for log
 * lines, into buf (len bytes; "(unknown entry)" when it cannot be read). */
void kc_cache_entry_label(struct kc_cache *c, int entry_fd, char *buf, size_t len);

/* The first 64 bits of a recipe hash: names one recipe of an entry (the pending cubin's
 * identity). kc_cache_lookup_cubin stores it in *recipe_id (if not NULL) with KC_PENDING. */
uint64_t kc_recipe_id(const char *recipe_hex);

/* The recipe id recorded in the published cubin behind fd, or 0 if it has none. */
uint64_t kc_cache_cubin_recipe_id(int fd);

/* Check an open published cubin (fd) against its record before it is served; cheap when
 * the inode's ctime and size are those verified before. Returns 0, or -EIO when it is
 * corrupt: then, if entry_fd >= 0 and the entry has a recipe, the cubin is removed so that
 * the next lookup compiles it again (the caller invalidates the kernel's entry). Once the
 * compiler identity changed during the mount, a compiled cubin not verified since is also
 * checked against the entry's recipe: -EAGAIN when entry_fd is -1 (call again with the
 * entry), -ESTALE when it is the compile of another recipe or compiler (removed as above;
 * the kernel, answered ESTALE, looks the name up again). */
int kc_cache_verify_open(struct kc_cache *c, int fd, int entry_fd);

/* -o verify_keys, at every open of a published cubin (fd) in its entry (entry_fd) by uid
 * reader: a compiled cubin's recorded key must be what the entry's name gives, or -EIO (an
 * entry renamed to another key); a client's cubin (no key) is served only to its owner, or
 * -EACCES. Returns 0 when it may be served, or always 0 without verify_keys. */
int kc_cache_verify_name(struct kc_cache *c, int fd, int entry_fd, uid_t reader);

/* Results of kc_cache_stage besides 0 (src took the name): */
#define KC_STAGE_KEPT 1          /* the stored file stayed (same bytes, or a cubin was already
				  * published); src was removed */
#define KC_STAGE_CUBIN_REMOVED 2 /* a new kernel.cu/.flags was placed and the cubin compiled
				  * from the old recipe removed: invalidate the kernel's entry */

/* Commit a staged file src_dir/src_name into the entry as role's name (kernel.cu,
 * kernel.flags or kernel.cubin), atomically. Returns 0 when src took the name,
 * KC_STAGE_KEPT, KC_STAGE_CUBIN_REMOVED, or: -EEXIST when other source or flags bytes are
 * stored (nothing changes; a different valid cubin over a published one is kept instead:
 * racing compiles of one recipe need not be byte-identical); -EINVAL for refused flags or
 * a cubin that is not a complete CUDA ELF; -EFBIG for a source or flags file over
 * max_source_size; -EPERM for a file with other hard links; other -errno. Every refusal
 * is logged and written to kernel.log; one of kernel.cu or kernel.flags is marked on the
 * entry (kc_store_mark_refused) until a later stage succeeds. */
int kc_cache_stage(struct kc_cache *c, enum kc_role role, int src_dir, const char *src_name,
		   int entry_fd);

/* Stage a client's file src_dir/src_name as kc_cache_stage does, from a private copy of
 * its bytes: the entry's name never names the client's inode, so no descriptor or map the
 * client holds on it reaches staged bytes or the kernel's cache of them. src is removed
 * when the result is not an error (a rename consumes its source) and stays otherwise.
 * Returns what kc_cache_stage returns, or -errno of the copy (ENOSPC...). */
int kc_cache_stage_copy(struct kc_cache *c, enum kc_role role, int src_dir,
			const char *src_name, int entry_fd);

/* After kernel.cu or kernel.flags left the entry: remove a cubin the mount compiled from
 * it and forget a rejection and a refusal. Returns 1 if a cubin was removed (the caller invalidates the
 * kernel's caches of it), else 0. */
int kc_cache_unstage(struct kc_cache *c, int entry_fd);

/* Nonzero if the entry would show a kernel.cubin that is not published yet: a recipe is
 * staged and was not rejected. For readdir. */
int kc_cache_cubin_pending(struct kc_cache *c, int entry_fd);

/* Sample the gauges for statistics. */
void kc_cache_gauges(struct kc_cache *c, struct kc_stats_gauges *g);

#endif
