/* compile.h - the nvcc compile driver: one compiler run as a child process.
 *
 * argv only, never a shell; the child runs in the sandbox (sandbox.h: a uid of its own,
 * its own namespaces, limits) in a private scratch directory, with a scrubbed environment,
 * its output captured to a log, and is killed (the whole group) when it exceeds the
 * timeout or the daemon shuts down. The include directories of its flags are checked as
 * its uid, so that an -I path tells nobody what only root may see.
 */
#ifndef KC_COMPILE_H
#define KC_COMPILE_H

#include <stdatomic.h>
#include <stddef.h>
#include <sys/types.h>

#include "flags.h"
#include "nvrtc_pool.h"

#define KC_COMPILE_CWD "/proc/self/cwd" /* the scratch directory as the compiler sees it */
#define KC_COMPILE_NICE 10 /* nice value compilers run at (the daemon's threads stay at 0) */
#define KC_COMPILE_AS_MIN (4ull << 30) /* bytes: least address space a compiler gets (it gets
					* half the node's memory when that is more) */
#define KC_COMPILE_FSIZE (4ull << 30)  /* bytes: largest file a compiler may write */
#define KC_COMPILE_NOFILE 1024         /* open files of each compiler process */
#define KC_COMPILE_SLOTS 256u          /* the most compiles at once (-o jobs=), and the uids
					* of a -o compile_uids= range: one per slot */

enum kc_compile_status {
	KC_COMPILE_OK,        /* a complete CUDA ELF was copied to out_fd */
	KC_COMPILE_REJECTED,  /* the compiler ran and reported errors: remember it */
	KC_COMPILE_TRANSIENT, /* killed, timed out, out of space, not runnable, bad output */
};

struct kc_compile_spec {
	const char *nvcc;          /* absolute path */
	const struct kc_argv *args; /* arguments after "<src> -cubin -o <out>" */
	const char *source;        /* bytes written to <scratch>/kernel.cu */
	size_t source_len;
	const char *scratch;       /* absolute path of an empty private directory */
	int scratch_fd;            /* fd on that directory */
	unsigned timeout_s;
	/* Who runs it (sandbox.h): uid and gid first_uid + n, where n < KC_COMPILE_SLOTS is a slot no other
	 * running compile holds; 0: as the daemon. It then reaches the scratch directory only
	 * as its working directory (its parents are closed to that uid): its paths are
	 * /proc/self/cwd/..., which its log shows as the scratch path again. */
	unsigned first_uid;
	int ns_flags;              /* CLONE_NEW* it runs in (kc_sandbox_namespaces) */
	int out_fd;                /* an empty file of the daemon's: the cubin is copied here
				    * (unused with deps_only) */
	int deps_only;             /* nvcc only: the dependency pass. The same compile again (the
				    * same source and flags, into a cubin of the scratch's own)
				    * under tracer (kcachefs-trace), which writes down every path
				    * the toolchain looked up, found or not; the outcome's deps is
				    * that trace (less the scratch's own paths). Off the compile's
				    * critical path */
	const char *tracer;        /* deps_only: absolute path of kcachefs-trace */
	struct kc_nvrtc_pool *pool; /* the mount's warm NVRTC workers (nvrtc_pool.h), or NULL.
				    * Set for every compile: one that kills its uid's processes at
				    * its end tells the table that the uid's idle workers are gone */
	int warm;                  /* with pool, not deps_only: nvcc is kcachefs-nvrtc; run the
				    * compile in a warm worker of this uid, compiler, generation
				    * and flags (a process per compile when none can start) */
	unsigned long compiler_gen; /* the compiler identity's generation (identity.h): part of
				    * a worker's key, so a replaced compiler gets new workers */
	int idle;                  /* a process per compile (not warm) in the idle scheduling
				    * class (SCHED_IDLE, sched(7)): a compile ahead, which only
				    * takes CPU time nothing else wants */
	atomic_int *group;         /* with idle, or NULL: the compiler's process group while it
				    * runs, else 0 (kc_compile_promote) */
	atomic_int *promote;       /* with idle, or NULL: set (by kc_compile_promote's caller) when
				    * a client waits for this compile: it then runs at
				    * KC_COMPILE_NICE in the normal class, from its start on */
};

struct kc_compile_outcome {
	enum kc_compile_status status;
	char *log;      /* the compiler's stdout+stderr, owned, NUL-terminated (it may also hold
			 * NULs a compiler echoed from the source: use log_len); at most 1 MiB:
			 * past that, the head and the last 64 KiB, at whole lines, with a note of
			 * what was left out between */
	size_t log_len;
	double seconds; /* wall time of the compiler run */
	int timed_out;  /* killed at timeout_s */
	char why[256];  /* one line: "exit status 1", "killed by signal 9", ... */
	char *deps;     /* deps_only and KC_COMPILE_OK: the trace ("<kind> <path>" lines,
			 * kcachefs-trace.c), less the lines of paths under the scratch,
			 * owned, NUL-terminated; NULL when there is none (deps_only: status is
			 * then not OK) */
	size_t deps_len;
};

/* Run the compiler. Always fills out (out->log may be NULL when nothing was printed) and
 * returns 0; -ENOMEM only when the outcome cannot be described. Free with
 * kc_compile_outcome_free. */
int kc_compile_run(const struct kc_compile_spec *spec, struct kc_compile_outcome *out);
void kc_compile_outcome_free(struct kc_compile_outcome *out);

/* The verdict on a compiler run that ended, from what kc_compile_run saw: wait_err (0, or
 * -ETIMEDOUT: killed at timeout_s), the wait status, and low_space (the scratch's
 * filesystem nearly full; only looked at for a nonzero exit). Pure: reads out->log, sets
 * out->status, out->why and out->timed_out. Timed out, killed by a signal, or an exit
 * without an "error" in the log, out of space or with a tool killed or out of memory are
 * KC_COMPILE_TRANSIENT; a nonzero exit that reported an error is KC_COMPILE_REJECTED.
 * Returns 0 with that verdict, or 1 for an exit 0 (out untouched: its output is to be
 * checked next). */
int kc_compile_classify(int wait_err, int status, unsigned timeout_s, int low_space,
			struct kc_compile_outcome *out);
/* The same verdict for a nonzero exit code (an NVRTC worker's reply carries one). */
void kc_compile_classify_exit(int code, int low_space, struct kc_compile_outcome *out);

/* Run "<compiler> --version" as a compile with args would run with first_uid uid and
 * ns_flags (its output discarded), to learn at the mount whether that uid can run it and
 * reach the include directories of args. Returns 0, or -errno with why filled: an include
 * directory it cannot reach (*bad_dir >= 0, why names it), the uid cannot start it
 * (-EACCES, -ENOENT...) or it failed (-EACCES). */
int kc_compile_probe(const char *compiler, const struct kc_argv *args, unsigned uid,
		     int ns_flags, int *bad_dir, char *why, size_t whylen);

/* Check that fd holds a complete CUDA ELF (magic, EM_CUDA, section and program header
 * tables inside the file). Returns 0 or -EINVAL with why filled. */
int kc_cubin_check(int fd, char *why, size_t whylen);
/* The same check of a cubin held in memory (data/len). */
int kc_cubin_check_buf(const void *data, size_t len, char *why, size_t whylen);

/* Whether cubin (len bytes) names a file of roots (the include directories of this node's
 * recipe, kc_tree_roots) by another path: a NUL-terminated string of printable bytes after a
 * NUL that starts with '/', has two '/' at least and a '.' in its last name, lies under no
 * root, and whose tail after one of its '/' names a file under a root here. A fetched cubin
 * that does names the compiling node's install of the same headers: __FILE__ expanded in
 * device code (an assert's message). Returns 1 with the first such string in path
 * (pathlen bytes, cut), 0 when none. Looks only under roots (the headers the compile of
 * this recipe reads here, no path of the cubin's), at 64 strings at most. */
int kc_cubin_foreign_path(const void *cubin, size_t len, const struct kc_argv *roots,
			  char *path, size_t pathlen);

/* 1 if thread tid belongs to the process group of a running compile (a compile that asks
 * the daemon's own mount for something, which must not wait on a compile), else 0. Reads
 * /proc/<tid>/stat. */
int kc_compile_owns(pid_t tid);

/* Kill every running compiler and make later kc_compile_run calls fail (transient) at
 * once: used at shutdown so that waiters get EIO instead of waiting. */
void kc_compile_shutdown(void);
/* The first step of a stop that lets the cluster's shares finish: as kc_compile_shutdown
 * for every compile but dependency passes (kc_compile_spec.deps_only), which run on and
 * may still start until kc_compile_shutdown. */
void kc_compile_stop_demand(void);

/* End this daemon's compiles with it, however it dies: its compilers' process groups move
 * to memory shared with a watcher (kc_sandbox_watch) that kills them, and every process of
 * the compile uids first_uid.. (0: compiles run as the daemon), when the daemon is gone;
 * the watcher holds lock_fd (the claim on those uids, or -1) till then. A watcher that is
 * killed while the daemon lives is replaced at once (a thread waits on it). Call once,
 * after daemonizing and before any compile. Returns 0, or -errno (not started: compiles
 * left by a daemon that dies are then killed only at the next start). */
int kc_compile_watch(unsigned first_uid, int lock_fd);

/* Move the process group group (a compile's, kc_compile_spec.group) from the idle class to
 * the normal one at KC_COMPILE_NICE, every member process (found in /proc); 0: nothing.
 * Processes it starts later inherit it. */
void kc_compile_promote(pid_t group);

#endif
