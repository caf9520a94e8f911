/* io.c - see io.h */
#include "io.h"

#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

int kc_write_all(int fd, const void *buf, size_t len)
{
	const char *p = buf;

	while (len > 0) {
		ssize_t n = write(fd, p, len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -errno;
		p += n;
		len -= (size_t)n;
	}
	return 0;
}

int kc_read_all(int fd, size_t max, char **out, size_t *len)
{
	size_t cap = 1 << 16, used = 0;
	char *buf = malloc(cap);

	if (!buf)
		return -ENOMEM;
	for (;;) {
		if (used == cap) {
			char *b = cap >= max ? NULL : realloc(buf, cap * 2);
			if (!b) {
				free(buf);
				return cap >= max ? -EFBIG : -ENOMEM;
			}
			buf = b;
			cap *= 2;
		}
		ssize_t n = read(fd, buf + used, cap - used);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			int err = -errno;
			free(buf);
			return err;
		}
		if (n == 0)
			break;
		used += (size_t)n;
	}
	if (used == cap) { /* room for the NUL */
		char *b = realloc(buf, cap + 1);
		if (!b) {
			free(buf);
			return -ENOMEM;
		}
		buf = b;
	}
	buf[used] = '\0';
	*out = buf;
	*len = used;
	return 0;
}
