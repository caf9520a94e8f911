/* config.c - see config.h */
#define _GNU_SOURCE
#include "config.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "log.h"

extern char **environ;

static char *find_on_path(const char *prog)
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
			if (access(buf, X_OK) == 0)
				return realpath(buf, NULL);
		}
		path += len + (colon ? 1 : 0);
	}
	return NULL;
}

static char *default_nvcc(void)
{
	const char *home = getenv("CUDA_HOME");
	char buf[4096];

	if (home && *home) {
		snprintf(buf, sizeof(buf), "%s/bin/nvcc", home);
		if (access(buf, X_OK) == 0)
			return strdup(buf);
	}
	char *found = find_on_path("nvcc");
	if (found)
		return found;
	return strdup("/usr/local/cuda/bin/nvcc");
}

/* Run "nvcc --version" and keep its last non-empty line. */
static void compiler_identity(struct kc_config *c)
{
	int pipefd[2];
	posix_spawn_file_actions_t fa;
	char *argv[] = {c->nvcc, "--version", NULL};
	char out[4096];
	size_t used = 0;
	pid_t pid;
	int status = 0;

	snprintf(c->compiler_id, sizeof(c->compiler_id), "%s unavailable", c->nvcc);
	if (pipe2(pipefd, O_CLOEXEC) != 0)
		return;
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_adddup2(&fa, pipefd[1], 1);
	posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
	int err = posix_spawn(&pid, c->nvcc, &fa, NULL, argv, environ);
	posix_spawn_file_actions_destroy(&fa);
	close(pipefd[1]);
	if (err) {
		close(pipefd[0]);
		kc_log(KC_LOG_WARN, "compiler %s cannot run: %s", c->nvcc, strerror(err));
		return;
	}
	for (;;) {
		ssize_t n = read(pipefd[0], out + used, sizeof(out) - 1 - used);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		used += (size_t)n;
		if (used == sizeof(out) - 1)
			break;
	}
	close(pipefd[0]);
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	out[used] = '\0';
	while (used > 0 && (out[used - 1] == '\n' || out[used - 1] == '\r'))
		out[--used] = '\0';
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || used == 0) {
		kc_log(KC_LOG_WARN, "compiler %s --version failed", c->nvcc);
		return;
	}
	char *last = strrchr(out, '\n');
	snprintf(c->compiler_id, sizeof(c->compiler_id), "%.*s %.*s", 120, c->nvcc, 120,
		 last ? last + 1 : out);
}

/* Compute capability of GPU 0 through the driver API, loaded at run time so that the
 * daemon runs on nodes without a driver. Returns 0 and fills arch, or -ENODEV. */
static int detect_arch(char *arch, size_t len)
{
	typedef int (*init_fn)(unsigned);
	typedef int (*get_fn)(int *, int);
	typedef int (*attr_fn)(int *, int, int);
	void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	int dev = 0, major = 0, minor = 0;

	if (!lib)
		return -ENODEV;
	init_fn cu_init = (init_fn)dlsym(lib, "cuInit");
	get_fn cu_get = (get_fn)dlsym(lib, "cuDeviceGet");
	attr_fn cu_attr = (attr_fn)dlsym(lib, "cuDeviceGetAttribute");
	int ok = cu_init && cu_get && cu_attr && cu_init(0) == 0 && cu_get(&dev, 0) == 0 &&
		 cu_attr(&major, 75, dev) == 0 && cu_attr(&minor, 76, dev) == 0;
	/* 75, 76: CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR (cuda.h) */
	dlclose(lib);
	if (!ok || major <= 0)
		return -ENODEV;
	/* Hopper and later have arch-specific features (wgmma, tcgen05): use the 'a' target,
	 * as DeepGEMM does (sm_90a, sm_100a). */
	snprintf(arch, len, "sm_%d%d%s", major, minor, major >= 9 ? "a" : "");
	return 0;
}

int kc_config_resolve(struct kc_config *c, char *why, size_t whylen)
{
	char arch[32];

	if (!c->nvcc)
		c->nvcc = default_nvcc();
	if (!c->nvcc)
		return -ENOMEM;
	if (!c->arch) {
		c->arch_detected = detect_arch(arch, sizeof(arch)) == 0;
		c->arch = strdup(c->arch_detected ? arch : KC_DEFAULT_ARCH);
		if (!c->arch)
			return -ENOMEM;
	}
	snprintf(arch, sizeof(arch), "-arch=%.20s", c->arch);
	if (strlen(c->arch) > 20 || strncmp(c->arch, "sm_", 3) != 0 ||
	    kc_flag_check(arch, why, whylen) != 0) {
		snprintf(why, whylen, "arch=%s: architecture must look like sm_90a", c->arch);
		return -EINVAL;
	}
	if (c->flags) {
		int err = kc_flags_split(c->flags, &c->mount_flags, why, whylen);
		if (err)
			return err;
	}
	if (c->jobs == 0) {
		long n = sysconf(_SC_NPROCESSORS_ONLN);
		c->jobs = n > 0 ? (unsigned)n : 1;
	}
	if (c->compile_timeout == 0)
		c->compile_timeout = KC_DEFAULT_COMPILE_TIMEOUT;
	if (c->max_source_size == 0)
		c->max_source_size = KC_DEFAULT_MAX_SOURCE;
	compiler_identity(c);
	return 0;
}

void kc_config_free(struct kc_config *c)
{
	free(c->nvcc);
	free(c->arch);
	free(c->flags);
	kc_argv_free(&c->mount_flags);
	c->nvcc = c->arch = c->flags = NULL;
}
