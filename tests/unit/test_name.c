/* test_name.c - the entry-name grammar (kc_name_classify) and file roles (kc_name_role). */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "name.h"
#include "tap.h"

#define HEX16 "0123456789abcdef"
#define HEX64 HEX16 HEX16 HEX16 HEX16
#define HEX128 HEX64 HEX64

/* Classify name; check the kind, and for KC_NAME_BAD_ENTRY that a reason was given. */
static void expect(const char *name, enum kc_name_kind want, const char *what)
{
	const char *why = NULL;
	enum kc_name_kind got = kc_name_classify(name, &why);
	char msg[512];

	snprintf(msg, sizeof(msg), "%s", what);
	CHECK(got == want, msg);
	if (want == KC_NAME_BAD_ENTRY) {
		snprintf(msg, sizeof(msg), "%s: why is set", what);
		CHECK(why != NULL && why[0] != '\0', msg);
	}
}

/* Build "kernel.<name>.<hash>" where the name is klen 'k's and the hash has hexlen digits of
 * '0'-'f' (an empty string when buflen is too short for it). */
static void entry_name(char *buf, size_t buflen, size_t klen, size_t hexlen)
{
	buf[0] = '\0';
	if (klen + hexlen + 9 > buflen)
		return;
	memcpy(buf, "kernel.", 7);
	memset(buf + 7, 'k', klen);
	buf[7 + klen] = '.';
	for (size_t i = 0; i < hexlen; i++)
		buf[8 + klen + i] = HEX16[i % 16];
	buf[8 + klen + hexlen] = '\0';
}

static void test_valid(void)
{
	char name[1024];

	expect("kernel.gemm." HEX16, KC_NAME_ENTRY, "16 hex digits is an entry");
	expect("kernel.gemm." HEX128, KC_NAME_ENTRY, "128 hex digits is an entry");
	expect("kernel.gemm." HEX64, KC_NAME_ENTRY, "64 hex digits is an entry");
	expect("kernel.fp8_gemm-1d2d." HEX16, KC_NAME_ENTRY, "name with '_' and '-' is an entry");
	expect("kernel.GemmV2." HEX16, KC_NAME_ENTRY, "name with capitals and digits is an entry");
	expect("kernel.x." HEX16, KC_NAME_ENTRY, "one-character name is an entry");

	/* exactly NAME_MAX bytes is allowed; 128-digit hash, name padded to fill */
	entry_name(name, sizeof(name), NAME_MAX - strlen("kernel..") - 128, 128);
	CHECK(strlen(name) == NAME_MAX, "built a name of exactly NAME_MAX bytes");
	expect(name, KC_NAME_ENTRY, "a name of exactly NAME_MAX bytes is an entry");

	/* the classifier must not care about why being NULL */
	CHECK(kc_name_classify("kernel.gemm." HEX16, NULL) == KC_NAME_ENTRY,
	      "valid entry with why == NULL");
	CHECK(kc_name_classify("kernel.gemm.xyz", NULL) == KC_NAME_BAD_ENTRY,
	      "bad entry with why == NULL");

	/* why is not touched for a valid entry or a plain name */
	const char *why = "untouched";
	kc_name_classify("kernel.gemm." HEX16, &why);
	CHECK(strcmp(why, "untouched") == 0, "why left alone for a valid entry");
	kc_name_classify("notes.txt", &why);
	CHECK(strcmp(why, "untouched") == 0, "why left alone for a plain name");
}

static void test_plain(void)
{
	expect("notes.txt", KC_NAME_PLAIN, "unrelated name is plain");
	expect("gemm." HEX16, KC_NAME_PLAIN, "no kernel. prefix is plain");
	expect("Kernel.gemm." HEX16, KC_NAME_PLAIN, "prefix is case-sensitive");
	expect("kernel", KC_NAME_PLAIN, "'kernel' is plain");
	expect("kernelgemm." HEX16, KC_NAME_PLAIN, "'kernel' without the dot is plain");
	expect("", KC_NAME_PLAIN, "empty string is plain");
	expect(KC_SOURCE_NAME, KC_NAME_PLAIN, "kernel.cu is plain");
	expect(KC_CUBIN_NAME, KC_NAME_PLAIN, "kernel.cubin is plain");
	expect(KC_FLAGS_NAME, KC_NAME_PLAIN, "kernel.flags is plain");
	expect(KC_LOG_NAME, KC_NAME_PLAIN, "kernel.log is plain");
}

static void test_bad(void)
{
	char name[1024];

	expect("kernel.gemm.0123456789abcde", KC_NAME_BAD_ENTRY, "15 hex digits is a bad entry");
	expect("kernel.gemm." HEX128 "0", KC_NAME_BAD_ENTRY, "129 hex digits is a bad entry");
	expect("kernel.gemm.0123456789ABCDEF", KC_NAME_BAD_ENTRY, "uppercase hex is a bad entry");
	expect("kernel.gemm.0123456789abcdeF", KC_NAME_BAD_ENTRY,
	       "one uppercase hex digit is a bad entry");
	expect("kernel.gemm.0123456789abcdeg", KC_NAME_BAD_ENTRY, "non-hex 'g' is a bad entry");
	expect("kernel.gemm.0123456789abcde-", KC_NAME_BAD_ENTRY, "'-' in the hash is a bad entry");
	expect("kernel.gemm.", KC_NAME_BAD_ENTRY, "empty hash is a bad entry");
	expect("kernel.." HEX16, KC_NAME_BAD_ENTRY, "empty kernel name is a bad entry");
	expect("kernel." HEX16, KC_NAME_BAD_ENTRY, "no name/hash separator is a bad entry");
	expect("kernel.ge.mm." HEX16, KC_NAME_BAD_ENTRY, "'.' in the name is a bad entry");
	expect("kernel..", KC_NAME_BAD_ENTRY, "'kernel..' is a bad entry");
	expect("kernel..." HEX16, KC_NAME_BAD_ENTRY, "'..' as the name is a bad entry");
	expect("kernel.../" HEX16, KC_NAME_BAD_ENTRY, "'..' and '/' in the name is a bad entry");
	expect("kernel.g\xc3\xa9mm." HEX16, KC_NAME_BAD_ENTRY, "UTF-8 bytes in the name is a bad entry");
	expect("kernel.g mm." HEX16, KC_NAME_BAD_ENTRY, "a blank in the name is a bad entry");
	expect("kernel.gemm\n." HEX16, KC_NAME_BAD_ENTRY, "a newline in the name is a bad entry");

	/* NAME_MAX + 1 bytes, otherwise valid */
	entry_name(name, sizeof(name), NAME_MAX + 1 - strlen("kernel..") - 128, 128);
	CHECK(strlen(name) == NAME_MAX + 1, "built a name of NAME_MAX + 1 bytes");
	expect(name, KC_NAME_BAD_ENTRY, "a name longer than NAME_MAX is a bad entry");

	/* much longer than NAME_MAX with a short hash */
	entry_name(name, sizeof(name), 250, 16);
	CHECK(strlen(name) > NAME_MAX, "built a 274-byte name");
	expect(name, KC_NAME_BAD_ENTRY, "a 274-byte name is a bad entry");

	/* the reasons differ by rule */
	const char *why_len = NULL, *why_hex = NULL;
	kc_name_classify("kernel.gemm.0123456789abcde", &why_len);
	kc_name_classify("kernel.gemm.0123456789abcdeg", &why_hex);
	CHECK(why_len && why_hex && strcmp(why_len, why_hex) != 0,
	      "hash-length and hash-digit rules give different reasons");
}

static void test_roles(void)
{
	CHECK(kc_name_role("kernel.cu") == KC_ROLE_SOURCE, "kernel.cu is the source");
	CHECK(kc_name_role("kernel.flags") == KC_ROLE_FLAGS, "kernel.flags is the flags");
	CHECK(kc_name_role("kernel.cubin") == KC_ROLE_CUBIN, "kernel.cubin is the cubin");
	CHECK(kc_name_role("kernel.log") == KC_ROLE_LOG, "kernel.log is the log");
	CHECK(kc_name_role("kernel.cu~") == KC_ROLE_PLAIN, "kernel.cu~ is plain");
	CHECK(kc_name_role(".kernel.cu.swp") == KC_ROLE_PLAIN, ".kernel.cu.swp is plain");
	CHECK(kc_name_role("kernel.cubin.tmp") == KC_ROLE_PLAIN, "kernel.cubin.tmp is plain");
	CHECK(kc_name_role("Kernel.cu") == KC_ROLE_PLAIN, "Kernel.cu is plain");
	CHECK(kc_name_role("kernel.c") == KC_ROLE_PLAIN, "kernel.c is plain");
	CHECK(kc_name_role("kernel") == KC_ROLE_PLAIN, "kernel is plain");
	CHECK(kc_name_role("") == KC_ROLE_PLAIN, "empty name is plain");
	CHECK(kc_name_role("kernel.gemm." HEX16) == KC_ROLE_PLAIN, "an entry name is plain");

	CHECK(kc_role_is_staged(KC_ROLE_SOURCE), "source is staged");
	CHECK(kc_role_is_staged(KC_ROLE_FLAGS), "flags is staged");
	CHECK(kc_role_is_staged(KC_ROLE_CUBIN), "cubin is staged");
	CHECK(!kc_role_is_staged(KC_ROLE_LOG), "log is not staged");
	CHECK(!kc_role_is_staged(KC_ROLE_PLAIN), "plain is not staged");
}

int main(void)
{
	test_valid();
	test_plain();
	test_bad();
	test_roles();
	return tap_done();
}
