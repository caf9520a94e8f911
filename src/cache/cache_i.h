/* cache_i.h - what the files of the hub share, and nothing else includes: cache.c (init,
 * lookup), entry.c (an entry's name, label and kernel.log), verify.c (published cubins
 * checked before they are served, the compiler's identity before a compile),
 * job.c (the compile job: fetch or compile, publish, share) and staging.c (staged files
 * checked and committed). The shape is libfuse's fuse_i.h: one private header beside the
 * public one (cache.h). */
#ifndef KC_CACHE_I_H
#define KC_CACHE_I_H

#include "cache.h"
#include "code.h"
#include "flags.h"
#include "recipe.h"
#include "remote_tier.h"

struct ahead_item;

/* One compile of an entry's recipe, queued by kc_cache_lookup_cubin for its leader, or a
 * compile ahead (ahead.c) of an entry of .kcachefs/ahead/entries/. */
struct compile_job {
	struct kc_cache *c;
	struct kc_flight_key key;
	int entry_fd;
	struct kc_recipe recipe;
	struct ahead_item *ahead; /* a compile ahead's item, or NULL: a client's compile */
	struct kc_slots *slots;   /* with a cluster store, the slots that bound this job's
				   * compiles (the clients' or the compiles ahead's), else NULL */
	atomic_int *group, *promote; /* a compile ahead's (compile.h), else NULL */
	double seconds;           /* the compiler's run, once it ran */
	int rejection;  /* the entry carried a rejection (another recipe's) when looked up */
	int transient; /* set by run_compile: the failure had a passing cause */
	/* Set by run_compile when a published compile is to be shared (share_fd >= 0): the
	 * cluster's part, run by share_published in c->shares (queued as the single flight
	 * is answered). */
	struct kc_remote_job rj;
	struct kc_argv args;  /* the compile's arguments (owned) */
	const char *compiler; /* cfg's */
	int share_fd;         /* the published cubin (owned), or -1 */
	struct compile_job *share_next, *share_prev; /* in c->shares_in_hand while shared */
	char label[512];
};

/* A recipe whose compile failed for a passing cause, held off until until (KC_RETRY_HOLDOFF). */
struct holdoff {
	struct holdoff *next;
	struct kc_flight_key key;
	char recipe[KC_SHA256_HEXLEN + 1];
	double until; /* CLOCK_MONOTONIC seconds */
};

/* The slots that bound compiles, or NULL where the pool's size does (no cluster store). */
static inline struct kc_slots *kc_cache_job_slots(struct kc_cache *c)
{
	return c->remote ? &c->slots : NULL;
}

/* verify.c */

/* Before a compile, and before its result is published or remembered: is the compiler on
 * disk still the one whose identity recipes are hashed with? A changed one is taken again
 * (identity.h), and every cubin is verified again at its next open, where one compiled
 * under another identity is stale (check_published). Returns kc_compiler_refresh's. */
int kc_cache_compiler_check(struct kc_cache *c);

/* Check the published cubin of an entry. Returns 0 (serve it), -ENOENT (none, or a bad or
 * stale one was removed so that the recipe is compiled again), -EIO (bad, cannot rebuild). */
int kc_cache_check_published(struct kc_cache *c, int entry_fd);

/* Remember the cubin behind fd as checked: this daemon has just published it, from bytes
 * it hashed into its record itself, under the recipe it checked under publish_lock. Its
 * first lookup then serves it without reading it back; a change since (its ctime or size
 * moved) has it checked again, as any cubin. Not remembered if the checked cubins were
 * dropped (a compiler change) since kc_cache_verified_epoch returned epoch, which the
 * publisher takes before it loads the recipe (that load may have used the old compiler). */
void kc_cache_mark_published(struct kc_cache *c, int fd, unsigned long epoch);

/* The count of droppings of the checked cubins so far (see kc_cache_mark_published). */
unsigned long kc_cache_verified_epoch(struct kc_cache *c);

/* Nonzero if the entry holds both kernel.cu and kernel.flags: a recipe the client staged
 * for the mount to compile. (With -o autocompile a kernel.cu alone is a recipe too, but an
 * entry like that holding a client's cubin is the older DeepGEMM sequence: the client's
 * cubin, compiled with the client's own flags, is the one to serve.) */
int kc_cache_staged_recipe(int entry_fd);

/* entry.c */

/* The name of the entry directory behind entry_fd, whole (a label is cut for logs).
 * Returns 0, or -ENAMETOOLONG when the kernel cannot give its path. */
int kc_cache_entry_name(struct kc_cache *c, int entry_fd, char name[256]);

/* Write kernel.log of the entry: head, then body_len bytes of body (may be NULL with 0),
 * atomically (a failure is logged, not returned): a reader sees the old log or the new one
 * whole, and a first log of at most KC_LOG_IN_PLACE bytes, created in place with one
 * write, empty or whole. */
#define KC_LOG_IN_PLACE 4096
void kc_cache_write_log(struct kc_cache *c, int entry_fd, const char *head, const char *body,
			size_t body_len);

/* job.c */

/* Passing failures are held off briefly: the kernel queues concurrent lookups of one name
 * and sends them one after another, and each would otherwise start its own compile.
 * Nonzero if key's recipe is held off now. */
int kc_cache_held_off(struct kc_cache *c, const struct kc_flight_key *key, const char *recipe);

/* A worker's compile job (arg: a struct compile_job, owned: freed when done). */
void kc_cache_compile_job(void *arg);

/* A compile ahead worker's job (arg: its struct ahead_item, owned by ahead.c). */
void kc_cache_ahead_job(void *arg);

/* ahead.c: compile ahead (code.h, history.h). Every function is a no-op, or says "none",
 * when c->ahead is NULL (-o ahead=0, or its directory could not be made). */

/* Open .kcachefs/ahead/ (histories and the entries compiled ahead) and start the compile
 * ahead workers: c->ahead. Returns 0, or -errno (logged; the mount goes on without it). */
int kc_cache_ahead_open(struct kc_cache *c);

/* Stop: compiles ahead not started are dropped (running ones end with every compile). */
void kc_cache_ahead_stop(struct kc_cache *c);

/* Stop and join the compile ahead workers (which may queue shares). */
void kc_cache_ahead_drain(struct kc_cache *c);

/* After every pool stopped, the shares' too (their history puts read it): free it. */
void kc_cache_ahead_close(struct kc_cache *c);

/* A client asked for the recipe r (keys k, code form blank/blen) and it was not published:
 * remember it in its context's history (saved in the backing directory; the store's is
 * kc_cache_ahead_share's), and when its shape is in another context's history, plan that
 * history's other recipes under this context's include roots: each is queued to run(item)
 * in the compile ahead workers (at most -o ahead= per trigger, each once). */
void kc_cache_ahead_note(struct kc_cache *c, const struct kc_recipe *r,
			 const struct kc_code *k, const char *blank, size_t blen, kc_job_fn run);

/* A client's recipe of context was compiled here (the cluster store had none) or taken
 * from a compile ahead: the context's history is put to the store (merged with the
 * store's), unless it was put since its last recipe came. A recipe fetched from the store
 * was put by the node that compiled it. */
void kc_cache_ahead_share(struct kc_cache *c, const char *context);

/* The entry compiled ahead under code, for a client's compile of that code: when a compile
 * ahead of it is queued, it is dropped (the client's compile runs now, never twice); when
 * one runs, this waits for it (after promoting it to the compiles' normal class). Returns
 * an O_PATH fd (the caller closes it) of the entry whose cubin is published and checked, or
 * -1: none, compile it. */
int kc_cache_ahead_wait(struct kc_cache *c, const char *code);

/* The compile ahead worker's start of item (a run's argument): waits until a job slot is
 * idle (no client's compile queued, fewer than -o jobs running in all), makes the entry,
 * and becomes its flight's leader. Returns the job to run (run_compile), or NULL when the
 * item was dropped (a client's compile took it, the mount stops, it failed: logged). */
struct compile_job *kc_cache_ahead_begin(struct ahead_item *it);

/* The end of a compile ahead begun with kc_cache_ahead_begin: result is run_compile's,
 * seconds the compiler's. Before its flight is finished. */
void kc_cache_ahead_end(struct kc_cache *c, struct ahead_item *it, int result, double seconds);

/* The compile ahead gauges into g. */
void kc_cache_ahead_gauges(struct kc_cache *c, struct kc_stats_gauges *g);

/* One use of a compile ahead by a client's compile (kc_cache_ahead_wait's entry published
 * into the client's): counted. */
void kc_cache_ahead_used(struct kc_cache *c, const char *code);

#endif
