/* io.h - whole-buffer writes, the one loop every writer of the project shares. */
#ifndef KC_IO_H
#define KC_IO_H

#include <stddef.h>

/* Write all len bytes of buf to fd, retrying short writes and EINTR. Returns 0 or -errno of
 * the failed write (ENOSPC, EDQUOT, EIO, EFBIG...). */
int kc_write_all(int fd, const void *buf, size_t len);

#endif
