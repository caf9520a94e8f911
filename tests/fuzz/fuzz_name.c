/* fuzz_name.c - libFuzzer target: the entry-name grammar (kc_name_classify, kc_name_role).
 * Any bytes as a name: no crash, no undefined behaviour, and the verdicts agree with the
 * grammar's simple consequences (checked here, so a wrong answer stops the fuzzer too). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "name.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *name = malloc(size + 1);
	if (!name)
		return 0;
	memcpy(name, data, size);
	name[size] = '\0'; /* names are C strings: a NUL ends one */
	const char *why = NULL;
	enum kc_name_kind kind = kc_name_classify(name, &why);
	if (kind == KC_NAME_ENTRY) {
		/* an entry name: "kernel.", no '/', fits a directory entry */
		if (strncmp(name, "kernel.", 7) != 0 || strchr(name, '/') || strlen(name) > 255)
			abort();
	}
	if (kind == KC_NAME_BAD_ENTRY && !why)
		abort(); /* a refusal always says why */
	enum kc_role role = kc_name_role(name);
	if (role != KC_ROLE_PLAIN && strncmp(name, "kernel.", 7) != 0)
		abort();
	free(name);
	return 0;
}
