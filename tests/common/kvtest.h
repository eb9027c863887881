/*
 * kvtest.h - small helpers shared by the cmocka suites.
 */
#ifndef KVTEST_H
#define KVTEST_H

#include <stdint.h>

#ifndef KV_TEST_DATA_DIR
#define KV_TEST_DATA_DIR "tests/data"
#endif

/* Deterministic PRNG (splitmix64) so a failing case can be replayed. */
static inline uint64_t kvt_rand(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [lo, hi]. */
static inline int64_t kvt_range(uint64_t *state, int64_t lo, int64_t hi)
{
    return lo + (int64_t)(kvt_rand(state) % (uint64_t)(hi - lo + 1));
}

/* Path of a file under tests/data (env KV_TEST_DATA_DIR overrides). */
const char *kvt_data_path(const char *name);

#endif /* KVTEST_H */
