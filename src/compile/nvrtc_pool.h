/* nvrtc_pool.h - the daemon's warm NVRTC workers: kcachefs-nvrtc --serve processes that
 * keep one NVRTC, and with it their automatic PCH, from one compile to the next (an NVRTC
 * precompiled header is reusable only inside the process that made it).
 *
 * One worker per key: the compile uid, the compiler identity's generation, the compiler
 * and every flag (so the architecture, the options and the include directories): a worker
 * is never shared by two uids, so never by two users' compiles' sandboxes, and serves one
 * compile at a time (taken busy, put back idle). compile.c starts workers in the sandbox
 * of a compile (sandbox.h: the same uid, namespaces, limits, scrubbed environment), each
 * in a private scratch directory of its own that outlives one compile, and talks to them
 * (nvrtc_wire.h); this table only keeps them: at most max workers (the least recently used
 * idle one is stopped to make room) and none idle longer than idle_s (a thread of the
 * table stops them). A stopped worker is killed (SIGKILL, its process group), reaped, and
 * its scratch directory removed.
 *
 * Owns: its workers (processes, sockets, scratch directories). Thread-safe.
 */
#ifndef KC_NVRTC_POOL_H
#define KC_NVRTC_POOL_H

#include <sys/types.h>

#include "store.h"

#define KC_NVRTC_IDLE_DEFAULT 60 /* seconds a worker may stay idle (-o nvrtc_idle=) */
#define KC_NVRTC_WORKER_CPU 600  /* CPU seconds a worker may use beyond one compile's
				  * timeout: its RLIMIT_CPU is compile_timeout + this, and it is
				  * retired once it used this much, so that each compile still has
				  * at least compile_timeout seconds */

struct kc_nvrtc_pool;

struct kc_nvrtc_worker {
	pid_t pid;          /* leader of its own process group; 0 until started */
	int sock;           /* the daemon's end of its socket (-1 until started) */
	int log_fd;         /* its stdout and stderr: worker.log of its scratch, O_APPEND */
	uid_t uid;          /* its compile uid (KC_SANDBOX_AS_DAEMON: the daemon's) */
	char *key;          /* owned */
	char scratch[4200]; /* its directory's path */
	int scratch_fd;     /* and an fd on it */
	unsigned long served; /* compiles it answered */
	/* the table's: */
	int busy;
	double idle_since;  /* monotonic seconds */
	struct kc_nvrtc_worker *next;
};

/* A table of at most max (>= 1) workers, stopped after idle_s (>= 1) seconds idle, whose
 * scratch directories store makes (borrowed, outlives the table). Returns NULL with errno
 * set (ENOMEM). */
struct kc_nvrtc_pool *kc_nvrtc_pool_create(struct kc_store *store, unsigned max,
					   unsigned idle_s);

/* Stop every worker (busy ones too: their compiles see the socket close) and free. */
void kc_nvrtc_pool_destroy(struct kc_nvrtc_pool *p);

/* The idle worker of key, taken busy for one compile, or NULL when there is none. A worker
 * found dead (killed while idle) is stopped and not returned. */
struct kc_nvrtc_worker *kc_nvrtc_pool_take(struct kc_nvrtc_pool *p, const char *key);

/* A new worker record for key and uid, taken busy, with its scratch directory made and
 * given to uid; the caller starts the process (fills pid, sock, log_fd). Makes room by
 * stopping the least recently used idle worker. Returns NULL with why filled: every one of
 * the max workers is busy, or the scratch directory cannot be made. */
struct kc_nvrtc_worker *kc_nvrtc_pool_new(struct kc_nvrtc_pool *p, const char *key, uid_t uid,
					  char *why, size_t whylen);

/* The compile is done with w: keep it idle for the next one (keep), or stop it. */
void kc_nvrtc_pool_put(struct kc_nvrtc_pool *p, struct kc_nvrtc_worker *w, int keep);

/* Every process of uid was killed (kc_sandbox_kill_uids, at the end of a compile that held
 * uid's slot): reap and forget its workers, which were idle. */
void kc_nvrtc_pool_forget_uid(struct kc_nvrtc_pool *p, uid_t uid);

/* Workers alive now, and those started since the table was made. */
void kc_nvrtc_pool_counts(struct kc_nvrtc_pool *p, unsigned *alive, unsigned long *started);

#endif
