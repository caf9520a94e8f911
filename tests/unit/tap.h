/* tap.h - a few lines of TAP output for the unit tests (meson reads TAP natively). */
#ifndef KC_TAP_H
#define KC_TAP_H

/* Record one check: prints "ok N - what" or "not ok N - what (file:line)". */
void tap_check(int cond, const char *what, const char *file, int line);
/* Record a check that documents a known bug: prints "... # TODO reason". A failure does not
 * fail the program; a pass shows up as an unexpected pass (turn it into a CHECK then). */
void tap_todo(int cond, const char *what, const char *reason, const char *file, int line);
/* Print the plan and return the exit status (0 when every check passed). */
int tap_done(void);

#define CHECK(cond, what) tap_check(!!(cond), (what), __FILE__, __LINE__)
#define CHECK_TODO(cond, what, reason) tap_todo(!!(cond), (what), (reason), __FILE__, __LINE__)

#endif
