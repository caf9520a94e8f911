/* remote_tier.h - the cluster store in the compile path: fetch a verified cubin
 * another node compiled, or take the key's lease and compile, or wait for the holder's
 * object; then share what this node compiled. Used by the hub's compile job (job.c), in a compile
 * pool thread (never a FUSE thread: the openers are parked by the single flight). With a
 * store the pool has KC_REMOTE_WAITERS workers more than -o jobs, and a job holds one of
 * jobs slots (pool.h) only while it holds a lease or compiles: fetching and waiting for
 * another node take no slot, so a joining node fetches many objects at once.
 *
 * One compile job, with the recipe's manifest key mkey (remote_object.h):
 *   1. the index under mkey lists the headers; this node hashes its own copies into its
 *      manifest and object key, fetches that object and verifies it (format, key,
 *      SHA-256, signature, CUDA ELF, manifest equal to this node's): a hit is published
 *      to L1 as a compile would be. A node whose headers differ has another object key.
 *      Once one index matched here, a job's first look asks for the object of this node's
 *      manifest of that header list before the index (one get instead of two), and this
 *      node's manifest of a list is shared by the looks that ask together
 *      (remote_rehash.h). At start, the lists record (kc_object_lists_key: the lists the
 *      cluster's nodes stored last, which each share names) is checked against this
 *      node's headers, so that a joining node's first look asks directly too.
 *   2. no index: take the lease on mkey and look again (the holder may just have
 *      published); holding it, compile, put the object and then the index, release,
 *      and notify the key's waiters (remote.h's notify: a Redis PUBLISH). A
 *      timer thread renews the lease every KC_REMOTE_RENEW_MS (or third of its ttl, if
 *      shorter) while the compile runs, which also proves that this holder lives.
 *   3. the lease is another node's: watch the key (remote.h's watch_start: a Redis
 *      SUBSCRIBE, a stat of the index and lease files every KC_REMOTE_WATCH_POLL_MS on
 *      dir:), look again, and look again at each notice and at least every
 *      KC_REMOTE_NOTICE_MS (a notice is only a hint: what is found is verified as ever);
 *      a store that gives no notices is polled at 50 ms growing to 1 s;
 *      a lease gone without an object, or whose holder has not proved for KC_REMOTE_ALIVE_MS
 *      that it lives, is taken over (remote.h); after remote_wait seconds compile
 *      locally (a hedge). A failure note (the holder's compile was rejected) means: compile
 *      locally at once.
 * Every store fault is a miss or a failed put: counted, logged (at most one line per 10 s
 * per kind), and after KC_REMOTE_BREAKER_FAULTS faults in a row the breaker opens: the store
 * is not asked, but probed (one cheap call) after KC_REMOTE_BREAKER_FIRST_S seconds, then at
 * waits that double up to KC_REMOTE_BREAKER_S; the first probe it answers closes the breaker
 * (logged once each way). Only nvcc compiles are shared:
 * NVRTC entries have no dependency output to build a manifest from (remote_manifest.h).
 */
#ifndef KC_REMOTE_TIER_H
#define KC_REMOTE_TIER_H

#include <stddef.h>

#include "hash.h"
#include "pool.h"
#include "remote.h"
#include "remote_object.h"
#include "stats.h"

#define KC_REMOTE_DEFAULT_LEASE 60      /* seconds of a lease between renewals */
#define KC_REMOTE_DEFAULT_WAIT 300      /* seconds a waiter waits before compiling itself */
#define KC_REMOTE_DEFAULT_TIMEOUT 2000  /* milliseconds of one store operation */
#define KC_REMOTE_FAIL_NOTE_MS 5000     /* a rejected compile's note lives this long */
#define KC_REMOTE_BREAKER_FAULTS 5      /* faults in a row that stop asking the store */
#define KC_REMOTE_BREAKER_FIRST_S 1     /* seconds from the opening to the first probe */
#define KC_REMOTE_BREAKER_S 30          /* the longest wait between two probes, seconds */
#define KC_REMOTE_NOTICE_MS 1000       /* a watching waiter looks again at least this often */
#define KC_REMOTE_NOTICE_GAP_MS 20     /* and, woken by notices, at most this often */
#define KC_REMOTE_WAITERS 32            /* pool workers beyond -o jobs: fetches and waits */
#define KC_REMOTE_LISTS 16              /* header lists a node keeps (remote_object.h) */
#define KC_REMOTE_FIRST_WAIT_MS 200     /* a node's first looks wait this long, at most, for
					 * the one that reads an index to find its header list */

/* -o remote options, as given (borrowed). */
struct kc_remote_opts {
	const char *url;       /* -o remote= */
	const char *auth_file; /* -o remote_auth= (Redis) */
	const char *key_file;  /* -o remote_key=: the HMAC secret; NULL: unsigned objects */
	int read_only;         /* -o remote_mode=ro */
	unsigned lease_s;      /* -o remote_lease= (0: default) */
	unsigned wait_s;       /* -o remote_wait= (0: default) */
	unsigned timeout_ms;   /* -o remote_timeout= (0: default) */
};

struct kc_remote_tier;

/* What one compile job does with the cluster store; zero-initialise, pass to kc_remote_tier_fetch,
 * then (unless it fetched) to kc_remote_tier_finish. */
struct kc_remote_job {
	int active;        /* the store takes part in this compile */
	int holder;        /* this node holds the lease on mkey */
	char mkey[KC_SHA256_HEXLEN + 1];
	char token[KC_REMOTE_TOKENLEN + 1];
	void *renewer;     /* the renewal thread while holder */
	char *data;        /* the fetched object (owned) */
	struct kc_object obj; /* it, verified: obj.cubin / obj.cubin_len are the bytes */
	char where[160];   /* the store and object, for kernel.log */
	const char *flags; /* the recipe's kernel.flags (borrowed; may be NULL): the include
			    * roots it names are left out of the header list */
	size_t flags_len;
	struct timespec since; /* the coarse real clock before the compile began (0: unknown):
				* a listed file changed since is not evidence of that compile */
};

/* Open the cluster store for -o remote=, counting into stats (borrowed, outlives the store). Returns 0 and *out, or
 * with why filled: -EINVAL for a usage error (a malformed or unknown URL, remote_auth=
 * with a dir: store), -EACCES for a key or auth file that someone other than root could
 * read, that cannot be read, or whose secret is shorter than KC_OBJECT_MIN_SECRET bytes,
 * -ENOMEM. Warns (log) when no key is given. Does not connect (kc_remote_tier_probe). */
int kc_remote_tier_open(const struct kc_remote_opts *o,
			struct kc_stats *stats, struct kc_remote_tier **out, char *why,
			size_t whylen);

/* Ask the store once, bounded by remote_timeout: a store that does not answer is said in
 * the log, counted as a get error, and the breaker opens (remote_up is 0: probed again
 * after KC_REMOTE_BREAKER_FIRST_S s, see above); the mount goes on without it. For
 * start-up, in the process that serves (after the daemon's fork): it also makes the header
 * memo ready (kc_manifest_memo_init), so that a joining node's first fetch does not fault
 * its pages in, and, when the store answers, starts a thread (joined by
 * kc_remote_tier_close, stopped by kc_remote_tier_stop between lists) that checks the
 * lists record against this node's headers: the first list it names that is this node's
 * is then asked for directly, its headers hashed and watched. With wait (a mount coming
 * up, not one taken over), the call waits for that thread at most
 * KC_REMOTE_PREWARM_WAIT_MS (the mount serves after it returns), then lets it go on; a
 * fetch never waits for it (doc/cluster.md). */
#define KC_REMOTE_PREWARM_WAIT_MS 1500
void kc_remote_tier_probe(struct kc_remote_tier *t, int wait);

/* Make waiting jobs stop waiting (they compile locally or fail at once); for shutdown. */
void kc_remote_tier_stop(struct kc_remote_tier *t);

void kc_remote_tier_close(struct kc_remote_tier *t);

/* Step 1 to 3 above for the recipe recipe_hash (use_store: 0 for an NVRTC compile, which
 * only clears rj). slots (may be NULL) bound this node's compiles: a lease is taken only
 * holding one, and none is held while waiting for another node. Returns 1 when a verified
 * cubin was fetched (rj->obj; publish it, then kc_remote_job_free), holding no slot; 0 to
 * compile (then kc_remote_tier_finish), holding one of slots, which the caller releases
 * when its compile has ended. Never fails. t may be NULL (no store: 0 with a slot). */
int kc_remote_tier_fetch(struct kc_remote_tier *t, const char *recipe_hash, int use_store,
			 struct kc_slots *slots, struct kc_remote_job *rj);

/* After the compile of rj: when it published (ok) the cubin behind cubin_fd, share it
 * (unless read-only, or deps, nvcc's dependency file of the same source and flags, is NULL or its manifest cannot be
 * built); release the lease, leaving a failure note when the compile was rejected. Frees
 * what rj holds. After kc_remote_tier_stop, with the breaker open (the store does not
 * answer), nothing is asked of the store: the lease expires. */
void kc_remote_tier_finish(struct kc_remote_tier *t, struct kc_remote_job *rj, int ok,
			   int rejected, int cubin_fd, const char *deps, size_t deps_len);

/* 1 when a published compile of rj is to be shared (the store takes part and the node
 * is not read-only): its caller then runs nvcc's dependency pass (compile.h's deps_only)
 * for kc_remote_tier_finish's deps, after the local publish, while the lease is held. */
int kc_remote_tier_shares(const struct kc_remote_tier *t, const struct kc_remote_job *rj);

/* Free what rj holds (after a fetch that returned 1). */
void kc_remote_job_free(struct kc_remote_job *rj);

/* Move the job *src to *dst (another place in memory, e.g. a record that outlives src's
 * stack frame): its lease's renewal thread then reads the key and token at dst. src must
 * not be used after. */
void kc_remote_job_move(struct kc_remote_job *dst, struct kc_remote_job *src);

/* Compile ahead's records in the store (remote_object.h's history kind; their bytes are
 * history.h's, which the caller parses: nothing here trusts them beyond their signature).
 * Each call is bounded as any store call (remote_timeout, the breaker) and counted.
 *
 * The history of context (64 hex) into *data (malloc'd) / *len. Returns 0; -ENOENT (none);
 * -EBADMSG (refused: unsigned where a key is set, another key's signature, malformed,
 * over KC_OBJECT_MAX_MANIFEST; counted in remote_rejected and logged); -EIO (a fault, or
 * the store is down); -ENOMEM. */
int kc_remote_tier_history_get(struct kc_remote_tier *t, const char *context, char **data,
			       size_t *len);

/* Store data/len as the history of context (replacing the one there), then name context
 * first in the record of the contexts stored last (at most KC_HISTORIES_PER_KEY). Returns 0,
 * -EROFS (-o remote_mode=ro: nothing stored), or -EIO (a fault). */
int kc_remote_tier_history_put(struct kc_remote_tier *t, const char *context, const char *data,
			       size_t len);

/* The contexts whose histories were stored last, newest first, into contexts (at most
 * max) / *n. Returns 0 (none: *n is 0), -EBADMSG (refused as above), -EIO, -ENOMEM. */
int kc_remote_tier_histories(struct kc_remote_tier *t, char (*contexts)[KC_SHA256_HEXLEN + 1],
			     size_t max, size_t *n);

/* 1 while the store answers (the breaker is closed), else 0. */
int kc_remote_tier_up(struct kc_remote_tier *t);

/* The breaker's wait, in seconds, before the probe after one that failed following a wait
 * of wait_s: twice wait_s, at most KC_REMOTE_BREAKER_S. */
double kc_remote_breaker_next_wait(double wait_s);

#endif
