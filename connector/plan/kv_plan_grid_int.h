/*
 * kv_plan_grid_int.h - the plan executor's CUDA body on the CPU grid
 * emulator (kvcache/kv_grid_hd.h), for the tests (module-private).
 *
 * kv__grid_plan_copy takes what kv__cuda_plan_copy takes (a schedule from
 * kv__plan_cuda_schedule; host memory on both sides here) and runs it: the
 * wide copies as the row-by-row model of cudaMemcpy2DAsync (memcpy per
 * row), the narrow part as the launch kv_plan_cuda.cu makes (the same
 * grid, block size and vector width, the same body over every (block,
 * thread)). KV_OK, or the emulator's refusal or fault (kv__grid_run).
 */
#ifndef KV_PLAN_GRID_INT_H
#define KV_PLAN_GRID_INT_H

#include "kv_plan_cuda_int.h"

kv_status kv__grid_plan_copy(const struct kv__plan_sched *s);

/* kv__cuda_plan_copy_dev on the emulator: a request kv__plan_check_request_dev
 * accepted, the block lists and the record host memory standing for device
 * memory, plan's own table standing for kv_plan_dev_create's; the same
 * launch (grid, block, width), then the record's value. */
kv_status kv__grid_plan_copy_dev(const kv_plan *plan, const struct kv_paged_cache *src,
                                 const uint32_t *sid, uint32_t n_src,
                                 const struct kv_paged_cache *dst, const uint32_t *did,
                                 uint32_t n_dst, uint64_t n_tokens,
                                 struct kv_plan_cuda_errors *err);

#endif /* KV_PLAN_GRID_INT_H */
