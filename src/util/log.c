/* log.c - see log.h */
#include "log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <syslog.h>

static int log_syslog;
static enum kc_log_level log_level = KC_LOG_INFO;

static const char *const level_names[] = {"error", "warning", "info", "debug"};

void kc_log_init(int use_syslog, enum kc_log_level level)
{
	log_syslog = use_syslog;
	log_level = level;
	if (use_syslog)
		openlog("kcachefs", LOG_PID, LOG_DAEMON);
}

int kc_log_level_parse(const char *word, enum kc_log_level *out)
{
	for (unsigned i = 0; i < sizeof(level_names) / sizeof(level_names[0]); i++) {
		if (strcmp(word, level_names[i]) == 0) {
			*out = (enum kc_log_level)i;
			return 0;
		}
	}
	return -EINVAL;
}

int kc_log_enabled(enum kc_log_level lvl)
{
	return lvl <= log_level;
}

void kc_log(enum kc_log_level lvl, const char *fmt, ...)
{
	static const int prio[] = {LOG_ERR, LOG_WARNING, LOG_INFO, LOG_DEBUG};
	char line[2048];
	va_list ap;

	if (lvl > log_level)
		return;
	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	if (log_syslog)
		syslog(prio[lvl], "%s", line);
	else
		fprintf(stderr, "kcachefs: %s: %s\n", level_names[lvl], line);
}
