/* name.c - see name.h */
#include "name.h"

#include <limits.h>
#include <string.h>

#include "util.h"

#define ENTRY_PREFIX "kernel."
#define HASH_MIN 16
#define HASH_MAX 128

static int is_name_char(unsigned char c)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
	       c == '_' || c == '-';
}

static enum kc_name_kind bad(const char **why, const char *reason)
{
	if (why)
		*why = reason;
	return KC_NAME_BAD_ENTRY;
}

enum kc_name_kind kc_name_classify(const char *name, const char **why)
{
	size_t len = strlen(name);
	const size_t plen = sizeof(ENTRY_PREFIX) - 1;

	if (len < plen || strncmp(name, ENTRY_PREFIX, plen) != 0)
		return KC_NAME_PLAIN;
	if (len == plen)
		return bad(why, "empty kernel name and hash");
	if (kc_name_role(name) != KC_ROLE_PLAIN)
		return KC_NAME_PLAIN; /* a file name such as kernel.cu used as a directory */
	if (len > NAME_MAX)
		return bad(why, "longer than NAME_MAX");

	const char *dot = strrchr(name, '.');
	const char *kname = name + plen;
	if (dot < kname)
		return bad(why, "no '.' between name and hash");
	size_t nlen = (size_t)(dot - kname);
	size_t hlen = len - plen - nlen - 1;
	if (nlen == 0)
		return bad(why, "empty kernel name");
	for (size_t i = 0; i < nlen; i++)
		if (!is_name_char((unsigned char)kname[i]))
			return bad(why, "kernel name may hold only letters, digits, '_' and '-'");
	if (hlen < HASH_MIN || hlen > HASH_MAX)
		return bad(why, "hash must be 16 to 128 hex digits");
	if (!kc_hex_lower(dot + 1, hlen))
		return bad(why, "hash must be lowercase hex digits");
	return KC_NAME_ENTRY;
}

enum kc_role kc_name_role(const char *name)
{
	if (strcmp(name, KC_SOURCE_NAME) == 0)
		return KC_ROLE_SOURCE;
	if (strcmp(name, KC_FLAGS_NAME) == 0)
		return KC_ROLE_FLAGS;
	if (strcmp(name, KC_CUBIN_NAME) == 0)
		return KC_ROLE_CUBIN;
	if (strcmp(name, KC_LOG_NAME) == 0)
		return KC_ROLE_LOG;
	return KC_ROLE_PLAIN;
}

const char *kc_role_name(enum kc_role role)
{
	switch (role) {
	case KC_ROLE_SOURCE: return KC_SOURCE_NAME;
	case KC_ROLE_FLAGS: return KC_FLAGS_NAME;
	case KC_ROLE_CUBIN: return KC_CUBIN_NAME;
	case KC_ROLE_LOG: return KC_LOG_NAME;
	default: return "";
	}
}

int kc_role_is_staged(enum kc_role role)
{
	return role == KC_ROLE_SOURCE || role == KC_ROLE_FLAGS || role == KC_ROLE_CUBIN;
}
