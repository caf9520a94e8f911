/* handover.h - the state a running daemon hands to its successor in a live upgrade
 * (kcachefs --upgrade, upgrade.c), as bytes plus a list of descriptors.
 *
 * Two messages. The offer, sent before the old daemon stops reading requests: the format,
 * the old daemon's pid, its command line and working directory (the new one runs with the
 * same options), and the FUSE_INIT the kernel sent at mount with the daemon's reply to it
 * (the new session replays the first and must produce the same second: the protocol
 * version, flags and sizes the kernel uses are those). The state, sent once every request
 * the old daemon read is answered: every inode the kernel holds (node id = slot and
 * generation, lookup count, backing identity, role, its O_PATH descriptors), the
 * generation of every slot, the open file handles (id, inode, descriptor) and directory
 * handles (id, the names of their snapshot). Descriptors travel beside the bytes
 * (SCM_RIGHTS); records name them by index, the /dev/fuse descriptor first.
 *
 * Both daemons must share KC_HANDOVER_FORMAT: a change to either message or to a record's
 * meaning changes it, and an upgrade between two formats is refused before anything stops.
 * Byte order and widths are the machine's (both daemons run on it).
 */
#ifndef KC_HANDOVER_H
#define KC_HANDOVER_H

#include <stddef.h>
#include <stdint.h>

#include "fs.h"

#ifndef KC_HANDOVER_FORMAT
#define KC_HANDOVER_FORMAT 1u
#endif
#define KC_HANDOVER_INIT_MAX 512 /* bytes of the FUSE_INIT request or reply kept */

struct kc_handover_offer {
	uint32_t format;
	int32_t pid;                  /* the old daemon */
	char *args;                   /* its argv[1..], each NUL-terminated; owned */
	uint32_t args_len;
	char *cwd;                    /* its working directory at start; owned */
	unsigned char init_in[KC_HANDOVER_INIT_MAX]; /* the kernel's FUSE_INIT, header first */
	uint32_t init_in_len;
	unsigned char init_out[KC_HANDOVER_INIT_MAX]; /* the daemon's reply to it */
	uint32_t init_out_len;
};

/* A growing byte buffer; err is set (-ENOMEM) once a put fails, and later puts do nothing. */
struct kc_hbuf {
	unsigned char *p;
	size_t len, cap;
	int err;
};

/* Descriptors listed for the state (borrowed: the lister does not close them). */
struct kc_hfds {
	int *v;
	size_t n, cap;
};

/* Encode o into b (b->err says whether it worked). */
void kc_handover_offer_put(struct kc_hbuf *b, const struct kc_handover_offer *o);
/* Decode an offer from len bytes; 0, or -EPROTO for bytes that are not one (o is then
 * empty). The caller frees with kc_handover_offer_free. */
int kc_handover_offer_get(const unsigned char *p, size_t len, struct kc_handover_offer *o);
void kc_handover_offer_free(struct kc_handover_offer *o);

/* Encode fs's state into b and list its descriptors in fds (fuse_fd first). Call with every
 * FUSE request answered and none being read (upgrade.c's gate). Returns 0, -ENOMEM, or
 * -EBUSY with why filled when a handle cannot be carried (a file being staged: its
 * temporary is the store's, which the new daemon empties). */
int kc_handover_state_put(struct kc_fs *fs, int fuse_fd, struct kc_hbuf *b, struct kc_hfds *fds,
			  char *why, size_t whylen);
/* Rebuild the inode table and the handles of fs (set up, nothing served yet) from the
 * state in p (len bytes) with its nfds descriptors fds, which it takes (closing those it
 * does not keep). *fuse_fd gets the /dev/fuse descriptor. Returns 0, or -EPROTO (bytes
 * that are not a state, an index past nfds) or -ENOMEM, with why filled. */
int kc_handover_state_restore(struct kc_fs *fs, const unsigned char *p, size_t len, int *fds,
			      size_t nfds, int *fuse_fd, char *why, size_t whylen);

/* -EBUSY with why filled when a handle cannot be carried (kc_handover_state_put), else 0. */
int kc_handover_busy(struct kc_fs *fs, char *why, size_t whylen);

/* Append len raw bytes / a u32 / a u32 length and the bytes. */
void kc_hbuf_raw(struct kc_hbuf *b, const void *p, size_t len);
void kc_hbuf_u32(struct kc_hbuf *b, uint32_t v);
void kc_hbuf_bytes(struct kc_hbuf *b, const void *p, size_t len);
void kc_hbuf_free(struct kc_hbuf *b);
void kc_hfds_free(struct kc_hfds *f);

#endif
