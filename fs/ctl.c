/* ctl.c - the reserved .kcachefs/ directory at the mount root: statistics for people
 * (stats) and for Prometheus (metrics.prom). The directory and its files are virtual;
 * nothing under it touches the backing store. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fs.h"
#include "kc_build.h"
#include "log.h"

void kc_ctl_attr(struct kc_fs *fs, const struct kc_inode *in, struct stat *st)
{
	memset(st, 0, sizeof(*st));
	st->st_ino = 1 + in->virt; /* shown by stat(1) only */
	st->st_uid = getuid();
	st->st_gid = getgid();
	if (in->virt == KC_VIRT_CTL_DIR) {
		st->st_mode = S_IFDIR | 0555;
		st->st_nlink = 2;
	} else {
		/* The daemon's user may truncate stats, which zeroes the counters. */
		st->st_mode = S_IFREG | (in->virt == KC_VIRT_STATS ? 0644 : 0444);
		st->st_nlink = 1;
		st->st_size = 0; /* read with direct I/O: the size is what read returns */
	}
	st->st_mtim = st->st_ctim = st->st_atim = fs->started;
}

char *kc_ctl_stats_text(struct kc_fs *fs, const struct kc_inode *in, size_t *len)
{
	enum kc_stats_format format = in->virt == KC_VIRT_METRICS ? KC_STATS_PROMETHEUS
								   : KC_STATS_TEXT;
	struct kc_stats_gauges g = {0};
	struct kc_evict_stats es;
	kc_cache_gauges(&fs->cache, &g);
	g.parked = __atomic_load_n(&fs->parked, __ATOMIC_RELAXED);
	g.inodes = kc_inode_count(&fs->inodes);
	g.inodes_max = fs->inodes.max;
	g.reliefs = __atomic_load_n(&fs->notifier.reliefs, __ATOMIC_RELAXED);
	kc_evict_sample(&fs->evict, &es);
	g.entries = es.entries;
	g.stored_bytes = es.bytes;
	g.max_bytes = fs->evict.max_bytes;
	g.max_entries = fs->evict.max_entries;
	char compiler[KC_COMPILER_ID_MAX];
	kc_config_compiler_id(&fs->cfg, compiler);
	struct kc_stats_info info = {KC_VERSION, compiler, fs->cfg.arch,
				     fs->cfg.flags ? fs->cfg.flags : ""};
	/* One rendering that fits, never two of which the second may grow (a counter gaining
	 * a digit meanwhile would cut the text). */
	for (size_t cap = 8192;; cap *= 2) {
		char *buf = malloc(cap);
		if (!buf)
			return NULL;
		*len = kc_stats_render(&fs->cache.stats, &g, &info, format, buf, cap);
		if (*len < cap)
			return buf;
		free(buf);
	}
}

void kc_ctl_reset(struct kc_fs *fs)
{
	kc_stats_reset(&fs->cache.stats);
	__atomic_store_n(&fs->notifier.reliefs, 0, __ATOMIC_RELAXED);
	kc_log(KC_LOG_INFO, "statistics reset");
}
