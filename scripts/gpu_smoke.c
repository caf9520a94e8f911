/* gpu_smoke.c - load cubins that kcachefs compiled, by path, with the CUDA driver API, run
 * them on real data and check the results against the host.
 *
 * usage: gpu_smoke MODE ENTRY...
 *
 *   MODE    module   cuModuleLoad(path) + cuModuleGetFunction
 *           library  cuLibraryLoadFromFile(path) + cuLibraryGetKernel + cuKernelGetFunction
 *   ENTRY   [NAME=]PATH, loaded and run in the order given. PATH is a cubin file if its
 *           name ends in .cubin, else a kernel entry directory (its kernel.cubin is
 *           loaded). NAME picks the test:
 *           vector_add, saxpy or block_sum (the sample kernels in tests/kernels/). Without
 *           NAME= it is read from the entry directory's name, kernel.<NAME>.<hash> (the
 *           directory itself, or the cubin's parent).
 *
 *   e.g. gpu_smoke library /mnt/kc/cache/kernel.vector_add.0123abcd0123abcd \
 *                          /mnt/kc/cache/kernel.saxpy.89ab... /mnt/kc/cache/kernel.block_sum.cdef...
 *
 * The tests:
 *   vector_add  out = a + b over 1<<20 floats (256 threads a block)
 *   saxpy       y = 2.5 * x + y over 1<<20 floats (grid-stride loop, 1024 blocks of 256)
 *   block_sum   out[b] = sum of block b's 256 ints, 64 blocks of 128 threads (CUB)
 * Floats are compared with a relative tolerance (saxpy is built with --use_fast_math, so
 * its multiply-add may be fused), ints exactly. Outputs are filled with NaN or a sentinel
 * before the launch, so a kernel that did not run cannot pass.
 *
 * Environment:
 *   GPU_SMOKE_BARRIER=PATH  after the context is made, create PATH.ready.<pid> and wait
 *                           (at most 300 s) until PATH exists before loading anything, so
 *                           that several processes open their cubins at the same moment
 *   GPU_SMOKE_DEVICE=N      device ordinal (default 0)
 *
 * Output (stdout), one line per kernel:
 *   pid 1234 module vector_add: 1048576 elements ok (max err 0, cubin 4344 bytes)
 * A CUDA error is printed with cuGetErrorName/cuGetErrorString and ends the program.
 * Exit status: 0 if every kernel loaded, ran and checked; 1 on a CUDA error or a wrong
 * result; 2 on a usage error.
 *
 * Build (on a machine without a GPU the stub libcuda links; the real libcuda.so.1 is
 * found at run time):
 *   cc -O2 -Wall -Wextra -I/usr/local/cuda/include scripts/gpu_smoke.c \
 *      -L/usr/local/cuda/lib64/stubs -lcuda -o build/gpu_smoke
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char *g_mode = "?";
static const char *g_kernel = "-";
static int g_pid;

static void cuda_fail(const char *call, CUresult r)
{
	const char *name = NULL, *text = NULL;
	if (cuGetErrorName(r, &name) != CUDA_SUCCESS || !name)
		name = "unknown CUresult";
	if (cuGetErrorString(r, &text) != CUDA_SUCCESS || !text)
		text = "";
	if (r == CUDA_ERROR_STUB_LIBRARY) { /* the stub cannot name its own errors */
		name = "CUDA_ERROR_STUB_LIBRARY";
		text = "the toolkit's stub libcuda was loaded, not the driver's libcuda.so.1";
	}
	printf("pid %d %s %s: FAILED: %s returned %s (%d: %s)\n", g_pid, g_mode, g_kernel, call,
	       name, (int)r, text);
	fflush(stdout);
	exit(1);
}

#define CK(call)                                                                             \
	do {                                                                                 \
		CUresult ck_r_ = (call);                                                     \
		if (ck_r_ != CUDA_SUCCESS)                                                   \
			cuda_fail(#call, ck_r_);                                             \
	} while (0)

static void *xmalloc(size_t n)
{
	void *p = malloc(n);
	if (!p) {
		printf("pid %d %s %s: FAILED: out of host memory\n", g_pid, g_mode, g_kernel);
		exit(1);
	}
	return p;
}

/* Deterministic pseudo-random numbers (xorshift32), so a failure can be reproduced. */
static uint32_t rng_next(uint32_t *s)
{
	uint32_t x = *s;
	x ^= x << 13;
	x ^= x >> 17;
	x ^= x << 5;
	return *s = x;
}

static float rng_float(uint32_t *s) /* in [-1, 1) */
{
	return (float)(rng_next(s) >> 8) / (float)(1u << 23) - 1.0f;
}

/* A loaded cubin: a module or a library, and the function to launch. */
struct loaded {
	CUmodule mod;
	CUlibrary lib;
	CUfunction fn;
	long long bytes; /* size of the cubin as stat reports it after the load */
};

static void load(const char *path, const char *sym, struct loaded *l)
{
	memset(l, 0, sizeof(*l));
	if (strcmp(g_mode, "module") == 0) {
		CK(cuModuleLoad(&l->mod, path));
		CK(cuModuleGetFunction(&l->fn, l->mod, sym));
	} else {
		CUkernel k;
		CK(cuLibraryLoadFromFile(&l->lib, path, NULL, NULL, 0, NULL, NULL, 0));
		CK(cuLibraryGetKernel(&k, l->lib, sym));
		CK(cuKernelGetFunction(&l->fn, k));
	}
	struct stat st;
	l->bytes = stat(path, &st) == 0 ? (long long)st.st_size : -1;
}

static void unload(struct loaded *l)
{
	if (l->mod)
		CK(cuModuleUnload(l->mod));
	if (l->lib)
		CK(cuLibraryUnload(l->lib));
}

static int report(const char *what, int ok, double maxerr, const struct loaded *l)
{
	printf("pid %d %s %s: %s %s (max err %g, cubin %lld bytes)\n", g_pid, g_mode, g_kernel,
	       what, ok ? "ok" : "WRONG RESULT", maxerr, l->bytes);
	return ok ? 0 : 1;
}

/* The error of one float against its reference, relative above magnitude 1; NaN counts as
 * infinitely wrong. */
static double float_err(float got, double want)
{
	if (isnan(got))
		return INFINITY;
	double e = fabs((double)got - want);
	return fabs(want) > 1.0 ? e / fabs(want) : e;
}

/* The end of a float kernel's test: copy its n results back from dres, free dres and want
 * (the host's reference, in double), and report the largest float_err: ok when within tol.
 * Returns 0 when ok, else 1. */
static int finish_floats(CUdeviceptr dres, double *want, int n, double tol,
			 const struct loaded *l)
{
	float *got = xmalloc((size_t)n * sizeof(float));
	CK(cuMemcpyDtoH(got, dres, (size_t)n * sizeof(float)));
	double maxerr = 0;
	for (int i = 0; i < n; i++) {
		double e = float_err(got[i], want[i]);
		if (!(e <= maxerr))
			maxerr = e;
	}
	CK(cuMemFree(dres));
	free(got);
	free(want);
	char what[64];
	snprintf(what, sizeof(what), "%d elements", n);
	return report(what, maxerr <= tol, maxerr, l);
}

static int test_vector_add(const char *path)
{
	const int n = 1 << 20;
	const size_t bytes = (size_t)n * sizeof(float);
	float *a = xmalloc(bytes), *b = xmalloc(bytes);
	double *want = xmalloc((size_t)n * sizeof(double));
	uint32_t seed = 12345;
	for (int i = 0; i < n; i++) {
		a[i] = rng_float(&seed) * 1000.0f;
		b[i] = rng_float(&seed);
		want[i] = (double)(a[i] + b[i]); /* the same float add */
	}
	struct loaded l;
	load(path, "vector_add", &l);

	CUdeviceptr da, db, dout;
	CK(cuMemAlloc(&da, bytes));
	CK(cuMemAlloc(&db, bytes));
	CK(cuMemAlloc(&dout, bytes));
	CK(cuMemcpyHtoD(da, a, bytes));
	CK(cuMemcpyHtoD(db, b, bytes));
	free(a);
	free(b);
	CK(cuMemsetD32(dout, 0x7fc00000u, (size_t)n)); /* NaN: untouched elements fail */
	int nn = n;
	void *args[] = {&da, &db, &dout, &nn};
	CK(cuLaunchKernel(l.fn, (unsigned)(n + 255) / 256, 1, 1, 256, 1, 1, 0, NULL, args, NULL));
	CK(cuCtxSynchronize());
	unload(&l);
	CK(cuMemFree(da));
	CK(cuMemFree(db));
	return finish_floats(dout, want, n, 1e-6, &l);
}

static int test_saxpy(const char *path)
{
	const int n = 1 << 20;
	const float alpha = 2.5f;
	const size_t bytes = (size_t)n * sizeof(float);
	float *x = xmalloc(bytes), *y = xmalloc(bytes);
	double *want = xmalloc((size_t)n * sizeof(double));
	uint32_t seed = 67890;
	for (int i = 0; i < n; i++) {
		x[i] = rng_float(&seed) * 100.0f;
		y[i] = rng_float(&seed) * 100.0f;
		want[i] = (double)alpha * x[i] + y[i];
	}
	struct loaded l;
	load(path, "saxpy", &l);

	CUdeviceptr dx, dy;
	CK(cuMemAlloc(&dx, bytes));
	CK(cuMemAlloc(&dy, bytes));
	CK(cuMemcpyHtoD(dx, x, bytes));
	CK(cuMemcpyHtoD(dy, y, bytes));
	free(x);
	free(y);
	float a = alpha;
	int nn = n;
	void *args[] = {&a, &dx, &dy, &nn};
	CK(cuLaunchKernel(l.fn, 1024, 1, 1, 256, 1, 1, 0, NULL, args, NULL));
	CK(cuCtxSynchronize());
	unload(&l);
	CK(cuMemFree(dx));
	/* A few ulps of a result near 100 (fused or not) is far below 1e-4; a y left as it was
	 * is off by 2.5*|x|, far above. */
	return finish_floats(dy, want, n, 1e-4, &l);
}

static int test_block_sum(const char *path)
{
	const int blocks = 64, per_block = 256, n = blocks * per_block;
	int *in = xmalloc((size_t)n * sizeof(int)), *out = xmalloc((size_t)blocks * sizeof(int));
	uint32_t seed = 424242;
	for (int i = 0; i < n; i++)
		in[i] = (int)(rng_next(&seed) % 2001u) - 1000;
	struct loaded l;
	load(path, "block_sum", &l);

	CUdeviceptr din, dout;
	CK(cuMemAlloc(&din, (size_t)n * sizeof(int)));
	CK(cuMemAlloc(&dout, (size_t)blocks * sizeof(int)));
	CK(cuMemcpyHtoD(din, in, (size_t)n * sizeof(int)));
	CK(cuMemsetD32(dout, 0x7fffffffu, (size_t)blocks)); /* no block of 256 small ints sums to this */
	void *args[] = {&din, &dout};
	CK(cuLaunchKernel(l.fn, (unsigned)blocks, 1, 1, 128, 1, 1, 0, NULL, args, NULL));
	CK(cuCtxSynchronize());
	CK(cuMemcpyDtoH(out, dout, (size_t)blocks * sizeof(int)));

	long long maxerr = 0;
	int wrong = 0;
	for (int b = 0; b < blocks; b++) {
		long long want = 0;
		for (int i = 0; i < per_block; i++)
			want += in[b * per_block + i];
		long long e = llabs((long long)out[b] - want);
		if (e > maxerr)
			maxerr = e;
		wrong += e != 0;
	}
	CK(cuMemFree(din));
	CK(cuMemFree(dout));
	unload(&l);
	free(in);
	free(out);
	char what[64];
	snprintf(what, sizeof(what), "%d blocks x %d ints", blocks, per_block);
	return report(what, wrong == 0, (double)maxerr, &l);
}

static const struct test {
	const char *name;
	int (*run)(const char *path);
} tests[] = {
	{"vector_add", test_vector_add},
	{"saxpy", test_saxpy},
	{"block_sum", test_block_sum},
};

static const struct test *find_test(const char *name, size_t len)
{
	for (size_t i = 0; i < sizeof(tests) / sizeof(tests[0]); i++)
		if (strlen(tests[i].name) == len && strncmp(tests[i].name, name, len) == 0)
			return &tests[i];
	return NULL;
}

/* From ".../kernel.<name>.<hash>" or ".../kernel.<name>.<hash>/<file>": the name. */
static const struct test *test_from_path(const char *path, int is_dir)
{
	char buf[4096];
	snprintf(buf, sizeof(buf), "%s", path);
	size_t len = strlen(buf);
	while (len > 1 && buf[len - 1] == '/')
		buf[--len] = '\0';
	if (!is_dir) { /* drop the file name */
		char *slash = strrchr(buf, '/');
		if (!slash)
			return NULL;
		*slash = '\0';
	}
	const char *base = strrchr(buf, '/');
	base = base ? base + 1 : buf;
	if (strncmp(base, "kernel.", 7) != 0)
		return NULL;
	const char *name = base + 7, *dot = strrchr(name, '.');
	if (!dot)
		return NULL;
	return find_test(name, (size_t)(dot - name));
}

static void wait_barrier(void)
{
	const char *bar = getenv("GPU_SMOKE_BARRIER");
	if (!bar || !*bar)
		return;
	char ready[4096];
	snprintf(ready, sizeof(ready), "%s.ready.%d", bar, g_pid);
	int fd = open(ready, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
	if (fd < 0) {
		printf("pid %d %s: FAILED: create %s: %s\n", g_pid, g_mode, ready, strerror(errno));
		exit(1);
	}
	close(fd);
	const struct timespec tick = {0, 1000000};
	for (long i = 0; access(bar, F_OK) != 0; i++) {
		if (i > 300 * 1000) {
			printf("pid %d %s: FAILED: %s did not appear within 300 s\n", g_pid, g_mode,
			       bar);
			exit(1);
		}
		nanosleep(&tick, NULL);
	}
}

static int usage(const char *prog)
{
	fprintf(stderr,
		"usage: %s module|library [NAME=]PATH...\n"
		"  PATH: a cubin file (*.cubin) or a kernel entry directory kernel.<NAME>.<hash>\n"
		"        (its kernel.cubin is loaded); NAME: vector_add, saxpy or block_sum\n"
		"        (default: from the entry directory's name)\n",
		prog);
	return 2;
}

int main(int argc, char **argv)
{
	g_pid = (int)getpid();
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc < 3 || (strcmp(argv[1], "module") != 0 && strcmp(argv[1], "library") != 0))
		return usage(argv[0]);
	g_mode = argv[1];

	/* Resolve every argument before touching the GPU, so a typo costs no cuInit. */
	int n = argc - 2;
	const struct test **which = xmalloc((size_t)n * sizeof(*which));
	char **paths = xmalloc((size_t)n * sizeof(*paths));
	for (int i = 0; i < n; i++) {
		const char *arg = argv[i + 2], *eq = strchr(arg, '=');
		const char *p = eq ? eq + 1 : arg;
		/* Decided by the name alone: the cubin is first touched by the CUDA loader. */
		size_t plen = strlen(p);
		int is_dir = !(plen >= 6 && strcmp(p + plen - 6, ".cubin") == 0);
		which[i] = eq ? find_test(arg, (size_t)(eq - arg)) : test_from_path(p, is_dir);
		if (!which[i]) {
			fprintf(stderr, "gpu_smoke: %s: no test for this name (want [NAME=]PATH with "
					"NAME vector_add, saxpy or block_sum, or an entry directory "
					"kernel.<NAME>.<hash>)\n",
				arg);
			return usage(argv[0]);
		}
		if (is_dir) {
			size_t len = strlen(p) + sizeof("/kernel.cubin");
			paths[i] = xmalloc(len);
			snprintf(paths[i], len, "%s/kernel.cubin", p);
		} else {
			paths[i] = strdup(p);
		}
	}

	int ordinal = getenv("GPU_SMOKE_DEVICE") ? atoi(getenv("GPU_SMOKE_DEVICE")) : 0;
	CUdevice dev;
	CUcontext ctx;
	CK(cuInit(0));
	CK(cuDeviceGet(&dev, ordinal));
	CK(cuDevicePrimaryCtxRetain(&ctx, dev));
	CK(cuCtxSetCurrent(ctx));
	wait_barrier();

	int failed = 0;
	for (int i = 0; i < n; i++) {
		g_kernel = which[i]->name;
		failed |= which[i]->run(paths[i]);
		free(paths[i]);
	}
	g_kernel = "-";
	CK(cuDevicePrimaryCtxRelease(dev));
	free(which);
	free(paths);
	return failed ? 1 : 0;
}
