/* test_inode.c - the node ids of the inode table (fs/inode.h): fixed ids for the root and
 * the virtual inodes, generation-tagged slots for the rest, stale ids known as such after
 * a forget, and lookup counts kept. On a temporary backing directory, without a mount. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "inode.h"
#include "ledger.h"
#include "tap.h"

/* A new O_PATH fd and stat of dir/name (created as a file). */
static int object(int dir, const char *name, struct stat *st)
{
	close(openat(dir, name, O_CREAT | O_WRONLY | O_CLOEXEC, 0644));
	int fd = openat(dir, name, O_PATH | O_CLOEXEC);
	fstat(fd, st);
	return fd;
}

/* Whether this process may call open_by_handle_at: CAP_DAC_READ_SEARCH (bit 2) in its
 * effective set. */
static int has_dac_read_search(void)
{
	char line[256];
	unsigned long long eff = 0;
	FILE *f = fopen("/proc/self/status", "re");
	while (f && fgets(line, sizeof(line), f))
		if (sscanf(line, "CapEff: %llx", &eff) == 1)
			break;
	if (f)
		fclose(f);
	return (int)(eff >> 2 & 1);
}

/* The inode ledger (fs/life/ledger.h): a table that records into a memfd, then a table of
 * a later epoch that restores from it, as a daemon started again after a crash does. */
static void ledger_checks(int root)
{
	int mfd = memfd_create("kc-ledger-test", MFD_CLOEXEC);
	struct kc_inode_table v, w;
	struct kc_ledger l1, l2, l3;
	CHECK(kc_inode_table_init(&v, root) == 0 && kc_ledger_open(&l1, dup(mfd), root) == 0,
	      "a table with a ledger");
	v.epoch = 2;
	kc_ledger_attach(&l1, &v);
	struct stat se, sf, sg, sh;
	int err = 0;
	mkdirat(root, "e", 0755);
	int efd = openat(root, "e", O_PATH | O_CLOEXEC);
	fstat(efd, &se);
	struct kc_inode *ie = kc_inode_ref(&v, efd, &se, &err);
	struct kc_inode *ifl = kc_inode_ref(&v, object(root, "f", &sf), &sf, &err);
	struct kc_inode *ig = kc_inode_ref(&v, object(root, "g", &sg), &sg, &err);
	struct kc_inode *ih = kc_inode_ref(&v, object(root, "h", &sh), &sh, &err);
	kc_inode_place(&v, ie, &v.root, "e", 0);
	kc_inode_place(&v, ifl, &v.root, "f", 0);
	kc_inode_place(&v, ig, &v.root, "g", 1); /* a stage temporary: not recorded */
	kc_inode_place(&v, ih, &v.root, "h", 0);
	kc_inode_ref(&v, object(root, "f", &sf), &sf, &err); /* f: two references */
	fuse_ino_t ide = kc_inode_ino(&v, ie), idf = kc_inode_ino(&v, ifl);
	fuse_ino_t idg = kc_inode_ino(&v, ig), idh = kc_inode_ino(&v, ih);
	unlinkat(root, "h", 0); /* gone before the restart: not restored */

	/* The daemon dies (v is left as it was); another starts in epoch 3. */
	CHECK(kc_inode_table_init(&w, root) == 0 && kc_ledger_open(&l2, dup(mfd), root) == 0,
	      "the restarted daemon's table and ledger");
	w.epoch = 3;
	long n = kc_ledger_restore(&l2, &w);
	if (n != 2)
		fprintf(stderr, "# restored %ld\n", n);
	CHECK(n == 2, "2 inodes restored (the directory and the plain file)");
	struct kc_inode *re = kc_inode_get(&w, ide), *rf = kc_inode_get(&w, idf);
	CHECK(re && re->dev == se.st_dev && re->ino == se.st_ino && re->type == S_IFDIR,
	      "the dead daemon's id of a directory names it again");
	CHECK(rf && rf->ino == sf.st_ino && rf->nlookup == 2, "a file's id, with its lookup count");
	CHECK(kc_inode_get(&w, idg) == NULL && kc_inode_get(&w, idh) == NULL,
	      "a stage temporary and a file gone before the restart: stale (ESTALE)");
	size_t got = 0, need = 0;
	struct kc_inode **cand = kc_inode_to_forget(&w, 0, &got, &need);
	int offered = 0;
	for (size_t i = 0; cand && i < got; i++) {
		offered += cand[i] == rf;
		kc_inode_forget(&w, cand[i], 1);
	}
	free(cand);
	CHECK(offered == 1 && need >= 1, "a restored file is offered to the inode bound's relief "
	      "(not taken as asked already)");
	kc_ledger_attach(&l2, &w);
	struct stat si;
	struct kc_inode *ii = kc_inode_ref(&w, object(root, "i", &si), &si, &err);
	fuse_ino_t idi = ii ? kc_inode_ino(&w, ii) : 0;
	CHECK(ii && idi != ide && idi != idf && idi != idg && idi != idh,
	      "a new inode gets an id none of the dead daemon's");
	struct kc_inode *again = kc_inode_ref(&w, object(root, "f", &sf), &sf, &err);
	CHECK(again == rf && kc_inode_ino(&w, again) == idf && rf->nlookup == 3,
	      "a lookup of the restored file's name answers its old id");
	kc_inode_forget(&w, rf, 3);
	CHECK(kc_inode_get(&w, idf) == NULL, "forgotten by the kernel: gone, its record too");

	/* A second restart restores what the ledger holds now: the directory, not the file. */
	struct kc_inode_table x;
	CHECK(kc_inode_table_init(&x, root) == 0 && kc_ledger_open(&l3, dup(mfd), root) == 0,
	      "a second restart");
	x.epoch = 4;
	n = kc_ledger_restore(&l3, &x);
	CHECK(n == 1 && kc_inode_get(&x, ide) && !kc_inode_get(&x, idf),
	      "the second restart restores the directory only");
	kc_ledger_close(&l3);
	kc_inode_table_destroy(&x);

	/* A ledger made under another backing directory restores nothing there. */
	char other[] = "/tmp/kc-inode-other-XXXXXX";
	int oroot = mkdtemp(other) ? open(other, O_PATH | O_DIRECTORY | O_CLOEXEC) : -1;
	CHECK(oroot >= 0 && kc_inode_table_init(&x, oroot) == 0 &&
	      kc_ledger_open(&l3, dup(mfd), oroot) == 0, "a restart on another backing directory");
	CHECK(kc_ledger_restore(&l3, &x) == 0 && !kc_inode_get(&x, ide),
	      "nothing restored from another backing directory's ledger");
	kc_ledger_close(&l3);
	kc_inode_table_destroy(&x);
	if (oroot >= 0)
		close(oroot);
	rmdir(other);

	/* A ledger of another build (its header not this one's) restores nothing: first a
	 * record again (the ledger was reset by the check above), restored once to show it is
	 * there, then the header spoiled. */
	struct kc_inode_table y;
	struct kc_ledger l4;
	CHECK(kc_inode_table_init(&y, root) == 0 && kc_ledger_open(&l4, dup(mfd), root) == 0,
	      "a table recording again");
	y.epoch = 5;
	kc_ledger_attach(&l4, &y);
	efd = openat(root, "e", O_PATH | O_CLOEXEC);
	struct kc_inode *ye = kc_inode_ref(&y, efd, &se, &err);
	kc_inode_place(&y, ye, &y.root, "e", 0);
	fuse_ino_t yid = kc_inode_ino(&y, ye);
	CHECK(kc_inode_table_init(&x, root) == 0 && kc_ledger_open(&l3, dup(mfd), root) == 0 &&
	      kc_ledger_restore(&l3, &x) == 1 && kc_inode_get(&x, yid), "its record restores");
	kc_ledger_close(&l3);
	kc_inode_table_destroy(&x);
	unsigned char junk[16];
	memset(junk, 0xff, sizeof(junk));
	CHECK(pwrite(mfd, junk, sizeof(junk), KC_LEDGER_AT) == (ssize_t)sizeof(junk), "header spoiled");
	CHECK(kc_inode_table_init(&x, root) == 0 && kc_ledger_open(&l3, dup(mfd), root) == 0,
	      "a restart on another build's ledger");
	CHECK(kc_ledger_restore(&l3, &x) == 0 && !kc_inode_get(&x, yid), "nothing restored from it");
	kc_ledger_close(&l3);
	kc_inode_table_destroy(&x);
	y.journal = NULL;
	kc_ledger_close(&l4);
	kc_inode_table_destroy(&y);

	w.journal = NULL;
	kc_ledger_close(&l2);
	kc_inode_table_destroy(&w);
	v.journal = NULL;
	kc_ledger_close(&l1);
	kc_inode_table_destroy(&v);
	close(mfd);
	for (const char *n2 = "fgi"; *n2; n2++) {
		char name[2] = {*n2, 0};
		unlinkat(root, name, 0);
	}
	unlinkat(root, "e", AT_REMOVEDIR);
}

/* An O_PATH fd and stat of entry/name, a new file of bytes (replacing any: a recompile). */
static int entry_file(int root, const char *entry, const char *name, const char *bytes,
		      struct stat *st)
{
	char path[256], tmp[256];
	snprintf(path, sizeof(path), "%s/%s", entry, name);
	snprintf(tmp, sizeof(tmp), "%s/.new", entry);
	int w = openat(root, tmp, O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
	if (w >= 0) {
		if (write(w, bytes, strlen(bytes)) < 0)
			perror("write");
		close(w);
	}
	renameat(root, tmp, root, path);
	int fd = openat(root, path, O_PATH | O_CLOEXEC);
	fstat(fd, st);
	return fd;
}

/* A new O_PATH fd of entry/name. */
static int entry_file_fd(int root, const char *entry, const char *name)
{
	char path[256];
	snprintf(path, sizeof(path), "%s/%s", entry, name);
	return openat(root, path, O_PATH | O_CLOEXEC);
}

/* The inode of directory entry in root, looked up and placed. */
static struct kc_inode *entry_dir(struct kc_inode_table *t, int root, const char *entry,
				  struct stat *st)
{
	int err = 0;
	mkdirat(root, entry, 0755);
	int fd = openat(root, entry, O_PATH | O_CLOEXEC);
	fstat(fd, st);
	struct kc_inode *in = kc_inode_ref(t, fd, st, &err);
	if (in)
		kc_inode_place(t, in, &t->root, entry, 0);
	return in;
}

/* Files of kernel entries. A pending cubin that became published is what a later lookup of
 * that cubin answers (one kernel inode, one set of locks); with a ledger, it and the
 * published cubins and staged files the kernel holds are restored after a crash, each as a
 * lookup made it, while its entry's name still names the same object. */
static void entry_file_checks(int root, int with_ledger)
{
	static const char *E1 = "kernel.k.0123456789abcdef", *E2 = "kernel.j.0123456789abcdef",
			  *E3 = "kernel.i.0123456789abcdef";
	int mfd = with_ledger ? memfd_create("kc-ledger-cubins", MFD_CLOEXEC) : -1;
	struct kc_inode_table v;
	struct kc_ledger l1 = {.fd = -1}, l2 = {.fd = -1};
	CHECK(kc_inode_table_init(&v, root) == 0, "a table for entry files");
	v.epoch = 6;
	if (with_ledger) {
		CHECK(kc_ledger_open(&l1, dup(mfd), root) == 0, "with a ledger");
		kc_ledger_attach(&l1, &v);
	}
	int err = 0;
	struct stat s1, s2, s3, sc1, sc2, sc3, ss, sx;
	struct kc_inode *e1 = entry_dir(&v, root, E1, &s1), *e2 = entry_dir(&v, root, E2, &s2);
	struct kc_inode *e3 = entry_dir(&v, root, E3, &s3);
	CHECK(e1 && e1->entry && e2 && e2->entry && e3 && e3->entry, "three entry directories");

	/* E1: looked up while it compiled (pending), then published. */
	struct kc_inode *p1 = kc_inode_ref_pending(&v, e1->fd, &s1, 42, &err);
	int c1 = entry_file(root, E1, "kernel.cubin", "cubin one", &sc1);
	CHECK(p1 && p1->pending && p1->cubin_fd < 0 && kc_inode_published(&v, p1, c1) == 0 &&
	      p1->cubin_fd == c1 && p1->cubin_ino == sc1.st_ino, "the pending cubin is published");
	int again = entry_file_fd(root, E1, "kernel.cubin");
	CHECK(kc_inode_published(&v, p1, again) == -EEXIST && p1->cubin_fd == c1,
	      "its cubin is set once");
	struct kc_inode *l = kc_inode_ref(&v, entry_file_fd(root, E1, "kernel.cubin"), &sc1, &err);
	kc_inode_place(&v, l, e1, "kernel.cubin", 0);
	CHECK(l == p1 && p1->nlookup == 2 && p1->pending && p1->role == KC_ROLE_CUBIN,
	      "a lookup of the published cubin answers the pending inode");
	fuse_ino_t idp = kc_inode_ino(&v, p1);
	/* E1's kernel.cu, looked up. */
	struct kc_inode *src = kc_inode_ref(&v, entry_file(root, E1, "kernel.cu", "src", &ss), &ss,
					    &err);
	kc_inode_place(&v, src, e1, "kernel.cu", 0);
	CHECK(src && src->role == KC_ROLE_SOURCE && src->parent_fd >= 0, "kernel.cu, looked up");
	fuse_ino_t ids = kc_inode_ino(&v, src);
	/* E2: published before the lookup. */
	struct kc_inode *y2 = kc_inode_ref(&v, entry_file(root, E2, "kernel.cubin", "cubin two",
							  &sc2), &sc2, &err);
	kc_inode_place(&v, y2, e2, "kernel.cubin", 0);
	CHECK(y2 && !y2->pending && y2->role == KC_ROLE_CUBIN && y2->parent_fd >= 0 &&
	      y2->entry_ino == s2.st_ino, "a published cubin, looked up");
	fuse_ino_t idy = kc_inode_ino(&v, y2);
	/* E3: a published cubin looked up, then compiled again (another object), and a pending
	 * inode still compiling. */
	struct kc_inode *y3 = kc_inode_ref(&v, entry_file(root, E3, "kernel.cubin", "old", &sc3),
					   &sc3, &err);
	kc_inode_place(&v, y3, e3, "kernel.cubin", 0);
	struct kc_inode *p3 = kc_inode_ref_pending(&v, e3->fd, &s3, 43, &err);
	fuse_ino_t idy3 = kc_inode_ino(&v, y3), idp3 = p3 ? kc_inode_ino(&v, p3) : 0;
	close(entry_file(root, E3, "kernel.cubin", "new", &sx));

	if (with_ledger) {
		/* The daemon dies; another restores from the ledger. */
		struct kc_inode_table w;
		CHECK(kc_inode_table_init(&w, root) == 0 && kc_ledger_open(&l2, dup(mfd), root) == 0,
		      "a restart");
		w.epoch = 7;
		long n = kc_ledger_restore(&l2, &w);
		struct kc_inode *rp = kc_inode_get(&w, idp), *rs = kc_inode_get(&w, ids);
		struct kc_inode *ry = kc_inode_get(&w, idy);
		struct stat st;
		CHECK(n == 6, "the three entries, the pending cubin made published, kernel.cu and "
		      "the published cubin are restored");
		CHECK(rp && rp->pending && rp->recipe_id == 42 && rp->stored &&
		      rp->role == KC_ROLE_CUBIN && rp->nlookup == 2 && rp->dev == s1.st_dev &&
		      rp->ino == s1.st_ino && fstat(rp->fd, &st) == 0 && st.st_ino == s1.st_ino &&
		      rp->parent_fd >= 0 && rp->cubin_fd >= 0 && fstat(rp->cubin_fd, &st) == 0 &&
		      st.st_ino == sc1.st_ino, "the pending cubin: its id, its entry, its cubin");
		struct kc_inode *rl = kc_inode_ref(&w, entry_file_fd(root, E1, "kernel.cubin"), &sc1,
						   &err);
		CHECK(rl && rl == rp && rp->nlookup == 3, "a lookup of its cubin answers it again");
		CHECK(ry && !ry->pending && ry->role == KC_ROLE_CUBIN && ry->ino == sc2.st_ino &&
		      ry->entry_ino == s2.st_ino && ry->parent_fd >= 0 &&
		      fstat(ry->fd, &st) == 0 && st.st_ino == sc2.st_ino &&
		      fstat(ry->parent_fd, &st) == 0 && st.st_ino == s2.st_ino,
		      "the published cubin: its id, its object, its entry");
		CHECK(rs && rs->role == KC_ROLE_SOURCE && rs->parent_fd >= 0 && rs->ino == ss.st_ino,
		      "kernel.cu: its id, its role, its entry");
		CHECK(!kc_inode_get(&w, idy3) && !kc_inode_get(&w, idp3),
		      "a cubin compiled again since, and a pending one still compiling: stale");
		kc_inode_forget(&w, rp, 3);
		struct kc_inode *fresh = kc_inode_ref(&w, entry_file_fd(root, E1, "kernel.cubin"),
						      &sc1, &err);
		CHECK(fresh && fresh != rp && !fresh->pending && kc_inode_get(&w, idp) == NULL,
		      "forgotten, the pending inode answers no lookup of its cubin");
		if (fresh)
			kc_inode_forget(&w, fresh, 1);
		kc_ledger_close(&l2);
		kc_inode_table_destroy(&w);
	}
	v.journal = NULL;
	if (with_ledger)
		kc_ledger_close(&l1);
	kc_inode_table_destroy(&v);
	if (mfd >= 0)
		close(mfd);
	const char *entries[] = {E1, E2, E3};
	for (int i = 0; i < 3; i++) {
		char path[256];
		const char *names[] = {"kernel.cubin", "kernel.cu"};
		for (int j = 0; j < 2; j++) {
			snprintf(path, sizeof(path), "%s/%s", entries[i], names[j]);
			unlinkat(root, path, 0);
		}
		unlinkat(root, entries[i], AT_REMOVEDIR);
	}
}

/* Lookups of one inode while others come and go. A find must hold what it found before
 * it lets go of the table's lock: kc_inode_find read the tree node after unlocking it, and
 * glibc's tdelete may free the node of a neighbouring key, so a FORGET of another inode at
 * that moment made the find return garbage (a daemon crash under concurrent renames). */
struct churn {
	struct kc_inode_table *t;
	int root, id;
	int bad;
	int *running; /* churners not done yet (atomic) */
};

static void *churn_run(void *arg)
{
	struct churn *c = arg;
	char name[32];
	struct stat st;
	snprintf(name, sizeof(name), "churn%d", c->id);
	close(openat(c->root, name, O_CREAT | O_WRONLY | O_CLOEXEC, 0644));
	for (int i = 0; i < 3000; i++) {
		int fd = openat(c->root, name, O_PATH | O_CLOEXEC), err = 0;
		struct kc_inode *in = fd >= 0 && fstat(fd, &st) == 0 ? kc_inode_ref(c->t, fd, &st, &err)
								      : NULL;
		if (!in) {
			c->bad++;
			if (fd >= 0)
				close(fd);
			continue;
		}
		kc_inode_forget(c->t, in, 1); /* its last reference: out of the tree, freed */
	}
	unlinkat(c->root, name, 0);
	__atomic_sub_fetch(c->running, 1, __ATOMIC_SEQ_CST);
	return NULL;
}

static void find_while_others_go(struct kc_inode_table *t, int root)
{
	struct stat sf;
	int err = 0;
	struct kc_inode *fixed = kc_inode_ref(t, object(root, "fixed", &sf), &sf, &err);
	enum { CHURNERS = 3 };
	pthread_t th[CHURNERS];
	struct churn c[CHURNERS];
	int started = 0, running = CHURNERS;
	for (int i = 0; i < CHURNERS; i++) {
		c[i] = (struct churn){.t = t, .root = root, .id = i, .running = &running};
		if (pthread_create(&th[i], NULL, churn_run, &c[i]) == 0)
			started++;
		else
			__atomic_sub_fetch(&running, 1, __ATOMIC_SEQ_CST);
	}
	long finds = 0, wrong = 0; /* finds for as long as the churners run */
	while (__atomic_load_n(&running, __ATOMIC_SEQ_CST) > 0 || finds < 1000) {
		struct kc_inode *in = kc_inode_find_held(t, sf.st_dev, sf.st_ino);
		wrong += in != fixed;
		kc_inode_let_go(t, in);
		finds++;
	}
	int bad = 0;
	for (int i = 0; i < started; i++) {
		pthread_join(th[i], NULL);
		bad += c[i].bad;
	}
	CHECK(fixed && started == CHURNERS && !bad && wrong == 0,
	      "finds of one inode while 3 threads make and forget 3000 others each: each found it");
	printf("# %ld finds\n", finds);
	CHECK(fixed && fixed->nlookup == 1, "the finds' holds all let go: its count is the kernel's");
	kc_inode_forget(t, fixed, 1);
	unlinkat(root, "fixed", 0);
}

int main(void)
{
	char dir[] = "/tmp/kc-inode-XXXXXX";
	if (!mkdtemp(dir)) {
		CHECK(0, "mkdtemp");
		return tap_done();
	}
	int root = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
	struct kc_inode_table t;
	CHECK(kc_inode_table_init(&t, root) == 0, "table set up");

	CHECK(kc_inode_ino(&t, &t.root) == FUSE_ROOT_ID && kc_inode_get(&t, FUSE_ROOT_ID) == &t.root,
	      "the root is FUSE_ROOT_ID");
	CHECK(kc_inode_ino(&t, &t.ctl_dir) == 2 && kc_inode_ino(&t, &t.stats) == 3 &&
	      kc_inode_ino(&t, &t.metrics) == 4, "the virtual inodes have fixed ids 2, 3, 4");
	CHECK(kc_inode_get(&t, 3) == &t.stats, "a fixed id resolves");
	CHECK(kc_inode_get(&t, 0) == NULL && kc_inode_get(&t, 5) == NULL &&
	      kc_inode_get(&t, 1ull << 32 | 1) == NULL, "0, an unused slot, a fixed slot with a "
	      "generation: unknown");

	struct stat sa, sb;
	int err = 0;
	struct kc_inode *a = kc_inode_ref(&t, object(root, "a", &sa), &sa, &err);
	struct kc_inode *b = kc_inode_ref(&t, object(root, "b", &sb), &sb, &err);
	CHECK(a && b && a != b, "two inodes");
	fuse_ino_t ia = kc_inode_ino(&t, a), ib = kc_inode_ino(&t, b);
	CHECK(ia >> 32 >= 1 && (uint32_t)ia >= KC_INODE_FIRST_SLOT && ia != ib,
	      "dynamic ids: a generation of at least 1 and a slot past the fixed ones");
	CHECK(ia != (fuse_ino_t)(uintptr_t)a, "an id is not the struct's address");
	CHECK(kc_inode_get(&t, ia) == a && kc_inode_get(&t, ib) == b, "ids resolve");

	struct kc_inode *a2 = kc_inode_ref(&t, object(root, "a", &sa), &sa, &err);
	CHECK(a2 == a && a->nlookup == 2 && kc_inode_ino(&t, a2) == ia,
	      "a second lookup: the same id, two references");
	kc_inode_forget(&t, a, 1);
	CHECK(kc_inode_get(&t, ia) == a && a->nlookup == 1, "one forget: still known");
	uint32_t slot = (uint32_t)ia;
	kc_inode_forget(&t, a, 1);
	CHECK(kc_inode_get(&t, ia) == NULL, "forgotten: the id is stale");

	struct stat sc;
	struct kc_inode *c = kc_inode_ref(&t, object(root, "c", &sc), &sc, &err);
	fuse_ino_t ic = kc_inode_ino(&t, c);
	CHECK((uint32_t)ic == slot && ic >> 32 == (ia >> 32) + 1,
	      "the freed slot is reused with the next generation");
	CHECK(kc_inode_get(&t, ia) == NULL && kc_inode_get(&t, ic) == c,
	      "the old id stays stale, the new one resolves");
	CHECK(kc_inode_count(&t) == 2, "two inodes counted");

	/* A daemon started again on the mount (holder.h): a fresh table in another epoch
	 * knows none of the ids the kernel holds from the dead one, and hands out none of
	 * them, though its slots start over; the fixed ids are the same. */
	struct kc_inode_table u;
	CHECK(kc_inode_table_init(&u, root) == 0, "a second table");
	u.epoch = 1;
	CHECK(kc_inode_get(&u, ib) == NULL && kc_inode_get(&u, ic) == NULL &&
	      kc_inode_get(&u, FUSE_ROOT_ID) == &u.root, "the dead table's ids are stale there");
	struct stat sd;
	struct kc_inode *d = kc_inode_ref(&u, object(root, "a", &sd), &sd, &err);
	fuse_ino_t id = d ? kc_inode_ino(&u, d) : 0;
	CHECK(d && id != ia && id != ib && id != ic && (uint32_t)id == (uint32_t)ia &&
	      kc_inode_get(&u, id) == d && kc_inode_get(&u, ia) == NULL,
	      "its first slot gets an id of its own epoch");
	if (d)
		kc_inode_forget(&u, d, 1);
	kc_inode_table_destroy(&u);

	if (has_dac_read_search()) {
		ledger_checks(root);
		entry_file_checks(root, 1);
	} else {
		CHECK(1, "# SKIP the inode ledger: open_by_handle_at needs CAP_DAC_READ_SEARCH");
		entry_file_checks(root, 0);
	}

	find_while_others_go(&t, root);
	kc_inode_forget(&t, b, 1);
	kc_inode_forget(&t, c, 1);
	CHECK(kc_inode_count(&t) == 0, "all forgotten");
	kc_inode_table_destroy(&t);
	close(root);
	char path[64];
	for (const char *n = "abc"; *n; n++) {
		snprintf(path, sizeof(path), "%s/%c", dir, *n);
		unlink(path);
	}
	rmdir(dir);
	return tap_done();
}
