/* flags.h - compiler arguments: the argv container, the kernel.flags reader and the
 * allow-list every argument must pass before it reaches the compiler.
 *
 * The allow-list admits what JIT clients (DeepGEMM: see doc/clients.md) pass: language and
 * optimisation switches, macros, existing include directories, diagnostics, ptxas options
 * and vetted host-compiler options, and NVRTC's own options that DeepGEMM's NVRTC compiler
 * passes (-default-device, --device-int128, --pch: nvcc refuses them with its own message).
 * It refuses anything that names an output, picks a host compiler, runs a program, reads
 * more options from a file, names a PCH file or directory (--create-pch, --use-pch,
 * --pch-dir: automatic PCH writes in the compile's TMPDIR, its scratch directory), or
 * changes what is produced.
 */
#ifndef KC_FLAGS_H
#define KC_FLAGS_H

#include <stddef.h>

/* A NULL-terminated, heap-owned argument vector. Zero-initialise before first use. */
struct kc_argv {
	char **v; /* v[n] == NULL; owned, each string owned */
	size_t n;
	size_t cap;
};

/* Append a copy of arg. Returns 0 or -ENOMEM. */
int kc_argv_push(struct kc_argv *a, const char *arg);
/* Append copies of every string of src. Returns 0 or -ENOMEM. */
int kc_argv_extend(struct kc_argv *a, const struct kc_argv *src);
void kc_argv_free(struct kc_argv *a);

/* Check one argument against the allow-list. Returns 0 if allowed; -EPERM if it would turn
 * the compiler against the node (names an output or another input, picks a host compiler,
 * runs a program, loads a plugin, reads options from a file, changes the output kind);
 * -EINVAL if it is merely not allowed (unknown, a relative include directory, a comma in
 * an -I/-D/-U value, which nvcc would split, a malformed architecture, characters outside
 * [A-Za-z0-9_-.,=/+:@%]). No file is looked at: the compiler's uid checks include directories (compile.h). Either way a one-line reason naming the
 * argument is written to why[0..whylen). */
int kc_flag_check(const char *arg, char *why, size_t whylen);

/* Read a kernel.flags buffer: one argument per line, surrounding blanks and empty lines
 * ignored, lines whose first non-blank character is '#' are comments (the kcachefs-nvcc shim
 * records the compiler identity and include-root digests there), '\r' before '\n' tolerated. Every argument is checked with kc_flag_check; the
 * first refusal makes it return -EINVAL with the reason in why (out is then freed). A NUL
 * byte or a line longer than 4096 bytes is refused too. Returns 0, -EINVAL (for every
 * refusal) or -ENOMEM. */
int kc_flags_parse(const char *buf, size_t len, struct kc_argv *out, char *why, size_t whylen);

/* Split a mount option value (arguments separated by blanks) and check each as above. */
int kc_flags_split(const char *str, struct kc_argv *out, char *why, size_t whylen);

/* The target architecture args choose (the value of the last -arch= or
 * --gpu-architecture=, pointing into args), or NULL. */
const char *kc_flags_arch(const struct kc_argv *args);

/* Nonzero if args already choose a target architecture (-arch=, --gpu-architecture=). */
int kc_flags_have_arch(const struct kc_argv *args);

/* The include directory an argument names ("-I<dir>", "--include-path=<dir>": a pointer
 * into arg), or NULL. */
const char *kc_flags_include_dir(const char *arg);

/* The compile backend an entry asks for in its kernel.flags: KC_FLAG_BACKEND followed by
 * "nvcc" or "nvrtc" (the last one wins; the allow-list takes no other value). */
#define KC_FLAG_BACKEND "--kcachefs-compiler="

/* The backend args choose ("nvcc", "nvrtc", pointing into args), or NULL. */
const char *kc_flags_backend(const struct kc_argv *args);

/* Turn nvcc arguments (as the allow-list passed them) into NVRTC options: the device-side
 * ones and NVRTC's own kept (renamed where NVRTC spells them otherwise), the host-side ones and what NVRTC
 * does anyway dropped (-O3, --compiler-options=, --expt-relaxed-constexpr...), and
 * KC_FLAG_BACKEND dropped. out is appended to. Returns 0, -EINVAL with why naming the first
 * argument NVRTC cannot take, or -ENOMEM (out is then freed). */
int kc_flags_to_nvrtc(const struct kc_argv *in, struct kc_argv *out, char *why, size_t whylen);

#endif
