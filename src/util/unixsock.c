/* unixsock.c - see unixsock.h */
#define _GNU_SOURCE
#include "unixsock.h"

#include <errno.h>
#include <stddef.h>
#include <string.h>
#include <unistd.h>

socklen_t kc_abstract_addr(const char *name, struct sockaddr_un *a)
{
	size_t n = strlen(name);
	memset(a, 0, sizeof(*a));
	a->sun_family = AF_UNIX;
	if (n > sizeof(a->sun_path) - 1)
		n = sizeof(a->sun_path) - 1;
	memcpy(a->sun_path + 1, name, n);
	return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

int kc_abstract_answers(const char *name, int type)
{
	struct sockaddr_un a;
	socklen_t al = kc_abstract_addr(name, &a);
	int s = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
	int ok = s >= 0 && connect(s, (struct sockaddr *)&a, al) == 0;
	if (s >= 0)
		close(s);
	return ok;
}

/* Room for KC_FDS_PER_MSG descriptors, aligned for a cmsghdr. */
union fd_control {
	char buf[CMSG_SPACE(KC_FDS_PER_MSG * sizeof(int))];
	struct cmsghdr align;
};

int kc_send_fds(int s, const void *buf, size_t len, const int *fds, size_t n)
{
	if (n > KC_FDS_PER_MSG)
		return -EINVAL;
	struct iovec iov = {(void *)buf, len};
	union fd_control u;
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
	if (n) {
		m.msg_control = u.buf;
		m.msg_controllen = CMSG_SPACE(n * sizeof(int));
		struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(n * sizeof(int));
		memcpy(CMSG_DATA(cm), fds, n * sizeof(int));
	}
	ssize_t r;
	do
		r = sendmsg(s, &m, MSG_NOSIGNAL);
	while (r < 0 && errno == EINTR);
	if (r < 0)
		return -errno;
	return (size_t)r == len ? 0 : -EPIPE;
}

ssize_t kc_recv_fds(int s, void *buf, size_t len, int *fds, size_t max, size_t *nfds, int *cut)
{
	struct iovec iov = {buf, len};
	union fd_control u;
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			   .msg_controllen = sizeof(u.buf)};
	ssize_t r;
	*nfds = 0;
	if (cut)
		*cut = 0;
	do
		r = recvmsg(s, &m, MSG_CMSG_CLOEXEC);
	while (r < 0 && errno == EINTR);
	if (r < 0)
		return -errno;
	for (struct cmsghdr *cm = CMSG_FIRSTHDR(&m); cm; cm = CMSG_NXTHDR(&m, cm)) {
		if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
			continue;
		size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		int v[KC_FDS_PER_MSG];
		memcpy(v, CMSG_DATA(cm), (k < KC_FDS_PER_MSG ? k : KC_FDS_PER_MSG) * sizeof(int));
		for (size_t i = 0; i < k && i < KC_FDS_PER_MSG; i++) {
			if (*nfds < max)
				fds[(*nfds)++] = v[i];
			else
				close(v[i]);
		}
	}
	if (m.msg_flags & MSG_CTRUNC) {
		while (*nfds) {
			close(fds[--*nfds]);
			fds[*nfds] = -1;
		}
		if (cut)
			*cut = 1;
	}
	return r;
}
