/* remote_tier.c - see remote_tier.h */
#define _GNU_SOURCE
#include "remote_tier.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "compile.h"
#include "io.h"
#include "kc_build.h"
#include "log.h"
#include "remote_manifest.h"
#include "util.h"
#include "remote_rehash.h"

enum fault_kind { FAULT_GET, FAULT_PUT, FAULT_LEASE, FAULT_KINDS };

/* The digest of an empty header list: no fetch needed to check it. */
#define EMPTY_LIST "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

struct kc_remote_tier {
	struct kc_remote_backend *b;
	struct kc_stats *stats;
	unsigned char *secret_buf;
	struct kc_object_secret secret;
	int read_only;
	unsigned lease_ms, wait_s;
	pthread_mutex_t lock;
	pthread_cond_t stop_cv; /* CLOCK_MONOTONIC: waits between polls end early at stop */
	int stopping;
	unsigned faults_in_row;
	double breaker_until;   /* monotonic seconds of the next probe; 0: closed */
	double breaker_wait_s;  /* the wait before that probe (doubles after a failed one) */
	int probing;            /* 1 while a thread asks the store whether it is back */
	double last_log[FAULT_KINDS];
	unsigned long suppressed[FAULT_KINDS];
	/* header lists (remote_manifest.h) this node fetched or stored, by their digest: a
	 * joining node fetches each once, and stores each once; replaced round-robin */
	struct {
		char hash[KC_SHA256_HEXLEN + 1];
		char *list; /* malloc'd; NULL: empty slot */
		size_t len;
	} lists[KC_REMOTE_LISTS];
	unsigned next_list;
	pthread_mutex_t list_fetch; /* one fetch of a header list at a time: the jobs of a
				     * joining node that need one list at once fetch it once */
	struct kc_rehash_table rehash; /* this node's manifests of those lists (remote_rehash.h) */
	/* the digest of the list whose manifest last matched an index here (under lock; ""
	 * none): a fetch asks first for the object of this node's manifest of it, without
	 * the index (look_direct) */
	char last_list[KC_SHA256_HEXLEN + 1];
	/* 1 while a look with no last_list reads an index: the looks that begin meanwhile
	 * wait for it (at most KC_REMOTE_FIRST_WAIT_MS, on list_cv) and then ask directly,
	 * instead of each reading its own index (a joining node's first fetches) */
	int establishing;
	pthread_cond_t list_cv; /* CLOCK_MONOTONIC; last_list set, establishing ended, or
				 * the store stopping */
	pthread_t prewarm;      /* kc_remote_tier_probe's check of the cluster's lists */
	int prewarm_live;       /* it holds a thread not yet joined */
};

static void prewarm_start(struct kc_remote_tier *t);
static void prewarm_wait(struct kc_remote_tier *t);

/* Open the breaker at now (t->lock held): the store is asked again, with one probe, after
 * KC_REMOTE_BREAKER_FIRST_S seconds. */
static void breaker_open(struct kc_remote_tier *t, double now)
{
	t->faults_in_row = KC_REMOTE_BREAKER_FAULTS;
	t->breaker_wait_s = KC_REMOTE_BREAKER_FIRST_S;
	t->breaker_until = now + t->breaker_wait_s;
}

double kc_remote_breaker_next_wait(double wait_s)
{
	double next = wait_s * 2;
	return next < KC_REMOTE_BREAKER_S ? next : KC_REMOTE_BREAKER_S;
}

/* The cheap call that says whether the store is back: a get of a key no object has (one
 * GET on Redis, one failed open on a dir: store). 0 when it answered, else the fault. */
static int ask_store(struct kc_remote_tier *t)
{
	static const char nobody[KC_SHA256_HEXLEN + 1] =
		"0000000000000000000000000000000000000000000000000000000000000000";
	char *data = NULL;
	size_t len = 0;
	int err = t->b->ops->get(t->b, nobody, &data, &len);
	free(data);
	return err == -ENOENT ? 0 : err;
}

/* Whether the breaker lets an operation through now. An open breaker holds operations off
 * until its probe is due; then the first caller asks the store once (the others are held
 * off meanwhile): an answer closes the breaker and lets the caller through, a fault doubles
 * the wait (up to KC_REMOTE_BREAKER_S) before the next probe. A store back at once is then
 * used again after KC_REMOTE_BREAKER_FIRST_S, not after the cap. */
static int store_usable(struct kc_remote_tier *t)
{
	pthread_mutex_lock(&t->lock);
	int closed = t->breaker_until == 0;
	int due = !closed && !t->probing && kc_mono_s() >= t->breaker_until;
	t->probing |= due;
	pthread_mutex_unlock(&t->lock);
	if (!due)
		return closed;
	int err = ask_store(t);
	pthread_mutex_lock(&t->lock);
	t->probing = 0;
	if (err == 0 && t->breaker_until != 0) {
		kc_log(KC_LOG_WARN, "cluster store %s answers again", t->b->ops->describe(t->b));
		t->faults_in_row = 0;
		t->breaker_until = 0;
	} else if (err != 0 && t->breaker_until != 0) {
		t->breaker_wait_s = kc_remote_breaker_next_wait(t->breaker_wait_s);
		t->breaker_until = kc_mono_s() + t->breaker_wait_s;
	}
	closed = t->breaker_until == 0;
	pthread_mutex_unlock(&t->lock);
	if (err != 0)
		atomic_fetch_add(&t->stats->remote_get_errors, 1);
	return closed;
}

/* Count the outcome err of an operation of kind: 0 and the answers that are no fault
 * (benign) close the breaker; a fault is counted, logged at most once per 10 s per kind,
 * and opens the breaker after KC_REMOTE_BREAKER_FAULTS in a row. */
static void outcome(struct kc_remote_tier *t, enum fault_kind kind, int err, int benign,
		    const char *what)
{
	static const char *const kinds[] = {"get", "put", "lease"};
	if (err == 0 || err == benign || (kind == FAULT_LEASE && (err == -EBUSY ||
								   err == -ENOLCK))) {
		pthread_mutex_lock(&t->lock);
		if (t->breaker_until != 0)
			kc_log(KC_LOG_WARN, "cluster store %s answers again", t->b->ops->describe(t->b));
		t->faults_in_row = 0;
		t->breaker_until = 0;
		pthread_mutex_unlock(&t->lock);
		return;
	}
	atomic_uint_fast64_t *counter = kind == FAULT_GET   ? &t->stats->remote_get_errors
					: kind == FAULT_PUT ? &t->stats->remote_put_errors
							    : &t->stats->remote_lease_errors;
	atomic_fetch_add(counter, 1);
	pthread_mutex_lock(&t->lock);
	double now = kc_mono_s();
	if (now - t->last_log[kind] >= 10) {
		kc_log(KC_LOG_WARN, "cluster store %s: %s %s failed: %s%s", t->b->ops->describe(t->b),
		       kinds[kind], what, strerror(-err),
		       t->suppressed[kind] ? " (and earlier ones not logged)" : "");
		t->last_log[kind] = now;
		t->suppressed[kind] = 0;
	} else {
		t->suppressed[kind]++;
	}
	/* An operation begun before the breaker opened, failing now, leaves its probes be. */
	if (++t->faults_in_row >= KC_REMOTE_BREAKER_FAULTS && t->breaker_until == 0) {
		kc_log(KC_LOG_WARN, "cluster store %s: %u faults in a row; compiling locally, and "
		       "asking it again in %d s, then at doubling waits up to %d s",
		       t->b->ops->describe(t->b), t->faults_in_row, KC_REMOTE_BREAKER_FIRST_S,
		       KC_REMOTE_BREAKER_S);
		breaker_open(t, now);
	}
	pthread_mutex_unlock(&t->lock);
}

int kc_remote_tier_up(struct kc_remote_tier *t)
{
	pthread_mutex_lock(&t->lock);
	int up = t->breaker_until == 0;
	pthread_mutex_unlock(&t->lock);
	return up;
}

/* Read the HMAC secret (kc_secret_read's rules: a file of root's, or the daemon's user's,
 * that nobody else can read), at least KC_OBJECT_MIN_SECRET bytes. */
static int load_secret(struct kc_remote_tier *t, const char *path, char *why, size_t whylen)
{
	char *buf;
	size_t len;
	int err = kc_secret_read("remote_key", path, 4096, &buf, &len, why, whylen);
	if (err)
		return -EACCES;
	if (len < KC_OBJECT_MIN_SECRET) {
		kc_secret_free(buf, len);
		snprintf(why, whylen, "remote_key=%s: the secret must be at least 16 bytes", path);
		return -EACCES;
	}
	t->secret_buf = (unsigned char *)buf;
	t->secret.bytes = t->secret_buf;
	t->secret.len = len;
	return 0;
}

int kc_remote_tier_open(const struct kc_remote_opts *o,
			struct kc_stats *stats, struct kc_remote_tier **out, char *why,
			size_t whylen)
{
	struct kc_remote_tier *t = calloc(1, sizeof(*t));
	if (!t) {
		snprintf(why, whylen, "out of memory");
		return -ENOMEM;
	}
	t->stats = stats;
	t->read_only = o->read_only;
	t->lease_ms = (o->lease_s ? o->lease_s : KC_REMOTE_DEFAULT_LEASE) * 1000u;
	t->wait_s = o->wait_s ? o->wait_s : KC_REMOTE_DEFAULT_WAIT;
	if (o->key_file) {
		int err = load_secret(t, o->key_file, why, whylen);
		if (err) {
			free(t);
			return err;
		}
	}
	t->b = kc_remote_backend_open(o->url, o->auth_file,
				      o->timeout_ms ? o->timeout_ms : KC_REMOTE_DEFAULT_TIMEOUT, why,
				      whylen);
	if (!t->b) {
		int err = errno ? -errno : -EINVAL;
		kc_secret_free((char *)t->secret_buf, t->secret.len);
		free(t);
		return err;
	}
	t->b->secret = &t->secret; /* len 0 without a key: records unsigned, still bounded */
	t->b->held_max_ms = t->lease_ms;
	t->b->note_max_ms = KC_REMOTE_FAIL_NOTE_MS;
	pthread_mutex_init(&t->lock, NULL);
	pthread_mutex_init(&t->list_fetch, NULL);
	kc_rehash_init(&t->rehash);
	kc_cond_init_mono(&t->stop_cv);
	kc_cond_init_mono(&t->list_cv);
	if (!o->key_file)
		kc_log(KC_LOG_WARN, "remote=%s without remote_key=: objects are not signed, and "
		       "anyone who can write the store can make this node serve their cubins",
		       t->b->ops->describe(t->b));
	kc_log(KC_LOG_INFO, "cluster store %s%s, lease %u s, wait %u s, timeout %u ms%s",
	       t->b->ops->describe(t->b), t->read_only ? " (read-only)" : "", t->lease_ms / 1000,
	       t->wait_s, t->b->timeout_ms, o->key_file ? ", objects signed" : "");
	*out = t;
	return 0;
}

void kc_remote_tier_probe(struct kc_remote_tier *t, int wait)
{
	kc_manifest_memo_init(); /* after the daemon's fork: its pages are this process's */
	int err = ask_store(t);
	if (err == 0) {
		kc_log(KC_LOG_INFO, "cluster store %s answers", t->b->ops->describe(t->b));
		prewarm_start(t);
		if (wait)
			prewarm_wait(t);
		return;
	}
	atomic_fetch_add(&t->stats->remote_get_errors, 1);
	kc_log(KC_LOG_WARN, "cluster store %s does not answer at start (%s): compiling locally, "
	       "and asking it again in %d s, then at doubling waits up to %d s",
	       t->b->ops->describe(t->b), strerror(-err), KC_REMOTE_BREAKER_FIRST_S,
	       KC_REMOTE_BREAKER_S);
	pthread_mutex_lock(&t->lock);
	breaker_open(t, kc_mono_s());
	pthread_mutex_unlock(&t->lock);
}

void kc_remote_tier_stop(struct kc_remote_tier *t)
{
	pthread_mutex_lock(&t->lock);
	t->stopping = 1;
	pthread_cond_broadcast(&t->stop_cv);
	pthread_cond_broadcast(&t->list_cv); /* looks waiting for an index reader */
	pthread_mutex_unlock(&t->lock);
}

void kc_remote_tier_close(struct kc_remote_tier *t)
{
	if (!t)
		return;
	if (t->prewarm_live) /* stopped between lists: at most one list's gets and rehash */
		pthread_join(t->prewarm, NULL);
	t->b->ops->destroy(t->b);
	pthread_mutex_destroy(&t->lock);
	pthread_mutex_destroy(&t->list_fetch);
	kc_rehash_destroy(&t->rehash);
	pthread_cond_destroy(&t->stop_cv);
	pthread_cond_destroy(&t->list_cv);
	for (int i = 0; i < KC_REMOTE_LISTS; i++)
		free(t->lists[i].list);
	kc_secret_free((char *)t->secret_buf, t->secret.len);
	free(t);
}

/* Sleep ms unless the cluster store stops first. Returns 1 when it stops. */
static int pause_ms(struct kc_remote_tier *t, unsigned ms)
{
	struct timespec until = kc_mono_after_ms(ms);
	pthread_mutex_lock(&t->lock);
	while (!t->stopping && pthread_cond_timedwait(&t->stop_cv, &t->lock, &until) != ETIMEDOUT)
		;
	int stopping = t->stopping;
	pthread_mutex_unlock(&t->lock);
	return stopping;
}

/* The renewal thread of a held lease. */
struct renewer {
	struct kc_remote_tier *t;
	const char *key, *token; /* the job's (kc_remote_job_move repoints them), which
				  * outlives the thread; read under mu */
	pthread_mutex_t mu;
	unsigned every_ms;
	struct kc_ticker ticker;
};

/* Renew every third of the lease, and at least every KC_REMOTE_RENEW_MS: each renewal also
 * tells waiters that this holder lives, so that one that died is taken over within
 * KC_REMOTE_ALIVE_MS and not its lease's ttl. Once taken over, nothing is left to renew. */
static long renew_tick(void *arg)
{
	struct renewer *r = arg;
	/* copied under the lock: kc_remote_job_move may move them meanwhile */
	char key[sizeof(((struct kc_remote_job *)0)->mkey)];
	char token[sizeof(((struct kc_remote_job *)0)->token)];
	pthread_mutex_lock(&r->mu);
	snprintf(key, sizeof(key), "%s", r->key);
	snprintf(token, sizeof(token), "%s", r->token);
	pthread_mutex_unlock(&r->mu);
	int err = r->t->b->ops->lease_renew(r->t->b, key, token, r->t->lease_ms);
	outcome(r->t, FAULT_LEASE, err, 0, "renewal");
	if (err == -ENOLCK) {
		kc_log(KC_LOG_INFO, "cluster store: lease on %.16s was taken over while "
		       "compiling", key);
		return KC_TICK_IDLE;
	}
	return r->every_ms;
}

static void renewer_start(struct kc_remote_tier *t, struct kc_remote_job *rj)
{
	struct renewer *r = calloc(1, sizeof(*r));
	if (!r)
		return; /* the lease then lasts its ttl; a takeover costs one more compile */
	r->t = t;
	r->key = rj->mkey;
	r->token = rj->token;
	r->every_ms = t->lease_ms / 3 ? t->lease_ms / 3 : 1;
	if (r->every_ms > KC_REMOTE_RENEW_MS)
		r->every_ms = KC_REMOTE_RENEW_MS;
	pthread_mutex_init(&r->mu, NULL);
	if (kc_ticker_start(&r->ticker, r->every_ms, renew_tick, r) != 0) {
		pthread_mutex_destroy(&r->mu);
		free(r);
		return;
	}
	rj->renewer = r;
}

static void renewer_stop(struct kc_remote_job *rj)
{
	struct renewer *r = rj->renewer;
	if (!r)
		return;
	kc_ticker_stop(&r->ticker);
	pthread_mutex_destroy(&r->mu);
	free(r);
	rj->renewer = NULL;
}

enum found { FOUND_NONE, FOUND_CUBIN, FOUND_OTHER_HEADERS, FOUND_FAULT };

/* A copy of the header list with digest hash from this node's table into *list / *len
 * (malloc'd). Returns 1 found, 0 not, -ENOMEM. */
static int list_cached(struct kc_remote_tier *t, const char *hash, char **list, size_t *len)
{
	int found = 0;
	pthread_mutex_lock(&t->lock);
	for (int i = 0; i < KC_REMOTE_LISTS && !found; i++) {
		if (!t->lists[i].list || strcmp(t->lists[i].hash, hash) != 0)
			continue;
		found = (*list = malloc(t->lists[i].len + 1)) ? 1 : -ENOMEM;
		if (found == 1) {
			memcpy(*list, t->lists[i].list, t->lists[i].len);
			*len = t->lists[i].len;
		}
	}
	pthread_mutex_unlock(&t->lock);
	return found;
}

/* Remember a copy of the header list list/len under its digest hash. */
static void list_remember(struct kc_remote_tier *t, const char *hash, const char *list,
			  size_t len)
{
	char *copy = malloc(len + 1);
	if (!copy)
		return;
	memcpy(copy, list, len);
	pthread_mutex_lock(&t->lock);
	unsigned i = t->next_list++ % KC_REMOTE_LISTS;
	free(t->lists[i].list);
	t->lists[i].list = copy;
	t->lists[i].len = len;
	memcpy(t->lists[i].hash, hash, KC_SHA256_HEXLEN + 1);
	pthread_mutex_unlock(&t->lock);
}

/* The header list whose digest is hash: from the table, else fetched and verified (an
 * index-kind object under its list key whose bytes have that digest). Returns 0 with
 * *list / *len (malloc'd); -ENOENT (not in the store, or refused: why says so), or a
 * store fault. */
static int list_fetch(struct kc_remote_tier *t, const char *hash, char **list, size_t *len,
		      char *why, size_t whylen);

static int list_get(struct kc_remote_tier *t, const char *hash, char **list, size_t *len,
		    char *why, size_t whylen)
{
	int err = list_cached(t, hash, list, len);
	if (err)
		return err < 0 ? err : 0;
	pthread_mutex_lock(&t->list_fetch);
	err = list_cached(t, hash, list, len); /* fetched by another job meanwhile */
	if (err) {
		pthread_mutex_unlock(&t->list_fetch);
		return err < 0 ? err : 0;
	}
	err = list_fetch(t, hash, list, len, why, whylen);
	pthread_mutex_unlock(&t->list_fetch);
	return err;
}

/* list_get's fetch from the store, verified, remembered. */
static int list_fetch(struct kc_remote_tier *t, const char *hash, char **list, size_t *len,
		      char *why, size_t whylen)
{
	char lkey[KC_SHA256_HEXLEN + 1], got[KC_SHA256_HEXLEN + 1], *data = NULL;
	size_t dlen = 0;
	struct kc_object obj;
	int err;
	if (kc_object_list_key(hash, lkey) != 0 || !store_usable(t))
		return -EIO;
	err = t->b->ops->get(t->b, lkey, &data, &dlen);
	outcome(t, FAULT_GET, err, -ENOENT, "of a header list");
	if (err) {
		snprintf(why, whylen, "header list %.16s: %s", hash, strerror(-err));
		return err;
	}
	atomic_fetch_add(&t->stats->remote_bytes_in, dlen);
	err = kc_object_parse(data, dlen, KC_OBJECT_INDEX, lkey, &t->secret, &obj, why, whylen);
	if (!err && (kc_sha256_buf(obj.manifest, obj.manifest_len, got) != 0 ||
		     strcmp(got, hash) != 0)) {
		snprintf(why, whylen, "header list %.16s does not have its digest", hash);
		err = -EBADMSG;
	}
	if (!err && !(*list = malloc(obj.manifest_len + 1)))
		err = -ENOMEM;
	if (err) {
		atomic_fetch_add(&t->stats->remote_rejected, 1);
		kc_log(KC_LOG_WARN, "cluster store: header list %.16s refused: %s", hash, why);
		free(data);
		return -ENOENT;
	}
	memcpy(*list, obj.manifest, obj.manifest_len);
	*len = obj.manifest_len;
	list_remember(t, hash, *list, *len);
	free(data);
	return 0;
}

/* The object under the key of this node's compact manifest mine/mlen for rj->mkey,
 * fetched and verified into rj (t0: when the look began, for the fetch time). Returns 0,
 * -ENOENT (not stored), -EBADMSG (refused: counted and logged), or a store fault. */
static int fetch_object(struct kc_remote_tier *t, struct kc_remote_job *rj, const char *mine,
			size_t mlen, double t0)
{
	char *data = NULL, why[400] = "", okey[KC_SHA256_HEXLEN + 1];
	size_t len = 0;
	if (kc_object_cubin_key(rj->mkey, mine, mlen, okey) != 0 || !store_usable(t))
		return -EIO;
	int err = t->b->ops->get(t->b, okey, &data, &len);
	outcome(t, FAULT_GET, err, -ENOENT, "of an object");
	if (err)
		return err;
	atomic_fetch_add(&t->stats->remote_bytes_in, len);
	err = kc_object_parse(data, len, KC_OBJECT_CUBIN, okey, &t->secret, &rj->obj, why,
			      sizeof(why));
	if (err == 0 && (rj->obj.manifest_len != mlen ||
			 memcmp(rj->obj.manifest, mine, mlen) != 0)) {
		snprintf(why, sizeof(why), "its manifest is not this node's");
		err = -EBADMSG;
	}
	if (err) {
		atomic_fetch_add(&t->stats->remote_rejected, 1);
		kc_log(KC_LOG_WARN, "cluster store: object %.16s refused: %s", okey, why);
		free(data);
		return -EBADMSG;
	}
	rj->data = data;
	snprintf(rj->where, sizeof(rj->where), "%.100s, object %.16s", t->b->ops->describe(t->b),
		 okey);
	atomic_fetch_add(&t->stats->remote_fetch_usec, (uint64_t)((kc_mono_s() - t0) * 1e6));
	atomic_fetch_add(&t->stats->remote_fetches, 1);
	return 0;
}

/* This node's compact manifest of the header list with digest lhash (list/list_len; none
 * for the empty list's digest) into mine / *mlen, from a rehash begun after ticket
 * (remote_rehash.h; with check, one that arms no watch: kc_rehash_check). Returns 0 or
 * kc_rehash_own's error, why filled. */
static int own_manifest(struct kc_remote_tier *t, unsigned long ticket, const char *lhash,
			const char *list, size_t list_len, char *mine, size_t *mlen, char *why,
			size_t whylen, int check)
{
	if (strcmp(lhash, EMPTY_LIST) == 0) /* no lookup outside the include roots */
		return kc_manifest_compact("", 0, mine, mlen);
	return (check ? kc_rehash_check : kc_rehash_own)(&t->rehash, ticket, lhash, list,
							 list_len, mine, mlen, why, whylen);
}

/* The object of rj->mkey under this node's manifest of the header list that last matched
 * an index here, asked for without the index: the kernels of one client read the same
 * headers, so a joining node finds most objects so, with one get instead of two. It is
 * the object the index would lead to when it lists that manifest, verified the same way,
 * and a key no node compiled under those headers holds none. FOUND_NONE: no such list
 * here, its headers are no longer this node's, or no object (the caller reads the index). */
static enum found look_direct(struct kc_remote_tier *t, struct kc_remote_job *rj,
			      unsigned long ticket, double t0, int *establisher)
{
	char lhash[KC_SHA256_HEXLEN + 1], mine[KC_MANIFEST_COMPACT_MAX], why[400] = "";
	char *list = NULL;
	size_t list_len = 0, mlen = 0;
	struct timespec until = kc_mono_after_ms(KC_REMOTE_FIRST_WAIT_MS);
	pthread_mutex_lock(&t->lock);
	int waited = 0; /* one wait at most: after one that found nothing, read the index */
	while (!t->last_list[0] && t->establishing && !t->stopping &&
	       pthread_cond_timedwait(&t->list_cv, &t->lock, &until) != ETIMEDOUT)
		waited = 1;
	memcpy(lhash, t->last_list, sizeof(lhash));
	if (!lhash[0] && !t->establishing && !waited)
		t->establishing = *establisher = 1;
	pthread_mutex_unlock(&t->lock);
	if (!lhash[0])
		return FOUND_NONE;
	if (strcmp(lhash, EMPTY_LIST) != 0 && list_cached(t, lhash, &list, &list_len) != 1)
		return FOUND_NONE; /* replaced in the table: the index names it again */
	int err = own_manifest(t, ticket, lhash, list, list_len, mine, &mlen, why, sizeof(why), 0);
	free(list);
	if (err)
		return err == -ENOMEM ? FOUND_FAULT : FOUND_NONE;
	err = fetch_object(t, rj, mine, mlen, t0);
	return err == 0 ? FOUND_CUBIN : err == -ENOENT ? FOUND_NONE
	       : err == -EBADMSG ? FOUND_OTHER_HEADERS : FOUND_FAULT;
}

/* Look for the recipe's object: with direct, first as look_direct does; then the index
 * under rj->mkey, the header lists it names, this node's compact manifest of those
 * headers, the object under the key of that manifest, verified. */
static enum found look_index(struct kc_remote_tier *t, struct kc_remote_job *rj,
			     unsigned long ticket, double t0);

static enum found look(struct kc_remote_tier *t, struct kc_remote_job *rj, int direct)
{
	double t0 = kc_mono_s();
	unsigned long ticket = kc_rehash_ticket(&t->rehash); /* before any header is looked at */

	if (!store_usable(t))
		return FOUND_FAULT;
	int establisher = 0;
	if (direct) {
		enum found f = look_direct(t, rj, ticket, t0, &establisher);
		if (f != FOUND_NONE)
			return f;
	}
	enum found f = look_index(t, rj, ticket, t0);
	if (establisher) {
		pthread_mutex_lock(&t->lock);
		t->establishing = 0;
		pthread_cond_broadcast(&t->list_cv);
		pthread_mutex_unlock(&t->lock);
	}
	return f;
}

/* The compact lines of the index-kind record under key (an index, or the lists record;
 * what: its name in the log), verified: 0 with *lines (malloc'd, KC_MANIFEST_LINE_LEN
 * bytes each) / *n; -ENOENT when there is none; -EBADMSG when it is refused (counted,
 * logged); -ENOMEM; another store fault. */
static int index_lines(struct kc_remote_tier *t, const char *key, const char *what,
		       char **lines, size_t *n)
{
	char *data = NULL, why[400] = "";
	size_t len = 0;
	struct kc_object idx;
	char of[80];
	snprintf(of, sizeof(of), "of the %s", what);
	int err = t->b->ops->get(t->b, key, &data, &len);
	outcome(t, FAULT_GET, err, -ENOENT, of);
	if (err)
		return err;
	atomic_fetch_add(&t->stats->remote_bytes_in, len);
	err = kc_object_parse(data, len, KC_OBJECT_INDEX, key, &t->secret, &idx, why,
			      sizeof(why));
	/* up to KC_MANIFEST_PER_KEY compact manifests, newest first */
	if (!err && (idx.manifest_len % KC_MANIFEST_LINE_LEN || !idx.manifest_len ||
		     idx.manifest[KC_SHA256_HEXLEN + 1] != KC_MANIFEST_LIST_NAME[0])) {
		snprintf(why, sizeof(why), "its manifest is not a compact one");
		err = -EBADMSG;
	}
	if (!err && !(*lines = malloc(idx.manifest_len)))
		err = -ENOMEM;
	if (!err) {
		memcpy(*lines, idx.manifest, idx.manifest_len);
		*n = idx.manifest_len / KC_MANIFEST_LINE_LEN;
	}
	free(data);
	if (err && err != -ENOMEM) {
		atomic_fetch_add(&t->stats->remote_rejected, 1);
		kc_log(KC_LOG_WARN, "cluster store: %s %.16s refused: %s", what, key, why);
		err = -EBADMSG;
	}
	return err;
}

/* The first of the n compact lines whose header list is this node's: its list's digest
 * into lhash and this node's compact manifest of it (from a rehash begun after ticket;
 * check as own_manifest's) into mine / *mlen. Returns its index; -ENOENT when none is (why
 * says why, for the log); -EIO on a store fault; -ENOMEM. */
static long match_line(struct kc_remote_tier *t, unsigned long ticket, const char *lines,
		       size_t n, char lhash[KC_SHA256_HEXLEN + 1],
		       char mine[KC_MANIFEST_COMPACT_MAX], size_t *mlen, char *why, size_t whylen,
		       int check)
{
	for (size_t i = 0; i < n; i++) {
		const char *line = lines + i * KC_MANIFEST_LINE_LEN;
		char *list = NULL;
		size_t list_len = 0;
		memcpy(lhash, line, KC_SHA256_HEXLEN);
		lhash[KC_SHA256_HEXLEN] = '\0';
		if (strcmp(lhash, EMPTY_LIST) != 0) {
			int err = list_get(t, lhash, &list, &list_len, why, whylen);
			if (err && err != -ENOENT)
				return err == -ENOMEM ? -ENOMEM : -EIO;
			if (err)
				continue;
		}
		int matched = own_manifest(t, ticket, lhash, list, list_len, mine, mlen, why,
					   whylen, check) == 0 &&
			      *mlen == KC_MANIFEST_LINE_LEN && memcmp(mine, line, *mlen) == 0;
		free(list);
		if (matched)
			return (long)i;
	}
	return -ENOENT;
}

/* Make lhash the list whose manifest last matched here (look_direct's), unless keep and
 * one is set already (by a look's index, which is as good), and wake the looks that wait
 * for one. */
static void list_matched(struct kc_remote_tier *t, const char *lhash, int keep)
{
	pthread_mutex_lock(&t->lock);
	if (!keep || !t->last_list[0])
		memcpy(t->last_list, lhash, KC_SHA256_HEXLEN + 1);
	pthread_cond_broadcast(&t->list_cv);
	pthread_mutex_unlock(&t->lock);
}

/* look's reading of the index (its second step), ticket and t0 as there. */
static enum found look_index(struct kc_remote_tier *t, struct kc_remote_job *rj,
			     unsigned long ticket, double t0)
{
	char *lines = NULL, why[400] = "";
	char lhash[KC_SHA256_HEXLEN + 1], mine[KC_MANIFEST_COMPACT_MAX] = "";
	size_t nlines = 0, mlen = 0;
	int err = index_lines(t, rj->mkey, "index", &lines, &nlines);
	if (err)
		return err == -ENOENT || err == -EBADMSG ? FOUND_NONE : FOUND_FAULT;
	long m = match_line(t, ticket, lines, nlines, lhash, mine, &mlen, why, sizeof(why), 0);
	free(lines);
	if (m == -EIO || m == -ENOMEM)
		return FOUND_FAULT;
	if (m < 0) { /* no image's headers in the index are this node's */
		kc_log(KC_LOG_DEBUG, "cluster store: index %.16s: none of its %zu manifests is this "
		       "node's%s%s", rj->mkey, nlines, why[0] ? ": " : "", why);
		return FOUND_OTHER_HEADERS;
	}
	list_matched(t, lhash, 0);
	err = fetch_object(t, rj, mine, mlen, t0);
	return err == 0 ? FOUND_CUBIN : err == -ENOENT || err == -EBADMSG ? FOUND_OTHER_HEADERS
	       : FOUND_FAULT;
}

/* Whether the cluster store is stopping (kc_remote_tier_stop). */
static int stopping(struct kc_remote_tier *t)
{
	pthread_mutex_lock(&t->lock);
	int stop = t->stopping;
	pthread_mutex_unlock(&t->lock);
	return stop;
}

/* The check of the cluster's header lists at start (kc_remote_tier_probe): the lists
 * record names the header lists the nodes stored last, newest first; the first whose
 * headers are this node's (this node's manifest of it is the one the record names)
 * becomes last_list, as if an index had matched it here, and the watch is armed for it
 * (only for it: a list whose headers are here with other bytes is not worth the watch).
 * So a joining node's first fetches ask for their objects directly, with its headers read
 * and hashed into the memo and watched, instead of doing that on the first fetch's path
 * while every reader waits. It holds no look back: a look that comes before it ends reads
 * an index as before (and shares its rehash, remote_rehash.h). Nothing is taken on its
 * word: each look rehashes the list after it asks (or takes the watch's proof) and
 * verifies the object it finds. A record that is missing, refused or names no list of
 * this node's leaves the node as before. It stops between lists once the store stops. */
static void *prewarm(void *arg)
{
	struct kc_remote_tier *t = arg;
	char key[KC_SHA256_HEXLEN + 1], lhash[KC_SHA256_HEXLEN + 1];
	char mine[KC_MANIFEST_COMPACT_MAX], why[400] = "", *lines = NULL, *list = NULL;
	size_t n = 0, mlen = 0, list_len = 0;
	long m = -ENOENT;
	if (kc_object_lists_key(key) != 0 || !store_usable(t) ||
	    index_lines(t, key, "header lists' record", &lines, &n) != 0)
		return NULL; /* none, or refused (logged), or a fault (counted, logged) */
	for (size_t i = 0; i < n && m == -ENOENT && !stopping(t); i++) {
		m = match_line(t, kc_rehash_ticket(&t->rehash), lines + i * KC_MANIFEST_LINE_LEN,
			       1, lhash, mine, &mlen, why, sizeof(why), 1);
		if (m == 0)
			m = (long)i;
	}
	free(lines);
	if (m >= 0) {
		list_matched(t, lhash, 1);
		kc_log(KC_LOG_INFO, "cluster store: header list %.16s, %ld of the %zu the cluster "
		       "stored last, is this node's headers: fetches ask for its objects directly",
		       lhash, m + 1, n);
		if (strcmp(lhash, EMPTY_LIST) != 0 && !stopping(t) &&
		    list_cached(t, lhash, &list, &list_len) == 1)
			kc_rehash_arm(&t->rehash, lhash, list, list_len);
		free(list);
	} else if (m == -ENOENT && !stopping(t)) {
		kc_log(KC_LOG_INFO, "cluster store: none of the %zu header lists the cluster "
		       "stored last is this node's headers%s%s", n, why[0] ? ": " : "", why);
	} else if (m == -ENOMEM) {
		kc_log(KC_LOG_WARN, "cluster store: the header lists the cluster stored last were "
		       "not checked: out of memory");
	}
	return NULL;
}

/* Start prewarm on a thread of its own; without one, the node goes on as before. */
static void prewarm_start(struct kc_remote_tier *t)
{
	t->prewarm_live = pthread_create(&t->prewarm, NULL, prewarm, t) == 0;
}

/* Wait for prewarm at start, at most KC_REMOTE_PREWARM_WAIT_MS, before the mount serves:
 * its rehash of a list reads and hashes the toolchain and headers the list names (a real
 * compile's: cicc, ptxas, cc1plus, nvcc, about 200 MB), which is a node's first fetch's
 * whole cost when it comes later; the mount comes up that much later instead. Past the
 * bound (a slow store) it goes on behind the mount, as before. */
static void prewarm_wait(struct kc_remote_tier *t)
{
	if (!t->prewarm_live)
		return;
	double t0 = kc_mono_s();
	struct timespec until = kc_wall_after_ms(KC_REMOTE_PREWARM_WAIT_MS);
	if (pthread_timedjoin_np(t->prewarm, NULL, &until) == 0) {
		t->prewarm_live = 0;
		kc_log(KC_LOG_INFO, "cluster store: the cluster's header lists checked in %.0f ms, "
		       "before the mount serves", (kc_mono_s() - t0) * 1000);
	} else {
		kc_log(KC_LOG_INFO, "cluster store: the check of the cluster's header lists goes on "
		       "behind the mount after %d ms", KC_REMOTE_PREWARM_WAIT_MS);
	}
}

/* Try to take the lease. Returns 0 taken, -EBUSY (*state says why), or a fault. A
 * read-only node takes none (it compiles what it does not find, unannounced) but waits
 * for a holder all the same: -EBUSY while one holds the key, else -EIO. */
static int take(struct kc_remote_tier *t, struct kc_remote_job *rj, enum kc_lease_state *state)
{
	if (!store_usable(t))
		return -EIO;
	if (t->read_only) {
		int err = t->b->ops->lease_peek(t->b, rj->mkey, state);
		outcome(t, FAULT_LEASE, err, 0, "peek");
		return err == 0 && *state != KC_LEASE_NONE ? -EBUSY : -EIO;
	}
	int err = t->b->ops->lease_take(t->b, rj->mkey, rj->token, t->lease_ms, state);
	outcome(t, FAULT_LEASE, err, 0, "take");
	return err;
}

/* Returns 0 (compile) holding one of slots. */
static int compile_here(struct kc_slots *slots, int *held)
{
	if (slots && !*held)
		kc_slots_acquire(slots);
	*held = 1;
	return 0;
}

/* Wait for a notice on *w until the next look is due: KC_REMOTE_NOTICE_MS at most (the
 * fallback that notices a dead holder, a failure note, or a notice never sent), in slices
 * that end at a stop. Looks follow one another by KC_REMOTE_NOTICE_GAP_MS at least, so
 * that a flood of planted notices costs the store at most that rate of looks. A watch that
 * faults is ended: the caller polls from then on. Returns 1 when the cluster store stops. */
static int wait_notice(struct kc_remote_tier *t, struct kc_remote_watch **w, double start)
{
	double begun = kc_mono_s(), end = start + t->wait_s;
	double until = begun + KC_REMOTE_NOTICE_MS / 1000.0;
	if (until > end)
		until = end;
	for (;;) {
		double left = until - kc_mono_s();
		if (left <= 0)
			return 0;
		int err = t->b->ops->watch_wait(t->b, *w, left > 0.2 ? 200 : (unsigned)(left * 1000) + 1);
		pthread_mutex_lock(&t->lock);
		int stopping = t->stopping;
		pthread_mutex_unlock(&t->lock);
		if (stopping)
			return 1;
		double gap = begun + KC_REMOTE_NOTICE_GAP_MS / 1000.0 - kc_mono_s();
		if (err == 0)
			return gap > 0 ? pause_ms(t, (unsigned)(gap * 1000) + 1) : 0;
		if (err != -ETIMEDOUT) {
			t->b->ops->watch_end(t->b, *w);
			*w = NULL;
			return pause_ms(t, 50);
		}
	}
}

/* rj's lease token, random (made at its first miss: a hit needs none). Returns 0 or -1. */
static int new_token(struct kc_remote_job *rj)
{
	unsigned char r[KC_REMOTE_TOKENLEN / 2];
	if (getrandom(r, sizeof(r), 0) != (ssize_t)sizeof(r))
		return -1;
	for (size_t i = 0; i < sizeof(r); i++)
		snprintf(rj->token + 2 * i, 3, "%02x", r[i]);
	return 0;
}

int kc_remote_tier_fetch(struct kc_remote_tier *t, const char *recipe_hash, int use_store,
			 struct kc_slots *slots, struct kc_remote_job *rj)
{
	int slot = 0;
	memset(rj, 0, sizeof(*rj));
	if (!t || !use_store || kc_object_manifest_key(recipe_hash, rj->mkey) != 0)
		return compile_here(slots, &slot);
	rj->active = 1;

	double start = kc_mono_s();
	unsigned delay = 50;
	int waited = 0, saw_holder = 0, watch_tried = 0;
	struct kc_remote_watch *w = NULL;
	for (int looks = 0;; looks++) {
		/* only the first look asks without the index: a waiter's looks read it */
		enum found f = look(t, rj, looks == 0);
		if (f == FOUND_CUBIN) {
			if (w)
				t->b->ops->watch_end(t->b, w);
			atomic_fetch_add(&t->stats->remote_hits, 1);
			return 1;
		}
		if (f != FOUND_NONE)
			break; /* other headers or a fault: compile here */
		/* A lease is taken only with a slot to compile in: a node holding leases it
		 * cannot compile yet would make the other nodes wait on its queue. */
		compile_here(slots, &slot);
		if (!rj->token[0] && new_token(rj) != 0)
			break; /* no token: no cluster single flight */
		enum kc_lease_state state = KC_LEASE_NONE;
		int err = take(t, rj, &state);
		if (err == 0) {
			rj->holder = 1;
			/* the last holder may have published between the look and the take */
			if ((f = look(t, rj, 0)) == FOUND_CUBIN) {
				int e = t->b->ops->lease_release(t->b, rj->mkey, rj->token, 0);
				outcome(t, FAULT_LEASE, e, 0, "release");
				rj->holder = 0;
				if (slots)
					kc_slots_release(slots);
				if (w)
					t->b->ops->watch_end(t->b, w);
				atomic_fetch_add(&t->stats->remote_hits, 1);
				return 1;
			}
			if (saw_holder) /* a holder went without an object: this node takes over */
				atomic_fetch_add(&t->stats->remote_takeovers, 1);
			renewer_start(t, rj);
			break;
		}
		if (err != -EBUSY || state == KC_LEASE_FAILED)
			break; /* a fault, read-only, or the holder's compile failed: compile here */
		if (slots) { /* waiting for another node's compile: let this node's run */
			kc_slots_release(slots);
			slot = 0;
		}
		saw_holder = 1;
		if (!waited) {
			waited = 1;
			atomic_fetch_add(&t->stats->remote_lease_waits, 1);
		}
		if (kc_mono_s() - start >= t->wait_s) {
			atomic_fetch_add(&t->stats->remote_hedged, 1);
			kc_log(KC_LOG_INFO, "cluster store: waited %u s for %.16s; compiling here",
			       t->wait_s, rj->mkey);
			break;
		}
		if (!watch_tried) { /* listen, then look again: no notice is missed */
			watch_tried = 1;
			if (t->b->ops->watch_start &&
			    t->b->ops->watch_start(t->b, rj->mkey, &w) == 0)
				continue;
		}
		if (w ? wait_notice(t, &w, start) : pause_ms(t, delay))
			break;
		delay = delay * 2 > 1000 ? 1000 : delay * 2;
	}
	if (w)
		t->b->ops->watch_end(t->b, w);
	atomic_fetch_add(&t->stats->remote_misses, 1);
	return compile_here(slots, &slot);
}

/* Put kind's object under key; counts and logs. Returns 0 when it is stored (or was). */
static int store_object(struct kc_remote_tier *t, enum kc_object_kind kind, const char *key,
			const char *manifest, size_t mlen, const void *cubin, size_t clen,
			int replace)
{
	char *obj = NULL;
	size_t len = 0;
	if (!store_usable(t) ||
	    kc_object_build(kind, key, manifest, mlen, cubin, clen, &t->secret, &obj, &len) != 0)
		return -EIO;
	int err = replace ? t->b->ops->replace(t->b, key, obj, len)
			  : t->b->ops->put(t->b, key, obj, len);
	outcome(t, FAULT_PUT, err, -EEXIST, kind == KC_OBJECT_INDEX ? "of an index"
					     : kind == KC_OBJECT_HISTORY ? "of a history" : "of an object");
	if (err == 0) {
		atomic_fetch_add(&t->stats->remote_puts, 1);
		atomic_fetch_add(&t->stats->remote_bytes_out, len);
	}
	free(obj);
	return err == -EEXIST ? 0 : err;
}

static size_t count_lines(const char *s, size_t len)
{
	size_t n = 0;
	for (size_t i = 0; i < len; i++)
		n += s[i] == '\n';
	return n;
}

static int put_object(struct kc_remote_tier *t, enum kc_object_kind kind, const char *key,
		      const char *manifest, size_t mlen, const void *cubin, size_t clen)
{
	return store_object(t, kind, key, manifest, mlen, cubin, clen, 0);
}

/* Add the compact manifest line (KC_MANIFEST_LINE_LEN bytes) to the index-kind record
 * under key (an index, or the lists record; what: its name in the log): a new record, or
 * the line first and the record's others after it, the oldest dropped past
 * KC_MANIFEST_PER_KEY (a store without replace keeps its first record). Returns 0 when the
 * record lists it (or cannot be made to), or a fault. */
static int index_add(struct kc_remote_tier *t, const char *key, const char *line,
		     const char *what)
{
	for (int tries = 0; tries < 3; tries++) {
		char *data = NULL, why[200], next[KC_MANIFEST_PER_KEY * KC_MANIFEST_LINE_LEN];
		size_t len = 0, n = KC_MANIFEST_LINE_LEN;
		struct kc_object idx;
		if (!store_usable(t))
			return -EIO;
		char of[80];
		snprintf(of, sizeof(of), "of the %s", what);
		int err = t->b->ops->get(t->b, key, &data, &len);
		outcome(t, FAULT_GET, err, -ENOENT, of);
		if (err == -ENOENT) {
			err = store_object(t, KC_OBJECT_INDEX, key, line, n, NULL, 0, 0);
			if (err == 0 && t->b->ops->replace)
				continue; /* look again: another node's may have come first (EEXIST) */
			return err;
		}
		if (err)
			return err;
		memcpy(next, line, n);
		if (kc_object_parse(data, len, KC_OBJECT_INDEX, key, &t->secret, &idx, why,
				    sizeof(why)) == 0 &&
		    idx.manifest_len % KC_MANIFEST_LINE_LEN == 0) {
			for (size_t off = 0; off < idx.manifest_len; off += KC_MANIFEST_LINE_LEN) {
				if (memcmp(idx.manifest + off, line, KC_SHA256_HEXLEN) == 0) {
					free(data);
					return 0; /* listed already */
				}
				if (n < sizeof(next)) {
					memcpy(next + n, idx.manifest + off, KC_MANIFEST_LINE_LEN);
					n += KC_MANIFEST_LINE_LEN;
				}
			}
		}
		free(data);
		if (!t->b->ops->replace)
			return 0; /* first-come */
		return store_object(t, KC_OBJECT_INDEX, key, next, n, NULL, 0, 1);
	}
	return 0;
}

/* Name the header list lhash (its compact line) first in the cluster's lists record
 * (kc_object_lists_key), unless it is listed there already or is the empty list: nodes
 * that start later check it against their headers before their first fetch
 * (kc_remote_tier_probe). One get per compile shared, and a put when the list is new
 * there. Returns 0 or a fault (counted, logged as any). */
static int announce(struct kc_remote_tier *t, const char *lhash, const char *line)
{
	char key[KC_SHA256_HEXLEN + 1];
	if (!lhash[0] || strcmp(lhash, EMPTY_LIST) == 0)
		return 0;
	return kc_object_lists_key(key) ? -ENOMEM
	       : index_add(t, key, line, "header lists' record");
}

/* What share stored: for its log line and the lists record, which come after the nodes
 * that wait on the key are told (a hint never delays them). */
struct stored {
	int done;                             /* the object and the index are stored */
	char lhash[KC_SHA256_HEXLEN + 1];     /* the header list's digest */
	char line[KC_MANIFEST_COMPACT_MAX];   /* its compact line */
	size_t cubin, headers, list, compact; /* bytes, headers listed, bytes, bytes */
};

/* Share the compiled cubin behind fd: the object, then the index that leads to it; *out
 * says what was stored. */
static void share(struct kc_remote_tier *t, struct kc_remote_job *rj, int fd, const char *deps,
		  size_t deps_len, struct stored *out)
{
	char *manifest = NULL, *cubin = NULL, why[400], okey[KC_SHA256_HEXLEN + 1];
	size_t mlen = 0, clen = 0;
	if (!deps) {
		kc_log(KC_LOG_INFO, "cluster store: %.16s not shared: the dependency pass gave no "
		       "trace", rj->mkey);
		return;
	}
	if (kc_manifest_from_trace(deps, deps_len, KC_COMPILE_CWD, rj->flags, rj->flags_len,
				   rj->since.tv_sec ? &rj->since : NULL, &manifest, &mlen, why,
				   sizeof(why)) != 0) {
		kc_log(KC_LOG_INFO, "cluster store: %.16s not shared: %s", rj->mkey, why);
		return;
	}
	/* the full header list under its own key (put with each compile shared, so a store
	 * that lost it has it again; one copy is kept), then the object and the index that
	 * name it */
	char compact[KC_MANIFEST_COMPACT_MAX], lhash[KC_SHA256_HEXLEN + 1] = "";
	char lkey[KC_SHA256_HEXLEN + 1];
	size_t cml = 0;
	int err = kc_manifest_compact(manifest, mlen, compact, &cml);
	if (!err && kc_manifest_compact_list(compact, cml, lhash) == 1 &&
	    strcmp(lhash, EMPTY_LIST) != 0)
		err = kc_object_list_key(lhash, lkey) ? -ENOMEM
		      : put_object(t, KC_OBJECT_INDEX, lkey, manifest, mlen, NULL, 0);
	int dup = err ? -1 : fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (dup >= 0 && lseek(dup, 0, SEEK_SET) == 0 &&
	    kc_read_all(dup, KC_OBJECT_MAX_CUBIN, &cubin, &clen) == 0 &&
	    kc_object_cubin_key(rj->mkey, compact, cml, okey) == 0) {
		if (put_object(t, KC_OBJECT_CUBIN, okey, compact, cml, cubin, clen) == 0 &&
		    index_add(t, rj->mkey, compact, "index") == 0) {
			*out = (struct stored){.done = 1, .cubin = clen, .list = mlen,
					       .headers = count_lines(manifest, mlen),
					       .compact = cml};
			memcpy(out->lhash, lhash, sizeof(lhash));
			memcpy(out->line, compact, sizeof(compact));
		}
	}
	if (dup >= 0)
		close(dup);
	free(cubin);
	free(manifest);
}

int kc_remote_tier_shares(const struct kc_remote_tier *t, const struct kc_remote_job *rj)
{
	return t && rj->active && !t->read_only;
}

/* Tell the nodes that wait on rj's key that its object is stored or its lease given up:
 * they look again at once, not at their next poll. A fault costs them only that poll. */
static void notify(struct kc_remote_tier *t, struct kc_remote_job *rj)
{
	if (!t->b->ops->notify || !kc_remote_tier_up(t))
		return;
	int err = t->b->ops->notify(t->b, rj->mkey);
	if (err)
		kc_log(KC_LOG_DEBUG, "cluster store: notice of %.16s not sent: %s", rj->mkey,
		       strerror(-err));
}

void kc_remote_tier_finish(struct kc_remote_tier *t, struct kc_remote_job *rj, int ok,
			   int rejected, int cubin_fd, const char *deps, size_t deps_len)
{
	if (!t || !rj->active)
		return;
	renewer_stop(rj);
	/* A daemon that stops does not wait remote_timeout per share on a store that does
	 * not answer (its breaker is open): the lease is left to expire. */
	pthread_mutex_lock(&t->lock);
	int skip = t->stopping && t->breaker_until != 0;
	pthread_mutex_unlock(&t->lock);
	if (skip) {
		kc_log(KC_LOG_WARN, "cluster store: %.16s not shared: the store does not answer "
		       "and the daemon stops; its lease expires", rj->mkey);
		rj->holder = 0;
		kc_remote_job_free(rj);
		return;
	}
	int told = rj->holder || (ok && !t->read_only);
	struct stored st = {0};
	if (ok && !t->read_only)
		share(t, rj, cubin_fd, deps, deps_len, &st);
	if (rj->holder) {
		int err = t->b->ops->lease_release(t->b, rj->mkey, rj->token,
						   rejected ? KC_REMOTE_FAIL_NOTE_MS : 0);
		outcome(t, FAULT_LEASE, err, 0, "release");
		rj->holder = 0;
	}
	if (told)
		notify(t, rj);
	if (st.done) {
		announce(t, st.lhash, st.line); /* a hint: its fault is counted, no more */
		kc_log(KC_LOG_INFO, "cluster store: %.16s stored (%zu bytes; %zu headers listed in "
		       "%zu bytes, %zu bytes of manifest)", rj->mkey, st.cubin, st.headers, st.list,
		       st.compact);
	}
	kc_remote_job_free(rj);
}

void kc_remote_job_move(struct kc_remote_job *dst, struct kc_remote_job *src)
{
	struct renewer *r = src->renewer;
	if (r)
		pthread_mutex_lock(&r->mu); /* renew_tick copies key and token under it */
	*dst = *src;
	if (r) {
		r->key = dst->mkey;
		r->token = dst->token;
		pthread_mutex_unlock(&r->mu);
	}
	memset(src, 0, sizeof(*src));
}

void kc_remote_job_free(struct kc_remote_job *rj)
{
	free(rj->data);
	rj->data = NULL;
}

/* The history-kind record under key (what: its name in the log), verified, into *data /
 * *len (its manifest bytes). Returns kc_remote_tier_history_get's. */
static int history_record(struct kc_remote_tier *t, const char *key, const char *what,
			  char **data, size_t *len)
{
	char *raw = NULL, why[400] = "", of[80];
	size_t rlen = 0;
	struct kc_object obj;
	if (!t || !store_usable(t))
		return -EIO;
	snprintf(of, sizeof(of), "of the %s", what);
	int err = t->b->ops->get(t->b, key, &raw, &rlen);
	outcome(t, FAULT_GET, err, -ENOENT, of);
	if (err)
		return err == -ENOENT ? err : err == -ENOMEM ? err : -EIO;
	atomic_fetch_add(&t->stats->remote_bytes_in, rlen);
	err = kc_object_parse(raw, rlen, KC_OBJECT_HISTORY, key, &t->secret, &obj, why,
			      sizeof(why));
	if (!err && !(*data = malloc(obj.manifest_len + 1)))
		err = -ENOMEM;
	if (!err) {
		memcpy(*data, obj.manifest, obj.manifest_len);
		(*data)[obj.manifest_len] = '\0';
		*len = obj.manifest_len;
	}
	free(raw);
	if (err && err != -ENOMEM) {
		atomic_fetch_add(&t->stats->remote_rejected, 1);
		kc_log(KC_LOG_WARN, "cluster store: %s %.16s refused: %s", what, key, why);
		err = -EBADMSG;
	}
	return err;
}

int kc_remote_tier_history_get(struct kc_remote_tier *t, const char *context, char **data,
			       size_t *len)
{
	char key[KC_SHA256_HEXLEN + 1];
	return kc_object_history_key(context, key) ? -ENOMEM
	       : history_record(t, key, "history", data, len);
}

int kc_remote_tier_histories(struct kc_remote_tier *t, char (*contexts)[KC_SHA256_HEXLEN + 1],
			     size_t max, size_t *n)
{
	char key[KC_SHA256_HEXLEN + 1], *data = NULL;
	size_t len = 0;
	*n = 0;
	if (kc_object_histories_key(key))
		return -ENOMEM;
	int err = history_record(t, key, "histories' record", &data, &len);
	if (err == -ENOENT)
		return 0;
	if (err)
		return err;
	for (size_t off = 0; off + KC_SHA256_HEXLEN < len + 0 && *n < max;
	     off += KC_SHA256_HEXLEN + 1) {
		if (data[off + KC_SHA256_HEXLEN] != '\n' || !kc_hex_lower(data + off, KC_SHA256_HEXLEN))
			break; /* a signed record of another version: what came before stands */
		memcpy(contexts[*n], data + off, KC_SHA256_HEXLEN);
		contexts[(*n)++][KC_SHA256_HEXLEN] = '\0';
	}
	free(data);
	return 0;
}

int kc_remote_tier_history_put(struct kc_remote_tier *t, const char *context, const char *data,
			       size_t len)
{
	char key[KC_SHA256_HEXLEN + 1];
	char list[KC_HISTORIES_PER_KEY][KC_SHA256_HEXLEN + 1];
	char next[KC_HISTORIES_PER_KEY * (KC_SHA256_HEXLEN + 1)];
	size_t n = 0, used = 0;
	if (!t || t->read_only)
		return -EROFS;
	if (kc_object_history_key(context, key))
		return -ENOMEM;
	int err = t->b->ops->replace ? store_object(t, KC_OBJECT_HISTORY, key, data, len, NULL, 0, 1)
				     : -EIO;
	if (err)
		return -EIO;
	/* the contexts' record: this one first, then the others, the oldest dropped */
	if (kc_remote_tier_histories(t, list, KC_HISTORIES_PER_KEY, &n) == -EIO)
		return -EIO;
	if (n > 0 && strcmp(list[0], context) == 0)
		return 0; /* first already */
	used = (size_t)snprintf(next, sizeof(next), "%s\n", context);
	for (size_t i = 0; i < n && used + KC_SHA256_HEXLEN + 1 <= sizeof(next); i++)
		if (strcmp(list[i], context) != 0)
			used += (size_t)snprintf(next + used, sizeof(next) - used, "%s\n", list[i]);
	return kc_object_histories_key(key) ? -ENOMEM
	       : store_object(t, KC_OBJECT_HISTORY, key, next, used, NULL, 0, 1) ? -EIO : 0;
}
