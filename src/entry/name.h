/* name.h - the entry-name grammar and the roles of the files inside an entry.
 *
 * A kernel entry is a directory named kernel.<name>.<hash>: <name> is one or more of
 * [A-Za-z0-9_-], <hash> is 16 to 128 lowercase hex digits, the whole within NAME_MAX.
 * Pure functions: no I/O, no allocation.
 */
#ifndef KC_NAME_H
#define KC_NAME_H

enum kc_name_kind {
	KC_NAME_PLAIN,     /* an ordinary name */
	KC_NAME_ENTRY,     /* a valid kernel.<name>.<hash> */
	KC_NAME_BAD_ENTRY, /* starts with "kernel." and has no file suffix, but breaks the grammar */
};

/* Role of a file name inside a kernel entry. */
enum kc_role {
	KC_ROLE_PLAIN = 0,
	KC_ROLE_SOURCE, /* kernel.cu: staged source */
	KC_ROLE_FLAGS,  /* kernel.flags: staged compiler arguments */
	KC_ROLE_CUBIN,  /* kernel.cubin: the published binary */
	KC_ROLE_LOG,    /* kernel.log: output of the last compile */
};

#define KC_SOURCE_NAME "kernel.cu"
#define KC_FLAGS_NAME "kernel.flags"
#define KC_CUBIN_NAME "kernel.cubin"
#define KC_LOG_NAME "kernel.log"

/* Classify a directory name. For KC_NAME_BAD_ENTRY, *why (if why is not NULL) is set to a
 * static string that says which rule the name breaks. */
enum kc_name_kind kc_name_classify(const char *name, const char **why);

/* Role of a file called name inside an entry; KC_ROLE_PLAIN for any other name. */
enum kc_role kc_name_role(const char *name);

/* The file name of role inside an entry ("" for KC_ROLE_PLAIN): static. */
const char *kc_role_name(enum kc_role role);

/* Roles whose content is fixed once stored: written through a private stage and committed
 * at close or rename (source, flags, cubin). */
int kc_role_is_staged(enum kc_role role);

#endif
