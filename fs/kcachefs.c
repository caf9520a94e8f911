/* kcachefs.c - kcachefs [options] BACKING_DIR MOUNTPOINT
 *
 * Option parsing is libfuse's (fuse_opt_parse for the mount's -o options, then
 * fuse_parse_cmdline for -f, -d, -s and the mountpoint), so the program is mountable from
 * fstab through mount.fuse3. Exit status: 0 after a clean unmount, 1 on a start-up error,
 * 2 on a usage error (a missing argument, an unknown option or a bad value).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <openssl/crypto.h>
#include <openssl/opensslv.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "compile.h"
#include "stage.h"
#include "fs.h"
#include "history.h"
#include "kc_build.h"
#include "life.h"
#include "unixsock.h"
#include "log.h"
#include "remote_tier.h"
#include "reqtimeout.h"

struct kc_opts {
	char *backing;
	char *nvcc, *arch, *flags, *log_level, *compiler;
	char *jobs, *compile_timeout, *max_source_size, *max_inodes; /* numbers, checked in main */
	char *nvrtc_idle, *ahead, *stop_timeout;
	char *max_size, *max_entries, *compile_uids;
	char *remote, *remote_auth, *remote_key, *remote_mode; /* the cluster store */
	char *remote_lease, *remote_wait, *remote_timeout;
	int autocompile, verify_keys, key_paths, holder;
};

#define OPT(t, p) {t, offsetof(struct kc_opts, p), 1}
static const struct fuse_opt kc_opt_spec[] = {
	OPT("nvcc=%s", nvcc),
	OPT("compiler=%s", compiler),
	OPT("arch=%s", arch),
	OPT("flags=%s", flags),
	OPT("jobs=%s", jobs),
	OPT("ahead=%s", ahead),
	OPT("compile_timeout=%s", compile_timeout),
	OPT("stop_timeout=%s", stop_timeout),
	OPT("nvrtc_idle=%s", nvrtc_idle),
	OPT("max_source_size=%s", max_source_size),
	OPT("max_inodes=%s", max_inodes),
	OPT("max_size=%s", max_size),
	OPT("max_entries=%s", max_entries),
	OPT("log_level=%s", log_level),
	OPT("autocompile", autocompile),
	OPT("verify_keys", verify_keys),
	OPT("key_paths", key_paths),
	OPT("holder", holder),
	OPT("compile_uids=%s", compile_uids),
	OPT("remote=%s", remote),
	OPT("remote_auth=%s", remote_auth),
	OPT("remote_key=%s", remote_key),
	OPT("remote_mode=%s", remote_mode),
	OPT("remote_lease=%s", remote_lease),
	OPT("remote_wait=%s", remote_wait),
	OPT("remote_timeout=%s", remote_timeout),
	FUSE_OPT_END,
};

static int opt_proc(void *data, const char *arg, int key, struct fuse_args *outargs)
{
	struct kc_opts *o = data;
	(void)outargs;
	if (key == FUSE_OPT_KEY_NONOPT && !o->backing) {
		o->backing = strdup(arg);
		return 0; /* consumed: the next non-option is the mountpoint */
	}
	return 1;
}

/* Users must reach the store only through the mount (its entries belong to their creators
 * there too, so a user who can enter it could rewrite files and records behind the mount).
 * Warn when no directory above the backing directory keeps other users out. */
static void warn_if_reachable(const char *backing)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s", backing);
	for (char *slash = strrchr(path, '/'); slash; slash = strrchr(path, '/')) {
		if (slash == path)
			slash[1] = '\0';
		else
			*slash = '\0';
		struct stat st;
		if (stat(path, &st) != 0 || !(st.st_mode & S_IXOTH))
			return; /* this one keeps others out */
		if (slash == path)
			break;
	}
	kc_log(KC_LOG_WARN, "the backing directory %s can be reached by every user, who could "
	       "change entries behind the mount; put it in a directory only root can enter "
	       "(chmod 700 its parent)", backing);
}

/* An entry left the tree: the kernel must not keep showing it. */
static void on_evicted(void *arg, const char *rel_path)
{
	struct kc_fs *fs = arg;
	kc_notifier_inval_path(&fs->notifier, rel_path);
}

static void usage(const char *prog)
{
	printf("usage: %s [options] BACKING_DIR MOUNTPOINT\n"
	       "       %s [-f] --upgrade MOUNTPOINT   take over a running daemon's mount\n\n"
	       "A self-populating cache of compiled CUDA kernels: the first open of\n"
	       "kernel.<name>.<hash>/kernel.cubin compiles the staged kernel.cu with the staged\n"
	       "kernel.flags, once, while concurrent openers wait.\n\n"
	       "kcachefs options:\n"
	       "    -o nvcc=PATH           compiler (default $CUDA_HOME/bin/nvcc, nvcc on PATH,\n"
	       "                           /usr/local/cuda/bin/nvcc)\n"
	       "    -o compiler=nvcc|nvrtc compile backend for entries that do not choose one\n"
	       "                           in kernel.flags (default nvcc)\n"
	       "    -o arch=sm_XY[a]       target (default: the node's GPU, else %s)\n"
	       "    -o flags='A B'         arguments added to every compile (blank separated;\n"
	       "                           escape commas as \\,)\n"
	       "    -o jobs=N              concurrent compiles, at most 256 (default: online CPUs)\n"
	       "    -o ahead=N             when a kernel another image asked is asked under new\n"
	       "                           headers, compile up to N of that image's others ahead,\n"
	       "                           in idle job slots (default %d, at most %d); 0: off\n"
	       "    -o compile_timeout=S   kill a compile after S seconds (default %d)\n"
	       "    -o stop_timeout=S      at a stop, wait at most S seconds for the cluster\n"
	       "                           store's shares in hand (default %d); 0: drop them\n"
	       "    -o nvrtc_idle=S        stop a warm NVRTC worker idle for S seconds\n"
	       "                           (default %d); 0: a process per NVRTC compile\n"
	       "    -o autocompile         compile entries that have kernel.cu but no kernel.flags\n"
	       "    -o compile_uids=N      run each compile as a uid of its own, N to N+255,\n"
	       "                           which no user may have (default for a daemon run\n"
	       "                           as root: the first range from %u that no other\n"
	       "                           daemon holds); compile_uids=daemon: as the daemon\n"
	       "    -o verify_keys         an entry's <hash> must be the key of its kernel.cu and\n"
	       "                           kernel.flags (src/entry/key.h), or they are refused\n"
	       "    -o key_paths           keep include roots' paths in the cluster's keys: a\n"
	       "                           cubin naming them (__FILE__) is shared only between\n"
	       "                           nodes with the same paths\n"
	       "    -o holder              keep the mount's descriptor in a process of its own,\n"
	       "                           which starts the daemon again when it dies: a\n"
	       "                           crash costs the requests in flight, not the mount\n"
	       "    -o max_source_size=B   largest kernel.cu/kernel.flags accepted (default %u)\n"
	       "    -o max_size=SIZE       evict least recently used entries when their bytes\n"
	       "                           exceed SIZE (K, M, G, T suffixes; default no bound)\n"
	       "    -o max_entries=N       evict when more entries than N are published\n"
	       "    -o max_inodes=N        inodes kept for the kernel before it is asked to\n"
	       "                           forget the least recently used (default: a quarter\n"
	       "                           of the open file limit)\n"
	       "    -o remote=URL          share compiled cubins with the other nodes of a cluster\n"
	       "                           through a store: dir:PATH (a shared filesystem),\n"
	       "                           redis://HOST[:PORT][/DB], redis+unix:///PATH[?db=N],\n"
	       "                           several redis URLs joined by | (shards)\n"
	       "    -o remote_auth=FILE    Redis \"USER PASSWORD\" or \"PASSWORD\" (root's, mode 600)\n"
	       "    -o remote_key=FILE     cluster secret (root's, mode 600): objects are signed\n"
	       "                           (HMAC-SHA256) and unsigned ones refused\n"
	       "    -o remote_mode=rw|ro   ro: use the store's objects, never write it (default rw)\n"
	       "    -o remote_lease=S      a compile's lease on its key, renewed every second\n"
	       "                           while it runs (a holder silent for 3 s is taken\n"
	       "                           over); longer leases in the store are ignored\n"
	       "                           (default %d)\n"
	       "    -o remote_wait=S       wait at most S s for another node's compile, then\n"
	       "                           compile here (default %d)\n"
	       "    -o remote_timeout=MS   bound of each store operation (default %d)\n"
	       "    -o log_level=LEVEL     error, warning, info (default) or debug\n\n",
	       prog, prog, KC_DEFAULT_ARCH, KC_DEFAULT_AHEAD, KC_HISTORY_MAX_RECIPES,
	       KC_DEFAULT_COMPILE_TIMEOUT, KC_DEFAULT_STOP_TIMEOUT, KC_NVRTC_IDLE_DEFAULT,
	       KC_DEFAULT_COMPILE_UIDS,
	       KC_DEFAULT_MAX_SOURCE, KC_REMOTE_DEFAULT_LEASE, KC_REMOTE_DEFAULT_WAIT,
	       KC_REMOTE_DEFAULT_TIMEOUT);
	fuse_cmdline_help();
	fuse_lowlevel_help();
}

static void version(void)
{
	printf("kcachefs %s\n", KC_VERSION);
	printf("libfuse %s (built against %s)\n", fuse_pkgversion(), KC_FUSE_VERSION);
	printf("OpenSSL %s (built against %s)\n", OpenSSL_version(OPENSSL_VERSION_STRING),
	       OPENSSL_VERSION_TEXT);
	printf("CUDA %s (built against %s)\n", KC_CUDA_VERSION, KC_CUDA_HOME);
#ifdef KC_HAVE_LIBSYSTEMD
	printf("systemd file descriptor store: yes (libsystemd)\n");
#else
	printf("systemd file descriptor store: no (built without libsystemd)\n");
#endif
}

/* Refuse a mountpoint inside the backing directory or the reverse: the daemon would read
 * its own mount (and wait on itself), or show its tree inside itself. */
static int check_overlap(const char *backing, const char *mnt)
{
	char a[PATH_MAX], b[PATH_MAX];
	if (!realpath(backing, a) || !realpath(mnt, b))
		return 0; /* reported by whoever opens them */
	size_t la = strlen(a), lb = strlen(b);
	int nested = (strncmp(a, b, lb) == 0 && (a[lb] == '/' || a[lb] == '\0' || lb == 1)) ||
		     (strncmp(a, b, la) == 0 && (b[la] == '/' || b[la] == '\0' || la == 1));
	if (nested) {
		fprintf(stderr, "kcachefs: backing directory %s and mountpoint %s overlap\n", a, b);
		return -1;
	}
	return 0;
}

/* The resolved path of mountpoint mnt without a look inside it: a daemon started again on
 * a mount whose daemon died must not stat it (the request would wait for itself). The
 * directory above is resolved; the last name is taken as it is. */
static void mountpoint_path(const char *mnt, char *out, size_t len)
{
	char dir[PATH_MAX], real[PATH_MAX] = "/";
	snprintf(dir, sizeof(dir), "%s", mnt);
	size_t n = strlen(dir);
	while (n > 1 && dir[n - 1] == '/')
		dir[--n] = '\0';
	char *slash = strrchr(dir, '/');
	const char *base = slash ? slash + 1 : dir;
	if (slash && slash != dir)
		*slash = '\0';
	int resolved = slash == dir || realpath(slash ? dir : ".", real);
	size_t rl = strlen(real), bl = strlen(base), sep = strcmp(real, "/") != 0;
	if (!resolved || !*base || rl + sep + bl + 1 > len) {
		snprintf(out, len, "%s", mnt);
		return;
	}
	memcpy(out, real, rl);
	out[rl] = '/';
	memcpy(out + rl + sep, base, bl + 1);
}

/* Undo the octal escapes (\040 for a blank...) of a path in /proc/self/mountinfo. */
static void unescape_mount_path(char *p)
{
	char *out = p;
	for (; *p; p++) {
		if (p[0] == '\\' && p[1] >= '0' && p[1] <= '3' && p[2] >= '0' && p[2] <= '7' &&
		    p[3] >= '0' && p[3] <= '7') {
			*out++ = (char)((p[1] - '0') << 6 | (p[2] - '0') << 3 | (p[3] - '0'));
			p += 3;
		} else {
			*out++ = *p;
		}
	}
	*out = '\0';
}

/* Nonzero if the mount visible at mnt (a resolved path) is a kcachefs mount: a second one
 * would hide it, and its clients would silently lose it. */
static int kcachefs_mounted_on(const char *mnt)
{
	FILE *f = fopen("/proc/self/mountinfo", "re");
	char *line = NULL;
	size_t cap = 0;
	int found = 0;
	if (!f)
		return 0;
	while (getline(&line, &cap, f) > 0) {
		/* ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE ... */
		char *save, *field = strtok_r(line, " ", &save), *point = NULL;
		for (int i = 1; field && i < 5; i++)
			point = field = strtok_r(NULL, " ", &save);
		while (field && strcmp(field, "-") != 0)
			field = strtok_r(NULL, " ", &save);
		char *type = field ? strtok_r(NULL, " ", &save) : NULL;
		if (!point || !type)
			continue;
		unescape_mount_path(point);
		if (strcmp(point, mnt) == 0) /* the last one listed is the one on top */
			found = strcmp(type, "fuse.kcachefs") == 0;
	}
	free(line);
	fclose(f);
	return found;
}

/* Nonzero when the kcachefs mount at mnt is dead: no daemon (its upgrade socket) nor holder
 * answers for it, and the kernel answers ENOTCONN. */
static int kcachefs_mount_dead(const char *mnt)
{
	char name[108];
	kc_upgrade_socket_path(mnt, name, sizeof(name));
	if (kc_abstract_answers(name, SOCK_STREAM) || kc_holder_listening(mnt))
		return 0;
	struct statfs sf; /* always a request (a stat may be answered from the kernel's cache) */
	return statfs(mnt, &sf) != 0 && errno == ENOTCONN;
}

/* A daemon not run as root mounts through fusermount3 (setuid root), and needs /dev/fuse
 * itself. Returns 0, or -1 after saying what is needed. */
static int check_fuse_device(void)
{
	if (geteuid() == 0)
		return 0;
	int fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
	if (fd >= 0) {
		close(fd);
		return 0;
	}
	fprintf(stderr, "kcachefs: cannot open /dev/fuse: %s: run kcachefs as root, or give "
		"this user read and write access to /dev/fuse and install fusermount3 (package "
		"fuse3) setuid root\n", strerror(errno));
	return -1;
}

/* Parse a -o number in [min, max] into *out; absent (NULL) leaves *out. Returns 0, or -1
 * after saying what is wrong. */
static int parse_number(const char *name, const char *text, unsigned long min, unsigned long max,
			unsigned long *out)
{
	char *end;
	if (!text)
		return 0;
	errno = 0;
	unsigned long v = strtoul(text, &end, 10);
	if (errno || end == text || *end || text[0] == '-' || v < min || v > max) {
		fprintf(stderr, "kcachefs: %s=%s: a whole number from %lu to %lu is needed\n", name,
			text, min, max);
		return -1;
	}
	*out = v;
	return 0;
}

/* One O_PATH fd per known inode (two for staged files): allow as many as the system's
 * per-process maximum (fs.nr_open) when privileged, else the hard limit. Returns the
 * limit now in force. */
static unsigned long raise_fd_limit(void)
{
	struct rlimit rl;
	unsigned long nr_open = 0;
	FILE *f = fopen("/proc/sys/fs/nr_open", "re");

	if (f) {
		if (fscanf(f, "%lu", &nr_open) != 1)
			nr_open = 0;
		fclose(f);
	}
	if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
		return 1024;
	if (nr_open > rl.rlim_max) {
		struct rlimit more = {nr_open, nr_open};
		if (setrlimit(RLIMIT_NOFILE, &more) == 0)
			return nr_open;
	}
	rl.rlim_cur = rl.rlim_max;
	setrlimit(RLIMIT_NOFILE, &rl);
	getrlimit(RLIMIT_NOFILE, &rl);
	kc_log(KC_LOG_DEBUG, "open file limit %lu", (unsigned long)rl.rlim_cur);
	return rl.rlim_cur == RLIM_INFINITY ? nr_open : (unsigned long)rl.rlim_cur;
}

/* Keep every wait of the mount under the kernel's request timeout rt (reqtimeout.h), which
 * aborts the whole mount when one request waits that long: parked requests are answered
 * ETIMEDOUT within its budget (waiter.c), compile_timeout and, with a cluster store
 * (remote nonzero), remote_wait are capped below the budget. *remote_wait is the
 * -o remote_wait= value (0: the default), lowered when capped. Describes the timeout in
 * desc (len bytes) for the start-up line. libfuse 3.14 has no request_timeout option
 * (3.18 adds one, sent to the kernel in the INIT reply): the sysctls alone decide. */
static void fit_request_timeout(struct kc_fs *fs, const struct kc_reqtimeout *rt,
				unsigned long *remote_wait, int remote, char *desc, size_t len)
{
	unsigned budget = kc_reqtimeout_budget(rt->effective_s);
	fs->request_budget = budget;
	fs->cfg.request_timeout = rt->effective_s;
	if (!budget) {
		snprintf(desc, len, "none%s", rt->present ? " (fs.fuse.default_request_timeout and "
			 "max_request_timeout are 0)" : " (the kernel has none)");
		return;
	}
	snprintf(desc, len, "%u s (fs.fuse.default_request_timeout=%u, max_request_timeout=%u): "
		 "requests answered within %u s", rt->effective_s, rt->default_s, rt->max_s, budget);
	unsigned cap = budget > 1 ? budget - 1 : 1;
	if (fs->cfg.compile_timeout > cap) {
		fs->cfg.compile_timeout_asked = fs->cfg.compile_timeout;
		fs->cfg.compile_timeout = cap;
		kc_log(KC_LOG_WARN, "compile_timeout %u s is capped at %u s: the kernel aborts this "
		       "mount when a request waits %u s (sysctls fs.fuse.default_request_timeout=%u, "
		       "fs.fuse.max_request_timeout=%u); set them to 0 (off) or to at least %u and "
		       "remount, for compiles that long", fs->cfg.compile_timeout_asked, cap,
		       rt->effective_s, rt->default_s, rt->max_s,
		       kc_reqtimeout_needed(fs->cfg.compile_timeout_asked + 1));
	}
	unsigned long wait = *remote_wait ? *remote_wait : KC_REMOTE_DEFAULT_WAIT;
	if (remote && wait > cap) {
		kc_log(KC_LOG_WARN, "remote_wait %lu s is capped at %u s, under the kernel's request "
		       "timeout of %u s", wait, cap, rt->effective_s);
		*remote_wait = cap;
	}
}

/* Unmount a mount this daemon took over (libfuse did not mount it, so it would not
 * unmount it): lazily, as libfuse does. */
/* kcachefs [-f] [-d] --upgrade MOUNTPOINT: connect to the daemon of MOUNTPOINT and take its
 * command line. On success *argc and *argv are the old daemon's command line (less -f)
 * with this one's other arguments (-f, -d) added, the working directory is the old daemon's, *offer
 * holds its offer; returns the connected socket. Returns -1 when there is no --upgrade,
 * -2 after saying why the upgrade cannot start (usage), -3 (refused or no daemon). */
static int upgrade_args(int *argc, char ***argv, struct kc_handover_offer *offer)
{
	int at = -1;
	for (int i = 1; i < *argc; i++)
		if (strcmp((*argv)[i], "--upgrade") == 0)
			at = i;
	if (at < 0)
		return -1;
	if (at + 1 >= *argc) {
		fprintf(stderr, "usage: %s [-f] [-d] --upgrade MOUNTPOINT\n", (*argv)[0]);
		return -2;
	}
	char why[1024];
	int s = kc_upgrade_connect((*argv)[at + 1], offer, why, sizeof(why));
	if (s < 0) {
		fprintf(stderr, "kcachefs: upgrade of %s: %s\n", (*argv)[at + 1], why);
		return -3;
	}
	kc_holder_taking((*argv)[at + 1]);
	size_t n = 1;
	for (uint32_t i = 0; i < offer->args_len; i++)
		n += offer->args[i] == '\0';
	char **v = calloc(n + (size_t)*argc + 1, sizeof(*v));
	if (!v) {
		close(s);
		return -3;
	}
	int k = 0;
	v[k++] = (*argv)[0];
	for (uint32_t i = 0; i < offer->args_len; i += (uint32_t)strlen(offer->args + i) + 1)
		if (strcmp(offer->args + i, "-f") != 0) /* this command's own -f decides */
			v[k++] = offer->args + i;
	for (int i = 1; i < *argc; i++)
		if (i != at && i != at + 1)
			v[k++] = (*argv)[i];
	if (chdir(offer->cwd) != 0)
		fprintf(stderr, "kcachefs: the running daemon's directory %s: %s\n", offer->cwd,
			strerror(errno));
	*argc = k;
	*argv = v;
	return s;
}

/* How this process came to run, and what main() gathers before the session serves. */
struct start {
	struct kc_opts o;
	struct fuse_cmdline_opts cmd;
	enum kc_log_level level;
	char cwd[PATH_MAX];          /* the directory it was started in (or the running daemon's) */
	char mnt[PATH_MAX];          /* the mountpoint, resolved without looking inside it */
	int restarted;               /* started again by the holder after a daemon died (hr) */
	struct kc_holder_restart hr;
	struct kc_ledger ledger;     /* the inodes the kernel holds, kept for a restart (ledger.h) */
	int ready_fd;                /* daemonized: the pipe to the starting command (daemon_start) */
	int up_sock;                 /* a live upgrade: the socket to the running daemon, else -1 */
	struct kc_handover_offer offer;
	char **up_argv;              /* a live upgrade: the command line built from the offer */
	unsigned char *up_state;     /* a live upgrade: the running daemon's state, up_len bytes */
	size_t up_len, up_nfds;
	int *up_fds, up_fuse_fd;     /* ... its descriptors, and the /dev/fuse one among them */
	uint64_t max_size;           /* the numbers of options that the core's config does not hold */
	unsigned long max_inodes, max_entries, remote_lease, remote_wait, remote_timeout;
};

/* Read the command line into s with libfuse's parsers. Returns -1 to go on, else the exit
 * status: 0 after --help or --version, 2 for a usage error (said). */
static int parse_args(struct start *s, struct fuse_args *args, const char *prog)
{
	if (fuse_opt_parse(args, &s->o, kc_opt_spec, opt_proc) != 0 ||
	    fuse_parse_cmdline(args, &s->cmd) != 0)
		return 2;
	if (s->cmd.show_help) {
		usage(prog);
		return 0;
	}
	if (s->cmd.show_version) {
		version();
		return 0;
	}
	if (!s->o.backing || !s->cmd.mountpoint) {
		fprintf(stderr, "usage: %s [options] BACKING_DIR MOUNTPOINT (see --help)\n", prog);
		return 2;
	}
	if (s->o.log_level && kc_log_level_parse(s->o.log_level, &s->level) != 0) {
		fprintf(stderr, "kcachefs: log_level=%s: use error, warning, info or debug\n",
			s->o.log_level);
		return 2;
	}
	return -1;
}

/* The options' values, each checked, into fs->cfg (which takes over the strings it keeps)
 * and s's numbers. Returns 0, or -1 for a usage error (said). */
static int configure(struct start *s, struct kc_fs *fs)
{
	struct kc_opts *o = &s->o;
	unsigned long jobs = 0, timeout = 0, max_source = 0;
	unsigned long nvrtc_idle = KC_NVRTC_IDLE_DEFAULT, ahead = KC_DEFAULT_AHEAD;
	unsigned long stop_timeout = KC_DEFAULT_STOP_TIMEOUT;
	if (parse_number("jobs", o->jobs, 1, KC_COMPILE_SLOTS, &jobs) ||
	    parse_number("ahead", o->ahead, 0, KC_HISTORY_MAX_RECIPES, &ahead) ||
	    parse_number("compile_timeout", o->compile_timeout, 1, 7 * 86400, &timeout) ||
	    parse_number("stop_timeout", o->stop_timeout, 0, 3600, &stop_timeout) ||
	    parse_number("nvrtc_idle", o->nvrtc_idle, 0, 86400, &nvrtc_idle) ||
	    parse_number("max_source_size", o->max_source_size, 1, 1ul << 30, &max_source) ||
	    parse_number("max_inodes", o->max_inodes, 16, 1ul << 30, &s->max_inodes) ||
	    parse_number("max_entries", o->max_entries, 1, 1ul << 40, &s->max_entries) ||
	    parse_number("remote_lease", o->remote_lease, 1, 86400, &s->remote_lease) ||
	    parse_number("remote_wait", o->remote_wait, 1, 7 * 86400, &s->remote_wait) ||
	    parse_number("remote_timeout", o->remote_timeout, 1, 600000, &s->remote_timeout))
		return -1;
	if (o->remote_mode && strcmp(o->remote_mode, "rw") != 0 &&
	    strcmp(o->remote_mode, "ro") != 0) {
		fprintf(stderr, "kcachefs: remote_mode=%s: must be rw or ro\n", o->remote_mode);
		return -1;
	}
	if (!o->remote && (o->remote_auth || o->remote_key || o->remote_mode || o->remote_lease ||
			   o->remote_wait || o->remote_timeout)) {
		fprintf(stderr, "kcachefs: remote_* options need -o remote=URL\n");
		return -1;
	}
	if (o->max_size && kc_parse_size(o->max_size, &s->max_size) != 0) {
		fprintf(stderr, "kcachefs: max_size=%s: a size in bytes is needed, with an optional "
			"K, M, G or T suffix (e.g. 20G)\n", o->max_size);
		return -1;
	}
	if (o->compiler && strcmp(o->compiler, "nvcc") != 0 && strcmp(o->compiler, "nvrtc") != 0) {
		fprintf(stderr, "kcachefs: compiler=%s: must be nvcc or nvrtc\n", o->compiler);
		return -1;
	}
	fs->cfg.backend_nvrtc = o->compiler && strcmp(o->compiler, "nvrtc") == 0;
	fs->cfg.nvcc = o->nvcc;
	fs->cfg.arch = o->arch;
	fs->cfg.flags = o->flags;
	fs->cfg.jobs = (unsigned)jobs;
	fs->cfg.ahead = (unsigned)ahead;
	fs->cfg.compile_timeout = (unsigned)timeout;
	fs->cfg.stop_timeout = (unsigned)stop_timeout;
	fs->cfg.nvrtc_idle = (unsigned)nvrtc_idle;
	fs->cfg.nvrtc_cold = nvrtc_idle == 0;
	fs->cfg.autocompile = o->autocompile;
	fs->cfg.verify_keys = o->verify_keys;
	fs->cfg.key_paths = o->key_paths;
	fs->cfg.compile_uids_opt = o->compile_uids;
	fs->cfg.max_source_size = max_source;
	o->compile_uids = o->nvcc = o->arch = o->flags = NULL; /* fs->cfg's now */
	return 0;
}

/* Block (how: SIG_BLOCK) or let through (SIG_UNBLOCK) the signals that stop a daemon. */
static void hold_stop_signals(int how)
{
	sigset_t stops;
	sigemptyset(&stops);
	sigaddset(&stops, SIGTERM);
	sigaddset(&stops, SIGINT);
	sigaddset(&stops, SIGHUP);
	sigaddset(&stops, SIGUSR1);
	sigprocmask(how, &stops, NULL);
}

/* Take the mountpoint before anything touches the mount: the running daemon's in a live
 * upgrade (its FUSE_INIT replayed, its state received into s), the holder's after a crash
 * (FUSE_INIT replayed), or a fresh one (a dead kcachefs mount there is unmounted first, a
 * live one refused). Returns 0, or -1 (said). */
static int take_mountpoint(struct start *s, struct kc_fs *fs, char *why, size_t whylen)
{
	/* Resolved before mounting: afterwards, a stat of the mountpoint would wait on us. */
	if (s->restarted || !realpath(s->cmd.mountpoint, s->mnt)) /* ENOTCONN: a dead mount */
		mountpoint_path(s->cmd.mountpoint, s->mnt, sizeof(s->mnt));
	if (s->up_sock >= 0) {
		/* Once the running daemon hands the mount over and exits, this process is the
		 * mount's only daemon: a stop signal that came before its handlers are set must
		 * stop it (an unmount), not kill it (a dead mount). Held until then (main). */
		hold_stop_signals(SIG_BLOCK);
		/* Taken over: nothing below may touch the mount until the loop serves it. */
		if (kc_upgrade_replay_init(s->up_sock, fs->se, &s->offer, why, whylen) != 0 ||
		    kc_upgrade_receive(s->up_sock, s->offer.pid, &s->up_state, &s->up_len,
				       &s->up_fds, &s->up_nfds, why, whylen) != 0) {
			fprintf(stderr, "kcachefs: upgrade of %s: %s\n", s->mnt, why);
			return -1;
		}
		return 0;
	}
	if (s->restarted) {
		if (kc_upgrade_replay(fs->se, s->hr.init_in, s->hr.init_in_len, s->hr.init_out,
				      s->hr.init_out_len, why, whylen) != 0) {
			kc_log(KC_LOG_ERR, "restarted by the holder of %s: %s", s->mnt, why);
			return -1;
		}
		return 0;
	}
	if (kcachefs_mounted_on(s->mnt) && kcachefs_mount_dead(s->mnt)) {
		/* What a daemon that died without a holder left: nobody can use it. */
		kc_log(KC_LOG_WARN, "%s has a dead kcachefs mount (Transport endpoint is not "
		       "connected: its daemon died, and no holder kept it): unmounting it first",
		       s->mnt);
		kc_unmount_detached(s->mnt);
	}
	if (kcachefs_mounted_on(s->mnt)) {
		fprintf(stderr, "kcachefs: %s already has a kcachefs mount, which this one would "
			"hide: unmount it first (umount %s, or fusermount3 -u %s), or choose another "
			"mountpoint\n", s->mnt, s->mnt, s->mnt);
		return -1;
	}
	return 0;
}

/* The kernel's request timeout (read before mounting: the kernel fixes a connection's
 * timeout when FUSE_INIT is answered, from the sysctls of that moment) fitted to the
 * compiles, described in desc; then the cluster store, when -o remote= names one (*remote,
 * else NULL). Returns 0, or the exit status 1 or 2 (a usage error) with why said. */
static int open_remote(struct start *s, struct kc_fs *fs, struct kc_remote_tier **remote,
		       char *desc, size_t desclen, char *why, size_t whylen)
{
	struct kc_reqtimeout rt;
	int rterr = kc_reqtimeout_read(KC_REQTIMEOUT_SYSCTL_DIR, &rt);
	if (rterr)
		kc_log(KC_LOG_WARN, "cannot read the kernel's FUSE request timeout from %s: %s; "
		       "assuming none", KC_REQTIMEOUT_SYSCTL_DIR, strerror(-rterr));
	fit_request_timeout(fs, &rt, &s->remote_wait, s->o.remote != NULL, desc, desclen);
	*remote = NULL;
	if (!s->o.remote)
		return 0;
	struct kc_remote_opts ro = {
		.url = s->o.remote, .auth_file = s->o.remote_auth, .key_file = s->o.remote_key,
		.read_only = s->o.remote_mode && strcmp(s->o.remote_mode, "ro") == 0,
		.lease_s = (unsigned)s->remote_lease, .wait_s = (unsigned)s->remote_wait,
		.timeout_ms = (unsigned)s->remote_timeout,
	};
	int err = kc_remote_tier_open(&ro, &fs->cache.stats, remote, why, whylen);
	if (!err && !fs->cfg.tracer && !ro.read_only)
		kc_log(KC_LOG_WARN, "remote=%s: kcachefs-trace is not next to kcachefs: this node "
		       "fetches, but shares none of its compiles (their dependency pass runs under "
		       "it)", s->o.remote);
	if (!err)
		return 0;
	fprintf(stderr, "kcachefs: %s\n", why);
	return err == -EINVAL ? 2 : 1; /* the option's value: a usage error */
}

/* Leave the foreground (without -f): fork, and have the parent, the command the user ran,
 * wait until the child serves (daemon_ready): its exit status 0 then says that the mount
 * answers and takes upgrades, so that a `kcachefs --upgrade` may follow at once. The
 * child drops the terminal (setsid) and points stdin, stdout and stderr at /dev/null, as
 * fuse_daemonize does; libfuse's parent returns once the child forked, before it serves.
 * Sets *ready_fd to the pipe's end the child writes (-1 with -f). The parent closes its
 * copy of fuse_fd, passes SIGINT, SIGTERM and SIGHUP on to the child as SIGTERM (a start
 * stopped by Ctrl-C), and exits 1 when the child exits before it serves, unmounting mnt
 * if it is left dead. Returns 0, or -1 when the fork failed (said). */
static pid_t starting_daemon; /* the starting command's child (daemon_start) */

/* The starting command is stopped (Ctrl-C): so is the start. */
static void forward_stop(int sig)
{
	(void)sig;
	if (starting_daemon > 0)
		kill(starting_daemon, SIGTERM);
}

static int daemon_start(int foreground, int *ready_fd, int fuse_fd, const char *mnt)
{
	*ready_fd = -1;
	if (chdir("/") != 0)
		kc_log(KC_LOG_DEBUG, "chdir /: %s", strerror(errno));
	if (foreground)
		return 0;
	int p[2];
	if (pipe2(p, O_CLOEXEC) != 0) {
		fprintf(stderr, "kcachefs: cannot daemonize: %s\n", strerror(errno));
		return -1;
	}
	pid_t pid = fork();
	if (pid < 0) {
		fprintf(stderr, "kcachefs: cannot daemonize: %s\n", strerror(errno));
		return -1;
	}
	if (pid > 0) {
		close(p[1]);
		close(fuse_fd); /* the daemon's alone: once it is gone, so is the connection */
		starting_daemon = pid;
		struct sigaction sa = {.sa_handler = forward_stop};
		sigemptyset(&sa.sa_mask);
		sigaction(SIGINT, &sa, NULL);
		sigaction(SIGTERM, &sa, NULL);
		sigaction(SIGHUP, &sa, NULL);
		char c;
		ssize_t n;
		while ((n = read(p[0], &c, 1)) < 0 && errno == EINTR)
			;
		if (n == 1)
			_exit(0);
		/* Died or stopped before it served. A mount it left dead (no holder starts
		 * another daemon on it) is unmounted, as a failed start leaves none. */
		int dead = kcachefs_mount_dead(mnt);
		if (dead)
			kc_unmount_detached(mnt);
		fprintf(stderr, "kcachefs: the daemon exited before it served (its log says "
			"why)%s\n", dead ? "; its mount is removed" : "");
		_exit(1);
	}
	close(p[0]);
	if (setsid() < 0)
		kc_log(KC_LOG_DEBUG, "setsid: %s", strerror(errno));
	int nullfd = open("/dev/null", O_RDWR | O_CLOEXEC);
	if (nullfd >= 0) {
		dup2(nullfd, 0);
		dup2(nullfd, 1);
		dup2(nullfd, 2);
		if (nullfd > 2)
			close(nullfd);
	}
	*ready_fd = p[1];
	return 0;
}

/* The daemon serves from here on (its workers and the upgrade listener run): let the
 * command that started it exit 0. */
static void daemon_ready(int *ready_fd)
{
	if (*ready_fd < 0)
		return;
	char c = 1;
	if (write(*ready_fd, &c, 1) != 1)
		kc_log(KC_LOG_DEBUG, "the starting command is gone: %s", strerror(errno));
	close(*ready_fd);
	*ready_fd = -1;
}

/* Grow this process's descriptor table now to hold KC_FD_TABLE descriptors (fewer under a
 * lower open file limit); after daemon_start, whose fork gives the child a table sized
 * for the descriptors open, not the parent's. The kernel grows it when a new descriptor
 * does not fit, doubling it; in a process with threads each growth waits for an RCU grace
 * period (expand_fdtable's synchronize_rcu) while every thread that opens a file waits. A joining node's
 * daemon crossed 256 and 512 while it fetched its first kernels (one descriptor per inode
 * it knows, one per store connection), and each of its opens stalled 10 to 27 ms at once
 * on the build machine. The table costs 8 bytes a descriptor. */
#define KC_FD_TABLE 16384
static void presize_fd_table(void)
{
	struct rlimit rl;
	if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur < 2)
		return;
	int high = rl.rlim_cur < KC_FD_TABLE ? (int)rl.rlim_cur - 1 : KC_FD_TABLE - 1;
	int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return; /* only an optimisation */
	int at = fcntl(fd, F_DUPFD_CLOEXEC, high);
	if (at >= 0)
		close(at);
	close(fd);
}

/* The inode table (its bound from -o max_inodes or the descriptor limit) and the eviction
 * index. Returns 0 or -1 (said). */
static int open_tables(struct start *s, struct kc_fs *fs)
{
	unsigned long fd_limit = raise_fd_limit();
	if (kc_inode_table_init(&fs->inodes, fs->store.root_fd) != 0)
		return -1;
	kc_evict_init(&fs->evict, &fs->store, &fs->cache.flights, &fs->cache.stats, s->max_size,
		      s->max_entries);
	fs->evict.evicted = on_evicted;
	fs->evict.arg = fs;
	/* A quarter of the descriptors for inodes (one each, two for staged files) leaves the
	 * rest for open files, compiles and the kernel's lag in forgetting. */
	fs->inodes.max = s->max_inodes ? s->max_inodes : fd_limit / 4;
	if (s->max_inodes && s->max_inodes > fd_limit / 2)
		kc_log(KC_LOG_WARN, "max_inodes=%lu is over half the open file limit %lu: lookups "
		       "may fail with EMFILE", s->max_inodes, fd_limit);
	return 0;
}

/* Connect the session to the kernel: the descriptor a live upgrade handed over, a clone of
 * the holder's after a crash, or a new mount. Returns 0; -1 before anything is mounted,
 * -2 after (the caller unmounts); said. */
static int attach_session(struct start *s, struct kc_fs *fs)
{
	if (s->up_fuse_fd >= 0) {
		if (kc_upgrade_adopt(s->up_fuse_fd) != 0) {
			kc_log(KC_LOG_ERR, "upgrade: cannot serve the descriptor handed over");
			return -1;
		}
		s->up_fuse_fd = -1; /* the session's */
		return 0;
	}
	if (s->restarted) {
		int c = kc_holder_clone(s->hr.fuse_fd);
		close(s->hr.fuse_fd);
		if (c < 0 || kc_upgrade_adopt(c) != 0) {
			kc_log(KC_LOG_ERR, "restarted by the holder: cannot serve a clone of its "
			       "descriptor: %s", strerror(c < 0 ? -c : errno));
			if (c >= 0)
				close(c);
			return -1;
		}
		return 0;
	}
	if (fuse_session_mount(fs->se, s->cmd.mountpoint) != 0) {
		if (geteuid() != 0)
			fprintf(stderr, "kcachefs: a mount by uid %u goes through fusermount3 (package "
				"fuse3, installed setuid root); or run kcachefs as root\n",
				(unsigned)geteuid());
		return -1;
	}
	if (kc_upgrade_io(fs->se, fuse_session_fd(fs->se)) != 0) {
		kc_log(KC_LOG_ERR, "cannot set up the session's I/O");
		return -2;
	}
	return 0;
}

/* The start-up line: what is served, how, and under which request timeout (rt_desc). */
static void log_serving(const struct start *s, struct kc_fs *fs, const char *rt_desc)
{
	char compiler[KC_COMPILER_ID_MAX];
	kc_config_compiler_id(&fs->cfg, compiler);
	kc_log(KC_LOG_INFO, "serving %s on %s: compiler %s (%s), arch %s%s, jobs %u, timeout %u s, "
	       "compile ahead %u a trigger (0: off), "
	       "max_size %llu, max_entries %llu (0: no bound), compiles run as %s%u%s%s; kernel "
	       "request timeout %s%s",
	       fs->store.root_path, s->cmd.mountpoint, fs->cfg.nvcc, compiler, fs->cfg.arch,
	       fs->cfg.arch_detected ? " (detected)" : "", fs->cfg.jobs, fs->cfg.compile_timeout,
	       fs->cfg.ahead,
	       (unsigned long long)s->max_size, (unsigned long long)s->max_entries,
	       fs->cfg.compile_uids ? "uids " : "the daemon, uid ",
	       fs->cfg.compile_uids ? fs->cfg.compile_uids : (unsigned)geteuid(),
	       fs->cfg.compile_uids ? "+" : "",
	       fs->cfg.ns_flags ? " in namespaces of their own" : "", rt_desc,
	       s->up_state ? "; taken over from the running daemon"
			   : s->restarted ? "; started again by the holder after the daemon died" : "");
	if (s->up_state)
		kc_log(KC_LOG_INFO, "upgrade: serving %s after pid %d, %llu inodes and every open "
		       "handle taken over", s->mnt, s->offer.pid,
		       (unsigned long long)kc_inode_count(&fs->inodes));
}

/* After daemonizing (fork keeps only the calling thread): the holder (a fork, so before
 * any thread), the compiles' watcher, the cache's workers, the notifier, the sweeper, the
 * cleaner, the live upgrade's listener, and the holder's epoch for the ids handed out.
 * Returns 0, or -1 when a worker thread cannot start (said). */
static int start_threads(struct start *s, struct kc_fs *fs, struct kc_remote_tier *remote,
			 int argc, char *argv[])
{
	if (s->o.holder && s->up_sock < 0 && !s->restarted) {
		int herr = kc_holder_start(s->mnt, fuse_session_fd(fs->se), !s->cmd.foreground,
					   s->ready_fd);
		if (herr)
			kc_log(KC_LOG_WARN, "no holder for %s (%s): a crash of the daemon costs the "
			       "mount", s->mnt, strerror(-herr));
	}
	/* The watcher too: it waits for this process, not for the one that daemonized. */
	int werr = kc_compile_watch(fs->cfg.compile_uids,
				    fs->cfg.uids_lock_fd > 0 ? fs->cfg.uids_lock_fd : -1);
	if (werr)
		kc_log(KC_LOG_WARN, "cannot start the watcher of the compiles (%s): a compile "
		       "outlives a daemon that dies, until the next start", strerror(-werr));
	int started = kc_cache_init(&fs->cache, &fs->cfg, &fs->store, remote) == 0;
	fs->cache.evict = &fs->evict; /* every publish is told to the index */
	if (started && remote)
		/* counted: the cache's counters are set up. A daemon that takes a mount over
		 * (an upgrade, a restart by the holder) serves at once: its clients wait */
		kc_remote_tier_probe(remote, s->up_sock < 0 && !s->restarted);
	if (!started || kc_notifier_start(&fs->notifier, fs->se, &fs->inodes, &fs->store) != 0 ||
	    kc_sweeper_start(fs) != 0 || kc_evict_start(&fs->evict) != 0) {
		kc_log(KC_LOG_ERR, "cannot start worker threads");
		return -1;
	}
	int lerr = kc_upgrade_listen(fs, s->mnt, argc, argv, s->cwd);
	if (lerr)
		kc_log(KC_LOG_WARN, "no live upgrade for this mount (kcachefs --upgrade): %s",
		       strerror(-lerr));
	/* The ids this daemon hands out carry the holder's epoch: never one a dead daemon's. */
	int state_fd = -1;
	uint32_t epoch = kc_holder_register(s->mnt, argc, argv, s->cwd, &state_fd);
	if (s->restarted && !epoch)
		epoch = s->hr.epoch;
	fs->inodes.epoch = fs->handles.epoch = epoch;
	__atomic_store_n(&fs->stale_ids, epoch != 0, __ATOMIC_SEQ_CST);
	/* The dead daemon's node ids, from the ledger the holder kept (before any request). */
	long restored = -1;
	if (state_fd >= 0 && kc_ledger_open(&s->ledger, state_fd, fs->inodes.root.fd) == 0) {
		if (s->restarted)
			restored = kc_ledger_restore(&s->ledger, &fs->inodes);
		kc_ledger_attach(&s->ledger, &fs->inodes);
	}
	/* Without it, the kernel's dentries of the root's names go, so that it looks them up
	 * again (the lookup of a mkdir's name is not retried on ESTALE). */
	if (s->restarted && restored < 0 && kc_notifier_inval_root(&fs->notifier) != 0)
		kc_log(KC_LOG_WARN, "cannot have the kernel look the root's names up again: a "
		       "mkdir in a directory it held may fail with ESTALE");
	return 0;
}

/* SIGUSR1: the holder's stop under a service manager that keeps the mount (holder.h): stop
 * as at SIGTERM, but leave the mount to the holder. */
static struct fuse_session *keep_session;
static volatile sig_atomic_t keep_asked;

static void on_keep_signal(int sig)
{
	(void)sig;
	keep_asked = 1;
	if (keep_session)
		fuse_session_exit(keep_session);
}

static int set_keep_handler(struct fuse_session *se)
{
	struct sigaction sa = {.sa_handler = on_keep_signal};
	sigemptyset(&sa.sa_mask);
	keep_session = se;
	return sigaction(SIGUSR1, &sa, NULL);
}

/* Seconds a stop waits for the shares it cut past its bound (their lease releases). */
#define KC_STOP_CUT_GRACE 2.0

/* The cluster store's shares in hand (dependency passes, puts, lease releases of the
 * compiles published last, which run after their openers were answered) end before the
 * daemon exits, at most stop_timeout seconds: else the cluster would compile those
 * kernels again. Past the bound each share still in hand is cut and named in the log.
 * Returns 0, or -1 when shares still wait on a store that does not answer: the caller
 * exits at once (_exit), as joining them would wait for that store. */
static int finish_shares(struct kc_fs *fs, int keep)
{
	unsigned n = kc_cache_settle(&fs->cache, 0);
	if (!n)
		return 0;
	unsigned bound = fs->cfg.stop_timeout;
	/* Kept for the holder, the mount queues the clients' requests meanwhile: under a
	 * kernel request timeout they must be answered by the next daemon in time, else the
	 * kernel aborts the mount (as the live upgrade's bound, upgrade.c). */
	if (keep && fs->request_budget && bound > kc_fs_queue_bound(fs))
		bound = kc_fs_queue_bound(fs);
	kc_log(KC_LOG_INFO, "stop: %u shares to the cluster store in hand: waiting for them, at "
	       "most %u s (-o stop_timeout)", n, bound);
	kc_store_note_stopping(&fs->store, time(NULL) + bound);
	double t0 = kc_mono_s();
	unsigned left = bound ? kc_cache_settle(&fs->cache, bound) : n;
	double took = kc_mono_s() - t0;
	if (!left) {
		kc_log(KC_LOG_INFO, "stop: %u shares to the cluster store ended in %.2f s", n, took);
		return 0;
	}
	kc_log(KC_LOG_WARN, "stop: %u of %u shares to the cluster store still in hand after "
	       "%.1f s are dropped (each is named): other nodes compile those kernels", left, n,
	       took);
	/* Cut: a dependency pass is killed and its lease released; a share that waits on a
	 * store that does not answer (each operation up to remote_timeout) is not waited
	 * for: the process exits without it, its lease expiring. */
	if (kc_cache_cut_shares(&fs->cache, KC_STOP_CUT_GRACE) == 0)
		return 0;
	kc_log(KC_LOG_WARN, "stop: exiting without the shares that wait on the cluster store; "
	       "the next start empties the temporaries");
	return -1;
}

/* Serve until the session ends. Returns the exit status: 0 for a stop by SIGTERM, SIGINT
 * or SIGHUP (systemd, Ctrl-C), which libfuse reports as the signal that ended the loop. */
static int serve(struct start *s, struct kc_fs *fs)
{
	int ret;
	if (s->cmd.singlethread) {
		ret = fuse_session_loop(fs->se);
	} else {
		struct fuse_loop_config *lc = fuse_loop_cfg_create();
		fuse_loop_cfg_set_clone_fd(lc, (unsigned)s->cmd.clone_fd);
		if (s->cmd.max_idle_threads != UINT_MAX) /* UINT_MAX: not given, keep libfuse's */
			fuse_loop_cfg_set_idle_threads(lc, s->cmd.max_idle_threads);
		fuse_loop_cfg_set_max_threads(lc, s->cmd.max_threads);
		ret = fuse_session_loop_mt(fs->se, lc);
		fuse_loop_cfg_destroy(lc);
	}
	return (ret == 0 || ret == SIGTERM || ret == SIGINT || ret == SIGHUP) ? 0 : 1;
}

static void start_free(struct start *s)
{
	char **strings[] = {
		&s->cmd.mountpoint, &s->o.backing, &s->o.nvcc, &s->o.arch, &s->o.flags,
		&s->o.log_level, &s->o.jobs, &s->o.compiler, &s->o.compile_timeout,
		&s->o.nvrtc_idle, &s->o.ahead, &s->o.stop_timeout, &s->o.max_source_size, &s->o.max_inodes, &s->o.max_size,
		&s->o.max_entries, &s->o.compile_uids, &s->o.remote, &s->o.remote_auth,
		&s->o.remote_key, &s->o.remote_mode, &s->o.remote_lease, &s->o.remote_wait,
		&s->o.remote_timeout,
	};
	for (size_t i = 0; i < sizeof(strings) / sizeof(*strings); i++)
		free(*strings[i]);
	if (s->up_sock >= 0)
		close(s->up_sock);
	if (s->up_fuse_fd >= 0)
		close(s->up_fuse_fd);
	if (s->ready_fd >= 0)
		close(s->ready_fd);
	free(s->up_state);
	free(s->up_fds);
	free(s->up_argv);
	kc_handover_offer_free(&s->offer);
}

/* A start by hand inherits what its shell holds open: a descriptor of a file in the mount
 * kept by the daemon makes the mount busy (an unmount fails) for as long as it runs. Close
 * every descriptor above stderr but one named as the mountpoint (/dev/fd/N: a mount made
 * by the caller). Not for a daemon the holder or a service manager started, which hand
 * descriptors over on purpose. */
static void close_inherited(int argc, char **argv)
{
	int keep = -1;
	for (int i = 1; i < argc; i++)
		if (strncmp(argv[i], "/dev/fd/", 8) == 0)
			keep = atoi(argv[i] + 8);
	DIR *d = opendir("/proc/self/fd");
	if (!d)
		return;
	int self = dirfd(d);
	for (struct dirent *e; (e = readdir(d));) {
		int fd = atoi(e->d_name);
		if (e->d_name[0] != '.' && fd > 2 && fd != self && fd != keep)
			close(fd);
	}
	closedir(d);
}

int main(int argc, char *argv[])
{
	struct start s = {.level = KC_LOG_INFO, .up_sock = -1, .up_fuse_fd = -1, .ready_fd = -1,
			  .ledger = {.fd = -1, .root_fd = -1}};
	if (!getcwd(s.cwd, sizeof(s.cwd)))
		snprintf(s.cwd, sizeof(s.cwd), "/");
	/* Started again by the holder after a daemon died (holder.h)? */
	s.restarted = kc_holder_restarted(&s.hr);
	if (s.restarted < 0)
		return 1;
	if (!s.restarted && !getenv("LISTEN_FDS"))
		close_inherited(argc, argv);
	if (!s.restarted)
		s.up_sock = upgrade_args(&argc, &argv, &s.offer);
	if (s.up_sock == -2 || s.up_sock == -3)
		return s.up_sock == -2 ? 2 : 1;
	if (s.up_sock >= 0) {
		s.up_argv = argv;
		if (!getcwd(s.cwd, sizeof(s.cwd)))
			snprintf(s.cwd, sizeof(s.cwd), "%s", s.offer.cwd);
	}
	struct fuse_args args = FUSE_ARGS_INIT(argc, argv);
	struct kc_fs *fs = NULL;
	struct kc_remote_tier *remote = NULL;
	char why[1024], rt_desc[256];
	int ret = parse_args(&s, &args, argv[0]);
	if (ret >= 0)
		goto out_args;
	ret = 1;
	kc_log_init(s.restarted && s.hr.use_syslog, s.cmd.debug ? KC_LOG_DEBUG : s.level);
	if (s.restarted)
		s.cmd.foreground = 1; /* the holder's child, which it waits for */
	/* Started by a service manager that kept the mount of a holder that died (holder.h):
	 * hold it again and start a daemon on it. */
	int held_fuse, held_init;
	if (s.o.holder && !s.restarted && s.up_sock < 0 &&
	    kc_holder_stored(&held_fuse, &held_init)) {
		mountpoint_path(s.cmd.mountpoint, s.mnt, sizeof(s.mnt));
		kc_holder_resume(s.mnt, held_fuse, held_init, argc, argv, s.cwd, !s.cmd.foreground);
	}
	if (!s.restarted && check_overlap(s.o.backing, s.cmd.mountpoint) != 0)
		goto out_args;

	fs = calloc(1, sizeof(*fs));
	if (!fs)
		goto out_args;
	clock_gettime(CLOCK_REALTIME, &fs->started);
	kc_idtable_init(&fs->handles);
	if (configure(&s, fs) != 0) {
		ret = 2;
		goto out_cfg;
	}
	/* The kernel has applied the client's umask to every mode a request carries; the
	 * daemon's own would take bits away a second time (a group's 0660 stored as 0640). */
	umask(0);
	/* libfuse's options are checked here, before anything can warn: a typo is the first
	 * thing said. The kernel checks permissions against the owners and modes we store. */
	fuse_opt_add_arg(&args, "-odefault_permissions");
	fs->se = fuse_session_new(&args, &kc_fs_ops, sizeof(kc_fs_ops), fs);
	if (!fs->se) {
		ret = 2; /* libfuse said why: an option neither it nor kcachefs knows */
		goto out_cfg;
	}
	if (take_mountpoint(&s, fs, why, sizeof(why)) != 0 || check_fuse_device() != 0)
		goto out_cfg;
	if (kc_config_resolve(&fs->cfg, why, sizeof(why)) != 0 ||
	    kc_store_open(&fs->store, s.o.backing, why, sizeof(why)) != 0) {
		fprintf(stderr, "kcachefs: %s\n", why);
		goto out_cfg;
	}
	warn_if_reachable(fs->store.root_path);
	int err = open_remote(&s, fs, &remote, rt_desc, sizeof(rt_desc), why, sizeof(why));
	if (err) {
		ret = err;
		goto out_store;
	}
	if (open_tables(&s, fs) != 0)
		goto out_store;
	if (s.up_state) {
		why[0] = '\0';
		err = kc_handover_state_restore(fs, s.up_state, s.up_len, s.up_fds, s.up_nfds,
						&s.up_fuse_fd, why, sizeof(why));
		if (err) {
			kc_log(KC_LOG_ERR, "upgrade: the state of pid %d cannot be taken: %s",
			       s.offer.pid, why);
			goto out_session;
		}
	}

	if (fuse_set_signal_handlers(fs->se) != 0 || set_keep_handler(fs->se) != 0)
		goto out_session;
	hold_stop_signals(SIG_UNBLOCK); /* held through a live upgrade's takeover */
	err = attach_session(&s, fs);
	if (err == -1)
		goto out_signals;
	if (err)
		goto out_unmount;
	kc_notifier_note_connection(&fs->notifier, s.mnt);
	log_serving(&s, fs, rt_desc);
	if (daemon_start(s.cmd.foreground, &s.ready_fd, fuse_session_fd(fs->se), s.mnt) != 0)
		goto out_unmount;
	if (!s.cmd.foreground)
		kc_log_init(1, s.cmd.debug ? KC_LOG_DEBUG : s.level);
	presize_fd_table();
	if (start_threads(&s, fs, remote, argc, argv) != 0)
		goto out_cache;
	daemon_ready(&s.ready_fd);
	ret = serve(&s, fs);
	kc_log(KC_LOG_INFO, "unmounting %s", s.cmd.mountpoint);

out_cache:
	/* In-flight compilers are killed; their waiters are answered EIO. Then the unmount
	 * aborts what the kernel still queues, which also frees a notification that waits on
	 * a directory lock held by such a request; only then is the notifier joined. The
	 * shares in hand end last: no client waits for them. */
	kc_upgrade_stop();
	/* Kept only where the holder can start a daemon on it: it has the FUSE_INIT (a stop
	 * during the first start, before the kernel's FUSE_INIT was answered, unmounts). */
	if (keep_asked && kc_holder_connected() &&
	    (s.restarted || s.up_state || kc_holder_init_kept())) {
		/* The holder keeps the mount for a service manager's store (holder.h): no
		 * unmount. The requests the kernel queues stay for the next daemon, so a
		 * notification waiting on a directory lock that one of them holds may never
		 * end: the notifier is not joined, the process exits. */
		kc_log(KC_LOG_INFO, "stopping without unmounting: the holder keeps the mount");
		kc_sweeper_stop(fs);
		kc_evict_stop(&fs->evict);
		kc_cache_stop(&fs->cache);
		if (finish_shares(fs, 1) != 0)
			_exit(0);
		kc_cache_shutdown(&fs->cache);
		kc_remote_tier_close(remote);
		_exit(0);
	}
	kc_holder_stop(); /* a clean stop: the holder lets the descriptor go */
	kc_sweeper_stop(fs);
	kc_evict_stop(&fs->evict);
	kc_cache_stop(&fs->cache);
	fuse_session_unmount(fs->se);
	if (s.up_state || s.restarted)
		kc_unmount_detached(s.mnt);
	kc_notifier_stop(&fs->notifier);
	kc_fh_free_all(fs); /* files still open at the stop: the kernel releases none now */
	if (finish_shares(fs, 0) != 0)
		_exit(0);
	kc_cache_shutdown(&fs->cache);
	goto out_signals;
out_unmount:
	fuse_session_unmount(fs->se);
	if (s.up_state || s.restarted)
		kc_unmount_detached(s.mnt);
out_signals:
	fuse_remove_signal_handlers(fs->se);
out_session:
	kc_evict_destroy(&fs->evict);
	fs->inodes.journal = NULL; /* its records stay the holder's: a stop leaves them as they are */
	kc_ledger_close(&s.ledger);
	kc_inode_table_destroy(&fs->inodes);
out_store:
	kc_remote_tier_close(remote);
	kc_store_close(&fs->store);
out_cfg:
	if (fs->se)
		fuse_session_destroy(fs->se);
	kc_config_free(&fs->cfg);
	kc_idtable_destroy(&fs->handles);
	free(fs);
out_args:
	fuse_opt_free_args(&args);
	start_free(&s);
	return ret;
}
