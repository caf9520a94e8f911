/* store.h - the backing store on local disk.
 *
 * Layout under BACKING_DIR: the client-visible tree itself, plus the reserved state
 * directory .kcachefs/ (never shown through the mount) holding
 *   lock      flock'ed by the one daemon serving this backing directory,
 *   tmp/      stage and publish temporaries (same filesystem as the tree: rename is atomic),
 *   scratch/  one private directory per running compile.
 * tmp/ and scratch/ are emptied at every start (crash recovery: nothing stays in progress).
 *
 * Integrity records live in extended attributes, written on the temporary before it is
 * renamed into place, so a published file and its record appear atomically:
 *   user.kcachefs.record on kernel.cubin: "v1 <sha256-hex> <size> <recipe-hex|-> <origin>"
 *   user.kcachefs.rejected on an entry directory: the recipe hash the compiler rejected.
 *   user.kcachefs.refused on an entry directory: the kernel.cu or kernel.flags refused last
 *     (kernel.log says why), while no stage succeeded since.
 *   user.kcachefs.key on a compiled kernel.cubin: the key (key.h) of the kernel.cu and
 *     kernel.flags it was compiled from; shown through the mount (getxattr), so that a
 *     client that names entries by content can check an open cubin is of its own recipe.
 */
#ifndef KC_STORE_H
#define KC_STORE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>

#include "hash.h"

#define KC_STATE_DIR ".kcachefs"

struct kc_store {
	char *root_path; /* absolute, resolved; owned */
	int root_fd;     /* O_RDONLY|O_DIRECTORY on BACKING_DIR */
	int tmp_fd;      /* .kcachefs/tmp */
	int scratch_fd;  /* .kcachefs/scratch */
	int lock_fd;     /* .kcachefs/lock, flock'ed exclusively */
};

/* Open (creating the state directory if needed) and recover the backing store at path.
 * Errors: -ENOENT/-ENOTDIR (path is not a directory), -EBUSY (another daemon holds the
 * lock), -ENOTSUP (the filesystem has no user extended attributes), -EROFS, other -errno;
 * *why gets a line for the operator. */
int kc_store_open(struct kc_store *s, const char *path, char *why, size_t whylen);
/* Empty tmp/ and scratch/ (nothing is in progress once the daemon stops), unlock, close. */
void kc_store_close(struct kc_store *s);

/* The daemon has stopped serving and holds the store only while the cluster store's shares
 * in hand end, until deadline (CLOCK_REALTIME seconds) at most: a daemon started on the
 * store meanwhile waits for the lock instead of failing with -EBUSY (kc_store_open; the
 * note is the file .kcachefs/stopping, "PID DEADLINE", removed at kc_store_close). */
void kc_store_note_stopping(struct kc_store *s, time_t deadline);
/* Seconds past a stopping daemon's deadline that kc_store_open still waits for its lock. */
#define KC_STORE_STOP_GRACE 10

/* Create a new empty temporary in tmp/ (O_RDWR, mode). name receives its name in tmp/.
 * Returns the fd (owned by the caller) or -errno. */
int kc_store_tmpfile(struct kc_store *s, mode_t mode, char name[64]);

/* Create a fresh empty scratch directory; path receives its absolute path. Returns an
 * O_RDONLY|O_DIRECTORY fd on it or -errno. Remove it with kc_store_remove_tree. */
int kc_store_scratch(struct kc_store *s, char *path, size_t pathlen);

/* Remove a directory tree by absolute path (no symlinks followed). Returns 0 or -errno. */
int kc_store_remove_tree(const char *path);

/* Publish-if-absent-or-identical: rename src_dir/src_name to dst_dir/dst_name unless the
 * destination exists. If it exists with the same bytes, src is removed and 1 is returned
 * (nothing changed); with other bytes, -EEXIST is returned and both stay as they were.
 * Returns 0 when src took the name, or another -errno. */
int kc_store_commit(int src_dir, const char *src_name, int dst_dir, const char *dst_name);

/* A new temporary in tmp/ (name as kc_store_tmpfile) holding a copy of the bytes of the
 * file behind src_fd (any fd open for reading), with mode. Returns the fd of the copy
 * (O_RDWR, owned by the caller) or -errno; on error no temporary is left. */
int kc_store_copy_tmp(struct kc_store *s, int src_fd, mode_t mode, char name[64]);

/* 1 if the files behind fds a and b hold the same bytes, 0 if not, -errno on read error. */
int kc_store_same_bytes(int a, int b);

/* Write buf to dir/name atomically (temp in tmp/ + rename over). Returns 0 or -errno. */
int kc_store_write_atomic(struct kc_store *s, int dir, const char *name, const void *buf,
			  size_t len);

/* Remove dir/name if it is still the file st describes (same device and inode): not one
 * renamed over the name since st was taken. */
void kc_store_unlink_if_same(int dir, const char *name, const struct stat *st);

/* The current path of the object behind fd (any fd, O_PATH too), relative to the root of
 * s, into out. Returns 0; -ENOENT when it is the root itself, outside the tree or unlinked;
 * -ENAMETOOLONG when the kernel cannot give it or out is too small. */
int kc_store_rel_path(const struct kc_store *s, int fd, char *out, size_t len);

/* Path "/proc/self/fd/N" for fd, for calls that need a path (xattrs on O_PATH fds). */
void kc_fd_path(int fd, char buf[32]);

/* fsync a directory given by any fd (O_PATH allowed). Returns 0 or -errno. */
int kc_store_sync_dir(int dir);

enum kc_origin { KC_ORIGIN_COMPILED, KC_ORIGIN_CLIENT };

struct kc_record {
	char sha256[KC_SHA256_HEXLEN + 1];
	uint64_t size;
	char recipe[KC_SHA256_HEXLEN + 1]; /* "" for client-published */
	enum kc_origin origin;
};

/* Attach rec to the file behind fd (any fd, O_PATH allowed). Returns 0 or -errno. */
int kc_record_write(int fd, const struct kc_record *rec);
/* Read the record of the file behind fd. Returns 0, -ENODATA (none), -EINVAL (garbled). */
int kc_record_read(int fd, struct kc_record *rec);

#define KC_KEY_XATTR "user.kcachefs.key"
/* Set the key (64 lowercase hex) of the recipe a compiled cubin (fd, any mode) was built
 * from. Returns 0 or -errno. */
int kc_key_record_write(int fd, const char key[KC_SHA256_HEXLEN + 1]);

/* Rejection marker on an entry directory (fd of the directory, O_PATH allowed). */
int kc_store_mark_rejected(int dir, const char *recipe_hex);
/* 1 if dir carries a rejection for exactly recipe_hex, else 0. */
int kc_store_is_rejected(int dir, const char *recipe_hex);
/* The same, and *marked (if not NULL) set to 0 when dir carries no rejection at all, else
 * 1 (one for any recipe, or its attribute cannot be read). */
int kc_store_rejection(int dir, const char *recipe_hex, int *marked);
void kc_store_clear_rejected(int dir);

/* Refusal marker on an entry directory: the recipe file refused there last (what, e.g.
 * "kernel.flags"), until a later stage succeeds or a recipe file is removed. */
int kc_store_mark_refused(int dir, const char *what);
/* 1 if dir carries a refusal marker, else 0. */
int kc_store_is_refused(int dir);
void kc_store_clear_refused(int dir);

#endif
