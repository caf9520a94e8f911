/* stage.c - see stage.h: file handles and stages. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "stage.h"
#include "log.h"

/* Follow up a kc_cache_stage result r in entry entry_ino: the kernel's cached kernel.cubin
 * goes when the recipe changed, and name (the rename target, if any) whenever src was
 * consumed: the kernel moved its dentry of src there, and src is not what the name holds.
 * Returns 0 or r's error. */
int kc_stage_result(struct kc_fs *fs, int r, fuse_ino_t entry_ino, const char *name)
{
	if (r == KC_STAGE_CUBIN_REMOVED)
		kc_notifier_inval_entry(&fs->notifier, entry_ino, KC_CUBIN_NAME);
	if (r >= 0 && name)
		kc_notifier_inval_entry(&fs->notifier, entry_ino, name);
	return r < 0 ? r : 0;
}

/* The process (thread group) of thread tid, or tid itself if it is gone. */
static pid_t tgid_of(pid_t tid)
{
	char path[64], line[128];
	pid_t tgid = tid;
	snprintf(path, sizeof(path), "/proc/%d/status", (int)tid);
	FILE *f = fopen(path, "re");
	if (!f)
		return tid;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "Tgid: %d", &tgid) == 1)
			break;
	fclose(f);
	return tgid;
}

pid_t kc_stage_tgid(fuse_req_t req)
{
	return tgid_of(fuse_req_ctx(req)->pid);
}

void kc_stage_note_writer(fuse_req_t req, struct kc_fh *fh)
{
	pid_t tid = fuse_req_ctx(req)->pid;
	if (tid != fh->writer_tid) {
		fh->writer_tid = tid;
		fh->writer_tgid = tgid_of(tid);
	}
	fh->dirty = 1;
}

static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static struct kc_fh *live; /* every handle not freed yet */

void kc_fh_free(struct kc_fs *fs, struct kc_fh *fh)
{
	pthread_mutex_lock(&live_lock);
	if (fh->prev)
		fh->prev->next = fh->next;
	else
		live = fh->next;
	if (fh->next)
		fh->next->prev = fh->prev;
	pthread_mutex_unlock(&live_lock);
	kc_idtable_remove(&fs->handles, fh->id);
	if (fh->pinned)
		kc_evict_unpin(&fs->evict, fh->pin_dev, fh->pin_ino);
	if (fh->kind == FH_STAGE) {
		if (fh->tmpname[0])
			unlinkat(fs->store.tmp_fd, fh->tmpname, 0);
		if (fh->entry_fd >= 0)
			close(fh->entry_fd);
	}
	if (fh->fd >= 0)
		close(fh->fd);
	free(fh->buf);
	free(fh);
}

void kc_fh_release(struct kc_fs *fs, struct kc_fh *fh)
{
	struct kc_inode *in = fh->in;
	kc_fh_free(fs, fh);
	if (in && kc_inode_opened(&fs->inodes, in, -1) == 0)
		kc_inode_unlinked(&fs->inodes, in);
}

/* Give fh a fresh stage temporary, seeded with the bytes of the file behind seed_fd (any
 * fd, write-only too) if it is >= 0. */
int kc_stage_begin(struct kc_fs *fs, struct kc_fh *fh, int seed_fd, mode_t mode)
{
	char path[32];
	int seed = -1;
	if (seed_fd >= 0) {
		kc_fd_path(seed_fd, path);
		seed = open(path, O_RDONLY | O_CLOEXEC);
		if (seed < 0)
			return -errno;
	}
	struct stat est;
	if (!fh->pinned && fh->entry_fd >= 0 && fstat(fh->entry_fd, &est) == 0 &&
	    kc_evict_pin(&fs->evict, est.st_dev, est.st_ino) == 0) {
		fh->pinned = 1; /* a stage in progress: its entry is not evicted */
		fh->pin_dev = est.st_dev;
		fh->pin_ino = est.st_ino;
	}
	int fd = seed >= 0 ? kc_store_copy_tmp(&fs->store, seed, mode & 07777, fh->tmpname)
			   : kc_store_tmpfile(&fs->store, mode & 07777, fh->tmpname);
	if (seed >= 0)
		close(seed);
	if (fd < 0) {
		fh->tmpname[0] = '\0';
		return fd;
	}
	if (fh->fd >= 0)
		close(fh->fd);
	fh->fd = fd;
	fh->done = 0;
	return 0;
}

void kc_stage_discard(struct kc_fs *fs, struct kc_fh *fh, const char *why)
{
	kc_log(KC_LOG_INFO, "%s stage discarded: %s", kc_role_name(fh->role), why);
	if (fh->tmpname[0])
		unlinkat(fs->store.tmp_fd, fh->tmpname, 0);
	fh->tmpname[0] = '\0';
	fh->done = 1;
	fh->dirty = 0;
}

/* Commit the stage temporary into the entry. Returns 0 or -errno (EEXIST, EINVAL...). */
int kc_stage_commit(struct kc_fs *fs, struct kc_fh *fh)
{
	struct stat est;
	if (fh->done || !fh->tmpname[0])
		return 0;
	struct kc_inode *entry = fstat(fh->entry_fd, &est) == 0
					 ? kc_inode_find_held(&fs->inodes, est.st_dev, est.st_ino)
					 : NULL;
	int err = kc_cache_stage(&fs->cache, fh->role, fs->store.tmp_fd, fh->tmpname, fh->entry_fd);
	if (entry)
		err = kc_stage_result(fs, err, kc_inode_ino(&fs->inodes, entry), NULL);
	else if (err > 0)
		err = 0;
	kc_inode_let_go(&fs->inodes, entry);
	if (err)
		unlinkat(fs->store.tmp_fd, fh->tmpname, 0);
	fh->tmpname[0] = '\0';
	fh->done = 1;
	fh->dirty = 0;
	return err;
}

/* Before bytes change through fh: a committed stage starts a new version from the
 * committed bytes. A plain descriptor on a file that has since become a staged file (its
 * directory was renamed into an entry), or whose file a stage consumed (renamed onto a
 * staged name: the entry holds a copy), names no stage: EBADF. Returns 0 or -errno. */
int kc_stage_prepare_write(struct kc_fs *fs, struct kc_inode *in, struct kc_fh *fh)
{
	if (fh->kind == FH_PLAIN) {
		enum kc_role role;
		int entry_fd = kc_inode_entry_fd(&fs->inodes, in, &role);
		if (entry_fd >= 0)
			close(entry_fd);
		if (__atomic_load_n(&in->discarded, __ATOMIC_SEQ_CST) ||
		    (entry_fd >= 0 && !in->staging)) {
			kc_log(KC_LOG_INFO, "a write through a descriptor of a file that is now %s "
			       "refused (EBADF): staged files change only by staging",
			       in->discarded ? "consumed by a stage" : "staged");
			return -EBADF;
		}
		return 0;
	}
	if (fh->kind == FH_STAGE && fh->failed)
		return -fh->failed; /* a stage with a hole is never resumed */
	if (fh->kind == FH_STAGE && fh->done) {
		struct stat st;
		return fstat(fh->fd, &st) ? -errno : kc_stage_begin(fs, fh, fh->fd, st.st_mode);
	}
	return 0;
}

/* Nonzero if /proc/<tgid>/fd/<fd> names a file called name (its last component). */
static int fd_named(pid_t tgid, const char *fd, const char *name)
{
	char path[64], target[PATH_MAX];
	snprintf(path, sizeof(path), "/proc/%d/fd/%.20s", (int)tgid, fd);
	ssize_t n = readlink(path, target, sizeof(target) - 1);
	if (n <= 0)
		return 0;
	target[n] = '\0';
	const char *slash = strrchr(target, '/');
	return slash && strcmp(slash + 1, name) == 0;
}

/* Nonzero if process tgid holds a descriptor of fh's stage. Read from /proc/<tgid>/fdinfo;
 * 0 where that cannot be read. */
static int holds_stage(pid_t tgid, const struct kc_fh *fh)
{
	char path[64], line[128];
	struct stat st;
	if (tgid <= 0 || !kc_role_is_staged(fh->role) || fstat(fh->fd, &st) != 0)
		return 0;
	snprintf(path, sizeof(path), "/proc/%d/fdinfo", (int)tgid);
	DIR *d = opendir(path);
	if (!d)
		return 0;
	int held = 0;
	struct dirent *de;
	while (!held && (de = readdir(d)) != NULL) {
		if (de->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "/proc/%d/fdinfo/%.20s", (int)tgid, de->d_name);
		FILE *f = fopen(path, "re");
		unsigned long long ino = 0;
		int have_ino = 0; /* "ino:" since Linux 5.14; before, the name alone decides */
		while (f && !have_ino && fgets(line, sizeof(line), f))
			have_ino = sscanf(line, "ino: %llu", &ino) == 1;
		if (f)
			fclose(f);
		/* The kernel's inode number of a stage is its temporary's. */
		held = f && (!have_ino || ino == (unsigned long long)st.st_ino) &&
		       fd_named(tgid, de->d_name, kc_role_name(fh->role));
	}
	closedir(d);
	return held;
}

int kc_stage_held_elsewhere(fuse_req_t req, const struct kc_fh *fh)
{
	return holds_stage(kc_stage_tgid(req), fh);
}

int kc_stage_held_by_creator(fuse_req_t req, const struct kc_fh *fh)
{
	return fh->creator_tgid != kc_stage_tgid(req) && holds_stage(fh->creator_tgid, fh);
}

/* A new handle under id (0: a new id). */
static struct kc_fh *fh_make(struct kc_fs *fs, uint64_t id, enum fh_kind kind, int fd)
{
	struct kc_fh *fh = calloc(1, sizeof(*fh));
	if (fh && !id && !(fh->id = kc_idtable_add(&fs->handles, fh, KC_HANDLE_FILE))) {
		free(fh);
		fh = NULL;
	} else if (fh && id && kc_idtable_put(&fs->handles, id, fh, KC_HANDLE_FILE) != 0) {
		free(fh);
		fh = NULL;
	} else if (fh && id) {
		fh->id = id;
	}
	if (fh) {
		fh->kind = kind;
		fh->fd = fd;
		fh->entry_fd = -1;
		pthread_mutex_lock(&live_lock);
		fh->next = live;
		if (live)
			live->prev = fh;
		live = fh;
		pthread_mutex_unlock(&live_lock);
	}
	return fh;
}

struct kc_fh *kc_fh_new(struct kc_fs *fs, enum fh_kind kind, int fd)
{
	return fh_make(fs, 0, kind, fd);
}

struct kc_fh *kc_fh_adopt(struct kc_fs *fs, uint64_t id, enum fh_kind kind, int fd)
{
	return id ? fh_make(fs, id, kind, fd) : NULL;
}

void kc_fh_free_all(struct kc_fs *fs)
{
	while (live)
		kc_fh_free(fs, live);
}


int kc_stage_writer_killed(fuse_req_t req)
{
	char path[64], buf[2048];
	pid_t tid = fuse_req_ctx(req)->pid;
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)tid);
	FILE *f = fopen(path, "re");
	if (!f)
		return 0;
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = '\0';
	char *p = strrchr(buf, ')'); /* the command name may hold anything: skip past it */
	if (!p)
		return 0;
	/* Fields 3.. follow: field 9 is the task's flags, field 52 its exit code (proc(5)). */
	unsigned long flags = 0;
	long exit_code = 0;
	int field = 2;
	for (char *save = NULL, *t = strtok_r(p + 1, " ", &save); t; t = strtok_r(NULL, " ", &save)) {
		field++;
		if (field == 9)
			flags = strtoul(t, NULL, 10);
		else if (field == 52)
			exit_code = strtol(t, NULL, 10);
	}
	return (flags & 0x4 /* PF_EXITING */) && (exit_code & 0x7f) != 0;
}

int kc_stage_is_writer(fuse_req_t req, const struct kc_fh *fh)
{
	return tgid_of(fuse_req_ctx(req)->pid) == fh->writer_tgid;
}

struct kc_fh *kc_fh_get(struct kc_fs *fs, uint64_t id)
{
	return kc_idtable_get(&fs->handles, id, KC_HANDLE_FILE);
}

int kc_fh_foreach(int (*fn)(struct kc_fh *fh, void *arg), void *arg)
{
	int r = 0;
	pthread_mutex_lock(&live_lock);
	for (struct kc_fh *fh = live; fh && !r; fh = fh->next)
		r = fn(fh, arg);
	pthread_mutex_unlock(&live_lock);
	return r;
}
