/* notify.h - kernel cache invalidations sent from a thread of their own.
 *
 * fuse_lowlevel_notify_inval_entry must not run inside a request that holds the same
 * directory lock (libfuse's fuse_lowlevel.h warns of the deadlock), so requests queue the
 * (parent, name) here and return; the notifier thread sends them afterwards.
 */
#ifndef KC_NOTIFY_H
#define KC_NOTIFY_H

#define FUSE_USE_VERSION 312
#include <fuse_lowlevel.h>
#include <pthread.h>

struct kc_notify_item;

struct kc_notifier {
	struct fuse_session *se;
	pthread_t thread;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	struct kc_notify_item *head, *tail;
	int stopping, started;
};

/* Start the thread. Returns 0 or -errno. */
int kc_notifier_start(struct kc_notifier *n, struct fuse_session *se);
/* Queue an invalidation of name in directory parent (copied). Drops it on ENOMEM. */
void kc_notifier_inval_entry(struct kc_notifier *n, fuse_ino_t parent, const char *name);
/* Send what is queued, then stop and join the thread. */
void kc_notifier_stop(struct kc_notifier *n);

#endif
