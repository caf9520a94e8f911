/* bench_io.c - the timed loops of scripts/bench.py, in C so that the interpreter's own cost
 * does not dilute the ratios it reports.
 *
 * usage: bench_io MODE PATH ITERATIONS
 *   read     open + fstat + read everything + close of the file PATH
 *   stat     stat of PATH
 *   readdir  opendir + readdir to the end + closedir of PATH
 *   statlat  stat of PATH, one operation at a time, with a pause of 1 ms between them
 * Prints one line: "<mode> <iterations> <nanoseconds per operation> <bytes or names per op>";
 * statlat prints "statlat <iterations> <median ns> <p99 ns> <max ns>" instead.
 * Exit status 0; 1 when an operation fails (with the errno), 2 on a usage error.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int fail(const char *what, const char *path)
{
	fprintf(stderr, "bench_io: %s %s: %s\n", what, path, strerror(errno));
	return 1;
}

int main(int argc, char **argv)
{
	if (argc != 4)
		goto usage;
	const char *mode = argv[1], *path = argv[2];
	long n = atol(argv[3]);
	long long bytes = 0;
	static char buf[1 << 20];
	if (n <= 0)
		goto usage;

	if (strcmp(mode, "statlat") == 0) {
		double *lat = calloc((size_t)n, sizeof(*lat));
		struct stat st;
		if (!lat)
			return 1;
		for (long i = 0; i < n; i++) {
			double t = now_ns();
			if (stat(path, &st) != 0)
				return fail("stat", path);
			lat[i] = now_ns() - t;
			usleep(1000);
		}
		qsort(lat, (size_t)n, sizeof(*lat), cmp_double);
		printf("statlat %ld %.1f %.1f %.1f\n", n, lat[n / 2], lat[(n * 99) / 100], lat[n - 1]);
		free(lat);
		return 0;
	}

	double t0 = now_ns();
	for (long i = 0; i < n; i++) {
		if (strcmp(mode, "read") == 0) {
			struct stat st;
			int fd = open(path, O_RDONLY | O_CLOEXEC);
			if (fd < 0 || fstat(fd, &st) != 0)
				return fail("open/fstat", path);
			long long got = 0;
			for (;;) {
				ssize_t r = read(fd, buf, sizeof(buf));
				if (r < 0)
					return fail("read", path);
				if (r == 0)
					break;
				got += r;
			}
			close(fd);
			if (got != st.st_size) {
				fprintf(stderr, "bench_io: %s: read %lld of %lld bytes\n", path, got,
					(long long)st.st_size);
				return 1;
			}
			bytes = got;
		} else if (strcmp(mode, "stat") == 0) {
			struct stat st;
			if (stat(path, &st) != 0)
				return fail("stat", path);
		} else if (strcmp(mode, "readdir") == 0) {
			DIR *d = opendir(path);
			long long names = 0;
			if (!d)
				return fail("opendir", path);
			while (readdir(d))
				names++;
			closedir(d);
			bytes = names;
		} else {
			goto usage;
		}
	}
	double per = (now_ns() - t0) / (double)n;
	printf("%s %ld %.1f %lld\n", mode, n, per, bytes);
	return 0;
usage:
	fprintf(stderr, "usage: bench_io read|stat|readdir PATH ITERATIONS\n");
	return 2;
}
