/* entry.c - an entry directory as the cache's files name and log it: its name, its label
 * in log lines, its kernel.log (cache_i.h). */
#define _GNU_SOURCE
#include "cache_i.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io.h"
#include "log.h"

/* The name of the entry directory behind entry_fd, whole (a label is cut for logs).
 * Returns 0, or -ENAMETOOLONG when the kernel cannot give its path. */
int kc_cache_entry_name(struct kc_cache *c, int entry_fd, char name[256])
{
	char rel[PATH_MAX];
	if (kc_store_rel_path(c->store, entry_fd, rel, sizeof(rel)) != 0)
		return -ENAMETOOLONG;
	const char *slash = strrchr(rel, '/');
	const char *base = slash ? slash + 1 : rel;
	if (strlen(base) > 255)
		return -ENAMETOOLONG;
	memcpy(name, base, strlen(base) + 1);
	return 0;
}

void kc_cache_entry_label(struct kc_cache *c, int entry_fd, char *buf, size_t len)
{
	char link[32], path[4096];
	kc_fd_path(entry_fd, link);
	ssize_t n = readlink(link, path, sizeof(path) - 1);
	if (n < 0) {
		snprintf(buf, len, "(unknown entry)");
		return;
	}
	path[n] = '\0';
	size_t rl = strlen(c->store->root_path);
	const char *rel = strncmp(path, c->store->root_path, rl) == 0 ? path + rl : path;
	snprintf(buf, len, "%.*s", (int)(len > 1 ? len - 1 : 0), *rel ? rel : "/");
}

void kc_cache_write_log(struct kc_cache *c, int entry_fd, const char *head, const char *body,
		      size_t body_len)
{
	size_t hl = strlen(head);
	char *buf = malloc(hl + body_len + 1);
	if (!buf)
		return;
	memcpy(buf, head, hl);
	if (body_len)
		memcpy(buf + hl, body, body_len);
	size_t len = hl + body_len;
	int err = -EEXIST;
	if (len <= KC_LOG_IN_PLACE) { /* a first log (a fetch's): no temporary and rename */
		int fd = openat(entry_fd, KC_LOG_NAME,
				O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
		struct stat st;
		err = fd < 0 ? -errno : kc_write_all(fd, buf, len);
		if (err && fd >= 0 && fstat(fd, &st) == 0) /* not one renamed over it meanwhile */
			kc_store_unlink_if_same(entry_fd, KC_LOG_NAME, &st);
		if (fd >= 0)
			close(fd);
	}
	if (err == -EEXIST)
		err = kc_store_write_atomic(c->store, entry_fd, KC_LOG_NAME, buf, len);
	if (err)
		kc_log(KC_LOG_WARN, "cannot write kernel.log: %s", strerror(-err));
	free(buf);
}
