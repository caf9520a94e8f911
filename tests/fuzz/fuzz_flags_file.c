/* fuzz_flags_file.c - libFuzzer target: the kernel.flags reader (kc_flags_parse, any bytes,
 * NULs and CRs included) and the translation of what it accepts for NVRTC
 * (kc_flags_to_nvrtc). Accepted arguments hold only allowed characters. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "flags.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char why[512];
	struct kc_argv argv = {0}, nvrtc = {0};
	if (kc_flags_parse((const char *)data, size, &argv, why, sizeof(why)) == 0) {
		for (size_t i = 0; i < argv.n; i++)
			for (const char *p = argv.v[i]; *p; p++)
				if ((unsigned char)*p < 0x21 || (unsigned char)*p > 0x7e ||
				    strchr("$`;|&<>'\"()[]{}*?~!#\\", *p))
					abort();
		kc_flags_to_nvrtc(&argv, &nvrtc, why, sizeof(why));
	}
	kc_argv_free(&nvrtc);
	kc_argv_free(&argv);
	return 0;
}
