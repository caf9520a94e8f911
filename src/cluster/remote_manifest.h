/* remote_manifest.h - the evidence of a compile for the cluster store (remote_object.h):
 * every path its toolchain looked up and what the lookup found, so that a node uses
 * another node's cubin only where its own compile would look up the same paths and find
 * the same things, and so make the same bytes.
 *
 * The list comes from the compiler itself: the dependency pass runs the same compile again
 * under kcachefs-trace (compile.h), which writes down every path any process of the
 * toolchain opened, stat'ed, tested for access, executed or read as a directory: nvcc,
 * nvcc.profile, the host compiler's driver and cc1plus, cicc, ptxas, libdevice, the shared
 * libraries they load, every header, and every lookup that found nothing (an include
 * searched through the -I directories in order, __has_include, #include_next, a program
 * searched through PATH). Each path is listed with its outcome: the SHA-256 of its bytes
 * (a regular file, symlinks followed as the lookup followed them), KC_MANIFEST_ABSENT (the
 * lookup found nothing: ENOENT, ENOTDIR), KC_MANIFEST_DIRECTORY (a directory), and for a
 * directory a tool read whole (listed as "+dir") the digest of its names. Left out: paths
 * under the compile's scratch, /proc, /sys and /dev, and paths under an include root that
 * the recipe names by content (tree.h: the key holds that whole tree's bytes).
 * A manifest is "<sha256-hex> <path>\n" lines sorted by path (kc_object_manifest_check).
 *
 * NVRTC-backend entries have no trace: they are not shared through the store
 * (remote_tier.c), as a header they include could differ between nodes unseen.
 *
 * Hashing reads files as the daemon: only regular files that everyone may read (mode o+r;
 * what an unprivileged compile could have read), outside /proc, /sys and /dev, of at most
 * KC_MANIFEST_MAX_HEADER bytes each and KC_MANIFEST_MAX_TOTAL in all are hashed, so that an index object from the store cannot make the daemon fingerprint a
 * private file.
 *
 * Hashes are memoized per process (a bounded table of 4096 paths, 4 ways a set, a full
 * set's least recently used path replaced): a file whose path, device, inode, size,
 * mtime and ctime are those it had when hashed is not read again. Stamps can lie: a write
 * through a shared writable mapping whose page is already dirty moves none of them. So a
 * hash is memoized only when nobody had the file open for writing while it was read (a
 * read lease, F_SETLEASE, held over the read: a writable mapping keeps its file open for
 * writing), on a local filesystem that stamps a mapping's first write to a clean page
 * (tree.h, kc_tree_memoizable), and when its ctime was behind the clock; any later writer
 * must open the file, and its first write (by write(2), or a fault on a page of a new
 * mapping) moves mtime and ctime. Jobs that need the same file at once wait for the one
 * that reads it (striped locks), so it is read once.
 */
#ifndef KC_REMOTE_MANIFEST_H
#define KC_REMOTE_MANIFEST_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "hash.h"

#define KC_MANIFEST_MAX_HEADER (256u << 20) /* bytes of one file hashed, at most (cicc: 73 MiB) */
#define KC_MANIFEST_MAX_HEADERS 20000      /* paths of one compile, at most, with repeats
					    * (made unique when full: remote_manifest.c;
					    * block_sum: 4,326 distinct in 22,141 lookups) */
#define KC_MANIFEST_MAX_TOTAL (1024u << 20) /* bytes of all files of one manifest hashed */

/* The outcome of a lookup that found nothing, and of one that found a directory, where a
 * file's SHA-256 stands (the SHA-256 of "kcachefs: a lookup that found nothing\n" and of
 * "kcachefs: a directory\n": no file's bytes are those). */
#define KC_MANIFEST_ABSENT "3e144f3ec7178ebad4c924e5d523e6f4bb43b02860e4bb9ef1ac958f6e2b0075"
#define KC_MANIFEST_DIRECTORY "12a476a2c53aa668e257ea001a336e1d142050e88dca0eb9732e07fc390e4d3d"
/* The outcome of a readlink of a path that is no symbolic link (SHA-256 of "kcachefs: not a
 * symbolic link\n"); a link's is the SHA-256 of "link:" and its target. */
#define KC_MANIFEST_NOT_LINK "1aceca70a30e06f9e6869f00ed7819b014f6eaf0eacf9e4883b00c87e4459b3b"

/* Build the manifest of a compile from its trace (trace/len, kcachefs-trace's "<kind>
 * <path>" lines, kind o, s, x or d). Paths under skip_dir, under /proc, /sys and /dev,
 * and under an include root that the recipe's kernel.flags (flags/flags_len, may be NULL)
 * names by content (tree.h) are left out; each other path is listed once with its
 * outcome, as above. Returns 0 with *manifest (malloc'd, owned by the caller; "" when no
 * path is listed) / *mlen; -EINVAL with why filled when a line cannot be parsed or names
 * a relative path; -EACCES / -EFBIG / -errno with why filled when a file cannot be hashed
 * (not readable by all, too big) or a lookup failed otherwise than finding nothing: a
 * compile whose evidence cannot be shown is not shared; -ESTALE with why filled when since
 * (the real clock before the compile began; NULL: not checked) is given and a listed file
 * or link changed at or after it (its ctime): the pass may have read bytes the compile did
 * not; -ENOMEM. */
int kc_manifest_from_trace(const char *trace, size_t len, const char *skip_dir,
			   const char *flags, size_t flags_len, const struct timespec *since,
			   char **manifest, size_t *mlen, char *why, size_t whylen);

/* The compact manifest that the cubin object carries (remote_object.h): one line
 * "<SHA-256 of the full list> @headers\n" (the SHA-256 of "" for a compile that read no
 * header outside the toolkit and its include roots); the full list (the manifest above) is
 * stored once in the store under its own key, shared by every kernel that reads the same
 * headers. An index carries up to KC_MANIFEST_PER_KEY such lines, newest first: one per
 * image whose nodes compiled the kernel. */
#define KC_MANIFEST_LIST_NAME "@headers"
#define KC_MANIFEST_COMPACT_MAX (KC_SHA256_HEXLEN + 16)
#define KC_MANIFEST_LINE_LEN (KC_SHA256_HEXLEN + 10) /* bytes of one compact line */
#define KC_MANIFEST_PER_KEY 4 /* manifests an index lists; the oldest goes first */

/* The compact manifest of the full list full/len into out / *outlen. Returns 0 or
 * -ENOMEM. */
int kc_manifest_compact(const char *full, size_t len, char out[KC_MANIFEST_COMPACT_MAX],
			size_t *outlen);

/* The list digest a one-line compact manifest names: 1 with hex filled, 0 for "",
 * -EBADMSG for anything else. */
int kc_manifest_compact_list(const char *compact, size_t len, char hex[KC_SHA256_HEXLEN + 1]);

/* This node's manifest for the paths another node's manifest (index, a checked
 * manifest) lists: the same paths, looked up here, each with its outcome here. Returns 0
 * with *manifest / *mlen (as above); -EACCES / -EFBIG / -errno with why filled when a file
 * cannot be hashed here (a miss: compile locally); -ENOMEM. */
int kc_manifest_rehash(const char *index, size_t len, char **manifest, size_t *mlen,
		       char *why, size_t whylen);

#define KC_MANIFEST_SPREAD_THREADS 7     /* helper threads of kc_manifest_rehash_spread */
#define KC_MANIFEST_SPREAD_PER_THREAD 16 /* listed headers a helper thread is worth */

/* kc_manifest_rehash, the same result and errors, with the headers stat'ed, and read and
 * hashed where the memo above lacks them, on helper threads (one per 16 headers, at most 7
 * and the CPUs this process may run on less one) beside this one: for a list's first
 * rehash on a node, the memo empty, where a joining node's first fetch hashed 133 host
 * headers one after the other while every other fetch waited. With
 * no helper to be had (a small list, one CPU) it is kc_manifest_rehash. Where several
 * headers fail, the error is the first's in the list's order, as there, and the threads
 * stop taking headers once one fails; but where the bytes in all pass
 * KC_MANIFEST_MAX_TOTAL, the error may be -EFBIG naming another header (the threads count
 * bytes in the order they take headers, one thread in the list's). Each header's size is
 * counted before it is read, its growth since its stat too, so the reads stay within that
 * many bytes but for a header that grows while it is read (as there). */
int kc_manifest_rehash_spread(const char *index, size_t len, char **manifest, size_t *mlen,
			      char *why, size_t whylen);

/* Helper threads kc_manifest_rehash_spread has started in this process (for tests). */
unsigned long kc_manifest_spread_threads(void);

/* Make the memo above ready (its pages and locks) before the first rehash needs it; a
 * first rehash makes it ready itself otherwise. Idempotent, thread-safe. */
void kc_manifest_memo_init(void);

/* Put the hash of the header path, open as fd (for reading), in the memo above, unless it
 * holds it already or the file may not be hashed (as kc_manifest_rehash would refuse it):
 * for a caller that has the header open anyway (remote_watch.c, with a read lease held on
 * fd: nobody writes it meanwhile). Returns 0, or -errno of the read (the memo is then left
 * as it was). */
int kc_manifest_memo_fill(const char *path, int fd);

#endif
