/* notify.c - see notify.h */
#include "notify.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

struct kc_notify_item {
	struct kc_notify_item *next;
	fuse_ino_t parent;
	char name[];
};

static void *notifier_main(void *arg)
{
	struct kc_notifier *n = arg;

	pthread_mutex_lock(&n->lock);
	for (;;) {
		while (!n->head && !n->stopping)
			pthread_cond_wait(&n->cond, &n->lock);
		struct kc_notify_item *it = n->head;
		if (!it)
			break;
		n->head = it->next;
		if (!n->head)
			n->tail = NULL;
		pthread_mutex_unlock(&n->lock);
		int err = fuse_lowlevel_notify_inval_entry(n->se, it->parent, it->name,
							   strlen(it->name));
		if (err && err != -ENOENT)
			kc_log(KC_LOG_DEBUG, "invalidate %s: %s", it->name, strerror(-err));
		free(it);
		pthread_mutex_lock(&n->lock);
	}
	pthread_mutex_unlock(&n->lock);
	return NULL;
}

int kc_notifier_start(struct kc_notifier *n, struct fuse_session *se)
{
	memset(n, 0, sizeof(*n));
	n->se = se;
	pthread_mutex_init(&n->lock, NULL);
	pthread_cond_init(&n->cond, NULL);
	int err = pthread_create(&n->thread, NULL, notifier_main, n);
	n->started = err == 0;
	return -err;
}

void kc_notifier_inval_entry(struct kc_notifier *n, fuse_ino_t parent, const char *name)
{
	size_t len = strlen(name);
	struct kc_notify_item *it = malloc(sizeof(*it) + len + 1);
	if (!it)
		return;
	it->next = NULL;
	it->parent = parent;
	memcpy(it->name, name, len + 1);
	pthread_mutex_lock(&n->lock);
	if (n->tail)
		n->tail->next = it;
	else
		n->head = it;
	n->tail = it;
	pthread_cond_signal(&n->cond);
	pthread_mutex_unlock(&n->lock);
}

void kc_notifier_stop(struct kc_notifier *n)
{
	if (!n->started)
		return;
	pthread_mutex_lock(&n->lock);
	n->stopping = 1;
	pthread_cond_broadcast(&n->cond);
	pthread_mutex_unlock(&n->lock);
	pthread_join(n->thread, NULL);
	n->started = 0;
}
