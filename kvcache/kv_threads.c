/* kv_threads.c - the process-wide thread count (kv_threads.h). */
#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>

#include "kv_lib.h"
#include "kv_threads.h"

static _Atomic int kv__threads_set; /* 0: every core */

kv_status kv_set_threads(int n)
{
    if (n < 0)
        return kv__error(KV_ERR_INVALID_ARG, "kv_set_threads: %d < 0 (0 means every core)", n);
    atomic_store_explicit(&kv__threads_set, n, memory_order_relaxed);
    return kv__ok();
}

int kv_threads(void)
{
    const int n = atomic_load_explicit(&kv__threads_set, memory_order_relaxed);
    if (n > 0)
        return n;
    /* The cores this process may run on (its affinity mask), as OpenMP's
     * omp_get_num_procs counts them. */
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set);
    const long c = sysconf(_SC_NPROCESSORS_ONLN);
    return c > 0 ? (int)c : 1;
}
