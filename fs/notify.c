/* notify.c - see notify.h */
#include "notify.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

struct inval {
	struct fuse_session *se;
	struct kc_inode_table *inodes;
	struct kc_inode *held; /* the parent, held until sent */
	fuse_ino_t parent;
	char name[];
};

static void send_inval(void *arg)
{
	struct inval *it = arg;
	int err = fuse_lowlevel_notify_inval_entry(it->se, it->parent, it->name, strlen(it->name));
	if (err && err != -ENOENT)
		kc_log(KC_LOG_DEBUG, "invalidate %s: %s", it->name, strerror(-err));
	kc_inode_forget(it->inodes, it->held, 1);
	free(it);
}

int kc_notifier_start(struct kc_notifier *n, struct fuse_session *se,
		      struct kc_inode_table *inodes)
{
	n->se = se;
	n->inodes = inodes;
	n->pool = kc_pool_create(1);
	return n->pool ? 0 : -errno;
}

void kc_notifier_inval_entry(struct kc_notifier *n, fuse_ino_t parent, const char *name)
{
	size_t len = strlen(name);
	struct inval *it = malloc(sizeof(*it) + len + 1);
	if (!it)
		return;
	it->se = n->se;
	it->inodes = n->inodes;
	it->held = kc_inode_get(n->inodes, parent);
	it->parent = parent;
	memcpy(it->name, name, len + 1);
	kc_inode_hold(n->inodes, it->held);
	if (kc_pool_submit(n->pool, send_inval, it) != 0) {
		kc_inode_forget(n->inodes, it->held, 1);
		free(it);
	}
}

void kc_notifier_stop(struct kc_notifier *n)
{
	if (n->pool)
		kc_pool_destroy(n->pool);
	n->pool = NULL;
}
