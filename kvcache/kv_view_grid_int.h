/*
 * kv_view_grid_int.h - the view copy's CUDA body on the CPU grid emulator
 * (kv_grid_hd.h), for the tests (module-private).
 *
 * kv__grid_view_copy takes what kv__cuda_view_copy takes (a plan from
 * kv_copy_plan_build of a validated copy, p->rows > 0, and the two bases,
 * host memory here) and runs the launch kv_view_cuda.cu makes: the same
 * arguments, grid, block size and vector width, the same body over every
 * (block, thread). *path_out: the path (KV__CUDA_COPY_*). KV_OK, or the
 * emulator's refusal or fault (kv__grid_run).
 */
#ifndef KV_VIEW_GRID_INT_H
#define KV_VIEW_GRID_INT_H

#include "kv_lib.h"
#include "kv_view_hd.h"

kv_status kv__grid_view_copy(const struct kv_copy_plan *p, const void *src_base, void *dst_base,
                             int *path_out);

#endif /* KV_VIEW_GRID_INT_H */
