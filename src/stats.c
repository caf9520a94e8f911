/* stats.c - see stats.h */
#include "stats.h"

#include <stdio.h>
#include <string.h>

struct metric {
	const char *name, *type, *help;
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

size_t kc_stats_render(const struct kc_stats *s, const struct kc_stats_gauges *g,
		       const struct kc_stats_info *info, char *buf, size_t len)
{
	static const struct metric m[] = {
		{"kcachefs_hits_total", "counter", "Cubin lookups served from a published cubin."},
		{"kcachefs_misses_total", "counter", "Cubin lookups that started a compile."},
		{"kcachefs_waits_total", "counter", "Requests (getattr, open) of a compiling cubin that waited for its compile."},
		{"kcachefs_cubin_opens_total", "counter", "Opens of published cubins."},
		{"kcachefs_compiles_total", "counter", "Compiler runs that published a cubin."},
		{"kcachefs_compile_failures_total", "counter", "Compiler runs that failed."},
		{"kcachefs_rejected_lookups_total", "counter", "Lookups refused by a remembered compile rejection."},
		{"kcachefs_corrupt_cubins_total", "counter", "Published cubins whose SHA-256 did not match."},
		{"kcachefs_published_bytes_total", "counter", "Bytes of cubins published by compiles."},
		{"kcachefs_compile_seconds_total", "counter", "Wall time of all compiler runs."},
		{"kcachefs_stages_total", "counter", "Staged files committed (kernel.cu, kernel.flags, kernel.cubin)."},
		{"kcachefs_stage_refusals_total", "counter", "Staged files refused."},
		{"kcachefs_compiles_in_flight", "gauge", "Compiler runs in progress."},
		{"kcachefs_compiles_queued", "gauge", "Compiles waiting for a job slot."},
		{"kcachefs_flights", "gauge", "Entries with a compile in flight or queued."},
		{"kcachefs_parked_requests", "gauge", "Requests waiting for a compile, not yet answered."},
		{"kcachefs_inodes", "gauge", "Inodes the kernel holds (each keeps a descriptor open)."},
		{"kcachefs_inodes_max", "gauge", "Inodes kept before the kernel is asked to forget the least recently used (-o max_inodes)."},
		{"kcachefs_inode_reliefs_total", "counter", "Times the kernel was asked to forget inodes to stay under kcachefs_inodes_max."},
	};
	double v[] = {
		(double)s->hits, (double)s->misses, (double)s->waits, (double)s->cubin_opens,
		(double)s->compiles,
		(double)s->compile_failures, (double)s->rejected_lookups, (double)s->corrupt,
		(double)s->published_bytes, (double)s->compile_usec / 1e6, (double)s->stages,
		(double)s->stage_refusals, g->inflight, g->queued, g->flights, g->parked, (double)g->inodes,
		(double)g->inodes_max, (double)g->reliefs,
	};
	size_t used = 0;

	for (size_t i = 0; i < sizeof(m) / sizeof(m[0]); i++) {
		char *dst = used < len ? buf + used : NULL;
		int n = snprintf(dst, dst ? len - used : 0,
				 "# HELP %s %s\n# TYPE %s %s\n%s %.*f\n", m[i].name, m[i].help,
				 m[i].name, m[i].type, m[i].name,
				 strcmp(m[i].name, "kcachefs_compile_seconds_total") == 0 ? 6 : 0, v[i]);
		used += (size_t)n;
	}
	static const char *const labels[] = {",version=\"", "\",compiler=\"", "\",arch=\"",
					     "\",flags=\""};
	const char *values[] = {info->version, info->compiler, info->arch, info->flags};
	put(buf, len, &used, "# HELP kcachefs_info The mount's version, and the compiler, target "
			     "architecture and flags that are part of every recipe.\n# TYPE kcachefs_info gauge\n"
			     "kcachefs_info{");
	for (int i = 0; i < 4; i++) {
		put(buf, len, &used, labels[i] + (i == 0));
		put_label(buf, len, &used, values[i] ? values[i] : "");
	}
	put(buf, len, &used, "\"} 1\n");
	if (len)
		buf[used < len ? used : len - 1] = '\0';
	return used;
}
