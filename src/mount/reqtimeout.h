/* reqtimeout.h - the kernel's FUSE request timeout (Linux 6.14+) and the waits it bounds.
 *
 * The sysctls fs.fuse.default_request_timeout and fs.fuse.max_request_timeout (seconds,
 * 0: off) give a FUSE connection a request timeout: every FUSE_TIMEOUT_TIMER_FREQ (15 s)
 * the kernel looks at its oldest requests, and aborts the whole connection (every later
 * access: ENOTCONN) when one is older than the timeout (fs/fuse/dev.c, fuse_check_timeout).
 * The timeout is fixed once per connection, when the daemon answers FUSE_INIT
 * (fs/fuse/inode.c process_init_reply -> fuse_init_server_timeout): the daemon's own
 * (FUSE_REQUEST_TIMEOUT in the INIT reply, which libfuse sends from 3.18 on and 3.14 never
 * does), else the default; capped by the maximum when that is nonzero; at least 15 s.
 * Sysctls changed later leave a mounted connection as it was.
 *
 * So every request the daemon keeps waiting (an open or a getattr parked on a compile, a
 * compile waiting for another node's lease) must be answered within kc_reqtimeout_budget
 * of its arrival.
 */
#ifndef KC_REQTIMEOUT_H
#define KC_REQTIMEOUT_H

#define KC_REQTIMEOUT_SYSCTL_DIR "/proc/sys/fs/fuse"
#define KC_REQTIMEOUT_FLOOR 15 /* seconds: FUSE_TIMEOUT_TIMER_FREQ, the kernel's minimum */

struct kc_reqtimeout {
	int present;         /* the kernel has the sysctls (6.14+) */
	unsigned default_s;  /* fs.fuse.default_request_timeout as read (0: off or absent) */
	unsigned max_s;      /* fs.fuse.max_request_timeout as read (0: off or absent) */
	unsigned effective_s; /* the timeout of a connection initialised now; 0: none */
};

/* The timeout the kernel gives a connection whose daemon asked for server_s (0: nothing)
 * while the sysctls are default_s and max_s, as fuse_init_server_timeout computes it.
 * Returns seconds, 0 for no timeout. */
unsigned kc_reqtimeout_effective(unsigned server_s, unsigned default_s, unsigned max_s);

/* Read both sysctls from dir (KC_REQTIMEOUT_SYSCTL_DIR; another for tests) into *rt, with
 * the effective timeout of a libfuse 3.14 daemon (which asks for none). Absent files (a
 * kernel before 6.14) read as 0 with present 0. Returns 0, or -errno when a file is there
 * but cannot be read or holds no number (then *rt says no timeout). */
int kc_reqtimeout_read(const char *dir, struct kc_reqtimeout *rt);

/* Seconds a request may be kept waiting under a connection timeout of timeout_s (0: no
 * bound, returns 0): the timeout less a margin (a tenth, at least 3 s) for the time the
 * request spent queued in the kernel before the daemon read it and for the answer's way
 * back. At least 1. */
unsigned kc_reqtimeout_budget(unsigned timeout_s);

/* The smallest request timeout (seconds) whose budget is at least wait_s: what to set the
 * sysctls to for waits of wait_s. */
unsigned kc_reqtimeout_needed(unsigned wait_s);

#endif
