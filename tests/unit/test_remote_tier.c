/* test_remote_tier.c - the breaker of the cluster store, on a dir: store that is missing at
 * start (the store down) and made later (the store back): the waits between probes double
 * from KC_REMOTE_BREAKER_FIRST_S up to KC_REMOTE_BREAKER_S, a probe is one get, and the
 * first one answered closes the breaker. */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "remote_tier.h"
#include "tap.h"

#define RECIPE "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* One compile job's use of the tier: the fetch (a miss, or held off), then its finish. */
static void one_job(struct kc_remote_tier *t)
{
	struct kc_remote_job rj;
	if (kc_remote_tier_fetch(t, RECIPE, 1, NULL, &rj) == 1)
		kc_remote_job_free(&rj);
	else
		kc_remote_tier_finish(t, &rj, 0, 0, -1, NULL, 0);
}

static void schedule(void)
{
	double w = KC_REMOTE_BREAKER_FIRST_S, seen[8];
	for (int i = 0; i < 8; i++) {
		seen[i] = w;
		w = kc_remote_breaker_next_wait(w);
	}
	CHECK(seen[0] == 1 && seen[1] == 2 && seen[2] == 4 && seen[3] == 8 && seen[4] == 16,
	      "the waits between probes double from 1 s");
	CHECK(seen[5] == KC_REMOTE_BREAKER_S && seen[7] == KC_REMOTE_BREAKER_S,
	      "and stay at the cap, 30 s");
}

int main(void)
{
	char root[] = "/tmp/kc-tier-XXXXXX", store[64], url[80];
	struct kc_stats stats;
	struct kc_remote_tier *t = NULL;
	char why[400];

	schedule();
	memset(&stats, 0, sizeof(stats));
	if (!mkdtemp(root))
		return 1;
	snprintf(store, sizeof(store), "%s/store", root);
	snprintf(url, sizeof(url), "dir:%s", store);
	struct kc_remote_opts o = {.url = url, .timeout_ms = 2000};
	CHECK(kc_remote_tier_open(&o, &stats, &t, why,
				  sizeof(why)) == 0, "a dir: store that is not there yet opens");
	kc_remote_tier_probe(t, 1);
	double opened = now_s();
	CHECK(!kc_remote_tier_up(t) && atomic_load(&stats.remote_get_errors) == 1,
	      "the start probe finds it down: the breaker opens");

	/* Down still, and the first probe is not due: jobs are held off, the store not asked. */
	one_job(t);
	if (now_s() - opened < KC_REMOTE_BREAKER_FIRST_S)
		CHECK(atomic_load(&stats.remote_get_errors) == 1, "no probe before its time");
	sleep(KC_REMOTE_BREAKER_FIRST_S + 1);
	one_job(t); /* due: the probe fails, the next is due 2 s later */
	double probed = now_s();
	CHECK(!kc_remote_tier_up(t) && atomic_load(&stats.remote_get_errors) == 2,
	      "the due probe asks once, finds it down, keeps the breaker open");
	one_job(t);
	if (now_s() - probed < 2 * KC_REMOTE_BREAKER_FIRST_S)
		CHECK(atomic_load(&stats.remote_get_errors) == 2,
		      "the wait doubled: no probe 1 s after a failed one");

	/* The store is back: the next due probe closes the breaker, the job uses the store. */
	CHECK(mkdir(store, 0700) == 0, "the store is made");
	sleep(2 * KC_REMOTE_BREAKER_FIRST_S + 1);
	one_job(t);
	CHECK(kc_remote_tier_up(t), "the probe after the doubled wait closes the breaker");
	CHECK(atomic_load(&stats.remote_get_errors) == 2 &&
	      atomic_load(&stats.remote_lease_errors) == 0,
	      "and the job that probed went on to the store: its lookup and lease are no fault");

	kc_remote_tier_close(t);
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", root);
	if (system(cmd) != 0)
		fprintf(stderr, "could not remove %s\n", root);
	return tap_done();
}
