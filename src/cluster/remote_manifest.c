/* remote_manifest.c - see remote_manifest.h */
#define _GNU_SOURCE
#include "remote_manifest.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "flags.h"
#include "hash.h"
#include "tree.h"

static int cmp_path(const void *a, const void *b);

/* Sort p and drop its repeated paths. */
static void paths_unique(struct kc_argv *p)
{
	if (p->n < 2)
		return;
	qsort(p->v, p->n, sizeof(*p->v), cmp_path);
	size_t kept = 1;
	for (size_t i = 1; i < p->n; i++) {
		if (strcmp(p->v[i], p->v[kept - 1]) == 0)
			free(p->v[i]);
		else
			p->v[kept++] = p->v[i];
	}
	for (size_t i = kept; i < p->n; i++)
		p->v[i] = NULL;
	p->n = kept;
}

/* Add path (len bytes) to the list p, at most KC_MANIFEST_MAX_HEADERS distinct paths. A
 * trace lists a path at every lookup (CUB's block_sum under nvcc 13.0: 22,141 lines, 4,326
 * paths; 17,568 of the lines are cc1plus's readlinks of the same headers): a full list is
 * made unique, and refused (-EFBIG) only when that frees less than a quarter of it, so that
 * each path added costs at most a few sorts' share. */
static int paths_add(struct kc_argv *p, const char *path, size_t len)
{
	if (p->n >= KC_MANIFEST_MAX_HEADERS) {
		paths_unique(p);
		if (p->n > KC_MANIFEST_MAX_HEADERS - KC_MANIFEST_MAX_HEADERS / 4)
			return -EFBIG;
	}
	char *copy = strndup(path, len);
	int err = copy ? kc_argv_push(p, copy) : -ENOMEM;
	free(copy);
	return err;
}

static int cmp_path(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Whether path is dir or below it (dir without a trailing slash). */
static int under(const char *path, const char *dir)
{
	size_t n = strlen(dir);
	return n && strncmp(path, dir, n) == 0 && (path[n] == '/' || path[n] == '\0');
}

/* The header hash memo (remote_manifest.h): MEMO_SETS sets of MEMO_WAYS paths, a path's
 * set chosen by its hash; a full set gives up its least recently used path. Direct-mapped
 * (one path a slot), two headers of one list that mapped to one slot put each other out,
 * and both were read and hashed again at every rehash: 2 of the 133 host headers of a
 * nvcc compile on the build machine, about 44 pairs in a 600-header list. */
#define MEMO_WAYS 4
#define MEMO_SETS 1024
struct memo_slot {
	char *path; /* malloc'd; NULL when empty */
	dev_t dev;
	ino_t ino;
	off_t size;
	struct timespec mtim, ctim;
	unsigned long used; /* its set's clock when last found or put */
	char hex[KC_SHA256_HEXLEN + 1];
};
static struct memo_slot memo[MEMO_SETS][MEMO_WAYS];
static unsigned long memo_clock[MEMO_SETS];
/* Held while a header of the sets that map to it is read and hashed: jobs that need the
 * same header at once (a joining node fetches many objects together) read it once, and
 * the others take the memo's hash. Striped, so that a header that hangs (a -I directory
 * on a hung NFS) blocks only the jobs that need a header of its stripe. */
#define HASHING_STRIPES 64
static pthread_mutex_t hashing[HASHING_STRIPES];
/* A set is read and written under the lock of its stripe (not one lock for the memo: the
 * jobs of a joining node look up every listed header per fetch, many at once). */
static pthread_mutex_t memo_mu[HASHING_STRIPES];
static pthread_once_t hashing_once = PTHREAD_ONCE_INIT;

static void hashing_init(void)
{
	for (int i = 0; i < HASHING_STRIPES; i++) {
		pthread_mutex_init(&hashing[i], NULL);
		pthread_mutex_init(&memo_mu[i], NULL);
	}
	/* A path's set is all but random and a slot is 144 bytes, so the first rehash of a
	 * list touched a page of the memo for most of its headers, each a page fault taken
	 * by a joining node's first fetch while every other fetch waited (a 32-kernel join:
	 * 382-405 faults before, 268-292 with the memo written here first). */
	memset(memo, 0, sizeof(memo));
	memset(memo_clock, 0, sizeof(memo_clock));
}

void kc_manifest_memo_init(void)
{
	pthread_once(&hashing_once, hashing_init);
}

static size_t memo_set_of(const char *path)
{
	uint64_t h = 1469598103934665603ull; /* FNV-1a */
	for (const unsigned char *c = (const unsigned char *)path; *c; c++)
		h = (h ^ *c) * 1099511628211ull;
	return (size_t)(h % MEMO_SETS);
}

static int same_time(const struct timespec *a, const struct timespec *b)
{
	return a->tv_sec == b->tv_sec && a->tv_nsec == b->tv_nsec;
}

static int memo_matches(const struct memo_slot *m, const char *path, const struct stat *st)
{
	return m->path && strcmp(m->path, path) == 0 && m->dev == st->st_dev &&
	       m->ino == st->st_ino && m->size == st->st_size && same_time(&m->mtim, &st->st_mtim) &&
	       same_time(&m->ctim, &st->st_ctim);
}

/* The memoized hash of path as st describes it into hex; 1 found, 0 not. */
static int memo_get(const char *path, const struct stat *st, char hex[KC_SHA256_HEXLEN + 1])
{
	size_t set = memo_set_of(path);
	int hit = 0;
	pthread_once(&hashing_once, hashing_init);
	pthread_mutex_lock(&memo_mu[set % HASHING_STRIPES]);
	for (int w = 0; w < MEMO_WAYS && !hit; w++) {
		struct memo_slot *m = &memo[set][w];
		if ((hit = memo_matches(m, path, st))) {
			memcpy(hex, m->hex, KC_SHA256_HEXLEN + 1);
			m->used = ++memo_clock[set];
		}
	}
	pthread_mutex_unlock(&memo_mu[set % HASHING_STRIPES]);
	return hit;
}

/* Remember hex as the hash of path as st describes it (the caller checked with
 * kc_tree_memoizable that those stamps cannot hide a change): in the way that holds path,
 * else an empty one, else the set's least recently used. */
static void memo_put(const char *path, const struct stat *st, const char hex[KC_SHA256_HEXLEN + 1])
{
	char *copy = strdup(path);
	if (!copy)
		return;
	size_t set = memo_set_of(path);
	pthread_once(&hashing_once, hashing_init);
	pthread_mutex_lock(&memo_mu[set % HASHING_STRIPES]);
	struct memo_slot *m = &memo[set][0];
	for (int w = 0; w < MEMO_WAYS; w++) {
		struct memo_slot *s = &memo[set][w];
		if (s->path && strcmp(s->path, path) == 0) {
			m = s;
			break;
		}
		if (m->path && (!s->path || s->used < m->used))
			m = s;
	}
	free(m->path);
	*m = (struct memo_slot){.path = copy, .dev = st->st_dev, .ino = st->st_ino,
				.size = st->st_size, .mtim = st->st_mtim, .ctim = st->st_ctim,
				.used = ++memo_clock[set]};
	memcpy(m->hex, hex, KC_SHA256_HEXLEN + 1);
	pthread_mutex_unlock(&memo_mu[set % HASHING_STRIPES]);
}

/* Whether a header st describes may be hashed (the bytes in all are hash_header's to
 * count): 0, -EACCES or -EFBIG. */
static int admit(const struct stat *st)
{
	if (!S_ISREG(st->st_mode) || !(st->st_mode & S_IROTH))
		return -EACCES;
	if ((uint64_t)st->st_size > KC_MANIFEST_MAX_HEADER)
		return -EFBIG;
	return 0;
}

/* Whether path is under a pseudo filesystem (procfs, sysfs) that a list from the store
 * may not make this daemon look at. Device nodes are no regular files (admit). */
static int pseudo(const char *path)
{
	return under(path, "/proc") || under(path, "/sys");
}

/* The outcome of the file path, open as fd (st: its fstat, admitted), into hex: the
 * SHA-256 of its bytes, with its mtime where they name __TIMESTAMP__ (kc_tree_file_digest)
 * and its mode where it is executable or set-id; memoize it
 * when its stamps may stand for its bytes (kc_tree_memoizable; leased: 1 when the caller
 * holds a read lease on fd, -1 to take one here over the read). Returns 0 or -errno of
 * the read. */
static int hash_open(const char *path, int fd, const struct stat *st,
		     char hex[KC_SHA256_HEXLEN + 1], int leased)
{
	struct timespec changed_before;
	clock_gettime(CLOCK_REALTIME_COARSE, &changed_before);
	if (leased < 0)
		leased = kc_tree_lease(fd);
	int err = kc_tree_file_digest(fd, st, hex, NULL); /* __TIMESTAMP__: its mtime too */
	if (!err && (st->st_mode & 07111)) {
		/* executable, set-id: a search for a program (PATH, access X_OK) finds it or not
		 * by its mode, as it finds its bytes */
		char text[KC_SHA256_HEXLEN + 32];
		int len = snprintf(text, sizeof(text), "%s mode %04o", hex,
				   (unsigned)(st->st_mode & 07111));
		err = kc_sha256_buf(text, (size_t)len, hex) ? -ENOMEM : 0;
	}
	if (!err && kc_tree_memoizable(fd, st, &changed_before, leased))
		memo_put(path, st, hex);
	return err;
}

static int cmp_dirent(const struct dirent **a, const struct dirent **b)
{
	return strcmp((*a)->d_name, (*b)->d_name);
}

/* The digest of the names in directory dir (a trace's "d" line: a tool read it whole) into
 * hex: SHA-256 over each name and its type ('d' directory, 'l' link, 'f' anything else), in
 * byte order. Returns 0 or -errno. */
static int listing_digest(const char *dir, char hex[KC_SHA256_HEXLEN + 1])
{
	struct dirent **names = NULL;
	int n = scandir(dir, &names, NULL, cmp_dirent);
	if (n < 0 && (errno == ENOENT || errno == ENOTDIR)) {
		memcpy(hex, KC_MANIFEST_ABSENT, KC_SHA256_HEXLEN + 1);
		return 0;
	}
	if (n < 0)
		return -errno;
	char *text = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&text, &len);
	for (int i = 0; i < n; i++) {
		const char *name = names[i]->d_name;
		unsigned char t = names[i]->d_type;
		if (f && strcmp(name, ".") != 0 && strcmp(name, "..") != 0)
			fprintf(f, "%c %s\n", t == DT_DIR ? 'd' : t == DT_LNK ? 'l' : 'f', name);
		free(names[i]);
	}
	free(names);
	int err = !f || fclose(f) != 0 ? -ENOMEM : kc_sha256_buf(text, len, hex) ? -ENOMEM : 0;
	free(text);
	return err;
}

/* The outcome of a readlink of path (a trace's "l" line, listed as ">path") into hex: the
 * SHA-256 of "link:" and the link's target, KC_MANIFEST_NOT_LINK, or KC_MANIFEST_ABSENT.
 * Returns 0 or -errno with why filled. */
static int link_outcome(const char *path, char hex[KC_SHA256_HEXLEN + 1], char *why,
			size_t whylen)
{
	char target[PATH_MAX + 5] = "link:";
	struct stat st;
	if (path[0] != '/' || pseudo(path)) {
		snprintf(why, whylen, "link %.200s: not a path to look up", path);
		return -EACCES;
	}
	if (lstat(path, &st) != 0) {
		if (errno != ENOENT && errno != ENOTDIR) {
			int err = -errno;
			snprintf(why, whylen, "link %.200s: %s", path, strerror(errno));
			return err;
		}
		memcpy(hex, KC_MANIFEST_ABSENT, KC_SHA256_HEXLEN + 1);
		return 0;
	}
	if (!S_ISLNK(st.st_mode)) {
		memcpy(hex, KC_MANIFEST_NOT_LINK, KC_SHA256_HEXLEN + 1);
		return 0;
	}
	ssize_t n = readlink(path, target + 5, PATH_MAX - 1);
	if (n < 0) {
		int err = -errno;
		snprintf(why, whylen, "link %.200s: %s", path, strerror(errno));
		return err;
	}
	return kc_sha256_buf(target, (size_t)n + 5, hex) ? -ENOMEM : 0;
}

/* Hash one header as remote_manifest.h says, adding its size to *total (__atomic: the
 * threads of a spread rehash share one) before it is read: its stat's size, then its
 * size on the descriptor, so that the reads stay within KC_MANIFEST_MAX_TOTAL (but for a
 * header growing while it is read). A memoized one is only stat'ed; any other is opened,
 * checked again on its descriptor and read. Returns 0 or -errno with why filled. */
static int hash_header(const char *path, char hex[KC_SHA256_HEXLEN + 1], uint64_t *total,
		       char *why, size_t whylen)
{
	struct stat st;
	int fd = -1;
	if (path[0] == '>')
		return link_outcome(path + 1, hex, why, whylen);
	if (path[0] == '+' && path[1] == '/' && !pseudo(path + 1)) {
		int err = listing_digest(path + 1, hex);
		if (err)
			snprintf(why, whylen, "directory %s: %s", path + 1, strerror(-err));
		return err;
	}
	int err = pseudo(path) ? -EACCES : stat(path, &st) != 0 ? -errno : 0;
	if (err == -ENOENT || err == -ENOTDIR || (!err && S_ISDIR(st.st_mode))) {
		/* a lookup that found nothing, or a directory: the outcome is the evidence */
		memcpy(hex, err ? KC_MANIFEST_ABSENT : KC_MANIFEST_DIRECTORY, KC_SHA256_HEXLEN + 1);
		return 0;
	}
	if (!err)
		err = admit(&st);
	uint64_t counted = err ? 0 : (uint64_t)st.st_size; /* what *total holds of it */
	if (!err && __atomic_add_fetch(total, counted, __ATOMIC_RELAXED) > KC_MANIFEST_MAX_TOTAL)
		err = -EFBIG;
	if (!err && !memo_get(path, &st, hex)) {
		pthread_mutex_t *stripe = &hashing[memo_set_of(path) % HASHING_STRIPES];
		pthread_once(&hashing_once, hashing_init);
		pthread_mutex_lock(stripe);
		if (!memo_get(path, &st, hex)) { /* nobody hashed it meanwhile */
			fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
			err = fd < 0 ? -errno : fstat(fd, &st) != 0 ? -errno : admit(&st);
			if (!err) { /* changed since the stat: counted at its size now (the
				     * difference wraps for a shrink); grown past the cap, refused */
				uint64_t now = __atomic_add_fetch(total, (uint64_t)st.st_size - counted,
								  __ATOMIC_RELAXED);
				if ((uint64_t)st.st_size > counted && now > KC_MANIFEST_MAX_TOTAL)
					err = -EFBIG;
			}
			if (!err)
				err = hash_open(path, fd, &st, hex, -1);
			if (fd >= 0)
				close(fd);
		}
		pthread_mutex_unlock(stripe);
	}
	if (err)
		snprintf(why, whylen, "header %s: %s", path,
			 err == -EACCES ? "not a regular file readable by all" : strerror(-err));
	return err;
}

int kc_manifest_memo_fill(const char *path, int fd)
{
	struct stat st;
	char hex[KC_SHA256_HEXLEN + 1];
	if (pseudo(path) || fstat(fd, &st) != 0 || admit(&st) != 0 || memo_get(path, &st, hex))
		return 0;
	return hash_open(path, fd, &st, hex, 1);
}

/* The headers of one spread rehash (build), taken in turn by its threads. */
struct spread {
	char **paths; /* sorted */
	size_t n;
	size_t next;    /* the next path to take (__atomic) */
	uint64_t total; /* bytes of the headers taken so far (hash_header's) */
	char (*hex)[KC_SHA256_HEXLEN + 1]; /* each header's digest */
	int *err;                         /* each header's error, or 0 */
	char **why;                       /* each failed header's reason (malloc'd) */
	int failed; /* a header failed (__atomic): no more are taken. Paths are taken in
		     * order and each taken one is hashed, so every one before it is (build
		     * stops at the first error) */
};

static void *spread_some(void *arg)
{
	struct spread *f = arg;
	char why[400];
	for (;;) {
		if (__atomic_load_n(&f->failed, __ATOMIC_RELAXED))
			return NULL; /* before taking one: every path taken is hashed */
		size_t i = __atomic_fetch_add(&f->next, 1, __ATOMIC_RELAXED);
		if (i >= f->n)
			return NULL;
		if (i && strcmp(f->paths[i], f->paths[i - 1]) == 0)
			continue; /* a duplicate: build skips it */
		f->err[i] = hash_header(f->paths[i], f->hex[i], &f->total, why, sizeof(why));
		if (f->err[i]) {
			f->why[i] = strdup(why);
			__atomic_store_n(&f->failed, 1, __ATOMIC_RELAXED);
		}
	}
}

static unsigned long spread_threads; /* helpers started so far (__atomic) */

unsigned long kc_manifest_spread_threads(void)
{
	return __atomic_load_n(&spread_threads, __ATOMIC_RELAXED);
}

/* Helper threads worth starting for n headers: one per KC_MANIFEST_SPREAD_PER_THREAD, at
 * most KC_MANIFEST_SPREAD_THREADS and the CPUs this process may run on (a cpuset, taskset;
 * not the machine's) less one. */
static size_t spread_helpers(size_t n)
{
	cpu_set_t set;
	long cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set)
								 : sysconf(_SC_NPROCESSORS_ONLN);
	size_t helpers = n / KC_MANIFEST_SPREAD_PER_THREAD;
	if (helpers > KC_MANIFEST_SPREAD_THREADS)
		helpers = KC_MANIFEST_SPREAD_THREADS;
	if (cpus > 0 && helpers > (size_t)cpus - 1)
		helpers = (size_t)cpus - 1;
	return helpers;
}

/* Hash the n sorted paths of f on helper threads (spread_helpers' count, those that can
 * be had) and this one, each header once. Returns 0 or -ENOMEM (nothing hashed). */
static int spread_run(struct spread *f, char **paths, size_t n, size_t helpers)
{
	pthread_t th[KC_MANIFEST_SPREAD_THREADS];
	size_t started = 0;
	*f = (struct spread){.paths = paths, .n = n, .hex = calloc(n, sizeof(*f->hex)),
			     .err = calloc(n, sizeof(*f->err)), .why = calloc(n, sizeof(*f->why))};
	if (!f->hex || !f->err || !f->why)
		return -ENOMEM;
	pthread_once(&hashing_once, hashing_init);
	for (; started < helpers; started++)
		if (pthread_create(&th[started], NULL, spread_some, f) != 0)
			break;
	__atomic_add_fetch(&spread_threads, started, __ATOMIC_RELAXED);
	spread_some(f);
	for (size_t i = 0; i < started; i++)
		pthread_join(th[i], NULL);
	return 0;
}

static void spread_free(struct spread *f)
{
	for (size_t i = 0; f->why && i < f->n; i++)
		free(f->why[i]);
	free(f->hex);
	free(f->err);
	free(f->why);
}

/* Unless err (the result of listing the paths p): sort and deduplicate them, hash each
 * (with spread, on helper threads: spread_run), and write the manifest. Frees p; returns
 * err or the result. */
static int build(int err, struct kc_argv *p, int spread, char **manifest, size_t *mlen,
		 char *why, size_t whylen)
{
	char *out = NULL;
	size_t len = 0;
	FILE *f = NULL;

	if (err == -EFBIG)
		snprintf(why, whylen, "more than %d distinct headers",
			 KC_MANIFEST_MAX_HEADERS - KC_MANIFEST_MAX_HEADERS / 4);
	if (err) {
		kc_argv_free(p);
		return err;
	}
	if (p->n)
		qsort(p->v, p->n, sizeof(*p->v), cmp_path);
	struct spread sp = {0};
	size_t helpers = spread ? spread_helpers(p->n) : 0; /* none: as on one thread */
	if ((helpers && spread_run(&sp, p->v, p->n, helpers) != 0) ||
	    !(f = open_memstream(&out, &len))) {
		spread_free(&sp);
		kc_argv_free(p);
		return -ENOMEM;
	}
	uint64_t total = 0;
	for (size_t i = 0; i < p->n && !err; i++) {
		char hex[KC_SHA256_HEXLEN + 1];
		if (i && strcmp(p->v[i], p->v[i - 1]) == 0)
			continue;
		if (!helpers)
			err = hash_header(p->v[i], hex, &total, why, whylen);
		else if ((err = sp.err[i])) /* the first in the list's order, as one thread says */
			snprintf(why, whylen, "%s", sp.why[i] ? sp.why[i] : strerror(-err));
		else
			memcpy(hex, sp.hex[i], sizeof(hex));
		if (!err)
			fprintf(f, "%s %s\n", hex, p->v[i]);
	}
	if (fclose(f) != 0 && !err)
		err = -ENOMEM;
	spread_free(&sp);
	kc_argv_free(p);
	if (err) {
		free(out);
		return err;
	}
	*manifest = out;
	*mlen = len;
	return 0;
}

/* Whether path (absolute) names a component "..". */
static int has_dotdot(const char *path)
{
	for (const char *p = strstr(path, "/.."); p; p = strstr(p + 1, "/.."))
		if (p[3] == '/' || p[3] == '\0')
			return 1;
	return 0;
}

/* Whether the lookup of path, under root as the words go, stays in the tree whose bytes
 * the recipe's key holds (tree.h: every file below root, symlinks followed). A path that
 * climbs out with ".." through a symbolic link leaves it: the directory part is then
 * resolved, and must lie below the resolved root; one whose directory part cannot be
 * resolved (missing, a dangling link, which the tree's digest does not show) is listed. */
static int in_root(const char *path, const char *root)
{
	if (!under(path, root))
		return 0;
	if (!has_dotdot(path))
		return 1;
	char dir[PATH_MAX], rdir[PATH_MAX], rroot[PATH_MAX];
	snprintf(dir, sizeof(dir), "%s", path);
	char *slash = strrchr(dir, '/');
	if (slash && slash != dir)
		*slash = '\0';
	if (!realpath(dir, rdir))
		return 0; /* a missing or dangling part: listed, its lookup is evidence */
	return realpath(root, rroot) && under(rdir, rroot);
}

/* How a traced path under /proc, /sys or /dev counts: 0 an ordinary path (listed with its
 * outcome: /dev/shm's files), 1 left out (the state of the kernel or of the process, a
 * device that gives no file's bytes, the scratch as /proc/self/cwd names it, a link's name
 * in /proc), -1 a way to any file that the list cannot show (/proc/PID/root, a
 * descriptor's file: /proc/PID/fd, /dev/fd, /dev/stdin). */
static int special(char kind, const char *path)
{
	static const char *const quiet[] = {"/dev/null", "/dev/zero", "/dev/full", "/dev/random",
					    "/dev/urandom", "/dev/tty", NULL};
	for (int i = 0; quiet[i]; i++)
		if (strcmp(path, quiet[i]) == 0)
			return 1;
	if (under(path, "/dev/fd") || under(path, "/dev/stdin") || under(path, "/dev/stdout") ||
	    under(path, "/dev/stderr"))
		return kind == 'o' || kind == 'x' ? -1 : 1;
	if (under(path, "/sys"))
		return 1;
	if (!under(path, "/proc"))
		return 0;
	if (kind == 'l' || kind == 's' || kind == 'd')
		return 1; /* names, not bytes: /proc/self/fd listed to close descriptors */
	/* /proc/<pid|self|thread-self>[/task/<tid>]/<what>...: root, fd and map_files reach
	 * any file; cwd is the scratch the tools run in, exe a tool listed by its exec, the
	 * rest the process's state, as /proc/<anything else> is the kernel's */
	char comp[4][16] = {"", "", "", ""};
	const char *c = path + 5;
	for (int i = 0; i < 4 && *c == '/'; i++) {
		size_t n = strcspn(c + 1, "/");
		snprintf(comp[i], sizeof(comp[i]), "%.*s", (int)(n < 15 ? n : 15), c + 1);
		c += 1 + n;
	}
	int process = strspn(comp[0], "0123456789") == strlen(comp[0]) && comp[0][0];
	if (!process && strcmp(comp[0], "self") != 0 && strcmp(comp[0], "thread-self") != 0)
		return 1;
	const char *what = strcmp(comp[1], "task") == 0 ? comp[3] : comp[1];
	if (strcmp(what, "cwd") == 0 && has_dotdot(path))
		return -1; /* out of the scratch */
	if (strcmp(what, "root") == 0 || strcmp(what, "fd") == 0 || strcmp(what, "map_files") == 0)
		return -1;
	return 1;
}

/* Add one path of the trace to p unless it is left out. */
static int add_traced(struct kc_argv *p, char kind, const char *path, size_t pl,
		      const char *skip_dir, const struct kc_argv *roots, char *why,
		      size_t whylen)
{
	if (path[0] != '/') {
		snprintf(why, whylen, "traced path %.200s is relative", path);
		return -EINVAL;
	}
	int sp = special(kind, path);
	if (sp < 0) {
		snprintf(why, whylen, "the compile read %.200s, a way to a file whose bytes the "
			 "list cannot show", path);
		return -EACCES;
	}
	if (sp || (skip_dir && under(path, skip_dir) && !has_dotdot(path)))
		return 0;
	for (size_t i = 0; i < roots->n; i++)
		if (in_root(path, roots->v[i]))
			return 0; /* its bytes are in the recipe's key (key.h) */
	if (kind == 'l') { /* ">path": the link's target is the outcome */
		char listed[PATH_MAX + 2];
		if (pl + 2 > sizeof(listed))
			return 0;
		snprintf(listed, sizeof(listed), ">%s", path);
		return paths_add(p, listed, pl + 1);
	}
	if (kind != 'd')
		return paths_add(p, path, pl);
	char listed[PATH_MAX + 2]; /* a directory read whole: "+dir" stands for its names */
	if (pl + 2 > sizeof(listed))
		return 0;
	snprintf(listed, sizeof(listed), "+%s", path);
	return paths_add(p, listed, pl + 1);
}

/* Whether a listed path (manifest line ml bytes: "<outcome> <path>") changed at or after
 * since: a file found (its ctime, through symlinks) or a link read (its own). A path that
 * found nothing or a directory is not looked at (a file made since is found, so listed as
 * a file). Returns 0 or -ESTALE with why filled. */
static int changed_since(const char *ml, size_t len, const struct timespec *since, char *why,
			 size_t whylen)
{
	char path[PATH_MAX];
	struct stat st;
	if (len <= KC_SHA256_HEXLEN + 1 || len - KC_SHA256_HEXLEN - 1 >= sizeof(path) ||
	    memcmp(ml, KC_MANIFEST_ABSENT, KC_SHA256_HEXLEN) == 0 ||
	    memcmp(ml, KC_MANIFEST_DIRECTORY, KC_SHA256_HEXLEN) == 0)
		return 0;
	memcpy(path, ml + KC_SHA256_HEXLEN + 1, len - KC_SHA256_HEXLEN - 1);
	path[len - KC_SHA256_HEXLEN - 1] = '\0';
	if (path[0] == '+')
		return 0; /* a directory's names */
	int link = path[0] == '>';
	if ((link ? lstat(path + 1, &st) : stat(path, &st)) != 0)
		return 0; /* gone: its outcome now differs from the list's, a miss everywhere */
	if (st.st_ctim.tv_sec > since->tv_sec ||
	    (st.st_ctim.tv_sec == since->tv_sec && st.st_ctim.tv_nsec >= since->tv_nsec)) {
		snprintf(why, whylen, "%.200s changed while the compile ran: the pass may have read "
			 "other bytes than the compile", path + link);
		return -ESTALE;
	}
	return 0;
}

int kc_manifest_from_trace(const char *trace, size_t len, const char *skip_dir,
			   const char *flags, size_t flags_len, const struct timespec *since,
			   char **manifest, size_t *mlen, char *why, size_t whylen)
{
	struct kc_argv p = {0}, roots = {0};
	char path[PATH_MAX];
	int err = kc_tree_roots(flags, flags_len, &roots);
	for (size_t off = 0; off < len && !err;) {
		const char *line = trace + off, *nl = memchr(line, '\n', len - off);
		size_t ll = nl ? (size_t)(nl - line) : len - off;
		off += ll + 1;
		if (ll < 3 || line[1] != ' ' || !strchr("osxdl", line[0]) || ll - 2 >= sizeof(path)) {
			snprintf(why, whylen, "malformed trace line %zu bytes into the trace",
				 off - ll - 1);
			err = -EINVAL;
			break;
		}
		memcpy(path, line + 2, ll - 2);
		path[ll - 2] = '\0';
		err = add_traced(&p, line[0], path, ll - 2, skip_dir, &roots, why, whylen);
	}
	kc_argv_free(&roots);
	if ((err = build(err, &p, 0, manifest, mlen, why, whylen)) != 0)
		return err;
	for (size_t off = 0; !err && since && off < *mlen;) {
		const char *line = *manifest + off, *nl = memchr(line, '\n', *mlen - off);
		size_t ll = nl ? (size_t)(nl - line) : *mlen - off;
		off += ll + 1;
		err = changed_since(line, ll, since, why, whylen);
	}
	if (err) {
		free(*manifest);
		*manifest = NULL;
		*mlen = 0;
	}
	return err;
}

/* The paths of the header list index/len into p. Returns 0; -EINVAL with why filled (a
 * malformed line); -EFBIG (too many); -ENOMEM. */
static int list_paths(const char *index, size_t len, struct kc_argv *p, char *why,
		      size_t whylen)
{
	int err = 0;
	for (size_t off = 0; off < len && !err;) {
		const char *nl = memchr(index + off, '\n', len - off);
		size_t ll = nl ? (size_t)(nl - (index + off)) : len - off;
		if (ll <= KC_SHA256_HEXLEN + 1) {
			snprintf(why, whylen, "malformed manifest line");
			return -EINVAL;
		}
		err = paths_add(p, index + off + KC_SHA256_HEXLEN + 1, ll - KC_SHA256_HEXLEN - 1);
		off += ll + 1;
	}
	return err;
}

/* kc_manifest_rehash and kc_manifest_rehash_spread, spread or not. */
static int rehash_list(const char *index, size_t len, int spread, char **manifest,
		       size_t *mlen, char *why, size_t whylen)
{
	struct kc_argv p = {0};
	int err = list_paths(index, len, &p, why, whylen);
	return build(err, &p, spread, manifest, mlen, why, whylen);
}

int kc_manifest_rehash(const char *index, size_t len, char **manifest, size_t *mlen,
		       char *why, size_t whylen)
{
	return rehash_list(index, len, 0, manifest, mlen, why, whylen);
}

int kc_manifest_rehash_spread(const char *index, size_t len, char **manifest, size_t *mlen,
			      char *why, size_t whylen)
{
	return rehash_list(index, len, 1, manifest, mlen, why, whylen);
}

int kc_manifest_compact(const char *full, size_t len, char out[KC_MANIFEST_COMPACT_MAX],
			size_t *outlen)
{
	char hex[KC_SHA256_HEXLEN + 1];
	if (kc_sha256_buf(full ? full : "", len, hex) != 0)
		return -ENOMEM;
	*outlen = (size_t)snprintf(out, KC_MANIFEST_COMPACT_MAX, "%s %s\n", hex,
				   KC_MANIFEST_LIST_NAME);
	return 0;
}

int kc_manifest_compact_list(const char *compact, size_t len, char hex[KC_SHA256_HEXLEN + 1])
{
	size_t nl = strlen(KC_MANIFEST_LIST_NAME);
	if (!len)
		return 0;
	if (len != KC_SHA256_HEXLEN + 2 + nl || compact[KC_SHA256_HEXLEN] != ' ' ||
	    memcmp(compact + KC_SHA256_HEXLEN + 1, KC_MANIFEST_LIST_NAME, nl) != 0 ||
	    compact[len - 1] != '\n')
		return -EBADMSG;
	memcpy(hex, compact, KC_SHA256_HEXLEN);
	hex[KC_SHA256_HEXLEN] = '\0';
	return 1;
}
