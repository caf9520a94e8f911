/* tmptree.h - a unit test's temporary directory tree: made, filled and removed. */
#ifndef KC_TMPTREE_H
#define KC_TMPTREE_H

#include <stddef.h>
#include <sys/types.h>

/* Make a fresh directory /tmp/<name>-XXXXXX; path (pathlen bytes) receives its name.
 * Returns 0, or -1 with the reason printed (perror). */
int tmptree_new(char *path, size_t pathlen, const char *name);
/* Create root/rel, mode 0755 (one level; the parent must exist). A failure is printed. */
void tmptree_mkdir(const char *root, const char *rel);
/* Write text to root/rel, created or truncated, with mode (set past the umask). A failure is
 * printed. */
void tmptree_put(const char *root, const char *rel, const char *text, mode_t mode);
/* Remove root and everything below it (links not followed). Returns 0, or -1 with the reason
 * printed. */
int tmptree_remove(const char *root);

#endif
