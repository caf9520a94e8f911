/* remote_manifest.h - the header manifest of a compile for the cluster store
 * (remote_object.h): which headers it read and their SHA-256, so that a node uses another
 * node's cubin only when its own copies of those headers are the same bytes.
 *
 * The list comes from the compiler itself: nvcc's dependency output (-MD -MF, make syntax;
 * compile.h's deps_only). Headers under the toolkit (kc_manifest_toolkit_root) are left out: the compiler identity in the recipe
 * covers them. Every other header (-I trees, the host's /usr/include) is listed and hashed.
 * A manifest is "<sha256-hex> <path>\n" lines sorted by path (kc_object_manifest_check).
 *
 * NVRTC-backend entries have no dependency output: they are not shared through the store
 * (remote_tier.c), as a header they include could differ between nodes unseen.
 *
 * Hashing reads files as the daemon: only regular files that everyone may read (mode o+r;
 * what an unprivileged compile could have read), outside /proc, /sys and /dev, of at most
 * KC_MANIFEST_MAX_HEADER bytes each and KC_MANIFEST_MAX_TOTAL in all are hashed, so that an index object from the store cannot make the daemon fingerprint a
 * private file.
 *
 * Hashes are memoized per process (a bounded table of 4096 paths, 4 ways a set, a full
 * set's least recently used path replaced): a header whose path, device, inode, size,
 * mtime and ctime are those it had when hashed is not read again; any change to it
 * changes its ctime, so it is hashed anew. A file whose ctime was
 * not yet behind the clock when it was hashed is not memoized (a second write in the same
 * clock tick could leave every stat field as it was). Jobs that need the same header at
 * once wait for the one that reads it (striped locks), so it is read once.
 */
#ifndef KC_REMOTE_MANIFEST_H
#define KC_REMOTE_MANIFEST_H

#include <stddef.h>
#include <stdint.h>

#include "hash.h"

#define KC_MANIFEST_MAX_HEADER (64u << 20) /* bytes of one header hashed, at most */
#define KC_MANIFEST_MAX_HEADERS 20000      /* headers of one compile, at most */
#define KC_MANIFEST_MAX_TOTAL (512u << 20) /* bytes of all headers of one manifest hashed */

/* Build the manifest of a compile from its dependency file (deps/len, make syntax: the
 * first target's prerequisites; "\ " escapes a blank, "$$" a '$', backslash-newline joins
 * lines). The source itself and paths under skip_dir (the compile's scratch as it saw it)
 * are left out, and so are paths under toolkit_root, and paths under an include root that
 * the recipe's kernel.flags (flags/flags_len, may be NULL) names by content (tree.h): the
 * bytes of that whole tree are in the recipe's key already. Returns 0 with *manifest (malloc'd,
 * owned by the caller; "" when no header is listed) / *mlen; -EINVAL with why filled when
 * the file cannot be parsed or lists a relative path; -EACCES / -ENOENT / -EFBIG with why
 * filled when a header cannot be hashed (no longer there, not readable by all, too big): a
 * compile whose headers cannot be shown is not shared; -ENOMEM. */
int kc_manifest_from_deps(const char *deps, size_t len, const char *skip_dir,
			  const char *toolkit_root, const char *flags, size_t flags_len,
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

/* This node's manifest for the headers another node's manifest (index, a checked
 * manifest) lists: the same paths, hashed here. Returns 0 with *manifest / *mlen (as
 * above); -ENOENT / -EACCES / -EFBIG with why filled when a header cannot be hashed here
 * (a miss: compile locally); -ENOMEM. */
int kc_manifest_rehash(const char *index, size_t len, char **manifest, size_t *mlen,
		       char *why, size_t whylen);

#define KC_MANIFEST_SPREAD_THREADS 7     /* helper threads of kc_manifest_rehash_spread */
#define KC_MANIFEST_SPREAD_PER_THREAD 16 /* listed headers a helper thread is worth */

/* kc_manifest_rehash, the same result and errors, with the headers stat'ed, and read and
 * hashed where the memo above lacks them, on helper threads (one per 16 headers, at most 7
 * and the CPUs this process may run on less one) beside this one: for a list's first
 * rehash on a node, the memo empty, where a joining node's first fetch hashed 133 host
 * headers one after the other while every other fetch waited (doc/performance.md). With
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

/* The toolkit root of the nvcc at nvcc_path into root: the realpath of its directory's
 * parent when that is laid out as a CUDA toolkit (include/cuda.h or targets/), else (a
 * wrapper script elsewhere) that of fallback (the toolkit kcachefs was built against) if
 * it is one. Returns 0 or -ENOENT (none: every header is then hashed). */
int kc_manifest_toolkit_root(const char *nvcc_path, const char *fallback, char *root,
			     size_t rootlen);

#endif
