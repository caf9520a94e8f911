/* upgrade.c - see upgrade.h */
#define _GNU_SOURCE
#include "upgrade.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "hash.h"
#include "pool.h"
#include "holder.h"
#include "log.h"
#include "stale.h"
#include "unixsock.h"

enum { MSG_HELLO = 1, MSG_OFFER, MSG_REFUSE, MSG_GO, MSG_ABORT, MSG_STATE, MSG_FAIL, MSG_ACK };
#define MAX_MSG (256u << 20)

/* The session's I/O (one per process). */
static struct {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	int closed;        /* no request is read while set */
	int readers;       /* threads between the check of closed and the return of a read */
	long outstanding;  /* requests read and not answered */
	int wake_fd;       /* an eventfd: wakes the readers' polls when closing */
	int swallow;       /* replies are kept in swallowed, not written (the replayed INIT) */
	int placeholder;   /* the new side: the session's descriptor until the real one */
	unsigned char swallowed[KC_HANDOVER_INIT_MAX];
	size_t swallowed_len;
	unsigned char init_in[KC_HANDOVER_INIT_MAX], init_out[KC_HANDOVER_INIT_MAX];
	size_t init_in_len, init_out_len;
	uint64_t init_unique;
} io = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, -1, 0, -1, {0}, 0, {0},
	{0}, 0, 0, 0};

static void note_request(const void *buf, size_t n)
{
	const struct fuse_in_header *h = buf;
	if (n < sizeof(*h))
		return;
	if (h->opcode == FUSE_INIT && !io.init_in_len && n <= sizeof(io.init_in)) {
		memcpy(io.init_in, buf, n);
		io.init_in_len = n;
		io.init_unique = h->unique;
	}
	/* Requests that get no reply. */
	if (h->opcode == FUSE_FORGET || h->opcode == FUSE_BATCH_FORGET ||
	    h->opcode == FUSE_INTERRUPT || h->opcode == FUSE_NOTIFY_REPLY)
		return;
	__atomic_add_fetch(&io.outstanding, 1, __ATOMIC_SEQ_CST);
}

static void reader_gone(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&io.lock);
	io.readers--;
	pthread_cond_broadcast(&io.cond);
	pthread_mutex_unlock(&io.lock);
}

/* Each reader thread waits in an epoll set of its own: the session's descriptor with
 * EPOLLEXCLUSIVE (a request wakes one idle reader, as a blocking read of /dev/fuse does,
 * not all of them, as poll() would), and the gate's eventfd (closing wakes them all). */
static pthread_key_t ep_key;
static pthread_once_t ep_once = PTHREAD_ONCE_INIT;

static void ep_close(void *p)
{
	close((int)(intptr_t)p - 1);
}

static void ep_key_make(void)
{
	pthread_key_create(&ep_key, ep_close);
}

/* This thread's epoll set for fd, or -1 (then poll() is used). */
static int thread_epoll(int fd)
{
	pthread_once(&ep_once, ep_key_make);
	intptr_t v = (intptr_t)pthread_getspecific(ep_key);
	if (v)
		return (int)v - 1;
	int ep = epoll_create1(EPOLL_CLOEXEC);
	struct epoll_event in = {.events = EPOLLIN | EPOLLEXCLUSIVE, .data.fd = fd};
	struct epoll_event wake = {.events = EPOLLIN, .data.fd = io.wake_fd};
	if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, fd, &in) != 0 ||
	    epoll_ctl(ep, EPOLL_CTL_ADD, io.wake_fd, &wake) != 0) {
		if (ep >= 0)
			close(ep);
		return -1;
	}
	pthread_setspecific(ep_key, (void *)(intptr_t)(ep + 1));
	return ep;
}

/* One wait for a request: the request's length, or -1 with *err (EAGAIN: none now, or the
 * gate is closing, or the request was one of a dead daemon's ids, answered here). */
static ssize_t poll_read(int fd, void *buf, size_t len, int *err, struct kc_fs *fs)
{
	int ep = thread_epoll(fd), ready = 0;
	*err = EAGAIN;
	if (ep >= 0) {
		struct epoll_event ev[2];
		int r = epoll_wait(ep, ev, 2, -1);
		if (r < 0) {
			*err = errno;
			return -1;
		}
		for (int i = 0; i < r; i++)
			ready |= ev[i].data.fd == fd;
	} else {
		struct pollfd p[2] = {{fd, POLLIN, 0}, {io.wake_fd, POLLIN, 0}};
		int r = poll(p, 2, -1);
		if (r < 0) {
			*err = errno;
			return -1;
		}
		ready = p[0].revents != 0;
	}
	if (!ready)
		return -1;
	ssize_t n = read(fd, buf, len);
	*err = errno;
	if (n > 0 && fs && !(n = (ssize_t)kc_stale_filter(fs, fd, buf, (size_t)n))) {
		*err = EAGAIN;
		return -1;
	}
	if (n > 0)
		note_request(buf, (size_t)n);
	return n;
}

static ssize_t io_read(int fd, void *buf, size_t len, void *userdata)
{
	/* libfuse cancels its workers when the loop ends, in this read: no lock is held across
	 * a cancellation point, and no cleanup handler is pushed (their longjmp trips
	 * AddressSanitizer); a reader cancelled while counted is only one at the very end. */
	for (;;) {
		while (__atomic_load_n(&io.closed, __ATOMIC_SEQ_CST))
			usleep(10000);
		pthread_mutex_lock(&io.lock);
		int closed = io.closed;
		if (!closed)
			io.readers++;
		pthread_mutex_unlock(&io.lock);
		if (closed)
			continue;

		int err;
		ssize_t n = poll_read(fd, buf, len, &err, userdata);
		reader_gone(NULL);
		if (n >= 0)
			return n;
		if (err != EAGAIN) {
			errno = err; /* EINTR: libfuse reads again; ENODEV: unmounted */
			return -1;
		}
	}
}

static ssize_t io_writev(int fd, struct iovec *iov, int count, void *userdata)
{
	(void)userdata;
	size_t total = 0;
	for (int i = 0; i < count; i++)
		total += iov[i].iov_len;
	if (io.swallow) {
		io.swallowed_len = 0;
		for (int i = 0; i < count; i++) {
			size_t k = iov[i].iov_len;
			if (io.swallowed_len + k > sizeof(io.swallowed))
				k = sizeof(io.swallowed) - io.swallowed_len;
			memcpy(io.swallowed + io.swallowed_len, iov[i].iov_base, k);
			io.swallowed_len += k;
		}
		return (ssize_t)total;
	}
	uint64_t unique = 0;
	if (count > 0 && iov[0].iov_len >= sizeof(struct fuse_out_header))
		unique = ((const struct fuse_out_header *)iov[0].iov_base)->unique;
	if (unique && unique == io.init_unique && io.init_in_len && !io.init_out_len &&
	    total <= sizeof(io.init_out)) {
		for (int i = 0; i < count; i++) {
			memcpy(io.init_out + io.init_out_len, iov[i].iov_base, iov[i].iov_len);
			io.init_out_len += iov[i].iov_len;
		}
		kc_holder_note_init(io.init_in, io.init_in_len, io.init_out, io.init_out_len);
	}
	ssize_t r = writev(fd, iov, count);
	int err = errno;
	/* A reply (a notification has unique 0) to a counted request: not the EAGAIN libfuse
	 * sends back to an INTERRUPT it cannot match yet, whose unique has the kernel's
	 * FUSE_INT_REQ_BIT (bit 0; requests' own uniques are even), and which note_request did
	 * not count. The count is decremented atomically: note_request increments it without
	 * the lock, and a plain decrement under the lock lost such increments, so that the
	 * count fell below 0 and an upgrade's drain gave up at once. */
	if (unique && !(unique & 1)) {
		pthread_mutex_lock(&io.lock);
		__atomic_sub_fetch(&io.outstanding, 1, __ATOMIC_SEQ_CST);
		pthread_cond_broadcast(&io.cond);
		pthread_mutex_unlock(&io.lock);
	}
	errno = err;
	return r;
}

int kc_upgrade_io(struct fuse_session *se, int fd)
{
	static const struct fuse_custom_io ops = {.writev = io_writev, .read = io_read};
	if (io.wake_fd < 0 && (io.wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0)
		return -errno;
	int fl = fcntl(fd, F_GETFL);
	if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0)
		return -errno;
	return fuse_session_custom_io(se, &ops, fd);
}

/* Stop reading requests: returns once no thread can take one. fs->draining says so to the
 * requests in hand (fs.h). */
static void gate_close(struct kc_fs *fs)
{
	__atomic_store_n(&fs->draining, 1, __ATOMIC_SEQ_CST);
	pthread_mutex_lock(&io.lock);
	io.closed = 1;
	uint64_t one = 1;
	if (write(io.wake_fd, &one, sizeof(one)) < 0)
		kc_log(KC_LOG_DEBUG, "upgrade: wake: %s", strerror(errno));
	while (io.readers > 0)
		pthread_cond_wait(&io.cond, &io.lock);
	pthread_mutex_unlock(&io.lock);
}

static void gate_open(struct kc_fs *fs)
{
	__atomic_store_n(&fs->draining, 0, __ATOMIC_SEQ_CST);
	uint64_t v;
	pthread_mutex_lock(&io.lock);
	if (read(io.wake_fd, &v, sizeof(v)) < 0 && errno != EAGAIN)
		kc_log(KC_LOG_DEBUG, "upgrade: wake: %s", strerror(errno));
	io.closed = 0;
	pthread_cond_broadcast(&io.cond);
	pthread_mutex_unlock(&io.lock);
}

static int stop_asked; /* the daemon stops: an upgrade being served ends (atomic) */

static int stopping(void)
{
	return __atomic_load_n(&stop_asked, __ATOMIC_SEQ_CST);
}

/* Whether the new process on connection c is gone (killed, or timed out by a service
 * manager): it sends nothing while the old daemon drains, so a hangup is its end. */
static int peer_gone(int c)
{
	struct pollfd p = {c, POLLRDHUP, 0};
	return c >= 0 && poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

/* Whether a wait of the upgrade on connection c must end now; why says why. */
static int wait_ends(int c, char *why, size_t whylen)
{
	if (stopping())
		snprintf(why, whylen, "the daemon is stopping");
	else if (peer_gone(c))
		snprintf(why, whylen, "the new process is gone (killed, or timed out)");
	else
		return 0;
	return 1;
}

/* Wait until every request read is answered, at most until deadline (CLOCK_MONOTONIC s),
 * or until the wait must end (wait_ends: why filled). Returns the requests left. */
static long drain(double deadline, int c, char *why, size_t whylen)
{
	pthread_mutex_lock(&io.lock);
	while (__atomic_load_n(&io.outstanding, __ATOMIC_SEQ_CST) > 0 && !wait_ends(c, why, whylen)) {
		struct timespec now;
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (now.tv_sec + now.tv_nsec / 1e9 >= deadline)
			break;
		kc_cond_wait_briefly(&io.cond, &io.lock);
	}
	long left = __atomic_load_n(&io.outstanding, __ATOMIC_SEQ_CST);
	pthread_mutex_unlock(&io.lock);
	return left;
}

static double mono_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Messages: a type and a length, then the bytes. */

static int write_all(int s, const void *p, size_t len)
{
	const char *c = p;
	while (len) {
		ssize_t n = send(s, c, len, MSG_NOSIGNAL);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return -errno ? -errno : -EPIPE;
		c += n;
		len -= (size_t)n;
	}
	return 0;
}

static int send_msg(int s, uint32_t type, const void *p, size_t len)
{
	uint32_t h[2] = {type, (uint32_t)len};
	int err = write_all(s, h, sizeof(h));
	return err ? err : write_all(s, p, len);
}

/* Read len bytes within timeout_s. */
static int read_all(int s, void *p, size_t len, int timeout_s)
{
	char *c = p;
	double deadline = mono_now() + timeout_s;
	while (len) {
		int left = (int)((deadline - mono_now()) * 1000);
		struct pollfd pf = {s, POLLIN, 0};
		if (left <= 0 || poll(&pf, 1, left) == 0)
			return -ETIMEDOUT;
		ssize_t n = recv(s, c, len, 0);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -errno;
		if (n == 0)
			return -EPIPE;
		c += n;
		len -= (size_t)n;
	}
	return 0;
}

/* Receive a message: its type, and its bytes (malloc'ed, NUL-terminated). */
static int recv_msg(int s, uint32_t *type, unsigned char **p, size_t *len, int timeout_s)
{
	uint32_t h[2];
	int err = read_all(s, h, sizeof(h), timeout_s);
	if (err)
		return err;
	if (h[1] > MAX_MSG)
		return -EPROTO;
	*p = malloc(h[1] + 1);
	if (!*p)
		return -ENOMEM;
	err = read_all(s, *p, h[1], timeout_s);
	if (err) {
		free(*p);
		*p = NULL;
		return err;
	}
	(*p)[h[1]] = '\0';
	*type = h[0];
	*len = h[1];
	return 0;
}

/* Send n descriptors on s, KC_FDS_PER_MSG a message of one byte. Returns 0 or -errno. */
static int send_fds(int s, const int *fds, size_t n)
{
	for (size_t i = 0; i < n; i += KC_FDS_PER_MSG) {
		size_t k = n - i < KC_FDS_PER_MSG ? n - i : KC_FDS_PER_MSG;
		int err = kc_send_fds(s, "F", 1, fds + i, k);
		if (err)
			return err;
	}
	return 0;
}

/* Receive n descriptors on s (send_fds's), waiting at most timeout_s for each message.
 * Returns 0, -ETIMEDOUT, -EPROTO (not such a message), or -errno. */
static int recv_fds(int s, int *fds, size_t n, int timeout_s)
{
	size_t got = 0;
	while (got < n) {
		struct pollfd pf = {s, POLLIN, 0};
		if (poll(&pf, 1, timeout_s * 1000) <= 0)
			return -ETIMEDOUT;
		char byte;
		size_t k;
		int cut;
		ssize_t r = kc_recv_fds(s, &byte, 1, fds + got, n - got, &k, &cut);
		if (r < 0)
			return (int)r;
		if (r != 1 || cut) { /* cut: the descriptors that came are closed, k is 0 */ /* not send_fds's message: its descriptors are not the ones asked for */
			while (k)
				close(fds[got + --k]);
			return -EPROTO;
		}
		got += k;
	}
	return 0;
}

void kc_upgrade_socket_path(const char *real_mnt, char *path, size_t len)
{
	char hex[KC_SHA256_HEXLEN + 1];
	kc_sha256_buf(real_mnt, strlen(real_mnt), hex);
	snprintf(path, len, "kcachefs-upgrade-%u-%.32s", (unsigned)geteuid(), hex);
}

/* The old side. */

static struct {
	struct kc_fs *fs;
	int sock;
	char path[108];
	struct kc_hbuf args;  /* the command line offered: argv[1..], NUL-terminated each */
	char *cwd;
	pthread_t thread;
	int started;
	pthread_mutex_t conn_lock; /* guards conn: kc_upgrade_stop shuts it down */
	int conn;                  /* the upgrade being served, or -1 */
} srv = {.sock = -1, .conn_lock = PTHREAD_MUTEX_INITIALIZER, .conn = -1};

static void refuse(int c, uint32_t type, const char *why)
{
	kc_log(KC_LOG_WARN, "upgrade refused: %s; serving on", why);
	send_msg(c, type, why, strlen(why) + 1);
}

/* Wait until no client stages through an open descriptor (check_fh in handover.c), at most
 * until deadline (CLOCK_MONOTONIC s). Returns 0, or -EBUSY (still staging) or -ESHUTDOWN (the
 * daemon stops, or the new process on c is gone) with why said. */
static int wait_unstaged(struct kc_fs *fs, int c, double deadline, char *why, size_t whylen)
{
	int said = 0;
	while (kc_handover_busy(fs, why, whylen)) {
		if (wait_ends(c, why, whylen))
			return -ESHUTDOWN;
		if (mono_now() >= deadline)
			return -EBUSY;
		if (!said++)
			kc_log(KC_LOG_INFO, "upgrade: waiting until no stage is open: %s", why);
		usleep(20000);
	}
	return 0;
}

/* One upgrade request on connection c. Returns only when this daemon serves on. */
static void serve(int c)
{
	struct kc_fs *fs = srv.fs;
	struct ucred cred;
	socklen_t cl = sizeof(cred);
	unsigned char *p = NULL;
	size_t len = 0;
	uint32_t type = 0;
	char why[512] = "";

	if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 ||
	    (cred.uid != 0 && cred.uid != geteuid()))
		return; /* only root and the daemon's user may ask */
	if (recv_msg(c, &type, &p, &len, 10) != 0 || type != MSG_HELLO || len < 4) {
		free(p);
		return;
	}
	uint32_t format;
	memcpy(&format, p, sizeof(format));
	free(p);
	p = NULL;
	if (format != KC_HANDOVER_FORMAT) {
		snprintf(why, sizeof(why), "the new kcachefs (pid %d) carries state of format %u, "
			 "this daemon's is %u: they cannot hand over; stop and start the daemon "
			 "instead (its clients lose the mount), or upgrade through a build of "
			 "format %u", (int)cred.pid, format, KC_HANDOVER_FORMAT, KC_HANDOVER_FORMAT);
		return refuse(c, MSG_REFUSE, why);
	}
	if (wait_unstaged(fs, c, mono_now() + KC_UPGRADE_STAGE_WAIT, why, sizeof(why)))
		return refuse(c, MSG_REFUSE, why);
	struct kc_handover_offer o = {.format = KC_HANDOVER_FORMAT, .pid = (int32_t)getpid(),
				      .args = (char *)srv.args.p, .args_len = (uint32_t)srv.args.len,
				      .cwd = srv.cwd};
	memcpy(o.init_in, io.init_in, io.init_in_len);
	o.init_in_len = (uint32_t)io.init_in_len;
	memcpy(o.init_out, io.init_out, io.init_out_len);
	o.init_out_len = (uint32_t)io.init_out_len;
	if (!o.init_in_len || !o.init_out_len)
		return refuse(c, MSG_REFUSE, "the mount's FUSE_INIT was not seen by this daemon");
	struct kc_hbuf offer = {0};
	kc_handover_offer_put(&offer, &o);
	int sent = offer.err ? offer.err : send_msg(c, MSG_OFFER, offer.p, offer.len);
	kc_hbuf_free(&offer);
	if (sent)
		return;
	if (recv_msg(c, &type, &p, &len, 60) != 0 || type != MSG_GO) {
		kc_log(KC_LOG_WARN, "upgrade: the new daemon (pid %d) did not take the mount: %s; "
		       "serving on", (int)cred.pid, type == MSG_ABORT && p ? (char *)p : "no answer");
		free(p);
		return;
	}
	free(p);
	p = NULL;

	double begun = mono_now();
	/* Under a kernel request timeout, the requests queued in the kernel meanwhile age too:
	 * the handover must end within the budget of one request (reqtimeout.h), less the new
	 * daemon's start. */
	unsigned bound = fs->request_budget ? kc_fs_queue_bound(fs) : fs->cfg.compile_timeout + 30;
	long held = -1, left = 0;
	int err = 0;
	for (;;) {
		gate_close(fs);
		if (held < 0) {
			held = __atomic_load_n(&io.outstanding, __ATOMIC_SEQ_CST);
			kc_log(KC_LOG_INFO, "upgrade: handing the mount to pid %d: no new request is "
			       "read; answering the %ld in hand", (int)cred.pid, held);
		}
		left = drain(begun + bound, c, why, sizeof(why));
		if (left && wait_ends(c, why, sizeof(why))) {
			err = -ESHUTDOWN;
			break;
		}
		if (left) {
			snprintf(why, sizeof(why), "%ld requests still unanswered after %u s (compiles "
				 "running%s)", left, bound, fs->request_budget ? ", under the kernel's "
				 "request timeout" : "");
			err = -ETIMEDOUT;
			break;
		}
		/* A client began staging between the offer and the closing of the gate: its
		 * close is a request, so the gate opens until it is done. */
		if (!kc_handover_busy(fs, why, sizeof(why)))
			break;
		gate_open(fs);
		if ((err = wait_unstaged(fs, c, begun + bound, why, sizeof(why))))
			break;
	}
	/* The cluster store's share of each compile runs after its openers were answered,
	 * holding the recipe's lease: this daemon's shares end here, not with its exit (which
	 * would leave their leases to expire and their objects unstored). */
	unsigned jobs = 0;
	while (!err && (jobs = kc_cache_settle(&fs->cache, 0.1)) && mono_now() < begun + bound)
		if (wait_ends(c, why, sizeof(why))) /* a stop, a new process gone: at once */
			err = -ESHUTDOWN;
	if (jobs && !err)
		kc_log(KC_LOG_WARN, "upgrade: %u shares to the cluster store still running after "
		       "%u s end with this daemon: their kernels stay published here, unshared; "
		       "their leases expire and another node compiles them", jobs, bound);
	struct kc_hbuf b = {0};
	struct kc_hfds fds = {0};
	if (!err && (fuse_session_exited(fs->se) || stopping())) {
		snprintf(why, sizeof(why), "the daemon is stopping");
		err = -ESHUTDOWN;
	}
	if (!err)
		err = kc_handover_state_put(fs, fuse_session_fd(fs->se), &b, &fds, why, sizeof(why));
	if (!err) {
		uint32_t n = (uint32_t)fds.n;
		struct kc_hbuf msg = {0};
		kc_hbuf_u32(&msg, n);
		kc_hbuf_bytes(&msg, b.p, b.len);
		err = msg.err ? msg.err : send_msg(c, MSG_STATE, msg.p, msg.len);
		kc_hbuf_free(&msg);
		if (!err)
			err = send_fds(c, fds.v, fds.n);
		if (!err)
			err = recv_msg(c, &type, &p, &len, 60);
		if (!err && type != MSG_ACK)
			err = -EPROTO;
		if (err)
			snprintf(why, sizeof(why), "the new daemon did not take the state: %s",
				 strerror(-err));
		free(p);
	} else {
		send_msg(c, MSG_FAIL, why, strlen(why) + 1);
	}
	kc_hbuf_free(&b);
	kc_hfds_free(&fds);
	if (err) {
		kc_log(KC_LOG_WARN, "upgrade abandoned: %s%s", why,
		       stopping() ? "" : "; serving on");
		gate_open(fs);
		return;
	}
	kc_log(KC_LOG_INFO, "upgrade: the mount is pid %d's now (%ld requests answered during "
	       "the handover, %.2f s): exiting", (int)cred.pid, held, mono_now() - begun);
	kc_holder_handover(); /* the holder (if any) waits for the new daemon, restarts none */
	/* No unmount, no cleanup of the store: both are the new daemon's now. */
	_exit(0);
}

static void *listener(void *arg)
{
	(void)arg;
	for (;;) {
		int c = accept4(srv.sock, NULL, NULL, SOCK_CLOEXEC);
		if (c < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			return NULL; /* closed at the stop */
		}
		/* Not cancelled inside (kc_upgrade_stop waits): the gate's lock must not stay held.
		 * A stop shuts the connection down instead, and serve ends at its next step. */
		pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, NULL);
		pthread_mutex_lock(&srv.conn_lock);
		srv.conn = c;
		pthread_mutex_unlock(&srv.conn_lock);
		if (!stopping())
			serve(c);
		pthread_mutex_lock(&srv.conn_lock);
		srv.conn = -1;
		close(c);
		pthread_mutex_unlock(&srv.conn_lock);
		pthread_setcancelstate(PTHREAD_CANCEL_ENABLE, NULL);
	}
}

int kc_upgrade_listen(struct kc_fs *fs, const char *real_mnt, int argc, char **argv,
		      const char *cwd)
{
	memset(&srv.args, 0, sizeof(srv.args));
	for (int i = 1; i < argc; i++)
		kc_hbuf_raw(&srv.args, argv[i], strlen(argv[i]) + 1);
	srv.cwd = strdup(cwd);
	if (srv.args.err || !srv.cwd)
		return -ENOMEM;
	srv.fs = fs;
	kc_upgrade_socket_path(real_mnt, srv.path, sizeof(srv.path));
	struct sockaddr_un a;
	socklen_t al = kc_abstract_addr(srv.path, &a);
	srv.sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (srv.sock < 0)
		return -errno;
	if (bind(srv.sock, (struct sockaddr *)&a, al) != 0 || listen(srv.sock, 4) != 0) {
		int err = -errno; /* EADDRINUSE: another process holds the name */
		close(srv.sock);
		srv.sock = -1;
		return err;
	}
	int err = pthread_create(&srv.thread, NULL, listener, NULL);
	if (err) {
		close(srv.sock);
		srv.sock = -1;
		return -err;
	}
	srv.started = 1;
	return 0;
}

void kc_upgrade_stop(void)
{
	if (!srv.started)
		return;
	/* An upgrade being served ends now, not after its waits (up to compile_timeout + 30 s
	 * for the compiles in hand): the new daemon is told no and exits, this one stops. */
	__atomic_store_n(&stop_asked, 1, __ATOMIC_SEQ_CST);
	pthread_mutex_lock(&srv.conn_lock);
	if (srv.conn >= 0)
		shutdown(srv.conn, SHUT_RDWR);
	pthread_mutex_unlock(&srv.conn_lock);
	shutdown(srv.sock, SHUT_RDWR);
	pthread_cancel(srv.thread);
	pthread_join(srv.thread, NULL);
	close(srv.sock);
	srv.sock = -1;
	srv.started = 0;
	kc_hbuf_free(&srv.args);
	free(srv.cwd);
	srv.cwd = NULL;
}

/* The new side. */

int kc_upgrade_connect(const char *mnt, struct kc_handover_offer *offer, char *why, size_t whylen)
{
	char real[4096], path[108];
	if (!realpath(mnt, real)) {
		snprintf(why, whylen, "%s: %s", mnt, strerror(errno));
		return -ENOENT;
	}
	kc_upgrade_socket_path(real, path, sizeof(path));
	struct sockaddr_un a;
	socklen_t al = kc_abstract_addr(path, &a);
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (s < 0 || connect(s, (struct sockaddr *)&a, al) != 0) {
		snprintf(why, whylen, "no kcachefs daemon of uid %u serves %s that takes upgrades "
			 "(socket @%s: %s; run the upgrade as the daemon's user, or as root for a "
			 "daemon of root's)", (unsigned)geteuid(), real, path, strerror(errno));
		if (s >= 0)
			close(s);
		return -ENOENT;
	}
	/* Anyone may bind an abstract name: the one listening must be root or this user. */
	struct ucred cred;
	socklen_t cl = sizeof(cred);
	if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 ||
	    (cred.uid != 0 && cred.uid != geteuid())) {
		snprintf(why, whylen, "the socket @%s is held by uid %u, not a daemon of this user",
			 path, (unsigned)cred.uid);
		close(s);
		return -EPERM;
	}
	uint32_t hello[2] = {KC_HANDOVER_FORMAT, (uint32_t)getpid()};
	unsigned char *p = NULL;
	size_t len = 0;
	uint32_t type = 0;
	int err = send_msg(s, MSG_HELLO, hello, sizeof(hello));
	if (!err)
		err = recv_msg(s, &type, &p, &len, 30);
	if (!err && type == MSG_REFUSE) {
		snprintf(why, whylen, "the daemon of %s refused: %s", real, (char *)p);
		err = -EPERM;
	} else if (!err && (type != MSG_OFFER || kc_handover_offer_get(p, len, offer) != 0)) {
		snprintf(why, whylen, "the daemon of %s sent no offer this build can read", real);
		err = -EPROTO;
	} else if (err) {
		snprintf(why, whylen, "the daemon of %s did not answer: %s (it serves one upgrade "
			 "at a time: if another took the mount over, ask again)", real,
			 strerror(-err));
	}
	free(p);
	if (err) {
		close(s);
		return err;
	}
	return s;
}

int kc_upgrade_replay(struct fuse_session *se, const unsigned char *init_in, size_t in_len,
		      const unsigned char *init_out, size_t out_len, char *why, size_t whylen)
{
	int placeholder = open("/dev/null", O_RDWR | O_CLOEXEC);
	int err = placeholder < 0 ? -errno : kc_upgrade_io(se, placeholder);
	io.placeholder = placeholder;
	struct fuse_in_header head = {0}; /* copied: init_in may be unaligned */
	if (in_len >= sizeof(head))
		memcpy(&head, init_in, sizeof(head));
	if (!err && (in_len < sizeof(head) || in_len > sizeof(io.init_in) ||
		     out_len > sizeof(io.init_out) || head.opcode != FUSE_INIT)) {
		snprintf(why, whylen, "no FUSE_INIT of the mount to replay");
		err = -EPROTO;
	}
	if (!err) {
		_Alignas(8) unsigned char in[KC_HANDOVER_INIT_MAX]; /* libfuse reads a header from it */
		memcpy(in, init_in, in_len);
		struct fuse_buf buf = {.size = in_len, .mem = in};
		io.swallow = 1;
		io.swallowed_len = 0;
		fuse_session_process_buf(se, &buf);
		io.swallow = 0;
		/* The same reply, less the unique id (bytes 8-15 of the header). */
		const size_t uo = offsetof(struct fuse_out_header, unique);
		if (io.swallowed_len != out_len || out_len < sizeof(struct fuse_out_header) ||
		    memcmp(io.swallowed, init_out, uo) != 0 ||
		    memcmp(io.swallowed + uo + 8, init_out + uo + 8, out_len - uo - 8) != 0) {
			snprintf(why, whylen, "this build answers the mount's FUSE_INIT otherwise than "
				 "the running daemon (protocol, flags or sizes): the kernel would use "
				 "what the running one negotiated");
			err = -EPROTO;
		}
	}
	if (!err) {
		memcpy(io.init_in, init_in, in_len);
		io.init_in_len = in_len;
		memcpy(io.init_out, init_out, out_len);
		io.init_out_len = out_len;
		io.init_unique = head.unique;
	}
	/* The placeholder stays the session's until kc_upgrade_adopt puts the real one there. */
	return err;
}

int kc_upgrade_replay_init(int sock, struct fuse_session *se, const struct kc_handover_offer *o,
			   char *why, size_t whylen)
{
	int err = kc_upgrade_replay(se, o->init_in, o->init_in_len, o->init_out, o->init_out_len,
				    why, whylen);
	if (!err) {
		err = send_msg(sock, MSG_GO, NULL, 0);
		if (err)
			snprintf(why, whylen, "the running daemon is gone: %s", strerror(-err));
	} else {
		send_msg(sock, MSG_ABORT, why, strlen(why) + 1);
	}
	return err;
}

int kc_upgrade_adopt(int fd)
{
	int fl = fcntl(fd, F_GETFL);
	if (io.placeholder < 0 || fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0 ||
	    dup3(fd, io.placeholder, O_CLOEXEC) < 0)
		return io.placeholder < 0 ? -EBADF : -errno;
	close(fd);
	return 0;
}

int kc_upgrade_receive(int sock, pid_t old, unsigned char **state, size_t *len, int **fds,
		       size_t *nfds, char *why, size_t whylen)
{
	unsigned char *p = NULL;
	size_t plen = 0;
	uint32_t type = 0, n = 0, blen = 0;
	*state = NULL;
	*fds = NULL;
	*nfds = 0;
	/* The old daemon first answers what it has in hand: compiles may run to their end. */
	int err = recv_msg(sock, &type, &p, &plen, 7 * 86400);
	if (!err && type == MSG_FAIL) {
		snprintf(why, whylen, "the running daemon keeps the mount: %s", (char *)p);
		free(p);
		return -EBUSY;
	}
	if (!err && (type != MSG_STATE || plen < 8))
		err = -EPROTO;
	if (!err) {
		memcpy(&n, p, 4);
		memcpy(&blen, p + 4, 4);
		if (blen != plen - 8 || n == 0 || n > (1u << 24))
			err = -EPROTO;
	}
	if (!err && !(*fds = malloc(n * sizeof(int))))
		err = -ENOMEM;
	if (!err)
		err = recv_fds(sock, *fds, n, 60);
	if (err) {
		snprintf(why, whylen, "no state from the running daemon: %s (it gave the upgrade "
			 "up, stopped or died: its log says which)", strerror(-err));
		free(p);
		free(*fds);
		*fds = NULL;
		return err;
	}
	*nfds = n;
	*state = malloc(blen ? blen : 1);
	if (*state)
		memcpy(*state, p + 8, blen);
	*len = blen;
	free(p);
	send_msg(sock, MSG_ACK, NULL, 0);
	/* The store is the old daemon's until it exits. */
	double deadline = mono_now() + 60;
	while (kill(old, 0) == 0 || errno != ESRCH) {
		char stat_path[64], buf[512];
		snprintf(stat_path, sizeof(stat_path), "/proc/%d/stat", (int)old);
		FILE *f = fopen(stat_path, "re");
		int zombie = 0;
		if (f) {
			if (fgets(buf, sizeof(buf), f)) {
				char *rp = strrchr(buf, ')');
				zombie = rp && rp[1] == ' ' && rp[2] == 'Z';
			}
			fclose(f);
		}
		if (zombie)
			break; /* exited; its parent has not reaped it yet */
		if (mono_now() > deadline) {
			snprintf(why, whylen, "the old daemon (pid %d) did not exit", (int)old);
			return -ETIMEDOUT;
		}
		usleep(10000);
	}
	return *state ? 0 : -ENOMEM;
}
