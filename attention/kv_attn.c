/* kv_attn.c - what the CPU and CUDA kernels share: the path counters. */
#include <stdatomic.h>

#include "kv_attn_int.h"

/* ---- stats --------------------------------------------------------------------- */

static _Atomic uint64_t kv__attn_calls[2][KV_ATTN_KERNEL_COUNT][KV_ATTN_PATH_COUNT];

void kv__attn_count(const struct kv__attn_job *job, bool cuda)
{
    if ((unsigned)job->kernel < KV_ATTN_KERNEL_COUNT && (unsigned)job->path < KV_ATTN_PATH_COUNT)
        atomic_fetch_add_explicit(&kv__attn_calls[cuda][job->kernel][job->path], 1,
                                  memory_order_relaxed);
}

void kv_attn_stats_get(struct kv_attn_stats *out)
{
    if (!out)
        return;
    for (int k = 0; k < KV_ATTN_KERNEL_COUNT; k++)
        for (int p = 0; p < KV_ATTN_PATH_COUNT; p++) {
            out->cpu[k][p] = atomic_load_explicit(&kv__attn_calls[0][k][p], memory_order_relaxed);
            out->cuda[k][p] = atomic_load_explicit(&kv__attn_calls[1][k][p], memory_order_relaxed);
        }
}

void kv_attn_stats_reset(void)
{
    for (int c = 0; c < 2; c++)
        for (int k = 0; k < KV_ATTN_KERNEL_COUNT; k++)
            for (int p = 0; p < KV_ATTN_PATH_COUNT; p++)
                atomic_store_explicit(&kv__attn_calls[c][k][p], 0, memory_order_relaxed);
}

const char *kv_attn_path_name(enum kv_attn_path p)
{
    switch (p) {
    case KV_ATTN_PATH_CANONICAL:
        return "canonical";
    case KV_ATTN_PATH_OUTER_STRIDE:
        return "outer_stride";
    case KV_ATTN_PATH_GENERIC:
        return "generic";
    case KV_ATTN_PATH_COUNT:
        break;
    }
    return "?";
}
