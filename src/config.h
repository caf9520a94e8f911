/* config.h - the mount's settings (from -o options) and their resolution: compiler
 * discovery, compiler identity, target architecture, compile limits.
 *
 * Owns: the strings and argv inside struct kc_config (freed by kc_config_free).
 */
#ifndef KC_CONFIG_H
#define KC_CONFIG_H

#include <stddef.h>

#include "flags.h"

#define KC_DEFAULT_ARCH "sm_90a"           /* when no GPU is found and no -o arch= */
#define KC_DEFAULT_COMPILE_TIMEOUT 600     /* seconds */
#define KC_DEFAULT_MAX_SOURCE (16u << 20)  /* bytes */

struct kc_config {
	char *nvcc;            /* absolute path of the compiler; NULL before resolution */
	char *arch;            /* e.g. "sm_90a"; NULL: detect */
	char *flags;           /* -o flags= as given (blank separated); may be NULL */
	struct kc_argv mount_flags; /* flags, split and allow-list checked */
	unsigned jobs;         /* concurrent compiles; 0: number of online CPUs */
	unsigned compile_timeout; /* seconds; 0: KC_DEFAULT_COMPILE_TIMEOUT */
	int autocompile;       /* compile entries that have kernel.cu but no kernel.flags */
	int verify_keys;       /* an entry's <hash> must be its recipe's key (key.h) */
	char *compile_user;    /* -o compile_user= as given; NULL: compiles run as the daemon */
	char *setpriv;         /* util-linux setpriv, when compiles drop to compile_uid; NULL:
				* they run as the daemon */
	unsigned compile_uid, compile_gid;
	size_t max_source_size; /* bytes of kernel.cu / kernel.flags accepted */
	char *nvrtc;           /* the kcachefs-nvrtc backend (NVRTC in its own process), found
				* next to the daemon; NULL when this build has none */
	int backend_nvrtc;     /* -o compiler=nvrtc: entries that do not choose use NVRTC */
	char compiler_id[512]; /* "<path> <last line of --version>", and "; <NVRTC version>"
				* when the NVRTC backend is there; part of every recipe */
	int arch_detected;     /* 1 if arch came from the node's GPU */
};

/* Fill in defaults and resolve: the compilers' user (compile_user; -EINVAL for an unknown
 * user, a non-root daemon asked to change it, or no setpriv), nvcc (-o nvcc=, else $CUDA_HOME/bin/nvcc, else nvcc on
 * PATH, else /usr/local/cuda/bin/nvcc), its identity (runs "nvcc --version"; a compiler
 * that cannot run leaves the id "<path> unavailable" and is reported by a warning), the
 * NVRTC backend (kcachefs-nvrtc in the daemon's own directory; -EINVAL when -o
 * compiler=nvrtc asks for it and it is not there), the
 * architecture (-o arch=, else the first GPU's compute capability through libcuda, else
 * KC_DEFAULT_ARCH) and the mount flags. Returns 0, or -EINVAL with why filled for a bad
 * arch or a refused flag, or -ENOMEM. */
int kc_config_resolve(struct kc_config *c, char *why, size_t whylen);

void kc_config_free(struct kc_config *c);

#endif
