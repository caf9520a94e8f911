/* test_identity.c - the compilers' identity (identity.h): no install path in it, a binary
 * replaced on disk is noticed by a refresh and taken again, and concurrent readers never
 * see a torn identity. Fake compilers are shell scripts answering --version. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "identity.h"
#include "tap.h"
#include "tmptree.h"

static char base[64];

/* Write a compiler script answering --version with "Build <build>", plus a comment, at
 * path (through a temporary and a rename, as an upgrade replaces a binary). */
static void write_compiler(const char *path, const char *build, const char *comment)
{
	char tmp[4200];
	snprintf(tmp, sizeof(tmp), "%s.new", path);
	FILE *f = fopen(tmp, "w");
	if (!f)
		abort();
	fprintf(f, "#!/bin/sh\n# %s\necho 'Cuda compilation tools'\necho 'Build %s'\n", comment,
		build);
	fclose(f);
	chmod(tmp, 0755);
	if (rename(tmp, path) != 0)
		abort();
}

struct reader {
	struct kc_compiler *k;
	const char *a, *b;
	volatile int *stop;
	int torn;
};

static void *read_ids(void *arg)
{
	struct reader *r = arg;
	char id[KC_COMPILER_ID_MAX];
	while (!*r->stop) {
		kc_compiler_id(r->k, id);
		if (strcmp(id, r->a) != 0 && strcmp(id, r->b) != 0)
			r->torn++;
	}
	return NULL;
}

int main(void)
{
	char a[200], b[300], dir2[200], link[200], lib[200];
	char id[KC_COMPILER_ID_MAX], id2[KC_COMPILER_ID_MAX], first[KC_COMPILER_ID_MAX];
	struct kc_compiler k, k2;

	if (tmptree_new(base, sizeof(base), "kc-compiler") != 0)
		return 1;
	snprintf(a, sizeof(a), "%s/nvcc", base);
	snprintf(dir2, sizeof(dir2), "%s/other-prefix", base);
	snprintf(b, sizeof(b), "%s/nvcc", dir2);
	snprintf(link, sizeof(link), "%s/nvcc-link", base);
	mkdir(dir2, 0755);
	write_compiler(a, "cuda_13.0.r13.0/compiler.1", "A");
	write_compiler(b, "cuda_13.0.r13.0/compiler.1", "A");
	if (symlink(a, link) != 0)
		return 1;

	/* One binary, one identity: wherever it is installed, however it is reached. */
	CHECK(kc_compiler_init(&k, a, NULL) == 0, "identity taken");
	unsigned long gen = kc_compiler_id(&k, first);
	CHECK(strstr(first, "Build cuda_13.0.r13.0/compiler.1 sha256:") == first,
	      "identity: the version line and the binary's digest");
	CHECK(!strstr(first, base), "no install path in the identity");
	CHECK(kc_compiler_init(&k2, b, NULL) == 0, "identity of a copy under another prefix");
	kc_compiler_id(&k2, id2);
	CHECK(strcmp(first, id2) == 0, "the same bytes elsewhere: the same identity");
	kc_compiler_destroy(&k2);
	CHECK(kc_compiler_init(&k2, link, NULL) == 0, "identity through a symlink");
	kc_compiler_id(&k2, id2);
	CHECK(strcmp(first, id2) == 0, "through a symlink: the same identity");
	kc_compiler_destroy(&k2);

	/* Other bytes, same version line (a wrapper script, a patched build): another one. */
	write_compiler(b, "cuda_13.0.r13.0/compiler.1", "B, which wraps A");
	CHECK(kc_compiler_init(&k2, b, NULL) == 0, "identity of other bytes");
	kc_compiler_id(&k2, id2);
	CHECK(strcmp(first, id2) != 0, "other bytes, same --version: another identity");
	kc_compiler_destroy(&k2);

	CHECK(kc_compiler_refresh(&k) == 0, "refresh: nothing changed");
	CHECK(kc_compiler_id(&k, id) == gen && strcmp(id, first) == 0, "refresh kept it");

	/* The same bytes installed again (a new inode): looked at again, still the same. */
	write_compiler(a, "cuda_13.0.r13.0/compiler.1", "A");
	CHECK(kc_compiler_refresh(&k) == 0, "reinstalled, same bytes: unchanged");
	CHECK(kc_compiler_id(&k, id) == gen && strcmp(id, first) == 0, "same identity, generation");

	/* An in-place upgrade: noticed, taken again. */
	write_compiler(a, "cuda_13.1.r13.1/compiler.2", "A upgraded");
	CHECK(kc_compiler_refresh(&k) == 1, "replaced binary: changed");
	CHECK(kc_compiler_id(&k, id) == gen + 1, "generation bumped");
	CHECK(strstr(id, "Build cuda_13.1.r13.1/compiler.2 sha256:") == id, "the new version");
	CHECK(kc_compiler_refresh(&k) == 0, "and then unchanged");

	/* Retargeting a symlink is a change too. */
	CHECK(kc_compiler_init(&k2, link, NULL) == 0, "identity through a symlink");
	kc_compiler_id(&k2, id2);
	write_compiler(b, "cuda_12.9.r12.9/compiler.0", "C");
	unlink(link);
	CHECK(symlink(b, link) == 0, "symlink retargeted");
	CHECK(kc_compiler_refresh(&k2) == 1, "retargeted symlink: changed");
	kc_compiler_id(&k2, id);
	CHECK(strstr(id, "compiler.0 sha256:") != NULL && strcmp(id, id2) != 0, "the target's");
	kc_compiler_destroy(&k2);

	/* Gone: the identity stays (compiles fail to run it, a passing cause), and comes
	 * back as the binary does. */
	kc_compiler_id(&k, first);
	gen = kc_compiler_generation(&k);
	unlink(a);
	CHECK(kc_compiler_refresh(&k) == -ENOENT, "removed: -ENOENT");
	CHECK(kc_compiler_id(&k, id) == gen && strcmp(id, first) == 0, "removed: identity kept");
	write_compiler(a, "cuda_13.2.r13.2/compiler.3", "back");
	CHECK(kc_compiler_refresh(&k) == 1, "a compiler back in place: changed");

	/* A compiler missing at the start is "unavailable", and taken when it comes. */
	snprintf(lib, sizeof(lib), "%s/late-nvcc", base);
	CHECK(kc_compiler_init(&k2, lib, NULL) == 0, "init without the binary");
	kc_compiler_id(&k2, id2);
	CHECK(strcmp(id2, "nvcc unavailable") == 0, "missing: unavailable");
	CHECK(kc_compiler_refresh(&k2) == 0, "still missing: unchanged");
	write_compiler(lib, "cuda_13.0.r13.0/compiler.1", "late");
	CHECK(kc_compiler_refresh(&k2) == 1, "appeared: changed");
	kc_compiler_destroy(&k2);

	/* Readers during swaps see one identity or the other, never a mix. */
	char ida[KC_COMPILER_ID_MAX], idb[KC_COMPILER_ID_MAX];
	write_compiler(a, "x/compiler.A", "A");
	kc_compiler_refresh(&k);
	kc_compiler_id(&k, ida);
	write_compiler(a, "x/compiler.B", "B");
	kc_compiler_refresh(&k);
	kc_compiler_id(&k, idb);
	volatile int stop = 0;
	struct reader r[3];
	pthread_t t[3];
	for (int i = 0; i < 3; i++) {
		r[i] = (struct reader){&k, ida, idb, &stop, 0};
		pthread_create(&t[i], NULL, read_ids, &r[i]);
	}
	int changes = 0;
	for (int i = 0; i < 20; i++) {
		write_compiler(a, i % 2 ? "x/compiler.B" : "x/compiler.A", i % 2 ? "B" : "A");
		changes += kc_compiler_refresh(&k) == 1;
	}
	stop = 1;
	int torn = 0;
	for (int i = 0; i < 3; i++) {
		pthread_join(t[i], NULL);
		torn += r[i].torn;
	}
	CHECK(changes == 20, "each swap noticed");
	CHECK(torn == 0, "no reader saw a torn identity");
	kc_compiler_destroy(&k);

	tmptree_remove(base);
	return tap_done();
}
