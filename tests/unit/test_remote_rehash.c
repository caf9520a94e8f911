/* test_remote_rehash.c - this node's manifest of a header list, shared by the fetches that
 * ask together and never older than the asking: a change made before a ticket is taken is
 * always seen. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "remote_rehash.h"
#include "tap.h"

static char root[64], header[128], list[512];
static struct kc_rehash_table table;

static void put(const char *text)
{
	int fd = open(header, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd >= 0) {
		if (write(fd, text, strlen(text)) < 0)
			perror("write");
		fchmod(fd, 0644);
		close(fd);
	}
}

/* Rehashes begun so far: each looks the list's one header up (a stat, and a read when it
 * changed). */
static unsigned long lookups(void)
{
	pthread_mutex_lock(&table.lock);
	unsigned long n = table.starts;
	pthread_mutex_unlock(&table.lock);
	return n;
}

static int own(unsigned long ticket, char mine[KC_MANIFEST_COMPACT_MAX])
{
	char why[200];
	size_t ml = 0;
	int err = kc_rehash_own(&table, ticket, "ab", list, strlen(list), mine, &ml, why,
				sizeof(why));
	if (!err && ml != KC_MANIFEST_LINE_LEN)
		return -EINVAL;
	return err;
}

struct racer {
	unsigned long ticket;
	char mine[KC_MANIFEST_COMPACT_MAX];
	int err;
};

static void *race(void *arg)
{
	struct racer *r = arg;
	r->err = own(r->ticket, r->mine);
	return NULL;
}

int main(void)
{
	char m1[KC_MANIFEST_COMPACT_MAX], m2[KC_MANIFEST_COMPACT_MAX], m3[KC_MANIFEST_COMPACT_MAX];
	char why[200];
	size_t ml = 0;

	snprintf(root, sizeof(root), "/tmp/kc-rehash-XXXXXX");
	if (!mkdtemp(root))
		return 1;
	chmod(root, 0755);
	snprintf(header, sizeof(header), "%s/h.h", root);
	snprintf(list, sizeof(list), "%064d %s\n", 0, header);
	put("#define A 1\n");
	kc_rehash_init(&table);

	unsigned long t1 = kc_rehash_ticket(&table);
	unsigned long before = lookups();
	CHECK(own(t1, m1) == 0, "a rehash gives this node's compact manifest");
	CHECK(lookups() == before + 1, "it looked the header up");
	before = lookups();
	CHECK(own(t1, m2) == 0 && strcmp(m1, m2) == 0 && lookups() == before,
	      "a fetch that asked before that rehash began takes its result, looking nothing up");

	/* the same size, the old mtime: only the ctime (and the bytes) say it changed */
	struct stat st;
	stat(header, &st);
	put("#define B 1\n");
	struct timespec times[2] = {st.st_atim, st.st_mtim};
	utimensat(AT_FDCWD, header, times, 0);
	unsigned long t2 = kc_rehash_ticket(&table);
	before = lookups();
	CHECK(own(t2, m3) == 0 && strcmp(m1, m3) != 0 && lookups() == before + 1,
	      "a fetch that asks after a change rehashes and sees it (size and mtime kept)");
	before = lookups();
	CHECK(own(t1, m2) == 0 && strcmp(m2, m3) == 0 && lookups() == before,
	      "an older ticket takes the newer result, which began after it");

	/* 8 fetches that ask at once share one rehash */
	unsigned long t3 = kc_rehash_ticket(&table);
	struct racer r[8];
	pthread_t th[8];
	before = lookups();
	for (int i = 0; i < 8; i++) {
		r[i].ticket = t3;
		pthread_create(&th[i], NULL, race, &r[i]);
	}
	int same = 1;
	for (int i = 0; i < 8; i++) {
		pthread_join(th[i], NULL);
		same &= r[i].err == 0 && strcmp(r[i].mine, m3) == 0;
	}
	CHECK(same, "8 fetches with one ticket get the same manifest");
	CHECK(lookups() == before + 1, "and the header was looked up once for all 8");

	unlink(header);
	unsigned long t4 = kc_rehash_ticket(&table);
	int err = kc_rehash_own(&table, t4, "ab", list, strlen(list), m2, &ml, why, sizeof(why));
	CHECK(err == -ENOENT && strstr(why, header), "a header gone: ENOENT, and why names it");
	err = kc_rehash_own(&table, t4, "ab", list, strlen(list), m2, &ml, why, sizeof(why));
	CHECK(err == -ENOENT && strstr(why, header), "the failure is shared as a result is");

	/* another list of the same header bytes is its own slot */
	put("#define B 1\n");
	unsigned long t5 = kc_rehash_ticket(&table);
	err = kc_rehash_own(&table, t5, "cd", list, strlen(list), m2, &ml, why, sizeof(why));
	CHECK(err == 0 && strcmp(m2, m3) == 0, "a list under another digest is rehashed for itself");

	kc_rehash_destroy(&table);
	unlink(header);
	rmdir(root);
	return tap_done();
}
