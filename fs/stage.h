/* stage.h - open file handles of the FUSE filesystem, and the stage: the private temporary that
 * a staged file (kernel.cu, kernel.flags, kernel.cubin in an entry) is written to until
 * the writer's close commits it into the entry through kc_cache_stage.
 *
 * Owns: each kc_fh owns its fds, its stage temporary and its stats text.
 */
#ifndef KC_STAGE_H
#define KC_STAGE_H

#include "fs.h"

enum fh_kind { FH_PLAIN, FH_STAGE, FH_STATS };

struct kc_fh {
	enum fh_kind kind;
	uint64_t id;         /* its fi->fh, in fs->handles */
	int fd;              /* reads and writes go here */
	struct kc_inode *in; /* the inode opened, counted in its opens until release (NULL:
			      * none, e.g. a stats handle) */
	/* FH_STAGE: */
	enum kc_role role;
	int entry_fd;        /* the entry directory (owned) */
	char tmpname[64];    /* the stage temporary in the store's tmp/; "" once committed */
	int dirty;           /* written (or truncated) since the last commit */
	int done;            /* committed or refused: nothing left to commit */
	int failed;          /* errno of a write or truncation of the stage that failed or fell
			      * short (0: none): the stage is discarded at the next close, never
			      * committed, and every later write through fh fails with it */
	pid_t writer_tid;    /* the last thread that wrote, and its process */
	pid_t writer_tgid;
	pid_t creator_tgid;  /* the process that created it (0: opened, not created) */
	int pinned;          /* the entry (pin_dev, pin_ino) is kept from eviction until freed */
	dev_t pin_dev;
	ino_t pin_ino;
	/* FH_STATS: */
	char *buf;
	size_t len;
	struct kc_fh *prev, *next; /* every live handle, for kc_fh_free_all */
};

/* A new handle of kind for fd (owned), with an id in fs->handles (fh->id, what fi->fh
 * gets). Returns NULL on ENOMEM. */
struct kc_fh *kc_fh_new(struct kc_fs *fs, enum fh_kind kind, int fd);
/* kc_fh_new under exactly id (a handle carried over by a live upgrade). Returns NULL when
 * the id is taken or on ENOMEM; fd is then not taken. */
struct kc_fh *kc_fh_adopt(struct kc_fs *fs, uint64_t id, enum fh_kind kind, int fd);
/* The handle behind a kernel file handle id, or NULL. */
struct kc_fh *kc_fh_get(struct kc_fs *fs, uint64_t id);
/* Call fn(fh, arg) for every live handle, under the list's lock; stops at the first
 * nonzero return and returns it. */
int kc_fh_foreach(int (*fn)(struct kc_fh *fh, void *arg), void *arg);
/* Close its fds, remove an uncommitted stage temporary, free it. */
void kc_fh_free(struct kc_fs *fs, struct kc_fh *fh);
/* kc_fh_free, and then, for a handle counted in its inode's opens, drop that count: the
 * last handle of a file with no name left lets go of it (kc_inode_unlinked). */
void kc_fh_release(struct kc_fs *fs, struct kc_fh *fh);
/* Free the handles the kernel never released (files still open when the session ended).
 * Only after the session loop and every thread that uses handles have stopped. */
void kc_fh_free_all(struct kc_fs *fs);

/* Give fh a fresh stage temporary with mode, seeded with the bytes of the file behind
 * seed_fd (any fd, write-only too) if seed_fd >= 0. Returns 0 or -errno. */
int kc_stage_begin(struct kc_fs *fs, struct kc_fh *fh, int seed_fd, mode_t mode);
/* Drop fh's uncommitted stage (its temporary goes; the entry is as it was), logging why.
 * Nothing through fh commits until a later write starts a new version. */
void kc_stage_discard(struct kc_fs *fs, struct kc_fh *fh, const char *why);
/* Commit fh's stage into its entry (once). Returns 0 or -errno: EEXIST (other bytes are
 * staged), EINVAL (refused flags or cubin), EFBIG, or an I/O error. */
int kc_stage_commit(struct kc_fs *fs, struct kc_fh *fh);
/* Call before bytes change through fh (write, ftruncate) on inode in: a committed stage
 * starts a new version from the committed bytes. Returns 0 or -errno: -EBADF for a plain
 * descriptor on a file that has since become a staged file or was consumed by a stage (the
 * caller has the kernel drop what the write left in its cache), or fh's failed errno for
 * a stage a write to it failed. */
int kc_stage_prepare_write(struct kc_fs *fs, struct kc_inode *in, struct kc_fh *fh);
/* The process (thread group) of the requesting thread. */
pid_t kc_stage_tgid(fuse_req_t req);
/* Record that the requesting thread's process wrote through fh. */
void kc_stage_note_writer(fuse_req_t req, struct kc_fh *fh);
/* Nonzero if the requesting thread's process is exiting because a signal killed it (its
 * files are being closed by the kernel): what it was writing is not complete. */
int kc_stage_writer_killed(fuse_req_t req);
/* Nonzero if the requesting thread's process holds another descriptor of fh's stage (a
 * dup: a shell's "> kernel.flags" closes the created descriptor after dup2 and before it
 * writes through fd 1). Read from /proc/<pid>/fdinfo; 0 where that cannot be read. */
int kc_stage_held_elsewhere(fuse_req_t req, const struct kc_fh *fh);
/* Nonzero if the process that created fh's stage is not the requesting thread's and still
 * holds a descriptor of it: the requesting process wrote through a copy it inherited (the
 * commands of "{ cat a; cat b; } > kernel.cu", a child given the parent's file as its
 * stdout), and a sibling may write next, so its close does not commit. */
int kc_stage_held_by_creator(fuse_req_t req, const struct kc_fh *fh);
/* Nonzero if the process of the requesting thread is fh's writer (its close commits). */
int kc_stage_is_writer(fuse_req_t req, const struct kc_fh *fh);
/* Follow up a kc_cache_stage result r in the entry entry_ino: invalidate the kernel's
 * kernel.cubin when the recipe changed, and name (a rename target, or NULL) whenever the
 * stage consumed the renamed file. Returns 0 or r's error. */
int kc_stage_result(struct kc_fs *fs, int r, fuse_ino_t entry_ino, const char *name);

#endif
