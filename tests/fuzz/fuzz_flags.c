/* fuzz_flags.c - libFuzzer target: the allow-list of compiler arguments (kc_flag_check) and
 * the -o flags= splitter (kc_flags_split). Whatever is accepted must hold only the
 * characters the allow-list permits: nvcc runs its sub-commands through a shell. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "flags.h"

static void check_safe(const char *arg)
{
	for (const char *p = arg; *p; p++)
		if (!strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.,=/+:@%",
			    *p))
			abort(); /* a shell character got through */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *text = malloc(size + 1), why[512];
	if (!text)
		return 0;
	memcpy(text, data, size);
	text[size] = '\0';
	if (kc_flag_check(text, why, sizeof(why)) == 0)
		check_safe(text);
	struct kc_argv argv = {0};
	if (kc_flags_split(text, &argv, why, sizeof(why)) == 0)
		for (size_t i = 0; i < argv.n; i++)
			check_safe(argv.v[i]);
	kc_argv_free(&argv);
	free(text);
	return 0;
}
