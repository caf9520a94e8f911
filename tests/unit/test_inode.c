/* test_inode.c - the node ids of the inode table (src/fs/inode.h): fixed ids for the root and
 * the virtual inodes, generation-tagged slots for the rest, stale ids known as such after
 * a forget, and lookup counts kept. On a temporary backing directory, without a mount. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "inode.h"
#include "tap.h"

/* A new O_PATH fd and stat of dir/name (created as a file). */
static int object(int dir, const char *name, struct stat *st)
{
	close(openat(dir, name, O_CREAT | O_WRONLY | O_CLOEXEC, 0644));
	int fd = openat(dir, name, O_PATH | O_CLOEXEC);
	fstat(fd, st);
	return fd;
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
