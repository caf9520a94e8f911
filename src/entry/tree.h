/* tree.h - the content digest of an include tree: what replaces an include directory's
 * path in a key (key.h), so that the same headers installed at another prefix, at another
 * time, or copied by another user give the same key, and one changed byte gives another.
 *
 * digest = lowercase hex SHA-256 over "kcachefs-tree-v1\n", then for every regular file
 * under the directory (symbolic links followed, each directory once, dangling links
 * skipped), sorted by its path relative to the directory: that path and the hex SHA-256 of
 * its bytes, each as a kc_sha256_field. No mtime, size, owner or absolute path is in it.
 *
 * Used by the nvcc shim (it names the entry) and by the daemon, which takes the digest
 * again before it compiles a recipe that names one (kc_tree_check_roots, with a memo of its
 * own in memory), so that an entry cannot claim the bytes of a tree it does not hold.
 */
#ifndef KC_TREE_H
#define KC_TREE_H

#include <stddef.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>

#include "hash.h"

#define KC_TREE_MAX_FILES 100000         /* files in one include tree, at most */
#define KC_TREE_MAX_BYTES (2ull << 30)   /* bytes of one include tree hashed, at most */

/* The line of kernel.flags that names an include root by content:
 * "# include-root <digest> <dir>" (comment lines are not compiler arguments). */
#define KC_TREE_ROOT_TAG "# include-root "

/* Whether line (ll bytes, no newline) is a well-formed KC_TREE_ROOT_TAG line: 1 with
 * pointers into it to its digest (KC_SHA256_HEXLEN bytes) and its dir (*dl bytes,
 * absolute), else 0. */
int kc_tree_root_line(const char *line, size_t ll, const char **digest, const char **dir,
		      size_t *dl);

/* The digest of what a compile takes from the regular file open as fd (st: its fstat),
 * reading it once, into hex: the SHA-256 of its bytes, with its mtime where its bytes name
 * __TIMESTAMP__ (the preprocessor expands it to the file's mtime; ccache's direct mode
 * hashes the mtime then too). An ELF file (a program) is not looked into. *size gets the
 * bytes read (may be NULL); a short read that ends at expect (st_size) ends the read.
 * Returns 0 or -errno of the read. */
int kc_tree_file_digest(int fd, const struct stat *st, char hex[KC_SHA256_HEXLEN + 1],
			uint64_t *size);

struct kc_argv;
/* The dirs of every KC_TREE_ROOT_TAG line of a kernel.flags text (flags, len bytes, may be
 * NULL), trailing slashes cut, pushed onto roots (flags.h). Returns 0 or -ENOMEM. */
int kc_tree_roots(const char *flags, size_t len, struct kc_argv *roots);

/* A memo of file digests for kc_tree_digest, so that a tree whose files did not change is
 * stat'ed, not read: the shim keeps one in a file between its calls (kc_tree_memo_load), the
 * daemon one in memory for its checks (kc_tree_memo_new). A file's digest is taken from it
 * only when its device, inode, size, mtime and ctime are those it had when it was hashed: any
 * write changes its ctime (also one that restores size and mtime, as rsync -t or touch -r
 * do), and so does a rename or chmod; a file replaced by rename is another inode. A digest is
 * remembered only when it cannot be stale under those stamps: the file's stat after the read
 * is the one before it (not changed while hashed); its ctime is at least one granule of its
 * filesystem's clock behind the coarse clock (a second write in the same granule could keep
 * every field; the granule is bounded from the stamp's trailing zeros, 2 s for a whole
 * second); nobody had it open for writing while it was read (kc_tree_lease: a writable
 * mapping made earlier writes with no stamp once its page is dirty); and the file is on a
 * local filesystem known to stamp every write (ext4, xfs, btrfs, tmpfs, overlayfs, zfs,
 * ...; never NFS or FUSE, whose stats may be cached).
 * Mtimes only gate the memo; they never enter a digest. Thread-safe (a mutex: the daemon's
 * compiles run in parallel). A memo file is trusted only when it is a regular file owned by
 * the caller and writable by no one else. */
struct kc_tree_memo;

#define KC_TREE_MEMO_MAX 200000 /* files a memo file remembers */
#define KC_TREE_MEMO_DAEMON 32768 /* files the daemon's memo remembers (its table: 8 MiB at most) */

/* 1 if a filesystem of statfs(2) f_type type is a local one, every change of which is made
 * through this machine's kernel (so it moves the ctime, and raises its inotify events,
 * here), else 0. Network filesystems are left out (another client's write shows in a
 * cached stat only later, and raises no event here), and so is any filesystem not known
 * here. overlayfs is in: its layers may not change while it is mounted
 * (Documentation/filesystems/overlayfs.rst), so every change goes through it. */
int kc_tree_local_type(unsigned long type);

/* Take a read lease on fd (open O_RDONLY) before its bytes are read for a memo: 1 when the
 * kernel grants it, that is when nobody has the file open for writing, a writable shared
 * mapping included (fcntl(2) F_SETLEASE; the caller is root or the file's owner); else 0
 * (a writer has it, or leases are not to be had here). A writer's open while it is held
 * breaks it with SIGURG (ignored unless handled) and waits until the caller closes fd. */
int kc_tree_lease(int fd);

/* Whether a digest of the file open as fd may be remembered under the stamps before (its
 * fstat before the read), now being the coarse real clock (CLOCK_REALTIME_COARSE) taken
 * after that fstat and before the read, leased kc_tree_lease's answer before the read: 1
 * when the lease was held over the whole read (granted, not broken: nobody could write
 * the file meanwhile, through a mapping made earlier neither), the file's fstat now is
 * before, its ctime is at least one granule behind now, and it is on a known local
 * filesystem, as the memo above says; else 0. The first write through a new mapping moves
 * mtime and ctime (page_mkwrite, or the fault path's file_update_time where a filesystem
 * has none: seen on ext4 and tmpfs, Linux 6.18), but further writes through it while its
 * page stays dirty move nothing: the lease is what shows that no such mapping existed.
 * Shared by every memo of file digests (also remote_manifest.c's). */
int kc_tree_memoizable(int fd, const struct stat *before, const struct timespec *now,
		       int leased);

/* An empty memo in memory that remembers at most max_files files (past that it is emptied
 * and fills again). Returns it (free with kc_tree_memo_free) or NULL when out of memory. */
struct kc_tree_memo *kc_tree_memo_new(size_t max_files);

/* Load the memo file at path (missing, untrusted or malformed: an empty memo that will be
 * saved there). Returns the memo (free with kc_tree_memo_free) or NULL when out of memory. */
struct kc_tree_memo *kc_tree_memo_load(const char *path);

/* Write a loaded memo back when it learned something: a temporary in its directory (created
 * mode 700) and a rename, so concurrent callers each leave a whole file (the last one's).
 * Returns 0 (also for a memo in memory) or -errno (the memo is only an optimisation: callers
 * may ignore it). */
int kc_tree_memo_save(struct kc_tree_memo *m);

/* How many file digests m gave (*hits) and how many files were read through it (*misses)
 * since it was made: a test's view of what a digest read. */
void kc_tree_memo_counts(struct kc_tree_memo *m, size_t *hits, size_t *misses);

void kc_tree_memo_free(struct kc_tree_memo *m);

/* Digest of the tree under dir as above into hex, with memo (may be NULL) for the files'
 * digests. Returns 0; -EXDEV when the walk reaches a
 * file or directory on device avoid ((dev_t)-1: none) or the root of a kcachefs mount (a
 * walk there would open, and so compile, its entries); -EACCES for a directory or file
 * that cannot be read; -E2BIG past KC_TREE_MAX_FILES files or KC_TREE_MAX_BYTES bytes;
 * other -errno from the walk (ELOOP for a link to itself, ENOENT for a missing dir);
 * -ENOMEM. */
int kc_tree_digest(const char *dir, dev_t avoid, struct kc_tree_memo *memo,
		   char hex[KC_SHA256_HEXLEN + 1]);

/* Nonzero if dir is the root of a kcachefs mount: a FUSE filesystem with a regular file
 * ".kcachefs/stats". */
int kc_tree_is_mount_root(const char *dir);

/* For every KC_TREE_ROOT_TAG line of a kernel.flags text (flags, len bytes): take the
 * digest of its directory again, through memo (may be NULL: every file read), and compare. Returns 0 when all match (or there are none);
 * -ESTALE when a tree no longer holds the bytes its line names, -EINVAL for a malformed
 * line, or kc_tree_digest's error, with why saying which directory and why; -ENOMEM. */
int kc_tree_check_roots(const char *flags, size_t len, struct kc_tree_memo *memo, char *why,
			size_t whylen);

#endif
