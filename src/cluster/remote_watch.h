/* remote_watch.h - proof that the headers of a list have not changed since a rehash began,
 * without a stat of each header (inotify(7), and poll(2) of the mount table).
 *
 * A joining node's fetch compares a header list with this node's headers as they are when
 * it asks (remote_rehash.h): a stat of each of the list's 133 host headers per kernel, which
 * was the largest single part of a joining node's time per kernel on the 2-core build
 * machine. The watch lets a fetch take the list's last rehash instead, when
 * nothing that rehash looked at can have changed since it began:
 *
 * - Before a rehash looks at any header, kc_watch_arm puts an inotify watch on every listed
 *   header (written, truncated, its attributes or times set, renamed or removed, and opened
 *   by any process: a writable mapping is made through an open, and its writes raise no
 *   event) and on every directory whose entries each path's walk looks up, the walk made
 *   as the kernel makes it, through every symlink of a chain (an entry created, removed or
 *   renamed in it; itself renamed or removed). A listed path whose lookup finds nothing
 *   (ENOENT, or ENOTDIR at a component that is a file) is covered by the watch of the last
 *   directory its walk reached, where a name made later raises an event; a listed
 *   directory is watched as a walk's directories are, and a listed readlink (">path") by
 *   the watch of the link's directory, where re-pointing it raises an event.
 * - A header that some process has open for writing when its watch is added (a mapping made
 *   before the watch writes with no event) is not proven: F_SETLEASE, as root or owner.
 * - Any event on any watch, an overflow of the event queue, or a change of this process's
 *   mount table moves the generation on (coarse: every list's proof goes with it), and a
 *   result is taken on the watch's word only while the generation is the one kc_watch_arm
 *   returned before that result's stats began.
 * - kc_watch_arm gives its word only when nothing but its own opens of the headers (for
 *   their leases) came while it ran: so a directory walked for one header is not looked up
 *   again for the next (a change to it since would have come as an event), and a
 *   filesystem is checked once per device.
 *
 * Events are queued by the system call that makes the change, before it returns, so a
 * change made before a fetch asks is always seen when the fetch drains the queue. Where
 * inotify cannot see every change, kc_watch_arm returns 0 and every fetch stats as before:
 * a path on a filesystem other than the local ones of kc_tree_local_type (tree.h): NFS,
 * FUSE, a network or cluster filesystem (a change made by another machine raises no event
 * here); a path on an overlayfs (a change made in a layer, not through the overlay, raises
 * no event on it); a watch that cannot be added (fs.inotify.max_user_watches); no inotify
 * instance to be had (fs.inotify.max_user_instances); no read lease to be had (no
 * CAP_LEASE, not the owner).
 */
#ifndef KC_REMOTE_WATCH_H
#define KC_REMOTE_WATCH_H

#include <pthread.h>
#include <stddef.h>

struct kc_watch {
	pthread_mutex_t lock;  /* guards all below */
	int fd;                /* the inotify instance; -1 before the first arm or when none */
	int mounts_fd;         /* /proc/self/mountinfo, polled for POLLPRI; -1 when none */
	int broken;            /* no instance or mount table to be had: never a proof */
	unsigned long gen;     /* moves on at each batch of events (starts at 1) */
	unsigned long unwatched; /* arms that returned 0 (for the log's first line only) */
	int arming;            /* arms holding or waiting for lock (__atomic, read without it) */
};

/* Initialise w (no inotify instance yet: the first kc_watch_arm makes it). */
void kc_watch_init(struct kc_watch *w);

/* Close w's descriptors. No call may be under way. */
void kc_watch_destroy(struct kc_watch *w);

/* Watch every path of the header list list/len (manifest lines "<64 hex> <absolute path>\n",
 * remote_manifest.h) and the directories their walks pass through. Call before the stats
 * of a rehash of that list. Returns the generation that stands for them (> 0), to keep
 * with the rehash's result; 0 when they cannot all be watched (logged once per daemon with
 * why): then the result is never taken on the watch's word. fill (may be NULL) is called
 * with each header's path as listed and a descriptor of it open for reading, while a read
 * lease proves that nobody has it open for writing: a caller that reads the headers anyway
 * reads them there (an open of its own after the arm would be an event that ends the
 * word). */
unsigned long kc_watch_arm(struct kc_watch *w, const char *list, size_t len,
			   int (*fill)(const char *path, int fd));

/* 1 if nothing watched has changed since kc_watch_arm returned gen (> 0), else 0. Reads
 * every event queued so far, so a change whose system call returned before this call is
 * always counted. -EBUSY at once, without waiting, while an arm runs (milliseconds, and
 * it reads the events itself: the caller stats the headers instead of waiting). */
int kc_watch_unchanged(struct kc_watch *w, unsigned long gen);

#endif
