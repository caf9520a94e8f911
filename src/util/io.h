/* io.h - whole-buffer writes and reads: the loops the project's programs share. */
#ifndef KC_IO_H
#define KC_IO_H

#include <stddef.h>

/* Write all len bytes of buf to fd, retrying short writes and EINTR. Returns 0 or -errno of
 * the failed write (ENOSPC, EDQUOT, EIO, EFBIG...). */
int kc_write_all(int fd, const void *buf, size_t len);

/* Read fd to its end into a malloc'd buffer (*out, *len bytes, followed by a NUL byte that
 * *len does not count; the caller frees it), retrying EINTR. Returns 0; -EFBIG once more
 * than max bytes (give or take the 64 KiB first buffer) are there; -ENOMEM; or -errno of a
 * failed read. */
int kc_read_all(int fd, size_t max, char **out, size_t *len);

#endif
