/* recipe.c - see recipe.h */
#include "recipe.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "key.h"
#include "name.h"

static int read_small(int dir, const char *name, size_t max, char **out, size_t *len)
{
	/* O_NONBLOCK: a FIFO put in the backing directory must not stall a request thread */
	int fd = openat(dir, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
	struct stat st;
	size_t used = 0;

	if (fd < 0)
		return -errno;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		int err = S_ISREG(st.st_mode) ? -errno : -ENOENT;
		close(fd);
		return err;
	}
	if ((size_t)st.st_size > max) {
		close(fd);
		return -EFBIG;
	}
	char *buf = malloc((size_t)st.st_size + 1);
	if (!buf) {
		close(fd);
		return -ENOMEM;
	}
	for (;;) {
		ssize_t n = read(fd, buf + used, (size_t)st.st_size + 1 - used);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			int err = -errno;
			free(buf);
			close(fd);
			return err;
		}
		if (n == 0)
			break;
		used += (size_t)n;
		if (used > (size_t)st.st_size) { /* grew while read: not a staged file */
			free(buf);
			close(fd);
			return -EAGAIN;
		}
	}
	close(fd);
	buf[used] = '\0';
	*out = buf;
	*len = used;
	return 0;
}

int kc_recipe_present(int entry_fd, const struct kc_config *cfg)
{
	struct stat st;
	if (fstatat(entry_fd, KC_SOURCE_NAME, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode))
		return 0;
	if (cfg->autocompile)
		return 1;
	return fstatat(entry_fd, KC_FLAGS_NAME, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
	       S_ISREG(st.st_mode);
}

int kc_recipe_load(int entry_fd, const struct kc_config *cfg, struct kc_recipe *r)
{
	struct kc_sha256 h;
	int err;

	memset(r, 0, sizeof(*r));
	err = read_small(entry_fd, KC_SOURCE_NAME, cfg->max_source_size, &r->source,
			 &r->source_len);
	if (err)
		return err;
	err = read_small(entry_fd, KC_FLAGS_NAME, cfg->max_source_size, &r->flags, &r->flags_len);
	if (err == -ENOENT && cfg->autocompile) {
		r->flags = strdup("");
		err = r->flags ? 0 : -ENOMEM;
	}
	if (!err)
		err = kc_sha256_init(&h);
	if (err) {
		kc_recipe_free(r);
		return err;
	}
	const char *mflags = cfg->flags ? cfg->flags : "";
	char compiler[KC_COMPILER_ID_MAX];
	r->compiler_gen = kc_config_compiler_id(cfg, compiler);
	/* flags naming include roots by content are hashed in their canonical form (key.h) */
	char *canon = NULL;
	size_t canon_len = 0;
	int v2 = kc_key_canonical(r->flags, r->flags_len, cfg->flags, cfg->key_paths, &canon,
				  &canon_len);
	if (v2 < 0) {
		kc_sha256_final(&h, r->hash);
		kc_recipe_free(r);
		return v2;
	}
	kc_sha256_update(&h, v2 ? "kcachefs-recipe-v2\n" : "kcachefs-recipe-v1\n", 19);
	kc_sha256_field(&h, compiler, strlen(compiler));
	kc_sha256_field(&h, cfg->arch, strlen(cfg->arch));
	const char *backend = cfg->backend_nvrtc ? "nvrtc" : "nvcc"; /* -o compiler= */
	kc_sha256_field(&h, backend, strlen(backend));
	kc_sha256_field(&h, mflags, strlen(mflags));
	if (v2)
		kc_sha256_field(&h, canon, canon_len);
	else
		kc_sha256_field(&h, r->flags, r->flags_len);
	free(canon);
	kc_sha256_field(&h, r->source, r->source_len);
	kc_sha256_final(&h, r->hash);
	return 0;
}

void kc_recipe_free(struct kc_recipe *r)
{
	free(r->source);
	free(r->flags);
	r->source = r->flags = NULL;
}
