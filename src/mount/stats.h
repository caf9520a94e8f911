/* stats.h - the mount's counters and their two text forms.
 *
 * .kcachefs/metrics.prom is the Prometheus text exposition format (version 0.0.4):
 * "# HELP"/"# TYPE" lines and "name value" lines, which a node exporter's textfile
 * collector or a scrape job reads as is, every metric always. .kcachefs/stats is the same
 * numbers for people, grouped as ccache -s groups its figures (local cache, compiles,
 * cluster store, eviction, inodes; a group of a feature that is off left out), one
 * "  what  value" line each. Both come from one table of metrics (stats.c).
 *
 * Lookups are counted as the daemon sees them: the kernel merges concurrent lookups of one
 * name into one request (the others wait in the kernel) and caches published cubins, so
 * opens, which always reach the daemon, are counted separately. Counters are exact while
 * mounted and start at zero at every mount; kc_stats_reset zeroes them.
 */
#ifndef KC_STATS_H
#define KC_STATS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* Upper bounds (seconds) of the compile duration histogram's buckets; +Inf follows. */
#define KC_STATS_BUCKETS {0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600}
#define KC_STATS_NBUCKETS 10

struct kc_stats {
	atomic_uint_fast64_t hits;             /* cubin lookups served from a published cubin */
	atomic_uint_fast64_t misses;           /* cubin lookups that started a compile */
	atomic_uint_fast64_t waits;            /* cubin lookups that joined a compile in flight */
	atomic_uint_fast64_t cubin_opens;      /* opens of published cubins */
	atomic_uint_fast64_t compiles;         /* compiler runs that published a cubin */
	atomic_uint_fast64_t compile_failures; /* compiler runs that failed, any cause */
	atomic_uint_fast64_t rejected_lookups; /* lookups refused by a remembered rejection */
	atomic_uint_fast64_t corrupt;          /* published cubins failing their SHA-256 */
	atomic_uint_fast64_t published_bytes;  /* bytes of cubins published by compiles */
	atomic_uint_fast64_t compile_usec;     /* wall time of all compiler runs, microseconds */
	atomic_uint_fast64_t stages;           /* kernel.cu/.flags/.cubin committed */
	atomic_uint_fast64_t stage_refusals;   /* stages refused (EEXIST, EINVAL, EFBIG) */
	atomic_uint_fast64_t compile_timeouts; /* compiler runs killed at compile_timeout */
	atomic_uint_fast64_t compile_runs;     /* compiler runs observed (the histogram's count) */
	atomic_uint_fast64_t compile_buckets[KC_STATS_NBUCKETS]; /* runs of <= each bound */
	atomic_uint_fast64_t evictions;        /* entries evicted (evict.c) */
	atomic_uint_fast64_t evicted_bytes;    /* their bytes */
	/* the cluster store (-o remote=, remote_tier.h) */
	atomic_uint_fast64_t remote_hits;      /* compiles answered by a verified object */
	atomic_uint_fast64_t remote_misses;    /* compiles that found none and compiled */
	atomic_uint_fast64_t remote_puts;      /* objects (cubins and indexes) stored */
	atomic_uint_fast64_t remote_get_errors;   /* store faults of gets */
	atomic_uint_fast64_t remote_put_errors;   /* of puts */
	atomic_uint_fast64_t remote_lease_errors; /* of lease operations */
	atomic_uint_fast64_t remote_rejected;  /* objects refused by verification */
	atomic_uint_fast64_t remote_foreign_paths; /* fetched cubins naming a path not on this
						    * node (the compiling node's: __FILE__) */
	atomic_uint_fast64_t remote_lease_waits; /* compiles that waited for another holder */
	atomic_uint_fast64_t remote_takeovers; /* leases taken after another holder's */
	atomic_uint_fast64_t remote_hedged;    /* waits given up at remote_wait: compiled here */
	atomic_uint_fast64_t remote_bytes_in;  /* bytes of objects fetched */
	atomic_uint_fast64_t remote_bytes_out; /* bytes of objects stored */
	atomic_uint_fast64_t remote_fetch_usec; /* time of the fetches that hit, microseconds */
	atomic_uint_fast64_t remote_fetches;   /* their number */
	/* compile ahead (-o ahead=, ahead.c) */
	atomic_uint_fast64_t ahead_triggers;   /* client compiles whose kernel another image's
						* history held: its other kernels planned */
	atomic_uint_fast64_t ahead_compiles;   /* compiles ahead that published a cubin */
	atomic_uint_fast64_t ahead_used;       /* client compiles answered by a compile ahead */
	atomic_uint_fast64_t ahead_failures;   /* compiles ahead that failed */
	atomic_uint_fast64_t remote_lookups;   /* cubin lookups parked on a flight that fetched:
						* answered with the fetched cubin (waiter.c) */
	pthread_mutex_t hist_lock; /* the histogram (compile_usec, _runs, _buckets) moves as one;
				    * all zero is its initial state, as in a zeroed struct */
};

/* Gauges sampled when the text is made. */
struct kc_stats_gauges {
	unsigned inflight; /* compiles running */
	unsigned queued;   /* compiles waiting for a job slot */
	unsigned flights;  /* entries with a compile in flight or queued */
	unsigned parked;   /* requests (getattr, open) parked on a compile, not yet answered */
	unsigned long inodes; /* inodes the kernel holds references to (each keeps an fd) */
	unsigned long inodes_max; /* the bound kept by asking the kernel to forget */
	unsigned long reliefs; /* times the kernel was asked to forget, to keep the bound */
	unsigned long entries; /* published entries in the store (evict.c's index) */
	unsigned long long stored_bytes; /* their bytes */
	unsigned long long max_bytes, max_entries; /* -o max_size, -o max_entries (0: none) */
	unsigned remote_set; /* 1: a cluster store is set (-o remote=) */
	unsigned remote_up;  /* 1: a cluster store is set and answers; 0: down or none */
	unsigned ahead_set;  /* 1: compile ahead is on */
	unsigned ahead_queued, ahead_running; /* compiles ahead waiting for an idle slot, running */
	unsigned ahead_unused; /* compiled ahead in this mount, not asked for (yet) */
	double ahead_unused_seconds; /* their compiler time: the CPU spent on nothing so far */
};

/* Facts about the mount, rendered as the info metric kcachefs_info (value 1) with label
 * values escaped as the Prometheus text format says (\\, \", \n). Borrowed strings. */
struct kc_stats_info {
	const char *version;  /* kcachefs's */
	const char *compiler; /* the compiler identity that is part of every recipe */
	const char *arch;     /* the target architecture */
	const char *flags;    /* -o flags= ("" for none), added to every compile */
};

enum kc_stats_format {
	KC_STATS_PROMETHEUS, /* metrics.prom */
	KC_STATS_TEXT,       /* stats: for people */
};

/* Render into buf (NUL-terminated, truncated to len). Returns the length it needed. */
size_t kc_stats_render(const struct kc_stats *s, const struct kc_stats_gauges *g,
		       const struct kc_stats_info *info, enum kc_stats_format format, char *buf,
		       size_t len);

/* Count one compiler run of seconds (wall time) in the sum and the histogram. */
void kc_stats_observe_compile(struct kc_stats *s, double seconds);

/* Zero every counter (not the gauges). Each is zeroed atomically; a count made during the
 * reset may land before or after it. */
void kc_stats_reset(struct kc_stats *s);

#endif
