/* test_remote_rehash.c - this node's manifest of a header list, shared by the fetches that
 * ask together and never older than the asking: a change made before a ticket is taken is
 * always seen, whether the fetch stats the headers or takes the watch's word
 * (remote_watch.h) that nothing changed. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sched.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "remote_rehash.h"
#include "tap.h"

static char root[64], inc[96], header[128], list[512];
static struct kc_rehash_table table;

/* path holding text, readable by all (the rehash hashes only such headers). */
static void write_file(const char *path, const char *text)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd >= 0) {
		if (write(fd, text, strlen(text)) < 0)
			perror("write");
		fchmod(fd, 0644);
		close(fd);
	}
}

static void put(const char *text)
{
	write_file(header, text);
}

/* The header given text of the same size, its mtime kept: only the ctime (and the bytes)
 * say it changed. */
static void put_keeping_mtime(const char *text)
{
	struct stat st;
	stat(header, &st);
	put(text);
	struct timespec times[2] = {st.st_atim, st.st_mtim};
	utimensat(AT_FDCWD, header, times, 0);
}

/* Rehashes begun so far for the fetches, once the armer has ended: each looks the list's
 * one header up (a stat, and a read when it changed). The armer's own rehash, after each
 * uncovered one, is not counted. */
static unsigned long lookups(void)
{
	kc_rehash_settle(&table);
	pthread_mutex_lock(&table.lock);
	unsigned long n = table.starts - table.armer_starts;
	pthread_mutex_unlock(&table.lock);
	return n;
}

/* Results taken on the watch's word so far. */
static unsigned long proven(void)
{
	pthread_mutex_lock(&table.lock);
	unsigned long n = table.proven;
	pthread_mutex_unlock(&table.lock);
	return n;
}

static int own(unsigned long ticket, char mine[KC_MANIFEST_COMPACT_MAX]);
/* A fetch of the one-header list l (digest hash) in t with ticket: 0 with mine (one
 * compact line), or its error. */
static int fetch(struct kc_rehash_table *t, const char *hash, unsigned long ticket,
		 const char *l, char mine[KC_MANIFEST_COMPACT_MAX]);

/* Fetches in turn, each asking after the last rehash, until one takes a result on the
 * watch's word (a rehash reads a header changed since the one before, and the memo keeps
 * its hash only once the clock has left the change's tick (kc_tree_memoizable): an open,
 * which the watch counts as a change). Returns 1 when one did, with mine its manifest. */
static int settle(char mine[KC_MANIFEST_COMPACT_MAX])
{
	for (int i = 0; i < 10; i++) {
		nanosleep(&(struct timespec){.tv_nsec = 20 * 1000000}, NULL);
		unsigned long p = proven(), l = lookups();
		if (own(kc_rehash_ticket(&table), mine) != 0)
			return 0;
		if (proven() == p + 1 && lookups() == l)
			return 1;
	}
	return 0;
}

/* One fetch asking now: 1 if it looked the header up (did not take the watch's word). */
static int looks_again(char mine[KC_MANIFEST_COMPACT_MAX])
{
	unsigned long l = lookups(), p = proven();
	return own(kc_rehash_ticket(&table), mine) == 0 && lookups() == l + 1 && proven() == p;
}

/* Every change that can give a header other bytes ends the watch's word (root only: the
 * test runs in a mount namespace of its own, on a tmpfs at /mnt whose walk, / and /mnt,
 * no other test writes in; elsewhere, another program's files in /tmp end it at any time). */
static void watched_changes(void)
{
	char m[KC_MANIFEST_COMPACT_MAX], before[KC_MANIFEST_COMPACT_MAX], path[192];
	CHECK(settle(before), "nothing changed: a later fetch takes the last rehash on the "
			      "watch's word, looking nothing up");

	put_keeping_mtime("#define C 1\n");
	CHECK(looks_again(m) && strcmp(m, before) != 0,
	      "watched: other bytes of the same size, mtime kept: looked up and seen");
	settle(before);

	struct timespec later[2] = {{.tv_nsec = UTIME_NOW}, {.tv_nsec = UTIME_NOW}};
	utimensat(AT_FDCWD, header, later, 0);
	CHECK(looks_again(m) && strcmp(m, before) == 0, "watched: touched: looked up, the same");
	settle(before);

	int fd = open(header, O_RDONLY);
	close(fd);
	CHECK(looks_again(m), "watched: opened by another process: looked up");
	settle(before);

	snprintf(path, sizeof(path), "%s/new.h", inc);
	write_file(path, "#define D 1\n");
	rename(path, header);
	CHECK(looks_again(m) && strcmp(m, before) != 0,
	      "watched: another file renamed over it: looked up and seen");
	settle(before);

	snprintf(path, sizeof(path), "%s/old", root);
	rename(inc, path);
	mkdir(inc, 0755);
	put("#define E 1\n");
	CHECK(looks_again(m) && strcmp(m, before) != 0,
	      "watched: its directory renamed and another put in its place: seen");
	settle(before);

	snprintf(path, sizeof(path), "%s/bound.h", root);
	write_file(path, "#define F 1\n");
	int bound = mount(path, header, NULL, MS_BIND, NULL) == 0;
	CHECK(bound && looks_again(m) && strcmp(m, before) != 0,
	      "watched: another file bind-mounted over it (no inotify event): seen");
	if (bound)
		umount(header);
	settle(before);

	fd = open(header, O_RDWR);
	char *map = fd >= 0 ? mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
	if (map != MAP_FAILED)
		map[9] = 'G'; /* a write no event reports: the open that made the mapping is */
	CHECK(map != MAP_FAILED && looks_again(m),
	      "watched: a writable mapping made since the last rehash: looked up");
	if (map != MAP_FAILED)
		munmap(map, 4096);
	if (fd >= 0)
		close(fd);

	/* a mapping made before the rehash: its open raised no event after the watch was
	 * added, and its writes raise none */
	fd = open(header, O_RDWR);
	map = fd >= 0 ? mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
	if (fd >= 0)
		close(fd);
	settle(before); /* takes no result on the watch's word while it is open for writing */
	if (map != MAP_FAILED)
		map[9] = 'H';
	CHECK(map != MAP_FAILED && own(kc_rehash_ticket(&table), m) == 0 && strcmp(m, before) != 0,
	      "watched: a writable mapping made before the last rehash, written after: seen");
	if (map != MAP_FAILED)
		munmap(map, 4096);
	static const char *const leftovers[] = {"old/h.h", "old", "bound.h"};
	for (int i = 0; i < 3; i++) {
		snprintf(path, sizeof(path), "%s/%s", root, leftovers[i]);
		if (unlink(path) != 0)
			rmdir(path);
	}
	put("#define B 1\n");
}

/* A list of n headers this node has never read: its first rehash reads them (a plain
 * one), its armer arms the watch and rehashes under it, and a fetch that asks after that
 * takes the armer's rehash on the watch's word (the reads came before the arm). */
static void watched_first_read(int n)
{
	char path[192], m[KC_MANIFEST_COMPACT_MAX], m2[KC_MANIFEST_COMPACT_MAX], why[200];
	size_t ml = 0, len = 0;
	char *l = malloc((size_t)n * 200);
	struct kc_rehash_table t;
	for (int i = 0; l && i < n; i++) {
		snprintf(path, sizeof(path), "%s/first%03d.h", inc, i);
		write_file(path, i % 2 ? "#define ODD 1\n" : "#define EVEN 1\n");
		len += (size_t)sprintf(l + len, "%064d %s\n", 0, path);
	}
	/* past the clock's tick of the writes, so that the memo may keep their hashes */
	nanosleep(&(struct timespec){.tv_nsec = 30 * 1000000}, NULL);
	kc_rehash_init(&t);
	int first = l ? kc_rehash_own(&t, kc_rehash_ticket(&t), "first", l, len, m, &ml, why,
				      sizeof(why)) : -ENOMEM;
	kc_rehash_settle(&t); /* the armer: the watch armed, one rehash under it */
	int next = l ? kc_rehash_own(&t, kc_rehash_ticket(&t), "first", l, len, m2, &ml, why,
				     sizeof(why)) : -ENOMEM;
	char what[160];
	snprintf(what, sizeof(what), "watched: %d header%s read for the first time: the next "
		 "fetch takes that rehash on the watch's word", n, n > 1 ? "s" : "");
	CHECK(first == 0 && next == 0 && strcmp(m, m2) == 0 && t.starts == 2 &&
	      t.armer_starts == 1 && t.proven == 1, what);
	/* the headers after the first share its walk, not looked up again: still watched */
	snprintf(path, sizeof(path), "%s/beside.h", inc);
	write_file(path, "#define BESIDE 1\n");
	next = l ? kc_rehash_own(&t, kc_rehash_ticket(&t), "first", l, len, m2, &ml, why,
				 sizeof(why)) : -ENOMEM;
	snprintf(what, sizeof(what), "watched: a file created beside those %d header%s: looked "
		 "up again", n, n > 1 ? "s" : "");
	kc_rehash_settle(&t);
	CHECK(next == 0 && t.starts - t.armer_starts == 2, what);
	unlink(path);
	kc_rehash_destroy(&t);
	for (int i = 0; i < n; i++) {
		snprintf(path, sizeof(path), "%s/first%03d.h", inc, i);
		unlink(path);
	}
	free(l);
}

/* ln -sfn to link: a new symlink renamed over it. */
static int repoint(const char *link, const char *to)
{
	char b[256];
	snprintf(b, sizeof(b), "%s.new", link);
	return symlink(to, b) == 0 ? rename(b, link) : -1;
}

/* Armed on a list of the one header path, then change(root/a, b) (b below root too unless
 * b_in_root is 0): 1 if the watch saw it. */
static int sees(const char *path, int (*change)(const char *, const char *), const char *a,
		const char *b, int b_in_root)
{
	char l[512], pa[192], pb[192];
	struct kc_watch w;
	kc_watch_init(&w);
	snprintf(l, sizeof(l), "%064d %s\n", 0, path);
	snprintf(pa, sizeof(pa), "%s/%s", root, a);
	snprintf(pb, sizeof(pb), b_in_root ? "%s/%s" : "%.0s%s", root, b);
	unsigned long gen = kc_watch_arm(&w, l, strlen(l), NULL);
	int quiet = gen && kc_watch_unchanged(&w, gen) == 1;
	int seen = change(pa, pb) == 0 && kc_watch_unchanged(&w, gen) == 0;
	if (change == rename)
		rename(pb, pa);
	kc_watch_destroy(&w);
	return quiet && seen;
}

/* Armed on a list of the one header path, then a directory renamed (from / to, below
 * root): 1 if the watch saw it. */
static int sees_rename(const char *path, const char *from, const char *to)
{
	return sees(path, rename, from, to, 1);
}

/* Armed on a list of the one header path, then the symlink link (below root) re-pointed at
 * to, as ln -sfn does: 1 if the watch saw it. */
static int sees_repoint(const char *path, const char *link, const char *to)
{
	return sees(path, repoint, link, to, 0);
}

/* Make the directories dirs[0..n) below root in turn (make), or remove them in reverse. */
static void dirs_below(const char *const *dirs, int n, int make)
{
	char path[192];
	for (int i = 0; i < n; i++) {
		snprintf(path, sizeof(path), "%s/%s", root, dirs[make ? i : n - 1 - i]);
		if (make)
			mkdir(path, 0755);
		else
			rmdir(path);
	}
}

/* A chain of symlinks (a link naming a link), of the header or of a directory on its walk:
 * re-pointing the link in the middle raises an event only in the directory holding it,
 * which is on neither the walk as written nor the walk as resolved. */
static void watched_chains(void)
{
	char path[192], target[192];
	static const char *const dirs[] = {"c1", "c2", "c3", "c3/sub"};
	dirs_below(dirs, 4, 1);
	snprintf(path, sizeof(path), "%s/c2/h.h", root);
	write_file(path, "#define N 1\n");
	snprintf(path, sizeof(path), "%s/c3/sub/h.h", root);
	write_file(path, "#define O 1\n");

	snprintf(target, sizeof(target), "%s/c2/h.h", root);
	snprintf(path, sizeof(path), "%s/c1/mid.h", root);
	symlink(target, path);
	snprintf(target, sizeof(target), "%s/c1/mid.h", root);
	snprintf(path, sizeof(path), "%s/chain.h", inc);
	symlink(target, path);
	snprintf(target, sizeof(target), "%s/c3/sub/h.h", root);
	CHECK(sees_repoint(path, "c1/mid.h", target),
	      "watched: a header symlink naming a symlink, the middle one re-pointed: seen");
	unlink(path);

	snprintf(path, sizeof(path), "%s/c1/middir", root);
	symlink("../c2", path); /* relative: walked from c1 */
	snprintf(path, sizeof(path), "%s/chaindir", inc);
	symlink("../c1/middir", path);
	snprintf(path, sizeof(path), "%s/chaindir/h.h", inc);
	CHECK(sees_repoint(path, "c1/middir", "../c3/sub"),
	      "watched: a directory symlink naming a symlink, the middle one re-pointed: seen");
	snprintf(path, sizeof(path), "%s/chaindir", inc);
	unlink(path);

	static const char *const files[] = {"c1/mid.h", "c1/middir", "c2/h.h", "c3/sub/h.h"};
	for (int i = 0; i < 4; i++) {
		snprintf(path, sizeof(path), "%s/%s", root, files[i]);
		unlink(path);
	}
	dirs_below(dirs, 4, 0);
}

/* Symlinks on a header's walk: the directories above what they name are watched too (a
 * rename there raises no event on the file, nor on the walk as written). */
static void watched_symlinks(void)
{
	char path[192], target[192];
	static const char *const dirs[] = {"d1", "d1/far", "d2", "d2/sub", "d2/sub/real"};
	dirs_below(dirs, 5, 1);
	snprintf(target, sizeof(target), "%s/d1/far/h.h", root);
	write_file(target, "#define L 1\n");
	snprintf(path, sizeof(path), "%s/link.h", inc);
	symlink(target, path);
	CHECK(sees_rename(path, "d1/far", "d1/far2"),
	      "watched: the directory of the file a header symlink names, renamed: seen");
	unlink(path);
	unlink(target);

	snprintf(target, sizeof(target), "%s/d2/sub/real", root);
	snprintf(path, sizeof(path), "%s/linkdir", inc);
	symlink(target, path);
	snprintf(target, sizeof(target), "%s/d2/sub/real/h.h", root);
	write_file(target, "#define M 1\n");
	snprintf(path, sizeof(path), "%s/linkdir/h.h", inc);
	CHECK(sees_rename(path, "d2/sub", "d2/sub2"),
	      "watched: a directory above the one a symlinked directory names, renamed: seen");
	unlink(target);
	snprintf(path, sizeof(path), "%s/linkdir", inc);
	unlink(path);
	dirs_below(dirs, 5, 0);
}

static volatile int opening;

/* Open the header for writing (changing nothing) until opening is 0. */
static void *open_for_writing(void *arg)
{
	while (opening) {
		int fd = open(header, O_WRONLY);
		if (fd >= 0)
			close(fd);
	}
	return arg;
}

/* The watch asks for a read lease on each header (is it open for writing?): a writer that
 * opens it meanwhile breaks the lease, with a signal to this process, which must live. */
static void armed_while_opened(void)
{
	pthread_t th;
	struct kc_watch w;
	kc_watch_init(&w);
	opening = 1;
	pthread_create(&th, NULL, open_for_writing, NULL);
	for (int i = 0; i < 20000; i++)
		kc_watch_arm(&w, list, strlen(list), NULL);
	opening = 0;
	pthread_join(th, NULL);
	kc_watch_destroy(&w);
	CHECK(1, "armed 20000 times while another thread opens the header for writing: alive");
}

/* A header on an overlayfs whose lower layer is written directly (not through the overlay):
 * its bytes change, and no event comes on the overlay's file. Skipped without overlayfs. */
static void watched_overlay(void)
{
	char dirs[4][128], opts[512], l[512], lower_h[160], h[160];
	static const char *const names[] = {"lower", "upper", "work", "merged"};
	for (int i = 0; i < 4; i++) {
		snprintf(dirs[i], sizeof(dirs[i]), "%s/%s", root, names[i]);
		mkdir(dirs[i], 0755);
	}
	snprintf(lower_h, sizeof(lower_h), "%s/h.h", dirs[0]);
	snprintf(h, sizeof(h), "%s/h.h", dirs[3]);
	write_file(lower_h, "#define P 1\n");
	snprintf(opts, sizeof(opts), "lowerdir=%s,upperdir=%s,workdir=%s", dirs[0], dirs[1],
		 dirs[2]);
	if (mount("kc-ovl", dirs[3], "overlay", 0, opts) == 0) {
		struct kc_watch w;
		kc_watch_init(&w);
		snprintf(l, sizeof(l), "%064d %s\n", 0, h);
		unsigned long gen = kc_watch_arm(&w, l, strlen(l), NULL);
		write_file(lower_h, "#define P 2\n");
		CHECK(!(gen && kc_watch_unchanged(&w, gen) == 1),
		      "a header on an overlayfs, its lower layer written: never taken unchanged");
		kc_watch_destroy(&w);
		umount(dirs[3]);
	}
	else
		printf("# no overlayfs: skipped\n");
	unlink(lower_h);
	char path[160];
	snprintf(path, sizeof(path), "%s/work/work", root);
	rmdir(path);
	for (int i = 3; i >= 0; i--)
		rmdir(dirs[i]);
}

struct racer {
	const char *hash; /* the list's digest: "ab" unless set */
	unsigned long ticket;
	char mine[KC_MANIFEST_COMPACT_MAX];
	int err;
};

static void *race(void *arg)
{
	struct racer *r = arg;
	r->err = fetch(&table, r->hash ? r->hash : "ab", r->ticket, list, r->mine);
	return NULL;
}

/* One fetch of the list hash on a thread of its own: 1 if it ended within 10 s (with r
 * filled), else 0 (the thread is then left to end when the watch's lock is let go). */
static int answered(const char *hash, struct racer *r, pthread_t *th)
{
	struct timespec by;
	*r = (struct racer){.hash = hash, .ticket = kc_rehash_ticket(&table)};
	pthread_create(th, NULL, race, r);
	clock_gettime(CLOCK_REALTIME, &by);
	by.tv_sec += 10;
	return pthread_timedjoin_np(*th, NULL, &by) == 0;
}

/* Hold the watch (hold 1) as a slow arm would, counted as an arm; let it go (0). */
static void hold_watch(struct kc_watch *w, int hold)
{
	if (hold) {
		__atomic_add_fetch(&w->arming, 1, __ATOMIC_SEQ_CST);
		pthread_mutex_lock(&w->lock);
	}
	else {
		pthread_mutex_unlock(&w->lock);
		__atomic_sub_fetch(&w->arming, 1, __ATOMIC_SEQ_CST);
	}
}

/* A header changed between a list's plain rehash and its arm: the arm reads it (through
 * the descriptor of its lease), so the armer's rehash after it only stats, and the next
 * fetch takes that rehash, with the new bytes, on the watch's word. (Had the armer's
 * rehash read it, its own open would have ended the word.) */
static void arm_reads_changed(void)
{
	char path[192], l[300], m[KC_MANIFEST_COMPACT_MAX], m2[KC_MANIFEST_COMPACT_MAX];
	struct kc_rehash_table t;
	snprintf(path, sizeof(path), "%s/armed.h", inc);
	write_file(path, "#define ARMED 1\n");
	snprintf(l, sizeof(l), "%064d %s\n", 0, path);
	nanosleep(&(struct timespec){.tv_nsec = 30 * 1000000}, NULL); /* memoizable */
	kc_rehash_init(&t);
	hold_watch(&t.watch, 1);
	int first = fetch(&t, "first", kc_rehash_ticket(&t), l, m); /* plain; its armer waits for the watch */
	write_file(path, "#define ARMED 22\n");
	nanosleep(&(struct timespec){.tv_nsec = 30 * 1000000}, NULL);
	hold_watch(&t.watch, 0);
	kc_rehash_settle(&t);
	unsigned long p = t.proven;
	int next = fetch(&t, "first", kc_rehash_ticket(&t), l, m2);
	CHECK(first == 0 && next == 0 && strcmp(m, m2) != 0 && t.proven == p + 1 && t.arms == 1,
	      "a header changed before the arm: the arm reads it, the next fetch takes the "
	      "new bytes on the watch's word");
	kc_rehash_destroy(&t);
	unlink(path);
}

/* A list whose arm gives no word (its header open for writing: no lease) starts no armer
 * for its next KC_REHASH_ARM_BACKOFF - 1 rehashes, and then one again. */
static void arm_backoff(void)
{
	char path[192], l[300], m[KC_MANIFEST_COMPACT_MAX];
	struct kc_rehash_table t;
	snprintf(path, sizeof(path), "%s/written.h", inc);
	write_file(path, "#define WRITTEN 1\n");
	snprintf(l, sizeof(l), "%064d %s\n", 0, path);
	int fd = open(path, O_WRONLY);
	kc_rehash_init(&t);
	int ok = fd >= 0;
	for (int i = 0; i < KC_REHASH_ARM_BACKOFF; i++) {
		ok &= fetch(&t, "first", kc_rehash_ticket(&t), l, m) == 0;
		kc_rehash_settle(&t);
	}
	CHECK(ok && t.arms == 1 && t.proven == 0,
	      "an arm that gave no word (a header open for writing): no armer for the next rehashes");
	ok &= fetch(&t, "first", kc_rehash_ticket(&t), l, m) == 0;
	kc_rehash_settle(&t);
	CHECK(ok && t.arms == 2 && t.proven == 0, "and after them, one arm again");
	kc_rehash_destroy(&t);
	if (fd >= 0)
		close(fd);
	unlink(path);
}

/* The watch is armed behind the fetches. While an arm holds the watch (taken here, as a
 * slow arm of another list would), a fetch of a covered list stats (the watch cannot give
 * its word) and is answered; the first fetch of another list is answered, its armer
 * waiting to arm, and so is its next. Once the arm is let go, the armer covers that list
 * and its next fetch takes the watch's word. */
static void arm_behind_fetches(void)
{
	char m[KC_MANIFEST_COMPACT_MAX], before[KC_MANIFEST_COMPACT_MAX];
	struct racer r;
	pthread_t th;
	CHECK(settle(before), "arm behind: the list is covered to begin with");
	unsigned long l = lookups(), p = proven();
	hold_watch(&table.watch, 1);
	int ok = answered("ab", &r, &th);
	CHECK(ok && r.err == 0 && strcmp(r.mine, before) == 0 && table.proven == p &&
	      table.starts - table.armer_starts == l + 1,
	      "arm behind: a covered list's fetch while an arm runs: stats, not waiting for it");
	ok = ok && answered("ef", &r, &th);
	CHECK(ok && r.err == 0 && strcmp(r.mine, before) == 0 && table.arming,
	      "arm behind: another list's first fetch is answered, its armer waiting to arm");
	ok = ok && answered("ef", &r, &th);
	CHECK(ok && r.err == 0 && table.arming,
	      "arm behind: and so is its next, the armer still waiting");
	hold_watch(&table.watch, 0);
	if (!ok)
		pthread_join(th, NULL);
	kc_rehash_settle(&table);
	p = proven();
	CHECK(fetch(&table, "ef", kc_rehash_ticket(&table), list, m) == 0 && strcmp(m, before) == 0 &&
	      proven() == p + 1,
	      "arm behind: the arm let go, the armer covers that list: its next fetch takes the "
	      "watch's word");
}

/* The check of the cluster's lists at start: kc_rehash_check's rehash arms nothing (the
 * list may be another image's); kc_rehash_arm then arms the one that matched, once, and a
 * fetch after that takes the armer's rehash on the watch's word. */
static void checked_then_armed(void)
{
	char m[KC_MANIFEST_COMPACT_MAX], m2[KC_MANIFEST_COMPACT_MAX], why[200];
	size_t ml = 0, len = strlen(list);
	struct kc_rehash_table t;
	kc_rehash_init(&t);
	kc_rehash_arm(&t, "chk", list, len);
	kc_rehash_settle(&t);
	CHECK(t.arms == 0, "arm: a list never rehashed here is not armed");
	int err = kc_rehash_check(&t, kc_rehash_ticket(&t), "chk", list, len, m, &ml, why,
				  sizeof(why));
	kc_rehash_settle(&t);
	CHECK(err == 0 && ml == KC_MANIFEST_LINE_LEN && t.starts == 1 && t.arms == 0,
	      "check: this node's manifest, from a rehash that starts no armer");
	kc_rehash_arm(&t, "chk", list, len);
	kc_rehash_settle(&t);
	unsigned long p = t.proven;
	err = kc_rehash_own(&t, kc_rehash_ticket(&t), "chk", list, len, m2, &ml, why, sizeof(why));
	CHECK(err == 0 && strcmp(m, m2) == 0 && t.arms == 1 && t.armer_starts == 1 &&
	      t.proven == p + 1,
	      "arm: the checked list armed; the next fetch takes the watch's word");
	kc_rehash_arm(&t, "chk", list, len);
	kc_rehash_settle(&t);
	CHECK(t.arms == 1, "arm: a list the watch covers is not armed again");
	kc_rehash_destroy(&t);
}

static int own(unsigned long ticket, char mine[KC_MANIFEST_COMPACT_MAX])
{
	return fetch(&table, "ab", ticket, list, mine);
}

static int fetch(struct kc_rehash_table *t, const char *hash, unsigned long ticket,
		 const char *l, char mine[KC_MANIFEST_COMPACT_MAX])
{
	char why[200];
	size_t ml = 0;
	int err = kc_rehash_own(t, ticket, hash, l, strlen(l), mine, &ml, why, sizeof(why));
	if (!err && ml != KC_MANIFEST_LINE_LEN)
		return -EINVAL;
	return err;
}

int main(void)
{
	char m1[KC_MANIFEST_COMPACT_MAX], m2[KC_MANIFEST_COMPACT_MAX], m3[KC_MANIFEST_COMPACT_MAX];
	char why[200];
	size_t ml = 0;

	/* As root, a mount namespace of this process's own with a tmpfs at /mnt (gone when it
	 * exits); else /tmp, where the watch's word is not tested. */
	int ns = geteuid() == 0 && unshare(CLONE_NEWNS) == 0 &&
		 mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) == 0 &&
		 mount("kc-rehash", "/mnt", "tmpfs", 0, "mode=0755") == 0;
	snprintf(root, sizeof(root), ns ? "/mnt/kc-rehash-XXXXXX" : "/tmp/kc-rehash-XXXXXX");
	if (!mkdtemp(root))
		return 1;
	chmod(root, 0755);
	snprintf(inc, sizeof(inc), "%s/inc", root);
	mkdir(inc, 0755);
	snprintf(header, sizeof(header), "%s/h.h", inc);
	snprintf(list, sizeof(list), "%064d %s\n", 0, header);
	put("#define A 1\n");
	kc_rehash_init(&table);

	unsigned long t1 = kc_rehash_ticket(&table);
	unsigned long before = lookups();
	CHECK(own(t1, m1) == 0, "a rehash gives this node's compact manifest");
	CHECK(lookups() == before + 1, "it looked the header up");
	before = lookups();
	CHECK(own(t1, m2) == 0 && strcmp(m1, m2) == 0 && lookups() == before,
	      "a fetch that asked before that rehash began takes its result, looking nothing up");

	put_keeping_mtime("#define B 1\n");
	unsigned long t2 = kc_rehash_ticket(&table);
	before = lookups();
	CHECK(own(t2, m3) == 0 && strcmp(m1, m3) != 0 && lookups() == before + 1,
	      "a fetch that asks after a change rehashes and sees it (size and mtime kept)");
	before = lookups();
	CHECK(own(t1, m2) == 0 && strcmp(m2, m3) == 0 && lookups() == before,
	      "an older ticket takes the newer result, which began after it");

	/* 8 fetches that ask at once, after a change (the same bytes written again: no result
	 * may stand on the watch's word), share one rehash */
	before = lookups(); /* the armer ended: no rehash of its begins after the ticket */
	put("#define B 1\n");
	unsigned long t3 = kc_rehash_ticket(&table);
	struct racer r[8];
	pthread_t th[8];
	for (int i = 0; i < 8; i++) {
		r[i] = (struct racer){.ticket = t3};
		pthread_create(&th[i], NULL, race, &r[i]);
	}
	int same = 1;
	for (int i = 0; i < 8; i++) {
		pthread_join(th[i], NULL);
		same &= r[i].err == 0 && strcmp(r[i].mine, m3) == 0;
	}
	CHECK(same, "8 fetches with one ticket get the same manifest");
	CHECK(lookups() == before + 1, "and the header was looked up once for all 8");

	if (ns) {
		watched_first_read(1);
		watched_first_read(100);
		watched_changes();
		arm_behind_fetches();
		arm_reads_changed();
		arm_backoff();
		checked_then_armed();
		watched_symlinks();
		watched_chains();
	}
	else
		printf("# not root, or no mount namespace: the watch's word is not tested\n");
	if (ns)
		watched_overlay();
	armed_while_opened();
	struct kc_watch other;
	kc_watch_init(&other);
	char proc[128];
	snprintf(proc, sizeof(proc), "%064d /proc/self/status\n", 0);
	CHECK(kc_watch_arm(&other, proc, strlen(proc), NULL) == 0,
	      "a header on a filesystem whose changes inotify may not see (/proc) is not watched");
	kc_watch_destroy(&other);

	chmod(header, 0600);
	unsigned long t4 = kc_rehash_ticket(&table);
	int err = kc_rehash_own(&table, t4, "ab", list, strlen(list), m2, &ml, why, sizeof(why));
	CHECK(err == -EACCES && strstr(why, header),
	      "a header no longer readable by all: EACCES, and why names it");
	err = kc_rehash_own(&table, t4, "ab", list, strlen(list), m2, &ml, why, sizeof(why));
	CHECK(err == -EACCES && strstr(why, header), "the failure is shared as a result is");
	unlink(header);
	unsigned long t6 = kc_rehash_ticket(&table);
	err = kc_rehash_own(&table, t6, "ab", list, strlen(list), m2, &ml, why, sizeof(why));
	CHECK(err == 0 && strcmp(m2, m3) != 0, "a header gone: another manifest (its lookup "
	      "finds nothing), not an error");

	/* another list of the same header bytes is its own slot */
	put("#define B 1\n");
	unsigned long t5 = kc_rehash_ticket(&table);
	err = kc_rehash_own(&table, t5, "cd", list, strlen(list), m2, &ml, why, sizeof(why));
	CHECK(err == 0 && strcmp(m2, m3) == 0, "a list under another digest is rehashed for itself");

	kc_rehash_destroy(&table);
	unlink(header);
	rmdir(inc);
	rmdir(root);
	return tap_done();
}
