/* holder.c - see holder.h */
#define _GNU_SOURCE
#include "holder.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifdef KC_HAVE_LIBSYSTEMD
#include <systemd/sd-daemon.h>
#endif

#include "hash.h"
#include "idtable.h"
#include "log.h"
#include "unixsock.h"

#define MAX_CONNS 16
#define MAX_MSG 65536
/* The memfd of the mount's state: the epoch (u32), then the FUSE_INIT request's and reply's
 * lengths (u32 each) and bytes. */
#define INIT_AT 4
/* Names in the service manager's file descriptor store. */
#define STORE_FUSE "kcachefs-fuse"
#define STORE_INIT "kcachefs-init"

extern char **environ;

/* The daemon's side. */
static int init_fd = -1;   /* the holder's memfd for FUSE_INIT (the first daemon only) */
static int reg_sock = -1;  /* the connection to the holder, once registered */
static int taking_sock = -1; /* a live upgrade's successor: its connection, said TAKING */

/* The abstract name of the holder of real_mnt (as upgrade.c's, another prefix). */
static void holder_name(const char *real_mnt, char *name, size_t len)
{
	char hex[KC_SHA256_HEXLEN + 1];
	kc_sha256_buf(real_mnt, strlen(real_mnt), hex);
	snprintf(name, len, "kcachefs-holder-%u-%.32s", (unsigned)geteuid(), hex);
}

static socklen_t holder_addr(const char *real_mnt, struct sockaddr_un *a)
{
	char name[100];
	holder_name(real_mnt, name, sizeof(name));
	return kc_abstract_addr(name, a);
}

int kc_holder_listening(const char *real_mnt)
{
	char name[100];
	holder_name(real_mnt, name, sizeof(name));
	return kc_abstract_answers(name, SOCK_SEQPACKET);
}

int kc_holder_clone(int fd)
{
	int c = open("/dev/fuse", O_RDWR | O_CLOEXEC);
	if (c < 0)
		return -errno;
	uint32_t master = (uint32_t)fd;
	if (ioctl(c, FUSE_DEV_IOC_CLONE, &master) != 0) {
		int err = -errno;
		close(c);
		return err;
	}
	return c;
}

/* The mount's FUSE_INIT reached the holder's memfd (kc_holder_note_init). */
static int init_kept;

void kc_holder_note_init(const unsigned char *in, size_t in_len, const unsigned char *out,
			 size_t out_len)
{
	if (init_fd < 0)
		return;
	uint32_t h[2] = {(uint32_t)in_len, (uint32_t)out_len};
	struct iovec v[3] = {{h, sizeof(h)}, {(void *)in, in_len}, {(void *)out, out_len}};
	if (pwritev(init_fd, v, 3, INIT_AT) != (ssize_t)(sizeof(h) + in_len + out_len))
		kc_log(KC_LOG_WARN, "holder: cannot keep the mount's FUSE_INIT (%s): a crash of the "
		       "daemon will cost the mount", strerror(errno));
	else
		init_kept = 1;
	close(init_fd);
	init_fd = -1;
}

int kc_holder_restarted(struct kc_holder_restart *r)
{
	const char *v = getenv(KC_HOLDER_ENV);
	if (!v)
		return 0;
	memset(r, 0, sizeof(*r));
	int ifd = -1, syslog_ = 0;
	unsigned epoch = 0;
	uint32_t h[2] = {0, 0};
	if (sscanf(v, "%d,%d,%u,%d", &r->fuse_fd, &ifd, &epoch, &syslog_) != 4 || r->fuse_fd < 0 ||
	    ifd < 0 || pread(ifd, h, sizeof(h), INIT_AT) != (ssize_t)sizeof(h) ||
	    h[0] > sizeof(r->init_in) || h[1] > sizeof(r->init_out) ||
	    pread(ifd, r->init_in, h[0], INIT_AT + sizeof(h)) != (ssize_t)h[0] ||
	    pread(ifd, r->init_out, h[1], INIT_AT + sizeof(h) + h[0]) != (ssize_t)h[1]) {
		kc_log(KC_LOG_ERR, "%s=%s: not the descriptors of a holder, or no FUSE_INIT in them",
		       KC_HOLDER_ENV, v);
		unsetenv(KC_HOLDER_ENV);
		return -EINVAL;
	}
	close(ifd);
	fcntl(r->fuse_fd, F_SETFD, FD_CLOEXEC);
	r->init_in_len = h[0];
	r->init_out_len = h[1];
	r->epoch = epoch & KC_EPOCH_MASK;
	r->use_syslog = syslog_;
	unsetenv(KC_HOLDER_ENV);
	return 1;
}

static int send_str(int s, const char *what)
{
	return send(s, what, strlen(what), MSG_NOSIGNAL) < 0 ? -errno : 0;
}

/* A connection to the holder of real_mnt (root's or this user's), or -1 (no holder). */
static int holder_connect(const char *real_mnt)
{
	struct sockaddr_un a;
	socklen_t al = holder_addr(real_mnt, &a);
	int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (s < 0 || connect(s, (struct sockaddr *)&a, al) != 0) {
		if (s >= 0)
			close(s);
		return -1; /* no holder */
	}
	struct ucred cred;
	socklen_t cl = sizeof(cred);
	if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 ||
	    (cred.uid != 0 && cred.uid != geteuid())) {
		kc_log(KC_LOG_WARN, "holder: the socket of %s is held by uid %u: not used",
		       real_mnt, (unsigned)cred.uid);
		close(s);
		return -1;
	}
	return s;
}

void kc_holder_taking(const char *mnt)
{
	char real[4096], msg[32];
	if (!realpath(mnt, real))
		return;
	int s = holder_connect(real);
	if (s < 0)
		return;
	int n = snprintf(msg, sizeof(msg), "TAKING%c%d", 0, (int)getpid());
	if (send(s, msg, (size_t)n + 1, MSG_NOSIGNAL) != n + 1) {
		close(s);
		return;
	}
	taking_sock = s;
}

/* Send the message what on s, with fd (SCM_RIGHTS) when fd >= 0. */
static void send_with_fd(int s, const char *what, int fd)
{
	int err = kc_send_fds(s, what, strlen(what), &fd, fd >= 0);
	if (err)
		kc_log(KC_LOG_DEBUG, "holder: reply %s: %s", what, strerror(-err));
}

/* Receive a message of at most len - 1 bytes on s (NUL-terminated) and the descriptor it
 * carries, if any, into *fd (-1 when none). Returns its length, or -1. */
static ssize_t recv_with_fd(int s, char *buf, size_t len, int *fd)
{
	size_t n;
	*fd = -1;
	/* A reply whose descriptor the kernel cut is still the holder's answer: this daemon
	 * runs without the state (no ledger), as when the holder has none to give. */
	ssize_t r = kc_recv_fds(s, buf, len - 1, fd, 1, &n, NULL);
	if (r < 0)
		return -1;
	buf[r] = '\0';
	return r;
}

uint32_t kc_holder_register(const char *real_mnt, int argc, char **argv, const char *cwd,
			    int *state_fd)
{
	*state_fd = -1;
	int s = taking_sock >= 0 ? taking_sock : holder_connect(real_mnt);
	taking_sock = -1;
	if (s < 0)
		return 0;
	/* SERVING\0pid\0cwd\0argv[0]\0argv[1]\0... */
	char msg[MAX_MSG];
	int n = snprintf(msg, sizeof(msg), "SERVING%c%d%c%s%c", 0, (int)getpid(), 0, cwd, 0);
	for (int i = 0; i < argc && n > 0 && (size_t)n < sizeof(msg); i++)
		n += snprintf(msg + n, sizeof(msg) - (size_t)n, "%s%c", argv[i], 0);
	char reply[64] = "";
	ssize_t r = -1;
	if (n > 0 && (size_t)n < sizeof(msg) && send(s, msg, (size_t)n, MSG_NOSIGNAL) == n) {
		struct pollfd p = {s, POLLIN, 0};
		if (poll(&p, 1, 10000) == 1)
			r = recv_with_fd(s, reply, sizeof(reply), state_fd);
	}
	unsigned epoch = 0;
	if (r <= 0 || sscanf(reply, "EPOCH %u", &epoch) != 1) {
		kc_log(KC_LOG_WARN, "holder of %s did not answer: a crash of this daemon costs the "
		       "mount", real_mnt);
		if (*state_fd >= 0)
			close(*state_fd);
		*state_fd = -1;
		close(s);
		return 0;
	}
	reg_sock = s;
	return epoch & KC_EPOCH_MASK;
}

void kc_holder_stop(void)
{
	if (reg_sock >= 0 && send_str(reg_sock, "STOP") != 0)
		kc_log(KC_LOG_WARN, "holder: cannot tell it of the stop: %s", strerror(errno));
}

int kc_holder_connected(void)
{
	return reg_sock >= 0;
}

int kc_holder_init_kept(void)
{
	return init_kept;
}

void kc_holder_handover(void)
{
	if (reg_sock >= 0)
		send_str(reg_sock, "HANDOVER");
}

void kc_unmount_detached(const char *mnt)
{
	if (geteuid() == 0) {
		if (umount2(mnt, MNT_DETACH) != 0 && errno != EINVAL && errno != ENOENT)
			kc_log(KC_LOG_WARN, "cannot unmount %s: %s", mnt, strerror(errno));
		return;
	}
	pid_t pid = fork();
	if (pid == 0) {
		execlp("fusermount3", "fusermount3", "-u", "-z", "--", mnt, (char *)NULL);
		_exit(127);
	}
	if (pid > 0)
		waitpid(pid, NULL, 0);
}

/* The holder's side. */

static struct {
	const char *mnt;
	int fuse_fd, init_fd, lsock, sigfd;
	int use_syslog;
	struct pollfd conn[MAX_CONNS];
	int nconn;
	int current;           /* the serving daemon's connection, or -1 */
	pid_t current_pid;     /* its pid (0: none) */
	pid_t starting;        /* a daemon the holder started that has not said it serves */
	int exe_fd;            /* the binary of the last daemon that served */
	char *msg;             /* its SERVING message: pid, cwd, argv */
	size_t msg_len;
	uint32_t epoch;
	double restarts[KC_HOLDER_RESTARTS];
	int nrestarts;
	double restart_at;     /* when to start a daemon (0: not due) */
	double handover_until; /* a HANDOVER was said: the new daemon must serve before this */
	int taking_fd;         /* the connection of a live upgrade's successor (TAKING), or -1 */
	pid_t taking_pid;      /* its pid, until it serves (its connection may be gone) */
	int stopping;
	int stored;            /* the descriptors are in the service manager's store */
} h;

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void drop_conn(int i)
{
	if (h.conn[i].fd == h.taking_fd)
		h.taking_fd = -1;
	close(h.conn[i].fd);
	if (h.current == i)
		h.current = -1;
	else if (h.current == h.nconn - 1)
		h.current = i;
	h.conn[i] = h.conn[--h.nconn];
}

/* Put the descriptor and the state's memfd in the service manager's file descriptor store
 * (systemd's FileDescriptorStoreMax=, NOTIFY_SOCKET): a holder that dies (killed with its
 * daemon) leaves the mount to the next start of the service (kc_holder_resume). */
static void store_fds(void)
{
#ifdef KC_HAVE_LIBSYSTEMD
	if (!getenv("NOTIFY_SOCKET"))
		return;
	int r = sd_pid_notify_with_fds(0, 0, "FDSTORE=1\nFDNAME=" STORE_FUSE, &h.fuse_fd, 1);
	if (r > 0)
		r = sd_pid_notify_with_fds(0, 0, "FDSTORE=1\nFDNAME=" STORE_INIT, &h.init_fd, 1);
	h.stored = r > 0;
	kc_log(r > 0 ? KC_LOG_INFO : KC_LOG_WARN, "holder of %s: %s", h.mnt, r > 0
	       ? "the mount's descriptor is in the service manager's store too: a restart of the "
		 "service after the holder died takes it back"
	       : "the service manager took no descriptor (FileDescriptorStoreMax=, NotifyAccess=)");
#endif
}

static void unstore_fds(void)
{
#ifdef KC_HAVE_LIBSYSTEMD
	if (h.stored)
		sd_notify(0, "FDSTOREREMOVE=1\nFDNAME=" STORE_FUSE);
	if (h.stored)
		sd_notify(0, "FDSTOREREMOVE=1\nFDNAME=" STORE_INIT);
#endif
	h.stored = 0;
}

/* Let the mount go: the kernel aborts its connection once no device of it is open. */
_Noreturn static void leave(int status, const char *why)
{
	kc_log(status ? KC_LOG_ERR : KC_LOG_INFO, "holder of %s: %s", h.mnt, why);
	unstore_fds();
	if (h.fuse_fd >= 0)
		close(h.fuse_fd);
	_exit(status);
}

/* A stop with no daemon running: no one unmounts; without it the mount would stay, its
 * connection aborted (Transport endpoint is not connected). The descriptor goes first, so
 * that fusermount3 finds the mount dead rather than waiting on it. */
_Noreturn static void leave_unmounting(const char *why)
{
	unstore_fds();
	if (h.fuse_fd >= 0)
		close(h.fuse_fd);
	h.fuse_fd = -1;
	kc_unmount_detached(h.mnt);
	leave(0, why);
}

/* The mount goes (a stop, an unmount): close the descriptor and exit once no daemon runs. */
static void let_go(void)
{
	h.stopping = 2;
	unstore_fds(); /* else the service manager's copy would keep the connection */
	if (h.fuse_fd >= 0)
		close(h.fuse_fd);
	h.fuse_fd = -1;
	if (h.current < 0 && !h.starting && !h.handover_until)
		leave(0, "the mount is gone, and no daemon runs");
}

/* Exit, leaving the mount to the service manager's store. */
_Noreturn static void keep_and_exit(void)
{
	kc_log(KC_LOG_INFO, "holder of %s: stopped; the mount stays in the service manager's "
	       "store: a restart of the service serves it again, a stop unmounts it", h.mnt);
	_exit(0);
}

/* The daemon is gone without a word: start another, unless they keep dying. */
static void died(const char *how)
{
	if (h.stopping == 3)
		keep_and_exit();
	double t = now_s();
	int recent = 0;
	for (int i = 0; i < h.nrestarts; i++)
		recent += t - h.restarts[i] < KC_HOLDER_WINDOW;
	if (h.stopping)
		leave_unmounting("stopped, and its daemon is gone: the mount goes");
	if (recent >= KC_HOLDER_RESTARTS) {
		char why[256];
		snprintf(why, sizeof(why), "the daemon %s, after %d restarts within %d s: giving up; "
			 "the mount is lost (Transport endpoint is not connected) until it is "
			 "unmounted and mounted again", how, recent, KC_HOLDER_WINDOW);
		leave(1, why);
	}
	double pause = recent ? 0.25 * (1 << (recent - 1)) : 0;
	kc_log(KC_LOG_WARN, "holder of %s: the daemon (pid %d) %s; the requests it had read are "
	       "answered with an error; starting another in %.2f s (restart %d within %d s)",
	       h.mnt, (int)(h.current_pid ? h.current_pid : h.starting ? h.starting : h.taking_pid), how, pause, recent + 1,
	       KC_HOLDER_WINDOW);
	h.current_pid = 0;
	h.starting = 0;
	h.taking_pid = 0;
	h.restart_at = t + pause;
	h.handover_until = 0;
}

static void restart(void)
{
	h.restart_at = 0;
	if (!h.msg)
		leave(1, "the daemon died before it ever served: nothing to start again");
	if (h.nrestarts == KC_HOLDER_RESTARTS)
		memmove(h.restarts, h.restarts + 1, sizeof(h.restarts[0]) * (KC_HOLDER_RESTARTS - 1));
	else
		h.nrestarts++;
	h.restarts[h.nrestarts - 1] = now_s();
	h.epoch = (h.epoch + 1) & KC_EPOCH_MASK;
	if (!h.epoch)
		h.epoch = 1;
	if (pwrite(h.init_fd, &h.epoch, sizeof(h.epoch), 0) != (ssize_t)sizeof(h.epoch))
		kc_log(KC_LOG_WARN, "holder: cannot record epoch %u: %s", h.epoch, strerror(errno));
	/* msg: SERVING\0pid\0cwd\0argv... */
	const char *cwd = h.msg + strlen(h.msg) + 1;
	cwd += strlen(cwd) + 1;
	char *argv[256];
	int argc = 0;
	for (const char *p = cwd + strlen(cwd) + 1; p < h.msg + h.msg_len && argc < 255;
	     p += strlen(p) + 1)
		argv[argc++] = (char *)p;
	argv[argc] = NULL;
	pid_t pid = fork();
	if (pid == 0) {
		sigset_t none;
		sigemptyset(&none);
		sigprocmask(SIG_SETMASK, &none, NULL);
		int f = dup(h.fuse_fd), i = dup(h.init_fd);
		char env[96];
		snprintf(env, sizeof(env), "%d,%d,%u,%d", f, i, h.epoch, h.use_syslog);
		setenv(KC_HOLDER_ENV, env, 1);
		if (chdir(cwd) != 0)
			kc_log(KC_LOG_WARN, "holder: the daemon's directory %s: %s", cwd, strerror(errno));
		if (h.exe_fd >= 0)
			execveat(h.exe_fd, "", argv, environ, AT_EMPTY_PATH);
		execv(argv[0], argv);
		kc_log(KC_LOG_ERR, "holder: cannot run %s: %s", argv[0], strerror(errno));
		_exit(127);
	}
	if (pid < 0) {
		died("could not be started again (fork failed)");
		return;
	}
	h.starting = pid;
	kc_log(KC_LOG_INFO, "holder of %s: started the daemon again, pid %d, epoch %u", h.mnt,
	       (int)pid, h.epoch);
}

/* A message from connection i. */
static void message(int i)
{
	char buf[MAX_MSG];
	ssize_t n = recv(h.conn[i].fd, buf, sizeof(buf) - 1, MSG_DONTWAIT);
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return;
	if (n <= 0) { /* gone */
		int was_current = h.current == i, was_taking = h.conn[i].fd == h.taking_fd;
		drop_conn(i);
		if (was_taking && h.handover_until) {
			/* The new daemon died (or failed at start) after the old one left: no
			 * daemon serves the mount, start one now. */
			h.handover_until = 0;
			died("that was to take the mount over is gone before it served");
			return;
		}
		if (!was_current)
			return;
		if (h.stopping == 2)
			leave(0, "the daemon stopped, and the mount is gone");
		if (h.handover_until)
			return; /* its successor says it serves, or the wait ends */
		died("died");
		return;
	}
	buf[n] = '\0';
	if (strcmp(buf, "STOP") == 0 && i == h.current) {
		/* The daemon unmounts: its device is the connection's last from here on. The
		 * holder exits once the daemon is gone (a service manager then finds no process
		 * it should stop). */
		let_go();
		kc_log(KC_LOG_INFO, "holder of %s: the daemon stops: the mount goes with it", h.mnt);
	} else if (strcmp(buf, "HANDOVER") == 0 && i == h.current) {
		kc_log(KC_LOG_INFO, "holder of %s: pid %d hands the mount to a new daemon", h.mnt,
		       (int)h.current_pid);
		h.handover_until = now_s() + KC_HOLDER_HANDOVER_WAIT;
		h.current = -1;
		h.current_pid = 0;
		if (h.taking_pid && h.taking_fd < 0) { /* its successor is gone already */
			h.handover_until = 0;
			died("that was to take the mount over is gone before it served");
		}
	} else if (n > 7 && memcmp(buf, "TAKING", 7) == 0) {
		/* A live upgrade's new daemon: while this connection stays open (across its
		 * daemonizing fork too) it lives; closed before it serves, it died. */
		h.taking_fd = h.conn[i].fd;
		h.taking_pid = (pid_t)atoi(buf + 7);
		kc_log(KC_LOG_DEBUG, "holder of %s: pid %d takes the mount over", h.mnt,
		       (int)h.taking_pid);
	} else if (n > 8 && memcmp(buf, "SERVING", 8) == 0) {
		pid_t pid = (pid_t)atoi(buf + 8);
		char *copy = malloc((size_t)n), path[64], reply[32];
		if (!copy)
			return;
		memcpy(copy, buf, (size_t)n);
		free(h.msg);
		h.msg = copy;
		h.msg_len = (size_t)n;
		snprintf(path, sizeof(path), "/proc/%d/exe", (int)pid);
		int exe = open(path, O_RDONLY | O_CLOEXEC);
		if (exe >= 0) {
			if (h.exe_fd >= 0)
				close(h.exe_fd);
			h.exe_fd = exe;
		}
		h.current = i;
		h.current_pid = pid;
		h.starting = 0;
		h.handover_until = 0;
		if (h.conn[i].fd == h.taking_fd) {
			h.taking_fd = -1;
			h.taking_pid = 0;
		}
		snprintf(reply, sizeof(reply), "EPOCH %u", h.epoch);
		send_with_fd(h.conn[i].fd, reply, h.init_fd); /* with the state: its inode ledger */
		kc_log(KC_LOG_DEBUG, "holder of %s: pid %d serves, epoch %u", h.mnt, (int)pid, h.epoch);
		if (h.stopping == 1 || h.stopping == 3) {
			/* A stop came while the mount was handed over (a live upgrade): it is this
			 * daemon's now. */
			kc_log(KC_LOG_INFO, "holder of %s: a stop came during the handover: stopping "
			       "the new daemon, pid %d", h.mnt, (int)pid);
			kill(pid, h.stopping == 3 ? SIGUSR1 : SIGTERM);
		}
	}
}

static void signalled(void)
{
	struct signalfd_siginfo si;
	while (read(h.sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
		if (si.ssi_signo == SIGCHLD) {
			int status;
			pid_t pid;
			while ((pid = waitpid(-1, &status, WNOHANG)) > 0)
				if (pid == h.starting) /* with the mount gone, died() exits */
					died(WIFSIGNALED(status) ? "was killed before it served"
								 : "exited before it served");
			continue;
		}
		pid_t d = h.current_pid ? h.current_pid : h.starting;
		if (d)
			kc_log(KC_LOG_INFO, "holder of %s: %s: stopping the daemon (pid %d)", h.mnt,
			       strsignal((int)si.ssi_signo), (int)d);
		else
			kc_log(KC_LOG_INFO, "holder of %s: %s: no daemon runs now", h.mnt,
			       strsignal((int)si.ssi_signo));
		if (h.stored) {
			/* Under a service manager that keeps the descriptor: a stop or a restart,
			 * which it alone can tell apart. The mount is left to its store: the daemon
			 * goes without unmounting (SIGUSR1: its compiles end, the requests it had
			 * read get an error, its shares to the cluster store end within
			 * stop_timeout); a restart takes the mount back, a stop unmounts it (the
			 * unit's ExecStopPost) and closes the store. */
			h.stopping = 3;
			if (!d && h.handover_until)
				continue; /* the new daemon is stopped once it says it serves */
			if (!d)
				keep_and_exit();
			kill(d, SIGUSR1);
			continue;
		}
		/* A stop: the daemon stops (and says so); without one, the mount goes now. */
		h.stopping = h.stopping ? h.stopping : 1;
		if (!d && h.handover_until) {
			/* Handed over: the new daemon is stopped once it says it serves (or the
			 * mount goes should it die first). */
			kc_log(KC_LOG_INFO, "holder of %s: the mount is handed over: the new daemon "
			       "stops once it serves", h.mnt);
			continue;
		}
		if (!d)
			leave_unmounting("stopped with no daemon running: the mount goes");
		kill(d, SIGTERM);
	}
}

_Noreturn static void holder_main(void)
{
	prctl(PR_SET_NAME, "kcachefs-holder", 0, 0, 0);
	kc_log(KC_LOG_INFO, "holder of %s: pid %d keeps the mount's descriptor; a daemon that "
	       "dies is started again", h.mnt, (int)getpid());
	for (;;) {
		struct pollfd p[MAX_CONNS + 3];
		int k = 0;
		p[k++] = (struct pollfd){h.fuse_fd, 0, 0}; /* POLLERR: the connection is gone */
		p[k++] = (struct pollfd){h.sigfd, POLLIN, 0};
		p[k++] = (struct pollfd){h.lsock, h.nconn < MAX_CONNS ? POLLIN : 0, 0};
		for (int i = 0; i < h.nconn; i++)
			p[k++] = (struct pollfd){h.conn[i].fd, POLLIN, 0};
		double t = now_s(), due = 0;
		if (h.restart_at)
			due = h.restart_at;
		if (h.handover_until && (!due || h.handover_until < due))
			due = h.handover_until;
		int wait = due ? (int)((due - t) * 1000) + 1 : -1;
		if (due && wait < 0)
			wait = 0;
		int r = poll(p, (nfds_t)k, wait);
		if (r < 0 && errno != EINTR)
			leave(1, "poll failed");
		t = now_s();
		if (h.fuse_fd >= 0 && (p[0].revents & (POLLERR | POLLHUP)))
			let_go(); /* unmounted */
		if (p[1].revents)
			signalled();
		if (p[2].revents & POLLIN) {
			int c = accept4(h.lsock, NULL, NULL, SOCK_CLOEXEC);
			struct ucred cred;
			socklen_t cl = sizeof(cred);
			if (c >= 0 && (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 ||
				       (cred.uid != 0 && cred.uid != geteuid())))
				close(c);
			else if (c >= 0)
				h.conn[h.nconn++] = (struct pollfd){c, POLLIN, 0};
		}
		/* Connections, last first: one dropped is replaced by the last. */
		for (int i = k - 1; i >= 3; i--)
			if (p[i].revents && i - 3 < h.nconn && h.conn[i - 3].fd == p[i].fd)
				message(i - 3);
		if (h.handover_until && t >= h.handover_until) {
			h.handover_until = 0;
			died("that was to take the mount over did not serve within the wait");
		}
		if (h.restart_at && t >= h.restart_at)
			restart();
	}
}

/* Become the holder of real_mnt's descriptor fuse_fd, with the state's memfd ifd and the
 * listening socket ls: only they stay open (the store, the log's pipe... are the daemon's). */
static void holder_setup(const char *real_mnt, int fuse_fd, int ifd, int ls, int use_syslog)
{
	sigset_t sigs;
	sigemptyset(&sigs);
	sigaddset(&sigs, SIGCHLD);
	sigaddset(&sigs, SIGTERM);
	sigaddset(&sigs, SIGINT);
	sigaddset(&sigs, SIGHUP);
	struct sigaction dfl = {.sa_handler = SIG_DFL};
	sigaction(SIGTERM, &dfl, NULL);
	sigaction(SIGINT, &dfl, NULL);
	sigaction(SIGHUP, &dfl, NULL);
	signal(SIGPIPE, SIG_IGN);
	sigprocmask(SIG_BLOCK, &sigs, NULL);
	int sfd = signalfd(-1, &sigs, SFD_CLOEXEC | SFD_NONBLOCK);
	int keep[] = {fuse_fd, ifd, ls, sfd};
	for (int i = 0; i < 4; i++) { /* to 3..6, in order, out of the way first */
		int moved = fcntl(keep[i], F_DUPFD_CLOEXEC, 100 + i);
		close(keep[i]);
		keep[i] = moved;
	}
	for (int i = 0; i < 4; i++) {
		dup3(keep[i], 3 + i, O_CLOEXEC);
		close(keep[i]);
	}
	close_range(7, ~0u, 0);
	memset(&h, 0, sizeof(h));
	h.mnt = strdup(real_mnt);
	h.fuse_fd = 3;
	h.init_fd = 4;
	h.lsock = 5;
	h.sigfd = 6;
	h.use_syslog = use_syslog;
	h.current = -1;
	h.exe_fd = -1;
	h.taking_fd = -1;
}

int kc_holder_start(const char *real_mnt, int fuse_fd, int use_syslog, int daemon_fd)
{
	struct sockaddr_un a;
	socklen_t al = holder_addr(real_mnt, &a);
	int ifd = memfd_create("kcachefs-init", MFD_CLOEXEC);
	int ls = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	int err = ifd < 0 || ls < 0 ? -errno : 0;
	if (!err && (bind(ls, (struct sockaddr *)&a, al) != 0 || listen(ls, 8) != 0))
		err = -errno; /* EADDRINUSE: another holder serves this mountpoint */
	int clone = err ? -1 : kc_holder_clone(fuse_fd);
	if (clone < 0 && !err)
		err = clone;
	pid_t pid = err ? -1 : fork();
	if (pid < 0 && !err)
		err = -errno;
	if (err) {
		if (ifd >= 0)
			close(ifd);
		if (ls >= 0)
			close(ls);
		if (clone >= 0)
			close(clone);
		return err;
	}
	if (pid == 0) {
		/* The daemon: its descriptor's number now names the clone; the holder has the
		 * first one. */
		close(ls);
		int fl = fcntl(clone, F_GETFL);
		if (fl < 0 || fcntl(clone, F_SETFL, fl | O_NONBLOCK) != 0 ||
		    dup3(clone, fuse_fd, O_CLOEXEC) < 0) {
			kc_log(KC_LOG_ERR, "holder: cannot serve through a clone of the descriptor: %s",
			       strerror(errno));
			_exit(1);
		}
		close(clone);
		init_fd = ifd;
		return 0;
	}
	prctl(PR_SET_NAME, "kcachefs-holder", 0, 0, 0); /* in ps, at once */
	close(clone);
	if (daemon_fd >= 0)
		close(daemon_fd);
	holder_setup(real_mnt, fuse_fd, ifd, ls, use_syslog);
	h.starting = pid; /* watched until it says it serves */
	store_fds();
	holder_main();
}

int kc_holder_stored(int *fuse_fd, int *init_fd)
{
	*fuse_fd = *init_fd = -1;
#ifdef KC_HAVE_LIBSYSTEMD
	char **names = NULL;
	int n = sd_listen_fds_with_names(1, &names);
	for (int i = 0; i < n; i++) {
		int fd = SD_LISTEN_FDS_START + i;
		if (names && strcmp(names[i], STORE_FUSE) == 0 && *fuse_fd < 0)
			*fuse_fd = fd;
		else if (names && strcmp(names[i], STORE_INIT) == 0 && *init_fd < 0)
			*init_fd = fd;
		else
			close(fd); /* not ours: nothing else is stored */
		fcntl(fd, F_SETFD, FD_CLOEXEC);
	}
	for (int i = 0; names && i < n; i++)
		free(names[i]);
	free(names);
	if (*fuse_fd >= 0 && *init_fd >= 0)
		return 1;
	if (*fuse_fd >= 0)
		close(*fuse_fd);
	if (*init_fd >= 0)
		close(*init_fd);
	*fuse_fd = *init_fd = -1;
#endif
	return 0;
}

_Noreturn void kc_holder_resume(const char *real_mnt, int fuse_fd, int init_fd, int argc, char **argv,
		      const char *cwd, int use_syslog)
{
	struct sockaddr_un a;
	socklen_t al = holder_addr(real_mnt, &a);
	int ls = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (ls < 0 || bind(ls, (struct sockaddr *)&a, al) != 0 || listen(ls, 8) != 0) {
		kc_log(KC_LOG_ERR, "holder of %s: cannot listen (%s): another holder serves it?",
		       real_mnt, strerror(errno));
		_exit(1);
	}
	holder_setup(real_mnt, fuse_fd, init_fd, ls, use_syslog);
	h.stored = 1;
	if (pread(h.init_fd, &h.epoch, sizeof(h.epoch), 0) != (ssize_t)sizeof(h.epoch))
		h.epoch = 0;
	/* What a restart runs: this very command, in this directory. */
	char msg[MAX_MSG];
	int n = snprintf(msg, sizeof(msg), "SERVING%c%d%c%s%c", 0, (int)getpid(), 0, cwd, 0);
	for (int i = 0; i < argc && n > 0 && (size_t)n < sizeof(msg); i++)
		n += snprintf(msg + n, sizeof(msg) - (size_t)n, "%s%c", argv[i], 0);
	if (n <= 0 || (size_t)n >= sizeof(msg) || !(h.msg = malloc((size_t)n)))
		leave(1, "cannot record the command line");
	memcpy(h.msg, msg, (size_t)n);
	h.msg_len = (size_t)n;
	h.exe_fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
	kc_log(KC_LOG_INFO, "holder of %s: the service manager kept the mount (epoch %u): "
	       "starting a daemon on it", h.mnt, h.epoch);
	h.restart_at = now_s();
	holder_main();
}
