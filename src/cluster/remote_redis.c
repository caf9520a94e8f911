/* remote_redis.c - one Redis/Valkey server of the cluster store, through hiredis (see
 * remote_redis.h).
 *
 * hiredis connects (redisConnectWithTimeout, redisConnectUnixWithTimeout) and parses
 * replies (its redisReader); the exchange itself is done here with poll against one
 * deadline per operation, so that a slow, paused or trickling server costs at most
 * timeout_ms, and with send(MSG_NOSIGNAL), so that a server gone away is an error and not
 * a SIGPIPE.
 */
#define _GNU_SOURCE
#include "remote_redis.h"

#include <errno.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "hash.h"
#include "log.h"
#include "remote_object.h"
#include "util.h"

#define MAX_REPLY ((size_t)512 << 20) /* Redis's own proto-max-bulk-len default */
#define MAX_ARRAY 16                  /* no command here expects an array at all */
#define OBJ_PREFIX "kcachefs:obj:"
#define LEASE_PREFIX "kcachefs:lease:"
#define RELOG_S 60 /* a fault that persists is logged again after this long */

#define ALIVE_PREFIX "kcachefs:alive:"
#define STR_(x) #x
#define STR(x) STR_(x)
#define RECORD_MAX_STR STR(KC_LEASE_RECORD_MAX)
#define STORED_PREFIX "kcachefs:stored:" /* the channel of key's notices (no key: no TTL) */

/* Lease scripts: KEYS[1] the lease key, holding a record of remote_object.h; KEYS[2] the
 * holder's liveness key, holding its token with a TTL of KC_REMOTE_ALIVE_MS that each
 * renewal sets again. A standing record counts (JUDGE's live) only if it is shorter than
 * KC_LEASE_RECORD_MAX without a NUL (anything else is no record: never sent back whole),
 * with a TTL within the bound of its kind, and a held one only while its holder's liveness
 * key is there with a TTL of at most alive_ms (the key is unsigned: one planted without a
 * TTL, or with a long one, proves nothing); the signature is checked by the caller, which
 * names a record it refuses in ARGV[7] (judged) and so replaces it atomically.
 * take: ARGV record, ttl, token, alive_ms, held_max, note_max, judged -> "0" taken, or
 *   "1" .. the record standing.  peek: the same ARGV -> "" or the record standing.
 * renew: ARGV prefix ("held <token> "), ttl, token, alive_ms -> 1 renewed, 0 not ours.
 * release: ARGV prefix, fail_ms, note record -> 1 released (or replaced by the note), 0
 *   not ours. */
#define JUDGE                                                                                 \
	"local function live(v)\n"                                                             \
	"  if v == ARGV[7] or #v >= " RECORD_MAX_STR " or string.find(v, '\\0', 1, true) then\n" \
	"    return false\n"                                                                   \
	"  end\n"                                                                              \
	"  local failed = string.sub(v, 1, 7) == 'failed '\n"                                  \
	"  local left = redis.call('PTTL', KEYS[1])\n"                                         \
	"  if left < 0 or left > tonumber(failed and ARGV[6] or ARGV[5]) then return false end\n" \
	"  if failed then return true end\n"                                                   \
	"  if string.sub(v, 1, 5) ~= 'held ' or\n"                                             \
	"     redis.call('GET', KEYS[2]) ~= string.sub(v, 6, 37) then return false end\n"     \
	"  local alive = redis.call('PTTL', KEYS[2])\n"                                        \
	"  return alive > 0 and alive <= tonumber(ARGV[4])\n"                                 \
	"end\n"                                                                                \
	"local v = redis.call('GET', KEYS[1])\n"
static const char take_script[] =
	JUDGE
	"if v and live(v) then return '1' .. v end\n"
	"redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])\n"
	"redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])\n"
	"return '0'\n";
static const char peek_script[] =
	JUDGE
	"if v and live(v) then return v end\n"
	"return ''\n";
static const char renew_script[] =
	"local v = redis.call('GET', KEYS[1])\n"
	"if not v or string.sub(v, 1, #ARGV[1]) ~= ARGV[1] then return 0 end\n"
	"redis.call('PEXPIRE', KEYS[1], ARGV[2])\n"
	"redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])\n"
	"return 1\n";
static const char release_script[] =
	"local v = redis.call('GET', KEYS[1])\n"
	"if not v or string.sub(v, 1, #ARGV[1]) ~= ARGV[1] then return 0 end\n"
	"redis.call('DEL', KEYS[2])\n"
	"if tonumber(ARGV[2]) > 0 then\n"
	"  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])\n"
	"else\n"
	"  redis.call('DEL', KEYS[1])\n"
	"end\n"
	"return 1\n";

/* Reply types a command accepts (bit per REDIS_REPLY_*). */
#define T(x) (1u << (x))

struct redis_backend {
	struct kc_remote_backend base; /* first: the ops get &base */
	struct kc_redis_addr addr;     /* the server; addr.canon names it in logs */
	char *user; /* NULL: AUTH PASSWORD (or no AUTH when pass is NULL too) */
	char *pass;
	pthread_mutex_t lock; /* guards idle, nidle and the log state below */
	redisContext *idle[KC_REDIS_POOL];
	int nidle;
	int down;           /* the last exchange failed */
	char last_why[200]; /* its cause, as last logged */
	time_t last_log;
};

static void say(char *why, size_t whylen, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static void say(char *why, size_t whylen, const char *fmt, ...)
{
	va_list ap;

	if (!why || !whylen)
		return;
	va_start(ap, fmt);
	vsnprintf(why, whylen, fmt, ap);
	va_end(ap);
}

/* ---- exchanges ---- */

/* hiredis's reply builders, with arrays bounded: a garbage "*2000000000" must not make
 * the reader allocate gigabytes. array_refused tells that refusal from a real OOM. */
static redisReplyObjectFunctions guarded_fns;
static void *(*plain_create_array)(const redisReadTask *, int);
static pthread_once_t fns_once = PTHREAD_ONCE_INIT;
static __thread int array_refused;

static void *guarded_create_array(const redisReadTask *task, int elements)
{
	if (elements < 0 || elements > MAX_ARRAY) {
		array_refused = 1;
		return NULL;
	}
	return plain_create_array(task, elements);
}

static void fns_init(void)
{
	redisReader *r = redisReaderCreate();

	if (!r)
		abort(); /* at start, a few hundred bytes: nothing works without them */
	guarded_fns = *r->fn;
	plain_create_array = guarded_fns.createArray;
	guarded_fns.createArray = guarded_create_array;
	redisReaderFree(r);
}

/* Wait until fd is ready for ev, or the deadline. 0, or -ETIMEDOUT / -EIO. */
static int wait_fd(int fd, short ev, int64_t deadline)
{
	for (;;) {
		int64_t left = deadline - kc_mono_ms();
		struct pollfd p = {.fd = fd, .events = ev};
		int r;

		if (left <= 0)
			return -ETIMEDOUT;
		r = poll(&p, 1, left > INT_MAX ? INT_MAX : (int)left);
		if (r > 0)
			return 0; /* also POLLHUP/POLLERR: the next send/recv says which */
		if (r == 0)
			return -ETIMEDOUT;
		if (errno != EINTR)
			return -EIO;
	}
}

/* errno of a failed send/recv on an established connection. */
static int io_errno(int e)
{
	switch (e) {
	case EPIPE: case ECONNRESET: case ENOTCONN: case ECONNABORTED:
		return -ENOTCONN;
	case ETIMEDOUT:
		return -ETIMEDOUT;
	case EHOSTUNREACH: case ENETUNREACH: case ENETDOWN:
		return -EHOSTUNREACH;
	case ECONNREFUSED:
		return -ECONNREFUSED;
	case ENOMEM: case ENOBUFS:
		return -ENOMEM;
	default:
		return -EIO;
	}
}

/* errno of a failed connect: from hiredis's message (errno may have moved since). */
static int connect_errno(const redisContext *c, int saved)
{
	static const int known[] = {ETIMEDOUT, EINPROGRESS, ECONNREFUSED, ENOENT, ECONNRESET,
				    EHOSTUNREACH, ENETUNREACH, EADDRNOTAVAIL, ENETDOWN, EACCES,
				    EPERM, ENOMEM};
	int e = 0;

	if (c->err == REDIS_ERR_OTHER)
		return -EHOSTUNREACH; /* the name did not resolve */
	for (size_t i = 0; i < sizeof(known) / sizeof(known[0]) && !e; i++)
		if (strstr(c->errstr, strerror(known[i])))
			e = known[i];
	if (!e)
		e = saved;
	switch (e) {
	case ETIMEDOUT: case EINPROGRESS:
		return -ETIMEDOUT;
	case ECONNREFUSED: case ENOENT: case ECONNRESET:
		return -ECONNREFUSED; /* no listener (a Unix socket: not even the file) */
	case EHOSTUNREACH: case ENETUNREACH: case EADDRNOTAVAIL: case ENETDOWN:
		return -EHOSTUNREACH;
	case EACCES: case EPERM:
		return -EACCES;
	case ENOMEM:
		return -ENOMEM;
	default:
		return -EIO;
	}
}

/* errno of an error reply, by its code (the first word). */
static int reply_errno(const char *msg)
{
	static const struct {
		const char *code;
		int err;
	} map[] = {
		{"OOM", ENOSPC}, {"READONLY", ENOSPC}, {"MISCONF", ENOSPC},
		{"NOAUTH", EACCES}, {"WRONGPASS", EACCES}, {"NOPERM", EACCES},
		{"LOADING", EAGAIN}, {"BUSY", EAGAIN}, {"MASTERDOWN", EAGAIN}, {"TRYAGAIN", EAGAIN},
	};
	size_t wl = strcspn(msg, " ");

	for (size_t i = 0; i < sizeof(map) / sizeof(map[0]); i++)
		if (strlen(map[i].code) == wl && !memcmp(msg, map[i].code, wl))
			return -map[i].err;
	/* An error raised inside a script may come wrapped ("ERR Error running script ...
	 * -OOM ..." on older servers). */
	if (strstr(msg, "OOM command not allowed"))
		return -ENOSPC;
	if (strstr(msg, "NOPERM"))
		return -EACCES;
	return -EIO;
}

/* A bulk reply whose declared length is over MAX_REPLY: refused before its bytes come. */
static int declared_too_big(const redisReader *r)
{
	const char *p = r->buf + r->pos, *e = r->buf + r->len;
	unsigned long long v = 0;

	if (r->len <= r->pos)
		return 0;
	if (*p == '$')
		p++;
	else if (r->ridx < 0 || r->rstack[r->ridx].type != REDIS_REPLY_STRING)
		return 0; /* (hiredis may have taken the '$' in already) */
	for (; p < e && *p >= '0' && *p <= '9'; p++) {
		v = v * 10 + (unsigned)(*p - '0');
		if (v > MAX_REPLY)
			return 1;
	}
	return 0;
}

/* Read one reply on c (what: the command, for why) within deadline: 0 and *out (the
 * caller's to free; of any type), or -ETIMEDOUT when none came (c stays in step: what came
 * of a reply stays in its reader), or another fault (c is then out of step). */
static int recv_reply(redisContext *c, const char *what, int64_t deadline, redisReply **out,
		      char *why, size_t whylen)
{
	char buf[16384];
	int rc;

	*out = NULL;
	for (;;) {
		void *got = NULL;
		ssize_t n;

		array_refused = 0;
		if (redisReaderGetReply(c->reader, &got) != REDIS_OK) {
			rc = c->reader->err == REDIS_ERR_OOM && !array_refused ? -ENOMEM : -EPROTO;
			say(why, whylen, "%s: %s", what, array_refused ?
			    "garbage: an array reply of an absurd size" : c->reader->errstr);
			return rc;
		}
		if (got) {
			*out = got;
			return 0;
		}
		if (c->reader->len - c->reader->pos > MAX_REPLY || declared_too_big(c->reader)) {
			rc = -EPROTO;
			say(why, whylen, "%s: a reply larger than %zu MiB", what, MAX_REPLY >> 20);
			return rc;
		}
		rc = wait_fd(c->fd, POLLIN, deadline);
		if (rc) {
			say(why, whylen, "%s: no answer within the timeout", what);
			return rc;
		}
		n = recv(c->fd, buf, sizeof(buf), MSG_DONTWAIT);
		if (n == 0) {
			rc = -ENOTCONN;
			say(why, whylen, "%s: the server closed the connection", what);
			return rc;
		}
		if (n < 0) {
			if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
				continue;
			rc = io_errno(errno);
			say(why, whylen, "%s: receiving: %s", what, strerror(errno));
			return rc;
		}
		if (redisReaderFeed(c->reader, buf, (size_t)n) != REDIS_OK) {
			rc = -ENOMEM;
			say(why, whylen, "%s: out of memory reading the reply", what);
			return rc;
		}
	}
}

/* One command and its reply on c, within deadline. 0 and *out (a reply of a type in
 * accept; an error reply is mapped, never returned), or -errno with why filled. After an
 * error c is out of step and must be freed. Bytes after the reply are garbage unless
 * more_ok (a subscribed connection: a message may follow at once). */
static int command(redisContext *c, int argc, const char **argv, const size_t *lens,
		   unsigned accept, int64_t deadline, int more_ok, redisReply **out, char *why,
		   size_t whylen)
{
	char *cmd = NULL;
	int len = redisFormatCommandArgv(&cmd, argc, argv, lens);
	size_t off = 0;
	redisReply *r = NULL;
	int rc;

	*out = NULL;
	if (len < 0 || !cmd) {
		say(why, whylen, "out of memory formatting %s", argv[0]);
		return -ENOMEM;
	}
	while (off < (size_t)len) {
		ssize_t n = send(c->fd, cmd + off, (size_t)len - off, MSG_NOSIGNAL | MSG_DONTWAIT);

		if (n > 0) {
			off += (size_t)n;
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
			rc = wait_fd(c->fd, POLLOUT, deadline);
			if (rc) {
				say(why, whylen, "%s: sending: %s", argv[0], strerror(-rc));
				goto out;
			}
			continue;
		}
		rc = io_errno(n < 0 ? errno : EPIPE);
		say(why, whylen, "%s: sending: %s", argv[0], strerror(n < 0 ? errno : EPIPE));
		goto out;
	}
	rc = recv_reply(c, argv[0], deadline, &r, why, whylen);
	if (rc)
		goto out;
	if (c->reader->pos < c->reader->len && !more_ok) {
		rc = -EPROTO;
		say(why, whylen, "%s: garbage: more bytes than one reply", argv[0]);
	} else if (r->type == REDIS_REPLY_ERROR) {
		rc = reply_errno(r->str ? r->str : "");
		say(why, whylen, "%s: %.150s", argv[0], r->str ? r->str : "");
	} else if (r->type < 0 || r->type > 31 || !(accept & T(r->type))) {
		rc = -EPROTO;
		say(why, whylen, "%s: garbage: a reply of type %d", argv[0], r->type);
	} else {
		*out = r;
		r = NULL;
		rc = 0;
	}
out:
	if (r)
		freeReplyObject(r);
	redisFreeCommand(cmd);
	return rc;
}

static int exchange(redisContext *c, int argc, const char **argv, const size_t *lens,
		    unsigned accept, int64_t deadline, redisReply **out, char *why, size_t whylen)
{
	return command(c, argc, argv, lens, accept, deadline, 0, out, why, whylen);
}

/* A status reply that must be "OK". */
static int expect_ok(redisContext *c, int argc, const char **argv, const size_t *lens,
		     int64_t deadline, char *why, size_t whylen)
{
	redisReply *r;
	int rc = exchange(c, argc, argv, lens, T(REDIS_REPLY_STATUS), deadline, &r, why, whylen);

	if (rc)
		return rc;
	if (strcmp(r->str ? r->str : "", "OK")) {
		rc = -EPROTO;
		say(why, whylen, "%s: garbage: status \"%.40s\"", argv[0], r->str ? r->str : "");
	}
	freeReplyObject(r);
	return rc;
}

/* A new connection to the server, authenticated and on its database. */
static int server_connect(struct redis_backend *b, int64_t deadline, redisContext **out,
			  char *why, size_t whylen)
{
	int64_t left = deadline - kc_mono_ms();
	struct timeval tv, optv;
	redisContext *c;
	int saved, rc;

	*out = NULL;
	if (left <= 0)
		return -ETIMEDOUT;
	tv.tv_sec = left / 1000;
	tv.tv_usec = (left % 1000) * 1000;
	errno = 0;
	c = b->addr.is_unix ? redisConnectUnixWithTimeout(b->addr.path, tv) :
			      redisConnectWithTimeout(b->addr.host, b->addr.port, tv);
	saved = errno;
	if (!c) {
		say(why, whylen, "connect: out of memory");
		return -ENOMEM;
	}
	if (c->err) {
		rc = connect_errno(c, saved);
		say(why, whylen, "connect: %s", c->errstr);
		redisFree(c);
		return rc;
	}
	/* Exchanges poll against the deadline; the socket timeouts bound anything else. */
	optv.tv_sec = b->base.timeout_ms / 1000;
	optv.tv_usec = (b->base.timeout_ms % 1000) * 1000;
	redisSetTimeout(c, optv);
	pthread_once(&fns_once, fns_init);
	c->reader->fn = &guarded_fns;
	if (b->pass) {
		const char *argv[3] = {"AUTH", b->user ? b->user : b->pass, b->pass};
		size_t lens[3] = {4, strlen(argv[1]), strlen(b->pass)};

		rc = expect_ok(c, b->user ? 3 : 2, argv, lens, deadline, why, whylen);
		if (rc)
			goto fail;
	}
	if (b->addr.db) {
		char db[16];
		const char *argv[2] = {"SELECT", db};
		size_t lens[2] = {6, (size_t)snprintf(db, sizeof(db), "%d", b->addr.db)};

		rc = expect_ok(c, 2, argv, lens, deadline, why, whylen);
		if (rc)
			goto fail;
	}
	*out = c;
	return 0;
fail:
	redisFree(c);
	return rc;
}

/* An idle connection that the server has not closed meanwhile, or NULL. */
static redisContext *pool_take(struct redis_backend *s)
{
	for (;;) {
		redisContext *c = NULL;
		struct pollfd p;

		pthread_mutex_lock(&s->lock);
		if (s->nidle)
			c = s->idle[--s->nidle];
		pthread_mutex_unlock(&s->lock);
		if (!c)
			return NULL;
		/* Readable while idle: EOF (a restart, an idle timeout) or bytes nobody asked
		 * for. Either way it is of no use. Not a retry: nothing was sent on it. */
		p.fd = c->fd;
		p.events = POLLIN;
		p.revents = 0;
		if (poll(&p, 1, 0) == 0)
			return c;
		redisFree(c);
	}
}

static void pool_give(struct redis_backend *s, redisContext *c)
{
	pthread_mutex_lock(&s->lock);
	if (s->nidle < KC_REDIS_POOL) {
		s->idle[s->nidle++] = c;
		c = NULL;
	}
	pthread_mutex_unlock(&s->lock);
	if (c)
		redisFree(c);
}

/* Log the server's fault: once per cause, again after RELOG_S; never the password. With
 * several shards, each shard's backend logs its own. */
static void server_fault(struct redis_backend *b, const char *op, int rc, char *why)
{
	time_t now = time(NULL);
	char *p;

	if (b->pass && *b->pass)
		while ((p = strstr(why, b->pass)))
			memset(p, '*', strlen(b->pass));
	pthread_mutex_lock(&b->lock);
	if (!b->down || strcmp(b->last_why, why) || now - b->last_log >= RELOG_S) {
		kc_log(KC_LOG_WARN, "remote: %s: %s failed: %s (%s)", b->addr.canon, op,
		       strerror(-rc), why);
		b->last_log = now;
		snprintf(b->last_why, sizeof(b->last_why), "%s", why);
	}
	b->down = 1;
	pthread_mutex_unlock(&b->lock);
}

static void server_ok(struct redis_backend *s)
{
	int was;

	pthread_mutex_lock(&s->lock);
	was = s->down;
	s->down = 0;
	s->last_why[0] = 0;
	pthread_mutex_unlock(&s->lock);
	if (was)
		kc_log(KC_LOG_INFO, "remote: %s answers again", s->addr.canon);
}

/* Run one command (of operation op) on the server: 0 and *out, or -errno (logged, except
 * -EACCES when quiet_acl: a command the ACL refuses, which the caller does without). */
static int call_as(struct redis_backend *b, const char *op, int argc, const char **argv,
		   const size_t *lens, unsigned accept, int quiet_acl, redisReply **out)
{
	int64_t deadline = kc_mono_ms() + b->base.timeout_ms;
	char why[200] = "";
	redisContext *c = pool_take(b);
	int rc = 0;

	if (!c)
		rc = server_connect(b, deadline, &c, why, sizeof(why));
	if (!rc)
		rc = exchange(c, argc, argv, lens, accept, deadline, out, why, sizeof(why));
	if (rc == -EACCES && quiet_acl && c) { /* an error reply: c is still in step */
		pool_give(b, c);
		return rc;
	}
	if (rc) {
		if (c)
			redisFree(c);
		server_fault(b, op, rc, why);
		return rc;
	}
	pool_give(b, c);
	server_ok(b);
	return 0;
}

static int call(struct redis_backend *b, const char *op, int argc, const char **argv,
		const size_t *lens, unsigned accept, redisReply **out)
{
	return call_as(b, op, argc, argv, lens, accept, 0, out);
}

/* ---- the operations ---- */

/* name = prefix + key (a valid key) */
static int name_of(const char *prefix, const char *key, char name[64 + KC_REMOTE_KEYLEN])
{
	if (!kc_hex_lower_str(key, KC_REMOTE_KEYLEN))
		return -EINVAL;
	snprintf(name, 64 + KC_REMOTE_KEYLEN, "%s%s", prefix, key);
	return 0;
}

/* GET prefix+key on the server: 0 and *r (a string or nil reply, caller frees). */
static int get_named(struct redis_backend *b, const char *op, const char *prefix,
		     const char *key, redisReply **r)
{
	char name[64 + KC_REMOTE_KEYLEN];
	const char *argv[2] = {"GET", name};
	size_t lens[2] = {3, 0};

	if (name_of(prefix, key, name))
		return -EINVAL;
	lens[1] = strlen(name);
	return call(b, op, 2, argv, lens, T(REDIS_REPLY_STRING) | T(REDIS_REPLY_NIL), r);
}

static int r_get(struct kc_remote_backend *base, const char *key, char **data, size_t *len)
{
	redisReply *r;
	int rc;

	*data = NULL;
	*len = 0;
	rc = get_named((struct redis_backend *)base, "get", OBJ_PREFIX, key, &r);
	if (rc)
		return rc;
	if (r->type == REDIS_REPLY_NIL) {
		rc = -ENOENT;
	} else {
		*data = malloc(r->len ? r->len : 1);
		if (*data) {
			memcpy(*data, r->str, r->len);
			*len = r->len;
		} else {
			rc = -ENOMEM;
		}
	}
	freeReplyObject(r);
	return rc;
}

/* SET key's object to data: only when there is none (nx: put), or replacing it. */
static int r_set(struct kc_remote_backend *base, const char *key, const void *data, size_t len,
		 int nx)
{
	struct redis_backend *b = (struct redis_backend *)base;
	char name[64 + KC_REMOTE_KEYLEN];
	const char *argv[4] = {"SET", name, data, "NX"};
	size_t lens[4] = {3, 0, len, 2};
	redisReply *r;
	int rc;

	if (name_of(OBJ_PREFIX, key, name) || (!data && len) || len >= MAX_REPLY)
		return -EINVAL;
	if (!data)
		argv[2] = "";
	lens[1] = strlen(name);
	rc = call(b, nx ? "put" : "replace", nx ? 4 : 3, argv, lens,
		  T(REDIS_REPLY_STATUS) | T(REDIS_REPLY_NIL), &r);
	if (rc)
		return rc;
	if (r->type == REDIS_REPLY_NIL)
		rc = -EEXIST;
	else if (strcmp(r->str ? r->str : "", "OK"))
		rc = -EPROTO;
	freeReplyObject(r);
	return rc;
}

static int r_put(struct kc_remote_backend *base, const char *key, const void *data, size_t len)
{
	return r_set(base, key, data, len, 1);
}

static int r_replace(struct kc_remote_backend *base, const char *key, const void *data,
		     size_t len)
{
	return r_set(base, key, data, len, 0);
}

#define LEASE_ARGS 7

/* Run a lease script on key's lease and liveness keys with args (NUL-terminated, n at
 * most LEASE_ARGS): 0 and *r (of a type in accept; the caller frees it), or -errno. */
static int lease_eval(struct redis_backend *b, const char *op, const char *script,
		      const char *key, int n, const char *const *args, unsigned accept,
		      redisReply **r)
{
	char lease[64 + KC_REMOTE_KEYLEN], alive[64 + KC_REMOTE_KEYLEN];
	const char *argv[5 + LEASE_ARGS] = {"EVAL", script, "2", lease, alive};
	size_t lens[5 + LEASE_ARGS];

	if (name_of(LEASE_PREFIX, key, lease) || name_of(ALIVE_PREFIX, key, alive))
		return -EINVAL;
	for (int i = 0; i < n; i++)
		argv[5 + i] = args[i];
	for (int i = 0; i < 5 + n; i++)
		lens[i] = strlen(argv[i]);
	return call(b, op, 5 + n, argv, lens, accept, r);
}

/* Run a script that answers 1 (done) or 0 (not our lease): 0, -ENOLCK or -errno. */
static int lease_eval_int(struct redis_backend *b, const char *op, const char *script,
			  const char *key, int n, const char *const *args)
{
	redisReply *r;
	int rc = lease_eval(b, op, script, key, n, args, T(REDIS_REPLY_INTEGER), &r);

	if (rc)
		return rc;
	rc = r->integer == 1 ? 0 : r->integer == 0 ? -ENOLCK : -EPROTO;
	freeReplyObject(r);
	return rc;
}

/* Whether the record v/len standing on key checks: 0 with *seen, else -EBADMSG (logged
 * at debug: anyone who can write the store can plant one). */
static int record_check(struct redis_backend *b, const char *key, const char *v, size_t len,
			struct kc_lease_seen *seen)
{
	char why[200];
	int rc = kc_lease_check(b->base.secret, key, v, len, b->base.held_max_ms,
				b->base.note_max_ms, seen, why, sizeof(why));

	if (rc == -EBADMSG)
		kc_log(KC_LOG_DEBUG, "remote: lease %.16s ignored: %s", key, why);
	return rc;
}

/* The judging arguments of take and peek: held_max, note_max (into nums) and judged. */
static void judge_args(struct redis_backend *b, const char **args, char nums[2][16],
		       const char *judged)
{
	snprintf(nums[0], 16, "%u", b->base.held_max_ms);
	snprintf(nums[1], 16, "%u", b->base.note_max_ms);
	args[4] = nums[0];
	args[5] = nums[1];
	args[6] = judged;
}

static int r_lease_take(struct kc_remote_backend *base, const char *key, const char *token,
			unsigned ttl_ms, enum kc_lease_state *state)
{
	struct redis_backend *b = (struct redis_backend *)base;
	char rec[KC_LEASE_RECORD_MAX], ttl[16], alive[16], nums[2][16], *judged = NULL;
	const char *args[LEASE_ARGS] = {rec, ttl, token, alive};
	struct kc_lease_seen seen;
	redisReply *r;
	int rc = -EBUSY;

	if (!ttl_ms || !kc_hex_lower_str(token, KC_REMOTE_TOKENLEN) ||
	    kc_lease_record(base->secret, key, KC_LEASE_HELD, token, ttl_ms, rec) < 0)
		return -EINVAL;
	snprintf(ttl, sizeof(ttl), "%u", ttl_ms);
	snprintf(alive, sizeof(alive), "%u", KC_REMOTE_ALIVE_MS);
	*state = KC_LEASE_HELD;
	/* a record that does not check is named and replaced: twice, then it is busy */
	for (int attempt = 0; attempt < 2 && rc == -EBUSY; attempt++) {
		judge_args(b, args, nums, judged ? judged : "");
		rc = lease_eval(b, "lease take", take_script, key, LEASE_ARGS, args,
				T(REDIS_REPLY_STRING), &r);
		if (rc)
			break;
		if (r->len == 1 && r->str[0] == '0') {
			rc = 0;
		} else if (r->len < 1 || r->str[0] != '1') {
			rc = -EPROTO;
		} else if (record_check(b, key, r->str + 1, r->len - 1, &seen) == 0) {
			*state = seen.state;
			rc = -EBUSY;
			attempt = 2;
		} else {
			free(judged);
			judged = strndup(r->str + 1, r->len - 1);
			rc = judged ? -EBUSY : -ENOMEM;
		}
		freeReplyObject(r);
	}
	free(judged);
	return rc;
}

static int r_lease_renew(struct kc_remote_backend *base, const char *key, const char *token,
			 unsigned ttl_ms)
{
	char prefix[8 + KC_REMOTE_TOKENLEN], ttl[16], alive[16];
	const char *args[4] = {prefix, ttl, token, alive};

	if (!ttl_ms || !kc_hex_lower_str(token, KC_REMOTE_TOKENLEN))
		return -EINVAL;
	snprintf(prefix, sizeof(prefix), "held %s ", token);
	snprintf(ttl, sizeof(ttl), "%u", ttl_ms);
	snprintf(alive, sizeof(alive), "%u", KC_REMOTE_ALIVE_MS);
	return lease_eval_int((struct redis_backend *)base, "lease renew", renew_script, key, 4,
			      args);
}

static int r_lease_release(struct kc_remote_backend *base, const char *key, const char *token,
			   unsigned fail_ms)
{
	char prefix[8 + KC_REMOTE_TOKENLEN], ms[16], note[KC_LEASE_RECORD_MAX] = "";
	const char *args[3] = {prefix, ms, note};

	if (!kc_hex_lower_str(token, KC_REMOTE_TOKENLEN) ||
	    (fail_ms && kc_lease_record(base->secret, key, KC_LEASE_FAILED, token, fail_ms,
					note) < 0))
		return -EINVAL;
	snprintf(prefix, sizeof(prefix), "held %s ", token);
	snprintf(ms, sizeof(ms), "%u", fail_ms);
	return lease_eval_int((struct redis_backend *)base, "lease release", release_script, key,
			      3, args);
}

static int r_lease_peek(struct kc_remote_backend *base, const char *key, enum kc_lease_state *state)
{
	struct redis_backend *b = (struct redis_backend *)base;
	char nums[2][16];
	char alive[16];
	const char *args[LEASE_ARGS] = {"", "", "", alive};
	struct kc_lease_seen seen;
	redisReply *r;

	snprintf(alive, sizeof(alive), "%u", KC_REMOTE_ALIVE_MS);
	judge_args(b, args, nums, "");
	int rc = lease_eval(b, "lease peek", peek_script, key, LEASE_ARGS, args,
			    T(REDIS_REPLY_STRING), &r);
	if (rc)
		return rc;
	*state = KC_LEASE_NONE;
	if (r->len && record_check(b, key, r->str, r->len, &seen) == 0)
		*state = seen.state;
	freeReplyObject(r);
	return 0;
}

/* ---- notices: PUBLISH on the server; each waiter SUBSCRIBEs on its own connection,
 * which the pool never sees (a subscribed connection takes no other command) ---- */

struct kc_remote_watch {
	redisContext *c; /* subscribed to STORED_PREFIX key */
};

static int r_watch_start(struct kc_remote_backend *base, const char *key,
			 struct kc_remote_watch **w)
{
	struct redis_backend *b = (struct redis_backend *)base;
	char name[64 + KC_REMOTE_KEYLEN], why[200] = "";
	const char *argv[2] = {"SUBSCRIBE", name};
	size_t lens[2] = {9, 0};
	int64_t deadline = kc_mono_ms() + b->base.timeout_ms;
	redisReply *r = NULL;
	int rc;

	*w = NULL;
	if (name_of(STORED_PREFIX, key, name))
		return -EINVAL;
	lens[1] = strlen(name);
	struct kc_remote_watch *nw = calloc(1, sizeof(*nw));
	if (!nw)
		return -ENOMEM;
	rc = server_connect(b, deadline, &nw->c, why, sizeof(why));
	if (!rc)
		rc = command(nw->c, 2, argv, lens, T(REDIS_REPLY_ARRAY), deadline, 1, &r, why,
			     sizeof(why));
	if (r)
		freeReplyObject(r);
	if (rc) {
		/* not server_fault: a store that refuses SUBSCRIBE (an ACL) still serves */
		kc_log(KC_LOG_DEBUG, "remote: %s: subscribe failed: %s (%s); polling",
		       b->addr.canon, strerror(-rc), why);
		if (nw->c)
			redisFree(nw->c);
		free(nw);
		return rc;
	}
	*w = nw;
	return 0;
}

static int r_watch_wait(struct kc_remote_backend *base, struct kc_remote_watch *w, unsigned ms)
{
	char why[200] = "";
	redisReply *r;
	int rc = recv_reply(w->c, "SUBSCRIBE", kc_mono_ms() + ms, &r, why, sizeof(why));

	if (rc == -ETIMEDOUT)
		return rc;
	if (rc) {
		kc_log(KC_LOG_DEBUG, "remote: %s: notices: %s (%s); polling",
		       ((struct redis_backend *)base)->addr.canon,
		       strerror(-rc), why);
		return rc;
	}
	/* ["message", channel, payload]: the payload means nothing (anyone may publish) */
	rc = r->type == REDIS_REPLY_ARRAY && r->elements == 3 && r->element[0]->str &&
	     !strcmp(r->element[0]->str, "message") ? 0 : -EPROTO;
	freeReplyObject(r);
	return rc;
}

static void r_watch_end(struct kc_remote_backend *base, struct kc_remote_watch *w)
{
	(void)base;
	if (!w)
		return;
	redisFree(w->c);
	free(w);
}

static int r_notify(struct kc_remote_backend *base, const char *key)
{
	char name[64 + KC_REMOTE_KEYLEN];
	const char *argv[3] = {"PUBLISH", name, "1"};
	size_t lens[3] = {7, 0, 1};
	redisReply *r;

	if (name_of(STORED_PREFIX, key, name))
		return -EINVAL;
	lens[1] = strlen(name);
	int rc = call_as((struct redis_backend *)base, "notify", 3, argv, lens,
			 T(REDIS_REPLY_INTEGER), 1, &r);
	if (!rc)
		freeReplyObject(r);
	return rc;
}

static const char *r_describe(struct kc_remote_backend *base)
{
	return ((struct redis_backend *)base)->addr.canon;
}

static void r_destroy(struct kc_remote_backend *base)
{
	struct redis_backend *b = (struct redis_backend *)base;

	if (!b)
		return;
	for (int j = 0; j < b->nidle; j++)
		redisFree(b->idle[j]);
	pthread_mutex_destroy(&b->lock);
	kc_secret_free(b->pass, b->pass ? strlen(b->pass) : 0);
	free(b->user);
	free(b);
}

static const struct kc_remote_backend_ops redis_ops = {
	.get = r_get,
	.put = r_put,
	.replace = r_replace,
	.lease_take = r_lease_take,
	.lease_renew = r_lease_renew,
	.lease_release = r_lease_release,
	.lease_peek = r_lease_peek,
	.watch_start = r_watch_start,
	.watch_wait = r_watch_wait,
	.watch_end = r_watch_end,
	.notify = r_notify,
	.describe = r_describe,
	.destroy = r_destroy,
};

struct kc_remote_backend *kc_remote_redis_open(const struct kc_redis_addr *addr,
					       const char *user, const char *pass,
					       unsigned timeout_ms, char *why, size_t whylen)
{
	struct redis_backend *b;

	if (!timeout_ms) {
		say(why, whylen, "remote: the timeout must be at least 1 ms");
		errno = EINVAL;
		return NULL;
	}
	b = calloc(1, sizeof(*b));
	if (!b) {
		say(why, whylen, "remote: out of memory");
		errno = ENOMEM;
		return NULL;
	}
	pthread_mutex_init(&b->lock, NULL);
	if ((user && !(b->user = strdup(user))) || (pass && !(b->pass = strdup(pass)))) {
		say(why, whylen, "remote: out of memory");
		r_destroy(&b->base);
		errno = ENOMEM;
		return NULL;
	}
	b->addr = *addr;
	b->base.ops = &redis_ops;
	b->base.timeout_ms = timeout_ms;
	b->base.held_max_ms = KC_REMOTE_RECORD_MAX_MS;
	b->base.note_max_ms = KC_REMOTE_RECORD_MAX_MS;
	return &b->base;
}
