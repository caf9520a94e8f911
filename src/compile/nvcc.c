/* nvcc.c - see nvcc.h */
#define _GNU_SOURCE
#include "nvcc.h"

#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* Nonzero if path is an executable file other than not_this. */
static int usable(const char *path, const struct stat *self)
{
	struct stat st;
	if (access(path, X_OK) != 0 || stat(path, &st) != 0 || !S_ISREG(st.st_mode))
		return 0;
	return !self || st.st_dev != self->st_dev || st.st_ino != self->st_ino;
}

static char *find_on_path(const char *prog, const struct stat *self)
{
	const char *path = getenv("PATH");
	char buf[4096];

	if (!path)
		return NULL;
	while (*path) {
		const char *colon = strchr(path, ':');
		size_t len = colon ? (size_t)(colon - path) : strlen(path);
		if (len > 0 && len + strlen(prog) + 2 < sizeof(buf)) {
			snprintf(buf, sizeof(buf), "%.*s/%s", (int)len, path, prog);
			if (usable(buf, self))
				return realpath(buf, NULL);
		}
		path += len + (colon ? 1 : 0);
	}
	return NULL;
}

char *kc_nvcc_find(const char *not_this)
{
	struct stat self_st, *self = NULL;
	const char *home = getenv("CUDA_HOME");
	char buf[4096];

	if (not_this && stat(not_this, &self_st) == 0)
		self = &self_st;
	if (home && *home) {
		snprintf(buf, sizeof(buf), "%s/bin/nvcc", home);
		if (usable(buf, self))
			return strdup(buf);
	}
	char *found = find_on_path("nvcc", self);
	if (found)
		return found;
	const char *fallback = "/usr/local/cuda/bin/nvcc";
	struct stat st;
	if (self && stat(fallback, &st) == 0 && st.st_dev == self->st_dev &&
	    st.st_ino == self->st_ino)
		return NULL;
	return strdup(fallback);
}

int kc_nvcc_output(const char *nvcc, const char *arg, char *out, size_t outlen)
{
	int pipefd[2];
	posix_spawn_file_actions_t fa;
	char *argv[] = {(char *)nvcc, (char *)arg, NULL};
	size_t used = 0;
	pid_t pid;
	int status = 0;

	if (outlen == 0)
		return -EINVAL;
	if (pipe2(pipefd, O_CLOEXEC) != 0)
		return -errno;
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_adddup2(&fa, pipefd[1], 1);
	posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
	int err = posix_spawn(&pid, nvcc, &fa, NULL, argv, environ);
	posix_spawn_file_actions_destroy(&fa);
	close(pipefd[1]);
	if (err) {
		close(pipefd[0]);
		return -err;
	}
	for (;;) {
		char drain[512];
		int full = used == outlen - 1;
		ssize_t n = read(pipefd[0], full ? drain : out + used,
				 full ? sizeof(drain) : outlen - 1 - used);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		if (!full)
			used += (size_t)n;
	}
	close(pipefd[0]);
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	out[used] = '\0';
	while (used > 0 && (out[used - 1] == '\n' || out[used - 1] == '\r'))
		out[--used] = '\0';
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || used == 0)
		return -EIO;
	return 0;
}

int kc_nvcc_version(const char *nvcc, char *out, size_t outlen)
{
	char buf[4096];
	int err = kc_nvcc_output(nvcc, "--version", buf, sizeof(buf));
	if (err)
		return err;
	char *last = strrchr(buf, '\n');
	snprintf(out, outlen, "%s", last ? last + 1 : buf);
	return 0;
}

int kc_nvcc_supports_arch(const char *nvcc, const char *arch)
{
	char list[4096], base[32];
	int err = kc_nvcc_output(nvcc, "--list-gpu-code", list, sizeof(list));
	if (err)
		return err;
	size_t n = strspn(arch, "sm_0123456789");
	snprintf(base, sizeof(base), "%.*s", (int)(n < sizeof(base) ? n : sizeof(base) - 1), arch);
	int listed = 0, found = 0;
	for (char *save = NULL, *t = strtok_r(list, " \t\r\n", &save); t;
	     t = strtok_r(NULL, " \t\r\n", &save)) {
		listed += strncmp(t, "sm_", 3) == 0;
		found |= strcmp(t, base) == 0;
	}
	return listed ? found : -EIO;
}
