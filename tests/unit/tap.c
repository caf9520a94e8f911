#include "tap.h"

#include <stdio.h>

static int tap_n, tap_failed;

void tap_check(int cond, const char *what, const char *file, int line)
{
	tap_n++;
	if (cond) {
		printf("ok %d - %s\n", tap_n, what);
	} else {
		tap_failed++;
		printf("not ok %d - %s (%s:%d)\n", tap_n, what, file, line);
	}
	fflush(stdout);
}

void tap_todo(int cond, const char *what, const char *reason, const char *file, int line)
{
	tap_n++;
	if (cond)
		printf("ok %d - %s # TODO %s\n", tap_n, what, reason);
	else
		printf("not ok %d - %s (%s:%d) # TODO %s\n", tap_n, what, file, line, reason);
	fflush(stdout);
}

int tap_done(void)
{
	printf("1..%d\n", tap_n);
	return tap_failed ? 1 : 0;
}
