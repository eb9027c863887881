/*
 * kvt_softcuda.h - a CUDA double for the offload tier's device seam
 * (connector/offload/kv_offload_dev_int.h) and the arenas' pinned and device
 * memory (allocator/allocator_int.h), for CPU tests: the model of the world
 * a device cache lives in, at least as strict as the CUDA runtime.
 *
 *   memory   "device" and "pinned" allocations are host memory the double
 *            allocated and tracks (base, bytes, kind, device). A copy whose
 *            cache lies outside one live allocation of the kind it claims
 *            is refused at issue (a host pointer where device memory is
 *            required); freeing an allocation a queued copy still uses is
 *            a fault (use after free on the GPU).
 *   streams  each stream runs its work in order on its own thread, so a
 *            copy lands after the call that issued it returns. Streams made
 *            without the non-blocking flag, and the legacy default stream
 *            (NULL), wait for each other as CUDA's legacy stream semantics
 *            say. A stream used after destroy, or destroyed with work
 *            queued, is refused / a fault.
 *   copies   the plan copy's CUDA schedule (kv__plan_cuda_schedule, checked
 *            as kv_plan_copy_cuda checks) run by the CPU grid emulator
 *            (kv__grid_plan_copy: the kernel body itself) when the stream
 *            reaches it.
 *   events   record enqueues a marker; sync sleeps until it ran (the
 *            tier's stream_sync until its stream ran everything queued;
 *            on an engine's stream: a fault). An event
 *            synchronized or destroyed before it was ever recorded, used
 *            after destroy, or recorded on a destroyed stream is refused (a
 *            fault: CUDA answers some of these with success, a tier that
 *            relies on it is wrong). A wait on an event recorded on a stream
 *            the tier did not make (an engine's stream) is counted.
 *   races    engine work (kvt_softcuda_engine_write) issued before a tier
 *            copy that touches the same device block and has not run when
 *            the copy runs: a fault (CUDA would copy stale bytes silently);
 *            and an engine write that runs while a tier copy of a device
 *            block it meets is still queued, whatever their order of issue
 *            (the engine wrote a store's or a load's block before the op
 *            ended, rules 1 and 2 of kv_offload.h): a fault too.
 *   threads  a stream or event made through the seam is used (copy, record,
 *            sync, destroy) only by the thread that made it: every entry of
 *            the CUDA table sets the calling thread's device (cudaSetDevice),
 *            so a call from another thread, an engine's, would move that
 *            thread's current device. CUDA accepts such a call; the double
 *            refuses it (a fault).
 *
 * Test controls: hold a stream (work behind the hold waits until
 * kvt_softcuda_release), pause every stream, read the counters.
 * Thread-safe: one mutex guards the double.
 */
#ifndef KVT_SOFTCUDA_H
#define KVT_SOFTCUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_offload_dev_int.h"

/* The seam's table of the double. */
const struct kv__offdev_ops *kvt_softcuda_ops(void);

/* Install the double (the arenas' CUDA memory and the tier's seam) and
 * start the legacy default stream; uninstall checks that nothing is left
 * (no allocation, stream or event) and restores CUDA. Counters reset. */
void kvt_softcuda_install(void);
void kvt_softcuda_uninstall(void);

/* An engine's stream on device (blocking: waits for the legacy default
 * stream and it for this one, as cudaStreamCreate); NULL is the legacy
 * default stream itself in the calls below. */
void *kvt_softcuda_engine_stream(int device, bool non_blocking);
void kvt_softcuda_engine_stream_free(void *stream);

/* Engine work on stream (NULL: the legacy default stream), as a kernel
 * writing KV would be: [p, p + bytes) of one live device allocation set to
 * value when the stream reaches it. A tier copy of a device block that
 * runs while such a write, issued before the copy, has not run is a race
 * the GPU would lose silently (the tier's stream waits for no engine
 * stream): the double counts it as a fault; so is such a write that runs
 * while a tier copy of a block it meets is still queued (issued before or
 * after it). kvt_softcuda_engine_sync
 * waits until stream has run all its work (cudaStreamSynchronize). */
void kvt_softcuda_engine_write(void *stream, void *p, size_t bytes, unsigned char value);
void kvt_softcuda_engine_sync(void *stream);

/* Queue a hold on stream (NULL: the legacy default stream): the stream's
 * later work waits until kvt_softcuda_release. */
void kvt_softcuda_hold(void *stream);
void kvt_softcuda_release(void);

/* A sticky error (a kernel's illegal address, say): from now on every
 * seam call fails with KV_ERR_DEVICE naming why, a synchronize waiting on
 * queued work returns that error, and queued work is dropped, never run
 * (destroying a stream or event still releases it, with the error). Not a
 * fault: the tier must cope. kvt_softcuda_install clears it. */
void kvt_softcuda_sticky(const char *why);

/* While paused no work item of any stream starts. */
void kvt_softcuda_pause(bool paused);

struct kvt_softcuda_stats {
    uint64_t copies_issued; /* copy calls accepted */
    uint64_t copies_done;   /* copies the streams ran */
    uint64_t queued;        /* work items queued and not run (holds included) */
    uint64_t event_syncs;   /* event_sync calls */
    uint64_t engine_waits;  /* event_sync on an event recorded on an engine stream */
    uint64_t tier_streams;  /* streams made through the seam and not destroyed */
    uint64_t allocs;        /* live allocations */
    uint64_t faults;        /* refusals and faults; last_fault says the last */
    char last_fault[256];
};
void kvt_softcuda_stats(struct kvt_softcuda_stats *out);

#endif /* KVT_SOFTCUDA_H */
