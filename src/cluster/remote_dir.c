/* remote_dir.c - see remote_dir.h */
#define _GNU_SOURCE
#include "remote_dir.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "hash.h"
#include "io.h"
#include "log.h"
#include "remote_object.h"
#include "util.h"

/* A held lease file as a taker last read it, and since when (this node's monotonic clock)
 * it has read the same bytes: unchanged for KC_REMOTE_ALIVE_MS, its holder is dead. */
#define SEEN_SLOTS 256 /* more than a node's waiting jobs (KC_REMOTE_WAITERS + jobs); a
			* slot reused too early only delays judging a holder dead */
#define LEASE_BYTES 256 /* a lease file's bytes read, at most */
struct seen_slot {
	char key[KC_REMOTE_KEYLEN + 1]; /* "" unused */
	char body[LEASE_BYTES];
	size_t len;
	int64_t since_ms;
};

struct dir_backend {
	struct kc_remote_backend base;
	char *root;
	char desc[PATH_MAX + 8];
	char clock[PATH_MAX];   /* leases/.clock.<host>.<pid> */
	atomic_int refs;        /* the opener's and each running operation's */
	atomic_int abandoned;   /* operations still stuck after their caller timed out */
	pthread_mutex_t seen_mu;
	struct seen_slot seen[SEEN_SLOTS]; /* held leases this node waits on, as last read */
};

enum dir_op { OP_GET, OP_PUT, OP_REPLACE, OP_TAKE, OP_RENEW, OP_RELEASE, OP_PEEK, OP_STAT };

/* One operation, shared by the caller and its worker; freed by whichever finishes last. */
struct dir_call {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int done, abandoned;
	struct dir_backend *d; /* a reference */
	enum dir_op op;
	char key[KC_REMOTE_KEYLEN + 1];
	char token[KC_REMOTE_TOKENLEN + 1];
	unsigned ms;           /* ttl_ms or fail_ms */
	char *data;            /* put: a copy of the object (owned); get: what was read */
	size_t len;
	enum kc_lease_state state;
	int result;
	struct dir_call *next; /* in the hand-off queue to an idle worker */
};

static void backend_put(struct dir_backend *d)
{
	if (atomic_fetch_sub(&d->refs, 1) == 1) {
		unlink(d->clock);
		pthread_mutex_destroy(&d->seen_mu);
		free(d->root);
		free(d);
	}
}

/* The errno of a filesystem call as remote.h names faults. */
static int fault(int e)
{
	switch (e) {
	case ENOENT:
	case ESTALE:
		return -ENOENT;
	case ENOSPC:
	case EDQUOT:
	case EROFS:
	case EFBIG:
		return -ENOSPC;
	case EACCES:
	case EPERM:
		return -EACCES;
	case ENOMEM:
	case ETIMEDOUT:
		return -e;
	default:
		return -EIO;
	}
}

/* root/<area>/<key[0..1]>[/<name>] */
static void path_of(const struct dir_backend *d, const char *area, const char *key,
		    const char *name, char *out, size_t len)
{
	if (name)
		snprintf(out, len, "%s/%s/%.2s/%s", d->root, area, key, name);
	else
		snprintf(out, len, "%s/%s/%.2s", d->root, area, key);
}

/* Create root/<area>/<key[0..1]> and what is missing between it and the root. The root
 * itself is never made: missing, it is a shared filesystem not mounted (yet), and a
 * directory made there would be a private store that shares nothing. Returns 0 or a
 * fault. */
static int make_dirs(const struct dir_backend *d, const char *area, const char *key)
{
	char p[PATH_MAX];
	path_of(d, area, key, NULL, p, sizeof(p));
	if (mkdir(p, 0755) == 0 || errno == EEXIST)
		return 0;
	if (errno != ENOENT)
		return fault(errno);
	snprintf(p, sizeof(p), "%s/%s", d->root, area);
	if (mkdir(p, 0755) != 0 && errno != EEXIST)
		return fault(errno);
	path_of(d, area, key, NULL, p, sizeof(p));
	return mkdir(p, 0755) == 0 || errno == EEXIST ? 0 : fault(errno);
}

/* A name beside path for a temporary: "<dir>/.<base>.<what>.<16 random hex>". */
static void temp_name(const char *path, const char *what, char *out, size_t len)
{
	unsigned char r[8];
	const char *slash = strrchr(path, '/');
	if (getrandom(r, sizeof(r), 0) != (ssize_t)sizeof(r))
		memset(r, 0, sizeof(r)); /* the pid and time still tell temporaries apart */
	snprintf(out, len, "%.*s/.%s.%s.%02x%02x%02x%02x%02x%02x%02x%02x.%d",
		 (int)(slash - path), path, slash + 1, what, r[0], r[1], r[2], r[3], r[4], r[5], r[6],
		 r[7], (int)getpid());
}

/* Write a complete file at tmp (exclusive create, mode), fsynced and closed. Returns 0 or a
 * fault (tmp removed). */
static int write_temp(const char *tmp, const void *data, size_t len, mode_t mode)
{
	int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
	if (fd < 0)
		return fault(errno);
	int err = kc_write_all(fd, data, len);
	if (!err && fsync(fd) != 0)
		err = -errno;
	if (close(fd) != 0 && !err) /* NFS reports a failed write back here */
		err = -errno;
	if (err) {
		unlink(tmp);
		return fault(-err);
	}
	return 0;
}

/* link(tmp, name) without replacing. Returns 0, -EEXIST or a fault. A link that NFS carried
 * out but answered with an error (a retransmission) shows as tmp's link count of 2. */
static int link_noreplace(const char *tmp, const char *name)
{
	if (link(tmp, name) == 0)
		return 0;
	int e = errno;
	struct stat st;
	if (e != EEXIST && stat(tmp, &st) == 0 && st.st_nlink == 2)
		return 0;
	return e == EEXIST ? -EEXIST : fault(e);
}

static int dir_get(struct dir_call *c)
{
	char p[PATH_MAX];
	struct stat st;
	path_of(c->d, "objects", c->key, c->key, p, sizeof(p));
	int fd = open(p, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0 && errno == ENOENT && (stat(c->d->root, &st) != 0 || !S_ISDIR(st.st_mode)))
		return -EIO; /* no root: the shared filesystem is not mounted, the store is down */
	if (fd < 0)
		return fault(errno);
	if (fstat(fd, &st) != 0) {
		int err = fault(errno);
		close(fd);
		return err;
	}
	if (!S_ISREG(st.st_mode) || (size_t)st.st_size > KC_REMOTE_DIR_MAX) {
		close(fd);
		return -EPROTO;
	}
	int err = kc_read_all(fd, KC_REMOTE_DIR_MAX, &c->data, &c->len);
	close(fd);
	if (err == -EFBIG)
		return -EPROTO;
	if (err)
		return fault(-err);
	if (c->len != (size_t)st.st_size) { /* a partial file, or one changed under us */
		free(c->data);
		c->data = NULL;
		return -ENOENT;
	}
	return 0;
}

/* Write the object through a temp file: put links it in only where no object is (another
 * node's put of the same key won); replace renames it over whatever is there. */
static int dir_write(struct dir_call *c, int replace)
{
	char p[PATH_MAX], tmp[PATH_MAX + 64];
	int err = make_dirs(c->d, "objects", c->key);
	if (err)
		return err;
	path_of(c->d, "objects", c->key, c->key, p, sizeof(p));
	temp_name(p, "tmp", tmp, sizeof(tmp));
	err = write_temp(tmp, c->data, c->len, 0444);
	if (err)
		return err;
	if (!replace) {
		err = link_noreplace(tmp, p);
		unlink(tmp);
	} else if (rename(tmp, p) != 0) {
		err = fault(errno);
		unlink(tmp);
	}
	return err;
}

static int dir_put(struct dir_call *c)
{
	return dir_write(c, 0);
}

static int dir_replace(struct dir_call *c)
{
	return dir_write(c, 1);
}

/* The filesystem's clock: touch this daemon's clock file and read its mtime. */
static int fs_now(struct dir_call *c, struct timespec *now)
{
	struct stat st;
	if (utimensat(AT_FDCWD, c->d->clock, NULL, 0) != 0) {
		int err = errno == ENOENT ? make_dirs(c->d, "leases", c->key) : fault(errno);
		if (err)
			return err;
		int fd = open(c->d->clock, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
		if (fd < 0)
			return fault(errno);
		close(fd);
		if (utimensat(AT_FDCWD, c->d->clock, NULL, 0) != 0)
			return fault(errno);
	}
	if (stat(c->d->clock, &st) != 0)
		return fault(errno);
	*now = st.st_mtim;
	return 0;
}

struct lease {
	int valid;         /* the record checks (kc_lease_check) */
	struct kc_lease_seen seen;
	char body[LEASE_BYTES];
	size_t len;
	struct stat st;
};

/* Open the lease file at p for mode (O_RDONLY, or O_RDWR to renew), read it and check its
 * record (a file that does not check is !valid: absent to every judge). Returns the open
 * fd (the caller closes it) or a fault (-ENOENT: no lease). */
static int lease_read(struct dir_call *c, const char *p, int mode, struct lease *l)
{
	char why[200];
	int fd = open(p, mode | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return fault(errno);
	ssize_t n = fstat(fd, &l->st) == 0 ? pread(fd, l->body, sizeof(l->body) - 1, 0) : -1;
	if (n < 0) {
		int err = fault(errno);
		close(fd);
		return err;
	}
	l->body[n] = '\0';
	l->len = (size_t)n;
	const struct kc_remote_backend *b = &c->d->base;
	int err = kc_lease_check(b->secret, c->key, l->body, l->len, b->held_max_ms,
				 b->note_max_ms, &l->seen, why, sizeof(why));
	l->valid = err == 0;
	if (err == -EBADMSG)
		kc_log(KC_LOG_DEBUG, "remote: lease %.16s ignored: %s", c->key, why);
	return fd;
}

/* Whether the holder of the held lease l on key lives: 1 while its bytes (with the counter
 * its renewals bump) change within KC_REMOTE_ALIVE_MS of this node's clock; the first
 * reading of a lease counts as a change. */
static int holder_lives(struct dir_backend *d, const char *key, const struct lease *l)
{
	int64_t now = kc_mono_ms();
	struct seen_slot *slot = NULL, *spare = &d->seen[0];
	int lives = 1;
	pthread_mutex_lock(&d->seen_mu);
	for (int i = 0; i < SEEN_SLOTS && !slot; i++) {
		struct seen_slot *e = &d->seen[i];
		if (strcmp(e->key, key) == 0)
			slot = e;
		else if (spare->key[0] && (!e->key[0] || e->since_ms < spare->since_ms))
			spare = e; /* an unused slot, else the one read longest ago */
	}
	if (slot && slot->len == l->len && memcmp(slot->body, l->body, l->len) == 0) {
		lives = now - slot->since_ms < KC_REMOTE_ALIVE_MS;
	} else {
		slot = slot ? slot : spare;
		strcpy(slot->key, key);
		memcpy(slot->body, l->body, l->len);
		slot->len = l->len;
		slot->since_ms = now;
	}
	pthread_mutex_unlock(&d->seen_mu);
	return lives;
}

/* Whether the lease l counts as absent at the store's time now: a record that does not
 * check, an mtime further ahead than the clock skew allows, an expiry passed, or a holder
 * that no longer lives. */
static int lease_gone(struct dir_call *c, const struct lease *l, const struct timespec *now)
{
	long long mtime = (long long)l->st.st_mtim.tv_sec * 1000000000ll + l->st.st_mtim.tv_nsec;
	long long now_ns = (long long)now->tv_sec * 1000000000ll + now->tv_nsec;
	if (!l->valid || mtime > now_ns + KC_REMOTE_SKEW_MS * 1000000ll ||
	    mtime + (long long)l->seen.ttl_ms * 1000000ll < now_ns)
		return 1;
	return l->seen.state == KC_LEASE_HELD && !holder_lives(c->d, c->key, l);
}

/* A lease file's bytes: its record, then the liveness counter its holder bumps. */
#define ALIVE_LINE "\nalive "
#define ALIVE_DIGITS 16

/* Seconds after which a remover's name (lease_remove_expired) left by a crash is stale. */
#define GRAVE_STALE_S 10

/* Whether the file at p holds exactly the bytes of l (which bear a random token and the
 * holder's counter: the same lease, not renewed since). */
static int same_bytes(const char *p, const struct lease *l)
{
	char buf[LEASE_BYTES];
	int fd = open(p, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
	close(fd);
	return n == (ssize_t)l->len && memcmp(buf, l->body, l->len) == 0;
}

/* Remove the lease file l that counts as gone (read from p) so that it can be taken. The
 * racers that judged the same bytes agree on one remover, whatever node they are on: the
 * first to link it under a name made of the SHA-256 of those bytes (not of its inode or
 * mtime, which a network filesystem such as sshfs numbers and caches per client); the
 * others get EEXIST and leave it. The remover unlinks p only if that name holds the bytes
 * judged, so p never vanishes under a lease taken or renewed meanwhile (a rename away and
 * back let a racer link in between: two holders). Returns 0 or a fault. */
static int lease_remove_expired(struct dir_call *c, const char *p, const struct lease *l)
{
	char grave[PATH_MAX + 96], sum[KC_SHA256_HEXLEN + 1];
	struct stat st;
	const char *slash = strrchr(p, '/');
	if (kc_sha256_buf(l->body, l->len, sum) != 0)
		return -ENOMEM;
	snprintf(grave, sizeof(grave), "%.*s/.%s.stale.%.32s", (int)(slash - p), p, slash + 1,
		 sum);
	if (link(p, grave) != 0) {
		if (errno == ENOENT)
			return 0; /* gone meanwhile: link again */
		if (errno != EEXIST)
			return fault(errno);
		struct timespec now; /* another racer removes it; a crashed one's name goes later */
		if (stat(grave, &st) == 0 && fs_now(c, &now) == 0 &&
		    st.st_ctim.tv_sec + GRAVE_STALE_S < now.tv_sec)
			unlink(grave);
		return 0;
	}
	if (same_bytes(grave, l))
		unlink(p); /* the file judged, which no other racer removes now */
	unlink(grave);
	return 0;
}

/* The bytes of a new lease file of state for c's key and token, ttl c->ms, into body.
 * Returns their length or -EINVAL / -ENOMEM. */
static int lease_body(struct dir_call *c, enum kc_lease_state state, char body[LEASE_BYTES])
{
	int n = kc_lease_record(c->d->base.secret, c->key, state, c->token, c->ms, body);
	if (n < 0)
		return n;
	return n + snprintf(body + n, LEASE_BYTES - (size_t)n, ALIVE_LINE "%0*x\n", ALIVE_DIGITS,
			    0);
}

static int dir_take(struct dir_call *c)
{
	char p[PATH_MAX], tmp[PATH_MAX + 64], body[LEASE_BYTES];
	int n = lease_body(c, KC_LEASE_HELD, body);
	if (n < 0)
		return n;
	int err = make_dirs(c->d, "leases", c->key);
	if (err)
		return err;
	path_of(c->d, "leases", c->key, c->key, p, sizeof(p));
	temp_name(p, "new", tmp, sizeof(tmp));
	err = write_temp(tmp, body, (size_t)n, 0644);
	if (err)
		return err;
	c->state = KC_LEASE_HELD;
	err = -EBUSY;
	for (int attempt = 0; attempt < 3; attempt++) {
		int r = link_noreplace(tmp, p);
		if (r != -EEXIST) {
			err = r;
			if (r == 0)
				c->state = KC_LEASE_NONE;
			break;
		}
		struct lease l;
		struct timespec now;
		int fd = lease_read(c, p, O_RDONLY, &l);
		if (fd == -ENOENT)
			continue; /* released meanwhile: link again */
		if (fd < 0) {
			err = fd;
			break;
		}
		close(fd);
		if ((r = fs_now(c, &now)) != 0) {
			err = r;
			break;
		}
		if (!lease_gone(c, &l, &now)) {
			c->state = l.seen.state;
			err = -EBUSY;
			break;
		}
		if ((r = lease_remove_expired(c, p, &l)) != 0) {
			err = r;
			break;
		}
	}
	unlink(tmp);
	return err;
}

/* Open the lease of key and check that it is held with our token. Returns the fd, -ENOLCK,
 * or a fault. */
static int lease_ours(struct dir_call *c, char *p, size_t plen, struct lease *l)
{
	path_of(c->d, "leases", c->key, c->key, p, plen);
	int fd = lease_read(c, p, O_RDWR, l);
	if (fd == -ENOENT)
		return -ENOLCK;
	if (fd >= 0 && (!l->valid || l->seen.state != KC_LEASE_HELD ||
			strcmp(l->seen.token, c->token) != 0)) {
		close(fd);
		return -ENOLCK;
	}
	return fd;
}

static int dir_renew(struct dir_call *c)
{
	char p[PATH_MAX];
	struct lease l;
	int fd = lease_ours(c, p, sizeof(p), &l);
	if (fd < 0)
		return fd;
	/* the ttl recorded at take stands; bumping the liveness counter of the file we checked
	 * (in place: same length, same inode) tells takers that we live and moves its expiry */
	char num[ALIVE_DIGITS + 1];
	const char *line = memmem(l.body, l.len, ALIVE_LINE, strlen(ALIVE_LINE));
	int err = 0;
	if (line && (size_t)(line - l.body) + strlen(ALIVE_LINE) + ALIVE_DIGITS <= l.len) {
		off_t at = (off_t)(line - l.body + (ptrdiff_t)strlen(ALIVE_LINE));
		unsigned long long v = strtoull(l.body + at, NULL, 16) + 1;
		snprintf(num, sizeof(num), "%0*llx", ALIVE_DIGITS, v & 0xffffffffffffffffull);
		if (pwrite(fd, num, ALIVE_DIGITS, at) != ALIVE_DIGITS)
			err = fault(errno);
	}
	if (!err && futimens(fd, NULL) != 0)
		err = fault(errno);
	close(fd);
	return err;
}

static int dir_release(struct dir_call *c)
{
	char p[PATH_MAX], tmp[PATH_MAX + 64], body[LEASE_BYTES];
	struct lease l;
	struct stat now;
	int fd = lease_ours(c, p, sizeof(p), &l);
	if (fd < 0)
		return fd;
	close(fd);
	if (c->ms) {
		temp_name(p, "new", tmp, sizeof(tmp));
		int n = lease_body(c, KC_LEASE_FAILED, body);
		int err = n < 0 ? n : write_temp(tmp, body, (size_t)n, 0644);
		if (!err && rename(tmp, p) != 0) {
			err = fault(errno);
			unlink(tmp);
		}
		return err;
	}
	if (stat(p, &now) != 0)
		return errno == ENOENT ? -ENOLCK : fault(errno);
	if (now.st_ino != l.st.st_ino || now.st_dev != l.st.st_dev)
		return -ENOLCK;
	return unlink(p) == 0 || errno == ENOENT ? 0 : fault(errno);
}

static int dir_peek(struct dir_call *c)
{
	char p[PATH_MAX];
	struct lease l;
	struct timespec now;
	path_of(c->d, "leases", c->key, c->key, p, sizeof(p));
	c->state = KC_LEASE_NONE;
	int fd = lease_read(c, p, O_RDONLY, &l);
	if (fd == -ENOENT)
		return 0;
	if (fd < 0)
		return fd;
	close(fd);
	int err = fs_now(c, &now);
	if (err)
		return err;
	if (!lease_gone(c, &l, &now))
		c->state = l.seen.state;
	return 0;
}

/* What a watcher compares between two stats of key (into c->len): whether its index is
 * there and which file it is, and which lease file stands (a holder's renewal rewrites its
 * file in place, which changes nothing here; a release removes or replaces it). */
static int dir_stat(struct dir_call *c)
{
	char p[PATH_MAX];
	struct stat st;
	uint64_t sig = 1469598103934665603ull;
	for (int i = 0; i < 2; i++) {
		path_of(c->d, i ? "leases" : "objects", c->key, c->key, p, sizeof(p));
		int there = lstat(p, &st) == 0;
		if (!there && errno != ENOENT)
			return fault(errno);
		uint64_t v[3] = {(uint64_t)there, there ? (uint64_t)st.st_ino : 0,
				 there && !i ? (uint64_t)st.st_size : 0};
		for (int j = 0; j < 3; j++)
			sig = (sig ^ v[j]) * 1099511628211ull;
	}
	c->len = (size_t)sig;
	return 0;
}

static void call_free(struct dir_call *c)
{
	backend_put(c->d);
	pthread_mutex_destroy(&c->mu);
	pthread_cond_destroy(&c->cv);
	free(c->data);
	free(c);
}

static void *call_worker(void *arg)
{
	static int (*const ops[])(struct dir_call *) = {
		[OP_GET] = dir_get, [OP_PUT] = dir_put, [OP_REPLACE] = dir_replace, [OP_TAKE] = dir_take,
		[OP_RENEW] = dir_renew, [OP_RELEASE] = dir_release, [OP_PEEK] = dir_peek,
		[OP_STAT] = dir_stat,
	};
	struct dir_call *c = arg;
	int result = ops[c->op](c);
	pthread_mutex_lock(&c->mu);
	c->result = result;
	c->done = 1;
	int abandoned = c->abandoned;
	pthread_cond_signal(&c->cv);
	pthread_mutex_unlock(&c->mu);
	if (abandoned) {
		atomic_fetch_sub(&c->d->abandoned, 1);
		call_free(c);
	}
	return NULL;
}

/* Workers outlive their call a while, idle, and take the next call handed to them: a
 * joining node's gets, one after another, then reuse threads instead of starting one each
 * (a thread's start, stack and exit were 6-7% of a joining node's CPU on the dir: store).
 * A call never waits behind another: it goes to an idle worker, or to a new one. Shared by
 * every dir: backend of the process; a worker idle for IDLE_MS, or beyond IDLE_MAX idle
 * ones, ends; a child of fork() starts with none. */
#define IDLE_MAX 8
#define IDLE_MS 2000
static struct {
	pthread_mutex_t mu;
	pthread_cond_t cv;        /* a call was handed over */
	unsigned idle, queued;    /* workers waiting; calls handed over, not taken yet */
	struct dir_call *head, **tail;
} hand = {.mu = PTHREAD_MUTEX_INITIALIZER, .tail = &hand.head};
static pthread_once_t hand_once = PTHREAD_ONCE_INIT;

/* In a child of fork() the idle workers are gone (only the forking thread is copied):
 * nothing is idle there, and nothing the parent queued is the child's to run. */
static void hand_forked(void)
{
	pthread_mutex_init(&hand.mu, NULL);
	kc_cond_init_mono(&hand.cv);
	hand.idle = hand.queued = 0;
	hand.head = NULL;
	hand.tail = &hand.head;
}

static void hand_init(void)
{
	kc_cond_init_mono(&hand.cv);
	pthread_atfork(NULL, NULL, hand_forked);
}

static void *worker_main(void *arg)
{
	for (struct dir_call *c = arg; c;) {
		call_worker(c);
		c = NULL;
		pthread_mutex_lock(&hand.mu);
		if (hand.idle - hand.queued < IDLE_MAX) {
			struct timespec until = kc_mono_after_ms(IDLE_MS);
			hand.idle++;
			while (!hand.head &&
			       pthread_cond_timedwait(&hand.cv, &hand.mu, &until) != ETIMEDOUT)
				;
			hand.idle--;
			if ((c = hand.head)) { /* taken even past the wait: it was counted on */
				if (!(hand.head = c->next))
					hand.tail = &hand.head;
				hand.queued--;
			}
		}
		pthread_mutex_unlock(&hand.mu);
	}
	return NULL;
}

/* Start c in an idle worker, else in a new one. Returns 0 or -ENOMEM. */
static int call_start(struct dir_call *c)
{
	pthread_once(&hand_once, hand_init);
	pthread_mutex_lock(&hand.mu);
	int handed = hand.idle > hand.queued;
	if (handed) {
		c->next = NULL;
		*hand.tail = c;
		hand.tail = &c->next;
		hand.queued++;
		pthread_cond_signal(&hand.cv);
	}
	pthread_mutex_unlock(&hand.mu);
	if (handed)
		return 0;
	pthread_attr_t ta;
	pthread_t t;
	pthread_attr_init(&ta);
	pthread_attr_setdetachstate(&ta, PTHREAD_CREATE_DETACHED);
	pthread_attr_setstacksize(&ta, 256 << 10);
	int err = pthread_create(&t, &ta, worker_main, c);
	pthread_attr_destroy(&ta);
	return err ? -ENOMEM : 0;
}

/* Run c in a worker and wait for it at most the backend's timeout. Returns its result, or
 * -ETIMEDOUT (c is then the worker's to free); c is freed unless the result is 0 of a get
 * (the caller takes c->data and frees c). */
static int call_run(struct dir_call *c)
{
	struct dir_backend *d = c->d;
	struct timespec until;

	pthread_mutex_init(&c->mu, NULL);
	kc_cond_init_mono(&c->cv);
	atomic_fetch_add(&d->refs, 1);
	if (atomic_load(&d->abandoned) >= KC_REMOTE_DIR_STUCK) {
		call_free(c);
		return -ETIMEDOUT;
	}
	if (call_start(c) != 0) {
		call_free(c);
		return -ENOMEM;
	}
	until = kc_mono_after_ms(d->base.timeout_ms);
	pthread_mutex_lock(&c->mu);
	while (!c->done && pthread_cond_timedwait(&c->cv, &c->mu, &until) != ETIMEDOUT)
		;
	if (!c->done) {
		c->abandoned = 1;
		atomic_fetch_add(&d->abandoned, 1);
		pthread_mutex_unlock(&c->mu);
		return -ETIMEDOUT;
	}
	pthread_mutex_unlock(&c->mu);
	return c->result;
}

static struct dir_call *call_new(struct kc_remote_backend *b, enum dir_op op, const char *key,
				 const char *token, unsigned ms)
{
	if (!kc_hex_lower_str(key, KC_REMOTE_KEYLEN) ||
	    (token && !kc_hex_lower_str(token, KC_REMOTE_TOKENLEN)))
		return NULL;
	struct dir_call *c = calloc(1, sizeof(*c));
	if (!c)
		return NULL;
	c->d = (struct dir_backend *)b;
	c->op = op;
	strcpy(c->key, key);
	if (token)
		strcpy(c->token, token);
	c->ms = ms;
	return c;
}

#define NEW_CALL(c, ...)                                                                      \
	struct dir_call *c = call_new(__VA_ARGS__);                                           \
	if (!c)                                                                               \
		return errno == ENOMEM ? -ENOMEM : -EINVAL;

static int op_get(struct kc_remote_backend *b, const char *key, char **data, size_t *len)
{
	errno = EINVAL;
	NEW_CALL(c, b, OP_GET, key, NULL, 0);
	int err = call_run(c);
	if (err == 0) {
		*data = c->data;
		*len = c->len;
		c->data = NULL;
	}
	if (err != -ETIMEDOUT)
		call_free(c);
	return err;
}

static int op_store(struct kc_remote_backend *b, enum dir_op op, const char *key,
		    const void *data, size_t len)
{
	errno = EINVAL;
	NEW_CALL(c, b, op, key, NULL, 0);
	c->data = malloc(len ? len : 1); /* the worker may outlive the caller's buffer */
	if (!c->data) {
		free(c);
		return -ENOMEM;
	}
	memcpy(c->data, data, len);
	c->len = len;
	int err = call_run(c);
	if (err != -ETIMEDOUT)
		call_free(c);
	return err;
}

static int op_put(struct kc_remote_backend *b, const char *key, const void *data, size_t len)
{
	return op_store(b, OP_PUT, key, data, len);
}

static int op_replace(struct kc_remote_backend *b, const char *key, const void *data,
		      size_t len)
{
	return op_store(b, OP_REPLACE, key, data, len);
}

/* The lease operations: run op on key with token and ms; *state (if not NULL) gets what
 * the worker saw. */
static int lease_op(struct kc_remote_backend *b, enum dir_op op, const char *key,
		    const char *token, unsigned ms, enum kc_lease_state *state)
{
	errno = EINVAL;
	NEW_CALL(c, b, op, key, token, ms);
	int err = call_run(c);
	if (err != -ETIMEDOUT) {
		if (state)
			*state = c->state;
		call_free(c);
	}
	return err;
}

static int op_take(struct kc_remote_backend *b, const char *key, const char *token,
		   unsigned ttl_ms, enum kc_lease_state *state)
{
	enum kc_lease_state s = KC_LEASE_HELD;
	int err = lease_op(b, OP_TAKE, key, token, ttl_ms, &s);
	if (state)
		*state = s;
	return err;
}

static int op_renew(struct kc_remote_backend *b, const char *key, const char *token,
		    unsigned ttl_ms)
{
	return lease_op(b, OP_RENEW, key, token, ttl_ms, NULL);
}

static int op_release(struct kc_remote_backend *b, const char *key, const char *token,
		      unsigned fail_ms)
{
	return lease_op(b, OP_RELEASE, key, token, fail_ms, NULL);
}

static int op_peek(struct kc_remote_backend *b, const char *key, enum kc_lease_state *state)
{
	return lease_op(b, OP_PEEK, key, NULL, 0, state);
}

/* A watch on dir: a stat of key's index and lease files every KC_REMOTE_WATCH_POLL_MS
 * (each bounded by the timeout, as every operation); a change is the notice. */
struct kc_remote_watch {
	char key[KC_REMOTE_KEYLEN + 1];
	size_t sig; /* dir_stat's, as last seen */
};

static int stat_sig(struct kc_remote_backend *b, const char *key, size_t *sig)
{
	errno = EINVAL;
	NEW_CALL(c, b, OP_STAT, key, NULL, 0);
	int err = call_run(c);
	if (err == -ETIMEDOUT)
		return err;
	*sig = c->len;
	call_free(c);
	return err;
}

static int op_watch_start(struct kc_remote_backend *b, const char *key,
			  struct kc_remote_watch **w)
{
	struct kc_remote_watch *nw = calloc(1, sizeof(*nw));
	*w = NULL;
	if (!nw)
		return -ENOMEM;
	int err = stat_sig(b, key, &nw->sig);
	if (err) {
		free(nw);
		return err;
	}
	snprintf(nw->key, sizeof(nw->key), "%s", key);
	*w = nw;
	return 0;
}

static int op_watch_wait(struct kc_remote_backend *b, struct kc_remote_watch *w, unsigned ms)
{
	int64_t until = kc_mono_ms() + ms;
	for (;;) {
		int64_t left = until - kc_mono_ms();
		if (left <= 0)
			return -ETIMEDOUT;
		if (left > KC_REMOTE_WATCH_POLL_MS)
			left = KC_REMOTE_WATCH_POLL_MS;
		struct timespec ts = {left / 1000, (long)(left % 1000) * 1000000l};
		while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
			;
		size_t sig = 0;
		int err = stat_sig(b, w->key, &sig);
		if (err)
			return err;
		if (sig != w->sig) {
			w->sig = sig;
			return 0;
		}
	}
}

static void op_watch_end(struct kc_remote_backend *b, struct kc_remote_watch *w)
{
	(void)b;
	free(w);
}

static const char *op_describe(struct kc_remote_backend *b)
{
	return ((struct dir_backend *)b)->desc;
}

static void op_destroy(struct kc_remote_backend *b)
{
	backend_put((struct dir_backend *)b);
}

static const struct kc_remote_backend_ops dir_ops = {
	.get = op_get, .put = op_put, .replace = op_replace, .lease_take = op_take, .lease_renew = op_renew,
	.lease_release = op_release, .lease_peek = op_peek, .watch_start = op_watch_start,
	.watch_wait = op_watch_wait, .watch_end = op_watch_end, .describe = op_describe,
	.destroy = op_destroy,
};

struct kc_remote_backend *kc_remote_dir_open(const char *path, unsigned timeout_ms, char *why,
					     size_t whylen)
{
	char host[64] = "host";
	size_t n = strlen(path);
	while (n > 1 && path[n - 1] == '/')
		n--;
	if (path[0] != '/' || n + 64 >= PATH_MAX) {
		snprintf(why, whylen, "dir: store path must be absolute (and shorter than %d): %s",
			 PATH_MAX - 64, path);
		errno = EINVAL;
		return NULL;
	}
	struct dir_backend *d = calloc(1, sizeof(*d));
	if (!d || !(d->root = strndup(path, n))) {
		free(d);
		snprintf(why, whylen, "out of memory");
		errno = ENOMEM;
		return NULL;
	}
	gethostname(host, sizeof(host) - 1);
	host[sizeof(host) - 1] = '\0';
	for (char *s = host; *s; s++)
		if (*s == '/')
			*s = '_';
	d->base.ops = &dir_ops;
	d->base.timeout_ms = timeout_ms ? timeout_ms : 1;
	atomic_init(&d->refs, 1);
	atomic_init(&d->abandoned, 0);
	pthread_mutex_init(&d->seen_mu, NULL);
	d->base.held_max_ms = KC_REMOTE_RECORD_MAX_MS;
	d->base.note_max_ms = KC_REMOTE_RECORD_MAX_MS;
	snprintf(d->desc, sizeof(d->desc), "dir:%s", d->root);
	struct stat st;
	if (stat(d->root, &st) != 0 || !S_ISDIR(st.st_mode))
		kc_log(KC_LOG_WARN, "remote=dir:%s: %s now; the store counts as down until it is "
		       "there (kcachefs never creates it: make it on the shared filesystem)",
		       d->root, stat(d->root, &st) != 0 ? strerror(errno) : "not a directory");
	snprintf(d->clock, sizeof(d->clock), "%s/leases/.clock.%s.%d", d->root, host,
		 (int)getpid());
	return &d->base;
}
