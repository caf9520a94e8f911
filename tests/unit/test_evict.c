/* test_evict.c - the index of published entries and the cleaner, without FUSE. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#include "evict.h"
#include "tap.h"

static char root[64];
static char evicted[8][256];
static int nevicted;

static void on_evicted(void *arg, const char *rel)
{
	(void)arg;
	if (nevicted < 8)
		snprintf(evicted[nevicted++], sizeof(evicted[0]), "%s", rel);
}

static int count_dir(const char *path)
{
	DIR *d = opendir(path);
	struct dirent *de;
	int n = 0;
	while (d && (de = readdir(d)) != NULL)
		n += de->d_name[0] != '.';
	if (d)
		closedir(d);
	return d ? n : -1;
}

static void test_parse_size(void)
{
	uint64_t v = 0;
	CHECK(kc_parse_size("4096", &v) == 0 && v == 4096, "size: bytes");
	CHECK(kc_parse_size("20G", &v) == 0 && v == 20ull << 30, "size: G suffix");
	CHECK(kc_parse_size("512k", &v) == 0 && v == 512ull << 10, "size: k suffix");
	CHECK(kc_parse_size("1T", &v) == 0 && v == 1ull << 40, "size: T suffix");
	const char *bad[] = {"", "0", "-1G", "10X", "1GB", "G", " 1", "99999999999999999999",
			     "17179869184G"};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		char what[64];
		snprintf(what, sizeof(what), "size: '%s' refused", bad[i]);
		CHECK(kc_parse_size(bad[i], &v) == -EINVAL, what);
	}
}

/* cache/kernel.k<i>.<32 hex>, with a cubin of bytes bytes (none if 0), last used at used
 * (seconds since the epoch; 0: no record). */
static void make_entry(int i, size_t bytes, long used)
{
	char path[256];
	snprintf(path, sizeof(path), "%s/cache/kernel.k%d.%032x", root, i, i);
	mkdir(path, 0755);
	if (bytes) {
		char file[300];
		snprintf(file, sizeof(file), "%s/kernel.cubin", path);
		FILE *f = fopen(file, "w");
		for (size_t n = 0; f && n < bytes; n++)
			fputc('x', f);
		if (f)
			fclose(f);
	}
	if (used) {
		char v[32];
		int n = snprintf(v, sizeof(v), "%ld", used);
		setxattr(path, "user.kcachefs.used", v, (size_t)n, 0);
	}
}

static int entry_exists(int i)
{
	char path[256];
	snprintf(path, sizeof(path), "%s/cache/kernel.k%d.%032x", root, i, i);
	return access(path, F_OK) == 0;
}

static void entry_id(int i, dev_t *dev, ino_t *ino)
{
	char path[256];
	struct stat st;
	snprintf(path, sizeof(path), "%s/cache/kernel.k%d.%032x", root, i, i);
	stat(path, &st);
	*dev = st.st_dev;
	*ino = st.st_ino;
}

/* A cleaner on the test's store, with the flight table and counters it reports to. */
struct rig {
	struct kc_flight_table flights;
	struct kc_stats stats;
	struct kc_evict e;
	struct kc_evict_stats es;
};

/* Set up r with kc_evict_init's bounds (0: none); the cleaner thread is not started. */
static void rig_init(struct rig *r, struct kc_store *s, uint64_t max_bytes, uint64_t max_entries)
{
	memset(r, 0, sizeof(*r));
	kc_flight_table_init(&r->flights);
	kc_evict_init(&r->e, s, &r->flights, &r->stats, max_bytes, max_entries);
}

static void rig_destroy(struct rig *r)
{
	kc_evict_destroy(&r->e);
	kc_flight_table_destroy(&r->flights);
}

static void test_index(struct kc_store *s)
{
	struct rig r;
	char path[256];

	rig_init(&r, s, 0, 0);
	snprintf(path, sizeof(path), "%s/cache", root);
	int cache = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
	make_entry(1, 100, 0);
	make_entry(2, 0, 0);
	mkdir(strcat(path, "/plain"), 0755);
	kc_evict_note(&r.e, cache, "kernel.k1.00000000000000000000000000000001");
	kc_evict_note(&r.e, cache, "kernel.k2.00000000000000000000000000000002");
	kc_evict_note(&r.e, cache, "plain");
	kc_evict_note(&r.e, cache, "absent");
	kc_evict_sample(&r.e, &r.es);
	CHECK(r.es.entries == 1 && r.es.bytes == 100,
	      "note: an entry with a cubin is indexed; one without, a plain directory and a "
	      "missing name are not");
	make_entry(1, 0, 0);
	snprintf(path, sizeof(path), "%s/cache/kernel.k1.%032x/kernel.cu", root, 1);
	FILE *f = fopen(path, "w");
	fputs("source", f);
	fclose(f);
	kc_evict_note(&r.e, cache, "kernel.k1.00000000000000000000000000000001");
	kc_evict_sample(&r.e, &r.es);
	CHECK(r.es.entries == 1 && r.es.bytes == 106, "note: bytes are every regular file's");
	snprintf(path, sizeof(path), "%s/cache/kernel.k1.%032x/kernel.cubin", root, 1);
	unlink(path);
	kc_evict_note(&r.e, cache, "kernel.k1.00000000000000000000000000000001");
	kc_evict_sample(&r.e, &r.es);
	CHECK(r.es.entries == 0 && r.es.bytes == 0, "note: an entry that lost its cubin leaves");
	/* more names than one read of the directory returns (4 KB, 42 of these) */
	make_entry(3, 10, 0);
	for (int i = 0; i < 150; i++) {
		snprintf(path, sizeof(path), "%s/cache/kernel.k3.%032x/extra-%03d-%0*d", root, 3, i,
			 60, 0);
		FILE *x = fopen(path, "w");
		if (x) {
			fputc('x', x);
			fclose(x);
		}
	}
	kc_evict_note(&r.e, cache, "kernel.k3.00000000000000000000000000000003");
	kc_evict_sample(&r.e, &r.es);
	CHECK(r.es.entries == 1 && r.es.bytes == 160,
	      "note: every file of an entry counted, past the first read of its directory");
	close(cache);
	rig_destroy(&r);
	snprintf(path, sizeof(path), "%s/cache/kernel.k3.%032x", root, 3);
	kc_store_remove_tree(path); /* the cleaner's test counts the entries there */
}

/* Whether entry i carries a last use (user.kcachefs.used). */
static int has_used_record(int i)
{
	char path[256], v[32];
	snprintf(path, sizeof(path), "%s/cache/kernel.k%d.%032x", root, i, i);
	return getxattr(path, "user.kcachefs.used", v, sizeof(v)) > 0;
}

/* A use is written at most hourly; the cubin's mtime stands for the last use until then
 * (as a restart reads it back), so a cubin just published is not written to at its first
 * lookups, and one published long ago with no record is, at its first. */
static void test_last_use(struct kc_store *s)
{
	struct rig r;
	char path[256];
	dev_t dev;
	ino_t ino;

	rig_init(&r, s, 0, 0);
	snprintf(path, sizeof(path), "%s/cache", root);
	int cache = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
	make_entry(30, 100, 0);
	make_entry(31, 100, 0);
	snprintf(path, sizeof(path), "%s/cache/kernel.k31.%032x/kernel.cubin", root, 31);
	struct timespec old[2] = {{.tv_sec = time(NULL) - 7200}, {.tv_sec = time(NULL) - 7200}};
	utimensat(AT_FDCWD, path, old, 0);
	kc_evict_note(&r.e, cache, "kernel.k30.0000000000000000000000000000001e");
	kc_evict_note(&r.e, cache, "kernel.k31.0000000000000000000000000000001f");
	entry_id(30, &dev, &ino);
	kc_evict_touch(&r.e, dev, ino);
	CHECK(!has_used_record(30), "last use: a cubin published now is not written to at its "
				    "first lookup (its mtime stands for the use)");
	entry_id(31, &dev, &ino);
	kc_evict_touch(&r.e, dev, ino);
	CHECK(has_used_record(31), "last use: one published two hours ago with no record is "
				   "written at its first lookup");
	close(cache);
	rig_destroy(&r);
	for (int i = 30; i <= 31; i++) {
		snprintf(path, sizeof(path), "%s/cache/kernel.k%d.%032x", root, i, i);
		kc_store_remove_tree(path);
	}
}

static void test_cleaner(struct kc_store *s)
{
	struct rig r;
	long now = (long)time(NULL);

	/* Entries 10..16, used in that order long ago; 11 is being staged, 12 compiling. */
	for (int i = 10; i <= 16; i++)
		make_entry(i, 1000, now - 1000 + i);
	rig_init(&r, s, 0, 4);
	r.e.evicted = on_evicted;
	dev_t dev;
	ino_t ino;
	entry_id(11, &dev, &ino);
	CHECK(kc_evict_pin(&r.e, dev, ino) == 0, "pin an entry being staged");
	entry_id(12, &dev, &ino);
	struct kc_flight_key key = {dev, ino};
	CHECK(kc_flight_join(&r.flights, &key, NULL, NULL, NULL) == KC_FLIGHT_LEADER,
	      "a compile in flight on another");
	entry_id(15, &dev, &ino);
	CHECK(kc_evict_start(&r.e) == 0, "start the cleaner");
	for (int t = 0; t < 500; t++) {
		kc_evict_sample(&r.e, &r.es);
		if (r.es.scanned && r.stats.evictions >= 3)
			break;
		usleep(10000);
	}
	usleep(100000);
	kc_evict_sample(&r.e, &r.es);
	/* 7 > 4: down to 90 % of 4, rounded up (4); 11 and 12 may not go: 10, 13, 14 go. */
	CHECK(r.es.entries == 4 && r.stats.evictions == 3 && r.stats.evicted_bytes == 3000,
	      "cleaner: evicted down to the low watermark");
	CHECK(!entry_exists(10) && entry_exists(11) && entry_exists(12) && !entry_exists(13) &&
		      !entry_exists(14) && entry_exists(15) && entry_exists(16),
	      "cleaner: the least recently used went; staged and compiling ones stayed");
	CHECK(nevicted == 3 && strcmp(evicted[0], "cache/kernel.k10.0000000000000000000000000000000a") == 0,
	      "cleaner: each eviction is reported with its path, oldest first");
	char tmp[256];
	snprintf(tmp, sizeof(tmp), "%s/.kcachefs/tmp", root);
	CHECK(count_dir(tmp) == 0, "cleaner: nothing of an evicted entry stays in tmp/");
	/* Used now: not a victim within the grace period, even when the oldest by record. */
	make_entry(20, 1000, now - 5000);
	int cache = open(strcat(strcpy(tmp, root), "/cache"), O_PATH | O_DIRECTORY | O_CLOEXEC);
	kc_evict_note(&r.e, cache, "kernel.k20.00000000000000000000000000000014");
	usleep(300000);
	CHECK(entry_exists(20), "cleaner: an entry published just now is kept (grace)");
	close(cache);
	kc_evict_stop(&r.e);
	kc_flight_finish(&r.flights, &key, 0);
	entry_id(11, &dev, &ino);
	kc_evict_unpin(&r.e, dev, ino);
	rig_destroy(&r);
}

/* Entries whose parent was renamed after they were indexed, and an entry inside an entry:
 * the cleaner finds them by handle, and drops what went with an evicted parent. */
static void test_moves(struct kc_store *s)
{
	struct rig r;
	char a[256], b[256];
	long now = (long)time(NULL);

	snprintf(a, sizeof(a), "%s/old", root);
	mkdir(a, 0755);
	for (int i = 30; i < 33; i++) {
		char p[300];
		snprintf(p, sizeof(p), "%s/old/kernel.m%d.%032x", root, i, i);
		mkdir(p, 0755);
		strcat(p, "/kernel.cubin");
		FILE *f = fopen(p, "w");
		fputs("cubin", f);
		fclose(f);
		setxattr(p, "user.kcachefs.used", "1", 1, 0); /* ignored: on the file */
	}
	/* kernel.m31 holds an entry of its own */
	char inner[400];
	snprintf(inner, sizeof(inner), "%s/old/kernel.m31.%032x/kernel.in.%032x", root, 31, 99);
	mkdir(inner, 0755);
	strcat(inner, "/kernel.cubin");
	FILE *f = fopen(inner, "w");
	fputs("cubin", f);
	fclose(f);
	rig_init(&r, s, 0, 100);
	int dir = open(a, O_PATH | O_DIRECTORY | O_CLOEXEC);
	for (int i = 30; i < 33; i++) {
		char name[64];
		snprintf(name, sizeof(name), "kernel.m%d.%032x", i, i);
		kc_evict_note(&r.e, dir, name);
	}
	snprintf(inner, sizeof(inner), "%s/old/kernel.m31.%032x", root, 31);
	int outer = open(inner, O_PATH | O_DIRECTORY | O_CLOEXEC);
	char in_name[64];
	snprintf(in_name, sizeof(in_name), "kernel.in.%032x", 99);
	kc_evict_note(&r.e, outer, in_name);
	close(outer);
	close(dir);
	kc_evict_sample(&r.e, &r.es);
	CHECK(r.es.entries == 4, "moves: four entries indexed");
	CHECK(kc_evict_start(&r.e) == 0, "moves: start the cleaner");
	for (int t = 0; t < 300 && !r.es.scanned; t++) {
		usleep(10000);
		kc_evict_sample(&r.e, &r.es);
	}
	/* After the scan: only the handles know where they are now. */
	snprintf(b, sizeof(b), "%s/new", root);
	CHECK(rename(a, b) == 0, "moves: their parent renamed behind the index");
	(void)now;
	usleep(2100000); /* past the grace of their publish */
	pthread_mutex_lock(&r.e.lock);
	r.e.max_entries = 1;
	pthread_mutex_unlock(&r.e.lock);
	kc_ticker_wake(&r.e.cleaner);
	for (int t = 0; t < 300; t++) {
		kc_evict_sample(&r.e, &r.es);
		if (r.es.scanned && r.es.entries <= 1)
			break;
		usleep(10000);
	}
	usleep(200000);
	kc_evict_sample(&r.e, &r.es);
	CHECK(r.es.entries <= 1 && count_dir(b) <= 1,
	      "moves: entries under the renamed parent are found and evicted; the one inside "
	      "an evicted entry leaves the index");
	rig_destroy(&r);
}

int main(void)
{
	struct kc_store s;
	char why[512], path[128];

	test_parse_size();
	strcpy(root, "/tmp/kc-test-evict.XXXXXX");
	if (!mkdtemp(root)) {
		perror("mkdtemp");
		return 1;
	}
	snprintf(path, sizeof(path), "%s/cache", root);
	mkdir(path, 0755);
	if (kc_store_open(&s, root, why, sizeof(why)) == 0) {
		test_index(&s);
		test_last_use(&s);
		test_cleaner(&s);
		test_moves(&s);
		kc_store_close(&s);
	} else {
		CHECK(0, "open the store");
		printf("# %s\n", why);
	}
	CHECK(kc_store_remove_tree(root) == 0, "remove the test directory");
	return tap_done();
}
