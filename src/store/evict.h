/* evict.h - the bounded cache: an index of published entries (bytes, last use) and one
 * cleaner thread that evicts the least recently used when -o max_size or -o max_entries
 * is exceeded, down to a low watermark (KC_EVICT_LOW_PERCENT of each bound).
 *
 * An entry is a directory named kernel.<name>.<hash> that holds a kernel.cubin; its bytes
 * are the sizes of the regular files in it. Last use is kept by the mount (opens of its
 * cubin and lookups of the entry, through kc_evict_touch), in memory, and persisted at most
 * hourly in the xattr user.kcachefs.used (seconds since the epoch) so that a remount keeps
 * the order; an entry without it counts as used when its cubin was last modified.
 *
 * Never evicted: an entry with a compile in flight (checked under the flight table's lock,
 * which no compile can start inside), one with a file being staged in it (kc_evict_pin),
 * and one used less than KC_EVICT_GRACE seconds ago. An evicted entry goes whole, with its
 * source: it is renamed into the state directory's tmp/ (it leaves the tree at once,
 * atomically), then removed; open descriptors of its files keep reading them (local disk).
 *
 * The cleaner thread first scans the backing tree (so start-up does not wait for it);
 * until the scan ends, nothing is evicted. Ownership: the index owns its records.
 */
#ifndef KC_EVICT_H
#define KC_EVICT_H

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#include "flight.h"
#include "stats.h"
#include "store.h"
#include "util.h"

#define KC_EVICT_LOW_PERCENT 90 /* evict down to this share of each bound */
#define KC_EVICT_GRACE 2        /* seconds: an entry used this recently is never a victim */
#define KC_EVICT_PERSIST 3600   /* seconds between writes of an entry's user.kcachefs.used */

struct trash;

struct kc_evict {
	struct kc_store *store;           /* borrowed */
	struct kc_flight_table *flights;  /* borrowed: entries compiling are not evicted */
	uint64_t max_bytes, max_entries;  /* 0: no bound of that kind */
	/* Called (cleaner thread) after an entry left the tree, with its path relative to the
	 * backing root, so the FUSE layer can invalidate the kernel's dentry. May be NULL. */
	void (*evicted)(void *arg, const char *rel_path);
	void *arg;
	struct kc_stats *stats;           /* borrowed: evictions are counted here */

	pthread_mutex_t lock;
	void *tree;                       /* tsearch tree of records keyed by (dev, ino) */
	uint64_t entries, bytes;          /* published entries indexed, and their bytes */
	int scanned, started;             /* started: the cleaner may be woken */
	uint64_t trashed;                 /* names tmp/evicted.<ino>.<n> apart */
	struct trash *trash;              /* removals to retry (cleaner thread only) */
	struct kc_ticker cleaner;         /* the cleaner thread */
};

/* Set up (nothing runs yet). Returns 0 or -errno. */
int kc_evict_init(struct kc_evict *e, struct kc_store *store, struct kc_flight_table *flights,
		  struct kc_stats *stats, uint64_t max_bytes, uint64_t max_entries);
/* Start the cleaner thread (scan, then evict when over a bound). Returns 0 or -errno. */
int kc_evict_start(struct kc_evict *e);
/* Stop and join the cleaner (an eviction in progress finishes); the index stays usable.
 * Call before the flight table goes. */
void kc_evict_stop(struct kc_evict *e);
/* Stop the cleaner if running, write the last uses not yet persisted, free the index.
 * Call while the store is open. */
void kc_evict_destroy(struct kc_evict *e);

/* (Re)measure the directory name in dir (any fd on a directory of the backing tree, O_PATH
 * allowed): indexed when it is an entry holding a kernel.cubin, as used now; dropped from
 * the index otherwise (it was renamed away or lost its cubin). Wakes the cleaner when a
 * bound is exceeded. Call after a cubin is published into it, or it was renamed. */
void kc_evict_note(struct kc_evict *e, int dir, const char *name);
/* The same, for an entry directory given by its own fd (O_PATH allowed). */
void kc_evict_note_fd(struct kc_evict *e, int entry_fd);
/* Mark the entry directory (dev, ino) used now; nothing if it is not indexed. */
void kc_evict_touch(struct kc_evict *e, dev_t dev, ino_t ino);
/* Drop (dev, ino) from the index (the entry directory was removed). */
void kc_evict_forget(struct kc_evict *e, dev_t dev, ino_t ino);
/* A file is being staged in entry directory (dev, ino): it is not evicted until as many
 * unpins. Returns 0 or -ENOMEM. */
int kc_evict_pin(struct kc_evict *e, dev_t dev, ino_t ino);
void kc_evict_unpin(struct kc_evict *e, dev_t dev, ino_t ino);

/* Gauges and counters for statistics (read under the lock). */
struct kc_evict_stats {
	uint64_t entries, bytes;
	int scanned; /* the start-up scan has ended: entries and bytes are complete */
};
void kc_evict_sample(struct kc_evict *e, struct kc_evict_stats *out);

/* Parse a size: digits with an optional K, M, G or T suffix (powers of 1024). Returns 0, or
 * -EINVAL for anything else, zero, or an overflow. */
int kc_parse_size(const char *text, uint64_t *out);

#endif
