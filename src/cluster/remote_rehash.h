/* remote_rehash.h - this node's compact manifest of a header list (remote_manifest.h),
 * taken once for the fetches that ask for it together.
 *
 * A joining node fetches many kernels at once, and their index entries name the same
 * header list (a DeepGEMM-like kernel's host headers are the same for all its kernels).
 * Each fetch must compare the list with this node's headers as they are when it asks:
 * stat every header (kc_manifest_rehash, through its memo of hashes), hash the result.
 * Done per fetch, that is a stat of every listed header per kernel (the largest part of a
 * joining node's time per kernel on the 2-core build machine).
 *
 * Shared here without going stale: a fetch takes a ticket when it asks (kc_rehash_ticket),
 * and takes only the result of a rehash that began after that ticket was taken: each header
 * was then stat'ed (and read, if it changed) after the fetch asked, as its own rehash would
 * have done. A fetch that finds one running that began before its ticket waits for it to
 * end and starts the next, which every fetch that asked meanwhile then shares (as a group
 * commit). Nothing is kept by time: a header changed before a fetch asked is always seen.
 *
 * A fetch also takes a result older than its ticket when the watch (remote_watch.h), armed
 * before that result's stats began, says that nothing it looked at has changed since: on a
 * joining node, whose fetches arrive one per rehash, that turns a stat of every header per
 * kernel into one read of the watch's events.
 *
 * The watch is armed behind the fetches, not in their way. Arming it walks, watches, leases
 * and reads every header (3 ms for 133 host headers inside a join on an H200 node), and
 * every reader of a joining node waited for it before its first cubin: the largest part of
 * a 32-kernel join there. So a rehash of a list that the watch does
 * not cover is a plain one (stats, and reads of what the memo lacks, spread over helper
 * threads at a list's first rehash: kc_manifest_rehash_spread), and its end starts one
 * thread, the armer, that arms the watch for the list and then runs one rehash under it.
 * Results of rehashes that began after that arm returned are the ones the watch's word
 * may stand for. The armer reads the headers only where the memo lacks them, so its arm
 * sees no open of the fetches' rehashes (which only stat, once the memo holds the list).
 */
#ifndef KC_REMOTE_REHASH_H
#define KC_REMOTE_REHASH_H

#include <pthread.h>
#include <stddef.h>

#include "hash.h"
#include "remote_manifest.h"
#include "remote_watch.h"

#define KC_REHASH_SLOTS 16 /* lists whose last rehash is kept (the cluster store keeps as many lists, remote_tier.c) */
#define KC_REHASH_ARM_BACKOFF 16 /* a list whose arm gave no word (a header on NFS, or open
				  * for writing) is armed again after this many rehashes */

struct kc_rehash_table {
	pthread_mutex_t lock;
	pthread_cond_t done; /* a rehash or the armer ended */
	unsigned long starts; /* rehashes begun so far: a ticket is its value when taken */
	unsigned next;        /* the slot a new list takes next (round robin) */
	unsigned long proven; /* results taken on the watch's word (for the tests) */
	unsigned long armer_starts; /* rehashes the armer began (for the tests) */
	unsigned long arms;   /* armers started (for the tests) */
	int arming;           /* the armer is running (one at a time, for any list) */
	int armer_live;       /* armer holds a thread not yet joined */
	pthread_t armer;
	struct kc_watch watch;
	struct kc_rehash_slot {
		char hash[KC_SHA256_HEXLEN + 1]; /* the list's digest; "" empty slot */
		int running;                     /* a rehash of it is under way */
		unsigned long seq;               /* the number of the last rehash that ended (0: none) */
		int err;                         /* its result: 0, or kc_manifest_rehash's error */
		unsigned long cover_gen;         /* the watch's generation for the list (0: none) */
		unsigned long cover_at;          /* starts when that arm returned: a rehash
						  * numbered above began after it */
		unsigned arm_skip;               /* uncovered rehashes left to start no armer,
						  * after an arm that gave no word */
		char mine[KC_MANIFEST_COMPACT_MAX];
		size_t mine_len;
		char why[200];
	} slots[KC_REHASH_SLOTS];
};

/* Initialise t (empty). */
void kc_rehash_init(struct kc_rehash_table *t);

/* Release what kc_rehash_init took, after the armer (if any) ends; no call may be under
 * way. */
void kc_rehash_destroy(struct kc_rehash_table *t);

/* Wait until the armer (if any) has ended: its watch armed and its rehash done (for the
 * tests, which count rehashes). */
void kc_rehash_settle(struct kc_rehash_table *t);

/* A ticket for a fetch that asks now: pass it to kc_rehash_own. */
unsigned long kc_rehash_ticket(struct kc_rehash_table *t);

/* This node's compact manifest (kc_manifest_compact of kc_manifest_rehash) of the header
 * list list/len whose digest is hash, from a rehash that began after ticket was taken (a
 * running one's result, or one run here), or from an earlier one that the watch proves
 * still true. A rehash run here that the watch does not cover starts the armer for the
 * list (unless it is running already), which copies list. Returns 0 with mine / *mlen
 * filled; the error of
 * kc_manifest_rehash (-ENOENT, -EACCES, -EFBIG, -EINVAL) with why filled when a header
 * cannot be hashed here; -ENOMEM. */
int kc_rehash_own(struct kc_rehash_table *t, unsigned long ticket, const char *hash,
		  const char *list, size_t len, char mine[KC_MANIFEST_COMPACT_MAX], size_t *mlen,
		  char *why, size_t whylen);

/* kc_rehash_own for a list that may not be this node's (the check of the cluster's lists
 * at start, remote_tier.h): the same result, but its rehash starts no armer, so that the
 * watch is not spent on a list whose headers are here with other bytes. Arm the one that
 * matched with kc_rehash_arm. Returns as kc_rehash_own. */
int kc_rehash_check(struct kc_rehash_table *t, unsigned long ticket, const char *hash,
		    const char *list, size_t len, char mine[KC_MANIFEST_COMPACT_MAX],
		    size_t *mlen, char *why, size_t whylen);

/* Start the armer for the list list/len whose digest is hash, as a fetch's uncovered
 * rehash does, after waiting for a running armer (another list's) to end: unless the
 * list's last rehash failed, the watch covers it already, or its last arm gave no word
 * (KC_REHASH_ARM_BACKOFF). Copies list. A thread that
 * cannot be had leaves it uncovered (its next fetch's rehash asks again). */
void kc_rehash_arm(struct kc_rehash_table *t, const char *hash, const char *list, size_t len);

#endif
