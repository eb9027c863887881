/*
 * kv_attn_grid.c - the attention kernels' CUDA bodies on the CPU grid
 * emulator (kv_attn_grid_int.h): the launchers of kv_attn_cuda.cu with the
 * uploads left out (the job's host arrays are read in place) and each
 * <<<grid, block, shared>>> replaced by kv__grid_run over the same body.
 */
#include "kv_attn_grid_int.h"
#include "kv_attn_kernels_hd.h"
#include "kv_attn_prefill_hd.h"
#include "kv_mem.h"

static _Thread_local struct kv__grid_attn_last g_last;

void kv__grid_attn_last(struct kv__grid_attn_last *out)
{
    *out = g_last;
}

struct move_arg {
    const struct kv__cmove *m;
    const struct kv__attn_run *runs;
    const float *scale;
    int vbytes;
};

static void move_bytes_thread(const struct kv_grid_ctx *c, const void *arg)
{
    const struct move_arg *a = arg;
    kv__move_bytes_body(c, a->m, a->runs, a->vbytes);
}

static void move_convert_thread(const struct kv_grid_ctx *c, const void *arg)
{
    const struct move_arg *a = arg;
    kv__move_convert_body(c, a->m, a->runs, a->scale);
}

static kv_status run(const char *fn, struct kv_grid_launch l,
                     void (*body)(const struct kv_grid_ctx *, const void *), const void *arg,
                     int vbytes)
{
    const kv_status st = kv__grid_run(fn, &l, body, arg);
    if (st == KV_OK) {
        g_last.launch = l;
        g_last.vbytes = vbytes;
    }
    return st;
}

/* the launch of the item kernels (move, copy, copy_ex): KV__ATTN_THREADS a block */
static struct kv_grid_launch items_launch(int64_t n_items)
{
    const struct kv_grid_launch l = {(uint64_t)kv__attn_grid_of(n_items), KV__ATTN_THREADS, 0,
                                     false};
    return l;
}

/* m's bytes move (vector width from m) or its converting move (scale: the
 * host mode's scales; NULL where m carries them) */
/* blocks of kv__cmove_threads threads, as kv_attn_cuda.cu launches them */
static kv_status move_launch(const char *fn, const struct kv__cmove *m,
                             const struct kv__attn_run *runs, int64_t max_run, bool bytes,
                             const float *scale)
{
    struct move_arg a = {m, runs, scale, 0};
    struct kv_grid_launch l = items_launch(m->n_items);
    if (!bytes) {
        l.block = (uint64_t)kv__cmove_threads(m, 0, max_run);
        return run(fn, l, move_convert_thread, &a, 0);
    }
    a.vbytes = kv__cmove_width(m);
    l.block = (uint64_t)kv__cmove_threads(m, a.vbytes, max_run);
    return run(fn, l, move_bytes_thread, &a, a.vbytes);
}

static kv_status move_one(const struct kv__attn_job *j, bool to_cache)
{
    struct kv__cmove m;
    const bool bytes = kv__cmove_build(j, to_cache, &m);
    if (bytes)
        return move_launch(j->fn, &m, j->runs, j->max_run, true, NULL);
    float scale[2 * 1024];
    kv__cmove_scales(j, &m, scale);
    return move_launch(j->fn, &m, j->runs, j->max_run, false, scale);
}

kv_status kv__grid_attn_move(const struct kv__attn_job *j, bool to_cache)
{
    if (j->n_runs == 0)
        return KV_OK;
    if (!j->scale_layer_stride || j->n_layers == 1)
        return move_one(j, to_cache);
    for (uint32_t l = 0; l < j->n_layers; l++) {
        struct kv__attn_job one;
        kv__attn_job_layer(j, l, &one);
        const kv_status st = move_one(&one, to_cache);
        if (st != KV_OK)
            return st;
    }
    return KV_OK;
}

struct copy_arg {
    const struct kv__ccopy *p;
    const struct kv__ccopy_ex *x;
    int vbytes;
};

static void copy_thread(const struct kv_grid_ctx *c, const void *arg)
{
    const struct copy_arg *a = arg;
    kv__copy_body(c, a->p, a->vbytes);
}

static void copy_ex_thread(const struct kv_grid_ctx *c, const void *arg)
{
    const struct copy_arg *a = arg;
    kv__copy_ex_body(c, a->x, a->vbytes);
}

kv_status kv__grid_attn_copy(const struct kv__attn_job *j)
{
    if (j->n_copies == 0)
        return KV_OK;
    int64_t *offs = kv__mem_alloc((size_t)j->n_copies * 2 * sizeof(int64_t));
    if (!offs)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %u copies", j->fn, j->n_copies);
    struct kv__ccopy p;
    struct copy_arg a = {&p, NULL, 1};
    kv_status st = kv__ccopy_build(j, offs, &p, &a.vbytes);
    if (st == KV_OK)
        st = run(j->fn, items_launch(p.n_items), copy_thread, &a, a.vbytes);
    kv__mem_free(offs);
    return st;
}

kv_status kv__grid_attn_copy_ex(const struct kv__attn_job *j)
{
    if (j->n_copies == 0)
        return KV_OK;
    const int64_t n_units = kv__ccopy_ex_units(j);
    int64_t *offs = kv__mem_alloc((size_t)n_units * 2 * sizeof(int64_t));
    if (!offs)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %u copies", j->fn, j->n_copies);
    struct kv__ccopy_ex x;
    struct copy_arg a = {NULL, &x, 1};
    kv__ccopy_ex_build(j, offs, &x, &a.vbytes);
    const kv_status st = run(j->fn, items_launch(x.n_items), copy_ex_thread, &a, a.vbytes);
    kv__mem_free(offs);
    return st;
}

int kv__cdec_body;
int kv__cdec_chunks;

static void decode_thread(const struct kv_grid_ctx *c, const void *arg)
{
    const struct kv__cdec *p = arg;
    switch (p->body) {
    case KV__CDEC_VEC:
        kv__decode_vec_body(c, p);
        break;
    case KV__CDEC_PIPE:
        kv__decode_pipe_body(c, p);
        break;
    case KV__CDEC_SPLIT:
        kv__decode_split_body(c, p);
        break;
    default:
        kv__decode_body(c, p);
        break;
    }
}

static void decode_merge_thread(const struct kv_grid_ctx *c, const void *arg)
{
    kv__decode_merge_body(c, arg);
}

/* The SMs the emulated split-KV plans for (an H100 / H200 SXM). */
#define GRID_SMS 132

/* kv__cdec_blocks blocks of p->warps warps (launch_decode in kv_attn_cuda.cu);
 * split-KV (max_tokens: the longest sequence, -1 unknown): the chunks'
 * kernel into a workspace (host memory here; kv_attn_cuda.cu's launchers
 * take the caller's or a stream-ordered one), then the merge kernel. */
static kv_status decode_launch(const char *fn, const struct kv__attn_job *j, struct kv__cdec *p,
                               size_t shmem, int64_t max_tokens)
{
    if (p->body == KV__CDEC_SPLIT)
        kv__cdec_split_plan(p, j->n_seqs, max_tokens, GRID_SMS);
    const int64_t blocks = kv__cdec_blocks(p, j->n_seqs);
    if (blocks > INT32_MAX)
        return kv__error(KV_ERR_UNSUPPORTED, "%s: %lld decode blocks (at most %d)", fn,
                         (long long)blocks, INT32_MAX);
    const struct kv_grid_launch l = {(uint64_t)blocks, (uint64_t)(32 * p->warps), shmem, true};
    if (p->body != KV__CDEC_SPLIT)
        return run(fn, l, decode_thread, p, 0);
    const size_t wb = kv__cdec_ws_bytes(p);
    p->ws = kv__mem_alloc(wb);
    if (!p->ws)
        return kv__error(KV_ERR_NO_MEMORY, "%s: split-KV workspace of %zu bytes", fn, wb);
    /* stale bytes: every entry the merge reads must have been written */
    memset(p->ws, 0xff, wb);
    kv_status st = kv__grid_run(fn, &l, decode_thread, p);
    if (st == KV_OK) {
        const struct kv_grid_launch m = {
            (uint64_t)kv__attn_grid_of(j->n_seqs * p->lo.num_heads * p->g), KV__DECM_THREADS, 0,
            false};
        st = run(fn, m, decode_merge_thread, p, 0);
        g_last.launch = l; /* the tests check the chunks' launch */
    }
    kv__mem_free(p->ws);
    p->ws = NULL;
    return st;
}

kv_status kv__grid_attn_decode(const struct kv__attn_job *j)
{
    static const char fn[] = "kv_attn_decode_cuda";
    /* the bodies take one query row per sequence (window, soft cap and lse
     * they do): a multi-token job is refused, as kv_attn_decode_ex_cuda
     * refuses it */
    if (j->q_start)
        return kv__error(KV_ERR_UNSUPPORTED,
                         "%s: multi-token attention (qo_indptr) on CUDA: not yet (the CPU "
                         "kernel has it)",
                         fn);
    if (j->n_seqs == 0)
        return KV_OK;
    struct kv__cdec p;
    size_t shmem = 0;
    kv_status st = kv__cdec_build(j, fn, &p, &shmem);
    if (st != KV_OK)
        return st;
    float scales[2 * 1024];
    kv__cdec_scales(j, &p, scales);
    p.page_ids = j->page_ids;
    p.page_start = j->page_start;
    p.seq_tokens = j->seq_tokens;
    p.scales = scales;
    int64_t max_tokens = 0;
    for (uint32_t s = 0; s < j->n_seqs; s++)
        max_tokens = j->seq_tokens[s] > max_tokens ? j->seq_tokens[s] : max_tokens;
    return decode_launch(fn, j, &p, shmem, max_tokens);
}

struct prefill_arg {
    const struct kv__cpre *p;
    int vbytes;
};

static void prefill_thread(const struct kv_grid_ctx *c, const void *arg)
{
    const struct prefill_arg *a = arg;
    kv__prefill_body(c, a->p, a->vbytes);
}

kv_status kv__grid_attn_prefill(const struct kv__attn_job *j)
{
    if (j->n_seqs == 0)
        return KV_OK;
    int64_t *tile_start = kv__mem_alloc(((size_t)j->n_seqs + 1) * sizeof(int64_t));
    if (!tile_start)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %u sequences", j->fn, j->n_seqs);
    struct kv__cpre p;
    int64_t blocks = 0;
    size_t shmem = 0;
    struct prefill_arg a = {&p, 1};
    kv_status st = kv__cpre_build(j, j->fn, &p, tile_start, &blocks, &shmem, &a.vbytes);
    float scales[2 * 1024];
    if (st == KV_OK && blocks > 0) {
        kv__cpre_scales(j, &p, scales);
        p.scales = scales;
        const struct kv_grid_launch l = {(uint64_t)blocks, 32 * KV__PF_WARPS, shmem, true};
        st = run(j->fn, l, prefill_thread, &a, a.vbytes);
    }
    kv__mem_free(tile_start);
    return st;
}

static void decode_mla_thread(const struct kv_grid_ctx *c, const void *arg)
{
    kv__decode_mla_body(c, arg);
}

kv_status kv__grid_attn_decode_mla(const struct kv__attn_job *j)
{
    static const char fn[] = "kv_attn_decode_mla_cuda";
    if (j->n_seqs == 0)
        return KV_OK;
    struct kv__cmla p;
    int64_t blocks = 0;
    size_t shmem = 0;
    kv_status st = kv__cmla_build(j, fn, &p, &blocks, &shmem);
    if (st != KV_OK)
        return st;
    const struct kv_grid_launch l = {(uint64_t)blocks, 32 * KV__DEC_WARPS, shmem, true};
    return run(fn, l, decode_mla_thread, &p, 0);
}

struct finish_arg {
    struct kv_attn_cuda_errors *err;
    struct kv__dev_arrays a; /* the launch's arrays and lengths */
};

static void finish_thread(const struct kv_grid_ctx *c, const void *arg)
{
    (void)c;
    const struct finish_arg *f = arg;
    kv__dev_error_finish_in(f->err, &f->a);
}

/* after a device-index launch that ran (st KV_OK), the record's 1-thread
 * finish where there is a record */
static kv_status finish(const char *fn, kv_status st, const struct finish_arg *f)
{
    if (st != KV_OK || !f->err)
        return st;
    const struct kv_grid_launch one = {1, 1, 0, false};
    return kv__grid_run(fn, &one, finish_thread, f);
}

kv_status kv__grid_attn_write_dev(const struct kv__attn_job *j, const int64_t *slots,
                                  int64_t n_slots, bool by_value, struct kv_attn_cuda_errors *err)
{
    if (n_slots == 0)
        return KV_OK;
    struct kv__cmove m;
    const bool bytes = kv__cmove_build_dev(j, slots, n_slots, err, &m);
    kv__cmove_scales_dev(j, by_value, &m);
    const kv_status st = move_launch(j->fn, &m, NULL, 1, bytes, NULL);
    return finish(
        j->fn, st,
        &(const struct finish_arg){.err = err, .a = {.slots = slots, .n_slots = n_slots}});
}

kv_status kv__grid_attn_decode_mla_dev(const struct kv__attn_job *j,
                                       const struct kv_attn_dev_pages *pg, const float *ksc,
                                       struct kv_attn_cuda_errors *err)
{
    if (j->n_seqs == 0)
        return KV_OK;
    struct kv__cmla p;
    int64_t blocks = 0;
    size_t shmem = 0;
    kv_status st = kv__cmla_build(j, j->fn, &p, &blocks, &shmem);
    if (st != KV_OK)
        return st;
    kv__cmla_build_dev(j, pg, err, ksc, &p);
    const struct kv_grid_launch l = {(uint64_t)blocks, 32 * KV__DEC_WARPS, shmem, true};
    st = run(j->fn, l, decode_mla_thread, &p, 0);
    return finish(
        j->fn, st,
        &(const struct finish_arg){.err = err, .a = kv__dev_pages_arrays(pg, j->n_seqs, NULL)});
}

kv_status kv__grid_attn_decode_dev(const struct kv__attn_job *j, const struct kv_attn_dev_pages *pg,
                                   bool by_value, struct kv_attn_cuda_errors *err)
{
    if (j->n_seqs == 0)
        return KV_OK;
    struct kv__cdec p;
    size_t shmem = 0;
    kv_status st = kv__cdec_build(j, j->fn, &p, &shmem);
    if (st != KV_OK)
        return st;
    kv__cdec_build_dev(j, pg, err, &p);
    kv__cdec_scales_dev(j, by_value, &p);
    /* split-KV as kv__cuda_attn_decode_dev_ws with a workspace (the
     * public device-index entry has none: it runs the vector body) */
    st = decode_launch(j->fn, j, &p, shmem, -1);
    return finish(
        j->fn, st,
        &(const struct finish_arg){.err = err, .a = kv__dev_pages_arrays(pg, j->n_seqs, NULL)});
}

kv_status kv__grid_attn_copy_dev(const struct kv__attn_job *j, const struct kv_block_copy *pairs,
                                 uint32_t n, struct kv_attn_cuda_errors *err)
{
    if (n == 0)
        return KV_OK;
    struct kv__ccopy p;
    struct copy_arg a = {&p, NULL, 1};
    kv_status st = kv__ccopy_build_dev(j, pairs, n, err, &p, &a.vbytes);
    if (st != KV_OK)
        return st;
    st = run(j->fn, items_launch(p.n_items), copy_thread, &a, a.vbytes);
    return finish(j->fn, st,
                  &(const struct finish_arg){.err = err, .a = {.pairs = pairs, .n_pairs = n}});
}

kv_status kv__grid_attn_copy_ex_dev(const struct kv__attn_job *j, const struct kv_block_copy *pairs,
                                    uint32_t n, struct kv_attn_cuda_errors *err)
{
    if (n == 0)
        return KV_OK;
    struct kv__ccopy_ex x;
    struct copy_arg a = {NULL, &x, 1};
    kv__ccopy_ex_build_dev(j, pairs, n, err, &x, &a.vbytes);
    const kv_status st = run(j->fn, items_launch(x.n_items), copy_ex_thread, &a, a.vbytes);
    return finish(j->fn, st,
                  &(const struct finish_arg){.err = err, .a = {.pairs = pairs, .n_pairs = n}});
}

kv_status kv__grid_attn_read_dev(const struct kv__attn_job *j, const struct kv_attn_dev_pages *pg,
                                 const int32_t *out_indptr, bool by_value,
                                 struct kv_attn_cuda_errors *err)
{
    if (j->n_seqs == 0)
        return KV_OK;
    struct kv__cmove m;
    const bool bytes = kv__cmove_build_read_dev(j, pg, out_indptr, err, &m);
    kv__cmove_scales_dev(j, by_value, &m);
    const kv_status st = move_launch(j->fn, &m, NULL, 1, bytes, NULL);
    return finish(j->fn, st,
                  &(const struct finish_arg){.err = err,
                                             .a = kv__dev_pages_arrays(pg, j->n_seqs, out_indptr)});
}
