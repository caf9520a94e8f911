/* nvcc.h - finding the CUDA compiler and asking it who it is. Shared by the daemon (which
 * runs nvcc for its compiles) and the kcachefs-nvcc shim (which hands calls to it).
 *
 * Owns: nothing; returned paths are malloc'd and owned by the caller.
 */
#ifndef KC_NVCC_H
#define KC_NVCC_H

#include <stddef.h>

/* The compiler to run when none is configured: $CUDA_HOME/bin/nvcc, else nvcc on PATH,
 * else /usr/local/cuda/bin/nvcc. A candidate that is the same file (st_dev, st_ino) as
 * not_this is skipped, so a shim installed as "nvcc" does not find itself (NULL: skip
 * nothing). Candidates must be executable. Returns a malloc'd path, or NULL when out of
 * memory or when the only candidate left is not_this itself. */
char *kc_nvcc_find(const char *not_this);

/* Run "<nvcc> --version" (argv, no shell; stderr discarded) and copy the last non-empty
 * line of its output (e.g. "Build cuda_13.0.r13.0/compiler.36424714_0") to out. Returns 0;
 * -errno when it cannot be started (ENOENT, EACCES...); -EIO when it exits non-zero, is
 * killed, or prints nothing. */
int kc_nvcc_version(const char *nvcc, char *out, size_t outlen);

/* Run "<nvcc> <arg>" the same way and copy its whole output (NUL-terminated, at most
 * outlen - 1 bytes, trailing newlines removed) to out. Same returns. */
int kc_nvcc_output(const char *nvcc, const char *arg, char *out, size_t outlen);

/* Whether nvcc can compile for arch ("sm_90a", "sm_100f": the letter after the number is
 * a variant of the listed sm_XY): 1 if "<nvcc> --list-gpu-code" lists it, 0 if it lists
 * others and not this one, -errno when nvcc cannot say (not runnable, an older nvcc or a
 * wrapper without that option). */
int kc_nvcc_supports_arch(const char *nvcc, const char *arch);

#endif
