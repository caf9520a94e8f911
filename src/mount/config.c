/* config.c - see config.h */
#define _GNU_SOURCE
#include "config.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "compile.h"
#include "log.h"
#include "nvcc.h"
#include "sandbox.h"

#define KC_CLAIM_WAIT_MS 2000 /* how long a start waits for a range held (see below) */

/* Nonzero if path is an executable regular file (else errno says why). */
static int runnable_file(const char *path)
{
	struct stat st;
	if (stat(path, &st) != 0)
		return 0;
	if (!S_ISREG(st.st_mode)) {
		errno = S_ISDIR(st.st_mode) ? EISDIR : EACCES;
		return 0;
	}
	return access(path, X_OK) == 0;
}

/* The program name in the directory of the running program (kcachefs-nvrtc,
 * kcachefs-trace), malloc'd, or NULL when it is not there or not executable. */
static char *find_beside(const char *name)
{
	char self[4096], path[4200];
	ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
	if (n <= 0)
		return NULL;
	self[n] = '\0';
	char *slash = strrchr(self, '/');
	if (!slash)
		return NULL;
	*slash = '\0';
	snprintf(path, sizeof(path), "%s/%s", self, name);
	return access(path, X_OK) == 0 ? strdup(path) : NULL;
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

/* Whom compiles run as, and in what: -o compile_uids=FIRST|daemon (config.h). Returns 0
 * or -EINVAL with why filled. */
static int resolve_compile_uids(struct kc_config *c, char *why, size_t whylen)
{
	const char *opt = c->compile_uids_opt;
	int root = geteuid() == 0;
	char nswhy[200];

	unsigned long first = KC_DEFAULT_COMPILE_UIDS, ranges = KC_DEFAULT_COMPILE_RANGES;
	int daemon = !opt ? !root : strcmp(opt, "daemon") == 0;
	if (opt && !daemon) { /* a bad value is said before any warning */
		char *end;
		errno = 0;
		first = strtoul(opt, &end, 10);
		ranges = 1;
		if (errno || end == opt || *end || opt[0] < '0' || opt[0] > '9' || first == 0 ||
		    first > 0xFFFFFFFEul - KC_COMPILE_SLOTS) {
			snprintf(why, whylen, "compile_uids=%s: give the first of %u free uids "
				 "(1 to %lu), or daemon", opt, KC_COMPILE_SLOTS,
				 0xFFFFFFFEul - KC_COMPILE_SLOTS);
			return -EINVAL;
		}
		if (!root) {
			snprintf(why, whylen, "compile_uids=%s: only a daemon run as root can run "
				 "compiles as other uids", opt);
			return -EINVAL;
		}
	}
	if (root) {
		c->ns_flags = kc_sandbox_namespaces(nswhy, sizeof(nswhy));
		if (!c->ns_flags)
			kc_log(KC_LOG_WARN, "compiles run without namespaces of their own (%s): "
			       "processes they leave are still killed with their group", nswhy);
	}
	if (daemon) {
		c->compile_uids = 0;
		return 0;
	}
	/* Two daemons in one range would kill each other's compiles. The watcher of a daemon
	 * that just died holds its claim while it kills that daemon's compiles (milliseconds):
	 * a restart on that range waits for it, up to KC_CLAIM_WAIT_MS. */
	int fd = -EBUSY;
	for (unsigned waited = 0; fd == -EBUSY && waited <= KC_CLAIM_WAIT_MS; waited += 50) {
		if (waited)
			usleep(50000);
		for (unsigned long k = 0; k < ranges && fd == -EBUSY; k++)
			if ((fd = kc_sandbox_claim_uids((uid_t)(first + k * KC_COMPILE_SLOTS),
							KC_COMPILE_SLOTS)) >= 0)
				first += k * KC_COMPILE_SLOTS;
	}
	if (fd < 0) {
		if (fd == -EPERM)
			snprintf(why, whylen, "compile uids: " KC_SANDBOX_RUN_DIR " must be a directory "
				 "of root's that only root may write");
		else if (fd != -EBUSY)
			snprintf(why, whylen, "compile uids: cannot claim a range in "
				 KC_SANDBOX_RUN_DIR ": %s", strerror(-fd));
		else if (opt)
			snprintf(why, whylen, "compile_uids=%lu: another kcachefs on this node compiles "
				 "as these uids; give each mount a range of its own", first);
		else
			snprintf(why, whylen, "compile uids: the %u default ranges are all taken by "
				 "other kcachefs daemons; give compile_uids=", KC_DEFAULT_COMPILE_RANGES);
		return -EINVAL;
	}
	c->compile_uids = (unsigned)first;
	c->uids_lock_fd = fd;
	/* A uid that is somebody's would give that user the compiles, and them that user's
	 * files; so the range is ours, and what runs in it was left by a daemon that died. */
	for (unsigned i = 0; i < KC_COMPILE_SLOTS; i++) {
		char who[100];
		if (kc_sandbox_id_taken(c->compile_uids + i, who, sizeof(who))) {
			snprintf(why, whylen, "compile_uids=%u: id %u belongs to %s; compiles need %u ids "
				 "no user or group has", c->compile_uids, c->compile_uids + i, who,
				 KC_COMPILE_SLOTS);
			return -EINVAL;
		}
	}
	unsigned left = kc_sandbox_count_uids(c->compile_uids, KC_COMPILE_SLOTS);
	if (left) {
		kc_log(KC_LOG_WARN, "killing %u compiler processes left by a previous daemon "
		       "(uids %u+)", left, c->compile_uids);
		kc_sandbox_kill_uids(c->compile_uids, KC_COMPILE_SLOTS);
	}
	return 0;
}

/* A compiler the daemon can run (ran: its --version answered at the mount) must run as the
 * compiles' uid too, and reach the include directories of -o flags=: say so at the mount,
 * not at every compile. Returns 0 or -EACCES with why filled. */
static int check_compiler_runs_sandboxed(const struct kc_config *c, const char *compiler,
					 int ran, char *why, size_t whylen)
{
	char probe[300];
	int bad_dir;
	if (!c->compile_uids || !ran)
		return 0;
	if (kc_compile_probe(compiler, &c->mount_flags, c->compile_uids, c->ns_flags, &bad_dir,
			     probe, sizeof(probe)) == 0)
		return 0;
	if (bad_dir >= 0)
		snprintf(why, whylen, "flags=: include directory %.300s for the compiles' uid %u: "
			 "all users must be able to search it and the directories above it (o+x)",
			 probe, c->compile_uids);
	else
		snprintf(why, whylen, "compile_uids=%u: %.200s runs as the daemon but not as uid %u "
			 "(%.300s): all users must be able to search the directories above it (o+x) "
			 "and to read and run it (o+rx), as where meson install and the CUDA toolkit "
			 "put their programs; or give compile_uids=daemon", c->compile_uids, compiler,
			 c->compile_uids, probe);
	return -EACCES;
}

int kc_config_resolve(struct kc_config *c, char *why, size_t whylen)
{
	char arch[32];

	if (!c->nvcc)
		c->nvcc = kc_nvcc_find(NULL);
	if (!c->nvcc)
		return -ENOMEM;
	if (!c->nvrtc)
		c->nvrtc = find_beside("kcachefs-nvrtc");
	if (!c->tracer)
		c->tracer = find_beside("kcachefs-trace");
	if (c->backend_nvrtc && !c->nvrtc) {
		snprintf(why, whylen, "compiler=nvrtc: kcachefs-nvrtc is not next to kcachefs "
			 "(it is built when meson finds libnvrtc)");
		return -EINVAL;
	}
	/* Every compile would fail: say so now. (One that goes away later fails its compiles
	 * as a passing cause, and is used again when it is back.) */
	if (!runnable_file(c->nvcc)) {
		int err = errno;
		if (!c->backend_nvrtc) {
			snprintf(why, whylen, "compiler %s: %s; give the path of nvcc with -o nvcc=PATH "
				 "(or set CUDA_HOME), or install the CUDA toolkit", c->nvcc,
				 strerror(err));
			return -ENOENT;
		}
		kc_log(KC_LOG_WARN, "compiler %s: %s; entries that ask for nvcc will fail", c->nvcc,
		       strerror(err));
	}
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
	/* A typo (sm_12 for sm_120) would fail every compile later: ask nvcc now. A compiler
	 * that cannot list its targets (a wrapper, not runnable yet) is not held against. */
	if (kc_nvcc_supports_arch(c->nvcc, c->arch) == 0) {
		snprintf(why, whylen, "arch=%s: %s does not compile for it (see its --list-gpu-code)",
			 c->arch, c->nvcc);
		return -EINVAL;
	}
	if (c->flags) {
		int err = kc_flags_split(c->flags, &c->mount_flags, why, whylen);
		if (err)
			return err;
	}
	if (resolve_compile_uids(c, why, whylen) != 0)
		return -EINVAL;
	if (c->jobs == 0) {
		long n = sysconf(_SC_NPROCESSORS_ONLN);
		c->jobs = n <= 0 ? 1 : n > KC_COMPILE_SLOTS ? KC_COMPILE_SLOTS : (unsigned)n;
	}
	if (c->compile_timeout == 0)
		c->compile_timeout = KC_DEFAULT_COMPILE_TIMEOUT;
	if (c->max_source_size == 0)
		c->max_source_size = KC_DEFAULT_MAX_SOURCE;
	int nvcc_ran, nvrtc_ran;
	c->compiler = malloc(sizeof(*c->compiler));
	if (!c->compiler || kc_compiler_init(c->compiler, c->nvcc, c->nvrtc) != 0) {
		free(c->compiler);
		c->compiler = NULL;
		return -ENOMEM;
	}
	kc_compiler_ran(c->compiler, &nvcc_ran, &nvrtc_ran);
	if (check_compiler_runs_sandboxed(c, c->nvcc, nvcc_ran, why, whylen) != 0)
		return -EACCES;
	/* NVRTC is the mount's choice, or an entry's: only the first cannot go without it. */
	if (c->nvrtc && check_compiler_runs_sandboxed(c, c->nvrtc, nvrtc_ran, why, whylen) != 0) {
		if (c->backend_nvrtc)
			return -EACCES;
		kc_log(KC_LOG_WARN, "%s; entries that ask for NVRTC will fail", why);
		why[0] = '\0';
	}
	return 0;
}

unsigned long kc_config_compiler_id(const struct kc_config *c, char *out)
{
	if (!c->compiler) {
		out[0] = '\0';
		return 0;
	}
	return kc_compiler_id(c->compiler, out);
}

void kc_config_free(struct kc_config *c)
{
	if (c->compiler) {
		kc_compiler_destroy(c->compiler);
		free(c->compiler);
		c->compiler = NULL;
	}
	free(c->nvcc);
	free(c->nvrtc);
	free(c->tracer);
	free(c->compile_uids_opt);
	c->compile_uids_opt = NULL;
	if (c->uids_lock_fd > 0)
		close(c->uids_lock_fd);
	c->uids_lock_fd = 0;
	c->nvrtc = NULL;
	c->tracer = NULL;
	free(c->arch);
	free(c->flags);
	kc_argv_free(&c->mount_flags);
	c->nvcc = c->arch = c->flags = NULL;
}
