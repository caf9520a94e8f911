/* test_remote_protocol.c - the cluster protocol (remote_tier.c) between two nodes over an
 * in-memory store: no disk store and no network. Two tiers ("nodes" A and B) open
 * "mem:" URLs, which this test's kc_remote_backend_open answers with a backend over one
 * table in memory (it stands in for remote.c's, which the linker then leaves out of this
 * program). The headers the compiles read and the cubin they publish are real files.
 *
 * Checked: a miss takes the lease and compiles; the holder's finish shares the object,
 * its header list and the index, and releases the lease; the other node then fetches the
 * verified cubin; a node whose headers differ compiles its own; a waiter on a held lease
 * gets the holder's object; a rejected compile's failure note sends the other node to
 * compile at once; a damaged object is refused and compiled around; a store that faults
 * opens the breaker. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hash.h"
#include "log.h"
#include "remote.h"
#include "remote_manifest.h"
#include "remote_tier.h"
#include "tap.h"
#include "util.h"

#define NVCC "/usr/local/cuda/bin/nvcc"

/* ---- the in-memory store ---- */

struct mem_object {
	struct mem_object *next;
	char key[KC_REMOTE_KEYLEN + 1];
	char *data;
	size_t len;
};

struct mem_lease {
	struct mem_lease *next;
	char key[KC_REMOTE_KEYLEN + 1];
	char token[KC_REMOTE_TOKENLEN + 1];
	enum kc_lease_state state;
	int64_t until_ms; /* kc_mono_ms */
};

static struct {
	pthread_mutex_t mu;
	struct mem_object *objects;
	struct mem_lease *leases;
	atomic_int faulty; /* every operation fails with -EIO */
	atomic_int gets, puts;
} mem = {.mu = PTHREAD_MUTEX_INITIALIZER};

struct mem_backend {
	struct kc_remote_backend base;
	char name[64];
};

static struct mem_object **object_at(const char *key)
{
	struct mem_object **o = &mem.objects;
	while (*o && strcmp((*o)->key, key) != 0)
		o = &(*o)->next;
	return o;
}

/* The lease on key, or NULL; one that expired is removed first. mem.mu held. */
static struct mem_lease *lease_of(const char *key)
{
	for (struct mem_lease **l = &mem.leases; *l; l = &(*l)->next) {
		if (strcmp((*l)->key, key) != 0)
			continue;
		if ((*l)->until_ms > kc_mono_ms())
			return *l;
		struct mem_lease *gone = *l;
		*l = gone->next;
		free(gone);
		return NULL;
	}
	return NULL;
}

static int mem_check(const char *key, const char *token)
{
	if (atomic_load(&mem.faulty))
		return -EIO;
	if (!kc_hex_lower_str(key, KC_REMOTE_KEYLEN) ||
	    (token && !kc_hex_lower_str(token, KC_REMOTE_TOKENLEN)))
		return -EINVAL;
	return 0;
}

static int mem_get(struct kc_remote_backend *b, const char *key, char **data, size_t *len)
{
	(void)b;
	int err = mem_check(key, NULL);
	if (err)
		return err;
	atomic_fetch_add(&mem.gets, 1);
	pthread_mutex_lock(&mem.mu);
	struct mem_object *o = *object_at(key);
	if (o && (*data = malloc(o->len + 1))) {
		memcpy(*data, o->data, o->len);
		*len = o->len;
	}
	err = !o ? -ENOENT : *data ? 0 : -ENOMEM;
	pthread_mutex_unlock(&mem.mu);
	return err;
}

static int mem_store(const char *key, const void *data, size_t len, int replace)
{
	int err = mem_check(key, NULL);
	if (err)
		return err;
	atomic_fetch_add(&mem.puts, 1);
	pthread_mutex_lock(&mem.mu);
	struct mem_object **at = object_at(key), *o = *at;
	if (o && !replace) {
		pthread_mutex_unlock(&mem.mu);
		return -EEXIST;
	}
	if (!o && (o = calloc(1, sizeof(*o)))) {
		snprintf(o->key, sizeof(o->key), "%s", key);
		*at = o;
	}
	char *copy = o ? malloc(len ? len : 1) : NULL;
	if (copy) {
		memcpy(copy, data, len);
		free(o->data);
		o->data = copy;
		o->len = len;
	}
	pthread_mutex_unlock(&mem.mu);
	return copy ? 0 : -ENOMEM;
}

static int mem_put(struct kc_remote_backend *b, const char *key, const void *data, size_t len)
{
	(void)b;
	return mem_store(key, data, len, 0);
}

static int mem_replace(struct kc_remote_backend *b, const char *key, const void *data,
		       size_t len)
{
	(void)b;
	return mem_store(key, data, len, 1);
}

static int mem_take(struct kc_remote_backend *b, const char *key, const char *token,
		    unsigned ttl_ms, enum kc_lease_state *state)
{
	(void)b;
	int err = mem_check(key, token);
	if (err || !ttl_ms)
		return err ? err : -EINVAL;
	pthread_mutex_lock(&mem.mu);
	struct mem_lease *l = lease_of(key);
	if (l) {
		*state = l->state;
		err = -EBUSY;
	} else if ((l = calloc(1, sizeof(*l)))) {
		snprintf(l->key, sizeof(l->key), "%s", key);
		snprintf(l->token, sizeof(l->token), "%s", token);
		l->state = KC_LEASE_HELD;
		l->until_ms = kc_mono_ms() + ttl_ms;
		l->next = mem.leases;
		mem.leases = l;
	} else {
		err = -ENOMEM;
	}
	pthread_mutex_unlock(&mem.mu);
	return err;
}

/* Give the lease token holds on key a new state and deadline (kc_mono_ms; 0: gone at the
 * next look): 0, or -ENOLCK when token does not hold it, or mem_check's error. */
static int set_held(const char *key, const char *token, enum kc_lease_state state,
		    int64_t until_ms)
{
	int err = mem_check(key, token);
	if (err)
		return err;
	pthread_mutex_lock(&mem.mu);
	struct mem_lease *l = lease_of(key);
	if (l && l->state == KC_LEASE_HELD && strcmp(l->token, token) == 0) {
		l->state = state;
		l->until_ms = until_ms;
	} else {
		err = -ENOLCK;
	}
	pthread_mutex_unlock(&mem.mu);
	return err;
}

static int mem_renew(struct kc_remote_backend *b, const char *key, const char *token,
		     unsigned ttl_ms)
{
	(void)b;
	return set_held(key, token, KC_LEASE_HELD, kc_mono_ms() + ttl_ms);
}

/* a failure note, or (fail_ms 0) a lease gone at the next look */
static int mem_release(struct kc_remote_backend *b, const char *key, const char *token,
		       unsigned fail_ms)
{
	(void)b;
	return set_held(key, token, KC_LEASE_FAILED, fail_ms ? kc_mono_ms() + fail_ms : 0);
}

static int mem_peek(struct kc_remote_backend *b, const char *key, enum kc_lease_state *state)
{
	(void)b;
	int err = mem_check(key, NULL);
	if (err)
		return err;
	pthread_mutex_lock(&mem.mu);
	struct mem_lease *l = lease_of(key);
	*state = l ? l->state : KC_LEASE_NONE;
	pthread_mutex_unlock(&mem.mu);
	return 0;
}

static const char *mem_describe(struct kc_remote_backend *b)
{
	return ((struct mem_backend *)b)->name;
}

static void mem_destroy(struct kc_remote_backend *b)
{
	free(b);
}

static const struct kc_remote_backend_ops mem_ops = {
	.get = mem_get, .put = mem_put, .replace = mem_replace, .lease_take = mem_take,
	.lease_renew = mem_renew, .lease_release = mem_release, .lease_peek = mem_peek,
	.describe = mem_describe, .destroy = mem_destroy,
};

/* remote.h's opener, for this program: every "mem:NAME" URL is the one table above. */
struct kc_remote_backend *kc_remote_backend_open(const char *url, const char *auth_file,
						 unsigned timeout_ms, char *why, size_t whylen)
{
	struct mem_backend *m;
	if (strncmp(url, "mem:", 4) != 0 || auth_file) {
		snprintf(why, whylen, "%s: only mem: stores in this test", url);
		errno = EINVAL;
		return NULL;
	}
	if (!(m = calloc(1, sizeof(*m)))) {
		errno = ENOMEM;
		return NULL;
	}
	m->base.ops = &mem_ops;
	m->base.timeout_ms = timeout_ms;
	m->base.held_max_ms = KC_REMOTE_RECORD_MAX_MS;
	m->base.note_max_ms = KC_REMOTE_RECORD_MAX_MS;
	snprintf(m->name, sizeof(m->name), "%s", url);
	return &m->base;
}

/* The state of the lease on key now. */
static enum kc_lease_state lease_now(const char *key)
{
	enum kc_lease_state s = KC_LEASE_NONE;
	mem_peek(NULL, key, &s);
	return s;
}

/* Flip a byte near the end of every object over 1 KiB (the cubin objects). */
static int damage_cubins(void)
{
	int n = 0;
	pthread_mutex_lock(&mem.mu);
	for (struct mem_object *o = mem.objects; o; o = o->next)
		if (o->len > 1024) {
			o->data[o->len - 100] ^= 0x5a;
			n++;
		}
	pthread_mutex_unlock(&mem.mu);
	return n;
}

/* ---- the nodes ---- */

static char base[64], header[128], cubin_path[128];
static int cubin_fd = -1;
static char *cubin;
static size_t cubin_len;

struct node {
	struct kc_stats stats;
	struct kc_remote_tier *t;
};

static int node_open(struct node *n, const char *name)
{
	char url[64], why[400];
	memset(n, 0, sizeof(*n));
	snprintf(url, sizeof(url), "mem:%s", name);
	struct kc_remote_opts o = {.url = url, .wait_s = 60, .timeout_ms = 2000};
	int err = kc_remote_tier_open(&o, &n->stats, &n->t, why, sizeof(why));
	if (err)
		printf("# %s\n", why);
	return err;
}

/* The recipe hash of kernel k (the tier derives the store's keys from it). */
static void recipe(int k, char hex[KC_SHA256_HEXLEN + 1])
{
	char text[32];
	snprintf(text, sizeof(text), "recipe %d", k);
	kc_sha256_buf(text, strlen(text), hex);
}

/* What the traced dependency pass writes for a compile that read header. */
static void deps_of(char *out, size_t len)
{
	snprintf(out, len, "o /proc/self/cwd/kernel.cu\no %s\n", header);
}

/* A compile on node n that published: its finish shares cubin with its headers. */
static void finish_published(struct node *n, struct kc_remote_job *rj)
{
	char deps[512];
	deps_of(deps, sizeof(deps));
	kc_remote_tier_finish(n->t, rj, 1, 0, cubin_fd, deps, strlen(deps));
}

static void put_header(const char *text)
{
	FILE *f = fopen(header, "w");
	if (f) {
		fputs(text, f);
		fclose(f);
	}
	chmod(header, 0644);
}

/* Build the cubin every compile here "publishes": a real one, from the real nvcc. */
static int make_cubin(void)
{
	char cmd[512], src[128];
	snprintf(src, sizeof(src), "%s/k.cu", base);
	FILE *f = fopen(src, "w");
	if (!f)
		return -1;
	fputs("extern \"C\" __global__ void k(float *x) { x[0] = 1; }\n", f);
	fclose(f);
	snprintf(cmd, sizeof(cmd), "%s -cubin -arch=sm_90a -o %s %s", NVCC, cubin_path, src);
	if (system(cmd) != 0)
		return -1;
	cubin_fd = open(cubin_path, O_RDONLY | O_CLOEXEC);
	struct stat st;
	if (cubin_fd < 0 || fstat(cubin_fd, &st) != 0 || !(cubin = malloc((size_t)st.st_size)) ||
	    pread(cubin_fd, cubin, (size_t)st.st_size, 0) != st.st_size)
		return -1;
	cubin_len = (size_t)st.st_size;
	return 0;
}

/* Whether the record under key names the compact line (the header list) of the index
 * under mkey: its bytes hold that 74-byte line. */
static int record_names_index_line(const char *key, const char *mkey)
{
	pthread_mutex_lock(&mem.mu);
	const struct mem_object *rec = *object_at(key), *idx = *object_at(mkey);
	const char *at = idx ? memmem(idx->data, idx->len, " @headers\n", 10) : NULL;
	int named = rec && at && at - idx->data >= KC_SHA256_HEXLEN &&
		    memmem(rec->data, rec->len, at - KC_SHA256_HEXLEN, KC_MANIFEST_LINE_LEN);
	pthread_mutex_unlock(&mem.mu);
	return named;
}

/* ---- the protocol ---- */

static void share_then_fetch(struct node *a, struct node *b)
{
	char r[65];
	struct kc_remote_job ja, jb;
	recipe(1, r);
	CHECK(kc_remote_tier_fetch(a->t, r, 1, NULL, &ja) == 0 && ja.active && ja.holder,
	      "A's miss: compile here, holding the key's lease");
	CHECK(lease_now(ja.mkey) == KC_LEASE_HELD, "the store shows the lease held");
	CHECK(atomic_load(&a->stats.remote_misses) == 1, "A counts a miss");
	CHECK(kc_remote_tier_shares(a->t, &ja), "A's compile is to be shared");
	int puts = atomic_load(&mem.puts);
	finish_published(a, &ja);
	CHECK(atomic_load(&mem.puts) - puts == 4 && atomic_load(&a->stats.remote_puts) == 4,
	      "A's finish stores the header list, the object, the index and the lists record");
	char lk[KC_SHA256_HEXLEN + 1];
	CHECK(kc_object_lists_key(lk) == 0 && record_names_index_line(lk, ja.mkey),
	      "the lists record names the header list that the index names");
	CHECK(kc_remote_tier_fetch(b->t, r, 1, NULL, &jb) == 1, "B fetches it: a hit");
	CHECK(jb.obj.cubin_len == cubin_len && memcmp(jb.obj.cubin, cubin, cubin_len) == 0,
	      "B's object carries A's cubin, byte for byte");
	CHECK(lease_now(jb.mkey) == KC_LEASE_NONE, "A's lease was released");
	CHECK(atomic_load(&b->stats.remote_hits) == 1 && atomic_load(&b->stats.remote_misses) == 0,
	      "B counts a hit, no miss");
	kc_remote_job_free(&jb);
}

static void other_headers(struct node *b)
{
	char r[65];
	struct kc_remote_job jb;
	put_header("#define KC_HEADER 2 /* another image's */\n");
	recipe(1, r);
	CHECK(kc_remote_tier_fetch(b->t, r, 1, NULL, &jb) == 0,
	      "B with other header bytes: no object for them, compile here");
	CHECK(atomic_load(&b->stats.remote_misses) == 1, "counted a miss");
	finish_published(b, &jb);
	put_header("#define KC_HEADER 1\n");
}

struct waiter_arg {
	struct node *n;
	const char *recipe;
	struct kc_remote_job rj;
	int ret;
};

static void *fetch_thread(void *p)
{
	struct waiter_arg *w = p;
	w->ret = kc_remote_tier_fetch(w->n->t, w->recipe, 1, NULL, &w->rj);
	return NULL;
}

/* Wait (at most 60 s) until n counts a lease wait. */
static int waits_counted(struct node *n)
{
	for (int i = 0; i < 6000 && atomic_load(&n->stats.remote_lease_waits) < 1; i++)
		usleep(10000);
	return atomic_load(&n->stats.remote_lease_waits) >= 1;
}

static void waiter_gets_holders_object(struct node *a, struct node *b)
{
	char r[65];
	struct kc_remote_job ja;
	pthread_t th;
	recipe(2, r);
	struct waiter_arg w = {.n = b, .recipe = r};
	CHECK(kc_remote_tier_fetch(a->t, r, 1, NULL, &ja) == 0 && ja.holder, "A holds kernel 2");
	pthread_create(&th, NULL, fetch_thread, &w);
	CHECK(waits_counted(b), "B waits on A's lease");
	finish_published(a, &ja);
	pthread_join(th, NULL);
	CHECK(w.ret == 1 && w.rj.obj.cubin_len == cubin_len,
	      "once A shares it, B's wait ends with A's object");
	CHECK(atomic_load(&b->stats.remote_hedged) == 0, "without a hedge");
	kc_remote_job_free(&w.rj);
}

static void failure_note(struct node *a, struct node *b)
{
	char r[65];
	struct kc_remote_job ja, jb;
	recipe(3, r);
	CHECK(kc_remote_tier_fetch(a->t, r, 1, NULL, &ja) == 0 && ja.holder, "A holds kernel 3");
	kc_remote_tier_finish(a->t, &ja, 0, 1, -1, NULL, 0);
	CHECK(lease_now(ja.mkey) == KC_LEASE_FAILED, "A's rejected compile leaves a failure note");
	uint64_t waits = atomic_load(&b->stats.remote_lease_waits);
	double t0 = kc_mono_s();
	CHECK(kc_remote_tier_fetch(b->t, r, 1, NULL, &jb) == 0 && !jb.holder,
	      "B, seeing the note, compiles here at once, holding no lease");
	CHECK(kc_mono_s() - t0 < 30 && atomic_load(&b->stats.remote_lease_waits) == waits,
	      "without waiting");
	kc_remote_tier_finish(b->t, &jb, 0, 1, -1, NULL, 0);
}

static void damaged_object(struct node *a, struct node *c)
{
	char r[65];
	struct kc_remote_job ja, jc;
	recipe(4, r);
	CHECK(kc_remote_tier_fetch(a->t, r, 1, NULL, &ja) == 0, "A compiles kernel 4");
	finish_published(a, &ja);
	CHECK(damage_cubins() >= 1, "a byte of each stored cubin object flipped");
	uint64_t rejected = atomic_load(&c->stats.remote_rejected);
	CHECK(kc_remote_tier_fetch(c->t, r, 1, NULL, &jc) == 0,
	      "C refuses the damaged object and compiles here");
	CHECK(atomic_load(&c->stats.remote_rejected) == rejected + 1, "counted as rejected");
	kc_remote_tier_finish(c->t, &jc, 0, 0, -1, NULL, 0);
}

static void breaker(struct node *c)
{
	char r[65];
	struct kc_remote_job jc;
	CHECK(kc_remote_tier_up(c->t), "C's store is up");
	atomic_store(&mem.faulty, 1);
	for (int i = 0; i < KC_REMOTE_BREAKER_FAULTS; i++) {
		recipe(100 + i, r);
		if (kc_remote_tier_fetch(c->t, r, 1, NULL, &jc) == 1)
			kc_remote_job_free(&jc);
		else
			kc_remote_tier_finish(c->t, &jc, 0, 0, -1, NULL, 0);
	}
	double opened = kc_mono_s();
	CHECK(!kc_remote_tier_up(c->t), "after KC_REMOTE_BREAKER_FAULTS faults the breaker opens");
	int gets = atomic_load(&mem.gets);
	recipe(200, r);
	int ret = kc_remote_tier_fetch(c->t, r, 1, NULL, &jc);
	if (kc_mono_s() - opened < KC_REMOTE_BREAKER_FIRST_S) /* else its probe was due */
		CHECK(ret == 0 && atomic_load(&mem.gets) == gets,
		      "open, the store is not asked before the first probe: compile here");
	else
		printf("# the machine took over %d s: the probe was due, not checked\n",
		       KC_REMOTE_BREAKER_FIRST_S);
	kc_remote_tier_finish(c->t, &jc, 0, 0, -1, NULL, 0);
	atomic_store(&mem.faulty, 0);
}

int main(void)
{
	struct node a, b, c;

	kc_log_init(0, KC_LOG_WARN);
	snprintf(base, sizeof(base), "/tmp/kc-test-protocol-XXXXXX");
	if (!mkdtemp(base))
		return 1;
	chmod(base, 0755); /* headers are hashed only when everyone can read them */
	snprintf(header, sizeof(header), "%s/kc_protocol.h", base);
	snprintf(cubin_path, sizeof(cubin_path), "%s/k.cubin", base);
	put_header("#define KC_HEADER 1\n");
	if (make_cubin() != 0) {
		CHECK(0, "a real cubin from the real nvcc");
		return tap_done();
	}
	CHECK(node_open(&a, "A") == 0 && node_open(&b, "B") == 0 && node_open(&c, "C") == 0,
	      "three nodes open one in-memory store");

	share_then_fetch(&a, &b);
	other_headers(&b);
	waiter_gets_holders_object(&a, &b);
	failure_note(&a, &b);
	damaged_object(&a, &c);
	breaker(&c);

	kc_remote_tier_close(a.t);
	kc_remote_tier_close(b.t);
	kc_remote_tier_close(c.t);
	close(cubin_fd);
	free(cubin);
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", base);
	CHECK(system(cmd) == 0, "clean up");
	return tap_done();
}
