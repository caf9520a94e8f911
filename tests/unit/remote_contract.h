/* remote_contract.h - the behaviour every cluster-store backend owes its callers
 * (remote.h), checked once and run against each backend: test_remote_dir.c (a directory)
 * and test_remote_redis.c (a Redis server). What is a backend's own (its layout, its
 * expiries on the server, its faults) stays in that backend's test. */
#ifndef KC_REMOTE_CONTRACT_H
#define KC_REMOTE_CONTRACT_H

#include "remote.h"

/* Run the contract's checks (TAP, through CHECK) on b, an open backend with no secret,
 * whose store may hold other keys: every key it uses is derived from tag, so run it once
 * per store with a tag of its own. Takes about ten seconds (expiries are waited for, at
 * most 20 s each). Leaves objects and expired leases behind. */
void remote_contract(struct kc_remote_backend *b, const char *tag);

/* Wait (at most 20 s) until a peek of key on b says want. Returns 1 when it did, else 0. */
int remote_wait_state(struct kc_remote_backend *b, const char *key, enum kc_lease_state want);

#endif
