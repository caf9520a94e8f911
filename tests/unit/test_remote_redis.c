/* test_remote_redis.c - the Redis backend against real redis-server processes (Debian's),
 * each started here on a Unix socket (or a loopback port) in a temp directory, and
 * SIGKILLed on every way out: at exit, on SIGTERM/SIGINT, and by the kernel if this
 * process dies (PR_SET_PDEATHSIG). Also a fake server in a thread that answers garbage.
 * The behaviour every backend owes is remote_contract.c's, run here on a server; what is
 * tested here besides is Redis's own (URLs, sharding, auth, keys and expiries on the
 * server, records, notices, faults).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "hash.h"
#include "log.h"
#include "remote.h"
#include "remote_object.h"
#include "remote_redis.h"
#include "remote_shards.h"
#include "remote_contract.h"
#include "tap.h"

#define MAX_SERVERS 8
#define READY_WAIT_MS 30000 /* a busy machine may take a while to start redis-server */
/* The ACL grants doc/cluster.md tells operators to give (test_docs.py checks the text). */
#define DOC_GRANTS "~kcachefs:* &kcachefs:stored:* +get +set +eval +pexpire +pttl +del +select +subscribe +publish"
#define SLOW_BOUND_MS 10000 /* "returned at all" bound for faults, never a timing target */

struct server {
	pid_t pid;
	char name[32];
	char sock[256]; /* Unix socket path */
	int port;       /* 0: no TCP listener */
	char admin_pass[64];
};

static char tmpdir[200];
static struct server *servers[MAX_SERVERS];

static int64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void nap_ms(int ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};

	nanosleep(&ts, NULL);
}

static void kill_all(void)
{
	for (int i = 0; i < MAX_SERVERS; i++)
		if (servers[i] && servers[i]->pid > 0) {
			kill(servers[i]->pid, SIGKILL);
			waitpid(servers[i]->pid, NULL, 0);
			servers[i]->pid = 0;
		}
}

static void cleanup(void)
{
	kill_all();
	if (tmpdir[0]) {
		char cmd[300];

		snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
		if (system(cmd) != 0)
			fprintf(stderr, "# could not remove %s\n", tmpdir);
		tmpdir[0] = 0;
	}
}

static void on_signal(int sig)
{
	for (int i = 0; i < MAX_SERVERS; i++)
		if (servers[i] && servers[i]->pid > 0)
			kill(servers[i]->pid, SIGKILL);
	signal(sig, SIG_DFL);
	raise(sig);
}

/* An admin connection (hiredis directly), or NULL. */
static redisContext *admin(struct server *s)
{
	struct timeval tv = {5, 0};
	redisContext *c = redisConnectUnixWithTimeout(s->sock, tv);

	if (!c || c->err) {
		if (c)
			redisFree(c);
		return NULL;
	}
	redisSetTimeout(c, tv);
	if (s->admin_pass[0]) {
		redisReply *r = redisCommand(c, "AUTH %s", s->admin_pass);
		int ok = r && r->type == REDIS_REPLY_STATUS;

		if (r)
			freeReplyObject(r);
		if (!ok) {
			redisFree(c);
			return NULL;
		}
	}
	return c;
}

/* Run one admin command; returns the reply (caller frees) or NULL. */
static redisReply *cmd(struct server *s, const char *fmt, ...)
{
	redisContext *c = admin(s);
	redisReply *r;
	va_list ap;

	if (!c)
		return NULL;
	va_start(ap, fmt);
	r = redisvCommand(c, fmt, ap);
	va_end(ap);
	redisFree(c);
	return r;
}

/* An admin command whose reply is an integer; LLONG_MIN on any failure. */
static long long cmd_int(struct server *s, const char *fmt, const char *arg)
{
	redisReply *r = cmd(s, fmt, arg);
	long long v = r && r->type == REDIS_REPLY_INTEGER ? r->integer : -999999;

	if (r)
		freeReplyObject(r);
	return v;
}

static int cmd_ok(struct server *s, const char *fmt, const char *arg)
{
	redisReply *r = cmd(s, fmt, arg);
	int ok = r && r->type == REDIS_REPLY_STATUS;

	if (r)
		freeReplyObject(r);
	return ok;
}

static int ping(struct server *s)
{
	redisReply *r = cmd(s, "PING");
	int ok = r && r->type == REDIS_REPLY_STATUS && !strcmp(r->str, "PONG");

	if (r)
		freeReplyObject(r);
	return ok;
}

/* Start redis-server s (name and port set by the caller; the socket goes in tmpdir),
 * extra: more "--option value" words, NULL-terminated. 0 when it answers PING. */
static int start(struct server *s, const char *const *extra)
{
	char port[16], dir[300], log[320];
	const char *argv[64];
	int n = 0, slot = -1;
	int64_t until;

	snprintf(s->sock, sizeof(s->sock), "%s/%s.sock", tmpdir, s->name);
	snprintf(port, sizeof(port), "%d", s->port);
	snprintf(dir, sizeof(dir), "%s", tmpdir);
	snprintf(log, sizeof(log), "%s/%s.log", tmpdir, s->name);
	argv[n++] = "redis-server";
	argv[n++] = "--port";
	argv[n++] = port;
	argv[n++] = "--bind";
	argv[n++] = "127.0.0.1";
	argv[n++] = "--unixsocket";
	argv[n++] = s->sock;
	argv[n++] = "--unixsocketperm";
	argv[n++] = "700";
	argv[n++] = "--save";
	argv[n++] = "";
	argv[n++] = "--appendonly";
	argv[n++] = "no";
	argv[n++] = "--daemonize";
	argv[n++] = "no";
	argv[n++] = "--dir";
	argv[n++] = dir;
	argv[n++] = "--logfile";
	argv[n++] = log;
	argv[n++] = "--enable-debug-command";
	argv[n++] = "local";
	for (int i = 0; extra && extra[i] && n < 62; i++)
		argv[n++] = extra[i];
	argv[n] = NULL;
	for (int i = 0; i < MAX_SERVERS; i++)
		if (!servers[i] || servers[i] == s) {
			slot = i;
			break;
		}
	if (slot < 0)
		return -1;
	servers[slot] = s;
	unlink(s->sock);
	s->pid = fork();
	if (s->pid < 0)
		return -1;
	if (s->pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		execvp("redis-server", (char **)argv);
		_exit(127);
	}
	until = now_ms() + READY_WAIT_MS;
	while (now_ms() < until) {
		if (ping(s))
			return 0;
		if (waitpid(s->pid, NULL, WNOHANG) == s->pid) {
			s->pid = 0;
			return -1;
		}
		nap_ms(20);
	}
	return -1;
}

static void stop(struct server *s, int sig)
{
	if (s->pid > 0) {
		kill(s->pid, sig);
		waitpid(s->pid, NULL, 0);
		s->pid = 0;
	}
}

static struct kc_remote_backend *open_url(const char *url, const char *auth, unsigned ms)
{
	char why[300] = "";
	struct kc_remote_backend *b = kc_remote_backend_open(url, auth, ms, why, sizeof(why));

	if (!b)
		printf("# open %s: %s\n", url, why);
	return b;
}

static struct kc_remote_backend *open_server(struct server *s, const char *auth, unsigned ms)
{
	char url[300];

	snprintf(url, sizeof(url), "redis+unix://%s", s->sock);
	return open_url(url, auth, ms);
}

/* The i-th test key: SHA-256 of "key <tag> <i>". */
static void key_of(const char *tag, int i, char key[KC_SHA256_HEXLEN + 1])
{
	char buf[64];

	snprintf(buf, sizeof(buf), "key %s %d", tag, i);
	kc_sha256_buf(buf, strlen(buf), key);
}

static const char TOKA[] = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
static const char TOKB[] = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

/* ---- URLs, hashing, auth files: no server ---- */

static void test_parse(void)
{
	static const struct {
		const char *url, *canon;
	} good[] = {
		{"redis://localhost", "redis://localhost:6379/0"},
		{"redis://Cache-1.example.org:6380/2", "redis://cache-1.example.org:6380/2"},
		{"redis://10.0.0.5:6379", "redis://10.0.0.5:6379/0"},
		{"redis://[::1]:7000/15", "redis://[::1]:7000/15"},
		{"redis://[fe80::1]", "redis://[fe80::1]:6379/0"},
		{"redis://redis_1", "redis://redis_1:6379/0"},
		{"redis+unix:///run/redis/redis.sock", "redis+unix:///run/redis/redis.sock?db=0"},
		{"redis+unix:///tmp/r.sock?db=3", "redis+unix:///tmp/r.sock?db=3"},
		{"redis://h:65535/2147483647", "redis://h:65535/2147483647"},
	};
	static const char *bad[] = {
		"", "redis://", "redis:///", "redis://:6379", "redis://host:", "redis://host:0",
		"redis://host:65536", "redis://host:99999999999", "redis://host:+1", "redis://host:-1",
		"redis://host:06379", "redis://host:63 79", "redis://host/", "redis://host/x",
		"redis://host/1/2", "redis://host/-1", "redis://host/01", "redis://host/2147483648",
		"redis://host?db=1", "redis://user:pw@host", "redis://:pw@host", "redis://host#frag",
		"redis://ho%20st", "redis://-host", "redis://.host", "redis://ho..st", "redis://host-",
		"redis://[::1", "redis://[::zz]", "redis://[]", "redis://[::1]x", "redis://ho st",
		"redis://host\t", " redis://host", "REDIS://host", "rediss://host", "http://host",
		"redis:/host", "redis//host", "dir:/x", "redis://host|", "|redis://host",
		"redis://a||redis://b", "redis://a|redis://a", "redis://a|redis://A:6379/0",
		"redis+unix://", "redis+unix:///", "redis+unix://host/tmp/s", "redis+unix://tmp/s",
		"redis+unix:///tmp/s?db=", "redis+unix:///tmp/s?db=x", "redis+unix:///tmp/s?db=1&x=2",
		"redis+unix:///tmp/s?foo=1", "redis+unix:///tmp/s?db=-1", "redis+unix:///tmp/dir/",
		"redis+unix:///tmp/s?", "redis+unix:///tmp/s\x01", "redis://host\x7f",
		"redis+unix:///aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
		"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
	};
	struct kc_redis_addr *a;
	char why[300], buf[2000], *big;
	int ok = 1, n;

	for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
		n = kc_redis_parse(good[i].url, &a, why, sizeof(why));
		if (n != 1 || strcmp(a->canon, good[i].canon)) {
			printf("# %s -> %d %s\n", good[i].url, n, n == 1 ? a->canon : why);
			ok = 0;
		}
		free(a);
	}
	CHECK(ok, "well-formed URLs parse to their canonical form");
	n = kc_redis_parse("redis+unix:///tmp/x.sock?db=1|redis://10.0.0.1|redis://[::1]:1/1", &a,
			   why, sizeof(why));
	CHECK(n == 3 && a[0].is_unix && !strcmp(a[0].path, "/tmp/x.sock") && a[0].db == 1 &&
	      !a[1].is_unix && !strcmp(a[1].host, "10.0.0.1") && a[1].port == 6379 &&
	      !strcmp(a[2].host, "::1") && a[2].port == 1 && a[2].db == 1,
	      "three shards parse with their fields");
	free(a);
	ok = 1;
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		why[0] = 0;
		n = kc_redis_parse(bad[i], &a, why, sizeof(why));
		if (n != -EINVAL || a || !why[0]) {
			printf("# not refused: \"%s\" (%d)\n", bad[i], n);
			ok = 0;
			free(a);
		}
	}
	CHECK(ok, "every malformed URL is -EINVAL with a reason");
	why[0] = 0;
	kc_redis_parse("redis://alice:s3cret@host", &a, why, sizeof(why));
	CHECK(!strstr(why, "s3cret") && strstr(why, "remote_auth"),
	      "credentials in a URL are refused, pointing to remote_auth=, not echoed");
	CHECK(kc_redis_parse(NULL, &a, why, sizeof(why)) == -EINVAL, "a NULL URL is -EINVAL");
	buf[0] = 0;
	for (int i = 0; i <= KC_REMOTE_MAX_SHARDS; i++)
		snprintf(buf + strlen(buf), sizeof(buf) - strlen(buf), "%sredis://h%d", i ? "|" : "", i);
	CHECK(strlen(buf) < sizeof(buf) - 1 && kc_redis_parse(buf, &a, why, sizeof(why)) == -EINVAL,
	      "more than KC_REMOTE_MAX_SHARDS shards is -EINVAL");
	big = malloc(20000);
	memset(big, 'a', 19999);
	big[19999] = 0;
	memcpy(big, "redis://", 8);
	CHECK(kc_redis_parse(big, &a, why, sizeof(why)) == -EINVAL, "a 20000-byte URL is -EINVAL");
	free(big);
	/* Every prefix and every one-byte change of a good URL: never a crash; accepted only
	 * when the result is itself well-formed (re-parses to the same canonical form). */
	{
		const char *seed = "redis://[::1]:7000/15|redis+unix:///tmp/r.sock?db=3";
		size_t sl = strlen(seed);
		char m[128];
		int crashfree = 1;

		for (size_t i = 0; i < sl; i++)
			for (int c = 1; c < 256; c += 7) {
				memcpy(m, seed, sl + 1);
				m[i] = (char)c;
				n = kc_redis_parse(m, &a, why, sizeof(why));
				if (n > 0) {
					for (int k = 0; k < n; k++) {
						struct kc_redis_addr *b2;
						if (kc_redis_parse(a[k].canon, &b2, why, sizeof(why)) != 1 ||
						    strcmp(b2->canon, a[k].canon))
							crashfree = 0;
						free(b2);
					}
					free(a);
				} else if (n != -EINVAL) {
					crashfree = 0;
				}
				m[i] = 0;
				n = kc_redis_parse(m, &a, why, sizeof(why));
				if (n > 0)
					free(a);
				else if (n != -EINVAL)
					crashfree = 0;
			}
		CHECK(crashfree, "mutated URLs: -EINVAL, or a shard list whose canonical forms re-parse");
	}
}

/* The shard of addrs[0..n) that holds key: the store layer's pick over their canonical
 * URLs, as the sharded backend does it. */
static size_t pick(const struct kc_redis_addr *addrs, size_t n, const char *key)
{
	const char *names[KC_REMOTE_MAX_SHARDS];

	for (size_t i = 0; i < n; i++)
		names[i] = addrs[i].canon;
	return kc_remote_shards_pick(names, n, key);
}

static void test_pick(void)
{
	struct kc_redis_addr *a2, *a3, *r2;
	char why[300], key[65];
	int n2, n3, on[3] = {0}, moved = 0, moved_wrong = 0, order = 1;
	const int N = 3000;

	n2 = kc_redis_parse("redis://10.0.0.1|redis://10.0.0.2", &a2, why, sizeof(why));
	n3 = kc_redis_parse("redis://10.0.0.1|redis://10.0.0.2|redis://10.0.0.3", &a3, why,
			    sizeof(why));
	kc_redis_parse("redis://10.0.0.2:6379/0|redis://10.0.0.1", &r2, why, sizeof(why));
	if (n2 != 2 || n3 != 3) {
		CHECK(0, "parse shard lists");
		return;
	}
	for (int i = 0; i < N; i++) {
		size_t p2, p3;

		key_of("pick", i, key);
		p2 = pick(a2, 2, key);
		p3 = pick(a3, 3, key);
		on[p2]++;
		if (p3 != p2) {
			moved++;
			if (p3 != 2)
				moved_wrong++;
		}
		if (strcmp(r2[pick(r2, 2, key)].canon, a2[p2].canon))
			order = 0;
	}
	printf("# 2 shards: %d / %d; a third shard moves %d of %d keys\n", on[0], on[1], moved, N);
	CHECK(on[0] > N * 4 / 10 && on[1] > N * 4 / 10, "two shards share the keys evenly (40..60%)");
	CHECK(moved > N * 28 / 100 && moved < N * 39 / 100, "adding a third shard moves about a third");
	CHECK(moved_wrong == 0, "and moves keys only onto the new shard");
	CHECK(order, "the pick depends on the shards, not on their order or spelling");
	free(a2);
	free(a3);
	free(r2);
}

/* The pick is part of the cluster's layout on the store: nodes of different versions share
 * the shards, so a key must stay on the shard it is on across upgrades. These vectors were
 * computed by kcachefs before sharding moved into the store layer (kc_redis_pick of
 * remote_redis.c); a change that moves any key fails here. The keys are SHA-256 of
 * "vector I"; picked3: the index among all three shards, picked2: among the first two. */
static void test_pick_vectors(void)
{
	static const char *const lists[2] = {
		"redis://10.0.0.1|redis://10.0.0.2|redis://10.0.0.3",
		"redis+unix:///run/redis/a.sock|redis://[::1]:7000/15|"
		"redis://Cache-1.example.org:6380/2",
	};
	/* [list][vector i] = {picked3, picked2} */
	static const unsigned char vec[2][12][2] = {
		{{1, 1}, {0, 0}, {1, 1}, {2, 0}, {1, 1}, {1, 1},
		 {1, 1}, {0, 0}, {2, 1}, {0, 0}, {2, 1}, {0, 0}},
		{{0, 0}, {2, 0}, {2, 1}, {2, 1}, {0, 0}, {1, 1},
		 {2, 0}, {0, 0}, {2, 1}, {0, 0}, {1, 1}, {0, 0}},
	};
	int ok = 1;

	for (int l = 0; l < 2; l++) {
		struct kc_redis_addr *a;
		char why[300], key[65], text[32];

		if (kc_redis_parse(lists[l], &a, why, sizeof(why)) != 3) {
			CHECK(0, "parse the vectors' shard list");
			return;
		}
		for (int i = 0; i < 12; i++) {
			snprintf(text, sizeof(text), "vector %d", i);
			kc_sha256_buf(text, strlen(text), key);
			if (pick(a, 3, key) != vec[l][i][0] || pick(a, 2, key) != vec[l][i][1]) {
				printf("# list %d, vector %d: picked %zu of 3, %zu of 2\n", l, i,
				       pick(a, 3, key), pick(a, 2, key));
				ok = 0;
			}
		}
		free(a);
	}
	CHECK(ok, "12 keys over two lists of 3 (and of 2) shards: picked as kcachefs always did");
}

static int write_file(const char *path, const char *text, mode_t mode)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);

	if (fd < 0)
		return -1;
	if (write(fd, text, strlen(text)) != (ssize_t)strlen(text)) {
		close(fd);
		return -1;
	}
	close(fd);
	return chmod(path, mode);
}

static void test_auth_file(void)
{
	char path[300], why[300], *u, *p;
	int rc;

	snprintf(path, sizeof(path), "%s/auth", tmpdir);
	write_file(path, "alice s3cret\n", 0600);
	rc = kc_redis_auth_read(path, &u, &p, why, sizeof(why));
	CHECK(rc == 0 && u && p && !strcmp(u, "alice") && !strcmp(p, "s3cret"), "USER PASSWORD");
	free(u);
	free(p);
	write_file(path, "onlypw", 0400);
	rc = kc_redis_auth_read(path, &u, &p, why, sizeof(why));
	CHECK(rc == 0 && !u && p && !strcmp(p, "onlypw"), "PASSWORD alone (mode 0400)");
	free(u);
	free(p);
	write_file(path, "alice s3cret\n", 0640);
	rc = kc_redis_auth_read(path, &u, &p, why, sizeof(why));
	CHECK(rc == -EINVAL && strstr(why, "0640") && !strstr(why, "s3cret"),
	      "a group-readable auth file is refused, saying its mode");
	write_file(path, "alice s3cret\n", 0604);
	CHECK(kc_redis_auth_read(path, &u, &p, why, sizeof(why)) == -EINVAL,
	      "an others-readable auth file is refused");
	write_file(path, "a b c\n", 0600);
	CHECK(kc_redis_auth_read(path, &u, &p, why, sizeof(why)) == -EINVAL, "three words: -EINVAL");
	write_file(path, "alice s3cret\nmore\n", 0600);
	CHECK(kc_redis_auth_read(path, &u, &p, why, sizeof(why)) == -EINVAL, "two lines: -EINVAL");
	write_file(path, "\n", 0600);
	CHECK(kc_redis_auth_read(path, &u, &p, why, sizeof(why)) == -EINVAL, "empty: -EINVAL");
	CHECK(kc_redis_auth_read(tmpdir, &u, &p, why, sizeof(why)) == -EINVAL,
	      "a directory: -EINVAL");
	snprintf(path, sizeof(path), "%s/no-such-auth", tmpdir);
	CHECK(kc_redis_auth_read(path, &u, &p, why, sizeof(why)) == -ENOENT, "missing: -ENOENT");
	if (geteuid() == 0) {
		snprintf(path, sizeof(path), "%s/auth", tmpdir);
		write_file(path, "alice s3cret\n", 0600);
		CHECK(chown(path, 4242, 4242) == 0 &&
		      kc_redis_auth_read(path, &u, &p, why, sizeof(why)) == -EINVAL &&
		      strstr(why, "4242"), "a file owned by another user is refused");
	} else {
		printf("# not root: the foreign-owner check is not exercised\n");
	}
	snprintf(path, sizeof(path), "%s/auth", tmpdir);
	write_file(path, "alice s3cret\n", 0644);
	errno = 0;
	CHECK(!kc_remote_backend_open("redis://h", path, 100, why, sizeof(why)) && errno == EACCES,
	      "open refuses a readable auth file with EACCES (a start-up error, not usage)");
	CHECK(!kc_remote_backend_open("redis://h/x", NULL, 100, why, sizeof(why)) && errno == EINVAL,
	      "open refuses a malformed URL with EINVAL");
	unlink(path);
}

/* ---- against a server ---- */

/* The behaviour every backend owes (remote_contract.c), on a server. */
static void test_contract(struct server *s)
{
	struct kc_remote_backend *b = open_server(s, NULL, 5000);
	CHECK(b != NULL, "open a backend on the server");
	if (b) {
		remote_contract(b, "redis");
		b->ops->destroy(b);
	}
}

/* What is Redis's own in objects: where they are stored, and without expiry. */
static void test_objects(struct server *s)
{
	struct kc_remote_backend *b = open_server(s, NULL, 5000);
	char k1[65], name[128];

	if (!b) {
		CHECK(0, "open a backend on the server");
		return;
	}
	CHECK(strstr(b->ops->describe(b), "redis+unix://") != NULL, "describe names the socket");
	key_of("obj", 1, k1);
	CHECK(b->ops->put(b, k1, "hello\0world", 11) == 0, "put stores");
	snprintf(name, sizeof(name), "kcachefs:obj:%s", k1);
	CHECK(cmd_int(s, "EXISTS %s", name) == 1, "the object is stored as kcachefs:obj:<key>");
	CHECK(cmd_int(s, "PTTL %s", name) == -1, "objects have no expiry (the server's LRU evicts)");
	b->ops->destroy(b);
}

/* What is Redis's own in leases: a key with an expiry that a renewal moves out, gone when
 * released, and a failure note that expires after fail_ms. */
static void test_leases(struct server *s)
{
	struct kc_remote_backend *b = open_server(s, NULL, 5000);
	enum kc_lease_state st = KC_LEASE_NONE;
	char k[65], name[128];
	long long pttl;

	if (!b) {
		CHECK(0, "open a backend on the server");
		return;
	}
	key_of("lease", 1, k);
	snprintf(name, sizeof(name), "kcachefs:lease:%s", k);
	CHECK(b->ops->lease_take(b, k, TOKA, 60000, &st) == 0, "A takes the lease");
	pttl = cmd_int(s, "PTTL %s", name);
	CHECK(pttl > 0 && pttl <= 60000, "the lease key expires (PX ttl)");
	cmd_ok(s, "PEXPIRE %s 30000", name);
	CHECK(b->ops->lease_renew(b, k, TOKA, 90000) == 0 && cmd_int(s, "PTTL %s", name) > 60000,
	      "A renews it: the expiry moves out");
	CHECK(b->ops->lease_release(b, k, TOKA, 0) == 0 && cmd_int(s, "EXISTS %s", name) == 0,
	      "released: gone from the server");
	CHECK(b->ops->lease_take(b, k, TOKA, 60000, &st) == 0 &&
		      b->ops->lease_release(b, k, TOKA, 4000) == 0,
	      "A releases it with a failure note");
	pttl = cmd_int(s, "PTTL %s", name);
	CHECK(pttl > 0 && pttl <= 4000, "the note expires after fail_ms");
	b->ops->destroy(b);
}

/* A SET's reply r (freed here) says it stored the value. */
static void check_set(redisReply *r, const char *what)
{
	CHECK(r && r->type == REDIS_REPLY_STATUS, what);
	if (r)
		freeReplyObject(r);
}

/* What stands on key k (lease key name) is absent: peek sees none, and A takes it at once
 * (with a TTL) and releases it. */
static void check_taken_over(struct server *s, struct kc_remote_backend *b, const char *k,
			     const char *name)
{
	enum kc_lease_state st = KC_LEASE_HELD;
	CHECK(b->ops->lease_peek(b, k, &st) == 0 && st == KC_LEASE_NONE, "peek sees none");
	CHECK(b->ops->lease_take(b, k, TOKA, 60000, &st) == 0, "taken over at once");
	long long pttl = cmd_int(s, "PTTL %s", name);
	CHECK(pttl > 0 && pttl <= 60000, "the new lease has a TTL");
	CHECK(b->ops->lease_release(b, k, TOKA, 0) == 0, "and is released");
}

/* A backend on s that signs with key, leases bounded at 60 s and notes at 5 s; NULL (a
 * failed check) if it cannot be opened. */
static struct kc_remote_backend *records_backend(struct server *s, struct kc_object_secret *key)
{
	struct kc_remote_backend *b = open_server(s, NULL, 5000);
	CHECK(b != NULL, "open a backend on the server");
	if (b) {
		b->secret = key;
		b->held_max_ms = 60000;
		b->note_max_ms = 5000;
	}
	return b;
}

/* Lease records that do not check (unsigned or signed with another key with a key set,
 * over their bound, a key without a TTL) are taken over at once; a holder whose liveness
 * key is gone (it stopped renewing) is taken over within KC_REMOTE_ALIVE_MS. */
static void test_lease_records(struct server *s)
{
	static const unsigned char sec[] = "0123456789abcdef0123", other_sec[] =
		"fedcba9876543210fedc";
	struct kc_object_secret key = {sec, 20}, other = {other_sec, 20};
	struct kc_remote_backend *b = records_backend(s, &key);
	enum kc_lease_state st = KC_LEASE_NONE;
	char k[65], name[128], rec[KC_LEASE_RECORD_MAX];
	struct {
		const struct kc_object_secret *by;
		enum kc_lease_state state;
		unsigned ttl, px; /* px 0: no TTL on the key */
		const char *what;
	} planted[] = {
		{NULL, KC_LEASE_HELD, 60000, 60000, "an unsigned lease"},
		{NULL, KC_LEASE_FAILED, 4000, 4000, "an unsigned failure note"},
		{&other, KC_LEASE_FAILED, 4000, 4000, "a note signed with another key"},
		{&key, KC_LEASE_FAILED, 5001, 5001, "a signed note over the bound"},
		{&key, KC_LEASE_FAILED, 4000, 0, "a signed note without a TTL"},
		{&key, KC_LEASE_FAILED, 4000, 9000, "a signed note whose TTL is over the bound"},
		{&key, KC_LEASE_HELD, 60000, 60000, "a signed lease whose holder is not alive"},
	};

	if (!b)
		return;
	key_of("records", 1, k);
	snprintf(name, sizeof(name), "kcachefs:lease:%s", k);
	for (size_t i = 0; i < sizeof(planted) / sizeof(*planted); i++) {
		redisReply *r;
		printf("# planted: %s\n", planted[i].what);
		CHECK(kc_lease_record(planted[i].by, k, planted[i].state, TOKB, planted[i].ttl,
				      rec) > 0, "make the record");
		if (planted[i].px)
			r = cmd(s, "SET %s %s PX %u", name, rec, planted[i].px);
		else
			r = cmd(s, "SET %s %s", name, rec);
		check_set(r, "plant it");
		check_taken_over(s, b, k, name);
	}
	CHECK(b->ops->lease_take(b, k, TOKA, 60000, &st) == 0 &&
		      b->ops->lease_take(b, k, TOKB, 60000, &st) == -EBUSY && st == KC_LEASE_HELD,
	      "a signed lease of this key stands");
	CHECK(b->ops->lease_release(b, k, TOKA, 4000) == 0 &&
		      b->ops->lease_take(b, k, TOKB, 60000, &st) == -EBUSY && st == KC_LEASE_FAILED,
	      "and so does its signed failure note");
	CHECK(cmd_int(s, "PTTL %s", name) > 0, "which expires");
	CHECK(cmd_int(s, "DEL %s", name) == 1, "drop it");

	/* liveness */
	int64_t t0 = now_ms();
	CHECK(b->ops->lease_take(b, k, TOKA, 60000, &st) == 0, "take a 60 s lease");
	for (int i = 0; i < 8; i++) {
		usleep(500000);
		CHECK(b->ops->lease_renew(b, k, TOKA, 60000) == 0 &&
			      b->ops->lease_take(b, k, TOKB, 60000, &st) == -EBUSY,
		      "renewed every 500 ms: it stands");
	}
	while (b->ops->lease_take(b, k, TOKB, 60000, &st) == -EBUSY && now_ms() < t0 + 30000)
		usleep(50000);
	double gone = (double)(now_ms() - t0 - 4000) / 1000;
	printf("# a holder that stopped renewing: taken over %.2f s later\n", gone);
	CHECK(gone >= KC_REMOTE_ALIVE_MS / 1000.0 - 0.6 && gone < 20,
	      "taken over once not heard from for KC_REMOTE_ALIVE_MS, not its 60 s ttl");
	CHECK(b->ops->lease_renew(b, k, TOKA, 60000) == -ENOLCK, "the dead one's renew: -ENOLCK");
	CHECK(b->ops->lease_release(b, k, TOKB, 0) == 0, "released");
	b->ops->destroy(b);
}

/* A liveness key proves nothing by itself: anyone who can write the store can plant one
 * (it is unsigned). A record with a NUL, a megabyte value without a newline, or a replayed
 * signed lease whose liveness key was planted without a TTL (or with one longer than
 * KC_REMOTE_ALIVE_MS) is absent: peek sees none and a take replaces it at once. */
static void test_planted_alive(struct server *s)
{
	static const unsigned char sec[] = "0123456789abcdef0123";
	struct kc_object_secret key = {sec, 20};
	struct kc_remote_backend *b = records_backend(s, &key);
	char k[65], name[128], alive[128], rec[KC_LEASE_RECORD_MAX];
	static char big[1 << 20];
	struct {
		const char *what;
		const char *val; /* NULL: a signed lease of TOKB */
		size_t len;
		const char *alive_px; /* "": no TTL on the liveness key */
	} planted[] = {
		{"an unsigned lease with a NUL", "held bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb\0 60000 -",
		 44, "3000"},
		{"a megabyte lease without a newline", big, sizeof(big), "3000"},
		{"a signed lease whose liveness key has no TTL", NULL, 0, ""},
		{"a signed lease whose liveness key lives an hour", NULL, 0, "3600000"},
	};

	if (!b)
		return;
	memset(big, 'x', sizeof(big));
	memcpy(big, "held " "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", 37);
	key_of("alive", 1, k);
	snprintf(name, sizeof(name), "kcachefs:lease:%s", k);
	snprintf(alive, sizeof(alive), "kcachefs:alive:%s", k);
	for (size_t i = 0; i < sizeof(planted) / sizeof(*planted); i++) {
		const char *v = planted[i].val;
		size_t len = planted[i].len;
		redisReply *r;
		printf("# planted: %s\n", planted[i].what);
		if (!v) {
			CHECK(kc_lease_record(&key, k, KC_LEASE_HELD, TOKB, 60000, rec) > 0,
			      "make the record");
			v = rec;
			len = strlen(rec);
		}
		check_set(cmd(s, "SET %s %b PX 60000", name, v, len), "plant the lease");
		if (*planted[i].alive_px)
			r = cmd(s, "SET %s %s PX %s", alive, TOKB, planted[i].alive_px);
		else
			r = cmd(s, "SET %s %s", alive, TOKB);
		check_set(r, "plant its liveness key");
		check_taken_over(s, b, k, name);
	}
	b->ops->destroy(b);
}

/* On a backend of two shards (s1, s2 listed in url2, in that order): a watch listens on
 * its key's shard, whichever it is; the record settings given to the sharded backend reach
 * the shard that holds the lease. */
static void test_shard_watches_and_records(struct kc_remote_backend *b2, const char *url2,
					   struct server *s1, struct server *s2)
{
	static const unsigned char sec[] = "0123456789abcdef0123", other_sec[] =
		"fedcba9876543210fedc";
	struct kc_object_secret key = {sec, 20}, other = {other_sec, 20};
	struct server *on[2] = {s1, s2};
	struct kc_redis_addr *a;
	char why[300], k[2][65];
	int seen[2] = {0, 0}, woke = 0;

	if (kc_redis_parse(url2, &a, why, sizeof(why)) != 2) {
		CHECK(0, "parse the two shards' URL");
		return;
	}
	/* a key on each shard */
	for (int i = 0; i < 200 && !(seen[0] && seen[1]); i++) {
		char kk[65];
		size_t p;

		key_of("shard-watch", i, kk);
		p = pick(a, 2, kk);
		if (!seen[p]) {
			memcpy(k[p], kk, 65);
			seen[p] = 1;
		}
	}
	free(a);
	if (!seen[0] || !seen[1]) {
		CHECK(0, "a key on each shard");
		return;
	}
	for (int p = 0; p < 2; p++) {
		struct kc_remote_watch *w = NULL;

		if (b2->ops->watch_start(b2, k[p], &w) == 0 && b2->ops->notify(b2, k[p]) == 0 &&
		    b2->ops->watch_wait(b2, w, SLOW_BOUND_MS) == 0)
			woke++;
		if (w)
			b2->ops->watch_end(b2, w);
	}
	CHECK(woke == 2, "a watch on each shard wakes at its key's notice");

	b2->secret = &key;
	b2->held_max_ms = 60000;
	b2->note_max_ms = 5000;
	for (int p = 0; p < 2; p++) {
		enum kc_lease_state st = KC_LEASE_NONE, st_key = KC_LEASE_NONE,
				    st_other = KC_LEASE_HELD;
		struct kc_remote_backend *one = records_backend(on[p], &key);
		struct kc_remote_backend *wrong = records_backend(on[p], &other);
		char name[128];

		if (!one || !wrong) {
			if (one)
				one->ops->destroy(one);
			if (wrong)
				wrong->ops->destroy(wrong);
			continue;
		}
		CHECK(b2->ops->lease_take(b2, k[p], TOKA, 60000, &st) == 0 &&
		      one->ops->lease_peek(one, k[p], &st_key) == 0 &&
		      wrong->ops->lease_peek(wrong, k[p], &st_other) == 0 &&
		      st_key == KC_LEASE_HELD && st_other == KC_LEASE_NONE,
		      "the sharded backend's secret signs the lease on its key's shard");
		snprintf(name, sizeof(name), "kcachefs:lease:%s", k[p]);
		CHECK(cmd_int(on[p], "EXISTS %s", name) == 1 && cmd_int(on[!p], "EXISTS %s", name) == 0,
		      "on that shard only");
		CHECK(b2->ops->lease_release(b2, k[p], TOKA, 0) == 0, "released");
		one->ops->destroy(one);
		wrong->ops->destroy(wrong);
	}
	b2->secret = NULL;
	b2->held_max_ms = b2->note_max_ms = KC_REMOTE_RECORD_MAX_MS;
}

static void test_shards(void)
{
	static struct server s1 = {.name = "shard1"}, s2 = {.name = "shard2"}, s3 = {.name = "shard3"};
	struct kc_remote_backend *b2 = NULL, *b3 = NULL;
	char url2[700], url3[1000], key[65], name[128], *data;
	int on1 = 0, on2 = 0, both = 0, none = 0, found = 0, moved = 0, wrong = 0, err = 0;
	const int N = 300;
	size_t len;

	if (start(&s1, NULL) || start(&s2, NULL) || start(&s3, NULL)) {
		CHECK(0, "start three redis-servers");
		goto out;
	}
	snprintf(url2, sizeof(url2), "redis+unix://%s|redis+unix://%s", s1.sock, s2.sock);
	snprintf(url3, sizeof(url3), "%s|redis+unix://%s", url2, s3.sock);
	b2 = open_url(url2, NULL, 5000);
	b3 = open_url(url3, NULL, 5000);
	if (!b2 || !b3) {
		CHECK(0, "open sharded backends");
		goto out;
	}
	CHECK(strstr(b2->ops->describe(b2), "(2 shards)") != NULL, "describe counts the shards");
	for (int i = 0; i < N; i++) {
		key_of("shard", i, key);
		if (b2->ops->put(b2, key, key, 64))
			err++;
	}
	CHECK(err == 0, "300 puts over two shards");
	for (int i = 0; i < N; i++) {
		int e1, e2;

		key_of("shard", i, key);
		snprintf(name, sizeof(name), "kcachefs:obj:%s", key);
		e1 = cmd_int(&s1, "EXISTS %s", name) == 1;
		e2 = cmd_int(&s2, "EXISTS %s", name) == 1;
		on1 += e1 && !e2;
		on2 += e2 && !e1;
		both += e1 && e2;
		none += !e1 && !e2;
	}
	printf("# shard 1: %d, shard 2: %d, both: %d, none: %d\n", on1, on2, both, none);
	CHECK(both == 0 && none == 0, "each key is on exactly one shard");
	CHECK(on1 > N * 35 / 100 && on2 > N * 35 / 100, "both shards hold a fair part");
	for (int i = 0; i < N; i++) {
		int rc;

		key_of("shard", i, key);
		data = NULL;
		rc = b3->ops->get(b3, key, &data, &len);
		if (rc == 0 && len == 64 && !memcmp(data, key, 64))
			found++;
		else if (rc == -ENOENT)
			moved++;
		else
			wrong++;
		free(data);
	}
	printf("# with a third shard: %d still found, %d moved\n", found, moved);
	CHECK(wrong == 0, "with a third shard every get is a hit or a clean miss");
	CHECK(moved > N * 2 / 10 && moved < N * 45 / 100, "a third shard moves about a third");
	test_shard_watches_and_records(b2, url2, &s1, &s2);
	/* One shard stopped: its keys are faults, the other shard's keys still answer. */
	stop(&s2, SIGKILL);
	found = 0;
	err = 0;
	for (int i = 0; i < N; i++) {
		int rc;

		key_of("shard", i, key);
		data = NULL;
		rc = b2->ops->get(b2, key, &data, &len);
		found += rc == 0;
		err += rc == -ECONNREFUSED;
		free(data);
	}
	printf("# shard 2 down: %d found, %d refused\n", found, err);
	CHECK(found == on1 && err == on2, "shard 2 down: shard 1's keys hit, shard 2's are refused");
out:
	if (b2)
		b2->ops->destroy(b2);
	if (b3)
		b3->ops->destroy(b3);
	stop(&s1, SIGKILL);
	stop(&s2, SIGKILL);
	stop(&s3, SIGKILL);
}

/* Read a file into a malloc'd string. */
static char *slurp(const char *path)
{
	FILE *f = fopen(path, "r");
	char *buf = calloc(1, 1 << 20);
	size_t n;

	if (!f || !buf) {
		if (f)
			fclose(f);
		return buf;
	}
	n = fread(buf, 1, (1 << 20) - 1, f);
	buf[n] = 0;
	fclose(f);
	return buf;
}

static void test_auth(void)
{
	static const char *const extra[] = {"--requirepass", "adminpw0", NULL};
	static struct server s = {.name = "auth", .admin_pass = "adminpw0"};
	static const struct {
		const char *file; /* NULL: no remote_auth= */
		int put_rc, get_rc;
		const char *what;
	} cases[] = {
		{"alice alicepw1\n", 0, 0, "ACL user alice: put and get"},
		{"adminpw0\n", -EEXIST, 0, "a bare password (requirepass): put and get"},
		{"alice wrongpw9\n", -EACCES, -EACCES, "a wrong password: -EACCES"},
		{NULL, -EACCES, -EACCES, "no AUTH on a server that needs it: -EACCES"},
		{"bob bobpw1\n", -EACCES, -EACCES, "a user without rights on kcachefs:* keys: -EACCES"},
	};
	struct kc_remote_backend *b;
	char path[300], logpath[300], k[65], *data = NULL, *log;
	size_t len;
	int saved_err;

	if (start(&s, extra)) {
		CHECK(0, "start redis-server with requirepass");
		return;
	}
	CHECK(cmd_ok(&s, "ACL SETUSER alice on >alicepw1 ~kcachefs:* +@all", NULL) &&
	      cmd_ok(&s, "ACL SETUSER bob on >bobpw1 ~other:* +@all", NULL), "ACL users created");
	snprintf(path, sizeof(path), "%s/auth", tmpdir);
	snprintf(logpath, sizeof(logpath), "%s/auth-test.log", tmpdir);
	key_of("auth", 1, k);

	/* Capture the backend's log lines: the passwords must not be in them. */
	fflush(stderr);
	saved_err = dup(2);
	{
		int lf = open(logpath, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
		dup2(lf, 2);
		close(lf);
	}
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		int put_rc = -999, get_rc = -999;

		if (cases[i].file)
			write_file(path, cases[i].file, 0600);
		b = open_server(&s, cases[i].file ? path : NULL, 5000);
		if (b) {
			put_rc = b->ops->put(b, k, "x", 1);
			get_rc = b->ops->get(b, k, &data, &len);
			free(data);
			data = NULL;
			b->ops->destroy(b);
		}
		printf("# %s: put %d, get %d\n", cases[i].what, put_rc, get_rc);
		CHECK(put_rc == cases[i].put_rc && get_rc == cases[i].get_rc, cases[i].what);
	}
	/* notices need the channel too (&kcachefs:stored:*): without it, waiters poll and the
	 * holder's refused PUBLISH is no fault (not logged, the shard not marked down) */
	CHECK(cmd_ok(&s, "ACL SETUSER carol on >carolpw1 ~kcachefs:* &kcachefs:stored:* +@all",
		     NULL), "an ACL user with the channel");
	for (int i = 0; i < 2; i++) {
		struct kc_remote_watch *w = NULL;
		int wrc = -999, nrc = -999;

		write_file(path, i ? "carol carolpw1\n" : "alice alicepw1\n", 0600);
		b = open_server(&s, path, 5000);
		if (b) {
			wrc = b->ops->watch_start(b, k, &w);
			nrc = b->ops->notify(b, k);
			if (!wrc && !nrc)
				wrc = b->ops->watch_wait(b, w, SLOW_BOUND_MS);
			if (w)
				b->ops->watch_end(b, w);
			b->ops->destroy(b);
		}
		printf("# %s: watch %d, notify %d\n", i ? "carol" : "alice", wrc, nrc);
		CHECK(i ? wrc == 0 && nrc == 0 : wrc == -EACCES && nrc == -EACCES,
		      i ? "with the channel: notices work" : "without it: -EACCES, no notices");
	}
	/* exactly the grants doc/cluster.md lists (DOC_GRANTS): every command the backend and
	 * its scripts run, the lease scripts' PTTL among them, on a held lease too */
	CHECK(cmd_ok(&s, "ACL SETUSER dave on >davepw1 " DOC_GRANTS, NULL),
	      "an ACL user with the documented grants");
	write_file(path, "dave davepw1\n", 0600);
	b = open_server(&s, path, 5000);
	if (b) {
		enum kc_lease_state st = KC_LEASE_NONE;
		struct kc_remote_watch *w = NULL;
		char *d = NULL;
		size_t dl = 0;
		const char *dk = "d1d2d3d4d5d6d7d8d1d2d3d4d5d6d7d8d1d2d3d4d5d6d7d8d1d2d3d4d5d6d7d8";
		int put_rc = b->ops->put(b, dk, "x", 1), get_rc = b->ops->get(b, dk, &d, &dl);
		int take_a = b->ops->lease_take(b, dk, TOKA, 60000, &st);
		int take_b = b->ops->lease_take(b, dk, TOKB, 60000, &st);
		int peek = b->ops->lease_peek(b, dk, &st);
		int renew = b->ops->lease_renew(b, dk, TOKA, 60000);
		int wrc = b->ops->watch_start(b, dk, &w), nrc = b->ops->notify(b, dk);
		if (w)
			b->ops->watch_end(b, w);
		int rel = b->ops->lease_release(b, dk, TOKA, 0);
		printf("# documented grants: put %d get %d take %d/%d peek %d renew %d watch %d "
		       "notify %d release %d\n", put_rc, get_rc, take_a, take_b, peek, renew, wrc, nrc,
		       rel);
		CHECK(put_rc == 0 && get_rc == 0 && take_a == 0 && take_b == -EBUSY && peek == 0 &&
			      renew == 0 && wrc == 0 && nrc == 0 && rel == 0,
		      "the documented grants are all the backend needs");
		free(d);
		b->ops->destroy(b);
	} else {
		CHECK(0, "the documented grants are all the backend needs (no connection)");
	}
	fflush(stderr);
	dup2(saved_err, 2);
	close(saved_err);
	log = slurp(logpath);
	CHECK(log && strstr(log, "EACCES") == NULL && strstr(log, "WRONGPASS") != NULL,
	      "the log says why (WRONGPASS)");
	CHECK(log && !strstr(log, "notify failed") && !strstr(log, "subscribe failed"),
	      "a refused notice is not logged as a fault");
	CHECK(log && !strstr(log, "alicepw1") && !strstr(log, "wrongpw9") && !strstr(log, "bobpw1") &&
	      !strstr(log, "adminpw0") && !strstr(log, "carolpw1"), "no password reaches the log");
	if (log && strstr(log, "pw"))
		printf("# log: %s\n", log);
	free(log);
	unlink(path);
	stop(&s, SIGKILL);
}

static void test_tcp_and_db(void)
{
	static struct server s = {.name = "tcp"};
	struct kc_remote_backend *b = NULL;
	char url[300], k[65], name[128], *data = NULL;
	size_t len;
	int lfd, ok = 0;

	/* A free loopback port: bind 0, read it back, close; retried if redis loses a race. */
	for (int attempt = 0; attempt < 5 && !ok; attempt++) {
		struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
		socklen_t sl = sizeof(sa);

		lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		bind(lfd, (struct sockaddr *)&sa, sizeof(sa));
		getsockname(lfd, (struct sockaddr *)&sa, &sl);
		close(lfd);
		s.port = ntohs(sa.sin_port);
		ok = start(&s, NULL) == 0;
	}
	if (!ok) {
		CHECK(0, "start redis-server on a loopback port");
		return;
	}
	snprintf(url, sizeof(url), "redis://127.0.0.1:%d/3", s.port);
	b = open_url(url, NULL, 5000);
	key_of("tcp", 1, k);
	snprintf(name, sizeof(name), "kcachefs:obj:%s", k);
	CHECK(b && b->ops->put(b, k, "tcp", 3) == 0 && b->ops->get(b, k, &data, &len) == 0 &&
	      len == 3, "redis://127.0.0.1:PORT/3: put and get");
	free(data);
	CHECK(cmd_int(&s, "EXISTS %s", name) == 0, "the object is not in db 0");
	{
		redisContext *c = admin(&s);
		redisReply *r1 = c ? redisCommand(c, "SELECT 3") : NULL;
		redisReply *r2 = c ? redisCommand(c, "EXISTS %s", name) : NULL;

		CHECK(r2 && r2->type == REDIS_REPLY_INTEGER && r2->integer == 1, "but in db 3");
		if (r1)
			freeReplyObject(r1);
		if (r2)
			freeReplyObject(r2);
		if (c)
			redisFree(c);
	}
	if (b)
		b->ops->destroy(b);
	snprintf(url, sizeof(url), "redis+unix://%s?db=99999", s.sock);
	b = open_url(url, NULL, 5000);
	CHECK(b && b->ops->get(b, k, &data, &len) == -EIO, "a db the server does not have: -EIO");
	if (b)
		b->ops->destroy(b);
	stop(&s, SIGKILL);
}

static void test_faults(void)
{
	static struct server s = {.name = "faults"};
	struct kc_remote_backend *b = NULL;
	enum kc_lease_state st;
	char k1[65], k2[65], *data = NULL;
	const unsigned TMO = 1000; /* ops must fit in it on a busy machine */
	int64_t t0, el;
	size_t len;
	int rc;

	if (start(&s, NULL)) {
		CHECK(0, "start redis-server");
		return;
	}
	b = open_server(&s, NULL, TMO);
	if (!b)
		goto out;
	key_of("fault", 1, k1);
	key_of("fault", 2, k2);
	CHECK(b->ops->put(b, k1, "one", 3) == 0 && b->ops->put(b, k2, "two", 3) == 0, "two objects");

	/* Paused longer than the timeout: -ETIMEDOUT, then the next call is in step. */
	CHECK(cmd_ok(&s, "CLIENT PAUSE 5000 ALL", NULL), "CLIENT PAUSE 5000");
	t0 = now_ms();
	rc = b->ops->get(b, k1, &data, &len);
	el = now_ms() - t0;
	printf("# paused: get -> %d after %lld ms (timeout %u)\n", rc, (long long)el, TMO);
	CHECK(rc == -ETIMEDOUT && el < SLOW_BOUND_MS, "a paused server: -ETIMEDOUT, bounded");
	CHECK(cmd_ok(&s, "CLIENT UNPAUSE", NULL), "CLIENT UNPAUSE");
	data = NULL;
	rc = b->ops->get(b, k2, &data, &len);
	CHECK(rc == 0 && len == 3 && !memcmp(data, "two", 3),
	      "after the pause a get answers its own key (the late reply was dropped)");
	free(data);
	data = NULL;

	/* DEBUG SLEEP: the whole server stalls. */
	{
		redisContext *c = admin(&s);
		int sent = c && redisAppendCommand(c, "DEBUG SLEEP 5") == REDIS_OK;
		int done = 0;

		int asleep = 0;
		int64_t until = now_ms() + SLOW_BOUND_MS;

		while (sent && !done && redisBufferWrite(c, &done) == REDIS_OK)
			;
		/* Asleep once a PING of a connection of its own goes unanswered. */
		while (done && !asleep && now_ms() < until) {
			struct timeval ptv = {0, 100000};
			redisContext *p = redisConnectUnixWithTimeout(s.sock, ptv);
			redisReply *r;

			if (p && !p->err) {
				redisSetTimeout(p, ptv);
				r = redisCommand(p, "PING");
				asleep = !r;
				if (r)
					freeReplyObject(r);
			}
			if (p)
				redisFree(p);
		}
		t0 = now_ms();
		rc = b->ops->lease_take(b, k1, TOKA, 10000, &st);
		el = now_ms() - t0;
		printf("# DEBUG SLEEP: lease_take -> %d after %lld ms\n", rc, (long long)el);
		CHECK(sent && done && asleep && rc == -ETIMEDOUT && el < SLOW_BOUND_MS,
		      "a server in DEBUG SLEEP: -ETIMEDOUT, bounded");
		if (c) {
			void *r = NULL;
			redisGetReply(c, &r); /* waits out the sleep */
			if (r)
				freeReplyObject(r);
			redisFree(c);
		}
	}

	/* FLUSHALL: objects are gone, a clean miss. */
	CHECK(cmd_ok(&s, "FLUSHALL", NULL), "FLUSHALL");
	CHECK(b->ops->get(b, k1, &data, &len) == -ENOENT, "after FLUSHALL: get -ENOENT");

	/* A tiny maxmemory with noeviction: writes are refused, reads still answer. */
	CHECK(b->ops->put(b, k1, "one", 3) == 0, "put again");
	CHECK(cmd_ok(&s, "CONFIG SET maxmemory-policy noeviction", NULL) &&
	      cmd_ok(&s, "CONFIG SET maxmemory 1", NULL), "maxmemory 1, noeviction");
	CHECK(b->ops->put(b, k2, "two", 3) == -ENOSPC, "a full server: put -ENOSPC");
	rc = b->ops->lease_take(b, k2, TOKA, 10000, &st);
	printf("# full: lease_take -> %d\n", rc);
	CHECK(rc == -ENOSPC, "a full server: lease_take -ENOSPC");
	data = NULL;
	CHECK(b->ops->get(b, k1, &data, &len) == 0 && len == 3, "a full server still serves gets");
	free(data);
	data = NULL;
	CHECK(cmd_ok(&s, "CONFIG SET maxmemory 0", NULL), "maxmemory unlimited again");

	/* Killed: -ECONNREFUSED at once; restarted empty: a clean miss, then it works. */
	stop(&s, SIGKILL);
	t0 = now_ms();
	rc = b->ops->get(b, k1, &data, &len);
	el = now_ms() - t0;
	printf("# killed: get -> %d after %lld ms\n", rc, (long long)el);
	CHECK(rc == -ECONNREFUSED && el < SLOW_BOUND_MS, "a killed server: -ECONNREFUSED");
	CHECK(b->ops->put(b, k1, "x", 1) == -ECONNREFUSED &&
	      b->ops->lease_peek(b, k1, &st) == -ECONNREFUSED, "for every operation");
	if (start(&s, NULL)) {
		CHECK(0, "restart redis-server");
		goto out;
	}
	CHECK(b->ops->get(b, k1, &data, &len) == -ENOENT, "restarted empty: get -ENOENT");
	CHECK(b->ops->put(b, k1, "one", 3) == 0 && b->ops->get(b, k1, &data, &len) == 0 && len == 3,
	      "and the backend works again");
	free(data);
	data = NULL;
	/* A server that restarts under a pooled connection: the stale connection is noticed
	 * before use, so the next call is not a fault. */
	stop(&s, SIGTERM);
	if (start(&s, NULL)) {
		CHECK(0, "restart redis-server");
		goto out;
	}
	CHECK(b->ops->get(b, k1, &data, &len) == -ENOENT, "a pooled connection to a restarted "
	      "server is replaced, not a fault");
out:
	free(data);
	if (b)
		b->ops->destroy(b);
	stop(&s, SIGKILL);
	{
		char url[300];

		snprintf(url, sizeof(url), "redis+unix://%s/none.sock", tmpdir);
		b = open_url(url, NULL, TMO);
		CHECK(b && b->ops->get(b, k1, &data, &len) == -ECONNREFUSED,
		      "a socket path with no server: -ECONNREFUSED");
		if (b)
			b->ops->destroy(b);
		b = open_url("redis://127.0.0.1:1", NULL, TMO);
		CHECK(b && b->ops->get(b, k1, &data, &len) == -ECONNREFUSED,
		      "a TCP port with no listener: -ECONNREFUSED");
		if (b)
			b->ops->destroy(b);
	}
}

/* ---- a server that answers garbage ---- */

enum junk_mode { JUNK_HTTP, JUNK_SILENT, JUNK_TRICKLE, JUNK_ARRAY, JUNK_WRONGTYPE, JUNK_EXTRA,
		 JUNK_HANGUP, JUNK_HUGE_BULK, JUNK_COUNT };

struct junk {
	int lfd, port;
	enum junk_mode mode;
	int stop_fd[2];
	pthread_t th;
};

static void *junk_main(void *p)
{
	struct junk *j = p;

	for (;;) {
		struct pollfd pf[2] = {{.fd = j->lfd, .events = POLLIN}, {.fd = j->stop_fd[0], .events = POLLIN}};
		char buf[4096];
		int c;

		if (poll(pf, 2, -1) < 0 || pf[1].revents)
			break;
		c = accept4(j->lfd, NULL, NULL, SOCK_CLOEXEC);
		if (c < 0)
			continue;
		/* Take the request in first, so that closing does not reset the connection. */
		{
			struct pollfd q = {.fd = c, .events = POLLIN};
			if (poll(&q, 1, 2000) > 0)
				(void)!recv(c, buf, sizeof(buf), MSG_DONTWAIT);
		}
		switch (j->mode) {
		case JUNK_HTTP:
			(void)!send(c, "HTTP/1.1 400 Bad Request\r\n\r\n", 28, MSG_NOSIGNAL);
			break;
		case JUNK_SILENT:
			break;
		case JUNK_TRICKLE: /* a bulk header, then one byte now and then: never done */
			(void)!send(c, "$100000\r\n", 9, MSG_NOSIGNAL);
			for (int i = 0; i < 40; i++) {
				struct pollfd q = {.fd = j->stop_fd[0], .events = POLLIN};
				if (poll(&q, 1, 100) != 0 || send(c, "x", 1, MSG_NOSIGNAL) != 1)
					break;
			}
			break;
		case JUNK_ARRAY:
			(void)!send(c, "*2000000000\r\n:1\r\n", 17, MSG_NOSIGNAL);
			break;
		case JUNK_WRONGTYPE:
			(void)!send(c, ":42\r\n", 5, MSG_NOSIGNAL);
			break;
		case JUNK_EXTRA:
			(void)!send(c, "$1\r\nx\r\n+OK\r\n", 12, MSG_NOSIGNAL);
			break;
		case JUNK_HANGUP:
			break;
		case JUNK_HUGE_BULK:
			(void)!send(c, "$9999999999999\r\n", 16, MSG_NOSIGNAL);
			break;
		default:
			break;
		}
		if (j->mode == JUNK_SILENT || j->mode == JUNK_HUGE_BULK) { /* held open */
			struct pollfd q[2] = {{.fd = c, .events = POLLIN}, {.fd = j->stop_fd[0], .events = POLLIN}};
			poll(q, 2, 5000);
		}
		close(c);
	}
	return NULL;
}

static void test_garbage(void)
{
	static const char *const names[JUNK_COUNT] = {
		"an HTTP answer", "silence", "a trickled bulk", "an absurd array", "an integer to GET",
		"two replies to one GET", "a hang-up", "a bulk of 10 TB"};
	struct junk j = {0};
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t sl = sizeof(sa);
	char url[100], k[65], msg[160], *data = NULL;
	size_t len;

	j.lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (j.lfd < 0 || bind(j.lfd, (struct sockaddr *)&sa, sizeof(sa)) || listen(j.lfd, 16) ||
	    getsockname(j.lfd, (struct sockaddr *)&sa, &sl) || pipe2(j.stop_fd, O_CLOEXEC)) {
		CHECK(0, "a loopback listener for the garbage server");
		return;
	}
	j.port = ntohs(sa.sin_port);
	pthread_create(&j.th, NULL, junk_main, &j);
	snprintf(url, sizeof(url), "redis://127.0.0.1:%d", j.port);
	key_of("junk", 1, k);
	for (int m = 0; m < JUNK_COUNT; m++) {
		struct kc_remote_backend *b = open_url(url, NULL, 1500);
		int64_t t0 = now_ms(), el;
		int rc;

		j.mode = (enum junk_mode)m;
		rc = b ? b->ops->get(b, k, &data, &len) : -999;
		el = now_ms() - t0;
		printf("# garbage (%s): get -> %d (%s) after %lld ms\n", names[m], rc,
		       rc < 0 ? strerror(-rc) : "ok", (long long)el);
		snprintf(msg, sizeof(msg), "a server answering %s: get fails cleanly, bounded", names[m]);
		/* Garbage that can be recognised is -EPROTO at once; silence is a timeout. */
		CHECK(rc == (m == JUNK_SILENT || m == JUNK_TRICKLE ? -ETIMEDOUT :
			     m == JUNK_HANGUP ? -ENOTCONN : -EPROTO) && !data && el < SLOW_BOUND_MS, msg);
		if (b)
			b->ops->destroy(b);
	}
	(void)!write(j.stop_fd[1], "x", 1);
	pthread_join(j.th, NULL);
	close(j.lfd);
	close(j.stop_fd[0]);
	close(j.stop_fd[1]);
}

/* ---- notices: a waiter's SUBSCRIBE, a holder's PUBLISH ---- */

struct notifier {
	struct kc_remote_backend *b;
	const char *key;
	int after_ms;
	int64_t sent_ms;
};

static void *notify_main(void *p)
{
	struct notifier *n = p;

	nap_ms(n->after_ms);
	n->sent_ms = now_ms();
	n->b->ops->notify(n->b, n->key);
	return NULL;
}

/* Called last on s: stops it. */
static void test_notices(struct server *s)
{
	struct kc_remote_backend *b = open_server(s, NULL, 5000);
	struct kc_remote_watch *w1 = NULL, *w2 = NULL, *w3 = NULL, *wx = NULL;
	char k[65], k3[65], name[128], *data = NULL;
	size_t len = 0;
	int64_t t0;
	int rc;

	if (!b) {
		CHECK(0, "open a backend on the server");
		return;
	}
	key_of("notice", 1, k);
	key_of("notice", 3, k3);
	CHECK(b->ops->watch_start(b, "ABC", &wx) == -EINVAL && !wx, "watch of a bad key: -EINVAL");
	CHECK(b->ops->notify(b, "../x") == -EINVAL, "notify of a bad key: -EINVAL");
	CHECK(b->ops->watch_start(b, k, &w1) == 0 && w1, "a waiter watches a key");
	CHECK(b->ops->watch_start(b, k, &w2) == 0 && w2, "a second waiter watches the same key");
	CHECK(b->ops->watch_start(b, k3, &w3) == 0 && w3, "a third watches another key");
	t0 = now_ms();
	rc = b->ops->watch_wait(b, w1, 150);
	CHECK(rc == -ETIMEDOUT && now_ms() - t0 >= 140 && now_ms() - t0 < SLOW_BOUND_MS,
	      "no notice: -ETIMEDOUT after the wait asked for");
	CHECK(b->ops->put(b, k, "x", 1) == 0 && b->ops->get(b, k, &data, &len) == 0,
	      "the watches leave the pooled connections be");
	free(data);
	CHECK(b->ops->notify(b, k) == 0, "notify");
	CHECK(b->ops->watch_wait(b, w1, SLOW_BOUND_MS) == 0 &&
	      b->ops->watch_wait(b, w2, SLOW_BOUND_MS) == 0,
	      "one notice, sent while nobody waited, wakes every waiter of the key");
	CHECK(b->ops->watch_wait(b, w3, 150) == -ETIMEDOUT, "and no waiter of another key");
	CHECK(b->ops->watch_wait(b, w1, 100) == -ETIMEDOUT, "a notice wakes each waiter once");

	struct notifier n = {b, k, 300, 0};
	pthread_t th;
	pthread_create(&th, NULL, notify_main, &n);
	rc = b->ops->watch_wait(b, w1, SLOW_BOUND_MS);
	int64_t woke = now_ms();
	pthread_join(th, NULL);
	printf("# a blocked waiter woke %lld ms after the notice\n", (long long)(woke - n.sent_ms));
	CHECK(rc == 0 && woke - n.sent_ms < 1000, "a blocked waiter wakes at the notice");
	CHECK(b->ops->watch_wait(b, w2, SLOW_BOUND_MS) == 0, "so does the other");

	snprintf(name, sizeof(name), "kcachefs:stored:%s", k);
	CHECK(cmd_int(s, "EXISTS %s", name) == 0, "a notice leaves no key in the store");
	redisReply *r = cmd(s, "PUBLISH %s planted", name);
	CHECK(r && r->type == REDIS_REPLY_INTEGER && r->integer == 2, "anyone may publish");
	if (r)
		freeReplyObject(r);
	CHECK(b->ops->watch_wait(b, w1, SLOW_BOUND_MS) == 0,
	      "a planted notice wakes the waiter: only a hint, which it checks by looking");
	CHECK(b->ops->watch_wait(b, w2, SLOW_BOUND_MS) == 0, "(and the other)");

	stop(s, SIGKILL);
	t0 = now_ms();
	rc = b->ops->watch_wait(b, w2, SLOW_BOUND_MS);
	CHECK(rc != 0 && rc != -ETIMEDOUT && now_ms() - t0 < SLOW_BOUND_MS / 2,
	      "a watch whose server died is a fault at once, not a wait");
	CHECK(b->ops->watch_start(b, k, &wx) != 0 && !wx, "no watch on a server that is down");
	CHECK(b->ops->notify(b, k) != 0, "nor a notice");
	b->ops->watch_end(b, w1);
	b->ops->watch_end(b, w2);
	b->ops->watch_end(b, w3);
	b->ops->destroy(b);
}

int main(void)
{
	static struct server main_srv = {.name = "main"};
	const char *base = getenv("TMPDIR");

	signal(SIGPIPE, SIG_DFL); /* the backend must not need SIGPIPE ignored */
	signal(SIGTERM, on_signal);
	signal(SIGINT, on_signal);
	kc_log_init(0, KC_LOG_INFO);
	snprintf(tmpdir, sizeof(tmpdir), "%s/kc-redis-XXXXXX", base && *base ? base : "/tmp");
	if (!mkdtemp(tmpdir)) {
		tmpdir[0] = 0;
		CHECK(0, "a temp dir");
		return tap_done();
	}
	atexit(cleanup);

	test_parse();
	test_pick();
	test_pick_vectors();
	test_auth_file();
	if (start(&main_srv, NULL)) {
		CHECK(0, "start redis-server (Debian's redis-server package)");
		return tap_done();
	}
	test_contract(&main_srv);
	test_objects(&main_srv);
	test_leases(&main_srv);
	test_lease_records(&main_srv);
	test_planted_alive(&main_srv);
	test_notices(&main_srv); /* stops it */
	test_shards();
	test_auth();
	test_tcp_and_db();
	test_faults();
	test_garbage();
	return tap_done();
}
