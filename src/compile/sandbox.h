/* sandbox.h - the process a compiler runs in: who it is, what it shares with the node.
 *
 * A compile is text that any user of the mount wrote, compiled by a daemon that runs as
 * root. kc_sandbox_spawn starts a program as a uid of its own (no supplementary groups, no
 * new privileges), in new network and IPC namespaces: it
 * reaches no network and no System V IPC or POSIX message queue of the node. Limits are set
 * before the program starts, so no tool it runs escapes them; kc_sandbox_kill_uids ends
 * every process of the uid afterwards, also one that left the process group. The idea of a sandbox made of a fresh uid and namespaces is the one of
 * bubblewrap and of systemd's DynamicUser=/PrivateNetwork=; nothing of theirs is used.
 *
 * Called from a multithreaded daemon: between clone and exec the child makes only
 * async-signal-safe system calls on memory prepared before the clone.
 */
#ifndef KC_SANDBOX_H
#define KC_SANDBOX_H

#include <stddef.h>
#include <sys/resource.h>
#include <sys/types.h>

#define KC_SANDBOX_AS_DAEMON ((uid_t)-1) /* uid of a spawn that keeps the daemon's identity */

struct kc_spawn {
	const char *path;    /* absolute path of the program */
	char *const *argv;   /* NULL-terminated */
	char *const *envp;   /* NULL-terminated: the whole environment, nothing inherited */
	int cwd_fd;          /* the working directory (a directory fd) */
	int out_fd;          /* stdout and stderr */
	int in_fd;           /* stdin when > 0 (a warm worker's socket), else /dev/null */
	uid_t uid;           /* run as uid, gid (KC_SANDBOX_AS_DAEMON: as the daemon); changing
			      * them needs a daemon run as root */
	gid_t gid;
	int ns_flags;        /* CLONE_NEW* to start it in (kc_sandbox_namespaces gives them) */
	int nice;            /* nice value */
	int idle;            /* run in the idle scheduling class (SCHED_IDLE) */
	struct rlimit as, fsize, cpu, nofile; /* RLIMIT_AS, _FSIZE, _CPU, _NOFILE; no cores */
	const char *const *dirs; /* NULL-terminated (or NULL): paths that must be directories
				  * the program can reach and search, checked as uid before it
				  * starts */
	unsigned start_timeout_s; /* the checks and the exec may take this long (a directory
				   * on a server that does not answer): then the child is killed */
	void (*started)(pid_t pid, void *arg); /* called with the child's pid right after the
						* clone, before the checks (or NULL) */
	void *arg;
};

/* Start sp->path. Returns the child's pid (the leader of its own process group: kill the
 * group, then reap it), or -errno with why filled: the clone failed (-EAGAIN, -ENOMEM,
 * -EPERM), the checks and exec took longer than start_timeout_s (-ETIMEDOUT), a directory of sp->dirs cannot be reached as sp->uid (its errno: -ENOENT,
 * -EACCES, -ENOTDIR; *bad_dir gets its index, why names it; else *bad_dir is -1), the
 * identity or the limits could not be set (-EPERM), or the exec failed (-ENOENT, -EACCES,
 * -ENOEXEC). On any error nothing is left running and the child is reaped. */
pid_t kc_sandbox_spawn(const struct kc_spawn *sp, int *bad_dir, char *why, size_t whylen);

/* The CLONE_NEW* flags (network, IPC) this daemon may give its compiles: both when the
 * kernel allows them (root, no seccomp or container policy against them), else 0
 * with why filled. Tries once, with a child that exits at once. */
int kc_sandbox_namespaces(char *why, size_t whylen);

#define KC_SANDBOX_RUN_DIR "/run/kcachefs" /* where daemons claim their ranges of uids */

/* Claim the uids first to first + count - 1 for this daemon, against other daemons on the
 * node: an OFD write lock on bytes first.. of KC_SANDBOX_RUN_DIR/compile-uids (the kernel
 * sees overlapping ranges), held while the returned fd is open (a daemon that dies lets it
 * go). Returns the fd, -EBUSY when another daemon holds a uid of the range, -EPERM when
 * KC_SANDBOX_RUN_DIR is not a directory of root's that only root may write, or -errno (not
 * root). */
int kc_sandbox_claim_uids(uid_t first, unsigned count);

/* 1 if id is a user's uid or a group's gid (NSS: files, LDAP...), with who naming it, else
 * 0. Thread-safe. */
int kc_sandbox_id_taken(unsigned id, char *who, size_t len);

/* SIGKILL every process of the uids first to first + count - 1 (a compile's, where no
 * process of anybody else runs): from a child that takes each uid and signals -1. Nothing
 * for KC_SANDBOX_AS_DAEMON or 0. Waits for the child, not for the processes to be gone. */
void kc_sandbox_kill_uids(uid_t first, unsigned count);

/* End the compiles with the daemon, however it dies (SIGKILL, the OOM killer): start a
 * watcher, a process of the daemon's uid that is no child of it, holds nothing of it but
 * keep_fd (or -1: the claim on the uids, kc_sandbox_claim_uids, so that no other daemon
 * compiles as them until the watcher is done), and waits for the daemon's exit (in ps:
 * "kcachefs-watch of pid <daemon>", never the daemon's arguments). Then it
 * SIGKILLs each process group (and process) of groups[0] to groups[ngroups - 1] that is >
 * 0, and every process of the uids first to first + count - 1 (none for first 0 or
 * KC_SANDBOX_AS_DAEMON), and exits. groups: memory shared with the watcher (MAP_SHARED),
 * where the daemon keeps its compilers' groups. A daemon's clean exit leaves nothing to
 * kill. Call after any fork that daemonizes, from a process without compiles yet.
 * Returns 0, or -errno (-EAGAIN, -ENOMEM: it could not be started); watcher_fd (may be
 * NULL) gets a pidfd of the watcher (the caller closes it; -1 where none could be had),
 * readable once the watcher is gone (killed: the caller starts another). Each compiler also
 * dies with the thread that started it (PR_SET_PDEATHSIG), as a daemon may die before it
 * records that compiler's group. Why not PR_SET_PDEATHSIG alone: it reaches the
 * compiler (nvcc) only, not the cicc, ptxas or gcc it started, nor a process that left
 * its group; why not PR_SET_CHILD_SUBREAPER: the daemon would adopt the tools, but they
 * outlive it all the same; and why not a pid namespace: the compiler would be its init,
 * which ignores the signals (its own SIGKILL too) that end a failing compiler. */
int kc_sandbox_watch(uid_t first, unsigned count, const volatile pid_t *groups,
		     unsigned ngroups, int keep_fd, int *watcher_fd);

/* How many processes whose uid is first to first + count - 1 run (not zombies): a scan of
 * /proc. */
unsigned kc_sandbox_count_uids(uid_t first, unsigned count);

#endif
