/* remote_watch.c - see remote_watch.h */
#define _GNU_SOURCE
#include "remote_watch.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/magic.h>
#include <poll.h>
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
 * raise no event, but the mapping is made through an open). */
#define FILE_EVENTS (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_OPEN | IN_MOVE_SELF | \
		     IN_DELETE_SELF)
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

/* Read every queued event and poll the mount table (w->lock held): the generation moves
 * on if anything came. */
static void drain(struct kc_watch *w)
{
	char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
	int moved = 0;
	for (;;) {
		ssize_t n = read(w->fd, buf, sizeof(buf));
		if (n > 0) {
			moved = 1;
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno != EAGAIN) /* cannot tell what happened: never a proof again */
			w->broken = 1;
		break;
	}
	struct pollfd p = {.fd = w->mounts_fd, .events = POLLPRI};
	int r = poll(&p, 1, 0);
	if (r < 0 || (r > 0 && (p.revents & (POLLPRI | POLLERR | POLLNVAL))))
		moved = 1;
	if (moved)
		w->gen++;
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
 * why filled. The open is this process's own: its IN_OPEN moves the generation before
 * kc_watch_arm returns it. */
static int no_writer(const char *path, char *why, size_t whylen)
{
	int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC); /* no lease break wait */
	/* a writer's open while the lease is held breaks it with a signal to this process:
	 * SIGURG, ignored unless handled (SIGIO, the default, would end the daemon) */
	int err = fd < 0 || fcntl(fd, F_SETSIG, SIGURG) != 0 ||
			  fcntl(fd, F_SETLEASE, F_RDLCK) != 0 ? -errno : 0;
	if (fd >= 0 && !err)
		fcntl(fd, F_SETLEASE, F_UNLCK);
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

/* Watch path (a directory when dir) after checking its filesystem. Returns 0, or -errno
 * with why filled. */
static int watch_one(struct kc_watch *w, const char *path, int dir, char *why, size_t whylen)
{
	struct statfs fs;
	if (statfs(path, &fs) != 0) {
		int err = -errno;
		snprintf(why, whylen, "%s: %s", path, strerror(errno));
		return err;
	}
	if (!kc_tree_local_type((unsigned long)fs.f_type)) {
		snprintf(why, whylen, "%s is on a filesystem (type 0x%lx) whose changes may come "
			 "from another machine", path, (unsigned long)fs.f_type);
		return -EXDEV;
	}
	if ((unsigned long)fs.f_type == OVERLAYFS_SUPER_MAGIC) { /* local for the memo, not here */
		snprintf(why, whylen, "%s is on an overlayfs: a change made in one of its layers "
			 "(not through it) raises no event on it", path);
		return -EXDEV;
	}
	if (inotify_add_watch(w->fd, path, dir ? DIR_EVENTS : FILE_EVENTS) < 0) {
		int err = -errno;
		snprintf(why, whylen, "%s: inotify_add_watch: %s%s", path, strerror(errno),
			 errno == ENOSPC ? " (fs.inotify.max_user_watches)" : "");
		return err;
	}
	return dir ? 0 : no_writer(path, why, whylen);
}

/* Whether dir is other or a directory above it, by their strings. */
static int above(const char *dir, const char *other)
{
	size_t n = strlen(dir);
	return strncmp(other, dir, n) == 0 && (other[n] == '/' || other[n] == '\0' || n == 1);
}

/* Watch the header path (absolute) and every directory whose entries its walk looks up,
 * walking it here as the kernel does: a symlink met on the way (the header itself, a
 * directory, or a link a link names, any number deep) is read and its target walked from
 * "/" or from the directory holding it. Every directory that holds a symlink of a chain is
 * thus watched (re-pointing a link in the middle of a chain raises an event only in its own
 * directory, not on the file nor on the walk as written). prev: the resolved path of the
 * previous header, updated here; the directories above it were watched by its walk (a list
 * is sorted, so its headers share most of their walks). */
static int watch_header(struct kc_watch *w, const char *path, char prev[PATH_MAX], char *why,
			size_t whylen)
{
	char cur[PATH_MAX] = "/", rest[PATH_MAX], next[PATH_MAX], target[PATH_MAX];
	struct stat st;
	int hops = 0, err = 0;
	if (path[0] != '/') {
		snprintf(why, whylen, "%.200s: not an absolute path", path);
		return -EINVAL;
	}
	if (!above("/", prev) || !prev[0])
		err = watch_one(w, "/", 1, why, whylen);
	snprintf(rest, sizeof(rest), "%s", path);
	while (!err) {
		char *p = rest + strspn(rest, "/");
		size_t cl = strcspn(p, "/");
		if (cl == 0) { /* the walk ended at a directory: not a header */
			snprintf(why, whylen, "%.200s: a directory", path);
			return -EISDIR;
		}
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
			if (last) {
				snprintf(why, whylen, "%.200s: a directory", path);
				return -EISDIR;
			}
			continue;
		}
		if ((size_t)snprintf(next, sizeof(next), "%s%s%.*s", cur, cur[1] ? "/" : "",
				     (int)cl, p) >= sizeof(next)) {
			snprintf(why, whylen, "%.200s: name too long", path);
			return -ENAMETOOLONG;
		}
		if (lstat(next, &st) != 0) {
			err = -errno;
			snprintf(why, whylen, "%s: %s", next, strerror(errno));
			return err;
		}
		if (S_ISLNK(st.st_mode)) {
			ssize_t n = readlink(next, target, sizeof(target) - 1);
			if (n <= 0 || ++hops > 40 || (size_t)n + strlen(after) >= sizeof(rest)) {
				snprintf(why, whylen, "%s: an unreadable symlink or too many", next);
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
			if (S_ISDIR(st.st_mode)) {
				snprintf(why, whylen, "%.200s: a directory", path);
				return -EISDIR;
			}
			err = watch_one(w, cur, 0, why, whylen);
			break;
		}
		if (!S_ISDIR(st.st_mode)) {
			snprintf(why, whylen, "%s: %s", cur, strerror(ENOTDIR));
			return -ENOTDIR;
		}
		if (!above(cur, prev))
			err = watch_one(w, cur, 1, why, whylen);
	}
	if (!err)
		snprintf(prev, PATH_MAX, "%s", cur);
	return err;
}

unsigned long kc_watch_arm(struct kc_watch *w, const char *list, size_t len)
{
	char why[PATH_MAX + 200] = "", path[PATH_MAX], prev[PATH_MAX] = "";
	pthread_mutex_lock(&w->lock);
	int err = w->broken ? -EIO : start(w);
	if (err)
		snprintf(why, sizeof(why), "no inotify instance: %s%s", strerror(-err),
			 err == -EMFILE ? " (fs.inotify.max_user_instances)" : "");
	for (size_t off = 0; off < len && !err;) {
		const char *nl = memchr(list + off, '\n', len - off);
		size_t ll = nl ? (size_t)(nl - (list + off)) : len - off;
		if (ll <= KC_SHA256_HEXLEN + 1 || ll - KC_SHA256_HEXLEN - 1 >= sizeof(path)) {
			snprintf(why, sizeof(why), "a malformed header list");
			err = -EINVAL;
			break;
		}
		memcpy(path, list + off + KC_SHA256_HEXLEN + 1, ll - KC_SHA256_HEXLEN - 1);
		path[ll - KC_SHA256_HEXLEN - 1] = '\0';
		off += ll + 1;
		err = watch_header(w, path, prev, why, sizeof(why));
	}
	unsigned long gen = 0;
	if (!err && !w->broken) {
		drain(w); /* what changed while the watches were added, the stats will see */
		gen = w->broken ? 0 : w->gen;
	}
	/* a header missing here is the rehash's to report (a miss), not the watch's */
	/* nor one open for writing now (for this rehash only) */
	w->failing = !gen;
	int first = !gen && err != -ENOENT && err != -ENOTDIR && err != -EBUSY &&
		    w->unwatched++ == 0;
	pthread_mutex_unlock(&w->lock);
	if (first)
		kc_log(KC_LOG_INFO, "header lists are not watched, each fetch stats its headers: %s",
		       why[0] ? why : "cannot read the watch's events");
	return gen;
}

int kc_watch_unchanged(struct kc_watch *w, unsigned long gen)
{
	pthread_mutex_lock(&w->lock);
	int same = 0;
	if (gen && w->fd >= 0 && !w->broken) {
		drain(w);
		same = !w->broken && w->gen == gen;
	}
	pthread_mutex_unlock(&w->lock);
	return same;
}

int kc_watch_failing(struct kc_watch *w)
{
	pthread_mutex_lock(&w->lock);
	int failing = w->failing;
	pthread_mutex_unlock(&w->lock);
	return failing;
}
