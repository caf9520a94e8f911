/* stats.c - see stats.h */
#include "stats.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* The groups of the text for people, in order, as ccache -s groups its figures. */
enum group { G_LOCAL, G_COMPILES, G_AHEAD, G_REMOTE, G_EVICTION, G_INODES, G_COUNT };

static const char *const group_title[G_COUNT] = {
	"local cache", "compiles", "compile ahead", "cluster store", "eviction", "inodes",
};

struct metric {
	enum group group;
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
		{G_LOCAL, "kcachefs_hits_total", "counter", "Cubin lookups served from a published cubin.", "hits", s->hits},
		{G_LOCAL, "kcachefs_misses_total", "counter", "Cubin lookups that started a compile.", "misses", s->misses},
		{G_LOCAL, "kcachefs_waits_total", "counter", "Requests (lookup, getattr, open) of a compiling cubin that joined its compile.", "waiters", s->waits},
		{G_LOCAL, "kcachefs_cubin_opens_total", "counter", "Opens of published cubins.", "cubin opens", s->cubin_opens},
		{G_LOCAL, "kcachefs_rejected_lookups_total", "counter", "Lookups answered EIO without a compile: a remembered rejection, a retry hold-off, or a key the entry's name does not give (verify_keys).", "rejected lookups", s->rejected_lookups},
		{G_LOCAL, "kcachefs_corrupt_cubins_total", "counter", "Published cubins whose SHA-256 did not match.", "corrupt cubins", s->corrupt},
		{G_LOCAL, "kcachefs_stages_total", "counter", "Staged files committed (kernel.cu, kernel.flags, kernel.cubin).", "stages", s->stages},
		{G_LOCAL, "kcachefs_stage_refusals_total", "counter", "Staged files refused.", "stages refused", s->stage_refusals},
		{G_LOCAL, "kcachefs_entries", "gauge", "Published entries in the store.", "entries", g->entries},
		{G_LOCAL, "kcachefs_stored_bytes", "gauge", "Bytes of the published entries (their regular files).", "bytes stored", g->stored_bytes},
		{G_COMPILES, "kcachefs_compiles_total", "counter", "Compiler runs that published a cubin.", "ok", s->compiles},
		{G_COMPILES, "kcachefs_compile_failures_total", "counter", "Compiler runs that failed (timeouts included).", "failed", s->compile_failures},
		{G_COMPILES, "kcachefs_compile_timeouts_total", "counter", "Compiler runs killed at compile_timeout.", "timed out", s->compile_timeouts},
		{G_COMPILES, "kcachefs_published_bytes_total", "counter", "Bytes of cubins published by compiles.", "bytes published", s->published_bytes},
		{G_COMPILES, "kcachefs_compiles_in_flight", "gauge", "Compiler runs in progress.", "in flight", g->inflight},
		{G_COMPILES, "kcachefs_compiles_queued", "gauge", "Compiles waiting for a job slot.", "queued", g->queued},
		{G_COMPILES, "kcachefs_flights", "gauge", "Entries with a compile in flight or queued.", "flights", g->flights},
		{G_COMPILES, "kcachefs_parked_requests", "gauge", "Requests waiting for a compile, not yet answered.", "parked requests", g->parked},
		{G_REMOTE, "kcachefs_remote_up", "gauge", "1 when a cluster store is set (-o remote=) and answers, else 0.", "up", g->remote_up},
		{G_REMOTE, "kcachefs_remote_hits_total", "counter", "Compiles answered by a verified object of the cluster store.", "hits", s->remote_hits},
		{G_REMOTE, "kcachefs_remote_misses_total", "counter", "Compiles that found no object in the cluster store and compiled here.", "misses", s->remote_misses},
		{G_REMOTE, "kcachefs_remote_puts_total", "counter", "Objects (cubins and header indexes) stored in the cluster store.", "puts", s->remote_puts},
		{G_REMOTE, "kcachefs_remote_get_errors_total", "counter", "Cluster store faults of gets (each a miss).", "get errors", s->remote_get_errors},
		{G_REMOTE, "kcachefs_remote_put_errors_total", "counter", "Cluster store faults of puts.", "put errors", s->remote_put_errors},
		{G_REMOTE, "kcachefs_remote_lease_errors_total", "counter", "Cluster store faults of lease operations.", "lease errors", s->remote_lease_errors},
		{G_REMOTE, "kcachefs_remote_rejected_total", "counter", "Objects of the cluster store refused by verification (never served).", "rejected", s->remote_rejected},
		{G_REMOTE, "kcachefs_remote_foreign_paths_total", "counter", "Fetched cubins that name a file path not on this node: the compiling node's (__FILE__ in device code), accepted unless -o key_paths.", "foreign paths", s->remote_foreign_paths},
		{G_REMOTE, "kcachefs_remote_lease_waits_total", "counter", "Compiles that waited for another node's lease.", "lease waits", s->remote_lease_waits},
		{G_REMOTE, "kcachefs_remote_takeovers_total", "counter", "Leases taken after another holder's expired or was released without an object.", "takeovers", s->remote_takeovers},
		{G_REMOTE, "kcachefs_remote_hedged_total", "counter", "Waits given up after remote_wait: compiled here.", "hedged", s->remote_hedged},
		{G_REMOTE, "kcachefs_remote_bytes_in_total", "counter", "Bytes of objects fetched from the cluster store.", "bytes in", s->remote_bytes_in},
		{G_REMOTE, "kcachefs_remote_bytes_out_total", "counter", "Bytes of objects stored in the cluster store.", "bytes out", s->remote_bytes_out},
		{G_REMOTE, "kcachefs_remote_fetch_microseconds_total", "counter", "Time of the fetches that hit, summed (divide by kcachefs_remote_fetches_total).", "fetch usec", s->remote_fetch_usec},
		{G_REMOTE, "kcachefs_remote_fetches_total", "counter", "Fetches that hit.", "fetches", s->remote_fetches},
		{G_REMOTE, "kcachefs_remote_lookups_total", "counter", "Lookups of a kernel.cubin that waited for its fetch and were answered with the fetched cubin.", "lookups", s->remote_lookups},
		{G_AHEAD, "kcachefs_ahead_triggers_total", "counter", "Compiles of a kernel that another image's history held: its other kernels were planned ahead.", "triggers", s->ahead_triggers},
		{G_AHEAD, "kcachefs_ahead_compiles_total", "counter", "Compiles ahead that published a cubin.", "compiled ahead", s->ahead_compiles},
		{G_AHEAD, "kcachefs_ahead_used_total", "counter", "Compiles a client asked for that a compile ahead answered (published, or joined while it ran).", "used", s->ahead_used},
		{G_AHEAD, "kcachefs_ahead_failures_total", "counter", "Compiles ahead that failed (the client's own compile is not affected).", "failed", s->ahead_failures},
		{G_AHEAD, "kcachefs_ahead_queued", "gauge", "Compiles ahead waiting for an idle job slot.", "queued", g->ahead_queued},
		{G_AHEAD, "kcachefs_ahead_running", "gauge", "Compiles ahead running.", "running", g->ahead_running},
		{G_AHEAD, "kcachefs_ahead_unused", "gauge", "Compiles ahead of this mount that no client asked for (yet).", "never asked", g->ahead_unused},
		{G_AHEAD, "kcachefs_ahead_unused_milliseconds", "gauge", "Compiler time of those, milliseconds: the CPU they cost so far.", "never asked ms", (unsigned long long)(g->ahead_unused_seconds * 1000)},
		{G_EVICTION, "kcachefs_evictions_total", "counter", "Entries evicted to stay under max_size and max_entries.", "evictions", s->evictions},
		{G_EVICTION, "kcachefs_evicted_bytes_total", "counter", "Bytes of the entries evicted.", "bytes evicted", s->evicted_bytes},
		{G_EVICTION, "kcachefs_max_size_bytes", "gauge", "The bound on kcachefs_stored_bytes (-o max_size; 0: none).", "max size", g->max_bytes},
		{G_EVICTION, "kcachefs_max_entries", "gauge", "The bound on kcachefs_entries (-o max_entries; 0: none).", "max entries", g->max_entries},
		{G_INODES, "kcachefs_inodes", "gauge", "Inodes the kernel holds (each keeps a descriptor open).", "held", g->inodes},
		{G_INODES, "kcachefs_inodes_max", "gauge", "Inodes kept before the kernel is asked to forget the least recently used (-o max_inodes).", "max", g->inodes_max},
		{G_INODES, "kcachefs_inode_reliefs_total", "counter", "Times the kernel was asked to forget inodes to stay under kcachefs_inodes_max.", "reliefs", g->reliefs},
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

	const char *h = "kcachefs_compile_duration_seconds";
	double sum = (double)usec / 1e6;
	if (prom) {
		for (size_t i = 0; i < sizeof(m) / sizeof(m[0]); i++)
			putf(buf, len, &used, "# HELP %s %s\n# TYPE %s %s\n%s %llu\n", m[i].name,
			     m[i].help, m[i].name, m[i].type, m[i].name, m[i].value);
		/* The compile duration histogram (cumulative buckets, as Prometheus wants). */
		putf(buf, len, &used, "# HELP %s Wall time of compiler runs.\n# TYPE %s histogram\n",
		     h, h);
		for (int b = 0; b <= KC_STATS_NBUCKETS; b++) {
			char le[16] = "+Inf";
			if (b < KC_STATS_NBUCKETS)
				snprintf(le, sizeof(le), "%g", bucket_bounds[b]);
			putf(buf, len, &used, "%s_bucket{le=\"%s\"} %llu\n", h, le,
			     b < KC_STATS_NBUCKETS ? buckets[b] : runs);
		}
		putf(buf, len, &used, "%s_sum %.6f\n%s_count %llu\n", h, sum, h, runs);
	} else {
		/* put, not putf: a compiler identity may be longer than putf's line */
		const char *head[] = {"kcachefs ", info->version, ", arch ", info->arch,
				      ", compiler ", info->compiler, info->flags[0] ? ", flags " : "",
				      info->flags, "\n"};
		for (size_t i = 0; i < sizeof(head) / sizeof(head[0]); i++)
			put(buf, len, &used, head[i]);
		/* A group of a feature that is off is left out: the cluster store without
		 * -o remote=, eviction without a bound (unless it evicted before one went). */
		int shown[G_COUNT] = {1, 1, g->ahead_set, g->remote_set,
				      g->max_bytes || g->max_entries || s->evictions, 1};
		for (int grp = 0; grp < G_COUNT; grp++) {
			if (!shown[grp])
				continue;
			putf(buf, len, &used, "%s:\n", group_title[grp]);
			for (size_t i = 0; i < sizeof(m) / sizeof(m[0]); i++)
				if (m[i].group == (enum group)grp)
					putf(buf, len, &used, "  %-18s %llu\n", m[i].label, m[i].value);
			if (grp != G_COMPILES)
				continue;
			putf(buf, len, &used, "  %-18s %.3f s in %llu runs; runs of at most", "time",
			     sum, runs);
			for (int b = 0; b < KC_STATS_NBUCKETS; b++)
				putf(buf, len, &used, "%s %g s: %llu", b ? "," : "", bucket_bounds[b],
				     buckets[b]);
			put(buf, len, &used, "\n");
		}
	}
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
		&s->remote_fetch_usec, &s->remote_fetches, &s->remote_lookups, &s->ahead_triggers,
		&s->ahead_compiles, &s->ahead_used, &s->ahead_failures,
	};
	pthread_mutex_lock(&s->hist_lock);
	for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
		atomic_store(all[i], 0);
	for (int b = 0; b < KC_STATS_NBUCKETS; b++)
		atomic_store(&s->compile_buckets[b], 0);
	pthread_mutex_unlock(&s->hist_lock);
}
