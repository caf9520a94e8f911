/* unixsock.h - Unix-domain sockets: abstract names, and descriptors passed in a message
 * (SCM_RIGHTS, unix(7)). The holder (fs/life/holder.c) and the live upgrade
 * (fs/life/upgrade.c) talk this way: the holder hands a restarted daemon its state memfd, an
 * upgrading daemon hands the new one /dev/fuse and its open files. */
#ifndef KC_UNIXSOCK_H
#define KC_UNIXSOCK_H

#include <stddef.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>

/* The most descriptors one message carries here (the kernel's SCM_MAX_FD is 253). */
#define KC_FDS_PER_MSG 250

/* Fill *a with the abstract address of name (a leading NUL, then name, cut to what fits:
 * no file, so nothing stays behind a killed server). Returns the address's length. */
socklen_t kc_abstract_addr(const char *name, struct sockaddr_un *a);

/* Nonzero if a server of type (SOCK_STREAM, SOCK_SEQPACKET) accepts a connection on the
 * abstract name now. */
int kc_abstract_answers(const char *name, int type);

/* Send len bytes of buf (len >= 1) on s as one message, carrying the n descriptors of fds
 * (borrowed; n <= KC_FDS_PER_MSG; none when n is 0), retrying EINTR, with MSG_NOSIGNAL.
 * Returns 0; -EPIPE when part of buf went; -EINVAL when n is past KC_FDS_PER_MSG; or
 * sendmsg's -errno (EPIPE, ECONNRESET, EAGAIN on a non-blocking socket). */
int kc_send_fds(int s, const void *buf, size_t len, const int *fds, size_t n);

/* Receive one message of at most len bytes into buf, and the descriptors it carries
 * (close-on-exec) into fds, at most max of them (the rest are closed), their count in
 * *nfds; retries EINTR. Returns the message's length (0: the peer closed) or recvmsg's
 * -errno. *cut (may be NULL) is set when the kernel cut the descriptors (MSG_CTRUNC: more
 * than KC_FDS_PER_MSG were sent, or this process could not take them, at its RLIMIT_NOFILE
 * or refused by a security module); those that came are then closed and *nfds is 0, and
 * the message's bytes are still returned. The caller owns the descriptors returned. */
ssize_t kc_recv_fds(int s, void *buf, size_t len, int *fds, size_t max, size_t *nfds, int *cut);

#endif
