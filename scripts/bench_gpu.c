/* bench_gpu.c - figure 7 of scripts/bench.py, on a GPU node: cuModuleLoad of the same cubin
 * through the mount and straight from the backing directory, alternating, in one process.
 *
 * usage: bench_gpu MOUNT_PATH BACKING_PATH LOADS REPS
 * Each repetition times LOADS x (cuModuleLoad + cuModuleUnload) of MOUNT_PATH, then of
 * BACKING_PATH. Prints one line per repetition and a last line
 *   "median mount <us> backing <us> ratio <r>"  (microseconds per load).
 * Exit status 0; 1 on a CUDA error; 2 on a usage error.
 * Build: cc -O2 -I/usr/local/cuda/include scripts/bench_gpu.c \
 *            -L/usr/local/cuda/lib64/stubs -lcuda -o build/bench_gpu
 */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int check(CUresult r, const char *what)
{
	if (r == CUDA_SUCCESS)
		return 0;
	const char *name = "?", *text = "?";
	cuGetErrorName(r, &name);
	cuGetErrorString(r, &text);
	fprintf(stderr, "bench_gpu: %s: %s (%s)\n", what, name, text);
	return 1;
}

/* Microseconds per load of path, over n loads. Negative on an error. */
static double loads(const char *path, int n)
{
	double t0 = now_us();
	for (int i = 0; i < n; i++) {
		CUmodule m;
		if (check(cuModuleLoad(&m, path), path) || check(cuModuleUnload(m), "unload"))
			return -1;
	}
	return (now_us() - t0) / n;
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
	if (argc != 5)
		return fprintf(stderr, "usage: bench_gpu MOUNT_PATH BACKING_PATH LOADS REPS\n"), 2;
	int n = atoi(argv[3]), reps = atoi(argv[4]);
	CUdevice dev;
	CUcontext ctx;
	if (n <= 0 || reps <= 0 || reps > 100)
		return 2;
	if (check(cuInit(0), "cuInit") || check(cuDeviceGet(&dev, 0), "cuDeviceGet") ||
	    check(cuCtxCreate(&ctx, NULL, 0, dev), "cuCtxCreate"))
		return 1;
	double a[100], b[100];
	if (loads(argv[1], 5) < 0 || loads(argv[2], 5) < 0) /* warm both */
		return 1;
	for (int r = 0; r < reps; r++) {
		a[r] = loads(argv[1], n);
		b[r] = loads(argv[2], n);
		if (a[r] < 0 || b[r] < 0)
			return 1;
		printf("rep %d: mount %.1f us backing %.1f us per load\n", r, a[r], b[r]);
	}
	qsort(a, (size_t)reps, sizeof(double), cmp);
	qsort(b, (size_t)reps, sizeof(double), cmp);
	printf("median mount %.1f backing %.1f ratio %.3f (spread mount %.1f-%.1f, backing %.1f-%.1f)\n",
	       a[reps / 2], b[reps / 2], a[reps / 2] / b[reps / 2], a[0], a[reps - 1], b[0],
	       b[reps - 1]);
	cuCtxDestroy(ctx);
	return 0;
}
