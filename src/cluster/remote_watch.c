/* remote_watch.c - see remote_watch.h */
#define _GNU_SOURCE
#include "remote_watch.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/magic.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "hash.h"
#include "log.h"
#include "tree.h"

/* A header: its content, its times, its name, and any open (a writable mapping's writes
 * raise no event, but the mapping is made through an open) and close without a write (so
 * that kc_watch_arm can tell its own open of a header from another process's: drain). */
#define FILE_EVENTS (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_OPEN | IN_CLOSE_NOWRITE | \
		     IN_MOVE_SELF | IN_DELETE_SELF)
/* A directory a walk passes through: the names in it, and its own name. */
#define DIR_EVENTS (IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_ATTRIB | \
		    IN_MOVE_SELF | IN_DELETE_SELF | IN_ONLYDIR)


void kc_watch_init(struct kc_watch *w)
{
	memset(w, 0, sizeof(*w));
	pthread_mutex_init(&w->lock, NULL);
	w->fd = w->mounts_fd = -1;
	w->gen = 1;
}

void kc_watch_destroy(struct kc_watch *w)
{
	if (w->fd >= 0)
		close(w->fd);
	if (w->mounts_fd >= 0)
		close(w->mounts_fd);
	w->fd = w->mounts_fd = -1;
	pthread_mutex_destroy(&w->lock);
}

/* Read every queued event and poll the mount table (w->lock held). The events of own (the
 * watch of each header kc_watch_arm opened for its lease, n of them, in that order) are
 * this process's own when they come exactly so: each header's IN_OPEN, then its
 * IN_CLOSE_NOWRITE. Anything else (another process's event, a queue overflow, a change of
 * the mount table) moves the generation on. Returns 1 when nothing else came and all of
 * own's did. A writer's open waits for the lease until the close that ends it, after its
 * IN_CLOSE_NOWRITE is queued (__fput: fsnotify_close, then locks_remove_file), so it is
 * never merged into this process's own IN_OPEN (inotify merges an event only into an
 * identical one just before it); a reader's may be, which proves nothing wrong. */
static int drain(struct kc_watch *w, const int *own, size_t n)
{
	char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
	int other = 0;
	size_t next = 0; /* the own event expected next: header next / 2, open or close */
	for (;;) {
		ssize_t len = read(w->fd, buf, sizeof(buf));
		if (len < 0 && errno == EINTR)
			continue;
		if (len <= 0) {
			if (len == 0 || errno != EAGAIN) /* cannot tell what happened: never again */
				w->broken = 1;
			break;
		}
		for (char *e = buf; e < buf + len;) {
			const struct inotify_event *ev = (const struct inotify_event *)(void *)e;
			uint32_t want = next % 2 ? IN_CLOSE_NOWRITE : IN_OPEN;
			if (next < 2 * n && ev->wd == own[next / 2] && ev->mask == want)
				next++;
			else
				other = 1;
			e += sizeof(*ev) + ev->len;
		}
	}
	struct pollfd p = {.fd = w->mounts_fd, .events = POLLPRI};
	int r = poll(&p, 1, 0);
	if (r < 0 || (r > 0 && (p.revents & (POLLPRI | POLLERR | POLLNVAL))))
		other = 1;
	if (other)
		w->gen++;
	return !other && next == 2 * n;
}

/* Make w's inotify instance and open the mount table (w->lock held). Returns 0 or -errno. */
static int start(struct kc_watch *w)
{
	if (w->fd >= 0)
		return 0;
	w->fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
	if (w->fd < 0)
		return -errno;
	w->mounts_fd = open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC);
	if (w->mounts_fd < 0) {
		int err = -errno;
		close(w->fd);
		w->fd = -1;
		return err;
	}
	return 0;
}

/* 0 if no process has the header path open for writing, checked after its watch is added:
 * a writable mapping made (or a writable descriptor opened, then mapped) before the watch
 * was added writes with no event at all, and its IN_OPEN came before the watch. A read
 * lease can be had only on a file nobody has open for writing (fcntl(2) F_SETLEASE; the
 * daemon runs as root, or owns the file). Else -EBUSY, or -errno where it cannot tell, with
 * why filled. The open and close are this process's own (drain tells them from others):
 * the lease ends with the close, so that a writer's open that waited on it comes after.
 * With the lease held, fill (if any) is given listed (the header's path as listed) and the
 * descriptor; a lease broken meanwhile is -EBUSY. */
static int no_writer(const char *path, const char *listed, int (*fill)(const char *, int),
		     char *why, size_t whylen)
{
	int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC); /* no lease break wait */
	/* a writer's open while the lease is held breaks it with a signal to this process:
	 * SIGURG, ignored unless handled (SIGIO, the default, would end the daemon) */
	int err = fd < 0 || fcntl(fd, F_SETSIG, SIGURG) != 0 ||
			  fcntl(fd, F_SETLEASE, F_RDLCK) != 0 ? -errno : 0;
	if (!err && fill)
		fill(listed, fd);
	/* still held: a writer's open that broke it (the kernel drops a lease that is not
	 * released lease-break-time after a break) could have come while the file was open
	 * here, and its IN_OPEN merged into this process's own */
	if (!err && fcntl(fd, F_GETLEASE) != F_RDLCK)
		err = -EBUSY;
	if (fd >= 0)
		close(fd);
	if (err == -EAGAIN || err == -EWOULDBLOCK)
		err = -EBUSY;
	if (err == -EBUSY)
		snprintf(why, whylen, "%s is open for writing (a write through a mapping raises "
			 "no event)", path);
	else if (err)
		snprintf(why, whylen, "%s: cannot tell whether it is open for writing: %s", path,
			 strerror(-err));
	return err;
}

/* One kc_watch_arm under way. */
struct arm {
	struct kc_watch *w;
	int *own;           /* the watch of each header opened for its lease, in order */
	size_t n, cap;
	dev_t fs_dev;       /* the device whose filesystem passed the check last */
	int fs_checked;
	int (*fill)(const char *path, int fd); /* kc_watch_arm's */
	const char *listed;  /* the header being watched, as the list names it */
	char prev[PATH_MAX]; /* the last header's path as walked (no symlink in it): every
			      * directory above it was looked up and watched by this arm */
	char why[PATH_MAX + 200];
};

/* Watch path (st: its lstat; a directory when dir) after checking its filesystem, once per
 * device. Returns 0, or -errno with a->why filled. */
static int watch_one(struct arm *a, const char *path, const struct stat *st, int dir)
{
	if (!a->fs_checked || st->st_dev != a->fs_dev) {
		struct statfs fs;
		if (statfs(path, &fs) != 0) {
			int err = -errno;
			snprintf(a->why, sizeof(a->why), "%s: %s", path, strerror(errno));
			return err;
		}
		if (!kc_tree_local_type((unsigned long)fs.f_type)) {
			snprintf(a->why, sizeof(a->why), "%s is on a filesystem (type 0x%lx) whose "
				 "changes may come from another machine", path,
				 (unsigned long)fs.f_type);
			return -EXDEV;
		}
		if ((unsigned long)fs.f_type == OVERLAYFS_SUPER_MAGIC) { /* local for the memo */
			snprintf(a->why, sizeof(a->why), "%s is on an overlayfs: a change made in one "
				 "of its layers (not through it) raises no event on it", path);
			return -EXDEV;
		}
		a->fs_dev = st->st_dev;
		a->fs_checked = 1;
	}
	/* IN_MASK_ADD: a watch added again (by another list's arm) keeps its mask, which is
	 * the same; without it the mask is set anew through 0, and an event that comes in that
	 * instant is lost */
	int wd = inotify_add_watch(a->w->fd, path, (dir ? DIR_EVENTS : FILE_EVENTS) | IN_MASK_ADD);
	if (wd < 0) {
		int err = -errno;
		snprintf(a->why, sizeof(a->why), "%s: inotify_add_watch: %s%s", path,
			 strerror(errno), errno == ENOSPC ? " (fs.inotify.max_user_watches)" : "");
		return err;
	}
	if (dir)
		return 0;
	if (a->n == a->cap) {
		size_t cap = a->cap ? 2 * a->cap : 256;
		int *own = realloc(a->own, cap * sizeof(*own));
		if (!own) {
			snprintf(a->why, sizeof(a->why), "out of memory");
			return -ENOMEM;
		}
		a->own = own;
		a->cap = cap;
	}
	a->own[a->n++] = wd;
	return no_writer(path, a->listed, a->fill, a->why, sizeof(a->why));
}

/* Whether dir is a directory strictly above the path other, by their strings. */
static int strictly_above(const char *dir, const char *other)
{
	size_t n = strlen(dir);
	return strncmp(other, dir, n) == 0 && other[n] == '/';
}

/* Watch the header path (absolute) and every directory whose entries its walk looks up,
 * walking it here as the kernel does: a symlink met on the way (the header itself, a
 * directory, or a link a link names, any number deep) is read and its target walked from
 * "/" or from the directory holding it. Every directory that holds a symlink of a chain is
 * thus watched (re-pointing a link in the middle of a chain raises an event only in its own
 * directory, not on the file nor on the walk as written). A directory above a->prev was
 * looked up and watched by this arm already (a list is sorted, so its headers share most
 * of their walks): it is passed without a look, since any change to it since raised an
 * event that ends this arm's word (kc_watch_arm). a->prev is updated here. */
static int watch_header(struct arm *a, const char *path)
{
	char cur[PATH_MAX] = "/", rest[PATH_MAX], next[PATH_MAX], target[PATH_MAX];
	struct stat st;
	int hops = 0, err = 0;
	if (path[0] != '/') {
		snprintf(a->why, sizeof(a->why), "%.200s: not an absolute path", path);
		return -EINVAL;
	}
	if (!a->prev[0])
		err = lstat("/", &st) == 0 ? watch_one(a, "/", &st, 1) : -errno;
	snprintf(rest, sizeof(rest), "%s", path);
	while (!err) {
		char *p = rest + strspn(rest, "/");
		size_t cl = strcspn(p, "/");
		if (cl == 0) /* the walk ended at a directory ("dir/.", "dir/"): cur, watched */
			break;
		const char *after = p + cl; /* "" or "/..." */
		int last = after[strspn(after, "/")] == '\0';
		if (cl == 1 && p[0] == '.') {
			memmove(rest, after, strlen(after) + 1);
			continue;
		}
		if (cl == 2 && p[0] == '.' && p[1] == '.') {
			char *slash = strrchr(cur, '/');
			slash[slash == cur] = '\0'; /* "/a/b" -> "/a" -> "/"; "/" stays */
			memmove(rest, after, strlen(after) + 1);
			if (last)
				break; /* a directory above, watched on the way down */
			continue;
		}
		if ((size_t)snprintf(next, sizeof(next), "%s%s%.*s", cur, cur[1] ? "/" : "",
				     (int)cl, p) >= sizeof(next)) {
			snprintf(a->why, sizeof(a->why), "%.200s: name too long", path);
			return -ENAMETOOLONG;
		}
		if (strictly_above(next, a->prev)) { /* a directory this arm watched */
			snprintf(cur, sizeof(cur), "%s", next);
			memmove(rest, after, strlen(after) + 1);
			if (last)
				break; /* a directory looked up: watched */
			continue;
		}
		if (lstat(next, &st) != 0) {
			err = -errno;
			if (err == -ENOENT) {
				/* a lookup that finds nothing (a header searched in a directory
				 * before the one that has it, __has_include): a name made in cur,
				 * watched on this walk, raises an event there */
				err = 0;
				break;
			}
			snprintf(a->why, sizeof(a->why), "%s: %s", next, strerror(errno));
			return err;
		}
		if (S_ISLNK(st.st_mode)) {
			ssize_t n = readlink(next, target, sizeof(target) - 1);
			if (n <= 0 || ++hops > 40 || (size_t)n + strlen(after) >= sizeof(rest)) {
				snprintf(a->why, sizeof(a->why), "%s: an unreadable symlink or too many",
					 next);
				return -ELOOP;
			}
			if (target[0] == '/')
				snprintf(cur, sizeof(cur), "/");
			memmove(rest + n, after, strlen(after) + 1); /* rest: the target, then after */
			memcpy(rest, target, (size_t)n);
			continue;
		}
		snprintf(cur, sizeof(cur), "%s", next);
		memmove(rest, after, strlen(after) + 1);
		if (last) {
			/* a directory looked up (an include directory tested) or read whole:
			 * watched as the walk's directories are, so that a name made or removed
			 * in it raises an event */
			err = watch_one(a, cur, &st, S_ISDIR(st.st_mode));
			break;
		}
		if (!S_ISDIR(st.st_mode)) {
			/* the lookup found nothing (ENOTDIR): cur, which holds this name, is
			 * watched, and a directory made in its place raises an event there */
			break;
		}
		err = watch_one(a, cur, &st, 1);
	}
	if (!err)
		snprintf(a->prev, sizeof(a->prev), "%s", cur);
	return err;
}

unsigned long kc_watch_arm(struct kc_watch *w, const char *list, size_t len,
			   int (*fill)(const char *path, int fd))
{
	struct arm a = {.w = w, .fill = fill, .listed = ""};
	char path[PATH_MAX];
	__atomic_add_fetch(&w->arming, 1, __ATOMIC_SEQ_CST); /* before the lock: see unchanged */
	pthread_mutex_lock(&w->lock);
	int err = w->broken ? -EIO : start(w);
	if (err)
		snprintf(a.why, sizeof(a.why), "no inotify instance: %s%s", strerror(-err),
			 err == -EMFILE ? " (fs.inotify.max_user_instances)" : "");
	else
		drain(w, NULL, 0); /* what came before (this daemon's own reads too) */
	for (size_t off = 0; off < len && !err;) {
		const char *nl = memchr(list + off, '\n', len - off);
		size_t ll = nl ? (size_t)(nl - (list + off)) : len - off;
		if (ll <= KC_SHA256_HEXLEN + 1 || ll - KC_SHA256_HEXLEN - 1 >= sizeof(path)) {
			snprintf(a.why, sizeof(a.why), "a malformed header list");
			err = -EINVAL;
			break;
		}
		memcpy(path, list + off + KC_SHA256_HEXLEN + 1, ll - KC_SHA256_HEXLEN - 1);
		path[ll - KC_SHA256_HEXLEN - 1] = '\0';
		off += ll + 1;
		a.listed = path;
		if (path[0] == '+') /* a directory's names: the directory, watched */
			memmove(path, path + 1, strlen(path));
		if (path[0] == '>') { /* a readlink: a link re-pointed is an event in its directory */
			char *slash = strrchr(path, '/');
			if (slash == path + 1)
				slash++; /* a link in "/" */
			if (slash)
				*slash = '\0';
			memmove(path, path + 1, strlen(path));
		}
		err = watch_header(&a, path);
	}
	/* Word is given only when nothing but this arm's own opens came meanwhile: a change to
	 * a directory already walked, or to a header already checked, would otherwise pass
	 * unseen by both this arm and the stats after it. */
	unsigned long gen = 0;
	int quiet = 0;
	if (!err && !w->broken) {
		quiet = drain(w, a.own, a.n);
		gen = quiet && !w->broken ? w->gen : 0;
	}
	free(a.own);
	/* a header missing here is the rehash's to report (a miss), not the watch's; nor one
	 * open for writing now, nor a change during the arm (for this rehash only) */
	int failing = !gen && (w->broken || (err && err != -ENOENT && err != -ENOTDIR &&
						    err != -EBUSY));
	int first = failing && w->unwatched++ == 0;
	pthread_mutex_unlock(&w->lock);
	__atomic_sub_fetch(&w->arming, 1, __ATOMIC_SEQ_CST);
	if (first)
		kc_log(KC_LOG_INFO, "header lists are not watched, each fetch stats its headers: %s",
		       a.why[0] ? a.why : "cannot read the watch's events");
	return gen;
}

int kc_watch_unchanged(struct kc_watch *w, unsigned long gen)
{
	/* an arm counts itself in arming before it waits for the lock, so a drain never
	 * queues behind one (it would wait the whole arm) */
	while (pthread_mutex_trylock(&w->lock) != 0) {
		if (__atomic_load_n(&w->arming, __ATOMIC_SEQ_CST))
			return -EBUSY;
		sched_yield(); /* another drain: microseconds */
	}
	int same = 0;
	if (gen && w->fd >= 0 && !w->broken) {
		drain(w, NULL, 0);
		same = !w->broken && w->gen == gen;
	}
	pthread_mutex_unlock(&w->lock);
	return same;
}
