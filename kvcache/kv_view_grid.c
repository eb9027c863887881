/*
 * kv_view_grid.c - the view copy's CUDA body on the CPU grid emulator
 * (kv_view_grid_int.h): kv__cuda_view_copy with the launch replaced by
 * kv__grid_run over the same body.
 */
#include "kv_view_grid_int.h"
#include "kv_view_kernels_hd.h"

static void rows_thread(const struct kv_grid_ctx *c, const void *arg)
{
    const struct kv__view_rows *a = arg;
    kv__view_rows_body(c, a, a->vbytes);
}

kv_status kv__grid_view_copy(const struct kv_copy_plan *p, const void *src_base, void *dst_base,
                             int *path_out)
{
    struct kv__view_rows a;
    int64_t blocks = 0;
    int path = 0;
    kv__view_rows_build(p, src_base, dst_base, &a, &blocks, &path);
    const struct kv_grid_launch l = {(uint64_t)blocks, KV__VIEW_THREADS, 0, false};
    const kv_status st = kv__grid_run("kv_view_copy_cuda", &l, rows_thread, &a);
    if (st == KV_OK && path_out)
        *path_out = path;
    return st;
}
