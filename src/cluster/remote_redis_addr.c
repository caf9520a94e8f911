/* remote_redis_addr.c - Redis URLs and the remote_auth= file (see remote_redis_addr.h). */
#include "remote_redis_addr.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "remote_shards.h"
#include "util.h"

#define AUTH_MAX 4096 /* bytes of a remote_auth= file */

/* ---- URLs ---- */

static int all_digits(const char *s, size_t n)
{
	if (!n)
		return 0;
	for (size_t i = 0; i < n; i++)
		if (s[i] < '0' || s[i] > '9')
			return 0;
	return 1;
}

/* A decimal number in s[0..n) without sign or leading zero, at most max. */
static int parse_uint(const char *s, size_t n, long max, long *out)
{
	long v = 0;

	if (!all_digits(s, n) || n > 10 || (n > 1 && s[0] == '0'))
		return -1;
	for (size_t i = 0; i < n; i++)
		v = v * 10 + (s[i] - '0');
	if (v > max)
		return -1;
	*out = v;
	return 0;
}

static int host_ok(const char *h, size_t n)
{
	if (n == 0 || n > 253 || h[0] == '-' || h[0] == '.' || h[n - 1] == '-')
		return 0;
	for (size_t i = 0; i < n; i++) {
		unsigned char c = h[i];
		if (!(isalnum(c) || c == '-' || c == '.' || c == '_'))
			return 0;
		if (c == '.' && i + 1 < n && h[i + 1] == '.')
			return 0;
	}
	return 1;
}

/* Refuse blanks, control characters, credentials and the characters a Redis URL of ours
 * never holds in shard idx's n bytes at s. Returns 0 or -EINVAL with why. */
static int check_url_chars(const char *s, size_t n, int idx, char *why, size_t whylen)
{
	for (size_t i = 0; i < n; i++) {
		unsigned char c = s[i];
		if (c <= ' ' || c == 0x7f) {
			snprintf(why, whylen,
				 "remote: shard %d: a blank or control character at offset %zu",
				 idx, i);
			return -EINVAL;
		}
		if (c == '@') {
			snprintf(why, whylen,
				 "remote: shard %d: credentials do not belong in the URL: put "
				 "\"USER PASSWORD\" in the file remote_auth= names",
				 idx);
			return -EINVAL;
		}
		if (c == '#' || c == '%') {
			snprintf(why, whylen,
				 "remote: shard %d: '%c' is not allowed in a Redis URL", idx, c);
			return -EINVAL;
		}
	}
	return 0;
}

/* The host of a redis:// URL at p (before end): "[IPv6]" or a name, into a->host (names
 * lowercased). Returns 0 with *rest after it, or -EINVAL with why. */
static int parse_tcp_host(const char *p, const char *end, int idx, struct kc_redis_addr *a,
			  const char **rest, char *why, size_t whylen)
{
	const char *hend;
	if (p < end && *p == '[') {
		char v6[INET6_ADDRSTRLEN];
		struct in6_addr in6;

		hend = memchr(p, ']', end - p);
		if (!hend || (size_t)(hend - p - 1) >= sizeof(v6)) {
			snprintf(why, whylen, "remote: shard %d: an IPv6 address is [ADDRESS]",
				 idx);
			return -EINVAL;
		}
		memcpy(v6, p + 1, hend - p - 1);
		v6[hend - p - 1] = 0;
		if (inet_pton(AF_INET6, v6, &in6) != 1) {
			snprintf(why, whylen, "remote: shard %d: \"%s\" is not an IPv6 address",
				 idx, v6);
			return -EINVAL;
		}
		strcpy(a->host, v6);
		*rest = hend + 1;
		return 0;
	}
	hend = p;
	while (hend < end && *hend != ':' && *hend != '/')
		hend++;
	if (!host_ok(p, hend - p)) {
		snprintf(why, whylen,
			 "remote: shard %d: no valid host after redis:// (letters, "
			 "digits, '-', '.', '_'; an IPv6 address in brackets)",
			 idx);
		return -EINVAL;
	}
	memcpy(a->host, p, hend - p);
	for (char *c = a->host; *c; c++)
		*c = tolower((unsigned char)*c);
	*rest = hend;
	return 0;
}

/* redis://HOST[:PORT][/DB], from after the scheme (p) to end. Returns 0 or -EINVAL. */
static int parse_tcp(const char *p, const char *end, int idx, struct kc_redis_addr *a, char *why,
		     size_t whylen)
{
	const char *q;
	long v;

	a->port = 6379;
	if (parse_tcp_host(p, end, idx, a, &q, why, whylen))
		return -EINVAL;
	if (q < end && *q == ':') {
		const char *pe = q + 1;
		while (pe < end && *pe != '/')
			pe++;
		if (parse_uint(q + 1, pe - q - 1, 65535, &v) || v == 0) {
			snprintf(why, whylen, "remote: shard %d: the port is a number 1..65535",
				 idx);
			return -EINVAL;
		}
		a->port = (int)v;
		q = pe;
	}
	if (q < end && *q == '/') {
		if (parse_uint(q + 1, end - q - 1, INT_MAX, &v)) {
			snprintf(why, whylen,
				 "remote: shard %d: after '/' comes the database number "
				 "(0, 1, ...) and nothing else",
				 idx);
			return -EINVAL;
		}
		a->db = (int)v;
		q = end;
	}
	if (q != end) {
		snprintf(why, whylen, "remote: shard %d: unexpected '%c' after the host", idx, *q);
		return -EINVAL;
	}
	snprintf(a->canon, sizeof(a->canon),
		 strchr(a->host, ':') ? "redis://[%s]:%d/%d" : "redis://%s:%d/%d", a->host, a->port,
		 a->db);
	return 0;
}

/* redis+unix:///PATH[?db=N], from after the scheme (p) to end. Returns 0 or -EINVAL. */
static int parse_unix(const char *p, const char *end, int idx, struct kc_redis_addr *a, char *why,
		      size_t whylen)
{
	const char *qm = memchr(p, '?', end - p);
	const char *pend = qm ? qm : end;
	long v;

	a->is_unix = 1;
	if (p == end || *p != '/') {
		snprintf(why, whylen,
			 "remote: shard %d: a Unix socket URL has no host: "
			 "redis+unix:///ABSOLUTE/PATH",
			 idx);
		return -EINVAL;
	}
	if (pend - p < 2 || pend[-1] == '/') {
		snprintf(why, whylen, "remote: shard %d: no socket path after redis+unix://", idx);
		return -EINVAL;
	}
	if ((size_t)(pend - p) >= sizeof(a->path)) {
		snprintf(why, whylen, "remote: shard %d: the socket path is longer than %zu bytes",
			 idx, sizeof(a->path) - 1);
		return -EINVAL;
	}
	memcpy(a->path, p, pend - p);
	if (qm) {
		if (end - qm < 4 || memcmp(qm, "?db=", 4) ||
		    parse_uint(qm + 4, end - qm - 4, INT_MAX, &v)) {
			snprintf(why, whylen, "remote: shard %d: the only query is ?db=N", idx);
			return -EINVAL;
		}
		a->db = (int)v;
	}
	snprintf(a->canon, sizeof(a->canon), "redis+unix://%s?db=%d", a->path, a->db);
	return 0;
}

int kc_redis_addr_parse(const char *s, size_t n, int idx, struct kc_redis_addr *a, char *why,
			size_t whylen)
{
	static const char tcp[] = "redis://", unx[] = "redis+unix://";

	memset(a, 0, sizeof(*a));
	if (n == 0) {
		snprintf(why, whylen, "remote: shard %d is empty (URLs are joined by a single '|')",
			 idx);
		return -EINVAL;
	}
	if (check_url_chars(s, n, idx, why, whylen))
		return -EINVAL;
	if (n >= sizeof(tcp) - 1 && !memcmp(s, tcp, sizeof(tcp) - 1))
		return parse_tcp(s + sizeof(tcp) - 1, s + n, idx, a, why, whylen);
	if (n >= sizeof(unx) - 1 && !memcmp(s, unx, sizeof(unx) - 1))
		return parse_unix(s + sizeof(unx) - 1, s + n, idx, a, why, whylen);
	if (n >= 9 && !memcmp(s, "rediss://", 9))
		snprintf(why, whylen,
			 "remote: shard %d: TLS (rediss://) is not supported: use a Unix "
			 "socket, or a tunnel to a loopback port",
			 idx);
	else
		snprintf(why, whylen,
			 "remote: shard %d: not a Redis URL: redis://HOST[:PORT][/DB] or "
			 "redis+unix:///PATH[?db=N]",
			 idx);
	return -EINVAL;
}

int kc_redis_parse(const char *url, struct kc_redis_addr **addrs, char *why, size_t whylen)
{
	struct kc_remote_piece pieces[KC_REMOTE_MAX_SHARDS];
	struct kc_redis_addr *a;
	int n = kc_remote_shards_split(url, pieces, why, whylen);

	*addrs = NULL;
	if (n < 0)
		return n;
	a = calloc((size_t)n, sizeof(*a));
	if (!a)
		return -ENOMEM;
	for (int i = 0; i < n; i++) {
		int rc = kc_redis_addr_parse(pieces[i].s, pieces[i].n, i + 1, &a[i], why, whylen);

		if (rc) {
			free(a);
			return rc;
		}
		for (int j = 0; j < i; j++)
			if (!strcmp(a[j].canon, a[i].canon)) {
				snprintf(why, whylen, "remote: shards %d and %d are the same (%s)",
					 j + 1, i + 1, a[i].canon);
				free(a);
				return -EINVAL;
			}
	}
	*addrs = a;
	return n;
}

/* ---- the auth file ---- */

int kc_redis_auth_read(const char *path, char **user, char **pass, char *why, size_t whylen)
{
	char *buf, *w1, *w2, *w3, *save = NULL;
	size_t got;
	int rc;

	*user = *pass = NULL;
	rc = kc_secret_read("remote_auth", path, AUTH_MAX, &buf, &got, why, whylen);
	if (rc)
		return rc;
	rc = -EINVAL;
	if (strlen(buf) != got) {
		snprintf(why, whylen, "remote_auth: %s holds a NUL byte", path);
		goto out;
	}
	if (strpbrk(buf, "\r\n")) {
		snprintf(why, whylen,
			 "remote_auth: %s has more than one line (\"USER PASSWORD\" or "
			 "\"PASSWORD\")",
			 path);
		goto out;
	}
	w1 = strtok_r(buf, " \t", &save);
	w2 = w1 ? strtok_r(NULL, " \t", &save) : NULL;
	w3 = w2 ? strtok_r(NULL, " \t", &save) : NULL;
	if (!w1 || w3) {
		snprintf(why, whylen,
			 "remote_auth: %s must hold one line: \"USER PASSWORD\" or "
			 "\"PASSWORD\" (%s)",
			 path, w1 ? "more than two words" : "it is empty");
		goto out;
	}
	*user = w2 ? strdup(w1) : NULL;
	*pass = strdup(w2 ? w2 : w1);
	if (!*pass || (w2 && !*user)) {
		free(*user);
		free(*pass);
		*user = *pass = NULL;
		rc = -ENOMEM;
		goto out;
	}
	rc = 0;
out:
	kc_secret_free(buf, got);
	return rc;
}
