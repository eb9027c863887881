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

struct dev_arg {
    const struct kv__plan_dev *p;
    int vbytes;
};

static void dev_thread(const struct kv_grid_ctx *c, const void *arg)
{
    const struct dev_arg *a = arg;
    kv__plan_dev_body(c, a->p, a->vbytes);
}

struct finish_arg {
    const struct kv__plan_dev *p;
};

static void finish_thread(const struct kv_grid_ctx *c, const void *arg)
{
    (void)c;
    const struct kv__plan_dev *p = ((const struct finish_arg *)arg)->p;
    kv__plan_dev_finish(p->err, p->sid, p->did, p->n_src, p->n_dst);
}

kv_status kv__grid_plan_copy_dev(const kv_plan *plan, const struct kv_paged_cache *src,
                                 const uint32_t *sid, uint32_t n_src,
                                 const struct kv_paged_cache *dst, const uint32_t *did,
                                 uint32_t n_dst, uint64_t n_tokens, struct kv_plan_cuda_errors *err)
{
    static const char fn[] = "kv_plan_copy_cuda_dev";
    struct kv__plan_dev p;
    const struct dev_arg a = {&p, kv__plan_dev_build(plan, plan->copies,
                                                     kv__plan_copies_align(plan), src, sid, n_src,
                                                     dst, did, n_dst, n_tokens, err, &p)};
    const int64_t all = p.n_items + (int64_t)n_src + n_dst;
    if (all == 0)
        return KV_OK;
    const struct kv_grid_launch l = {(uint64_t)kv__plan_narrow_grid(all), KV__PLAN_THREADS, 0,
                                     false};
    kv_status st = kv__grid_run(fn, &l, dev_thread, &a);
    if (st != KV_OK || !err)
        return st;
    const struct finish_arg f = {&p};
    const struct kv_grid_launch one = {1, 1, 0, false};
    return kv__grid_run(fn, &one, finish_thread, &f);
}
