/* identity.h - the identity of the compilers the mount runs: what a recipe hash (recipe.h)
 * and a remembered rejection name as "the compiler".
 *
 * identity = "<last line of nvcc --version> sha256:<SHA-256 of the nvcc binary's bytes>",
 * and when the NVRTC backend is there
 *            "; <kcachefs-nvrtc --version, its lines joined> sha256:<SHA-256 of libnvrtc>".
 * No install path is in it: one binary reached through a symlink, $CUDA_HOME or PATH, or
 * installed under another prefix on another node, has one identity.
 *
 * The binaries can be replaced while mounted (an in-place toolkit upgrade). Each compile
 * calls kc_compiler_refresh before it starts and again before its result is published or
 * remembered: a cheap stat of each resolved binary (realpath, st_dev, st_ino, st_size,
 * st_mtim, st_ctim); only when one changed are --version and the digests taken again.
 *
 * Owns: its copies of the paths and the current identity. Thread-safe: compiles running at
 * once share one kc_compiler.
 */
#ifndef KC_IDENTITY_H
#define KC_IDENTITY_H

#include <limits.h>
#include <pthread.h>
#include <sys/types.h>
#include <time.h>

#define KC_COMPILER_ID_MAX 512 /* bytes of an identity, with its NUL */

/* What a binary on disk was when its identity was taken. */
/* The inode a path leads to (symbolic links followed): another binary behind the path, or
 * a link pointed elsewhere, has another stamp. */
struct kc_file_stamp {
	dev_t dev;
	ino_t ino;
	off_t size;
	struct timespec mtim, ctim;
};

struct kc_compiler {
	pthread_mutex_t lock;         /* guards everything below but the paths */
	pthread_mutex_t refresh_lock; /* one retake (--version, digests) at a time */
	char *nvcc;                   /* as configured; owned */
	char *nvrtc;                  /* kcachefs-nvrtc, or NULL; owned */
	struct kc_file_stamp stamp[3]; /* nvcc, kcachefs-nvrtc, the libnvrtc it loads */
	int stamped[3];               /* stamp[i] holds a binary that was there */
	char lib[PATH_MAX];           /* libnvrtc as kcachefs-nvrtc --version names it, or "" */
	char id[KC_COMPILER_ID_MAX];
	unsigned long generation;     /* bumped at each change of id */
	int nvcc_ran, nvrtc_ran;      /* their --version answered at the last take */
};

/* Take the identity of nvcc (and of nvrtc, the kcachefs-nvrtc program, when not NULL).
 * A binary that cannot be opened or answer --version is named "unavailable" in the id,
 * with a warning, and is looked at again by each refresh. Returns 0 or -ENOMEM. */
int kc_compiler_init(struct kc_compiler *k, const char *nvcc, const char *nvrtc);

/* Stat each binary; when one is not what it was, take the identity again. Returns 0 when
 * the identity is unchanged, 1 when it changed (generation bumped), -errno when a binary
 * that was there cannot be stat'ed now (the identity is kept; a compile will fail to run
 * it). Costs a realpath and a stat per binary when nothing changed. */
int kc_compiler_refresh(struct kc_compiler *k);

/* Copy the current identity to out (KC_COMPILER_ID_MAX bytes) and return its generation:
 * two copies with equal generations are the same identity. */
unsigned long kc_compiler_id(struct kc_compiler *k, char *out);

/* The current generation alone. */
unsigned long kc_compiler_generation(struct kc_compiler *k);

/* Whether nvcc / kcachefs-nvrtc answered --version at the last take (for the start-up
 * checks of config.c). */
void kc_compiler_ran(struct kc_compiler *k, int *nvcc_ran, int *nvrtc_ran);

void kc_compiler_destroy(struct kc_compiler *k);

#endif
