/* test_store.c - the backing store: state directory, recovery, lock, commit, records. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "store.h"
#include "tap.h"

static char root[64];

static int write_file(int dir, const char *name, const void *buf, size_t len)
{
	int fd = openat(dir, name, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return -errno;
	ssize_t n = write(fd, buf, len);
	close(fd);
	return n == (ssize_t)len ? 0 : -EIO;
}

/* Read dir/name into buf; returns its length or -errno. */
static ssize_t read_file(int dir, const char *name, char *buf, size_t len)
{
	int fd = openat(dir, name, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	ssize_t n = read(fd, buf, len);
	close(fd);
	return n;
}

static int has_content(int dir, const char *name, const char *want)
{
	char buf[256];
	ssize_t n = read_file(dir, name, buf, sizeof(buf));
	return n == (ssize_t)strlen(want) && memcmp(buf, want, (size_t)n) == 0;
}

static int exists(int dir, const char *name)
{
	struct stat st;
	return fstatat(dir, name, &st, AT_SYMLINK_NOFOLLOW) == 0;
}

/* Number of entries (other than . and ..) in the directory at path, or -1. */
static int count_entries(const char *path)
{
	DIR *d = opendir(path);
	struct dirent *e;
	int n = 0;
	if (!d)
		return -1;
	while ((e = readdir(d)))
		if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
			n++;
	closedir(d);
	return n;
}

static int is_dir(const char *path)
{
	struct stat st;
	return lstat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static void test_open(void)
{
	struct kc_store s, s2;
	char why[512] = "", path[512];
	int err;

	err = kc_store_open(&s, root, why, sizeof(why));
	CHECK(err == 0, "open a fresh backing directory");
	if (err) {
		printf("# %s\n", why);
		return;
	}
	snprintf(path, sizeof(path), "%s/.kcachefs", root);
	CHECK(is_dir(path), "state directory created");
	snprintf(path, sizeof(path), "%s/.kcachefs/tmp", root);
	CHECK(is_dir(path), ".kcachefs/tmp created");
	snprintf(path, sizeof(path), "%s/.kcachefs/scratch", root);
	CHECK(is_dir(path), ".kcachefs/scratch created");
	snprintf(path, sizeof(path), "%s/.kcachefs/lock", root);
	struct stat st;
	CHECK(lstat(path, &st) == 0 && S_ISREG(st.st_mode), ".kcachefs/lock created");
	CHECK(s.root_path && strcmp(s.root_path, root) == 0, "root_path is the resolved path");
	CHECK(s.root_fd >= 0 && s.tmp_fd >= 0 && s.scratch_fd >= 0 && s.lock_fd >= 0,
	      "all fds open");

	/* a second daemon on the same directory */
	why[0] = '\0';
	err = kc_store_open(&s2, root, why, sizeof(why));
	CHECK(err == -EBUSY, "second open while the first is open: -EBUSY");
	CHECK(why[0] != '\0', "second open: why is set");
	if (err == 0)
		kc_store_close(&s2);

	/* leave things behind in tmp/ and scratch/, as a crash would */
	char spath[512];
	int sfd = kc_store_scratch(&s, spath, sizeof(spath));
	CHECK(sfd >= 0, "scratch directory created");
	CHECK(sfd >= 0 && strncmp(spath, root, strlen(root)) == 0 && is_dir(spath),
	      "scratch path is absolute under the root");
	if (sfd >= 0) {
		write_file(sfd, "kernel.cu", "x", 1);
		mkdirat(sfd, "deep", 0700);
		int deep = openat(sfd, "deep", O_RDONLY | O_DIRECTORY);
		if (deep >= 0) {
			write_file(deep, "ptx", "y", 1);
			close(deep);
		}
		close(sfd);
	}
	char tname[64];
	int tfd = kc_store_tmpfile(&s, 0600, tname);
	CHECK(tfd >= 0, "tmpfile created");
	if (tfd >= 0) {
		CHECK(write(tfd, "half", 4) == 4, "write into tmpfile");
		close(tfd);
	}
	CHECK(write_file(s.tmp_fd, "leftover", "z", 1) == 0, "leftover file in tmp/");
	CHECK(write_file(s.root_fd, "keep.txt", "keep", 4) == 0, "a file of the tree");
	snprintf(path, sizeof(path), "%s/.kcachefs/tmp", root);
	CHECK(count_entries(path) == 2, "tmp/ holds two files before the restart");
	snprintf(path, sizeof(path), "%s/.kcachefs/scratch", root);
	CHECK(count_entries(path) == 1, "scratch/ holds one directory before the restart");
	kc_store_close(&s);
	CHECK(s.root_fd == -1 && s.root_path == NULL, "close resets the store");

	err = kc_store_open(&s, root, why, sizeof(why));
	CHECK(err == 0, "reopen after close");
	if (err)
		return;
	snprintf(path, sizeof(path), "%s/.kcachefs/tmp", root);
	CHECK(count_entries(path) == 0, "reopen wiped tmp/");
	snprintf(path, sizeof(path), "%s/.kcachefs/scratch", root);
	CHECK(count_entries(path) == 0, "reopen wiped scratch/");
	CHECK(!is_dir(spath), "old scratch directory gone");
	CHECK(has_content(s.root_fd, "keep.txt", "keep"), "the tree itself is untouched");
	unlinkat(s.root_fd, "keep.txt", 0);
	kc_store_close(&s);

	/* paths that are not directories */
	char missing[128];
	snprintf(missing, sizeof(missing), "%s/does-not-exist", root);
	why[0] = '\0';
	CHECK(kc_store_open(&s, missing, why, sizeof(why)) == -ENOENT,
	      "open a non-existent path: -ENOENT");
	CHECK(why[0] != '\0', "non-existent path: why is set");
	char file[128];
	snprintf(file, sizeof(file), "%s/plainfile", root);
	int ffd = open(file, O_WRONLY | O_CREAT, 0600);
	if (ffd >= 0)
		close(ffd);
	CHECK(kc_store_open(&s, file, why, sizeof(why)) == -ENOTDIR,
	      "open a regular file: -ENOTDIR");
	unlink(file);
}

static void test_commit(struct kc_store *s)
{
	int dir;

	mkdirat(s->root_fd, "kernel.gemm.0123456789abcdef", 0755);
	dir = openat(s->root_fd, "kernel.gemm.0123456789abcdef", O_RDONLY | O_DIRECTORY);
	CHECK(dir >= 0, "entry directory");
	if (dir < 0)
		return;

	/* absent destination */
	write_file(s->tmp_fd, "a", "first", 5);
	CHECK(kc_store_commit(s->tmp_fd, "a", dir, "kernel.cubin") == 0, "commit to absent: 0");
	CHECK(!exists(s->tmp_fd, "a"), "commit to absent: source gone");
	CHECK(has_content(dir, "kernel.cubin", "first"), "commit to absent: destination has it");

	/* a destination already there: the same bytes are a success (1) that leaves it as it
	 * was; other bytes, of the same size or longer, are -EEXIST and leave both as they were */
	static const struct {
		const char *src, *bytes, *what;
		int want;
	} onto[] = {
		{"b", "first", "commit identical", 1},
		{"c", "other", "commit different (same size)", -EEXIST},
		{"d", "firstly", "commit different (longer)", -EEXIST},
	};
	struct stat before, after;
	fstatat(dir, "kernel.cubin", &before, 0);
	for (size_t i = 0; i < sizeof(onto) / sizeof(onto[0]); i++) {
		char what[160];
		write_file(s->tmp_fd, onto[i].src, onto[i].bytes, strlen(onto[i].bytes));
		snprintf(what, sizeof(what), "%s: %d", onto[i].what, onto[i].want);
		CHECK(kc_store_commit(s->tmp_fd, onto[i].src, dir, "kernel.cubin") == onto[i].want,
		      what);
		snprintf(what, sizeof(what), "%s: source %s", onto[i].what,
			 onto[i].want == 1 ? "gone" : "unchanged");
		CHECK(onto[i].want == 1 ? !exists(s->tmp_fd, onto[i].src)
					: has_content(s->tmp_fd, onto[i].src, onto[i].bytes),
		      what);
		fstatat(dir, "kernel.cubin", &after, 0);
		snprintf(what, sizeof(what), "%s: destination unchanged (same inode, same bytes)",
			 onto[i].what);
		CHECK(before.st_ino == after.st_ino && has_content(dir, "kernel.cubin", "first"), what);
	}
	unlinkat(s->tmp_fd, "c", 0);
	unlinkat(s->tmp_fd, "d", 0);

	/* a missing source */
	CHECK(kc_store_commit(s->tmp_fd, "nonesuch", dir, "kernel.log") == -ENOENT,
	      "commit a missing source: -ENOENT");

	/* same_bytes directly */
	write_file(s->tmp_fd, "e", "first", 5);
	int a = openat(s->tmp_fd, "e", O_RDONLY), b = openat(dir, "kernel.cubin", O_RDONLY);
	write_file(s->tmp_fd, "f", "firsT", 5);
	int c = openat(s->tmp_fd, "f", O_RDONLY);
	CHECK(kc_store_same_bytes(a, b) == 1, "same_bytes: equal files");
	CHECK(kc_store_same_bytes(a, c) == 0, "same_bytes: last byte differs");
	close(a);
	close(b);
	close(c);
	unlinkat(s->tmp_fd, "e", 0);
	unlinkat(s->tmp_fd, "f", 0);

	/* write_atomic: create, then replace */
	CHECK(kc_store_write_atomic(s, dir, "kernel.log", "log one\n", 8) == 0,
	      "write_atomic creates");
	CHECK(has_content(dir, "kernel.log", "log one\n"), "write_atomic: content");
	int held = openat(dir, "kernel.log", O_RDONLY);
	CHECK(kc_store_write_atomic(s, dir, "kernel.log", "log two, longer\n", 16) == 0,
	      "write_atomic replaces");
	CHECK(has_content(dir, "kernel.log", "log two, longer\n"), "write_atomic: new content");
	char old[32];
	ssize_t n = held >= 0 ? pread(held, old, sizeof(old), 0) : -1;
	CHECK(n == 8 && memcmp(old, "log one\n", 8) == 0,
	      "write_atomic: an open reader keeps the old file (rename, not rewrite)");
	if (held >= 0)
		close(held);
	char tpath[512];
	snprintf(tpath, sizeof(tpath), "%s/.kcachefs/tmp", s->root_path);
	CHECK(count_entries(tpath) == 0, "write_atomic leaves nothing in tmp/");
	CHECK(kc_store_write_atomic(s, dir, "no/such/dir", "x", 1) < 0,
	      "write_atomic into a missing directory fails");
	CHECK(count_entries(tpath) == 0, "failed write_atomic leaves nothing in tmp/");

	/* records */
	struct kc_record rec = {0}, got;
	memset(rec.sha256, 'a', KC_SHA256_HEXLEN);
	memset(rec.recipe, 'b', KC_SHA256_HEXLEN);
	rec.size = 123456789012ull;
	rec.origin = KC_ORIGIN_COMPILED;
	int fd = openat(dir, "kernel.cubin", O_RDONLY);
	memset(&got, 0x55, sizeof(got));
	CHECK(kc_record_read(fd, &got) == -ENODATA, "record_read on a file with none: -ENODATA");
	CHECK(kc_record_write(fd, &rec) == 0, "record_write (compiled)");
	memset(&got, 0x55, sizeof(got));
	CHECK(kc_record_read(fd, &got) == 0, "record_read (compiled)");
	CHECK(strcmp(got.sha256, rec.sha256) == 0 && got.size == rec.size &&
		      strcmp(got.recipe, rec.recipe) == 0 && got.origin == KC_ORIGIN_COMPILED,
	      "record round-trip (compiled)");

	struct kc_record crec = {0};
	memset(crec.sha256, 'c', KC_SHA256_HEXLEN);
	crec.size = 5;
	crec.origin = KC_ORIGIN_CLIENT;
	CHECK(kc_record_write(fd, &crec) == 0, "record_write (client) replaces");
	memset(&got, 0x55, sizeof(got));
	CHECK(kc_record_read(fd, &got) == 0 && strcmp(got.sha256, crec.sha256) == 0 &&
		      got.size == 5 && got.recipe[0] == '\0' && got.origin == KC_ORIGIN_CLIENT,
	      "record round-trip (client, no recipe)");
	close(fd);

	/* on an O_PATH fd, and a garbled record */
	fd = openat(dir, "kernel.log", O_PATH);
	CHECK(kc_record_write(fd, &rec) == 0, "record_write through an O_PATH fd");
	CHECK(kc_record_read(fd, &got) == 0 && got.origin == KC_ORIGIN_COMPILED,
	      "record_read through an O_PATH fd");
	char p[32];
	kc_fd_path(fd, p);
	setxattr(p, "user.kcachefs.record", "v1 short 1 - compiled", 21, 0);
	CHECK(kc_record_read(fd, &got) == -EINVAL, "garbled record: -EINVAL");
	char bogus[160];
	int blen = snprintf(bogus, sizeof(bogus), "v1 %s 5 - bogus", rec.sha256);
	setxattr(p, "user.kcachefs.record", bogus, (size_t)blen, 0);
	CHECK(kc_record_read(fd, &got) == -EINVAL, "record with an unknown origin: -EINVAL");
	close(fd);

	/* rejection markers */
	char h1[KC_SHA256_HEXLEN + 1], h2[KC_SHA256_HEXLEN + 1];
	memset(h1, '1', KC_SHA256_HEXLEN);
	h1[KC_SHA256_HEXLEN] = '\0';
	strcpy(h2, h1);
	h2[KC_SHA256_HEXLEN - 1] = '2';
	CHECK(!kc_store_is_rejected(dir, h1), "no marker: not rejected");
	CHECK(kc_store_mark_rejected(dir, h1) == 0, "mark rejected");
	CHECK(kc_store_is_rejected(dir, h1) == 1, "rejected for the marked hash");
	CHECK(kc_store_is_rejected(dir, h2) == 0, "not rejected for another hash");
	char h1short[KC_SHA256_HEXLEN];
	memcpy(h1short, h1, KC_SHA256_HEXLEN - 1);
	h1short[KC_SHA256_HEXLEN - 1] = '\0';
	CHECK(kc_store_is_rejected(dir, h1short) == 0, "not rejected for a prefix of the hash");
	int opath = openat(s->root_fd, "kernel.gemm.0123456789abcdef", O_PATH | O_DIRECTORY);
	CHECK(kc_store_is_rejected(opath, h1) == 1, "rejected seen through an O_PATH fd");
	close(opath);
	CHECK(kc_store_mark_rejected(dir, h2) == 0 && kc_store_is_rejected(dir, h2) == 1 &&
		      kc_store_is_rejected(dir, h1) == 0,
	      "marking another hash replaces the marker");
	kc_store_clear_rejected(dir);
	CHECK(!kc_store_is_rejected(dir, h1) && !kc_store_is_rejected(dir, h2),
	      "cleared: not rejected");
	kc_store_clear_rejected(dir); /* clearing twice is harmless */

	/* refusal markers */
	CHECK(!kc_store_is_refused(dir), "no marker: not refused");
	CHECK(kc_store_mark_refused(dir, "kernel.flags") == 0 && kc_store_is_refused(dir) == 1,
	      "marked refused");
	kc_store_clear_refused(dir);
	CHECK(!kc_store_is_refused(dir), "cleared: not refused");

	/* a copy into tmp/: the same bytes in another inode, with the mode asked for */
	char copied[64], big[200000];
	for (size_t i = 0; i < sizeof(big); i++)
		big[i] = (char)(i * 7 + i / 251);
	CHECK(write_file(dir, "src.bin", big, sizeof(big)) == 0, "write a source to copy");
	int src = openat(dir, "src.bin", O_RDONLY | O_CLOEXEC);
	int copy = kc_store_copy_tmp(s, src, 0640, copied);
	struct stat sst, cst;
	CHECK(copy >= 0 && fstat(src, &sst) == 0 && fstat(copy, &cst) == 0 &&
		      sst.st_ino != cst.st_ino && (cst.st_mode & 07777) == 0640 &&
		      cst.st_size == (off_t)sizeof(big) && kc_store_same_bytes(src, copy) == 1,
	      "copy_tmp: the same bytes in a new inode of tmp/");
	close(copy);
	close(src);
	unlinkat(s->tmp_fd, copied, 0);
	unlinkat(dir, "src.bin", 0);
	CHECK(kc_store_copy_tmp(s, -1, 0600, copied) < 0 && faccessat(s->tmp_fd, copied, F_OK, 0) != 0,
	      "copy_tmp of an unreadable fd fails and leaves no temporary");

	unlinkat(dir, "kernel.cubin", 0);
	unlinkat(dir, "kernel.log", 0);
	close(dir);
	unlinkat(s->root_fd, "kernel.gemm.0123456789abcdef", AT_REMOVEDIR);
}

/* Publish atomicity: a reader never sees a partial file. */
#define PUB_SIZE (1u << 20)
#define PUB_ROUNDS 40

static unsigned char *pub_want;
static int pub_dir;
static atomic_int pub_stop;
static atomic_int pub_seen;    /* complete files seen */
static atomic_int pub_partial; /* partial or wrong files seen */

static void *pub_reader(void *arg)
{
	unsigned char *buf = malloc(PUB_SIZE + 1);
	(void)arg;
	if (!buf) {
		atomic_fetch_add(&pub_partial, 1);
		return NULL;
	}
	while (!atomic_load(&pub_stop)) {
		int fd = openat(pub_dir, "kernel.cubin", O_RDONLY | O_CLOEXEC);
		if (fd < 0) {
			if (errno != ENOENT)
				atomic_fetch_add(&pub_partial, 1);
			continue;
		}
		size_t got = 0;
		for (;;) {
			ssize_t n = read(fd, buf + got, PUB_SIZE + 1 - got);
			if (n <= 0)
				break;
			got += (size_t)n;
			if (got == PUB_SIZE + 1)
				break;
		}
		close(fd);
		if (got == PUB_SIZE && memcmp(buf, pub_want, PUB_SIZE) == 0)
			atomic_fetch_add(&pub_seen, 1);
		else
			atomic_fetch_add(&pub_partial, 1);
	}
	free(buf);
	return NULL;
}

static void test_publish(struct kc_store *s)
{
	pthread_t th;
	int ok_write = 1, ok_commit = 1, waited_ok = 1;

	pub_want = malloc(PUB_SIZE);
	if (!pub_want) {
		CHECK(0, "publish: allocate");
		return;
	}
	for (size_t i = 0; i < PUB_SIZE; i++)
		pub_want[i] = (unsigned char)(i * 2654435761u >> 13);
	mkdirat(s->root_fd, "kernel.pub.0123456789abcdef", 0755);
	pub_dir = openat(s->root_fd, "kernel.pub.0123456789abcdef", O_RDONLY | O_DIRECTORY);
	atomic_store(&pub_stop, 0);
	pthread_create(&th, NULL, pub_reader, NULL);

	for (int round = 0; round < PUB_ROUNDS; round++) {
		char name[64];
		int fd = kc_store_tmpfile(s, 0644, name);
		if (fd < 0) {
			ok_write = 0;
			break;
		}
		/* written in small pieces so that a visible temporary would show up partial */
		for (size_t off = 0; off < PUB_SIZE; off += 16384)
			if (write(fd, pub_want + off, 16384) != 16384)
				ok_write = 0;
		close(fd);
		if (kc_store_commit(s->tmp_fd, name, pub_dir, "kernel.cubin") != 0)
			ok_commit = 0;
		/* let the reader see this one before it goes away (bounded wait) */
		int seen = atomic_load(&pub_seen);
		for (int spin = 0; spin < 20000 && atomic_load(&pub_seen) == seen; spin++)
			usleep(50);
		if (atomic_load(&pub_seen) == seen)
			waited_ok = 0;
		unlinkat(pub_dir, "kernel.cubin", 0);
	}
	atomic_store(&pub_stop, 1);
	pthread_join(th, NULL);

	CHECK(ok_write, "publish: staged 1 MiB files through tmpfile");
	CHECK(ok_commit, "publish: every commit took the free name");
	CHECK(atomic_load(&pub_partial) == 0, "publish: reader never saw a partial file");
	CHECK(waited_ok && atomic_load(&pub_seen) >= PUB_ROUNDS,
	      "publish: reader saw every published file complete");
	printf("# reader saw %d complete files, %d bad\n", atomic_load(&pub_seen),
	       atomic_load(&pub_partial));
	close(pub_dir);
	unlinkat(s->root_fd, "kernel.pub.0123456789abcdef", AT_REMOVEDIR);
	free(pub_want);
}

int main(void)
{
	struct kc_store s;
	char why[512];

	strcpy(root, "/tmp/kc-test-store.XXXXXX");
	if (!mkdtemp(root)) {
		perror("mkdtemp");
		return 1;
	}
	test_open();
	if (kc_store_open(&s, root, why, sizeof(why)) == 0) {
		test_commit(&s);
		test_publish(&s);
		kc_store_close(&s);
	} else {
		CHECK(0, "open the store for the commit tests");
		printf("# %s\n", why);
	}
	CHECK(kc_store_remove_tree(root) == 0, "remove_tree removes the test directory");
	CHECK(access(root, F_OK) != 0 && errno == ENOENT, "test directory gone");
	return tap_done();
}
