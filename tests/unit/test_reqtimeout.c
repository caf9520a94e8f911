/* test_reqtimeout.c - the kernel's FUSE request timeout as the daemon derives it from the
 * sysctls (src/mount/reqtimeout.h), read from a directory of fake sysctl files. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "reqtimeout.h"
#include "tap.h"

static void put(const char *dir, const char *name, const char *text)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	FILE *f = fopen(path, "w");
	if (f) {
		fputs(text, f);
		fclose(f);
	}
}

static void drop(const char *dir, const char *name)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	unlink(path);
}

int main(void)
{
	/* fuse_init_server_timeout: the default, capped by the maximum, at least 15 s. */
	CHECK(kc_reqtimeout_effective(0, 0, 0) == 0, "both off: no timeout");
	CHECK(kc_reqtimeout_effective(0, 120, 0) == 120, "default alone");
	CHECK(kc_reqtimeout_effective(0, 0, 90) == 90, "max alone applies to every connection");
	CHECK(kc_reqtimeout_effective(0, 120, 90) == 90, "default capped by max");
	CHECK(kc_reqtimeout_effective(0, 60, 90) == 60, "default under max");
	CHECK(kc_reqtimeout_effective(0, 5, 0) == KC_REQTIMEOUT_FLOOR, "raised to the 15 s floor");
	CHECK(kc_reqtimeout_effective(300, 60, 0) == 300, "a server's own timeout wins over the default");
	CHECK(kc_reqtimeout_effective(300, 60, 100) == 100, "and is capped by max");

	CHECK(kc_reqtimeout_budget(0) == 0, "no timeout: no bound");
	CHECK(kc_reqtimeout_budget(15) == 12, "15 s: 3 s margin");
	CHECK(kc_reqtimeout_budget(600) == 540, "600 s: a tenth");
	CHECK(kc_reqtimeout_budget(2) >= 1, "never 0 for a timeout");
	CHECK(kc_reqtimeout_needed(600) == 666 && kc_reqtimeout_budget(666) >= 600 &&
	      kc_reqtimeout_budget(665) < 600, "needed: the smallest timeout covering a wait");
	CHECK(kc_reqtimeout_needed(1) == 15, "needed: at least the floor");

	char dir[] = "/tmp/kc-reqtimeout-XXXXXX";
	if (!mkdtemp(dir)) {
		CHECK(0, "mkdtemp");
		return tap_done();
	}
	struct kc_reqtimeout rt;
	CHECK(kc_reqtimeout_read(dir, &rt) == 0 && !rt.present && rt.effective_s == 0,
	      "absent sysctls (a kernel before 6.14): no timeout");
	put(dir, "default_request_timeout", "0\n");
	put(dir, "max_request_timeout", "0\n");
	CHECK(kc_reqtimeout_read(dir, &rt) == 0 && rt.present && rt.effective_s == 0,
	      "present and off");
	put(dir, "default_request_timeout", "40\n");
	put(dir, "max_request_timeout", "20\n");
	CHECK(kc_reqtimeout_read(dir, &rt) == 0 && rt.default_s == 40 && rt.max_s == 20 &&
	      rt.effective_s == 20, "read both: default capped by max");
	put(dir, "max_request_timeout", "junk\n");
	CHECK(kc_reqtimeout_read(dir, &rt) == -EINVAL && rt.effective_s == 0,
	      "a file without a number: -EINVAL");
	drop(dir, "default_request_timeout");
	drop(dir, "max_request_timeout");
	rmdir(dir);
	return tap_done();
}
