/* log.h - leveled logging to stderr (foreground) or syslog (daemon).
 *
 * Owns: the process-wide log sink and level. Thread-safe: each call writes one line.
 */
#ifndef KC_LOG_H
#define KC_LOG_H

enum kc_log_level { KC_LOG_ERR = 0, KC_LOG_WARN, KC_LOG_INFO, KC_LOG_DEBUG };

/* Select the sink (use_syslog != 0: syslog with ident "kcachefs", else stderr) and the
 * most verbose level that is written. May be called again, e.g. after daemonizing. */
void kc_log_init(int use_syslog, enum kc_log_level level);

/* Parse "error", "warning", "info" or "debug". Returns 0, or -EINVAL for another word. */
int kc_log_level_parse(const char *word, enum kc_log_level *out);

/* Nonzero if lines of level lvl are written (to skip building costly ones). */
int kc_log_enabled(enum kc_log_level lvl);

/* Write one line (printf format, no trailing newline needed) if lvl is enabled. */
void kc_log(enum kc_log_level lvl, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif
