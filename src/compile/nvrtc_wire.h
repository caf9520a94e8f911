/* nvrtc_wire.h - the frames between the daemon (nvrtc_pool.h) and a warm NVRTC worker
 * (kcachefs-nvrtc --serve) on one socket: one request, then one reply, then the next.
 *
 * request: struct kc_nvrtc_req, then args_len bytes of nvcc flags (each NUL-terminated:
 *          nargs strings, as the mount's allow-list passed them), then source_len bytes of
 *          source (kernel.cu, which may not hold a NUL byte).
 * reply:   struct kc_nvrtc_rep, then log_len bytes of NVRTC's log, then cubin_len bytes of
 *          cubin (0 unless status is 0).
 * Both ends run on one node from one build: fields are in host byte order. A worker that
 * reads a frame it cannot take (bad magic, sizes over the bounds) exits with status 2;
 * at EOF on the socket it exits 0.
 */
#ifndef KC_NVRTC_WIRE_H
#define KC_NVRTC_WIRE_H

#include <stdint.h>

#define KC_NVRTC_REQ_MAGIC 0x6b637271u /* "kcrq" */
#define KC_NVRTC_REP_MAGIC 0x6b637270u /* "kcrp" */
#define KC_NVRTC_MAX_SOURCE (64u << 20) /* bytes: a larger source is refused */
#define KC_NVRTC_MAX_ARGS (1u << 20)    /* bytes of the flags of one request */
#define KC_NVRTC_MAX_LOG (64u << 20)    /* bytes of a reply's log the daemon takes */

struct kc_nvrtc_req {
	uint32_t magic;      /* KC_NVRTC_REQ_MAGIC */
	uint32_t nargs;      /* flags in the args block */
	uint64_t args_len;   /* bytes of the args block */
	uint64_t source_len; /* bytes of source */
};

struct kc_nvrtc_rep {
	uint32_t magic;      /* KC_NVRTC_REP_MAGIC */
	int32_t status;      /* as kcachefs-nvrtc's exit status: 0 a cubin, 1 the source was
			      * rejected (the log says why), 2 a flag NVRTC cannot take or
			      * another error (the log says which) */
	uint64_t log_len;
	uint64_t cubin_len;
	uint64_t cpu_usec;   /* CPU time the worker has used so far (user + system), for the
			      * daemon to retire it before its RLIMIT_CPU could end a compile */
	uint64_t served;     /* requests this worker answered, this one included */
};

#endif
