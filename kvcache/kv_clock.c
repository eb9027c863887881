/* kv_clock.c - the monotonic clock and deadlines of every timed wait (kv_lib.h). */
#include <stdint.h>
#include <time.h>

#include "kv_lib.h"

#define KV__NS_PER_S 1000000000ull

uint64_t kv__now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * KV__NS_PER_S + (uint64_t)ts.tv_nsec;
}

uint64_t kv__deadline_ns(uint32_t timeout_ms)
{
    return kv__now_ns() + (uint64_t)timeout_ms * 1000000ull;
}

struct timespec kv__ns_to_ts(uint64_t ns)
{
    return (struct timespec){.tv_sec = (time_t)(ns / KV__NS_PER_S),
                             .tv_nsec = (long)(ns % KV__NS_PER_S)};
}

struct timespec kv__deadline_ts(uint32_t timeout_ms)
{
    return kv__ns_to_ts(kv__deadline_ns(timeout_ms));
}
