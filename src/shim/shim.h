/* shim.h - the logic of the kcachefs-nvcc shim: which nvcc calls it takes over, the flags
 * it stages, the entry it names, and the mount it stages into. The program around it is
 * shim/kcachefs-nvcc.c; everything here is pure or read-only so the unit tests can drive it.
 *
 * Owns: the strings and argv inside struct kc_shim_call (freed by kc_shim_call_free).
 */
#ifndef KC_SHIM_H
#define KC_SHIM_H

#include <stddef.h>
#include <sys/types.h>

#include "flags.h"
#include "hash.h"
#include "tree.h"

#define KC_SHIM_DIR "kcachefs-nvcc" /* the directory at the mount root that holds its entries */

struct kc_shim_call {
	char *input;          /* the .cu file as given; owned */
	char *output;         /* the path after -o / --output-file; owned */
	struct kc_argv flags; /* every other argument but -cubin, in order, one token per option
			       * ("-Idir", "--opt=value"), relative include dirs made absolute */
};

/* Recognise a single-source cubin compile among nvcc's arguments args[0..n) (argv without
 * argv[0]): exactly one argument that is not an option and ends in ".cu", "-cubin" (or
 * "--cubin"), and exactly one output ("-o F", "-o=F", "--output-file F",
 * "--output-file=F"). Options that nvcc takes with a separate value ("-I dir",
 * "-arch sm_90a", "-Xptxas -v") are joined into one token as kernel.flags wants them;
 * "-I"/"--include-path" directories that are relative are made absolute against cwd.
 * Returns 1 and fills call (free with kc_shim_call_free); 0 when the call is anything else
 * (--version, no -cubin, several inputs, an option missing its value), which the shim
 * hands to nvcc unchanged; -ENOMEM. */
int kc_shim_parse(int n, char *const *args, const char *cwd, struct kc_shim_call *call);
void kc_shim_call_free(struct kc_shim_call *call);

/* Blackwell's way of naming the target: one "-gencode=arch=compute_X,code=sm_X" (or
 * "--generate-code=", or "code=[sm_X]") becomes "--gpu-architecture=sm_X", which makes
 * the same cubin (sm_100a, sm_100f, sm_120a, sm_120f... as given: the key names the exact
 * target). Returns 0 (done, or no -gencode); -EINVAL with why when the call asks for more
 * than one cubin can hold (several pairs, PTX as well, -gencode with -arch/-code, another
 * virtual architecture): the shim hands it to nvcc with that reason; -ENOMEM. */
int kc_shim_targets(struct kc_shim_call *call, char *why, size_t whylen);

/* Check every flag of call against the mount's allow-list (kc_flag_check), and refuse
 * arguments with leading or trailing blanks, which one-per-line kernel.flags cannot keep.
 * Returns 0, or kc_flag_check's -EPERM (a flag that would turn the compiler against the
 * node: the shim refuses the call) or -EINVAL (merely not the mount's: the shim hands the
 * call to nvcc), with a one-line reason in why. */
int kc_shim_check(const struct kc_shim_call *call, char *why, size_t whylen);

/* Render the kernel.flags the shim stages: "# kcachefs-nvcc: <compiler>\n" (the mount's
 * compiler identity, no path), then "# include-root <digest> <dir>\n" for every include
 * directory (tree.h: the digest of its bytes, which replaces its path in the key, key.h),
 * then "--kcachefs-compiler=nvcc" (the shim stands for nvcc), then one argument per line
 * (the -I paths stay: the compile needs them); avoid is the mount's device and memo (may
 * be NULL) the file digests remembered (see kc_tree_digest). *out is malloc'd (the caller frees it). Returns 0, -ENOMEM, or
 * kc_tree_digest's -errno for an include directory. */
int kc_shim_flags_file(const struct kc_shim_call *call, const char *compiler, dev_t avoid,
		       struct kc_tree_memo *memo, char **out, size_t *out_len);

/* The entry the shim stages into: KC_SHIM_DIR/KC_SHIM_ENTRY_PREFIX<key>. The name does not
 * depend on the caller's file name, so one source compiles once whatever it is called. */
#define KC_SHIM_ENTRY_PREFIX "kernel.nvcc."

/* Nonzero if the source (len bytes) has an #include "name" that resolves in src_dir, the
 * directory of the caller's file: nvcc looks there first, and the mount compiles elsewhere,
 * so such a call is handed to nvcc. */
int kc_shim_local_includes(const char *src, size_t len, const char *src_dir);

/* The value of label (e.g. "compiler", "flags") of the kcachefs_info line of a
 * .kcachefs/metrics.prom text, unescaped, into out. Returns 0, or -ENOENT when the text has none. */
int kc_shim_info_label(const char *stats, size_t len, const char *label, char *out,
		       size_t outlen);

/* The compiler's output as nvcc would have printed it for the caller: every path of the
 * form ".../.kcachefs/scratch/<dir>/kernel.cu" (where the mount compiled it) becomes input.
 * Returns a malloc'd copy (length in *outlen), or NULL when out of memory. */
char *kc_shim_log_rewrite(const char *log, size_t len, const char *input, size_t *outlen);

/* The root of the kcachefs mount that holds the existing directory dir: the nearest
 * ancestor (dir itself included) on a FUSE filesystem with a regular file
 * ".kcachefs/stats". Returns a malloc'd absolute path, or NULL with errno ENOENT (none)
 * or another errno from resolving dir. */
char *kc_shim_find_mount(const char *dir);

#endif
