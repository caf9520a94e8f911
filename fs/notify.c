/* notify.c - see notify.h */
#include "notify.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "store.h"

struct inval {
	struct kc_notifier *n;
	struct kc_inode_table *inodes;
	struct kc_inode *held; /* the parent, held until sent */
	fuse_ino_t parent;     /* with an empty name: the inode to invalidate */
	char name[];
};

/* Send one invalidation unless the session is over (a request the loop dropped may hold
 * the directory's lock: see kc_notifier_stop). */
static int notify_entry(struct kc_notifier *n, fuse_ino_t parent, const char *name)
{
	if (fuse_session_exited(n->se))
		return -ESHUTDOWN;
	__atomic_add_fetch(&n->sending, 1, __ATOMIC_SEQ_CST);
	int err = fuse_lowlevel_notify_inval_entry(n->se, parent, name, strlen(name));
	__atomic_sub_fetch(&n->sending, 1, __ATOMIC_SEQ_CST);
	return err;
}

static void send_inval(void *arg)
{
	struct inval *it = arg;
	int err;
	if (it->name[0]) {
		err = notify_entry(it->n, it->parent, it->name);
	} else if (fuse_session_exited(it->n->se)) {
		err = -ESHUTDOWN;
	} else {
		__atomic_add_fetch(&it->n->sending, 1, __ATOMIC_SEQ_CST);
		err = fuse_lowlevel_notify_inval_inode(it->n->se, it->parent, 0, 0);
		__atomic_sub_fetch(&it->n->sending, 1, __ATOMIC_SEQ_CST);
	}
	if (err && err != -ENOENT)
		kc_log(KC_LOG_DEBUG, "invalidate %s: %s", it->name, strerror(-err));
	kc_inode_forget(it->inodes, it->held, 1);
	free(it);
}

int kc_notifier_start(struct kc_notifier *n, struct fuse_session *se,
		      struct kc_inode_table *inodes, const struct kc_store *store)
{
	n->se = se;
	n->inodes = inodes;
	n->store = store;
	n->pool = kc_pool_create(1);
	return n->pool ? 0 : -errno;
}

void kc_notifier_inval_entry(struct kc_notifier *n, fuse_ino_t parent, const char *name)
{
	size_t len = strlen(name);
	struct inval *it = malloc(sizeof(*it) + len + 1);
	if (!it)
		return;
	it->n = n;
	it->inodes = n->inodes;
	it->held = kc_inode_get(n->inodes, parent);
	it->parent = parent;
	memcpy(it->name, name, len + 1);
	kc_inode_hold(n->inodes, it->held);
	if (kc_pool_submit(n->pool, send_inval, it) != 0) {
		kc_inode_forget(n->inodes, it->held, 1);
		free(it);
	}
}

void kc_notifier_inval_inode(struct kc_notifier *n, fuse_ino_t ino)
{
	kc_notifier_inval_entry(n, ino, ""); /* an empty name: the inode itself */
}

int kc_notifier_inval_path(struct kc_notifier *n, const char *rel)
{
	char dir[4096];
	const char *slash = strrchr(rel, '/'), *name = slash ? slash + 1 : rel;
	struct kc_inode *parent = &n->inodes->root;
	if (slash) {
		struct stat st;
		snprintf(dir, sizeof(dir), "%.*s", (int)(slash - rel), rel);
		if (fstatat(n->inodes->root.fd, dir, &st, AT_SYMLINK_NOFOLLOW) != 0)
			return -errno;
		parent = kc_inode_find_held(n->inodes, st.st_dev, st.st_ino);
		if (!parent)
			return -ENOENT; /* the kernel forgot the directory, and so this dentry */
	}
	int err = notify_entry(n, kc_inode_ino(n->inodes, parent), name);
	if (parent != &n->inodes->root)
		kc_inode_forget(n->inodes, parent, 1);
	return err;
}

static void inval_root(void *arg)
{
	struct kc_notifier *n = arg;
	int fd = openat(n->inodes->root.fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
	if (!d) {
		int err = errno;
		if (fd >= 0)
			close(fd);
		kc_log(KC_LOG_WARN, "cannot read the root to have the kernel look its names up "
		       "again (%s): a mkdir in a directory it held may fail once", strerror(err));
		return;
	}
	unsigned sent = 0, known = 0;
	for (struct dirent *de; (de = readdir(d)) && !fuse_session_exited(n->se);) {
		if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
			continue;
		int err = notify_entry(n, FUSE_ROOT_ID, de->d_name);
		sent++;
		known += err == 0; /* -ENOENT: the kernel had no dentry of it */
	}
	closedir(d);
	kc_log(KC_LOG_INFO, "the kernel looks the root's names up again: %u of %u were cached "
	       "with the dead daemon's node ids", known, sent);
}

int kc_notifier_inval_root(struct kc_notifier *n)
{
	return kc_pool_submit(n->pool, inval_root, n) != 0 ? -ENOMEM : 0;
}

/* Invalidate the kernel's dentry of in, found by its current path under the root (a
 * pending inode's, whose fd is its entry: the entry's kernel.cubin). Returns 0 when sent. */
static int inval_by_path(struct kc_notifier *n, struct kc_inode *in)
{
	char rel[PATH_MAX];
	if (kc_store_rel_path(n->store, in->fd, rel, sizeof(rel)) != 0)
		return -1; /* unlinked, outside the root, or a path too long */
	if (in->pending) {
		size_t len = strlen(rel);
		int w = snprintf(rel + len, sizeof(rel) - len, "/%s", KC_CUBIN_NAME);
		if (w < 0 || (size_t)w >= sizeof(rel) - len)
			return -1;
	}
	return kc_notifier_inval_path(n, rel);
}

/* One pass: ask the kernel to forget the least recently used inodes until no more than
 * three quarters of the bound are left that were not asked already. */
static void relieve_pass(struct kc_notifier *n)
{
	struct kc_inode_table *t = n->inodes;
	uint64_t count, low = t->max - t->max / 4;
	/* Again while over: lookups may outpace one round. Inodes already asked for count as
	 * gone, so a round with nothing new to ask ends it (their forgets are on the way). */
	for (int round = 0; round < 8 && (count = kc_inode_count(t)) > t->max; round++) {
		size_t got = 0, need = 0, sent = 0;
		struct kc_inode **v = kc_inode_to_forget(t, low, &got, &need);
		/* Oldest first, until enough were sent: one that cannot be (unlinked, a path
		 * too long) stays a candidate and is passed over. */
		for (size_t i = 0; v && i < got; i++) {
			if (sent < need && !fuse_session_exited(n->se) && inval_by_path(n, v[i]) == 0) {
				kc_inode_asked(v[i]);
				sent++;
			}
			kc_inode_forget(t, v[i], 1);
		}
		free(v);
		if (!sent)
			break;
		__atomic_add_fetch(&n->reliefs, 1, __ATOMIC_RELAXED);
		kc_log(KC_LOG_DEBUG, "%llu inodes known to the kernel, over max_inodes %llu: "
		       "invalidated %zu of the least recently used", (unsigned long long)count,
		       (unsigned long long)t->max, sent);
	}
}

static void relieve(void *arg)
{
	struct kc_notifier *n = arg;
	const struct timespec pause = {0, 1000000}; /* 1 ms: the forgets of what was asked */
	/* A pass while a new inode took the table over the bound since the last one began,
	 * each after the invalidations queued meanwhile: no such trigger is dropped, so the
	 * table comes back under the bound without waiting for the next lookup. */
	if (__atomic_exchange_n(&n->relief_wanted, 0, __ATOMIC_SEQ_CST) &&
	    !fuse_session_exited(n->se)) {
		relieve_pass(n);
		nanosleep(&pause, NULL);
		if (kc_pool_submit(n->pool, relieve, n) == 0)
			return; /* still queued */
	}
	__atomic_store_n(&n->relief_queued, 0, __ATOMIC_SEQ_CST);
	int idle = 0; /* a trigger that came after the exchange and saw this still queued */
	if (__atomic_load_n(&n->relief_wanted, __ATOMIC_SEQ_CST) &&
	    __atomic_compare_exchange_n(&n->relief_queued, &idle, 1, 0, __ATOMIC_SEQ_CST,
					__ATOMIC_SEQ_CST) &&
	    kc_pool_submit(n->pool, relieve, n) != 0)
		__atomic_store_n(&n->relief_queued, 0, __ATOMIC_SEQ_CST);
}

void kc_notifier_relieve(struct kc_notifier *n)
{
	struct kc_inode_table *t = n->inodes;
	if (!t->max || kc_inode_count(t) <= t->max || !n->pool)
		return;
	__atomic_store_n(&n->relief_wanted, 1, __ATOMIC_SEQ_CST);
	int idle = 0;
	if (!__atomic_compare_exchange_n(&n->relief_queued, &idle, 1, 0, __ATOMIC_SEQ_CST,
					 __ATOMIC_SEQ_CST))
		return; /* the relief running sees relief_wanted */
	if (kc_pool_submit(n->pool, relieve, n) != 0)
		__atomic_store_n(&n->relief_queued, 0, __ATOMIC_SEQ_CST);
}

void kc_notifier_note_connection(struct kc_notifier *n, const char *mountpoint)
{
	char line[8192], mnt[4096];
	unsigned major, minor;
	FILE *f = fopen("/proc/self/mountinfo", "re");
	/* "<id> <parent> <major>:<minor> <root> <mountpoint> ..."; the last match is ours. */
	while (f && fgets(line, sizeof(line), f))
		if (sscanf(line, "%*u %*u %u:%u %*s %4095s", &major, &minor, mnt) == 3 &&
		    strcmp(mnt, mountpoint) == 0)
			n->conn = ((unsigned long)major << 20) | minor; /* the kernel's dev_t */
	if (f)
		fclose(f);
}

/* Abort the connection (the kernel fails every request still waiting). Returns 0 or -1. */
static int abort_connection(unsigned long conn)
{
	static const char dir[] = "/sys/fs/fuse/connections";
	char path[128];
	snprintf(path, sizeof(path), "%s/%lu/abort", dir, conn);
	int mounted = access(path, W_OK) != 0 && mount("fusectl", dir, "fusectl", 0, NULL) == 0;
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	int ok = fd >= 0 && write(fd, "1", 1) == 1;
	if (fd >= 0)
		close(fd);
	if (mounted)
		umount2(dir, MNT_DETACH); /* leave the node as it was */
	return ok ? 0 : -1;
}

void kc_notifier_stop(struct kc_notifier *n)
{
	if (!n->pool)
		return;
	for (int i = 0; i < 100 && __atomic_load_n(&n->sending, __ATOMIC_SEQ_CST); i++)
		usleep(10000);
	if (__atomic_load_n(&n->sending, __ATOMIC_SEQ_CST)) {
		int r = n->conn ? abort_connection(n->conn) : -1;
		kc_log(r == 0 ? KC_LOG_WARN : KC_LOG_ERR, "an invalidation is blocked by a request "
		       "left unanswered at the stop: %s", r == 0 ? "connection aborted"
		       : "cannot abort the connection (mount fusectl on /sys/fs/fuse/connections)");
	}
	kc_pool_destroy(n->pool);
	n->pool = NULL;
}
