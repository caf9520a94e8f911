/* tap.h - a few lines of TAP output for the unit tests (meson reads TAP natively). */
#ifndef KC_TAP_H
#define KC_TAP_H

/* Record one check: prints "ok N - what" or "not ok N - what (file:line)". */
void tap_check(int cond, const char *what, const char *file, int line);
/* Print the plan and return the exit status (0 when every check passed). */
int tap_done(void);

#define CHECK(cond, what) tap_check(!!(cond), (what), __FILE__, __LINE__)

#endif
