#define _GNU_SOURCE
#include "tmptree.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int tmptree_new(char *path, size_t pathlen, const char *name)
{
	snprintf(path, pathlen, "/tmp/%s-XXXXXX", name);
	if (!mkdtemp(path)) {
		perror(path);
		return -1;
	}
	return 0;
}

void tmptree_mkdir(const char *root, const char *rel)
{
	char path[1024];
	snprintf(path, sizeof(path), "%s/%s", root, rel);
	if (mkdir(path, 0755) != 0 && errno != EEXIST)
		perror(path);
}

void tmptree_put(const char *root, const char *rel, const char *text, mode_t mode)
{
	char path[1024];
	snprintf(path, sizeof(path), "%s/%s", root, rel);
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, mode);
	if (fd < 0) {
		perror(path);
		return;
	}
	if (write(fd, text, strlen(text)) < 0 || fchmod(fd, mode) != 0)
		perror(path);
	close(fd);
}

static int remove_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)flag;
	(void)ftw;
	if (remove(path) != 0) {
		perror(path);
		return -1;
	}
	return 0;
}

int tmptree_remove(const char *root)
{
	return nftw(root, remove_one, 16, FTW_DEPTH | FTW_PHYS) == 0 ? 0 : -1;
}
