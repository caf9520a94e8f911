/* test_remote_manifest.c - header manifests from dependency output, and their rehash on
 * another node's files. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "hash.h"
#include "remote_manifest.h"
#include "remote_object.h"
#include "tap.h"
#include "tmptree.h"

static char root[64];

static void put(const char *rel, const char *text, mode_t mode)
{
	tmptree_put(root, rel, text, mode);
}

/* Bytes this process has read so far (rchar in /proc/self/io). Each call reads that file
 * itself, about 100 bytes: see probe_cost. */
static uint64_t bytes_read(void)
{
	char buf[512];
	unsigned long long rchar = 0;
	FILE *f = fopen("/proc/self/io", "r");
	if (!f)
		return 0;
	while (fgets(buf, sizeof(buf), f))
		if (sscanf(buf, "rchar: %llu", &rchar) == 1)
			break;
	fclose(f);
	return rchar;
}

/* Wait (bounded) until the coarse clock is past path's change time, so its hash may be
 * memoized. */
static void behind_clock(const char *path)
{
	struct stat st;
	struct timespec now;
	for (int i = 0; i < 100000 && stat(path, &st) == 0; i++) {
		clock_gettime(CLOCK_REALTIME_COARSE, &now);
		if (now.tv_sec > st.st_ctim.tv_sec ||
		    (now.tv_sec == st.st_ctim.tv_sec && now.tv_nsec > st.st_ctim.tv_nsec))
			return;
		usleep(1000);
	}
}

/* FNV-1a of s, as the memo places a path (remote_manifest.c). */
static uint64_t fnv1a(const char *s)
{
	uint64_t h = 1469598103934665603ull;
	for (const unsigned char *c = (const unsigned char *)s; *c; c++)
		h = (h ^ *c) * 1099511628211ull;
	return h;
}

/* Four headers whose paths fall in one place of the memo (the same FNV-1a modulo 4096,
 * its size) are all memoized: a rehash of a list of them reads none. A direct-mapped memo
 * kept one of them, and read and hashed the other three at every rehash. */
static void memo_ways(void)
{
	enum { NAMES = 20000 };
	static uint16_t slot[NAMES];
	char p[300], deps[2048], why[300], *m = NULL, *m2 = NULL;
	size_t ml = 0, ml2 = 0;
	int pick[4], n = 0;
	tmptree_mkdir(root, "ways");
	for (int i = 0; i < NAMES; i++) {
		snprintf(p, sizeof(p), "%s/ways/h%d.h", root, i);
		slot[i] = (uint16_t)(fnv1a(p) % 4096);
	}
	for (int i = 0; i < NAMES && n < 4; i++) { /* the first slot that 4 names share */
		n = 0;
		for (int k = i; k < NAMES && n < 4; k++)
			if (slot[k] == slot[i])
				pick[n++] = k;
	}
	CHECK(n == 4, "four header paths that share a place in the memo");
	if (n != 4)
		return;
	snprintf(deps, sizeof(deps), "o /proc/self/cwd/kernel.cu\n");
	for (int i = 0; i < 4; i++) {
		snprintf(p, sizeof(p), "ways/h%d.h", pick[i]);
		put(p, "#define W 1\n", 0644);
		snprintf(deps + strlen(deps), sizeof(deps) - strlen(deps), "o %s/%s\n", root, p);
	}
	snprintf(p, sizeof(p), "%s/ways/h%d.h", root, pick[3]);
	behind_clock(p);
	CHECK(kc_manifest_from_trace(deps, strlen(deps), "/proc/self/cwd", NULL, 0, NULL, &m, &ml,
				     why, sizeof(why)) == 0 && ml > 0, "their manifest");
	CHECK(kc_manifest_rehash(m, ml, &m2, &ml2, why, sizeof(why)) == 0, "rehash to memoize");
	free(m2);
	uint64_t read0 = bytes_read(), cost = bytes_read() - read0;
	read0 = bytes_read();
	CHECK(kc_manifest_rehash(m, ml, &m2, &ml2, why, sizeof(why)) == 0 && ml2 == ml &&
		      memcmp(m, m2, ml) == 0, "rehash: the same manifest");
	uint64_t read1 = bytes_read();
	CHECK(read0 && read1 - read0 < cost + 12,
	      "four headers in one place of the memo: all four from the memo, none read");
	free(m2);
	free(m);
}

/* n headers of size bytes each under dir, "// header i" and spaces, listed into list
 * (cap bytes; the digests as another node's, zeros) at *len; want gets the last one's
 * digest. */
static void spread_tree(const char *dir, int n, size_t size, char *list, size_t cap,
			size_t *len, char want[KC_SHA256_HEXLEN + 1])
{
	static char text[4096];
	char p[256];
	tmptree_mkdir(root, dir);
	for (int i = 0; i < n; i++) {
		memset(text, ' ', size);
		memcpy(text, p, (size_t)snprintf(p, sizeof(p), "// header %d", i));
		text[size - 1] = '\n';
		text[size] = '\0';
		snprintf(p, sizeof(p), "%s/h%02d.h", dir, i);
		put(p, text, 0644);
		*len += (size_t)snprintf(list + *len, cap - *len, "%064d %s/%s\n", 0, root, p);
	}
	snprintf(p, sizeof(p), "%s/%s/h%02d.h", root, dir, n - 1);
	behind_clock(p);
	kc_sha256_buf(text, size, want);
}

/* n sparse headers of size bytes, <prefix>0.h and on under root, listed into list (cap
 * bytes) at *len. */
static void sparse_headers(const char *prefix, int n, uint64_t size, char *list, size_t cap,
			   size_t *len)
{
	for (int i = 0; i < n; i++) {
		char p[256];
		snprintf(p, sizeof(p), "%s/%s%d.h", root, prefix, i);
		int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
		if (fd < 0 || ftruncate(fd, (off_t)size) != 0)
			CHECK(0, "spread: a sparse header made");
		if (fd >= 0)
			close(fd);
		*len += (size_t)snprintf(list + *len, cap - *len, "%064d %s\n", 0, p);
	}
}

/* Pin this process to the first k CPUs of all (its affinity). Returns 1 if pinned. */
static int pin_first(const cpu_set_t *all, int k)
{
	cpu_set_t some;
	CPU_ZERO(&some);
	for (int c = 0, n = 0; c < CPU_SETSIZE && n < k; c++)
		if (CPU_ISSET(c, all)) {
			CPU_SET(c, &some);
			n++;
		}
	return sched_setaffinity(0, sizeof(some), &some) == 0;
}

/* A list's first rehash spread over helper threads (kc_manifest_rehash_spread): every
 * header read once, the same manifest as the rehash on one thread, the same errors; on
 * one CPU it is that rehash. */
static void spread(void)
{
	enum { N = 64, SIZE = 1000 };
	static char list[N * 400];
	char why[300], want[KC_SHA256_HEXLEN + 1], *m = NULL, *m1 = NULL;
	size_t len = 0, ml = 0, ml1 = 0;
	spread_tree("spread", N, SIZE, list, sizeof(list), &len, want);
	cpu_set_t all;
	int have = sched_getaffinity(0, sizeof(all), &all) == 0;
	int cpus = have ? CPU_COUNT(&all) : 1;
	unsigned long threads = kc_manifest_spread_threads();
	uint64_t read0 = bytes_read(), cost = bytes_read() - read0;
	read0 = bytes_read();
	int err = kc_manifest_rehash_spread(list, len, &m, &ml, why, sizeof(why));
	uint64_t read1 = bytes_read();
	CHECK(err == 0 && m && strstr(m, want), "spread: a header gets the hash of its bytes");
	if (cpus > 1)
		CHECK(kc_manifest_spread_threads() > threads,
		      "spread: helper threads ran (more than one CPU)");
	CHECK(read1 - read0 >= (uint64_t)N * SIZE && read1 - read0 < (uint64_t)N * SIZE + cost + 12,
	      "spread: each of 64 headers read once");
	read0 = bytes_read();
	err = kc_manifest_rehash(list, len, &m1, &ml1, why, sizeof(why));
	read1 = bytes_read();
	CHECK(err == 0 && ml1 == ml && m && m1 && memcmp(m, m1, ml) == 0 && read1 - read0 < cost + 12,
	      "spread: the rehash on one thread after it gives the same manifest, reading none");
	free(m1);
	m1 = NULL;
	free(m);
	m = NULL;
	read0 = bytes_read();
	err = kc_manifest_rehash_spread(list, len, &m, &ml, why, sizeof(why));
	read1 = bytes_read();
	CHECK(err == 0 && read1 - read0 < cost + 12, "spread: a list the memo holds: none read again");
	free(m);
	m = NULL;

	/* one CPU: no helper, the same manifest */
	static char list1[N * 400];
	size_t len1 = 0;
	char want1[KC_SHA256_HEXLEN + 1];
	spread_tree("spread1", N, SIZE, list1, sizeof(list1), &len1, want1);
	if (have) {
		int pinned = pin_first(&all, 1);
		threads = kc_manifest_spread_threads();
		read0 = bytes_read();
		err = kc_manifest_rehash_spread(list1, len1, &m, &ml, why, sizeof(why));
		read1 = bytes_read();
		int no_helper = kc_manifest_spread_threads() == threads;
		if (pinned)
			sched_setaffinity(0, sizeof(all), &all);
		err = err || kc_manifest_rehash(list1, len1, &m1, &ml1, why, sizeof(why));
		CHECK(pinned && no_helper && err == 0 && m && m1 && ml == ml1 && memcmp(m, m1, ml) == 0 &&
		      strstr(m, want1) && read1 - read0 < (uint64_t)N * SIZE + cost + 12,
		      "spread: on one CPU, no helper, each header read once, the same manifest");
		free(m);
		free(m1);
		m = m1 = NULL;
	}

	/* errors: the first in the list's order, named, as on one thread */
	size_t base = len;
	char gone_[256];
	put("spread/z-private.h", "#define Z 1\n", 0600);
	len += (size_t)snprintf(list + len, sizeof(list) - len, "%064d %s/spread/z-private.h\n", 0,
				root);
	err = kc_manifest_rehash_spread(list, len, &m, &ml, why, sizeof(why));
	CHECK(err == -EACCES && strstr(why, "z-private.h"),
	      "spread: a header not readable by all: EACCES, named");
	free(m);
	m = NULL;
	put("spread/a-fifo.h", "", 0644);
	snprintf(gone_, sizeof(gone_), "%s/spread/a-fifo.h", root);
	unlink(gone_);
	mkfifo(gone_, 0644);
	len += (size_t)snprintf(list + len, sizeof(list) - len, "%064d %s\n", 0, gone_);
	char why1[300] = "";
	err = kc_manifest_rehash_spread(list, len, &m, &ml, why, sizeof(why));
	int err1 = kc_manifest_rehash(list, len, &m1, &ml1, why1, sizeof(why1));
	CHECK(err == -EACCES && err1 == -EACCES && strstr(why, "a-fifo.h") &&
		      strcmp(why, why1) == 0,
	      "spread: two headers that fail: the first's error in the list's order (a fifo)");
	free(m);
	free(m1);
	m = m1 = NULL;
	len = base;
	len += (size_t)snprintf(list + len, sizeof(list) - len, "short\n");
	err = kc_manifest_rehash_spread(list, len, &m, &ml, why, sizeof(why));
	CHECK(err == -EINVAL, "spread: a malformed line: refused (EINVAL)");
	free(m);
	m = NULL;

	/* more than KC_MANIFEST_MAX_TOTAL bytes in all (sparse files): EFBIG, and no thread
	 * reads past it */
	enum { BIG = 10 };
	const uint64_t each = KC_MANIFEST_MAX_HEADER - (4u << 20); /* each may be hashed; 5 pass
								     * the bytes in all */
	static char blist[N * 400 + BIG * 300];
	size_t blen = base; /* after the 64 small ones: helpers to share them */
	memcpy(blist, list, base);
	tmptree_mkdir(root, "big");
	sparse_headers("big/b", BIG, each, blist, sizeof(blist), &blen);
	read0 = bytes_read();
	err = kc_manifest_rehash_spread(blist, blen, &m, &ml, why, sizeof(why));
	read1 = bytes_read();
	CHECK(err == -EFBIG && read1 - read0 <= KC_MANIFEST_MAX_TOTAL,
	      "spread: headers past the bytes in all: EFBIG, none read past them");
	free(m);
	m = NULL;

	/* a header that fails before the big ones: the threads stop taking headers, each
	 * reads at most the one or two it took before it saw the failure */
	size_t glen = base;
	char gone[256];
	snprintf(gone, sizeof(gone), "%s/big/c-private.h", root); /* before c0.h */
	put("big/c-private.h", "#define C 1\n", 0600);
	memcpy(blist, list, base);
	glen += (size_t)snprintf(blist + glen, sizeof(blist) - glen, "%064d %s\n", 0, gone);
	sparse_headers("big/c", BIG, each, blist, sizeof(blist), &glen); /* none in the memo */
	/* at most two threads, so that all 8 the cap lets in are more */
	int pinned = have && pin_first(&all, 2);
	threads = kc_manifest_spread_threads();
	read0 = bytes_read();
	err = kc_manifest_rehash_spread(blist, glen, &m, &ml, why, sizeof(why));
	read1 = bytes_read();
	uint64_t took = kc_manifest_spread_threads() - threads + 1; /* and this thread */
	if (pinned)
		sched_setaffinity(0, sizeof(all), &all);
	CHECK(pinned && took <= 2 && err == -EACCES && strstr(why, "c-private.h") &&
	      read1 - read0 <= 2 * took * each + cost,
	      "spread: after a header fails, the threads stop: EACCES, the big ones mostly unread");
	free(m);
}

/* A header written through a shared writable mapping whose page is already dirty: no stamp
 * moves. The memo keeps no hash while a writer holds the file (its read lease is refused),
 * so the write is seen; once the writer is gone, the hash is kept again, and the next
 * writer's first write through a new mapping moves the stamps. */
static void mapped_writer(void)
{
	char path[256], list[512], *m = NULL, *m2 = NULL, *m3 = NULL, why[300];
	size_t ml = 0, ml2 = 0, ml3 = 0;
	put("mapped.h", "#define M 1\n", 0644);
	snprintf(path, sizeof(path), "%s/mapped.h", root);
	snprintf(list, sizeof(list), "%064d %s\n", 0, path);
	int fd = open(path, O_RDWR);
	char *map = fd >= 0 ? mmap(NULL, 12, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
	CHECK(map != MAP_FAILED, "a writable shared mapping of a header");
	if (map == MAP_FAILED)
		return;
	map[0] = '#'; /* the page dirty: its stamps move once */
	behind_clock(path);
	CHECK(kc_manifest_rehash(list, strlen(list), &m, &ml, why, sizeof(why)) == 0,
	      "rehash while a writer maps it");
	struct stat before, after;
	stat(path, &before);
	map[10] = '9'; /* "#define M 9": through the dirty page */
	stat(path, &after);
	CHECK(before.st_mtim.tv_nsec == after.st_mtim.tv_nsec &&
		      before.st_ctim.tv_nsec == after.st_ctim.tv_nsec && before.st_size == after.st_size,
	      "the write through the dirty page moved no stamp");
	CHECK(kc_manifest_rehash(list, strlen(list), &m2, &ml2, why, sizeof(why)) == 0 &&
		      (ml2 != ml || memcmp(m, m2, ml) != 0),
	      "the next rehash sees the new bytes: no hash was memoized while a writer held it");
	munmap(map, 12);
	close(fd);
	behind_clock(path);
	CHECK(kc_manifest_rehash(list, strlen(list), &m3, &ml3, why, sizeof(why)) == 0 &&
		      ml3 == ml2 && memcmp(m2, m3, ml2) == 0, "the writer gone: the same bytes");
	uint64_t read0 = bytes_read(), cost = bytes_read() - read0;
	free(m3);
	read0 = bytes_read();
	CHECK(kc_manifest_rehash(list, strlen(list), &m3, &ml3, why, sizeof(why)) == 0 &&
		      bytes_read() - read0 < cost + 12, "and from the memo again, not read");
	free(m);
	free(m2);
	free(m3);
}

/* A header whose bytes name __TIMESTAMP__ (here across the 64 KiB read boundary) is
 * evidence with its mtime; one that does not, with its bytes alone. */
static void timestamp_header(void)
{
	static char text[70000];
	char path[256], list[512], *m1 = NULL, *m2 = NULL, why[300];
	size_t l1 = 0, l2 = 0;
	for (int named = 1; named >= 0; named--) {
		memset(text, ' ', sizeof(text) - 1);
		text[sizeof(text) - 1] = '\0';
		if (named)
			memcpy(text + 65530, "__TIMESTAMP__", 13);
		put("stamped.h", text, 0644);
		snprintf(path, sizeof(path), "%s/stamped.h", root);
		snprintf(list, sizeof(list), "%064d %s\n", 0, path);
		utimensat(AT_FDCWD, path, (struct timespec[]){{1000000000, 0}, {1000000000, 0}}, 0);
		CHECK(kc_manifest_rehash(list, strlen(list), &m1, &l1, why, sizeof(why)) == 0, "rehash");
		utimensat(AT_FDCWD, path, (struct timespec[]){{1500000000, 0}, {1500000000, 0}}, 0);
		CHECK(kc_manifest_rehash(list, strlen(list), &m2, &l2, why, sizeof(why)) == 0 &&
			      (l1 == l2 && memcmp(m1, m2, l1) == 0) == !named,
		      named ? "__TIMESTAMP__ across the read boundary: the mtime is evidence"
			    : "no __TIMESTAMP__: touched, the same evidence");
		free(m1);
		free(m2);
		m1 = m2 = NULL;
	}
}

/* A trace names a path at every lookup: 25,000 lines of 40 headers (cc1plus's readlinks of
 * CUB under nvcc 13.0: 22,141 lines, 4,326 paths) make a list of 40; 16,000 distinct paths
 * are kept, 20,001 refused (EFBIG). Each path names nothing, so nothing is hashed. */
static void repeated_lookups(void)
{
	size_t cap = 25000 * 48, len = 0;
	char *trace = malloc(cap), *m = NULL, why[300];
	size_t ml = 0;
	for (int i = 0; trace && i < 25000; i++)
		len += (size_t)snprintf(trace + len, cap - len, "l %s/none/h%02d.h\n", root, i % 40);
	CHECK(trace && kc_manifest_from_trace(trace, len, NULL, NULL, 0, NULL, &m, &ml, why,
					      sizeof(why)) == 0,
	      "25,000 lookups of 40 paths: a manifest");
	size_t lines = 0;
	for (size_t i = 0; m && i < ml; i++)
		lines += m[i] == '\n';
	CHECK(lines == 40, "... of 40 lines, one a path");
	free(m);
	m = NULL;
	len = 0;
	for (int i = 0; trace && i < 16000; i++)
		len += (size_t)snprintf(trace + len, cap - len, "o %s/none/d%05d.h\n", root, i);
	CHECK(trace && kc_manifest_from_trace(trace, len, NULL, NULL, 0, NULL, &m, &ml, why,
					      sizeof(why)) == 0,
	      "16,000 distinct paths: a manifest");
	free(m);
	m = NULL;
	for (int i = 16000; trace && i < 20001; i++)
		len += (size_t)snprintf(trace + len, cap - len, "o %s/none/d%05d.h\n", root, i);
	CHECK(trace && kc_manifest_from_trace(trace, len, NULL, NULL, 0, NULL, &m, &ml, why,
					      sizeof(why)) == -EFBIG && !m,
	      "20,001 distinct paths: refused");
	free(trace);
}

int main(void)
{
	char deps[2048], why[300], want[1024], ha[65], hb[65], tk[128], *m = NULL, *m2 = NULL;
	size_t ml = 0, ml2 = 0;

	if (tmptree_new(root, sizeof(root), "kc-manifest") != 0)
		return 1;
	chmod(root, 0755);
	char d[256];
	tmptree_mkdir(root, "inc");
	tmptree_mkdir(root, "tk");
	tmptree_mkdir(root, "tk/bin");
	snprintf(tk, sizeof(tk), "%s/tk", root);
	put("inc/a.h", "#define A 1\n", 0644);
	put("inc/b c#.h", "#define B 2\n", 0644);
	put("tk/t.h", "#define T 3\n", 0644);
	put("tk/bin/nvcc", "", 0755);
	kc_sha256_buf("#define A 1\n", 12, ha);
	kc_sha256_buf("#define B 2\n", 12, hb);

	tmptree_mkdir(root, "inc/sub");
	snprintf(deps, sizeof(deps),
		 "o /proc/self/cwd/kernel.cu\n"
		 "o %s/inc/b c#.h\ns %s/tk/bin/../t.h\n"
		 "o %s/inc/a.h\no %s/inc/a.h\nx %s/inc/a.h\n"
		 "o %s/inc/none.h\ns %s/inc/a.h/x.h\ns %s/inc/sub\no /dev/zero\n"
		 "o /proc/self/cmdline\n",
		 root, root, root, root, root, root, root, root);
	int err = kc_manifest_from_trace(deps, strlen(deps), "/proc/self/cwd", NULL, 0, NULL, &m, &ml,
					 why, sizeof(why));
	char ht[65];
	kc_sha256_buf("#define T 3\n", 12, ht);
	snprintf(want, sizeof(want),
		 "%s %s/inc/a.h\n%s %s/inc/a.h/x.h\n%s %s/inc/b c#.h\n%s %s/inc/none.h\n"
		 "%s %s/inc/sub\n%s %s/tk/bin/../t.h\n",
		 ha, root, KC_MANIFEST_ABSENT, root, hb, root, KC_MANIFEST_ABSENT, root,
		 KC_MANIFEST_DIRECTORY, root, ht, root);
	CHECK(err == 0 && ml == strlen(want) && memcmp(m, want, ml) == 0,
	      "manifest: every lookup once, sorted, with its outcome (bytes, nothing found, a "
	      "directory); the toolkit's files in it; the source, /dev and /proc left out");
	if (err || ml != strlen(want))
		printf("# %d %s\n# got: %.*s\n# want: %s", err, why, (int)ml, m ? m : "", want);
	CHECK(kc_object_manifest_check(m, ml, why, sizeof(why)) == 0, "it is a valid manifest");

	CHECK(kc_manifest_rehash(m, ml, &m2, &ml2, why, sizeof(why)) == 0 && ml2 == ml &&
		      memcmp(m, m2, ml) == 0, "rehash on the same files: the same manifest");
	free(m2);
	char rflags[1200], path_[256];
	snprintf(rflags, sizeof(rflags), "# include-root %064d %s/inc/\n-I%s/inc/\n", 0, root, root);
	snprintf(want, sizeof(want), "%s %s/tk/bin/../t.h\n", ht, root);
	CHECK(kc_manifest_from_trace(deps, strlen(deps), "/proc/self/cwd", rflags,
				     strlen(rflags), NULL, &m2, &ml2, why, sizeof(why)) == 0 &&
		      ml2 == strlen(want) && memcmp(m2, want, ml2) == 0,
	      "manifest: lookups under an include root named by content are left out");
	free(m2);
	/* a ".." out of the root through a symlink leaves the tree the key holds */
	snprintf(d, sizeof(d), "%s/tk", root);
	snprintf(path_, sizeof(path_), "%s/inc/tklink", root);
	CHECK(symlink(d, path_) == 0, "a symlink in the root to a directory outside it");
	snprintf(deps, sizeof(deps), "o %s/inc/tklink/bin/../t.h\no %s/inc/sub/../a.h\n", root,
		 root);
	snprintf(want, sizeof(want), "%s %s/inc/tklink/bin/../t.h\n", ht, root);
	CHECK(kc_manifest_from_trace(deps, strlen(deps), NULL, rflags, strlen(rflags), NULL, &m2, &ml2,
				     why, sizeof(why)) == 0 &&
		      ml2 == strlen(want) && memcmp(m2, want, ml2) == 0,
	      "manifest: a \"..\" that climbs out of the root through a symlink is listed, one "
	      "that stays in it is not");
	free(m2);
	unlink(path_);
	char compact[KC_MANIFEST_COMPACT_MAX], hx[KC_SHA256_HEXLEN + 1], hm[KC_SHA256_HEXLEN + 1];
	size_t cl = 0;
	CHECK(kc_manifest_compact(m, ml, compact, &cl) == 0 &&
		      kc_manifest_compact_list(compact, cl, hx) == 1 &&
		      kc_sha256_buf(m, ml, hm) == 0 && strcmp(hx, hm) == 0 && cl < 80 &&
		      kc_object_manifest_check(compact, cl, why, sizeof(why)) == 0,
	      "compact manifest: one line naming the full list by its digest");
	CHECK(kc_manifest_compact("", 0, compact, &cl) == 0 && cl == KC_MANIFEST_LINE_LEN &&
		      kc_manifest_compact_list(compact, cl, hx) == 1 &&
		      strcmp(hx, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855") == 0,
	      "compact manifest: no headers, the digest of the empty list");
	CHECK(kc_manifest_compact_list("", 0, hx) == 0, "compact manifest: \"\" names no list");
	CHECK(kc_manifest_compact_list(m, ml, hx) == -EBADMSG,
	      "compact manifest: a full list is not a compact one");
	snprintf(want, sizeof(want), "%s @headers\n%s @headers\n", ha, hb);
	CHECK(kc_object_manifest_check(want, strlen(want), why, sizeof(why)) == 0,
	      "manifest check: an index lists several compact manifests");
	snprintf(want, sizeof(want), "%s @headers\n%s @headers\n", ha, ha);
	CHECK(kc_object_manifest_check(want, strlen(want), why, sizeof(why)) == -EBADMSG,
	      "manifest check: one compact manifest twice is refused");
	snprintf(want, sizeof(want), "%s @headers\n%s /x.h\n", ha, hb);
	CHECK(kc_object_manifest_check(want, strlen(want), why, sizeof(why)) == -EBADMSG,
	      "manifest check: compact and full lines do not mix");
	want[0] = '\0';
	for (int i = 0; i <= KC_MANIFEST_PER_KEY; i++)
		snprintf(want + strlen(want), sizeof(want) - strlen(want), "%063x%d @headers\n", 0, i);
	CHECK(kc_object_manifest_check(want, strlen(want), why, sizeof(why)) == -EBADMSG,
	      "manifest check: at most KC_MANIFEST_PER_KEY manifests per index");

	/* the memo: once the headers' change time is behind the clock, a rehash reads none
	 * (seen as the bytes this process read, /proc/self/io's rchar) */
	uint64_t read0, read1, cost;
	char a_h[256];
	snprintf(a_h, sizeof(a_h), "%s/inc/a.h", root);
	behind_clock(a_h);
	snprintf(d, sizeof(d), "%s/inc/b c#.h", root);
	behind_clock(d);
	CHECK(kc_manifest_rehash(m, ml, &m2, &ml2, why, sizeof(why)) == 0, "rehash to memoize");
	free(m2);
	read0 = bytes_read();
	cost = bytes_read() - read0; /* what one look at /proc/self/io reads (give or take a
				      * digit): each header here is 12 bytes */
	read0 = bytes_read();
	CHECK(kc_manifest_rehash(m, ml, &m2, &ml2, why, sizeof(why)) == 0 && ml2 == ml &&
		      memcmp(m, m2, ml) == 0, "rehash from the memo: the same manifest");
	read1 = bytes_read();
	free(m2);
	CHECK(read0 && read1 - read0 < cost + 12,
	      "unchanged headers: both from the memo, not a header's bytes read");

	put("inc/a.h", "#define A 2\n", 0644); /* same size, same path and inode */
	read0 = bytes_read();
	CHECK(kc_manifest_rehash(m, ml, &m2, &ml2, why, sizeof(why)) == 0 &&
		      (ml2 != ml || memcmp(m, m2, ml) != 0), "a changed header: another manifest");
	read1 = bytes_read();
	CHECK(read1 - read0 >= cost + 12 - 4 && read1 - read0 < cost + 2 * 12,
	      "the changed header hashed anew (its 12 bytes read), the other one from the memo");
	char ha2[65];
	kc_sha256_buf("#define A 2\n", 12, ha2);
	CHECK(m2 && strstr(m2, ha2), "its new hash is that of its new bytes");
	free(m2);
	put("inc/a.h", "#define A 3\n", 0644); /* again at once: maybe in the same clock tick */
	kc_sha256_buf("#define A 3\n", 12, ha2);
	CHECK(kc_manifest_rehash(m, ml, &m2, &ml2, why, sizeof(why)) == 0 && m2 && strstr(m2, ha2),
	      "a header changed twice in a row: the hash of its last bytes");
	free(m2);
	put("inc/a.h", "#define A 1\n", 0644);
	CHECK(kc_manifest_rehash(m, ml, &m2, &ml2, why, sizeof(why)) == 0 && ml2 == ml &&
		      memcmp(m, m2, ml) == 0, "changed back: the first manifest again");
	free(m2);
	put("inc/a.h", "#define A 1\n", 0600);
	CHECK(kc_manifest_rehash(m, ml, &m2, &ml2, why, sizeof(why)) == -EACCES &&
		      strstr(why, "a.h"), "a header not readable by all is not hashed");
	snprintf(d, sizeof(d), "%s/inc/a.h", root);
	unlink(d);
	CHECK(kc_manifest_rehash(m, ml, &m2, &ml2, why, sizeof(why)) == 0 && m2 &&
		      (ml2 != ml || memcmp(m, m2, ml) != 0),
	      "a header gone: another manifest (its lookup finds nothing)");
	free(m2);
	mkdir(d, 0755);
	CHECK(kc_manifest_rehash(m, ml, &m2, &ml2, why, sizeof(why)) == 0 && m2 &&
		      strstr(m2, KC_MANIFEST_DIRECTORY),
	      "a header replaced by a directory: another outcome");
	free(m2);
	rmdir(d);
	snprintf(path_, sizeof(path_), "%s/inc/none.h", root);
	put("inc/none.h", "#define N 1\n", 0644);
	put("inc/a.h", "#define A 1\n", 0644);
	CHECK(kc_manifest_rehash(m, ml, &m2, &ml2, why, sizeof(why)) == 0 && m2 &&
		      (ml2 != ml || memcmp(m, m2, ml) != 0),
	      "a header where the compile found nothing (shadowing, __has_include): another "
	      "manifest");
	free(m2);
	unlink(path_);
	free(m);

	/* a directory read whole: the digest of its names */
	snprintf(deps, sizeof(deps), "d %s/inc\n", root);
	CHECK(kc_manifest_from_trace(deps, strlen(deps), NULL, NULL, 0, NULL, &m, &ml, why,
				     sizeof(why)) == 0 && ml > 0 && m[65] == '+',
	      "a directory read: listed as \"+dir\"");
	put("inc/new.h", "", 0644);
	CHECK(kc_manifest_rehash(m, ml, &m2, &ml2, why, sizeof(why)) == 0 &&
		      (ml2 != ml || memcmp(m, m2, ml) != 0), "a name added: another digest");
	free(m2);
	free(m);

	/* a readlink: the link's target is the outcome, so a re-pointed link is another list */
	char link[300];
	snprintf(link, sizeof(link), "%s/inc/sel", root);
	CHECK(symlink("sub", link) == 0, "a symlink to a directory");
	snprintf(deps, sizeof(deps), "l %s\nl %s/inc/a.h\nl %s/inc/nolink\n", link, root, root);
	CHECK(kc_manifest_from_trace(deps, strlen(deps), NULL, NULL, 0, NULL, &m, &ml, why,
				     sizeof(why)) == 0 && m && m[65] == '>' &&
		      memmem(m, ml, KC_MANIFEST_NOT_LINK, 64) && memmem(m, ml, KC_MANIFEST_ABSENT, 64),
	      "readlinks listed as \">path\": a link's target, not a link, nothing there");
	unlink(link);
	CHECK(symlink("tk", link) == 0 &&
		      kc_manifest_rehash(m, ml, &m2, &ml2, why, sizeof(why)) == 0 &&
		      (ml2 != ml || memcmp(m, m2, ml) != 0), "the link re-pointed: another list");
	free(m2);
	free(m);
	unlink(link);

	/* what /proc, /sys and /dev hold: left out, listed, or refused */
	snprintf(deps, sizeof(deps),
		 "o /dev/null\no /dev/urandom\no /proc/sys/vm/overcommit_memory\no /proc/self/maps\n"
		 "l /proc/self/exe\no /proc/self/cwd/kernel.cu\ns /sys/devices/system/cpu/online\n"
		 "d /proc/self/fd\no /dev/shm/kc-no-such-header.h\n");
	snprintf(want, sizeof(want), "%s /dev/shm/kc-no-such-header.h\n", KC_MANIFEST_ABSENT);
	CHECK(kc_manifest_from_trace(deps, strlen(deps), NULL, NULL, 0, NULL, &m, &ml, why,
				     sizeof(why)) == 0 && ml == strlen(want) && memcmp(m, want, ml) == 0,
	      "devices, the kernel's and the process's state left out; /dev/shm listed");
	free(m);
	const char *opaque[] = {"o /proc/self/root/etc/hostname\n", "o /proc/1/task/1/root/x.h\n",
				"o /proc/self/fd/3\n", "o /dev/fd/3\n", "o /dev/stdin\n",
				"o /proc/self/cwd/../../x.h\n"};
	for (size_t i = 0; i < sizeof(opaque) / sizeof(*opaque); i++) {
		char what[160];
		snprintf(what, sizeof(what), "a way to any file refused: %.*s", (int)strlen(opaque[i]) - 1,
			 opaque[i]);
		CHECK(kc_manifest_from_trace(opaque[i], strlen(opaque[i]), NULL, NULL, 0, NULL, &m, &ml,
					     why, sizeof(why)) == -EACCES, what);
	}
	snprintf(deps, sizeof(deps), "o /tmp/scratch-kc/../x.h\n");
	CHECK(kc_manifest_from_trace(deps, strlen(deps), "/tmp/scratch-kc", NULL, 0, NULL, &m, &ml,
				     why, sizeof(why)) == 0 && ml > 0,
	      "a path that climbs out of the scratch is listed");
	free(m);

	/* a file changed while the compile ran (the clock before it began is later than the
	 * file's ctime): not shared */
	struct timespec since;
	put("inc/late.h", "#define L 1\n", 0644);
	snprintf(deps, sizeof(deps), "o %s/inc/late.h\n", root);
	since = (struct timespec){.tv_sec = 1};
	CHECK(kc_manifest_from_trace(deps, strlen(deps), NULL, NULL, 0, &since, &m, &ml, why,
				     sizeof(why)) == -ESTALE && strstr(why, "late.h") && !m,
	      "a file changed since the compile began: -ESTALE, named");
	clock_gettime(CLOCK_REALTIME, &since);
	since.tv_sec += 5;
	CHECK(kc_manifest_from_trace(deps, strlen(deps), NULL, NULL, 0, &since, &m, &ml, why,
				     sizeof(why)) == 0 && ml > 0, "one unchanged since: listed");
	free(m);

	CHECK(kc_manifest_from_trace("", 0, "/proc/self/cwd", NULL, 0, NULL, &m, &ml, why,
				     sizeof(why)) == 0 && ml == 0, "nothing looked up: an empty manifest");
	free(m);
	const char *rel = "o inc/x.h\n";
	CHECK(kc_manifest_from_trace(rel, strlen(rel), NULL, NULL, 0, NULL, &m, &ml, why, sizeof(why)) ==
		      -EINVAL, "a relative path refused");
	CHECK(kc_manifest_from_trace("garbage", 7, NULL, NULL, 0, NULL, &m, &ml, why, sizeof(why)) ==
		      -EINVAL, "a malformed trace refused");
	snprintf(deps, sizeof(deps), "%s /dev/zero\n", KC_MANIFEST_ABSENT);
	CHECK(kc_manifest_rehash(deps, strlen(deps), &m, &ml, why, sizeof(why)) == -EACCES,
	      "a list naming a device: not looked at");
	snprintf(deps, sizeof(deps), "%s /proc/self/cmdline\n", KC_MANIFEST_ABSENT);
	CHECK(kc_manifest_rehash(deps, strlen(deps), &m, &ml, why, sizeof(why)) == -EACCES,
	      "a list naming a file of /proc (regular, readable by all): not looked at");

	memo_ways();
	repeated_lookups();
	mapped_writer();
	timestamp_header();
	spread();
	CHECK(tmptree_remove(root) == 0, "clean up");
	return tap_done();
}
