/* stats.c - see stats.h */
#include "stats.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

struct metric {
	const char *name, *type, *help; /* Prometheus */
	const char *label;              /* for people */
	unsigned long long value;
};

/* Append str at buf + *used, counting what does not fit (buf stays NUL-free here). */
static void put(char *buf, size_t len, size_t *used, const char *str)
{
	for (; *str; str++, (*used)++)
		if (*used + 1 < len)
			buf[*used] = *str;
}

/* Append a label value escaped as the Prometheus text format says. */
static void put_label(char *buf, size_t len, size_t *used, const char *value)
{
	for (const char *p = value; *p; p++) {
		char one[2] = {*p, 0};
		put(buf, len, used, *p == '\\' ? "\\\\" : *p == '"' ? "\\\"" : *p == '\n' ? "\\n" : one);
	}
}

static void putf(char *buf, size_t len, size_t *used, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static void putf(char *buf, size_t len, size_t *used, const char *fmt, ...)
{
	char one[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(one, sizeof(one), fmt, ap);
	va_end(ap);
	put(buf, len, used, one);
}

static const double bucket_bounds[KC_STATS_NBUCKETS] = KC_STATS_BUCKETS;

size_t kc_stats_render(const struct kc_stats *s, const struct kc_stats_gauges *g,
		       const struct kc_stats_info *info, enum kc_stats_format format, char *buf,
		       size_t len)
{
	const struct metric m[] = {
		{"kcachefs_hits_total", "counter", "Cubin lookups served from a published cubin.", "hits", s->hits},
		{"kcachefs_misses_total", "counter", "Cubin lookups that started a compile.", "misses", s->misses},
		{"kcachefs_waits_total", "counter", "Requests (lookup, getattr, open) of a compiling cubin that joined its compile.", "waiters", s->waits},
		{"kcachefs_cubin_opens_total", "counter", "Opens of published cubins.", "cubin opens", s->cubin_opens},
		{"kcachefs_compiles_total", "counter", "Compiler runs that published a cubin.", "compiles ok", s->compiles},
		{"kcachefs_compile_failures_total", "counter", "Compiler runs that failed (timeouts included).", "compiles failed", s->compile_failures},
		{"kcachefs_compile_timeouts_total", "counter", "Compiler runs killed at compile_timeout.", "compiles timed out", s->compile_timeouts},
		{"kcachefs_rejected_lookups_total", "counter", "Lookups answered EIO without a compile: a remembered rejection, a retry hold-off, or a key the entry's name does not give (verify_keys).", "rejected lookups", s->rejected_lookups},
		{"kcachefs_corrupt_cubins_total", "counter", "Published cubins whose SHA-256 did not match.", "corrupt cubins", s->corrupt},
		{"kcachefs_published_bytes_total", "counter", "Bytes of cubins published by compiles.", "bytes published", s->published_bytes},
		{"kcachefs_stages_total", "counter", "Staged files committed (kernel.cu, kernel.flags, kernel.cubin).", "stages", s->stages},
		{"kcachefs_stage_refusals_total", "counter", "Staged files refused.", "stages refused", s->stage_refusals},
		{"kcachefs_evictions_total", "counter", "Entries evicted to stay under max_size and max_entries.", "evictions", s->evictions},
		{"kcachefs_evicted_bytes_total", "counter", "Bytes of the entries evicted.", "bytes evicted", s->evicted_bytes},
		{"kcachefs_remote_hits_total", "counter", "Compiles answered by a verified object of the cluster store.", "remote hits", s->remote_hits},
		{"kcachefs_remote_misses_total", "counter", "Compiles that found no object in the cluster store and compiled here.", "remote misses", s->remote_misses},
		{"kcachefs_remote_puts_total", "counter", "Objects (cubins and header indexes) stored in the cluster store.", "remote puts", s->remote_puts},
		{"kcachefs_remote_get_errors_total", "counter", "Cluster store faults of gets (each a miss).", "remote get errors", s->remote_get_errors},
		{"kcachefs_remote_put_errors_total", "counter", "Cluster store faults of puts.", "remote put errors", s->remote_put_errors},
		{"kcachefs_remote_lease_errors_total", "counter", "Cluster store faults of lease operations.", "remote lease errors", s->remote_lease_errors},
		{"kcachefs_remote_rejected_total", "counter", "Objects of the cluster store refused by verification (never served).", "remote rejected", s->remote_rejected},
		{"kcachefs_remote_foreign_paths_total", "counter", "Fetched cubins that name a file path not on this node: the compiling node's (__FILE__ in device code), accepted unless -o key_paths.", "remote foreign paths", s->remote_foreign_paths},
		{"kcachefs_remote_lease_waits_total", "counter", "Compiles that waited for another node's lease.", "remote lease waits", s->remote_lease_waits},
		{"kcachefs_remote_takeovers_total", "counter", "Leases taken after another holder's expired or was released without an object.", "remote takeovers", s->remote_takeovers},
		{"kcachefs_remote_hedged_total", "counter", "Waits given up after remote_wait: compiled here.", "remote hedged", s->remote_hedged},
		{"kcachefs_remote_bytes_in_total", "counter", "Bytes of objects fetched from the cluster store.", "remote bytes in", s->remote_bytes_in},
		{"kcachefs_remote_bytes_out_total", "counter", "Bytes of objects stored in the cluster store.", "remote bytes out", s->remote_bytes_out},
		{"kcachefs_remote_fetch_microseconds_total", "counter", "Time of the fetches that hit, summed (divide by kcachefs_remote_fetches_total).", "remote fetch usec", s->remote_fetch_usec},
		{"kcachefs_remote_fetches_total", "counter", "Fetches that hit.", "remote fetches", s->remote_fetches},
		{"kcachefs_remote_lookups_total", "counter", "Lookups of a kernel.cubin that waited for its fetch and were answered with the fetched cubin.", "remote lookups", s->remote_lookups},
		{"kcachefs_remote_up", "gauge", "1 when a cluster store is set (-o remote=) and answers, else 0.", "remote up", g->remote_up},
		{"kcachefs_inode_reliefs_total", "counter", "Times the kernel was asked to forget inodes to stay under kcachefs_inodes_max.", "inode reliefs", g->reliefs},
		{"kcachefs_entries", "gauge", "Published entries in the store.", "entries", g->entries},
		{"kcachefs_stored_bytes", "gauge", "Bytes of the published entries (their regular files).", "bytes stored", g->stored_bytes},
		{"kcachefs_max_size_bytes", "gauge", "The bound on kcachefs_stored_bytes (-o max_size; 0: none).", "max size", g->max_bytes},
		{"kcachefs_max_entries", "gauge", "The bound on kcachefs_entries (-o max_entries; 0: none).", "max entries", g->max_entries},
		{"kcachefs_compiles_in_flight", "gauge", "Compiler runs in progress.", "compiles in flight", g->inflight},
		{"kcachefs_compiles_queued", "gauge", "Compiles waiting for a job slot.", "compiles queued", g->queued},
		{"kcachefs_flights", "gauge", "Entries with a compile in flight or queued.", "flights", g->flights},
		{"kcachefs_parked_requests", "gauge", "Requests waiting for a compile, not yet answered.", "parked requests", g->parked},
		{"kcachefs_inodes", "gauge", "Inodes the kernel holds (each keeps a descriptor open).", "inodes", g->inodes},
		{"kcachefs_inodes_max", "gauge", "Inodes kept before the kernel is asked to forget the least recently used (-o max_inodes).", "inodes max", g->inodes_max},
	};
	const int prom = format == KC_STATS_PROMETHEUS;
	size_t used = 0;
	/* The histogram as one snapshot: +Inf equals _count, buckets never decrease. */
	unsigned long long runs, buckets[KC_STATS_NBUCKETS], usec;
	pthread_mutex_lock((pthread_mutex_t *)&s->hist_lock);
	runs = s->compile_runs;
	usec = s->compile_usec;
	for (int b = 0; b < KC_STATS_NBUCKETS; b++)
		buckets[b] = s->compile_buckets[b];
	pthread_mutex_unlock((pthread_mutex_t *)&s->hist_lock);

	if (!prom)
		putf(buf, len, &used, "kcachefs %s, arch %s, compiler %s%s%s\n", info->version,
		     info->arch, info->compiler, info->flags[0] ? ", flags " : "", info->flags);
	for (size_t i = 0; i < sizeof(m) / sizeof(m[0]); i++) {
		if (prom)
			putf(buf, len, &used, "# HELP %s %s\n# TYPE %s %s\n%s %llu\n", m[i].name,
			     m[i].help, m[i].name, m[i].type, m[i].name, m[i].value);
		else
			putf(buf, len, &used, "%-20s %llu\n", m[i].label, m[i].value);
	}
	/* The compile duration histogram (cumulative buckets, as Prometheus wants). */
	const char *h = "kcachefs_compile_duration_seconds";
	double sum = (double)usec / 1e6;
	if (prom)
		putf(buf, len, &used, "# HELP %s Wall time of compiler runs.\n# TYPE %s histogram\n",
		     h, h);
	else
		putf(buf, len, &used, "%-20s %.3f s in %llu runs; runs of at most", "compile time", sum,
		     runs);
	for (int b = 0; b <= KC_STATS_NBUCKETS; b++) {
		unsigned long long n = b < KC_STATS_NBUCKETS ? buckets[b] : runs;
		char le[16];
		if (b < KC_STATS_NBUCKETS)
			snprintf(le, sizeof(le), "%g", bucket_bounds[b]);
		if (prom)
			putf(buf, len, &used, "%s_bucket{le=\"%s\"} %llu\n", h,
			     b < KC_STATS_NBUCKETS ? le : "+Inf", n);
		else if (b < KC_STATS_NBUCKETS)
			putf(buf, len, &used, "%s %s s: %llu", b ? "," : "", le, n);
	}
	if (prom)
		putf(buf, len, &used, "%s_sum %.6f\n%s_count %llu\n", h, sum, h, runs);
	else
		put(buf, len, &used, "\n");
	if (prom) {
		static const char *const labels[] = {",version=\"", "\",compiler=\"", "\",arch=\"",
						     "\",flags=\""};
		const char *values[] = {info->version, info->compiler, info->arch, info->flags};
		put(buf, len, &used, "# HELP kcachefs_info The mount's version, and the compiler, "
				     "target architecture and flags that are part of every recipe.\n"
				     "# TYPE kcachefs_info gauge\nkcachefs_info{");
		for (int i = 0; i < 4; i++) {
			put(buf, len, &used, labels[i] + (i == 0));
			put_label(buf, len, &used, values[i] ? values[i] : "");
		}
		put(buf, len, &used, "\"} 1\n");
	}
	if (len)
		buf[used < len ? used : len - 1] = '\0';
	return used;
}

void kc_stats_observe_compile(struct kc_stats *s, double seconds)
{
	pthread_mutex_lock(&s->hist_lock);
	atomic_fetch_add(&s->compile_usec, (uint64_t)(seconds * 1e6));
	for (int b = 0; b < KC_STATS_NBUCKETS; b++)
		if (seconds <= bucket_bounds[b])
			atomic_fetch_add(&s->compile_buckets[b], 1);
	atomic_fetch_add(&s->compile_runs, 1);
	pthread_mutex_unlock(&s->hist_lock);
}

void kc_stats_reset(struct kc_stats *s)
{
	atomic_uint_fast64_t *all[] = {
		&s->hits, &s->misses, &s->waits, &s->cubin_opens, &s->compiles,
		&s->compile_failures, &s->rejected_lookups, &s->corrupt, &s->published_bytes,
		&s->compile_usec, &s->stages, &s->stage_refusals, &s->compile_timeouts,
		&s->compile_runs, &s->evictions, &s->evicted_bytes, &s->remote_hits,
		&s->remote_misses, &s->remote_puts, &s->remote_get_errors, &s->remote_put_errors,
		&s->remote_lease_errors, &s->remote_rejected, &s->remote_foreign_paths,
		&s->remote_lease_waits,
		&s->remote_takeovers, &s->remote_hedged, &s->remote_bytes_in, &s->remote_bytes_out,
		&s->remote_fetch_usec, &s->remote_fetches, &s->remote_lookups,
	};
	pthread_mutex_lock(&s->hist_lock);
	for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
		atomic_store(all[i], 0);
	for (int b = 0; b < KC_STATS_NBUCKETS; b++)
		atomic_store(&s->compile_buckets[b], 0);
	pthread_mutex_unlock(&s->hist_lock);
}
