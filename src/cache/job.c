/* job.c - the compile job: fetch from the cluster store or compile, publish, share (cache_i.h) */
#define _GNU_SOURCE
#include "cache_i.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "io.h"
#include "key.h"
#include "log.h"
#include "reqtimeout.h"
#include "util.h"

#define KC_MAX_CUBIN_READ (256u << 20) /* bytes of a cubin compiled ahead read back */

/* Passing failures are held off briefly: the kernel queues concurrent lookups of one name
 * and sends them one after another, and each would otherwise start its own compile. */
int kc_cache_held_off(struct kc_cache *c, const struct kc_flight_key *key, const char *recipe)
{
	double now = kc_mono_s();
	int found = 0;

	pthread_mutex_lock(&c->holdoff_lock);
	for (struct holdoff **p = &c->holdoffs; *p;) {
		struct holdoff *h = *p;
		if (h->until <= now) {
			*p = h->next;
			free(h);
			continue;
		}
		if (h->key.dev == key->dev && h->key.ino == key->ino &&
		    strcmp(h->recipe, recipe) == 0)
			found = 1;
		p = &h->next;
	}
	pthread_mutex_unlock(&c->holdoff_lock);
	return found;
}

static void hold_off(struct kc_cache *c, const struct kc_flight_key *key, const char *recipe)
{
	struct holdoff *h = malloc(sizeof(*h));
	if (!h)
		return;
	h->key = *key;
	snprintf(h->recipe, sizeof(h->recipe), "%s", recipe);
	h->until = kc_mono_s() + KC_RETRY_HOLDOFF;
	pthread_mutex_lock(&c->holdoff_lock);
	h->next = c->holdoffs;
	c->holdoffs = h;
	pthread_mutex_unlock(&c->holdoff_lock);
}

/* 0 if the entry's recipe is still the one j loaded, else -EAGAIN; publish_lock held.
 * Its files are read and hashed again: a change need not pass through kc_cache_unstage
 * (the entry renamed to a plain name, its kernel.cu written as a plain file, and renamed
 * back; or a hard link of kernel.cu made before it was staged), so no counter of unstages
 * can stand for this read. */
static int recipe_kept(struct compile_job *j)
{
	struct kc_cache *c = j->c;
	struct kc_recipe now;
	if (kc_recipe_load(j->entry_fd, c->cfg, &now) != 0)
		return -EAGAIN;
	int err = strcmp(now.hash, j->recipe.hash) == 0 ? 0 : -EAGAIN;
	kc_recipe_free(&now);
	return err;
}

/* Publish a checked cubin (fd, the daemon's temporary tmp_name in tmp/) into the entry.
 * fetched NULL: this node's compile, fsync'ed with the entry so that it survives a power
 * loss, and published only if the compiler on disk is still the one that ran. Else a cubin
 * fetched from the cluster store, whose fetched_len bytes fd holds (hashed from memory,
 * not read back): no fsyncs (a fetch is cheap to repeat, and its fsyncs
 * were half of a fetch's time: a power loss may lose it, or leave a torn one, which the
 * record check at the first lookup after the start (check_published) removes, and it is
 * fetched again), and no compiler check (none ran here; a compiler changed since the
 * lookup makes the cubin stale at its next lookup, as any). Returns 0, -EAGAIN (the recipe
 * or compiler changed meanwhile: nothing published) or -EIO. */
static int publish(struct compile_job *j, int fd, const char *tmp_name, const char *label,
		   uint64_t *bytes, const void *fetched, size_t fetched_len)
{
	struct kc_cache *c = j->c;
	struct kc_record rec = {.origin = KC_ORIGIN_COMPILED, .size = fetched_len};
	char key[KC_SHA256_HEXLEN + 1];
	int compiled = !fetched;
	int err = compiled ? kc_sha256_fd(fd, rec.sha256, &rec.size)
			   : kc_sha256_buf(fetched, fetched_len, rec.sha256);
	strcpy(rec.recipe, j->recipe.hash);
	if (!err)
		err = kc_record_write(fd, &rec);
	if (!err)
		err = kc_key_compute(j->recipe.source, j->recipe.source_len, j->recipe.flags,
				     j->recipe.flags_len, key);
	if (!err)
		err = kc_key_record_write(fd, key);
	if (!err && (fchmod(fd, 0444) != 0 || (compiled && fsync(fd) != 0)))
		err = -errno;
	if (err) {
		kc_log(KC_LOG_ERR, "%s: cannot prepare cubin for publishing: %s", label,
		       strerror(-err));
		return -EIO;
	}
	*bytes = rec.size;
	/* The compiler that ran must be the one the recipe was hashed with: swapped during
	 * the compile, its output is not this recipe's (and is compiled again). */
	int unsure = compiled && kc_cache_compiler_check(c) < 0;
	pthread_mutex_lock(&c->publish_lock);
	unsigned long epoch = kc_cache_verified_epoch(c); /* before the recipe's identity */
	err = unsure ? -EAGAIN : recipe_kept(j);
	if (!err && renameat2(c->store->tmp_fd, tmp_name, j->entry_fd, KC_CUBIN_NAME,
			      RENAME_NOREPLACE) != 0) {
		err = errno == EEXIST ? 0 : -errno;
		if (!err) /* a client published first: ours is not needed */
			unlinkat(c->store->tmp_fd, tmp_name, 0);
	} else if (!err) {
		kc_cache_mark_published(c, fd, epoch); /* its ctime as the rename left it */
	}
	pthread_mutex_unlock(&c->publish_lock);
	if (err == -EAGAIN) {
		kc_log(KC_LOG_INFO, "%s: recipe or compiler changed during the compile; result "
		       "discarded", label);
		return err;
	}
	if (err) {
		kc_log(KC_LOG_ERR, "%s: cannot publish cubin: %s", label, strerror(-err));
		return -EIO;
	}
	if (compiled)
		kc_store_sync_dir(j->entry_fd);
	if (j->rejection) /* another recipe's, or the compiler's before it changed */
		kc_store_clear_rejected(j->entry_fd);
	return 0;
}

/* Publish a cubin fetched from the cluster store (rj, verified) through the temporary
 * out_fd/out_name, as a compile's is published. Returns publish's result. */
static int publish_fetched(struct compile_job *j, struct kc_remote_job *rj, int out_fd,
			   const char *out_name, const char *label)
{
	char head[2048];
	uint64_t bytes = 0;
	int result = kc_write_all(out_fd, rj->obj.cubin, rj->obj.cubin_len) == 0
			     ? publish(j, out_fd, out_name, label, &bytes, rj->obj.cubin,
				       rj->obj.cubin_len)
			     : -EIO;
	char named[512] = "";
	/* A path of the compiling node's in the bytes (__FILE__ in device code, DeepGEMM's
	 * DG_DEVICE_ASSERT): accepted, as ccache's base_dir accepts it, and said; -o key_paths
	 * keeps the include roots' paths in the key instead. A few stats of this node's own
	 * headers, after the publish. */
	struct kc_argv roots = {0};
	if (result == 0 && kc_tree_roots(j->recipe.flags, j->recipe.flags_len, &roots) == 0 &&
	    kc_cubin_foreign_path(rj->obj.cubin, rj->obj.cubin_len, &roots, named,
				  sizeof(named)) == 1)
		atomic_fetch_add(&j->c->stats.remote_foreign_paths, 1);
	kc_argv_free(&roots);
	snprintf(head, sizeof(head), "kcachefs: compile %s: %s from the cluster store (%s), "
		 "%zu bytes, not compiled here%s%.300s%s\n", label,
		 result == 0 ? "fetched" : "fetched but not published", rj->where,
		 rj->obj.cubin_len, named[0] ? "; it names " : "", named,
		 named[0] ? ", a path of the node that compiled it, not of this one (accepted: "
			    "-o key_paths keeps include paths in the key)" : "");
	if (result != -EAGAIN)
		kc_cache_write_log(j->c, j->entry_fd, head, NULL, 0);
	kc_log(result == 0 ? KC_LOG_INFO : KC_LOG_WARN, "%.*s", (int)strlen(head) - 11, head + 10);
	j->transient = result == -EIO;
	return result;
}

/* Publish the cubin compiled ahead in the entry ahead_fd (published and checked there,
 * kc_cache_ahead_wait) into j's entry, through the temporary out_fd/out_name, as a fetch is
 * published. Returns publish's result, or -EIO when it cannot be read. */
static int publish_ahead(struct compile_job *j, int ahead_fd, const char *code, int out_fd,
			 const char *out_name, const char *label)
{
	char head[1024], *buf = NULL;
	size_t len = 0;
	uint64_t bytes = 0;
	int fd = openat(ahead_fd, KC_CUBIN_NAME, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
	int result = fd < 0 ? -EIO : kc_read_all(fd, KC_MAX_CUBIN_READ, &buf, &len) ? -EIO : 0;
	if (fd >= 0)
		close(fd);
	if (!result)
		result = kc_write_all(out_fd, buf, len) == 0
				 ? publish(j, out_fd, out_name, label, &bytes, buf, len)
				 : -EIO;
	free(buf);
	snprintf(head, sizeof(head), "kcachefs: compile %s: %s from its compile ahead (code %.16s), "
		 "%zu bytes, not compiled again\n", label,
		 result == 0 ? "published" : "not published", code, len);
	if (result != -EAGAIN)
		kc_cache_write_log(j->c, j->entry_fd, head, NULL, 0);
	kc_log(result == 0 ? KC_LOG_INFO : KC_LOG_WARN, "%.*s", (int)strlen(head) - 11, head + 10);
	if (result == 0)
		kc_cache_ahead_used(j->c, code);
	return result;
}

/* A recipe the mount will not compile (its flags, or a backend it lacks): kernel.log says why
 * (head, one line), the recipe is marked rejected, and the failure counted and logged. */
static int refuse_recipe(struct compile_job *j, const char *label, const char *head)
{
	kc_cache_write_log(j->c, j->entry_fd, head, NULL, 0);
	kc_store_mark_rejected(j->entry_fd, j->recipe.hash);
	atomic_fetch_add(&j->c->stats.compile_failures, 1);
	kc_log(KC_LOG_WARN, "compile %s: %.*s", label, (int)strlen(head) - 11, head + 10);
	return -EIO;
}

/* The compile's arguments into args (empty on entry; the caller frees it): the mount's
 * flags, the entry's kernel.flags, and the mount's architecture unless they name one; the
 * backend the entry asks for (else the mount's, -o compiler=) is taken out of them into
 * *nvrtc. Returns 0, or -EIO (refused with refuse_recipe, or out of memory). */
static int compile_args(struct compile_job *j, const char *label, struct kc_argv *args,
			int *nvrtc)
{
	const struct kc_config *cfg = j->c->cfg;
	struct kc_argv eflags = {0};
	char why[512], head[700];

	if (kc_flags_parse(j->recipe.flags, j->recipe.flags_len, &eflags, why, sizeof(why))) {
		snprintf(head, sizeof(head), "kcachefs: kernel.flags %s\n", why);
		return refuse_recipe(j, label, head);
	}
	int err = kc_argv_extend(args, &cfg->mount_flags) || kc_argv_extend(args, &eflags) ||
		  (!kc_flags_have_arch(args) &&
		   (snprintf(why, sizeof(why), "--gpu-architecture=%s", cfg->arch),
		    kc_argv_push(args, why)));
	kc_argv_free(&eflags);
	if (err)
		return -EIO;
	const char *backend = kc_flags_backend(args);
	*nvrtc = backend ? strcmp(backend, "nvrtc") == 0 : cfg->backend_nvrtc;
	if (*nvrtc && !cfg->nvrtc) {
		snprintf(head, sizeof(head), "kcachefs: kernel.flags asks for NVRTC (%snvrtc), which "
			 "this kcachefs was built without\n", KC_FLAG_BACKEND);
		return refuse_recipe(j, label, head);
	}
	for (size_t i = 0; i < args->n;) { /* the choice is the mount's, not a compiler flag */
		if (strncmp(args->v[i], KC_FLAG_BACKEND, strlen(KC_FLAG_BACKEND)) != 0) {
			i++;
			continue;
		}
		free(args->v[i]);
		memmove(&args->v[i], &args->v[i + 1], (args->n - i) * sizeof(*args->v));
		args->n--;
	}
	return 0;
}

/* Run the compiler of spec, after checking that the include roots the recipe names by
 * content hold those bytes now: the key (key.h) is theirs, whatever the path (a tree changed
 * since it was staged fails this compile as a transient one; a new stage names its new
 * bytes). Fills out (the caller frees it). */
static void compile_checked(struct compile_job *j, const char *label,
			    const struct kc_compile_spec *spec, struct kc_compile_outcome *out)
{
	struct kc_cache *c = j->c;
	char why[512];
	int roots = kc_tree_check_roots(j->recipe.flags, j->recipe.flags_len, c->tree_memo, why,
					 sizeof(why));
	if (roots) {
		memset(out, 0, sizeof(*out));
		out->status = KC_COMPILE_TRANSIENT;
		snprintf(out->why, sizeof(out->why), "%.255s", why);
	} else if (kc_compile_run(spec, out) != 0) {
		out->status = KC_COMPILE_TRANSIENT;
		snprintf(out->why, sizeof(out->why), "out of memory");
	}
	if (!roots)
		kc_stats_observe_compile(&c->stats, out->seconds);
	if (out->timed_out)
		atomic_fetch_add(&c->stats.compile_timeouts, 1);
	kc_log(KC_LOG_DEBUG, "compile %s: compiler ran %.2f s: %s", label, out->seconds, out->why);
}

/* What a compile that ran comes to, in kernel.log (with the compiler's output) and the
 * daemon's log: published, not published, rejected or failed, in how long, with which
 * compiler and arch, and, where a kernel request timeout cut compile_timeout and the compile
 * ran out of it, which sysctls to set. A rejection is remembered; -EAGAIN (the recipe or the
 * compiler changed meanwhile) writes no kernel.log. */
static void report_compile(struct compile_job *j, const char *label,
			   const struct kc_compile_outcome *out, int result, const char *compiler,
			   const char *arch)
{
	const struct kc_config *cfg = j->c->cfg;
	char head[1536];
	const char *kind = out->status == KC_COMPILE_OK
				   ? (result == 0 ? "published" : "not published")
				   : out->status == KC_COMPILE_REJECTED ? "rejected" : "failed";
	snprintf(head, sizeof(head), "kcachefs: compile %s: %s (%s) in %.2f s with %s, arch %s\n",
		 label, kind, out->why, out->seconds, compiler, arch);
	if (out->timed_out && cfg->compile_timeout_asked) {
		size_t hl = strlen(head);
		snprintf(head + hl, sizeof(head) - hl, "kcachefs: the compile timeout is %u s, not "
			 "compile_timeout=%u, because the kernel aborts this mount when a request "
			 "waits %u s (sysctls fs.fuse.default_request_timeout and "
			 "fs.fuse.max_request_timeout): set them to 0 (off) or to at least %u and "
			 "remount, for compiles that long\n", cfg->compile_timeout,
			 cfg->compile_timeout_asked, cfg->request_timeout,
			 kc_reqtimeout_needed(cfg->compile_timeout_asked + 1));
	}
	if (result != -EAGAIN)
		kc_cache_write_log(j->c, j->entry_fd, head, out->log, out->log_len);
	if (out->status == KC_COMPILE_REJECTED && result != -EAGAIN)
		kc_store_mark_rejected(j->entry_fd, j->recipe.hash);
	kc_log(result == 0 ? KC_LOG_INFO : KC_LOG_WARN, "%.*s", (int)strlen(head) - 11, head + 10);
}

/* The job of a recipe's leader: fetch its cubin from the cluster store, or compile it, and
 * publish it. Returns 0 (published), -EAGAIN (the recipe or compiler changed meanwhile: the
 * waiters look again) or -EIO; j->transient says whether the failure may pass. */
static int run_compile(struct compile_job *j)
{
	struct kc_cache *c = j->c;
	const struct kc_config *cfg = c->cfg;
	struct kc_argv args = {0};
	struct kc_compile_outcome out;
	char label[512], scratch[4200], arch[32];
	uint64_t bytes = 0;
	int result, nvrtc = 0;

	kc_cache_entry_label(c, j->entry_fd, label, sizeof(label));
	if (__atomic_load_n(&c->stopped, __ATOMIC_SEQ_CST)) {
		/* Queued at a stop: its waiters are answered now, without asking a store that
		 * may not answer for remote_timeout. */
		j->transient = 1;
		return -EIO;
	}
	if (compile_args(j, label, &args, &nvrtc) != 0) {
		kc_argv_free(&args);
		return -EIO;
	}
	snprintf(arch, sizeof(arch), "%.31s", kc_flags_arch(&args));
	const char *compiler = nvrtc ? cfg->nvrtc : cfg->nvcc;

	char out_name[64];
	int scratch_fd = -1;
	int out_fd = kc_store_tmpfile(c->store, 0600, out_name);
	if (out_fd < 0) {
		kc_log(KC_LOG_ERR, "compile %s: cannot create the cubin's temporary: %s", label,
		       strerror(-out_fd));
		kc_argv_free(&args);
		atomic_fetch_add(&c->stats.compile_failures, 1);
		return -EIO;
	}
	/* The code key (code.h) names what the compiler sees: the cluster store's key and the
	 * compiles ahead's, so that sources that differ only in comments are one compile. */
	struct kc_code code;
	char *blank = NULL, compiler_id[KC_COMPILER_ID_MAX];
	size_t blen = 0;
	kc_config_compiler_id(cfg, compiler_id);
	int coded = kc_code_keys(j->recipe.source, j->recipe.source_len, j->recipe.flags,
				 j->recipe.flags_len, cfg, compiler_id, &code, &blank, &blen) == 1;
	if (coded && !j->ahead && c->ahead) {
		kc_cache_ahead_note(c, &j->recipe, &code, blank, blen, kc_cache_ahead_job);
		int afd = kc_cache_ahead_wait(c, code.code);
		result = afd < 0 ? -ENOENT : publish_ahead(j, afd, code.code, out_fd, out_name, label);
		if (afd >= 0)
			close(afd);
		if (result == 0 || result == -EAGAIN) {
			if (result == 0)
				kc_cache_ahead_share(c, code.context);
			free(blank);
			kc_argv_free(&args);
			goto done;
		}
	}
	free(blank);
	struct kc_remote_job rj;
	if (kc_remote_tier_fetch(c->remote, coded ? code.code : j->recipe.hash, !nvrtc, j->slots,
				 &rj) == 1) {
		kc_argv_free(&args);
		result = publish_fetched(j, &rj, out_fd, out_name, label);
		kc_remote_job_free(&rj);
		goto done;
	}
	/* Nothing to fetch: lookups that waited for a fetch are answered now (their readers
	 * wait for the compile as pending inodes, holding no directory lock). */
	kc_flight_compiling(&c->flights, &j->key);
	if (coded && !j->ahead) /* compiled here: the cluster's history of it is this node's */
		kc_cache_ahead_share(c, code.context);
	rj.flags = j->recipe.flags; /* its include roots stay out of the header list */
	rj.flags_len = j->recipe.flags_len;
	clock_gettime(CLOCK_REALTIME_COARSE, &rj.since); /* a file changed after this: no evidence */
	/* Holding a job slot from here on. The scratch directory only for a compile: a fetch
	 * needs none. */
	scratch_fd = kc_store_scratch(c->store, scratch, sizeof(scratch));
	if (scratch_fd < 0) {
		kc_log(KC_LOG_ERR, "compile %s: cannot create scratch directory: %s", label,
		       strerror(-scratch_fd));
		kc_remote_tier_finish(c->remote, &rj, 0, 0, out_fd, NULL, 0);
		if (j->slots)
			kc_slots_release(j->slots);
		kc_argv_free(&args);
		close(out_fd);
		unlinkat(c->store->tmp_fd, out_name, 0);
		atomic_fetch_add(&c->stats.compile_failures, 1);
		return -EIO;
	}
	struct kc_compile_spec spec = {
		.nvcc = compiler, .args = &args, .source = j->recipe.source,
		.source_len = j->recipe.source_len, .scratch = scratch, .scratch_fd = scratch_fd,
		.timeout_s = cfg->compile_timeout, .first_uid = cfg->compile_uids,
		.ns_flags = cfg->ns_flags, .out_fd = out_fd, .pool = c->nvrtc,
		.warm = nvrtc && !j->ahead, .compiler_gen = j->recipe.compiler_gen,
		.idle = j->ahead != NULL, .group = j->group, .promote = j->promote,
	};
	compile_checked(j, label, &spec, &out);
	j->seconds = out.seconds;

	result = -EIO;
	if (out.status == KC_COMPILE_REJECTED &&
	    (kc_cache_compiler_check(c) < 0 ||
	     kc_compiler_generation(cfg->compiler) != j->recipe.compiler_gen)) {
		/* A rejection is remembered for the compiler that gave it, and that one is gone:
		 * the waiters look again and the compiler there now compiles. */
		kc_log(KC_LOG_INFO, "compile %s: compiler changed during the compile; its "
		       "rejection discarded", label);
		result = -EAGAIN;
	} else if (out.status == KC_COMPILE_OK) {
		result = publish(j, out_fd, out_name, label, &bytes, NULL, 0);
		if (result == 0) {
			atomic_fetch_add(&c->stats.compiles, 1);
			atomic_fetch_add(&c->stats.published_bytes, bytes);
		}
	}
	if (result == 0 && kc_remote_tier_shares(c->remote, &rj) &&
	    (j->share_fd = fcntl(out_fd, F_DUPFD_CLOEXEC, 0)) >= 0) {
		/* shared after the openers have their cubin (share_published), the lease kept */
		kc_remote_job_move(&j->rj, &rj); /* rj's frame ends before the share */
		j->args = args;
		args = (struct kc_argv){0};
		j->compiler = compiler;
		snprintf(j->label, sizeof(j->label), "%s", label);
	} else {
		kc_remote_tier_finish(c->remote, &rj, 0, out.status == KC_COMPILE_REJECTED,
				      out_fd, NULL, 0);
	}
	kc_argv_free(&args);
	if (j->slots)
		kc_slots_release(j->slots);
	if (result != 0 && result != -EAGAIN)
		atomic_fetch_add(&c->stats.compile_failures, 1);
	report_compile(j, label, &out, result, compiler, arch);
	j->transient = out.status != KC_COMPILE_REJECTED && result == -EIO;
	kc_compile_outcome_free(&out);
done:
	close(out_fd);
	if (result != 0)
		unlinkat(c->store->tmp_fd, out_name, 0);
	if (scratch_fd >= 0) {
		close(scratch_fd);
		kc_store_remove_tree(scratch);
	}
	if (result == 0 && c->evict && !j->ahead) /* entries compiled ahead are ahead.c's */
		kc_evict_note_fd(c->evict, j->entry_fd);
	return result;
}

/* The cluster's part of a published compile: the dependency pass (the same compile again,
 * traced, compile.h) gives the list of what the toolchain looked up, then the object and
 * index are put and the lease released. Runs in c->shares after the openers were answered and holds no
 * job slot nor compile worker: the node's next compile need not wait for it. A pass that fails only means "not shared":
 * the published cubin stays, the lease is released, so another node compiles. */
static void share_published(struct compile_job *j)
{
	struct kc_cache *c = j->c;
	const struct kc_config *cfg = c->cfg;
	struct kc_compile_outcome out = {.status = KC_COMPILE_TRANSIENT};
	char scratch[4200];
	int scratch_fd = kc_store_scratch(c->store, scratch, sizeof(scratch));
	struct kc_compile_spec spec = {
		.nvcc = j->compiler, .args = &j->args, .source = j->recipe.source,
		.source_len = j->recipe.source_len, .scratch = scratch, .scratch_fd = scratch_fd,
		.timeout_s = cfg->compile_timeout, .first_uid = cfg->compile_uids,
		.ns_flags = cfg->ns_flags, .out_fd = -1, .deps_only = 1, .pool = c->nvrtc,
		.tracer = cfg->tracer,
	};
	if (scratch_fd < 0)
		snprintf(out.why, sizeof(out.why), "no scratch directory: %s", strerror(-scratch_fd));
	else if (kc_compile_run(&spec, &out) != 0)
		snprintf(out.why, sizeof(out.why), "out of memory");
	if (out.status == KC_COMPILE_OK)
		kc_log(KC_LOG_DEBUG, "compile %s: dependency pass ran %.2f s", j->label, out.seconds);
	else if (atomic_load(&c->shares_cut))
		kc_log(KC_LOG_WARN, "cluster store: %s not shared: the daemon stopped before "
		       "its dependency pass ended (-o stop_timeout=%u); its lease is released, "
		       "so another node compiles it", j->label, cfg->stop_timeout);
	else
		kc_log(KC_LOG_WARN, "cluster store: %s not shared: its dependency pass %s",
		       j->label, out.why);
	kc_remote_tier_finish(c->remote, &j->rj, out.status == KC_COMPILE_OK, 0, j->share_fd,
			      out.deps, out.deps_len);
	kc_compile_outcome_free(&out);
	if (scratch_fd >= 0) {
		close(scratch_fd);
		kc_store_remove_tree(scratch);
	}
	close(j->share_fd);
	j->share_fd = -1;
}

static void job_free(struct compile_job *j)
{
	kc_argv_free(&j->args);
	close(j->entry_fd);
	kc_recipe_free(&j->recipe);
	free(j);
}

/* j is in hand (in) or no longer (!in): c->shares_in_hand, named at a stop's cut. */
static void in_hand(struct compile_job *j, int in)
{
	struct kc_cache *c = j->c;
	pthread_mutex_lock(&c->shares_lock);
	if (in) {
		j->share_prev = NULL;
		j->share_next = c->shares_in_hand;
		if (c->shares_in_hand)
			c->shares_in_hand->share_prev = j;
		c->shares_in_hand = j;
	} else {
		if (j->share_prev)
			j->share_prev->share_next = j->share_next;
		else
			c->shares_in_hand = j->share_next;
		if (j->share_next)
			j->share_next->share_prev = j->share_prev;
	}
	pthread_mutex_unlock(&c->shares_lock);
}

static void share_job(void *arg)
{
	share_published(arg);
	in_hand(arg, 0);
	job_free(arg);
}

/* The end of a job that ran (result: run_compile's): its share queued, its flight's
 * waiters answered, the job freed. */
static void end_job(struct compile_job *j, int result)
{
	struct kc_cache *c = j->c;
	struct kc_flight_key key = j->key;
	/* The share runs in a pool of its own, queued before the openers are answered: once
	 * they are, kc_cache_settle sees it (a live upgrade waits for it). Run here when that
	 * pool is stopping. */
	if (j->share_fd >= 0) {
		in_hand(j, 1);
		if (kc_pool_submit(c->shares, share_job, j) == 0) {
			kc_flight_finish(&c->flights, &key, result);
			return;
		}
	}
	kc_flight_finish(&c->flights, &key, result);
	if (j->share_fd >= 0) {
		share_published(j);
		in_hand(j, 0);
	}
	job_free(j);
}

void kc_cache_compile_job(void *arg)
{
	struct compile_job *j = arg;
	int result = run_compile(j);
	if (j->transient)
		hold_off(j->c, &j->key, j->recipe.hash);
	end_job(j, result);
}

void kc_cache_ahead_job(void *arg)
{
	struct ahead_item *it = arg;
	struct compile_job *j = kc_cache_ahead_begin(it);
	if (!j)
		return;
	int result = run_compile(j);
	kc_cache_ahead_end(j->c, it, result, j->seconds);
	end_job(j, result);
}
