/* config.h - the mount's settings (from -o options) and their resolution: compiler
 * discovery, compiler identity, target architecture, compile limits.
 *
 * Owns: the strings and argv inside struct kc_config (freed by kc_config_free).
 */
#ifndef KC_CONFIG_H
#define KC_CONFIG_H

#include <stddef.h>

#include "compile.h"
#include "identity.h"
#include "flags.h"

#define KC_DEFAULT_ARCH "sm_90a"           /* when no GPU is found and no -o arch= */
#define KC_DEFAULT_COMPILE_TIMEOUT 600     /* seconds */
/* Seconds a stop waits for the cluster store's shares in hand (-o stop_timeout): within
 * the unit's TimeoutStopSec=60 (scripts/kcachefs.service) and Kubernetes' default grace
 * period of 30 s, with room for the rest of the stop. */
#define KC_DEFAULT_STOP_TIMEOUT 25
#define KC_DEFAULT_AHEAD 256               /* recipes compiled ahead per trigger */
#define KC_DEFAULT_MAX_SOURCE (16u << 20)  /* bytes */
/* First uid of the compiles of a daemon run as root: 0x7FFF0000, 256 uids just below 2^31,
 * above what useradd (1000-60000), systemd (DynamicUser= 61184-65519, containers
 * 524288-1879048191, the foreign range 2147352576-2147418111) and subuid ranges hand out. */
#define KC_DEFAULT_COMPILE_UIDS 2147418112u
#define KC_DEFAULT_COMPILE_RANGES 64u /* daemons on a node: the default range is the first of
				       * 0x7FFF0000 + k * 256, k < 64, no other daemon holds */

struct kc_config {
	char *nvcc;            /* absolute path of the compiler; NULL before resolution */
	char *arch;            /* e.g. "sm_90a"; NULL: detect */
	char *flags;           /* -o flags= as given (blank separated); may be NULL */
	struct kc_argv mount_flags; /* flags, split and allow-list checked */
	unsigned jobs;         /* concurrent compiles; 0: number of online CPUs */
	unsigned ahead;        /* -o ahead=N: recipes compiled ahead per trigger (ahead.c); 0:
				* none, no history kept */
	unsigned compile_timeout; /* seconds; 0: KC_DEFAULT_COMPILE_TIMEOUT */
	unsigned stop_timeout; /* seconds a stop waits for the shares in hand (kc_cache_stop) */
	unsigned request_timeout; /* the kernel's FUSE request timeout of the mount (seconds,
				   * reqtimeout.h; 0: none), set by kcachefs.c */
	unsigned compile_timeout_asked; /* nonzero: the compile_timeout asked for, which kcachefs.c
				   * capped to stay under request_timeout */
	int autocompile;       /* compile entries that have kernel.cu but no kernel.flags */
	int verify_keys;       /* an entry's <hash> must be its recipe's key (key.h) */
	int key_paths;         /* -o key_paths: include roots' paths stay in the recipe hash
				* (key.h), so a cubin that names them (__FILE__) is shared
				* only between nodes with the same paths */
	char *compile_uids_opt; /* -o compile_uids= as given; NULL: the default */
	unsigned compile_uids; /* first uid of the compiles' range (compile.h: uid and gid
				* compile_uids + n for the n-th running compile, n < KC_COMPILE_SLOTS); 0:
				* compiles run as the daemon */
	int ns_flags;          /* CLONE_NEW* compiles run in (sandbox.h); 0: none */
	int uids_lock_fd;      /* > 0: holds the claim on the range (kc_sandbox_claim_uids) */
	size_t max_source_size; /* bytes of kernel.cu / kernel.flags accepted */
	char *nvrtc;           /* the kcachefs-nvrtc backend (NVRTC in its own process), found
				* next to the daemon; NULL when this build has none */
	char *tracer;          /* kcachefs-trace, found next to the daemon: the cluster's
				* dependency pass runs under it (compile.h); NULL: nothing is
				* shared through the store */
	int backend_nvrtc;     /* -o compiler=nvrtc: entries that do not choose use NVRTC */
	unsigned nvrtc_idle;   /* seconds a warm NVRTC worker (nvrtc_pool.h) may stay idle;
				* 0: KC_NVRTC_IDLE_DEFAULT */
	int nvrtc_cold;        /* -o nvrtc_idle=0: no warm workers, a process per compile */
	struct kc_compiler *compiler; /* the compilers' identity (identity.h); owned. Read it
				* with kc_config_compiler_id, never keep a copy across compiles */
	int arch_detected;     /* 1 if arch came from the node's GPU */
};

/* Fill in defaults and resolve: the compilers' uids (compile_uids; -EINVAL for a value
 * that is not "daemon" or a number whose 256 uids are free of users, or a daemon not run
 * as root given one; -EACCES when the compiler runs as the daemon and not as those uids),
 * their namespaces (when root; none, with a warning, where the kernel refuses them), nvcc (-o nvcc=, else $CUDA_HOME/bin/nvcc, else nvcc on
 * PATH, else /usr/local/cuda/bin/nvcc; -ENOENT with why filled when that is not an
 * executable file, unless -o compiler=nvrtc, which only warns), its identity (identity.h:
 * runs "nvcc --version" and digests the binary; a compiler that cannot answer is
 * "unavailable" in it, with a warning), the NVRTC backend (kcachefs-nvrtc in the daemon's own directory; -EINVAL when -o
 * compiler=nvrtc asks for it and it is not there), the
 * architecture (-o arch=, else the first GPU's compute capability through libcuda, else
 * KC_DEFAULT_ARCH) and the mount flags. Returns 0, or -EINVAL with why filled for a bad
 * arch or a refused flag, or -ENOMEM. */
int kc_config_resolve(struct kc_config *c, char *why, size_t whylen);

/* The identity of the compilers the mount runs now (identity.h): part of every recipe
 * hash and of every remembered rejection, and the name of "the compiler" in any key that
 * leaves this node (a cluster store's object key). It holds no install path: the same
 * binaries give the same identity on every node. Copies it to out (KC_COMPILER_ID_MAX
 * bytes) and returns its generation (equal generations: the same identity). Before
 * kc_config_resolve: "" and 0. Thread-safe. */
unsigned long kc_config_compiler_id(const struct kc_config *c, char *out);

void kc_config_free(struct kc_config *c);

#endif
