/* identity.c - see identity.h */
#define _GNU_SOURCE
#include "identity.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hash.h"
#include "log.h"
#include "nvcc.h"

enum { NVCC, NVRTC, LIBNVRTC };

static void stamp_fill(struct kc_file_stamp *s, const struct stat *st)
{
	s->dev = st->st_dev;
	s->ino = st->st_ino;
	s->size = st->st_size;
	s->mtim = st->st_mtim;
	s->ctim = st->st_ctim;
}

/* Stamp of the binary at path: one stat (taken per miss; a realpath would cost a readlink
 * per component). Returns 0 or -errno. */
static int stamp_of(const char *path, struct kc_file_stamp *s)
{
	struct stat st;
	if (stat(path, &st) != 0)
		return -errno;
	stamp_fill(s, &st);
	return 0;
}

static int stamp_same(const struct kc_file_stamp *a, const struct kc_file_stamp *b)
{
	return a->dev == b->dev && a->ino == b->ino &&
	       a->size == b->size && a->mtim.tv_sec == b->mtim.tv_sec &&
	       a->mtim.tv_nsec == b->mtim.tv_nsec && a->ctim.tv_sec == b->ctim.tv_sec &&
	       a->ctim.tv_nsec == b->ctim.tv_nsec;
}

/* SHA-256 of the binary at path, and its stamp (of the inode digested). Returns 0 or
 * -errno. */
static int digest(const char *path, struct kc_file_stamp *s, char hex[KC_SHA256_HEXLEN + 1])
{
	char real[PATH_MAX];
	struct stat st;
	if (!realpath(path, real))
		return -errno;
	int fd = open(real, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
	if (fd < 0)
		return -errno;
	int err = fstat(fd, &st) != 0 ? -errno : !S_ISREG(st.st_mode) ? -EACCES : 0;
	if (!err)
		err = kc_sha256_fd(fd, hex, NULL);
	close(fd);
	if (!err)
		stamp_fill(s, &st);
	return err;
}

/* The state one take of the identity yields; copied into kc_compiler under its lock. */
struct take {
	struct kc_file_stamp stamp[3];
	int stamped[3];
	char lib[PATH_MAX];
	char id[KC_COMPILER_ID_MAX];
	int nvcc_ran, nvrtc_ran;
};

/* "<version> sha256:<hex>" of nvcc into out. */
static void take_nvcc(const char *nvcc, struct take *t, char *out, size_t len)
{
	char version[200], hex[KC_SHA256_HEXLEN + 1];
	int err = digest(nvcc, &t->stamp[NVCC], hex);
	t->stamped[NVCC] = err == 0;
	if (err) {
		kc_log(KC_LOG_WARN, "compiler %s cannot be read: %s", nvcc, strerror(-err));
		snprintf(out, len, "nvcc unavailable");
		return;
	}
	err = kc_nvcc_version(nvcc, version, sizeof(version));
	t->nvcc_ran = err == 0;
	if (err == -EIO)
		kc_log(KC_LOG_WARN, "compiler %s --version failed", nvcc);
	else if (err)
		kc_log(KC_LOG_WARN, "compiler %s cannot run: %s", nvcc, strerror(-err));
	snprintf(out, len, "%.120s sha256:%s", err ? "unavailable" : version, hex);
}

/* "; <version lines> sha256:<hex of libnvrtc>" of kcachefs-nvrtc into out. */
static void take_nvrtc(const char *nvrtc, struct take *t, char *out, size_t len)
{
	char text[1024], version[240] = "", hex[KC_SHA256_HEXLEN + 1];
	int err = stamp_of(nvrtc, &t->stamp[NVRTC]);
	t->stamped[NVRTC] = err == 0;
	if (!err)
		err = kc_nvcc_output(nvrtc, "--version", text, sizeof(text));
	if (err) {
		snprintf(out, len, "; NVRTC unavailable");
		return;
	}
	/* Its lines but the library's path, which names the file digested instead. */
	size_t used = 0;
	for (char *save, *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		if (strncmp(line, "libnvrtc ", 9) == 0) {
			snprintf(t->lib, sizeof(t->lib), "%s", line + 9);
			continue;
		}
		if (used < sizeof(version) - 1)
			used += (size_t)snprintf(version + used, sizeof(version) - used, "%s%s",
						 used ? " " : "", line);
	}
	if (!t->lib[0]) { /* an older kcachefs-nvrtc: its version alone */
		t->nvrtc_ran = 1;
		snprintf(out, len, "; %.200s", version);
		return;
	}
	err = digest(t->lib, &t->stamp[LIBNVRTC], hex);
	t->stamped[LIBNVRTC] = err == 0;
	t->nvrtc_ran = err == 0;
	if (err)
		snprintf(out, len, "; NVRTC unavailable (%.200s: %s)", t->lib, strerror(-err));
	else
		snprintf(out, len, "; %.200s sha256:%s", version, hex);
}

/* Take the whole identity; retried while a binary changes under it. */
static void take(const struct kc_compiler *k, struct take *t)
{
	for (int tries = 0;; tries++) {
		memset(t, 0, sizeof(*t));
		take_nvcc(k->nvcc, t, t->id, sizeof(t->id));
		if (k->nvrtc) {
			size_t n = strlen(t->id);
			take_nvrtc(k->nvrtc, t, t->id + n, sizeof(t->id) - n);
		}
		/* --version ran by path: the binaries digested must still be there */
		int moved = 0;
		for (int i = 0; i < 3; i++) {
			struct kc_file_stamp now;
			const char *path = i == NVCC ? k->nvcc : i == NVRTC ? k->nvrtc : t->lib;
			if (t->stamped[i] && (stamp_of(path, &now) != 0 || !stamp_same(&now, &t->stamp[i])))
				moved = 1;
		}
		if (!moved || tries == 3)
			return;
	}
}

int kc_compiler_init(struct kc_compiler *k, const char *nvcc, const char *nvrtc)
{
	struct take t;
	memset(k, 0, sizeof(*k));
	k->nvcc = strdup(nvcc);
	k->nvrtc = nvrtc ? strdup(nvrtc) : NULL;
	if (!k->nvcc || (nvrtc && !k->nvrtc)) {
		free(k->nvcc);
		free(k->nvrtc);
		return -ENOMEM;
	}
	pthread_mutex_init(&k->lock, NULL);
	pthread_mutex_init(&k->refresh_lock, NULL);
	take(k, &t);
	memcpy(k->stamp, t.stamp, sizeof(k->stamp));
	memcpy(k->stamped, t.stamped, sizeof(k->stamped));
	memcpy(k->lib, t.lib, sizeof(k->lib));
	memcpy(k->id, t.id, sizeof(k->id));
	k->nvcc_ran = t.nvcc_ran;
	k->nvrtc_ran = t.nvrtc_ran;
	return 0;
}

/* Whether each binary is what was stamped. Returns 1 (all are), 0 (one changed or came),
 * or -errno of one that was there and cannot be stat'ed now. */
static int unchanged(struct kc_compiler *k)
{
	struct kc_file_stamp now;
	char lib[PATH_MAX];
	int stamped[3];
	pthread_mutex_lock(&k->lock);
	memcpy(stamped, k->stamped, sizeof(stamped));
	memcpy(lib, k->lib, sizeof(lib));
	pthread_mutex_unlock(&k->lock);
	int ret = 1;
	for (int i = 0; i < 3 && ret == 1; i++) {
		const char *path = i == NVCC ? k->nvcc : i == NVRTC ? k->nvrtc : lib;
		if (!path || !path[0])
			continue;
		int err = stamp_of(path, &now);
		if (err) {
			if (stamped[i])
				ret = err;
			continue; /* still not there */
		}
		pthread_mutex_lock(&k->lock);
		if (!k->stamped[i] || !stamp_same(&now, &k->stamp[i]))
			ret = 0;
		pthread_mutex_unlock(&k->lock);
	}
	return ret;
}

int kc_compiler_refresh(struct kc_compiler *k)
{
	struct take t;
	int same = unchanged(k);
	if (same != 0)
		return same == 1 ? 0 : same;
	pthread_mutex_lock(&k->refresh_lock);
	same = unchanged(k); /* another compile took it meanwhile */
	if (same != 0) {
		pthread_mutex_unlock(&k->refresh_lock);
		return same == 1 ? 0 : same;
	}
	take(k, &t);
	pthread_mutex_lock(&k->lock);
	int changed = strcmp(k->id, t.id) != 0;
	memcpy(k->stamp, t.stamp, sizeof(k->stamp));
	memcpy(k->stamped, t.stamped, sizeof(k->stamped));
	memcpy(k->lib, t.lib, sizeof(k->lib));
	k->nvcc_ran = t.nvcc_ran;
	k->nvrtc_ran = t.nvrtc_ran;
	if (changed) {
		kc_log(KC_LOG_INFO, "compiler changed on disk: now %s (was %s)", t.id, k->id);
		memcpy(k->id, t.id, sizeof(k->id));
		k->generation++;
	}
	pthread_mutex_unlock(&k->lock);
	pthread_mutex_unlock(&k->refresh_lock);
	return changed;
}

unsigned long kc_compiler_id(struct kc_compiler *k, char *out)
{
	pthread_mutex_lock(&k->lock);
	memcpy(out, k->id, KC_COMPILER_ID_MAX);
	unsigned long gen = k->generation;
	pthread_mutex_unlock(&k->lock);
	return gen;
}

unsigned long kc_compiler_generation(struct kc_compiler *k)
{
	pthread_mutex_lock(&k->lock);
	unsigned long gen = k->generation;
	pthread_mutex_unlock(&k->lock);
	return gen;
}

void kc_compiler_ran(struct kc_compiler *k, int *nvcc_ran, int *nvrtc_ran)
{
	pthread_mutex_lock(&k->lock);
	*nvcc_ran = k->nvcc_ran;
	*nvrtc_ran = k->nvrtc_ran;
	pthread_mutex_unlock(&k->lock);
}

void kc_compiler_destroy(struct kc_compiler *k)
{
	free(k->nvcc);
	free(k->nvrtc);
	k->nvcc = k->nvrtc = NULL;
	pthread_mutex_destroy(&k->lock);
	pthread_mutex_destroy(&k->refresh_lock);
}
