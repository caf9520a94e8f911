/* holder.h - the holder: a small process that keeps a mount's /dev/fuse descriptor, so
 * that a daemon that dies costs the requests it had read, not the mount (-o holder).
 *
 * The daemon forks it at start, once mounted: the holder keeps the descriptor that mounted
 * (the connection's first device) and the mount's FUSE_INIT (request and reply, in a memfd
 * the daemon fills when it answers it); the daemon reads and answers through a clone of
 * the descriptor of its own (FUSE_DEV_IOC_CLONE). When a daemon dies, the kernel ends the
 * requests it had read with an error (ECONNABORTED: fs/fuse/dev.c's fuse_dev_release
 * ends those of the closed device), and keeps the connection, queued requests included,
 * while another device of it is open: the holder's. The holder then starts the daemon
 * again (the binary and command line of the last one that served, in its directory),
 * giving it the descriptor, the FUSE_INIT to replay (upgrade.h's kc_upgrade_replay) and a
 * new epoch (idtable.h): it serves the same mount, bind mounts in other mount namespaces
 * included, restores the dead one's ids (of directories, links and files, an entry's
 * included: ledger.h says which) from the inode ledger in the same memfd, and answers its
 * other ids and its handles ESTALE / EBADF (stale.h).
 *
 * Daemons find the holder of their mount on an abstract Unix socket named after the user
 * and the mountpoint (as upgrade.h's): each daemon that serves says so (and learns the
 * epoch, and gets the memfd, for its ledger); it says STOP before a clean unmount (the holder then lets the descriptor go and
 * exits 0) and HANDOVER before it exits at a live upgrade (the holder then waits for the
 * new daemon to say it serves: no restart; the new daemon said TAKING on a connection of
 * its own when it connected to the old one, and should that connection close before it
 * serves, the holder starts a daemon at once). Restarts are bounded: at most
 * KC_HOLDER_RESTARTS within KC_HOLDER_WINDOW seconds, each after a growing pause; past
 * that the holder lets the mount go (as a crash without a holder does) and exits 1. A
 * SIGTERM, SIGINT or SIGHUP to the holder is passed to the daemon (a stop); during a live
 * upgrade, to the new daemon once it serves; with no daemon running, the holder unmounts
 * the mount lazily and exits. Under a service manager that keeps the descriptor (its store),
 * the holder sends the daemon SIGUSR1 instead: the daemon stops without unmounting (the
 * cluster store's shares in hand end first, within -o stop_timeout), and the holder exits
 * once it is gone, leaving the mount to the store.
 */
#ifndef KC_HOLDER_H
#define KC_HOLDER_H

#include <stddef.h>
#include <stdint.h>

#define KC_HOLDER_RESTARTS 5
#define KC_HOLDER_WINDOW 60
/* Seconds the holder waits after a HANDOVER for the new daemon to serve, then restarts. */
#define KC_HOLDER_HANDOVER_WAIT 120
/* The environment variable that tells a daemon the holder started it (internal). */
#define KC_HOLDER_ENV "KCACHEFS_HOLDER"

/* Fork the holder of the mount at real_mnt served through *fuse_fd (the descriptor that
 * mounted it; no request read yet). The holder (the parent: it stays the process the
 * service manager started) never returns from here. In the daemon (the child) *fuse_fd's
 * number becomes a clone of the descriptor; returns 0 there. use_syslog: where the
 * holder and the daemons it starts log. daemon_fd: a descriptor of the daemon's alone,
 * which the holder closes (the pipe that tells the starting command the daemon serves), or
 * -1. Returns -errno (no holder; the daemon serves on the descriptor as before) when it
 * cannot be set up. */
int kc_holder_start(const char *real_mnt, int fuse_fd, int use_syslog, int daemon_fd);

/* Did the service manager hand back a mount's descriptors from its file descriptor store
 * (LISTEN_FDS, LISTEN_FDNAMES: kcachefs-fuse and kcachefs-init, stored by a holder)?
 * Returns 1 with *fuse_fd and *init_fd set, else 0 (always without libsystemd). */
int kc_holder_stored(int *fuse_fd, int *init_fd);
/* Become the holder of the mount at real_mnt from the descriptors kc_holder_stored gave,
 * and start a daemon on it at once (argv of argc, run in cwd: this command). Never
 * returns. real_mnt must not be resolved through the mount (no daemon answers it yet). */
_Noreturn void kc_holder_resume(const char *real_mnt, int fuse_fd, int init_fd, int argc,
				char **argv, const char *cwd, int use_syslog);

/* The mount's FUSE_INIT was answered (upgrade.c): keep it for a restart. */
void kc_holder_note_init(const unsigned char *in, size_t in_len, const unsigned char *out,
			 size_t out_len);

/* What a daemon started by the holder is given. */
struct kc_holder_restart {
	int fuse_fd;            /* the holder's descriptor: clone it (kc_holder_clone) */
	uint32_t epoch;
	int use_syslog;
	unsigned char init_in[512], init_out[512];
	size_t init_in_len, init_out_len;
};

/* Was this daemon started by a holder (KC_HOLDER_ENV set)? Returns 1 and fills r (and
 * unsets the variable, so that compilers do not see it), 0 when not, or -EINVAL after a
 * log line saying what was wrong with it. */
int kc_holder_restarted(struct kc_holder_restart *r);

/* A new descriptor on the connection of fd (FUSE_DEV_IOC_CLONE), close-on-exec. Returns it
 * or -errno. */
int kc_holder_clone(int fd);

/* Tell the holder of real_mnt, if there is one, that this daemon serves it (pid, argv of
 * argc, cwd: what a restart runs). Returns the epoch this daemon's ids must carry (0
 * without a holder), and in *state_fd the holder's memfd of the mount's state, which holds
 * the inode ledger (ledger.h; the caller owns it), or -1 (no holder, or one of a build
 * that sends none). */
uint32_t kc_holder_register(const char *real_mnt, int argc, char **argv, const char *cwd,
			    int *state_fd);

/* A live upgrade's new daemon (kcachefs --upgrade mnt, connected to the running daemon):
 * tell the holder of mnt, if any, that it takes the mount over. The connection stays open
 * (inherited by the daemonized child) and becomes kc_holder_register's: should this
 * process die before it serves, the holder sees it close and starts a daemon at once. */
void kc_holder_taking(const char *mnt);

/* Nonzero when a holder of real_mnt listens. */
int kc_holder_listening(const char *real_mnt);

/* Unmount mnt lazily (MNT_DETACH; not as root: fusermount3 -u -z), waiting for it; a
 * mount already gone is no error, others are logged. For a dead mount, or one whose
 * daemon is gone: it never touches the mount's files. */
void kc_unmount_detached(const char *mnt);

/* Tell the holder this daemon stops cleanly: it lets the descriptor go and exits. */
void kc_holder_stop(void);
/* Nonzero when this daemon is registered with a holder (kc_holder_register). */
int kc_holder_connected(void);
/* Nonzero once this daemon (the holder's first, which mounted) gave the holder the mount's
 * FUSE_INIT: before that, a daemon the holder starts again could not serve the mount. */
int kc_holder_init_kept(void);
/* Tell the holder this daemon handed the mount to a new one (upgrade.c). */
void kc_holder_handover(void);

#endif
