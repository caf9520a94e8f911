/* reqtimeout.c - the kernel's FUSE request timeout, read from its sysctls (reqtimeout.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reqtimeout.h"

unsigned kc_reqtimeout_effective(unsigned server_s, unsigned default_s, unsigned max_s)
{
	unsigned t = server_s;
	if (!t && !default_s && !max_s)
		return 0;
	if (!t)
		t = default_s;
	if (max_s)
		t = t ? (t < max_s ? t : max_s) : max_s;
	return t < KC_REQTIMEOUT_FLOOR ? KC_REQTIMEOUT_FLOOR : t;
}

/* Read one unsigned sysctl: 0 and *v, 1 when the file is absent, or -errno. */
static int read_one(const char *dir, const char *name, unsigned *v)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	*v = 0;
	FILE *f = fopen(path, "re");
	if (!f)
		return errno == ENOENT ? 1 : -errno;
	unsigned long x;
	int n = fscanf(f, "%lu", &x);
	fclose(f);
	if (n != 1 || x > 0xffffffffUL)
		return -EINVAL;
	*v = (unsigned)x;
	return 0;
}

int kc_reqtimeout_read(const char *dir, struct kc_reqtimeout *rt)
{
	memset(rt, 0, sizeof(*rt));
	int a = read_one(dir, "default_request_timeout", &rt->default_s);
	int b = read_one(dir, "max_request_timeout", &rt->max_s);
	if (a < 0 || b < 0) {
		rt->default_s = rt->max_s = 0;
		return a < 0 ? a : b;
	}
	rt->present = a == 0 || b == 0;
	/* libfuse 3.14 has no request_timeout option (3.18+ has one, sent as
	 * FUSE_REQUEST_TIMEOUT in the INIT reply): the daemon asks for nothing. */
	rt->effective_s = kc_reqtimeout_effective(0, rt->default_s, rt->max_s);
	return 0;
}

unsigned kc_reqtimeout_budget(unsigned timeout_s)
{
	if (!timeout_s)
		return 0;
	unsigned margin = timeout_s / 10 > 3 ? timeout_s / 10 : 3;
	return timeout_s > margin + 1 ? timeout_s - margin : 1;
}

unsigned kc_reqtimeout_needed(unsigned wait_s)
{
	unsigned t = wait_s > KC_REQTIMEOUT_FLOOR ? wait_s : KC_REQTIMEOUT_FLOOR;
	while (kc_reqtimeout_budget(t) < wait_s)
		t++;
	return t;
}
