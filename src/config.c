/* config.c - see config.h */
#define _GNU_SOURCE
#include "config.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "nvcc.h"

/* "<path> <last line of --version>", or "<path> unavailable" with a warning. */
static void compiler_identity(struct kc_config *c)
{
	char version[200];
	int err = kc_nvcc_version(c->nvcc, version, sizeof(version));

	if (err) {
		snprintf(c->compiler_id, sizeof(c->compiler_id), "%s unavailable", c->nvcc);
		if (err == -EIO)
			kc_log(KC_LOG_WARN, "compiler %s --version failed", c->nvcc);
		else
			kc_log(KC_LOG_WARN, "compiler %s cannot run: %s", c->nvcc, strerror(-err));
		return;
	}
	snprintf(c->compiler_id, sizeof(c->compiler_id), "%.*s %.120s", 120, c->nvcc, version);
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
		c->nvcc = kc_nvcc_find(NULL);
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
