/* upgrade.h - live upgrade: a running daemon hands its mount to a new one without
 * unmounting (kcachefs --upgrade MOUNTPOINT).
 *
 * The daemon listens on an abstract Unix socket named after its user and mountpoint
 * (kc_upgrade_socket_path; no file, so nothing stays behind a killed daemon); each side
 * checks the other's credentials (root, or the same user). A new daemon connects and says its handover
 * format (handover.h); another format is refused with a message and the old daemon keeps
 * serving, as is a mount where a client stages a recipe through an open descriptor for
 * longer than KC_UPGRADE_STAGE_WAIT seconds. Else the old one offers its command line and the mount's FUSE_INIT; the new
 * one replays that FUSE_INIT on its own session (libfuse 3.14's fuse_session expects
 * FUSE_INIT first: its reply goes nowhere) and checks it negotiates what the kernel uses,
 * or aborts, the old one serving on. Then the old one stops reading requests (the kernel
 * queues them), waits until every request it read is answered, the openers parked on its
 * compiles included (at most compile_timeout and a margin; past that it resumes serving;
 * a stage begun meanwhile reopens the gate until its descriptor is closed), then, within
 * the same bound, for a cluster store's shares (kc_cache_settle: dependency pass, puts,
 * lease release) to end in the old daemon (past the bound they are given up,
 * with a warning: their leases expire). It sends the /dev/fuse descriptor and its state (SCM_RIGHTS) and exits without unmounting.
 * The new one waits for it to be gone, opens the store and serves the same descriptor.
 *
 * The session's I/O goes through kc_upgrade_io's read and writev (fuse_session_custom_io),
 * which can stop between requests and count requests read and not answered. One session
 * per process.
 */
#ifndef KC_UPGRADE_H
#define KC_UPGRADE_H

#include <stddef.h>
#include <sys/types.h>

#include "fs.h"
#include "handover.h"

/* Seconds an upgrade request waits for the clients staging through open descriptors to
 * close them before it is refused. */
#define KC_UPGRADE_STAGE_WAIT 10

/* The abstract socket name (without its leading NUL) of this user's daemon serving
 * real_mnt (a resolved path), into path (len bytes). */
void kc_upgrade_socket_path(const char *real_mnt, char *path, size_t len);

/* Put the session's I/O on fd (its /dev/fuse descriptor, made non-blocking). Returns 0 or
 * -errno. */
int kc_upgrade_io(struct fuse_session *se, int fd);

/* Old side: serve upgrade requests for real_mnt from a thread, offering argv[1..argc-1]
 * run in cwd. Returns 0 or -errno (no upgrade possible; the mount serves on). */
int kc_upgrade_listen(struct kc_fs *fs, const char *real_mnt, int argc, char **argv,
		      const char *cwd);
/* Stop listening (at a normal stop) and remove the socket if it is still this daemon's. */
void kc_upgrade_stop(void);

/* New side. Connect to the daemon of mnt and get its offer. Returns the connected socket,
 * or -errno with why filled: -ENOENT (no daemon listens there), -EPERM (refused: another
 * format; the message in why), -EPROTO. */
int kc_upgrade_connect(const char *mnt, struct kc_handover_offer *offer, char *why, size_t whylen);
/* Replay the offer's FUSE_INIT on se (io set up on a placeholder descriptor) and compare
 * the reply with the old daemon's; then tell the old daemon to go on (0) or to keep
 * serving (-EPROTO, why filled). */
int kc_upgrade_replay_init(int sock, struct fuse_session *se, const struct kc_handover_offer *o,
			   char *why, size_t whylen);
/* Put the session's I/O on a placeholder descriptor and replay init_in (in_len bytes, the
 * mount's FUSE_INIT as the kernel sent it) on se, checking that se answers it with exactly
 * init_out (out_len bytes, the reply the kernel took, unique id aside): se starts as already
 * initialized. Returns 0, or -EPROTO with why filled. Used by the upgrade and by a daemon
 * restarted by the holder (holder.h). */
int kc_upgrade_replay(struct fuse_session *se, const unsigned char *init_in, size_t in_len,
		      const unsigned char *init_out, size_t out_len, char *why, size_t whylen);
/* Make the session set up by kc_upgrade_replay_init serve fd (the /dev/fuse descriptor
 * handed over; consumed on success): it takes the placeholder's number, so libfuse's session
 * needs no second setup. Returns 0 or -errno. */
int kc_upgrade_adopt(int fd);
/* Receive the state (*state, *len: malloc'ed bytes) and its descriptors (*fds, *nfds),
 * acknowledge them, and wait (at most 60 s) until the old daemon's pid is gone. Returns 0,
 * or -errno with why filled (the old daemon kept the mount when it failed before sending). */
int kc_upgrade_receive(int sock, pid_t old, unsigned char **state, size_t *len, int **fds,
		       size_t *nfds, char *why, size_t whylen);

#endif
