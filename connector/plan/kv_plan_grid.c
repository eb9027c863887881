/*
 * kv_plan_grid.c - the plan executor's CUDA body on the CPU grid emulator
 * (kv_plan_grid_int.h).
 */
#include <string.h>

#include "kv_plan_grid_int.h"
#include "kv_plan_kernels_hd.h"

struct narrow_arg {
    const struct kv__plan_narrow *n;
    int vbytes;
};

static void narrow_thread(const struct kv_grid_ctx *c, const void *arg)
{
    const struct narrow_arg *a = arg;
    kv__plan_narrow_body(c, a->n, a->vbytes);
}

kv_status kv__grid_plan_copy(const struct kv__plan_sched *sc)
{
    for (int64_t i = 0; i < sc->n_wide; i++) {
        const struct kv__plan_frag *f = &sc->wide[i];
        for (int64_t y = 0; y < f->height; y++)
            memcpy(f->dst + y * f->dst_pitch, f->src + y * f->src_pitch, (size_t)f->width);
    }
    if (sc->narrow.n_items == 0)
        return KV_OK;
    const struct narrow_arg a = {&sc->narrow, kv__plan_narrow_width(sc->narrow_align)};
    const struct kv_grid_launch l = {(uint64_t)kv__plan_narrow_grid(sc->narrow.n_items),
                                     KV__PLAN_THREADS, 0, false};
    return kv__grid_run("kv_plan_copy_cuda", &l, narrow_thread, &a);
}
