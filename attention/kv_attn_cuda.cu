/*
 * kv_attn_cuda.cu - the attention kernels on the GPU.
 *
 * Each launcher receives a job validated on the host by the CPU kernels'
 * validator (kv_attn_check.c), uploads its host index arrays (runs, pages,
 * copy offsets, scales) with stream-ordered allocations (cudaMemcpyAsync
 * from pageable host memory: CUDA may synchronize with the stream to stage
 * it, and graph capture could not replay it; docs/design.md), launches on
 * the caller's stream, frees on the stream, and maps any CUDA error through
 * kv__cuda_status (KV_ERR_DEVICE for a failed launch). Every cache address is
 * computed with kv_attn_hd.h and every conversion with kv_convert_hd.h: the
 * code the CPU kernels and tests run. The kernel bodies and their launch
 * parameters are in kv_attn_kernels_hd.h: each __global__ below is a thin
 * wrapper filling a struct kv_grid_ctx from the built-ins, and the CPU grid
 * emulator runs the same bodies in the tests (kv_attn_grid.c).
 *
 *   move    one CUDA block per (run, layer); its threads walk the run's
 *           [n][H][D] elements: as 16/8/4/2/1-byte vectors when the dtypes
 *           agree without scales (the widest every address allows), through
 *           f32 otherwise
 *   copy    one CUDA block per (block pair, byte run), vector copies; a
 *           layer range, one plane or two caches: one per (pair, layer,
 *           storage block) or, one plane of packed K|V, per half head row
 *   decode  the vector body: one CUDA block per (sequence, KV head, group
 *           of up to 4 query heads), lane groups of one row each, online
 *           softmax in registers; its pipelined form; split-KV (the vector
 *           body over chunks of tokens into a workspace, then a merge
 *           kernel); the general body for other rows: one block per
 *           (sequence, KV head), warps over tokens, lanes over the head dim
 *           (kv_attn_kernels_hd.h; kv__cdec_build picks)
 *   prefill one CUDA block per (tile of query rows, KV head); a decode with
 *           options too (kv_attn_prefill_hd.h)
 */
#include <cuda_runtime.h>

#include "kv_attn_cuda_int.h"
#include "kv_attn_kernels_hd.h"
#include "kv_attn_prefill_hd.h"
#include "kv_cuda_lib.h"
#include "kv_mem.h"

#include <string.h>

/* ---- device memory for a launch's index arrays ------------------------------ */

static kv_status upload(void **dev, const void *host, size_t bytes, cudaStream_t s,
                        const char *what)
{
    *dev = NULL;
    if (bytes == 0)
        return KV_OK;
    kv_status st = kv__cuda_status(cudaMallocAsync(dev, bytes, s), what);
    if (st != KV_OK)
        return st;
    st = kv__cuda_status(cudaMemcpyAsync(*dev, host, bytes, cudaMemcpyHostToDevice, s), what);
    if (st != KV_OK) {
        (void)cudaFreeAsync(*dev, s);
        *dev = NULL;
    }
    return st;
}

static void release(void *dev, cudaStream_t s)
{
    if (dev)
        (void)cudaFreeAsync(dev, s);
}

/* A host-index job's page table on the device: page_ids, page_start and
 * seq_tokens uploaded (NULL: not, or empty), freed with release_table. */
struct dev_table {
    void *pages, *start, *tok;
};

/* j's page table uploaded into *d (all NULL before) and named by p's
 * page_ids, page_start and seq_tokens (P: kv__cdec, kv__cmla, kv__cpre). */
template <class P>
static kv_status upload_table(const struct kv__attn_job *j, P *p, struct dev_table *d,
                              cudaStream_t s, const char *fn)
{
    const int64_t n_pages = j->page_start[j->n_seqs];
    kv_status st;
    if ((st = upload(&d->pages, j->page_ids, (size_t)n_pages * sizeof(int32_t), s, fn)) != KV_OK ||
        (st = upload(&d->start, j->page_start, ((size_t)j->n_seqs + 1) * sizeof(int64_t), s,
                     fn)) != KV_OK ||
        (st = upload(&d->tok, j->seq_tokens, (size_t)j->n_seqs * sizeof(int64_t), s, fn)) != KV_OK)
        return st;
    p->page_ids = (const int32_t *)d->pages;
    p->page_start = (const int64_t *)d->start;
    p->seq_tokens = (const int64_t *)d->tok;
    return KV_OK;
}

static void release_table(const struct dev_table *d, cudaStream_t s)
{
    release(d->tok, s);
    release(d->start, s);
    release(d->pages, s);
}

/* The thread's context from the built-ins (1-D launches). */
__device__ __forceinline__ struct kv_grid_ctx kv__ctx(void *shared)
{
    struct kv_grid_ctx c = {blockIdx.x, threadIdx.x, blockDim.x, gridDim.x, shared, NULL};
    return c;
}

/* ---- the wrappers ------------------------------------------------------------- */

template <int W>
__global__ void kv__move_bytes_kernel(struct kv__cmove m, const struct kv__attn_run *runs)
{
    const struct kv_grid_ctx c = kv__ctx(NULL);
    kv__move_bytes_body(&c, &m, runs, W);
}

__global__ void kv__move_convert_kernel(struct kv__cmove m, const struct kv__attn_run *runs,
                                        const float *scale /* [2][n_mul] */)
{
    const struct kv_grid_ctx c = kv__ctx(NULL);
    kv__move_convert_body(&c, &m, runs, scale);
}

template <int W> __global__ void kv__copy_kernel(struct kv__ccopy p)
{
    const struct kv_grid_ctx c = kv__ctx(NULL);
    kv__copy_body(&c, &p, W);
}

template <int W> __global__ void kv__copy_ex_kernel(struct kv__ccopy_ex p)
{
    const struct kv_grid_ctx c = kv__ctx(NULL);
    kv__copy_ex_body(&c, &p, W);
}

__global__ void kv__decode_kernel(struct kv__cdec p)
{
    extern __shared__ float sh[];
    const struct kv_grid_ctx c = kv__ctx(sh);
    kv__decode_body(&c, &p);
}

__global__ void __launch_bounds__(32 * KV__DEC_WARPS) kv__decode_vec_kernel(struct kv__cdec p)
{
    extern __shared__ float sh[];
    const struct kv_grid_ctx c = kv__ctx(sh);
    kv__decode_vec_body(&c, &p);
}

__global__ void __launch_bounds__(32 * KV__DEC_WARPS) kv__decode_pipe_kernel(struct kv__cdec p)
{
    extern __shared__ float sh[];
    const struct kv_grid_ctx c = kv__ctx(sh);
    kv__decode_pipe_body(&c, &p);
}

__global__ void __launch_bounds__(32 * KV__DEC_WARPS) kv__decode_split_kernel(struct kv__cdec p)
{
    extern __shared__ float sh[];
    const struct kv_grid_ctx c = kv__ctx(sh);
    kv__decode_split_body(&c, &p);
}

__global__ void __launch_bounds__(KV__DECM_THREADS) kv__decode_merge_kernel(struct kv__cdec p)
{
    const struct kv_grid_ctx c = kv__ctx(NULL);
    kv__decode_merge_body(&c, &p);
}

/* The decode launch of p (kv__cdec_build): the body p.body, one block per
 * kv__cdec_blocks; split-KV (p.ws and the plan set) then its merge. */
static kv_status launch_decode(const struct kv__cdec &p, int64_t n_seqs, size_t shmem,
                               cudaStream_t s, const char *fn)
{
    const int64_t blocks = kv__cdec_blocks(&p, n_seqs);
    if (blocks > INT32_MAX)
        return kv__error(KV_ERR_UNSUPPORTED, "%s: %lld decode blocks (at most %d)", fn,
                         (long long)blocks, INT32_MAX);
    switch (p.body) {
    case KV__CDEC_VEC:
        kv__decode_vec_kernel<<<(unsigned)blocks, 32 * p.warps, shmem, s>>>(p);
        break;
    case KV__CDEC_PIPE:
        kv__decode_pipe_kernel<<<(unsigned)blocks, 32 * p.warps, shmem, s>>>(p);
        break;
    case KV__CDEC_SPLIT:
        kv__decode_split_kernel<<<(unsigned)blocks, 32 * p.warps, shmem, s>>>(p);
        kv__decode_merge_kernel<<<kv__attn_grid_of(n_seqs * p.lo.num_heads * p.g), KV__DECM_THREADS,
                                  0, s>>>(p);
        break;
    default:
        kv__decode_kernel<<<(unsigned)blocks, 32 * p.warps, shmem, s>>>(p);
        break;
    }
    return KV_OK;
}

/* The current device's multiprocessors (split-KV's plan; 132 if unknown). */
static int device_sms(void)
{
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        sms <= 0)
        return 132;
    return sms;
}

__global__ void kv__decode_mla_kernel(struct kv__cmla p)
{
    extern __shared__ float sh[];
    const struct kv_grid_ctx c = kv__ctx(sh);
    kv__decode_mla_body(&c, &p);
}

/* ---- launches of a templated width ------------------------------------------- */

/* kv__move_bytes_kernel at the width kv__cmove_width chose (runs: device
 * runs of the host-index mode, NULL in the device-index mode). */
static void launch_move_bytes(const struct kv__cmove &m, const struct kv__attn_run *runs, int grid,
                              int64_t max_run, cudaStream_t s)
{
    const int th = kv__cmove_threads(&m, kv__cmove_width(&m), max_run);
    switch (kv__cmove_width(&m)) {
    case 16:
        kv__move_bytes_kernel<16><<<grid, th, 0, s>>>(m, runs);
        break;
    case 8:
        kv__move_bytes_kernel<8><<<grid, th, 0, s>>>(m, runs);
        break;
    case 4:
        kv__move_bytes_kernel<4><<<grid, th, 0, s>>>(m, runs);
        break;
    case 2:
        kv__move_bytes_kernel<2><<<grid, th, 0, s>>>(m, runs);
        break;
    default:
        kv__move_bytes_kernel<1><<<grid, th, 0, s>>>(m, runs);
        break;
    }
}

/* kv__copy_kernel at width w (16, 8, 4 or 1: kv__ccopy_build*). */
static void launch_copy(const struct kv__ccopy &p, int w, cudaStream_t s)
{
    const int grid = kv__attn_grid_of(p.n_items);
    if (w == 16)
        kv__copy_kernel<16><<<grid, KV__ATTN_THREADS, 0, s>>>(p);
    else if (w == 8)
        kv__copy_kernel<8><<<grid, KV__ATTN_THREADS, 0, s>>>(p);
    else if (w == 4)
        kv__copy_kernel<4><<<grid, KV__ATTN_THREADS, 0, s>>>(p);
    else
        kv__copy_kernel<1><<<grid, KV__ATTN_THREADS, 0, s>>>(p);
}

/* kv__copy_ex_kernel at width w (16, 8, 4, 2 or 1: kv__ccopy_ex_build*). */
static void launch_copy(const struct kv__ccopy_ex &p, int w, cudaStream_t s)
{
    const int grid = kv__attn_grid_of(p.n_items);
    if (w == 16)
        kv__copy_ex_kernel<16><<<grid, KV__ATTN_THREADS, 0, s>>>(p);
    else if (w == 8)
        kv__copy_ex_kernel<8><<<grid, KV__ATTN_THREADS, 0, s>>>(p);
    else if (w == 4)
        kv__copy_ex_kernel<4><<<grid, KV__ATTN_THREADS, 0, s>>>(p);
    else if (w == 2)
        kv__copy_ex_kernel<2><<<grid, KV__ATTN_THREADS, 0, s>>>(p);
    else
        kv__copy_ex_kernel<1><<<grid, KV__ATTN_THREADS, 0, s>>>(p);
}

/* The host-index copy launch of p (kv__ccopy or kv__ccopy_ex) at width w:
 * its offsets offs ([n_units][2], host, freed here) uploaded and named by
 * p.offs, the launch, the upload freed on the stream. */
template <class P>
static kv_status launch_copy_offs(P &p, int w, int64_t *offs, int64_t n_units, cudaStream_t s,
                                  const char *fn)
{
    void *d_offs = NULL;
    kv_status st = upload(&d_offs, offs, (size_t)n_units * 2 * sizeof(int64_t), s, fn);
    kv__mem_free(offs);
    if (st != KV_OK)
        return st;
    p.offs = (const int64_t *)d_offs;
    launch_copy(p, w, s);
    st = kv__cuda_status(cudaGetLastError(), fn);
    release(d_offs, s);
    return st;
}

/* ---- move (write and read) ----------------------------------------------------- */

extern "C" kv_status kv__cuda_attn_move(const struct kv__attn_job *j, bool to_cache,
                                        kv_cuda_stream stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    const char *fn = j->fn;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || j->n_runs == 0)
        return st;
    struct kv__cmove m;
    const bool bytes = kv__cmove_build(j, to_cache, &m);
    void *d_runs = NULL, *d_scale = NULL;
    st = upload(&d_runs, j->runs, (size_t)j->n_runs * sizeof(*j->runs), s, fn);
    if (st != KV_OK)
        return st;
    const struct kv__attn_run *runs = (const struct kv__attn_run *)d_runs;
    const int grid = kv__attn_grid_of(m.n_items);
    if (bytes) {
        launch_move_bytes(m, runs, grid, j->max_run, s);
    } else {
        /* the scales themselves (1 without): x / scale on the way in, x *
         * scale on the way out (kv_apply_scale, as on the CPU) */
        float scale[2 * 1024];
        kv__cmove_scales(j, &m, scale);
        st = upload(&d_scale, scale, (size_t)(2 * m.n_mul) * sizeof(float), s, fn);
        if (st != KV_OK) {
            release(d_runs, s);
            return st;
        }
        kv__move_convert_kernel<<<grid, kv__cmove_threads(&m, 0, j->max_run), 0, s>>>(
            m, runs, (const float *)d_scale);
    }
    st = kv__cuda_status(cudaGetLastError(), fn);
    release(d_scale, s);
    release(d_runs, s);
    return st;
}

/* ---- device-index write and its error record ------------------------------------- */

__global__ void kv__dev_error_finish_kernel(struct kv_attn_cuda_errors *e,
                                            struct kv__dev_arrays a)
{
    kv__dev_error_finish_in(e, &a);
}

/* The arrays of a slots or pairs launch, for the finish. */
static struct kv__dev_arrays slots_arrays(const int64_t *slots, int64_t n)
{
    struct kv__dev_arrays a;
    memset(&a, 0, sizeof(a));
    a.slots = slots;
    a.n_slots = n;
    return a;
}

static struct kv__dev_arrays pairs_arrays(const struct kv_block_copy *pairs, uint32_t n)
{
    struct kv__dev_arrays a;
    memset(&a, 0, sizeof(a));
    a.pairs = pairs;
    a.n_pairs = n;
    return a;
}

/* The end of a device-index launch: the finish of the error record (when
 * given) over the launch's arrays a, then the launch's status. */
static kv_status finish_dev(struct kv_attn_cuda_errors *err, const struct kv__dev_arrays &a,
                            cudaStream_t s, const char *fn)
{
    if (err)
        kv__dev_error_finish_kernel<<<1, 1, 0, s>>>(err, a);
    return kv__cuda_status(cudaGetLastError(), fn);
}

/* No allocation, no copy, no synchronization: capture-safe. */
extern "C" kv_status kv__cuda_attn_write_dev(const struct kv__attn_job *j, const int64_t *slots,
                                             int64_t n_slots, bool by_value,
                                             struct kv_attn_cuda_errors *err, kv_cuda_stream stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    const char *fn = j->fn;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || n_slots == 0)
        return st;
    struct kv__cmove m;
    const bool bytes = kv__cmove_build_dev(j, slots, n_slots, err, &m);
    kv__cmove_scales_dev(j, by_value, &m);
    const int grid = kv__attn_grid_of(m.n_items);
    if (bytes) {
        launch_move_bytes(m, NULL, grid, 1, s);
    } else {
        kv__move_convert_kernel<<<grid, kv__cmove_threads(&m, 0, 1), 0, s>>>(m, NULL, NULL);
    }
    return finish_dev(err, slots_arrays(slots, n_slots), s, fn);
}

/* No allocation, no copy, no synchronization: capture-safe. Split-KV
 * (kv__cdec_body) only with a workspace: as many chunks as the plan (with
 * the caller's max_tokens hint, -1 none) asks and ws_bytes hold (none: the
 * vector body). */
extern "C" kv_status kv__cuda_attn_decode_dev_ws(const struct kv__attn_job *j,
                                                 const struct kv_attn_dev_pages *pg, bool by_value,
                                                 struct kv_attn_cuda_errors *err, void *ws,
                                                 size_t ws_bytes, int64_t max_tokens,
                                                 kv_cuda_stream stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    const char *fn = j->fn;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || j->n_seqs == 0)
        return st;
    struct kv__cdec p;
    size_t shmem = 0;
    if ((st = kv__cdec_build(j, fn, &p, &shmem)) != KV_OK)
        return st;
    kv__cdec_build_dev(j, pg, err, &p);
    kv__cdec_scales_dev(j, by_value, &p);
    if (p.body == KV__CDEC_SPLIT) {
        kv__cdec_split_plan(&p, j->n_seqs, max_tokens, device_sms());
        const size_t per = kv__cdec_ws_bytes(&p) / (size_t)p.n_split;
        const int64_t fit = ws ? (int64_t)(ws_bytes / per) : 0;
        if (fit < p.n_split)
            p.n_split = fit;
        p.ws = (float *)ws;
        if (p.n_split < 1)
            p.body = KV__CDEC_VEC;
    }
    if ((st = launch_decode(p, j->n_seqs, shmem, s, fn)) != KV_OK)
        return st;
    return finish_dev(err, kv__dev_pages_arrays(pg, j->n_seqs, NULL), s, fn);
}

extern "C" kv_status kv__cuda_attn_decode_dev(const struct kv__attn_job *j,
                                              const struct kv_attn_dev_pages *pg, bool by_value,
                                              struct kv_attn_cuda_errors *err,
                                              kv_cuda_stream stream)
{
    return kv__cuda_attn_decode_dev_ws(j, pg, by_value, err, NULL, 0, -1, stream);
}

extern "C" kv_status kv__cuda_attn_copy_dev(const struct kv__attn_job *j,
                                            const struct kv_block_copy *pairs, uint32_t n,
                                            struct kv_attn_cuda_errors *err, kv_cuda_stream stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    const char *fn = j->fn;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || n == 0)
        return st;
    struct kv__ccopy p;
    int w = 1;
    if ((st = kv__ccopy_build_dev(j, pairs, n, err, &p, &w)) != KV_OK)
        return st;
    launch_copy(p, w, s);
    return finish_dev(err, pairs_arrays(pairs, n), s, fn);
}

extern "C" kv_status kv__cuda_attn_read_dev(const struct kv__attn_job *j,
                                            const struct kv_attn_dev_pages *pg,
                                            const int32_t *out_indptr, bool by_value,
                                            struct kv_attn_cuda_errors *err, kv_cuda_stream stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    const char *fn = j->fn;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || j->n_seqs == 0)
        return st;
    struct kv__cmove m;
    const bool bytes = kv__cmove_build_read_dev(j, pg, out_indptr, err, &m);
    kv__cmove_scales_dev(j, by_value, &m);
    const int grid = kv__attn_grid_of(m.n_items);
    if (bytes)
        launch_move_bytes(m, NULL, grid, 1, s);
    else
        kv__move_convert_kernel<<<grid, kv__cmove_threads(&m, 0, 1), 0, s>>>(m, NULL, NULL);
    return finish_dev(err, kv__dev_pages_arrays(pg, j->n_seqs, out_indptr), s, fn);
}

extern "C" kv_status kv__cuda_attn_copy_ex_dev(const struct kv__attn_job *j,
                                               const struct kv_block_copy *pairs, uint32_t n,
                                               struct kv_attn_cuda_errors *err,
                                               kv_cuda_stream stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    const char *fn = j->fn;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || n == 0)
        return st;
    struct kv__ccopy_ex p;
    int w = 1;
    kv__ccopy_ex_build_dev(j, pairs, n, err, &p, &w);
    launch_copy(p, w, s);
    return finish_dev(err, pairs_arrays(pairs, n), s, fn);
}

extern "C" kv_status kv__cuda_attn_errors_alloc(struct kv_attn_cuda_errors **out)
{
    static const char fn[] = "kv_attn_cuda_errors_create";
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK)
        return st;
    void *p = NULL;
    st = kv__cuda_status(cudaMalloc(&p, sizeof(struct kv_attn_cuda_errors)), fn);
    if (st != KV_OK)
        return st;
    st = kv__cuda_status(cudaMemset(p, 0, sizeof(struct kv_attn_cuda_errors)), fn);
    if (st != KV_OK) {
        (void)cudaFree(p);
        return st;
    }
    *out = (struct kv_attn_cuda_errors *)p;
    return KV_OK;
}

extern "C" void kv__cuda_attn_errors_free(struct kv_attn_cuda_errors *e)
{
    (void)cudaFree(e);
}

extern "C" kv_status kv__cuda_attn_errors_zero(struct kv_attn_cuda_errors *e, kv_cuda_stream stream)
{
    return kv__cuda_status(cudaMemsetAsync(e, 0, sizeof(*e), (cudaStream_t)stream),
                           "kv_attn_cuda_errors_reset");
}

extern "C" kv_status kv__cuda_attn_errors_read(const struct kv_attn_cuda_errors *e,
                                               struct kv_attn_cuda_errors *host,
                                               kv_cuda_stream stream)
{
    static const char fn[] = "kv_attn_cuda_errors_get";
    cudaStream_t s = (cudaStream_t)stream;
    kv_status st =
        kv__cuda_status(cudaMemcpyAsync(host, e, sizeof(*host), cudaMemcpyDeviceToHost, s), fn);
    if (st == KV_OK)
        st = kv__cuda_status(cudaStreamSynchronize(s), fn);
    return st;
}

/* ---- copy blocks ---------------------------------------------------------------- */

extern "C" kv_status kv__cuda_attn_copy(const struct kv__attn_job *j, kv_cuda_stream stream)
{
    const char *fn = j->fn;
    cudaStream_t s = (cudaStream_t)stream;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || j->n_copies == 0)
        return st;
    int64_t *offs = (int64_t *)kv__mem_alloc((size_t)j->n_copies * 2 * sizeof(int64_t));
    if (!offs)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %u copies", fn, j->n_copies);
    struct kv__ccopy p;
    int w = 1;
    if ((st = kv__ccopy_build(j, offs, &p, &w)) != KV_OK) {
        kv__mem_free(offs);
        return st;
    }
    return launch_copy_offs(p, w, offs, j->n_copies, s, fn);
}

extern "C" kv_status kv__cuda_attn_copy_ex(const struct kv__attn_job *j, kv_cuda_stream stream)
{
    const char *fn = j->fn;
    cudaStream_t s = (cudaStream_t)stream;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || j->n_copies == 0)
        return st;
    const int64_t n_units = kv__ccopy_ex_units(j);
    int64_t *offs = (int64_t *)kv__mem_alloc((size_t)n_units * 2 * sizeof(int64_t));
    if (!offs)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %u copies", fn, j->n_copies);
    struct kv__ccopy_ex p;
    int w = 1;
    kv__ccopy_ex_build(j, offs, &p, &w);
    return launch_copy_offs(p, w, offs, n_units, s, fn);
}

/* ---- decode attention -------------------------------------------------------------- */

extern "C" kv_status kv__cuda_attn_decode(const struct kv__attn_job *j, kv_cuda_stream stream)
{
    static const char fn[] = "kv_attn_decode_cuda";
    cudaStream_t s = (cudaStream_t)stream;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || j->n_seqs == 0)
        return st;
    struct kv__cdec p;
    size_t shmem = 0;
    if ((st = kv__cdec_build(j, fn, &p, &shmem)) != KV_OK)
        return st;
    float scales[2 * 1024];
    kv__cdec_scales(j, &p, scales);
    struct dev_table d = {NULL, NULL, NULL};
    void *d_scales = NULL, *d_ws = NULL;
    if (p.body == KV__CDEC_SPLIT) {
        int64_t max_tokens = 0;
        for (uint32_t i = 0; i < j->n_seqs; i++)
            max_tokens = j->seq_tokens[i] > max_tokens ? j->seq_tokens[i] : max_tokens;
        kv__cdec_split_plan(&p, j->n_seqs, max_tokens, device_sms());
        /* the host-index mode allocates on the stream anyway */
        if ((st = kv__cuda_status(cudaMallocAsync(&d_ws, kv__cdec_ws_bytes(&p), s), fn)) != KV_OK)
            return st;
        p.ws = (float *)d_ws;
    }
    if ((st = upload_table(j, &p, &d, s, fn)) != KV_OK ||
        (st = upload(&d_scales, scales, (size_t)(2 * p.n_mul) * sizeof(float), s, fn)) != KV_OK)
        goto out;
    p.scales = (const float *)d_scales;
    if ((st = launch_decode(p, j->n_seqs, shmem, s, fn)) == KV_OK)
        st = kv__cuda_status(cudaGetLastError(), fn);
out:
    release(d_ws, s);
    release(d_scales, s);
    release_table(&d, s);
    return st;
}

/* ---- MLA decode --------------------------------------------------------------------- */

extern "C" kv_status kv__cuda_attn_decode_mla_dev(const struct kv__attn_job *j,
                                                  const struct kv_attn_dev_pages *pg,
                                                  const float *ksc, struct kv_attn_cuda_errors *err,
                                                  kv_cuda_stream stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    const char *fn = j->fn;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || j->n_seqs == 0)
        return st;
    struct kv__cmla p;
    int64_t blocks = 0;
    size_t shmem = 0;
    if ((st = kv__cmla_build(j, fn, &p, &blocks, &shmem)) != KV_OK)
        return st;
    kv__cmla_build_dev(j, pg, err, ksc, &p);
    kv__decode_mla_kernel<<<(unsigned)blocks, 32 * KV__DEC_WARPS, shmem, s>>>(p);
    return finish_dev(err, kv__dev_pages_arrays(pg, j->n_seqs, NULL), s, fn);
}

extern "C" kv_status kv__cuda_attn_decode_mla(const struct kv__attn_job *j, kv_cuda_stream stream)
{
    static const char fn[] = "kv_attn_decode_mla_cuda";
    cudaStream_t s = (cudaStream_t)stream;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || j->n_seqs == 0)
        return st;
    struct kv__cmla p;
    int64_t blocks = 0;
    size_t shmem = 0;
    if ((st = kv__cmla_build(j, fn, &p, &blocks, &shmem)) != KV_OK)
        return st;
    struct dev_table d = {NULL, NULL, NULL};
    if ((st = upload_table(j, &p, &d, s, fn)) == KV_OK) {
        kv__decode_mla_kernel<<<(unsigned)blocks, 32 * KV__DEC_WARPS, shmem, s>>>(p);
        st = kv__cuda_status(cudaGetLastError(), fn);
    }
    release_table(&d, s);
    return st;
}

/* ---- multi-token attention (and decode with options) ------------------------------ */

template <int W> __global__ void kv__prefill_kernel(struct kv__cpre p)
{
    extern __shared__ float sh[];
    const struct kv_grid_ctx c = kv__ctx(sh);
    kv__prefill_body(&c, &p, W);
}

/* kv__prefill_kernel at the width kv__cpre_width chose (16, 8, 4, 2, 1). */
static void launch_prefill(const struct kv__cpre &p, int w, int64_t blocks, size_t shmem,
                           cudaStream_t s)
{
    const unsigned grid = (unsigned)blocks, threads = 32 * KV__PF_WARPS;
    if (w == 16)
        kv__prefill_kernel<16><<<grid, threads, shmem, s>>>(p);
    else if (w == 8)
        kv__prefill_kernel<8><<<grid, threads, shmem, s>>>(p);
    else if (w == 4)
        kv__prefill_kernel<4><<<grid, threads, shmem, s>>>(p);
    else if (w == 2)
        kv__prefill_kernel<2><<<grid, threads, shmem, s>>>(p);
    else
        kv__prefill_kernel<1><<<grid, threads, shmem, s>>>(p);
}

extern "C" kv_status kv__cuda_attn_prefill(const struct kv__attn_job *j, kv_cuda_stream stream)
{
    const char *fn = j->fn;
    cudaStream_t s = (cudaStream_t)stream;
    kv_status st = kv__cuda_ready(fn, NULL);
    if (st != KV_OK || j->n_seqs == 0)
        return st;
    const size_t idx_bytes = ((size_t)j->n_seqs + 1) * sizeof(int64_t);
    int64_t *tile_start = (int64_t *)kv__mem_alloc(idx_bytes);
    if (!tile_start)
        return kv__error(KV_ERR_NO_MEMORY, "%s: %u sequences", fn, j->n_seqs);
    struct kv__cpre p;
    int64_t blocks = 0;
    size_t shmem = 0;
    int w = 1;
    float scales[2 * 1024];
    struct dev_table d = {NULL, NULL, NULL};
    void *d_q = NULL, *d_tiles = NULL, *d_scales = NULL;
    if ((st = kv__cpre_build(j, fn, &p, tile_start, &blocks, &shmem, &w)) != KV_OK || blocks == 0)
        goto out;
    kv__cpre_scales(j, &p, scales);
    if ((st = upload_table(j, &p, &d, s, fn)) != KV_OK ||
        (j->q_start && (st = upload(&d_q, j->q_start, idx_bytes, s, fn)) != KV_OK) ||
        (st = upload(&d_tiles, tile_start, idx_bytes, s, fn)) != KV_OK ||
        (st = upload(&d_scales, scales, (size_t)(2 * p.n_mul) * sizeof(float), s, fn)) != KV_OK)
        goto out;
    p.q_start = (const int64_t *)d_q;
    p.tile_start = (const int64_t *)d_tiles;
    p.scales = (const float *)d_scales;
    launch_prefill(p, w, blocks, shmem, s);
    st = kv__cuda_status(cudaGetLastError(), fn);
out:
    release(d_scales, s);
    release(d_tiles, s);
    release(d_q, s);
    release_table(&d, s);
    kv__mem_free(tile_start);
    return st;
}
