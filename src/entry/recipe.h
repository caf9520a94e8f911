/* recipe.h - an entry's recipe: its staged source and flags, and the key that names one
 * compile of them.
 *
 * recipe hash = SHA-256 over "kcachefs-recipe-v1\n", then for each of compiler id, arch,
 * the mount's default backend ("nvcc" or "nvrtc"), mount flags, entry flags, source: the
 * decimal byte length, '\n', the bytes, '\n'.
 * Entry flags that name include roots by content (key.h) are hashed in their canonical
 * form, under "kcachefs-recipe-v2\n": the recipe, and so the cluster store's keys, do not
 * depend on where the headers are installed.
 * The compiler identity (kc_config_compiler_id, as it is when the recipe is loaded) and the
 * target architecture are part of it, so a cubin (or a rejection) recorded for another
 * compiler or GPU is never taken for this one.
 */
#ifndef KC_RECIPE_H
#define KC_RECIPE_H

#include <stddef.h>

#include "config.h"
#include "hash.h"

struct kc_recipe {
	char *source;     /* owned */
	size_t source_len;
	char *flags;      /* owned; "" when the entry has none (autocompile) */
	size_t flags_len;
	char hash[KC_SHA256_HEXLEN + 1];
	unsigned long compiler_gen; /* generation of the compiler identity in hash */
};

/* Load the recipe of the entry directory behind entry_fd (O_PATH allowed). Returns 0;
 * -ENOENT when kernel.cu is missing, or kernel.flags is missing and autocompile is off;
 * -EFBIG when a file exceeds cfg->max_source_size; other -errno from reading. */
int kc_recipe_load(int entry_fd, const struct kc_config *cfg, struct kc_recipe *r);

/* Nonzero if the entry holds a staged recipe (same rule as kc_recipe_load, without reading
 * the files). */
int kc_recipe_present(int entry_fd, const struct kc_config *cfg);

void kc_recipe_free(struct kc_recipe *r);

#endif
