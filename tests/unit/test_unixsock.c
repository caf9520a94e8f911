/* test_unixsock.c - descriptors passed in a message (src/util/unixsock.h): none, some, more
 * than the receiver asks for (closed), a receiver that cannot take them (MSG_CTRUNC: the
 * bytes still come, the descriptors do not), too many to send; and abstract names. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tap.h"
#include "unixsock.h"

/* Nonzero if a and b are descriptors of one open file (the same inode). */
static int same_file(int a, int b)
{
	struct stat x, y;
	return fstat(a, &x) == 0 && fstat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

int main(void)
{
	int sv[2];
	CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0, "a socket pair");
	char buf[64];
	int fds[4] = {-1, -1, -1, -1};
	size_t n;
	int cut;

	CHECK(kc_send_fds(sv[0], "hello", 5, NULL, 0) == 0, "send: bytes without descriptors");
	CHECK(kc_recv_fds(sv[1], buf, sizeof(buf), fds, 4, &n, &cut) == 5 && n == 0 && !cut &&
		      memcmp(buf, "hello", 5) == 0,
	      "recv: the bytes, no descriptor");

	int p[2];
	CHECK(pipe2(p, O_CLOEXEC) == 0, "a pipe to pass");
	CHECK(kc_send_fds(sv[0], "F", 1, p, 2) == 0, "send: two descriptors");
	CHECK(kc_recv_fds(sv[1], buf, sizeof(buf), fds, 4, &n, &cut) == 1 && n == 2 && !cut &&
		      same_file(fds[0], p[0]) && same_file(fds[1], p[1]),
	      "recv: both, the same files");
	CHECK((fcntl(fds[0], F_GETFD) & FD_CLOEXEC) && (fcntl(fds[1], F_GETFD) & FD_CLOEXEC),
	      "recv: close-on-exec");
	close(fds[0]);
	close(fds[1]);

	/* More than asked for: the rest are closed, not leaked. */
	int before = dup(0);
	close(before);
	CHECK(kc_send_fds(sv[0], "F", 1, p, 2) == 0 &&
		      kc_recv_fds(sv[1], buf, sizeof(buf), fds, 1, &n, &cut) == 1 && n == 1 && !cut,
	      "recv: one of two asked for");
	int next = dup(0);
	CHECK(next == before + 1, "recv: the one not asked for was closed");
	close(next);
	close(fds[0]);

	/* A receiver at its descriptor limit: the kernel cuts them; the bytes still come. */
	struct rlimit saved, low;
	getrlimit(RLIMIT_NOFILE, &saved);
	int top = dup(0); /* the lowest free number: the limit makes it the last allowed */
	close(top);
	low = saved;
	low.rlim_cur = (rlim_t)top;
	CHECK(kc_send_fds(sv[0], "EPOCH 7", 7, p, 1) == 0, "send: one descriptor");
	CHECK(setrlimit(RLIMIT_NOFILE, &low) == 0, "the receiver's limit lowered");
	fds[0] = 12345;
	ssize_t r = kc_recv_fds(sv[1], buf, sizeof(buf), fds, 1, &n, &cut);
	setrlimit(RLIMIT_NOFILE, &saved);
	CHECK(r == 7 && memcmp(buf, "EPOCH 7", 7) == 0 && n == 0 && cut,
	      "recv at the limit: the message whole, no descriptor, said as cut");

	int many[KC_FDS_PER_MSG + 1];
	for (size_t i = 0; i <= KC_FDS_PER_MSG; i++)
		many[i] = p[0];
	CHECK(kc_send_fds(sv[0], "F", 1, many, KC_FDS_PER_MSG + 1) == -EINVAL,
	      "send: more than KC_FDS_PER_MSG is EINVAL, nothing sent");

	close(sv[0]);
	CHECK(kc_recv_fds(sv[1], buf, sizeof(buf), fds, 1, &n, &cut) == 0 && n == 0,
	      "recv: 0 when the peer closed");
	CHECK(kc_send_fds(sv[1], "x", 1, NULL, 0) == -EPIPE, "send to a closed peer: EPIPE");
	close(sv[1]);

	/* Abstract names: a listener answers, none does not; no file is made. */
	char name[64];
	snprintf(name, sizeof(name), "kcachefs-test-unixsock-%d", (int)getpid());
	struct sockaddr_un a;
	socklen_t al = kc_abstract_addr(name, &a);
	int l = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	CHECK(!kc_abstract_answers(name, SOCK_STREAM), "abstract: nobody listens yet");
	CHECK(bind(l, (struct sockaddr *)&a, al) == 0 && listen(l, 1) == 0, "abstract: bound");
	CHECK(kc_abstract_answers(name, SOCK_STREAM), "abstract: the listener answers");
	CHECK(!kc_abstract_answers(name, SOCK_SEQPACKET), "abstract: another type does not");
	CHECK(access(name, F_OK) != 0, "abstract: no file in the directory");
	close(l);
	close(p[0]);
	close(p[1]);
	return tap_done();
}
