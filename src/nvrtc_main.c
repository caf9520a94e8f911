/* nvrtc_main.c - kcachefs-nvrtc: the NVRTC compile backend, run by the daemon exactly as it
 * runs nvcc (its own process, scratch directory, timeout and log), so that a compiler crash
 * or hang costs one compile and never the mount.
 *
 *   kcachefs-nvrtc SOURCE -cubin -o OUT [nvcc flags...]
 *   kcachefs-nvrtc --version   (its version; "libnvrtc PATH", the library it loaded;
 *                               "NVRTC X.Y" last)
 *
 * The flags are nvcc's, as the mount's allow-list passed them; kc_flags_to_nvrtc
 * (flags.h) turns them into NVRTC options, dropping what only steers the host side. The
 * toolkit's headers (<CUDA>/include and its cccl/) are on the include path, as nvcc puts
 * them. Output and status are shaped like nvcc's: the compile log on stderr, the cubin
 * written to OUT, exit status 0; 1 when the source is rejected (the log names each
 * error); 2 for a usage error or a flag NVRTC cannot take; 3 when the cubin cannot be
 * written.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <nvrtc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "flags.h"
#include "io.h"
#include "kc_build.h"

/* dl_iterate_phdr callback: the path of the libnvrtc this process loaded, into *arg. */
static int find_libnvrtc(struct dl_phdr_info *info, size_t size, void *arg)
{
	(void)size;
	const char *slash = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
	if (!slash || strncmp(slash + 1, "libnvrtc.so", 11) != 0)
		return 0;
	*(const char **)arg = info->dlpi_name;
	return 1;
}

int main(int argc, char **argv)
{
	int major = 0, minor = 0;
	nvrtcVersion(&major, &minor);
	if (argc == 2 && strcmp(argv[1], "--version") == 0) {
		/* The library's line lets the daemon digest the very file (compiler.h). */
		const char *lib = NULL;
		dl_iterate_phdr(find_libnvrtc, &lib);
		printf("kcachefs-nvrtc %s (CUDA %s)\n", KC_VERSION, KC_CUDA_VERSION);
		if (lib)
			printf("libnvrtc %s\n", lib);
		printf("NVRTC %d.%d\n", major, minor);
		return 0;
	}
	if (argc < 5 || strcmp(argv[2], "-cubin") != 0 || strcmp(argv[3], "-o") != 0) {
		fprintf(stderr, "usage: %s SOURCE -cubin -o OUT [nvcc flags...] | --version\n",
			argv[0]);
		return 2;
	}
	const char *src_path = argv[1], *out_path = argv[4];
	struct kc_argv given = {0}, opts = {0};
	char why[512], inc[4200];
	size_t len = 0;

	for (int i = 5; i < argc; i++)
		if (kc_argv_push(&given, argv[i]))
			return 2;
	if (kc_flags_to_nvrtc(&given, &opts, why, sizeof(why)) != 0) {
		fprintf(stderr, "kcachefs-nvrtc: error: %s\n", why);
		return 2;
	}
	const char *home = getenv("CUDA_HOME");
	if (!home || !*home)
		home = KC_CUDA_HOME;
	snprintf(inc, sizeof(inc), "--include-path=%s/include", home);
	kc_argv_push(&opts, inc);
	snprintf(inc, sizeof(inc), "--include-path=%s/include/cccl", home);
	kc_argv_push(&opts, inc);

	char *source = NULL;
	int in = open(src_path, O_RDONLY | O_CLOEXEC);
	int rerr = in < 0 ? -errno : kc_read_all(in, SIZE_MAX, &source, &len);
	if (in >= 0)
		close(in);
	if (rerr) {
		fprintf(stderr, "kcachefs-nvrtc: error: cannot read %s: %s\n", src_path,
			strerror(-rerr));
		return 2;
	}
	if (memchr(source, '\0', len)) { /* NVRTC takes a C string: it would stop there */
		fprintf(stderr, "kcachefs-nvrtc: error: the source holds a NUL byte\n");
		return 2;
	}
	nvrtcProgram prog;
	nvrtcResult r = nvrtcCreateProgram(&prog, source, "kernel.cu", 0, NULL, NULL);
	if (r != NVRTC_SUCCESS) {
		fprintf(stderr, "kcachefs-nvrtc: error: %s\n", nvrtcGetErrorString(r));
		return 2;
	}
	r = nvrtcCompileProgram(prog, (int)opts.n, (const char *const *)opts.v);
	size_t log_len = 0;
	if (nvrtcGetProgramLogSize(prog, &log_len) == NVRTC_SUCCESS && log_len > 1) {
		char *log = malloc(log_len);
		if (log && nvrtcGetProgramLog(prog, log) == NVRTC_SUCCESS)
			fputs(log, stderr);
		free(log);
	}
	if (r != NVRTC_SUCCESS) {
		fprintf(stderr, "kcachefs-nvrtc: error: %s\n", nvrtcGetErrorString(r));
		return r == NVRTC_ERROR_COMPILATION ? 1 : 2;
	}
	size_t cubin_len = 0;
	char *cubin = NULL;
	if (nvrtcGetCUBINSize(prog, &cubin_len) != NVRTC_SUCCESS || cubin_len == 0 ||
	    !(cubin = malloc(cubin_len)) || nvrtcGetCUBIN(prog, cubin) != NVRTC_SUCCESS) {
		fprintf(stderr, "kcachefs-nvrtc: error: no cubin (is the architecture a real "
				"sm_XY, not compute_XY?)\n");
		return 2;
	}
	int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	int err = fd < 0 ? -errno : kc_write_all(fd, cubin, cubin_len);
	if (fd >= 0 && close(fd) != 0 && !err)
		err = -errno;
	if (err) {
		fprintf(stderr, "kcachefs-nvrtc: cannot write %s: %s\n", out_path, strerror(-err));
		return 3;
	}
	nvrtcDestroyProgram(&prog);
	free(cubin);
	free(source);
	kc_argv_free(&given);
	kc_argv_free(&opts);
	return 0;
}
