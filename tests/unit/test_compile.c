/* test_compile.c - the nvcc driver (kc_compile_run) and the cubin check, with the real nvcc
 * and with fake compilers from tests/fakes. */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "compile.h"
#include "flags.h"
#include "store.h"
#include "remote_manifest.h"
#include "tap.h"

#define NVCC "/usr/local/cuda/bin/nvcc"

static char base[64];    /* mkdtemp: everything this test writes */
static char kernels[4096], fakes[4096];

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Read a whole file; returns a malloc'ed buffer (NUL-terminated) or NULL. */
static char *slurp(const char *path, size_t *len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	struct stat st;
	char *buf = NULL;

	if (fd < 0)
		return NULL;
	if (fstat(fd, &st) == 0 && (buf = malloc((size_t)st.st_size + 1))) {
		ssize_t n = read(fd, buf, (size_t)st.st_size);
		if (n != st.st_size) {
			free(buf);
			buf = NULL;
		} else {
			buf[n] = '\0';
			*len = (size_t)n;
		}
	}
	close(fd);
	return buf;
}

static int spit(const char *path, const void *buf, size_t len)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return -errno;
	ssize_t n = write(fd, buf, len);
	close(fd);
	return n == (ssize_t)len ? 0 : -EIO;
}

struct run {
	char scratch[256];
	int scratch_fd;
	int out_fd; /* the cubin's copy */
	struct kc_compile_outcome out;
	int ret;
	double wall;
};

static int deps_only; /* run_compile runs the dependency pass alone */
static int no_tracer; /* ... with no kcachefs-trace */

/* Run compiler on the sample kernel `kernel` (a file in tests/kernels, or source text when
 * it starts with '#') with args, in a fresh scratch directory under base. */
static void run_compile(struct run *r, const char *compiler, const char *kernel,
			const struct kc_argv *args, unsigned timeout_s)
{
	char path[4200];
	size_t srclen = 0;
	struct kc_argv none = {0};

	memset(r, 0, sizeof(*r));
	r->scratch_fd = r->out_fd = -1;
	snprintf(r->scratch, sizeof(r->scratch), "%s/run.XXXXXX", base);
	if (!mkdtemp(r->scratch)) {
		r->ret = -errno;
		return;
	}
	r->scratch_fd = open(r->scratch, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	snprintf(path, sizeof(path), "%s.out", r->scratch);
	r->out_fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	unlink(path);
	snprintf(path, sizeof(path), "%s/%s", kernels, kernel);
	char *src = kernel[0] == '#' ? strdup(kernel) : slurp(path, &srclen);
	if (src && kernel[0] == '#')
		srclen = strlen(src);
	if (!src)
		src = strdup("extern \"C\" __global__ void k(void) {}\n"), srclen = strlen(src);

	struct kc_compile_spec spec = {
		.nvcc = compiler,
		.args = args ? args : &none,
		.source = src,
		.source_len = srclen,
		.scratch = r->scratch,
		.scratch_fd = r->scratch_fd,
		.timeout_s = timeout_s,
		.out_fd = r->out_fd,
		.deps_only = deps_only,
		.tracer = no_tracer ? NULL : getenv("KC_TEST_TRACER"),
	};
	double t0 = now_s();
	r->ret = kc_compile_run(&spec, &r->out);
	r->wall = now_s() - t0;
	free(src);
}

static void run_done(struct run *r)
{
	kc_compile_outcome_free(&r->out);
	if (r->scratch_fd >= 0)
		close(r->scratch_fd);
	if (r->out_fd >= 0)
		close(r->out_fd);
	kc_store_remove_tree(r->scratch);
}

static int why_has(const struct run *r, const char *word)
{
	return strstr(r->out.why, word) != NULL;
}

static int log_has(const struct run *r, const char *word)
{
	return r->out.log && strstr(r->out.log, word) != NULL;
}

static void show(const struct run *r)
{
	printf("# status %d, why: %s (%.2f s)\n", r->out.status, r->out.why, r->wall);
}

/* Fake compiler path. */
static const char *fake(const char *name)
{
	static char buf[4200];
	snprintf(buf, sizeof(buf), "%s/%s", fakes, name);
	return buf;
}

static int cubin_check_path(const char *path, char *why, size_t whylen)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	int err = kc_cubin_check(fd, why, whylen);
	close(fd);
	return err;
}

/* Count live (not zombie) processes whose process group is pgid or whose pid is pid. */
static int live_in_group(pid_t pgid, pid_t pid)
{
	DIR *d = opendir("/proc");
	struct dirent *e;
	int n = 0;

	if (!d)
		return -1;
	while ((e = readdir(d))) {
		if (!isdigit((unsigned char)e->d_name[0]))
			continue;
		char path[300], buf[1024];
		snprintf(path, sizeof(path), "/proc/%s/stat", e->d_name);
		int fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			continue;
		ssize_t len = read(fd, buf, sizeof(buf) - 1);
		close(fd);
		if (len <= 0)
			continue;
		buf[len] = '\0';
		char *rp = strrchr(buf, ')');
		char state;
		int ppid, pgrp;
		if (!rp || sscanf(rp + 1, " %c %d %d", &state, &ppid, &pgrp) != 3)
			continue;
		if (state != 'Z' && state != 'X' && (pgrp == pgid || atoi(e->d_name) == pid))
			n++;
	}
	closedir(d);
	return n;
}

static void test_nvcc(const char *cubin_copy)
{
	struct run r;
	struct kc_argv args = {0};
	char why[256], path[4200];
	size_t flen = 0;

	snprintf(path, sizeof(path), "%s/vector_add.flags", kernels);
	char *flags = slurp(path, &flen);
	CHECK(flags && kc_flags_parse(flags, flen, &args, why, sizeof(why)) == 0,
	      "vector_add.flags parses");
	free(flags);

	run_compile(&r, NVCC, "vector_add.cu", &args, 120);
	CHECK(r.ret == 0, "nvcc vector_add: kc_compile_run returns 0");
	CHECK(r.out.status == KC_COMPILE_OK, "nvcc vector_add: KC_COMPILE_OK");
	if (r.out.status != KC_COMPILE_OK) {
		show(&r);
		if (r.out.log)
			printf("# log: %.500s\n", r.out.log);
	}
	snprintf(path, sizeof(path), "%s/kernel.cubin", r.scratch);
	struct stat st;
	CHECK(stat(path, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0,
	      "nvcc vector_add: scratch/kernel.cubin exists");
	snprintf(path, sizeof(path), "%s/kernel.cu", r.scratch);
	CHECK(stat(path, &st) == 0, "nvcc vector_add: source written to scratch/kernel.cu");
	int fd = openat(r.scratch_fd, "kernel.cubin", O_RDONLY);
	why[0] = '\0';
	CHECK(fd >= 0 && kc_cubin_check(fd, why, sizeof(why)) == 0,
	      "nvcc vector_add: kc_cubin_check accepts the cubin");
	if (fd >= 0) {
		/* keep a copy for the fakes and the cubin checks */
		char buf[1 << 16];
		ssize_t n;
		int out = open(cubin_copy, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
		while (out >= 0 && (n = read(fd, buf, sizeof(buf))) > 0)
			if (write(out, buf, (size_t)n) != n)
				break;
		if (out >= 0)
			close(out);
		close(fd);
	}
	CHECK(r.out.seconds > 0 && r.out.seconds < 120, "nvcc vector_add: seconds measured");
	CHECK(r.out.deps == NULL, "nvcc vector_add: no dependency file unless asked for");
	run_done(&r);
	kc_argv_free(&args);

	/* the trace of a compile that includes a header of an -I tree, and the manifest from
	 * it: what it found, what it looked for and did not find, the toolchain it ran */
	struct kc_argv inc = {0};
	char *m = NULL, idir[4200];
	size_t ml = 0;
	snprintf(idir, sizeof(idir), "-I%s/include", kernels);
	kc_argv_push(&inc, idir);
	deps_only = 1;
	run_compile(&r, NVCC, "#include <kc_test/scale.cuh>\n#include <cuda_fp16.h>\n"
		    "#if __has_include(<kc_test/no_such_header.h>)\n#error\n#endif\n"
		    "extern \"C\" __global__ void k(float *x) { x[0] = 1; }\n", &inc, 120);
	deps_only = 0;
	CHECK(r.out.status == KC_COMPILE_OK && r.out.deps &&
		      strstr(r.out.deps, "/kc_test/scale.cuh\n") &&
		      strstr(r.out.deps, "/kc_test/no_such_header.h\n") &&
		      strstr(r.out.deps, "/cicc\n") && strstr(r.out.deps, "/ptxas\n") &&
		      strstr(r.out.deps, "/nvcc.profile\n") && !strstr(r.out.deps, r.scratch),
	      "the traced pass: the -I header, a __has_include probe, cicc, ptxas and "
	      "nvcc.profile, nothing of its scratch");
	if (r.out.status != KC_COMPILE_OK)
		show(&r);
	struct stat dst;
	CHECK(fstat(r.out_fd, &dst) == 0 && dst.st_size == 0 &&
		      faccessat(r.scratch_fd, "kernel.cubin", F_OK, 0) != 0,
	      "the dependency pass publishes no cubin");
	CHECK(r.out.deps &&
		      kc_manifest_from_trace(r.out.deps, r.out.deps_len, KC_COMPILE_CWD, NULL, 0, NULL, &m,
					     &ml, why, sizeof(why)) == 0 &&
		      memmem(m, ml, "/kc_test/scale.cuh\n", 19) &&
		      memmem(m, ml, KC_MANIFEST_ABSENT, 64) && memmem(m, ml, "cuda_fp16.h\n", 12) &&
		      !memmem(m, ml, "kernel.cu\n", 10),
	      "its manifest: the -I header, the toolkit's, a lookup that found nothing, not "
	      "the source");
	free(m);
	run_done(&r);
	deps_only = no_tracer = 1;
	run_compile(&r, NVCC, "extern \"C\" __global__ void k(void) {}\n", NULL, 120);
	deps_only = no_tracer = 0;
	CHECK(r.out.status != KC_COMPILE_OK && !r.out.deps && why_has(&r, "kcachefs-trace"),
	      "a dependency pass with no tracer fails and says why");
	run_done(&r);
	kc_argv_free(&inc);

	kc_argv_push(&args, "-O3");
	run_compile(&r, NVCC, "broken.cu", &args, 120);
	CHECK(r.ret == 0 && r.out.status == KC_COMPILE_REJECTED, "nvcc broken: KC_COMPILE_REJECTED");
	if (r.out.status != KC_COMPILE_REJECTED)
		show(&r);
	CHECK(log_has(&r, "error"), "nvcc broken: log mentions error");
	CHECK(log_has(&r, "undefined_symbol_kcachefs_test"), "nvcc broken: log names the culprit");
	CHECK(r.out.log && r.out.log_len == strlen(r.out.log), "nvcc broken: log_len is the length");
	CHECK(why_has(&r, "status"), "nvcc broken: why gives the exit status");
	CHECK(faccessat(r.scratch_fd, "kernel.cubin", F_OK, 0) != 0,
	      "nvcc broken: no cubin in scratch");
	run_done(&r);
	kc_argv_free(&args);
}

static void test_fakes(const char *cubin_copy)
{
	struct run r;
	struct kc_argv args = {0};

	/* a compiler that hangs: killed at the timeout, with its helpers */
	run_compile(&r, fake("fake_sleep.sh"), "vector_add.cu", NULL, 1);
	CHECK(r.ret == 0 && r.out.status == KC_COMPILE_TRANSIENT, "timeout: KC_COMPILE_TRANSIENT");
	CHECK(why_has(&r, "timed out"), "timeout: why says timed out");
	if (!why_has(&r, "timed out"))
		show(&r);
	CHECK(r.wall < 5.0, "timeout: returned within a few seconds");
	char pidbuf[64] = "";
	int pfd = openat(r.scratch_fd, "compiler.pid", O_RDONLY);
	ssize_t n = pfd >= 0 ? read(pfd, pidbuf, sizeof(pidbuf) - 1) : -1;
	if (pfd >= 0)
		close(pfd);
	int shell = 0, helper = 0;
	CHECK(n > 0 && sscanf(pidbuf, "%d %d", &shell, &helper) == 2 && shell > 1 && helper > 1,
	      "timeout: the fake recorded its pids");
	if (shell > 1) {
		int live = -1;
		/* killed processes may take a moment to disappear from /proc */
		for (int i = 0; i < 300 && live != 0; i++) {
			live = live_in_group(shell, helper);
			if (live)
				usleep(10000);
		}
		CHECK(live == 0, "timeout: no process of the fake's group remains");
		if (live > 0) { /* do not leave them behind */
			kill(-shell, SIGKILL);
			kill(helper, SIGKILL);
		}
	}
	run_done(&r);

	run_compile(&r, fake("fake_signal.sh"), "vector_add.cu", NULL, 30);
	CHECK(r.ret == 0 && r.out.status == KC_COMPILE_TRANSIENT, "SIGKILL: KC_COMPILE_TRANSIENT");
	CHECK(why_has(&r, "signal"), "SIGKILL: why mentions the signal");
	CHECK(why_has(&r, "9"), "SIGKILL: why gives the signal number");
	CHECK(log_has(&r, "about to be killed"), "SIGKILL: output captured in the log");
	run_done(&r);

	run_compile(&r, fake("fake_tool_killed.sh"), "vector_add.cu", NULL, 30);
	CHECK(r.ret == 0 && r.out.status == KC_COMPILE_TRANSIENT,
	      "a tool killed (cc1plus, 'Killed signal terminated program'): KC_COMPILE_TRANSIENT");
	CHECK(why_has(&r, "killed or ran out of memory"), "tool killed: why says so");
	run_done(&r);

	run_compile(&r, fake("fake_empty.sh"), "vector_add.cu", NULL, 30);
	CHECK(r.ret == 0 && r.out.status == KC_COMPILE_TRANSIENT, "empty cubin: KC_COMPILE_TRANSIENT");
	CHECK(why_has(&r, "empty"), "empty cubin: why says empty");
	CHECK(r.out.log == NULL || r.out.log_len == 0, "empty cubin: nothing logged");
	run_done(&r);

	run_compile(&r, fake("fake_nooutput.sh"), "vector_add.cu", NULL, 30);
	CHECK(r.ret == 0 && r.out.status == KC_COMPILE_TRANSIENT, "no cubin: KC_COMPILE_TRANSIENT");
	CHECK(why_has(&r, "no cubin"), "no cubin: why says so");
	run_done(&r);

	if (cubin_copy) {
		kc_argv_push(&args, cubin_copy);
		run_compile(&r, fake("fake_truncated.sh"), "vector_add.cu", &args, 30);
		CHECK(r.ret == 0 && r.out.status == KC_COMPILE_TRANSIENT,
		      "half a cubin: KC_COMPILE_TRANSIENT");
		CHECK(why_has(&r, "truncated"), "half a cubin: why says truncated");
		if (!why_has(&r, "truncated"))
			show(&r);
		struct stat a, b;
		char path[4200];
		snprintf(path, sizeof(path), "%s/kernel.cubin", r.scratch);
		CHECK(stat(path, &a) == 0 && stat(cubin_copy, &b) == 0 && a.st_size > 0 &&
			      a.st_size == b.st_size / 2,
		      "half a cubin: the fake wrote half of a real cubin");
		run_done(&r);
		kc_argv_free(&args);
	} else {
		CHECK(1, "half a cubin # SKIP no real cubin (nvcc absent)");
	}

	/* exit status 1: rejected; check argv and environment on the way */
	setenv("KC_TEST_SECRET", "leak", 1);
	kc_argv_push(&args, "-DFROM_ARGS=1");
	kc_argv_push(&args, "-O3");
	run_compile(&r, fake("fake_fail.sh"), "vector_add.cu", &args, 30);
	unsetenv("KC_TEST_SECRET");
	CHECK(r.ret == 0 && r.out.status == KC_COMPILE_REJECTED, "exit 1: KC_COMPILE_REJECTED");
	CHECK(why_has(&r, "status 1"), "exit 1: why gives the exit status");
	CHECK(log_has(&r, "fake-nvcc: error"), "exit 1: output captured in the log");
	char want[4400];
	snprintf(want, sizeof(want), "args: %s/kernel.cu -cubin -o %s/kernel.cubin -DFROM_ARGS=1 -O3",
		 r.scratch, r.scratch);
	CHECK(log_has(&r, want), "exit 1: argv is <src> -cubin -o <out> <args>");
	snprintf(want, sizeof(want), "env: TMPDIR=%s\n", r.scratch);
	CHECK(log_has(&r, want), "exit 1: TMPDIR is the scratch directory");
	CHECK(log_has(&r, "env: LC_ALL=C\n"), "exit 1: LC_ALL=C");
	CHECK(r.out.log && !strstr(r.out.log, "KC_TEST_SECRET"),
	      "exit 1: the daemon's environment is not passed on");
	snprintf(want, sizeof(want), "env: PATH=%s:", fakes);
	CHECK(log_has(&r, want), "exit 1: PATH starts with the compiler's directory");
	run_done(&r);
	kc_argv_free(&args);

	run_compile(&r, "/nonexistent/kcachefs/nvcc", "vector_add.cu", NULL, 30);
	CHECK(r.ret == 0 && r.out.status == KC_COMPILE_TRANSIENT,
	      "missing compiler: KC_COMPILE_TRANSIENT");
	CHECK(why_has(&r, "cannot run"), "missing compiler: why says cannot run");
	run_done(&r);

	run_compile(&r, fake("fake_limits.sh"), "vector_add.cu", NULL, 30);
	CHECK(log_has(&r, "limits: nofile 1024 cpu 90 core 0 fsize 8388608"),
	      "limits: 1024 files, CPU time the timeout plus 60 s, no core, 4 GiB files");
	run_done(&r);

	/* a non-empty scratch directory (kernel.cu already there) is not silently reused */
	run_compile(&r, fake("fake_nooutput.sh"), "vector_add.cu", NULL, 30);
	struct kc_compile_outcome again;
	struct kc_compile_spec spec = {
		.nvcc = fake("fake_fail.sh"), .args = &args, .source = "x", .source_len = 1,
		.scratch = r.scratch, .scratch_fd = r.scratch_fd, .timeout_s = 30,
	};
	CHECK(kc_compile_run(&spec, &again) == 0 && again.status == KC_COMPILE_TRANSIENT &&
		      strstr(again.why, "scratch") != NULL,
	      "scratch already holding kernel.cu: transient, why says scratch");
	kc_compile_outcome_free(&again);
	run_done(&r);
}

static void test_cubin_check(const char *cubin_copy)
{
	char path[4200], why[256];
	int err;

	snprintf(path, sizeof(path), "%s/garbage", base);
	spit(path, "this is not an ELF file at all, just some text that goes on for a while\n", 73);
	why[0] = '\0';
	err = cubin_check_path(path, why, sizeof(why));
	CHECK(err == -EINVAL && strstr(why, "ELF"), "cubin_check: garbage refused");
	spit(path, "\x7f" "EL", 3);
	CHECK(cubin_check_path(path, why, sizeof(why)) == -EINVAL, "cubin_check: 3 bytes refused");
	spit(path, "", 0);
	why[0] = '\0';
	CHECK(cubin_check_path(path, why, sizeof(why)) == -EINVAL && strstr(why, "empty"),
	      "cubin_check: empty file refused");
	unlink(path);

	/* a host ELF: right magic, wrong e_machine */
	why[0] = '\0';
	err = cubin_check_path("/proc/self/exe", why, sizeof(why));
	CHECK(err == -EINVAL && strstr(why, "EM_CUDA"), "cubin_check: x86-64 ELF refused");

	if (!cubin_copy) {
		CHECK(1, "cubin_check on a real cubin # SKIP nvcc absent");
		return;
	}
	why[0] = 'x';
	CHECK(cubin_check_path(cubin_copy, why, sizeof(why)) == 0, "cubin_check: real cubin accepted");

	size_t len = 0;
	char *cubin = slurp(cubin_copy, &len);
	CHECK(cubin && len > 64, "read the real cubin");
	if (!cubin)
		return;
	snprintf(path, sizeof(path), "%s/patched", base);

	/* wrong e_machine (x86-64 = 62) in an otherwise real cubin */
	char *p = malloc(len);
	memcpy(p, cubin, len);
	p[18] = 62;
	p[19] = 0;
	spit(path, p, len);
	why[0] = '\0';
	CHECK(cubin_check_path(path, why, sizeof(why)) == -EINVAL && strstr(why, "EM_CUDA"),
	      "cubin_check: real cubin with e_machine 62 refused");

	/* 32-bit class */
	memcpy(p, cubin, len);
	p[4] = 1; /* ELFCLASS32 */
	spit(path, p, len);
	CHECK(cubin_check_path(path, why, sizeof(why)) == -EINVAL,
	      "cubin_check: ELFCLASS32 refused");

	/* every truncation that cuts into a header table is refused */
	Elf64_Ehdr eh;
	memcpy(&eh, cubin, sizeof(eh));
	size_t sh_end = eh.e_shoff + (size_t)eh.e_shnum * eh.e_shentsize;
	size_t ph_end = eh.e_phoff + (size_t)eh.e_phnum * eh.e_phentsize;
	size_t tables_end = sh_end > ph_end ? sh_end : ph_end;
	CHECK(tables_end <= len && tables_end > len / 2,
	      "real cubin: header tables end in its second half");
	int ok = 1;
	size_t step = len / 32 ? len / 32 : 1;
	for (size_t cut = len / 2; cut < tables_end; cut += step) {
		spit(path, cubin, cut);
		why[0] = '\0';
		if (cubin_check_path(path, why, sizeof(why)) != -EINVAL || !strstr(why, "truncated"))
			ok = 0;
	}
	spit(path, cubin, tables_end - 1);
	why[0] = '\0';
	if (cubin_check_path(path, why, sizeof(why)) != -EINVAL || !strstr(why, "truncated"))
		ok = 0;
	CHECK(ok, "cubin_check: cubins cut into their header tables refused as truncated");
	unlink(path);
	free(p);
	free(cubin);
}

/* kc_compile_shutdown kills a running compiler and makes later runs fail at once. */
struct bg {
	struct run r;
};

static void *bg_run(void *arg)
{
	struct bg *b = arg;
	run_compile(&b->r, fake("fake_sleep.sh"), "vector_add.cu", NULL, 60);
	return NULL;
}

static void test_shutdown(void)
{
	pthread_t th;
	struct bg b;
	struct stat st;
	char path[512];
	int started = 0;

	memset(&b, 0, sizeof(b));
	pthread_create(&th, NULL, bg_run, &b);
	/* wait until the fake runs (its scratch directory name is known only to the thread,
	 * so look for any compiler.pid under base) */
	for (int i = 0; i < 500 && !started; i++) {
		DIR *d = opendir(base);
		struct dirent *e;
		while (d && (e = readdir(d))) {
			if (strncmp(e->d_name, "run.", 4) != 0)
				continue;
			snprintf(path, sizeof(path), "%s/%s/compiler.pid", base, e->d_name);
			if (stat(path, &st) == 0 && st.st_size > 0)
				started = 1;
		}
		if (d)
			closedir(d);
		if (!started)
			usleep(10000);
	}
	CHECK(started, "shutdown: the hanging fake started");
	double t0 = now_s();
	kc_compile_shutdown();
	pthread_join(th, NULL);
	CHECK(now_s() - t0 < 5.0, "shutdown: the running compile ended at once");
	CHECK(b.r.ret == 0 && b.r.out.status == KC_COMPILE_TRANSIENT,
	      "shutdown: the running compile is transient");
	CHECK(b.r.wall < 30, "shutdown: it did not run to its 60 s timeout");
	run_done(&b.r);

	struct run r;
	run_compile(&r, fake("fake_fail.sh"), "vector_add.cu", NULL, 30);
	CHECK(r.ret == 0 && r.out.status == KC_COMPILE_TRANSIENT && why_has(&r, "shutting down"),
	      "shutdown: later runs fail at once");
	CHECK(faccessat(r.scratch_fd, "compile.log", F_OK, 0) != 0,
	      "shutdown: the compiler was not started");
	run_done(&r);
}

/* The verdict on a run (kc_compile_classify), given what the run saw: no compiler runs. */
static enum kc_compile_status verdict(int wait_err, int status, int low_space, const char *log,
				      struct kc_compile_outcome *out)
{
	memset(out, 0, sizeof(*out));
	out->status = KC_COMPILE_TRANSIENT;
	out->log = (char *)log;
	out->log_len = log ? strlen(log) : 0;
	if (kc_compile_classify(wait_err, status, 30, low_space, out))
		return KC_COMPILE_OK; /* exited 0: the output is checked next */
	return out->status;
}

static void test_classify(void)
{
	struct kc_compile_outcome o;
	const char *err_log = "kernel.cu(3): error: identifier \"x\" is undefined\n";

	CHECK(verdict(-ETIMEDOUT, 0, 0, err_log, &o) == KC_COMPILE_TRANSIENT && o.timed_out &&
		      strstr(o.why, "timed out after 30 s"), "classify: a timeout is transient");
	CHECK(verdict(0, W_EXITCODE(0, SIGKILL), 0, err_log, &o) == KC_COMPILE_TRANSIENT &&
		      !o.timed_out && strstr(o.why, "killed by signal 9"),
	      "classify: killed by a signal is transient, whatever the log says");
	CHECK(verdict(0, W_EXITCODE(1, 0), 0, err_log, &o) == KC_COMPILE_REJECTED &&
		      strcmp(o.why, "compiler exited with status 1") == 0,
	      "classify: exit 1 with an error reported: rejected");
	CHECK(verdict(0, W_EXITCODE(1, 0), 0, "warning: nothing\n", &o) == KC_COMPILE_TRANSIENT &&
		      strstr(o.why, "without reporting an error"),
	      "classify: exit 1 without an error in the log: transient");
	CHECK(verdict(0, W_EXITCODE(1, 0), 0, NULL, &o) == KC_COMPILE_TRANSIENT,
	      "classify: exit 1 with no log at all: transient");
	CHECK(verdict(0, W_EXITCODE(1, 0), 1, err_log, &o) == KC_COMPILE_TRANSIENT &&
		      strstr(o.why, "out of disk space"),
	      "classify: an error on a nearly full disk: transient");
	CHECK(verdict(0, W_EXITCODE(2, 0), 0, "error: write failed: No space left on device\n",
		      &o) == KC_COMPILE_TRANSIENT && strstr(o.why, "out of disk space"),
	      "classify: an error saying the disk is full: transient");
	CHECK(verdict(0, W_EXITCODE(1, 0), 0,
		      "gcc: fatal error: Killed signal terminated program cc1plus\n", &o) ==
			      KC_COMPILE_TRANSIENT && strstr(o.why, "was killed"),
	      "classify: a tool killed (OOM) is transient though it says error");
	CHECK(verdict(0, W_EXITCODE(1, 0), 0, "error: std::bad_alloc\n", &o) ==
		      KC_COMPILE_TRANSIENT, "classify: out of memory is transient");
	CHECK(verdict(0, W_EXITCODE(0, 0), 0, err_log, &o) == KC_COMPILE_OK && o.why[0] == 0,
	      "classify: exit 0 is no verdict yet (the output is checked next)");
}

/* A fetched cubin's strings that name this node's include root's files by another path
 * (__FILE__ of the compiling node's headers), and those that do not. */
static void test_foreign_paths(void)
{
	char root[4300], path[512];
	snprintf(root, sizeof(root), "%s/include", kernels);
	struct kc_argv roots = {0}, none = {0};
	kc_argv_push(&roots, root);
	static const char own_source[] = "\0assertion failed: %s:%d\n\0/proc/self/cwd/kernel.cu\0";
	char buf[8192];
	size_t n = sizeof(own_source);
	memcpy(buf, own_source, n);
	CHECK(kc_cubin_foreign_path(buf, n, &roots, path, sizeof(path)) == 0,
	      "foreign paths: kernel.cu's own __FILE__ is no other node's path");
	n += (size_t)snprintf(buf + n, sizeof(buf) - n, "%s/kc_test/scale.cuh", root) + 1;
	CHECK(kc_cubin_foreign_path(buf, n, &roots, path, sizeof(path)) == 0,
	      "foreign paths: a header at this node's own root is this node's path");
	n += (size_t)snprintf(buf + n, sizeof(buf) - n, "/venv-a/site/include/kc_test/scale.cuh") + 1;
	CHECK(kc_cubin_foreign_path(buf, n, &roots, path, sizeof(path)) == 1 &&
		      strcmp(path, "/venv-a/site/include/kc_test/scale.cuh") == 0,
	      "foreign paths: the same header at another root is named");
	CHECK(kc_cubin_foreign_path(buf, n, &none, path, sizeof(path)) == 0,
	      "foreign paths: a recipe with no include root looks at nothing");
	kc_argv_free(&roots);
}

int main(void)
{
	const char *k = getenv("KC_TEST_KERNELS"), *f = getenv("KC_TEST_FAKES");
	char cubin_copy[256];

	/* absolute paths: the compiler runs in its scratch directory */
	if (!realpath(k ? k : "tests/kernels", kernels) || !realpath(f ? f : "tests/fakes", fakes)) {
		perror("KC_TEST_KERNELS / KC_TEST_FAKES");
		return 1;
	}
	strcpy(base, "/tmp/kc-test-compile.XXXXXX");
	if (!mkdtemp(base)) {
		perror("mkdtemp");
		return 1;
	}
	snprintf(cubin_copy, sizeof(cubin_copy), "%s/vector_add.cubin", base);
	test_classify();

	int have_nvcc = access(NVCC, X_OK) == 0;
	if (have_nvcc) {
		test_nvcc(cubin_copy);
	} else {
		CHECK(1, "compiles with the real nvcc # SKIP " NVCC " not found");
	}
	int have_cubin = have_nvcc && access(cubin_copy, R_OK) == 0;
	test_foreign_paths();
	test_fakes(have_cubin ? cubin_copy : NULL);
	test_cubin_check(have_cubin ? cubin_copy : NULL);
	test_shutdown(); /* last: the driver refuses to run compilers after it */

	CHECK(kc_store_remove_tree(base) == 0 && access(base, F_OK) != 0,
	      "scratch directories removed");
	return tap_done();
}
