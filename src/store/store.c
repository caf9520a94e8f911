/* store.c - see store.h */
#define _GNU_SOURCE
#include "store.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "io.h"
#include "log.h"

#define RECORD_XATTR "user.kcachefs.record"
#define REJECTED_XATTR "user.kcachefs.rejected"
#define REFUSED_XATTR "user.kcachefs.refused"

static atomic_uint_fast64_t tmp_counter;

int kc_store_rel_path(const struct kc_store *s, int fd, char *out, size_t len)
{
	char link[32], path[PATH_MAX + 1];
	kc_fd_path(fd, link);
	ssize_t n = readlink(link, path, sizeof(path));
	size_t rl = strlen(s->root_path);
	if (n <= 0 || (size_t)n >= sizeof(path))
		return -ENAMETOOLONG;
	path[n] = '\0';
	if ((size_t)n <= rl + 1 || strncmp(path, s->root_path, rl) != 0 || path[rl] != '/')
		return -ENOENT;
	if ((size_t)n - rl - 1 >= len)
		return -ENAMETOOLONG;
	memcpy(out, path + rl + 1, (size_t)n - rl);
	return 0;
}

void kc_fd_path(int fd, char buf[32])
{
	snprintf(buf, 32, "/proc/self/fd/%d", fd);
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)ftw;
	if (flag == FTW_DP)
		return rmdir(path) == 0 || errno == ENOENT ? 0 : -1;
	return unlink(path) == 0 || errno == ENOENT ? 0 : -1;
}

int kc_store_remove_tree(const char *path)
{
	if (nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS) != 0)
		return errno == ENOENT ? 0 : -errno;
	return 0;
}

/* Whether process pid (a /proc entry's name) works in dir: its cwd is dir or below. */
static int cwd_in(const char *pid, const char *dir)
{
	char link[64], cwd[4400];
	snprintf(link, sizeof(link), "/proc/%.20s/cwd", pid);
	ssize_t n = readlink(link, cwd, sizeof(cwd) - 1);
	if (n < 0)
		return 0;
	cwd[n] = '\0';
	size_t dl = strlen(dir);
	return strncmp(cwd, dir, dl) == 0 && (cwd[dl] == '\0' || cwd[dl] == '/');
}

/* The process group of pid (a /proc entry's name), or 0 when it is gone or unreadable. */
static int pgrp_of(const char *pid)
{
	char path[64], line[512];
	int pgrp = 0;
	snprintf(path, sizeof(path), "/proc/%.20s/stat", pid);
	FILE *f = fopen(path, "re");
	if (!f)
		return 0;
	char *paren = fgets(line, sizeof(line), f) ? strrchr(line, ')') : NULL;
	fclose(f);
	/* after the name: " S ppid pgrp ..." */
	if (!paren || sscanf(paren + 1, " %*c %*d %d", &pgrp) != 1)
		return 0;
	return pgrp;
}

/* Whether a process of group pgid works in dir: then the group is the compile that
 * recorded it there, not another that took its number since. Its leader, the compiler,
 * is mostly gone (it dies with the daemon's thread, PR_SET_PDEATHSIG) while the tools it
 * started keep the group: any member counts. */
static int group_works_in(int pgid, const char *dir)
{
	char leader[16];
	snprintf(leader, sizeof(leader), "%d", pgid);
	if (cwd_in(leader, dir))
		return 1;
	DIR *d = opendir("/proc");
	struct dirent *de;
	int found = 0;
	if (!d)
		return 0;
	while (!found && (de = readdir(d)) != NULL)
		found = de->d_name[0] >= '1' && de->d_name[0] <= '9' &&
			pgrp_of(de->d_name) == pgid && cwd_in(de->d_name, dir);
	closedir(d);
	return found;
}

/* A compile of a daemon that died keeps running (its own process group, reparented).
 * Each scratch directory records its compiler's process group in "pgid": kill the group
 * if a process of it still works in that directory. */
static void kill_orphan_compiles(const char *scratch_path)
{
	DIR *d = opendir(scratch_path);
	struct dirent *de;

	if (!d)
		return;
	while ((de = readdir(d)) != NULL) {
		char path[4400], buf[32];
		if (de->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "%.4096s/%.255s/pgid", scratch_path, de->d_name);
		FILE *f = fopen(path, "re");
		int pgid = 0;
		if (!f)
			continue;
		if (!fgets(buf, sizeof(buf), f) || sscanf(buf, "%d", &pgid) != 1)
			pgid = 0;
		fclose(f);
		if (pgid <= 1)
			continue;
		snprintf(path, sizeof(path), "%.4096s/%.255s", scratch_path, de->d_name);
		if (group_works_in(pgid, path)) {
			kc_log(KC_LOG_WARN, "killing compiler process group %d left by a previous daemon",
			       pgid);
			kill(-pgid, SIGKILL);
		}
	}
	closedir(d);
}

/* Empty the directory dirpath (keep it), or create it. Returns an fd on it or -errno. */
static int fresh_dir(int parent, const char *name, const char *dirpath)
{
	if (kc_store_remove_tree(dirpath) != 0)
		kc_log(KC_LOG_WARN, "cannot clean %s: %s", dirpath, strerror(errno));
	if (mkdirat(parent, name, 0700) != 0 && errno != EEXIST)
		return -errno;
	int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
	return fd < 0 ? -errno : fd;
}

static int fail(char *why, size_t whylen, int err, const char *fmt, const char *arg)
{
	char msg[512];
	snprintf(msg, sizeof(msg), fmt, arg);
	snprintf(why, whylen, "%s: %s", msg, strerror(-err));
	return err;
}

#define STOPPING_NOTE "stopping"

void kc_store_note_stopping(struct kc_store *s, time_t deadline)
{
	char path[4200], text[64];
	snprintf(path, sizeof(path), "%s/" KC_STATE_DIR "/" STOPPING_NOTE, s->root_path);
	int n = snprintf(text, sizeof(text), "%d %lld\n", (int)getpid(), (long long)deadline);
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (fd < 0 || kc_write_all(fd, text, (size_t)n) != 0)
		kc_log(KC_LOG_DEBUG, "cannot write %s: %s", path, strerror(errno));
	if (fd >= 0)
		close(fd);
}

/* The lock of the store at state (a directory descriptor) is held by a daemon that stopped
 * serving and ends its shares (kc_store_note_stopping): wait for it, until its deadline and
 * KC_STORE_STOP_GRACE seconds more. Returns 0 once the lock is taken, else -EBUSY. */
static int wait_for_stopping(int state, int lock_fd, const char *root)
{
	char text[64] = "";
	int fd = openat(state, STOPPING_NOTE, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
	ssize_t n = fd >= 0 ? read(fd, text, sizeof(text) - 1) : -1;
	if (fd >= 0)
		close(fd);
	int pid;
	long long deadline;
	if (n <= 0 || sscanf(text, "%d %lld", &pid, &deadline) != 2)
		return -EBUSY;
	kc_log(KC_LOG_INFO, "the daemon (pid %d) that served %s has stopped and ends its shares "
	       "to the cluster store: waiting for it, at most %lld s", pid, root,
	       deadline + KC_STORE_STOP_GRACE - (long long)time(NULL));
	while ((long long)time(NULL) <= deadline + KC_STORE_STOP_GRACE) {
		if (flock(lock_fd, LOCK_EX | LOCK_NB) == 0)
			return 0;
		struct timespec pause = {0, 50 * 1000 * 1000};
		nanosleep(&pause, NULL);
	}
	return -EBUSY;
}

int kc_store_open(struct kc_store *s, const char *path, char *why, size_t whylen)
{
	char sub[4096];
	int state = -1, err;

	memset(s, 0, sizeof(*s));
	s->root_fd = s->tmp_fd = s->scratch_fd = s->lock_fd = -1;
	s->root_path = realpath(path, NULL);
	if (!s->root_path)
		return fail(why, whylen, -errno, "backing directory %s", path);
	s->root_fd = open(s->root_path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (s->root_fd < 0) {
		err = fail(why, whylen, -errno, "backing directory %s", s->root_path);
		goto out;
	}
	if (mkdirat(s->root_fd, KC_STATE_DIR, 0700) != 0 && errno != EEXIST) {
		err = fail(why, whylen, -errno, "cannot create %s/" KC_STATE_DIR, s->root_path);
		goto out;
	}
	state = openat(s->root_fd, KC_STATE_DIR, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
	if (state < 0) {
		err = fail(why, whylen, -errno, "cannot open %s/" KC_STATE_DIR, s->root_path);
		goto out;
	}
	s->lock_fd = openat(state, "lock", O_RDONLY | O_CREAT | O_CLOEXEC, 0600);
	if (s->lock_fd < 0) {
		err = fail(why, whylen, -errno, "cannot open %s/" KC_STATE_DIR "/lock", s->root_path);
		goto out;
	}
	err = flock(s->lock_fd, LOCK_EX | LOCK_NB) == 0 ? 0 : errno == EWOULDBLOCK ? -EBUSY : -errno;
	if (err == -EBUSY)
		err = wait_for_stopping(state, s->lock_fd, s->root_path);
	if (err) {
		err = fail(why, whylen, err, "another kcachefs already serves %s", s->root_path);
		goto out;
	}
	unlinkat(state, STOPPING_NOTE, 0); /* a stopping daemon's, which is gone now */
	snprintf(sub, sizeof(sub), "%s/" KC_STATE_DIR "/tmp", s->root_path);
	s->tmp_fd = fresh_dir(state, "tmp", sub);
	snprintf(sub, sizeof(sub), "%s/" KC_STATE_DIR "/scratch", s->root_path);
	kill_orphan_compiles(sub);
	s->scratch_fd = fresh_dir(state, "scratch", sub);
	if (s->tmp_fd < 0 || s->scratch_fd < 0) {
		err = fail(why, whylen, s->tmp_fd < 0 ? s->tmp_fd : s->scratch_fd,
			   "cannot prepare %s/" KC_STATE_DIR, s->root_path);
		goto out;
	}
	/* Integrity records need user xattrs: probe once, refuse clearly if absent. */
	char name[64];
	int probe = kc_store_tmpfile(s, 0600, name);
	if (probe < 0) {
		err = fail(why, whylen, probe, "cannot write in %s", s->root_path);
		goto out;
	}
	err = fsetxattr(probe, RECORD_XATTR, "probe", 5, 0) == 0 ? 0 : -errno;
	close(probe);
	unlinkat(s->tmp_fd, name, 0);
	if (err) {
		err = fail(why, whylen, err, "backing filesystem of %s needs user extended attributes",
			   s->root_path);
		goto out;
	}
	close(state);
	return 0;
out:
	if (state >= 0)
		close(state);
	kc_store_close(s);
	return err;
}

void kc_store_close(struct kc_store *s)
{
	/* Still holding the lock: leave no temporary or scratch directory behind. */
	if (s->lock_fd >= 0 && s->tmp_fd >= 0 && s->scratch_fd >= 0 && s->root_path) {
		static const char *const subs[] = {"tmp", "scratch"};
		for (unsigned i = 0; i < 2; i++) {
			char sub[4200];
			snprintf(sub, sizeof(sub), "%s/" KC_STATE_DIR "/%s", s->root_path, subs[i]);
			if (kc_store_remove_tree(sub) != 0 || mkdir(sub, 0700) != 0)
				kc_log(KC_LOG_WARN, "cannot clean %s: %s", sub, strerror(errno));
		}
	}
	if (s->lock_fd >= 0 && s->root_path) {
		char note[4200];
		snprintf(note, sizeof(note), "%s/" KC_STATE_DIR "/" STOPPING_NOTE, s->root_path);
		unlink(note);
	}
	int *fds[] = {&s->root_fd, &s->tmp_fd, &s->scratch_fd, &s->lock_fd};
	for (unsigned i = 0; i < 4; i++) {
		if (*fds[i] >= 0)
			close(*fds[i]);
		*fds[i] = -1;
	}
	free(s->root_path);
	s->root_path = NULL;
}

int kc_store_tmpfile(struct kc_store *s, mode_t mode, char name[64])
{
	for (;;) {
		snprintf(name, 64, "t%d.%llu", (int)getpid(),
			 (unsigned long long)atomic_fetch_add(&tmp_counter, 1));
		int fd = openat(s->tmp_fd, name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, mode);
		if (fd >= 0 || errno != EEXIST)
			return fd < 0 ? -errno : fd;
	}
}

int kc_store_scratch(struct kc_store *s, char *path, size_t pathlen)
{
	char name[64];
	for (;;) {
		snprintf(name, sizeof(name), "c%d.%llu", (int)getpid(),
			 (unsigned long long)atomic_fetch_add(&tmp_counter, 1));
		if (mkdirat(s->scratch_fd, name, 0700) == 0)
			break;
		if (errno != EEXIST)
			return -errno;
	}
	snprintf(path, pathlen, "%s/" KC_STATE_DIR "/scratch/%s", s->root_path, name);
	int fd = openat(s->scratch_fd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	return fd < 0 ? -errno : fd;
}

int kc_store_copy_tmp(struct kc_store *s, int src_fd, mode_t mode, char name[64])
{
	char buf[65536];
	off_t off = 0;
	int fd = kc_store_tmpfile(s, mode, name);
	if (fd < 0)
		return fd;
	for (;;) {
		ssize_t n = pread(src_fd, buf, sizeof(buf), off);
		if (n < 0 && errno == EINTR)
			continue;
		int err = n < 0 ? -errno : n > 0 ? kc_write_all(fd, buf, (size_t)n) : 0;
		if (err) {
			close(fd);
			unlinkat(s->tmp_fd, name, 0);
			return err;
		}
		if (n == 0)
			return fd;
		off += n;
	}
}

int kc_store_same_bytes(int a, int b)
{
	struct stat sa, sb;
	char ba[65536], bb[65536];
	off_t off = 0;

	if (fstat(a, &sa) != 0 || fstat(b, &sb) != 0)
		return -errno;
	if (sa.st_size != sb.st_size)
		return 0;
	while (off < sa.st_size) {
		ssize_t na = pread(a, ba, sizeof(ba), off);
		ssize_t nb = pread(b, bb, sizeof(bb), off);
		if (na < 0 || nb < 0)
			return -errno;
		if (na != nb || memcmp(ba, bb, (size_t)na) != 0)
			return 0;
		if (na == 0)
			return 0; /* shrank under us */
		off += na;
	}
	return 1;
}

int kc_store_commit(int src_dir, const char *src_name, int dst_dir, const char *dst_name)
{
	if (renameat2(src_dir, src_name, dst_dir, dst_name, RENAME_NOREPLACE) == 0)
		return 0;
	if (errno != EEXIST)
		return -errno;
	int a = openat(src_dir, src_name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
	int b = openat(dst_dir, dst_name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
	int same = (a < 0 || b < 0) ? -errno : kc_store_same_bytes(a, b);
	if (a >= 0)
		close(a);
	if (b >= 0)
		close(b);
	if (same < 0)
		return same;
	if (!same)
		return -EEXIST;
	if (unlinkat(src_dir, src_name, 0) != 0 && errno != ENOENT)
		return -errno;
	return 1;
}

int kc_store_write_atomic(struct kc_store *s, int dir, const char *name, const void *buf,
			  size_t len)
{
	char tmp[64];
	int fd = kc_store_tmpfile(s, 0644, tmp);

	if (fd < 0)
		return fd;
	int err = kc_write_all(fd, buf, len);
	close(fd);
	if (!err && renameat(s->tmp_fd, tmp, dir, name) != 0)
		err = -errno;
	if (err)
		unlinkat(s->tmp_fd, tmp, 0);
	return err;
}

void kc_store_unlink_if_same(int dir, const char *name, const struct stat *st)
{
	struct stat now;
	if (fstatat(dir, name, &now, AT_SYMLINK_NOFOLLOW) == 0 && now.st_ino == st->st_ino &&
	    now.st_dev == st->st_dev)
		unlinkat(dir, name, 0);
}

int kc_store_sync_dir(int dir)
{
	char path[32];
	kc_fd_path(dir, path);
	int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	int err = fsync(fd) == 0 ? 0 : -errno;
	close(fd);
	return err;
}

/* The attribute calls on a file's descriptor: fsetxattr/fgetxattr, else (an O_PATH
 * descriptor: EBADF) through its /proc/self/fd link, a path walk through /proc (each
 * publish set its record and key so, twice a fetched kernel). */
static int fd_setxattr(int fd, const char *name, const void *val, size_t len)
{
	if (fsetxattr(fd, name, val, len, 0) == 0)
		return 0;
	if (errno != EBADF)
		return -errno;
	char path[32];
	kc_fd_path(fd, path);
	return setxattr(path, name, val, len, 0) == 0 ? 0 : -errno;
}

static ssize_t fd_getxattr(int fd, const char *name, void *val, size_t size)
{
	ssize_t n = fgetxattr(fd, name, val, size);
	if (n >= 0 || errno != EBADF)
		return n;
	char path[32];
	kc_fd_path(fd, path);
	return getxattr(path, name, val, size);
}

int kc_record_write(int fd, const struct kc_record *rec)
{
	char val[256];
	int n = snprintf(val, sizeof(val), "v1 %s %llu %s %s", rec->sha256,
			 (unsigned long long)rec->size, rec->recipe[0] ? rec->recipe : "-",
			 rec->origin == KC_ORIGIN_COMPILED ? "compiled" : "client");
	return fd_setxattr(fd, RECORD_XATTR, val, (size_t)n);
}

int kc_record_read(int fd, struct kc_record *rec)
{
	char val[256], origin[16];
	unsigned long long size;

	ssize_t n = fd_getxattr(fd, RECORD_XATTR, val, sizeof(val) - 1);
	if (n < 0)
		return errno == ENODATA ? -ENODATA : -errno;
	val[n] = '\0';
	if (sscanf(val, "v1 %64s %llu %64s %15s", rec->sha256, &size, rec->recipe, origin) != 4 ||
	    strlen(rec->sha256) != KC_SHA256_HEXLEN ||
	    strspn(rec->sha256, "0123456789abcdef") != KC_SHA256_HEXLEN)
		return -EINVAL;
	rec->size = size;
	if (strcmp(rec->recipe, "-") == 0)
		rec->recipe[0] = '\0';
	if (strcmp(origin, "compiled") == 0)
		rec->origin = KC_ORIGIN_COMPILED;
	else if (strcmp(origin, "client") == 0)
		rec->origin = KC_ORIGIN_CLIENT;
	else
		return -EINVAL;
	return 0;
}

int kc_key_record_write(int fd, const char key[KC_SHA256_HEXLEN + 1])
{
	return fd_setxattr(fd, KC_KEY_XATTR, key, KC_SHA256_HEXLEN);
}

int kc_store_mark_rejected(int dir, const char *recipe_hex)
{
	char path[32];
	kc_fd_path(dir, path);
	return setxattr(path, REJECTED_XATTR, recipe_hex, strlen(recipe_hex), 0) == 0 ? 0 : -errno;
}

int kc_store_rejection(int dir, const char *recipe_hex, int *marked)
{
	char path[32], val[KC_SHA256_HEXLEN + 1];
	kc_fd_path(dir, path);
	ssize_t n = getxattr(path, REJECTED_XATTR, val, sizeof(val) - 1);
	if (marked)
		*marked = n > 0 || (n < 0 && errno != ENODATA);
	if (n <= 0)
		return 0;
	val[n] = '\0';
	return strcmp(val, recipe_hex) == 0;
}

int kc_store_is_rejected(int dir, const char *recipe_hex)
{
	return kc_store_rejection(dir, recipe_hex, NULL);
}

void kc_store_clear_rejected(int dir)
{
	char path[32];
	kc_fd_path(dir, path);
	removexattr(path, REJECTED_XATTR);
}

int kc_store_mark_refused(int dir, const char *what)
{
	char path[32];
	kc_fd_path(dir, path);
	return setxattr(path, REFUSED_XATTR, what, strlen(what), 0) == 0 ? 0 : -errno;
}

int kc_store_is_refused(int dir)
{
	char path[32];
	kc_fd_path(dir, path);
	return getxattr(path, REFUSED_XATTR, NULL, 0) > 0;
}

void kc_store_clear_refused(int dir)
{
	char path[32];
	kc_fd_path(dir, path);
	removexattr(path, REFUSED_XATTR);
}
