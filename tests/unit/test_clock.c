/*
 * test_clock.c - kvcache/kv_lib.h's clock (kv_clock.c), the one source of
 * the library's deadlines: kv__now_ns reads CLOCK_MONOTONIC and never goes
 * back, kv__deadline_ns is now + ms (to UINT32_MAX ms), kv__ns_to_ts splits
 * exactly, and a kv__deadline_ts deadline is what a timed wait on a
 * CLOCK_MONOTONIC condition variable times out at.
 */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include <cmocka.h>

#include "kv_lib.h"

static uint64_t libc_now_ns(void)
{
    struct timespec ts;
    assert_int_equal(clock_gettime(CLOCK_MONOTONIC, &ts), 0);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void test_clock_now_is_monotonic(void **state)
{
    (void)state;
    uint64_t prev = kv__now_ns();
    for (int i = 0; i < 100000; i++) {
        const uint64_t a = libc_now_ns(), n = kv__now_ns(), b = libc_now_ns();
        assert_true(a <= n && n <= b); /* the same clock, read between */
        assert_true(prev <= n);
        prev = n;
    }
}

static void test_clock_deadline_ns_is_now_plus_ms(void **state)
{
    (void)state;
    static const uint32_t ms[] = {0, 1, 999, 1000, 1001, 60000, UINT32_MAX};
    for (size_t i = 0; i < sizeof(ms) / sizeof(ms[0]); i++) {
        const uint64_t add = (uint64_t)ms[i] * 1000000ull;
        const uint64_t a = libc_now_ns(), d = kv__deadline_ns(ms[i]), b = libc_now_ns();
        if (d < a + add || d > b + add)
            fail_msg("%u ms: deadline %llu outside [%llu, %llu]", ms[i], (unsigned long long)d,
                     (unsigned long long)(a + add), (unsigned long long)(b + add));
    }
}

static void test_clock_ns_to_ts_splits_exactly(void **state)
{
    (void)state;
    static const struct {
        uint64_t ns;
        long long sec;
        long nsec;
    } v[] = {
        {0, 0, 0},
        {999999999ull, 0, 999999999},
        {1000000000ull, 1, 0},
        {1999999999ull, 1, 999999999},
        {UINT64_MAX, 18446744073LL, 709551615},
    };
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        const struct timespec ts = kv__ns_to_ts(v[i].ns);
        assert_true((long long)ts.tv_sec == v[i].sec);
        assert_int_equal(ts.tv_nsec, v[i].nsec);
    }
    /* a deadline as a timespec: the same instant, nanoseconds in range */
    for (uint32_t ms = 0; ms < 3000; ms += 7) {
        const uint64_t a = kv__now_ns();
        const struct timespec ts = kv__deadline_ts(ms);
        const uint64_t b = kv__now_ns();
        const uint64_t d = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
        assert_true(ts.tv_nsec >= 0 && ts.tv_nsec < 1000000000L);
        assert_true(d >= a + (uint64_t)ms * 1000000ull && d <= b + (uint64_t)ms * 1000000ull);
    }
}

static void test_clock_timed_wait_ends_at_deadline(void **state)
{
    (void)state;
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    assert_int_equal(pthread_condattr_setclock(&ca, CLOCK_MONOTONIC), 0);
    assert_int_equal(pthread_cond_init(&cv, &ca), 0);
    pthread_condattr_destroy(&ca);
    const uint64_t t0 = kv__now_ns();
    const struct timespec ts = kv__deadline_ts(30);
    int r = 0;
    pthread_mutex_lock(&mu);
    while (r != ETIMEDOUT) /* nobody signals: only the deadline ends it */
        r = pthread_cond_timedwait(&cv, &mu, &ts);
    pthread_mutex_unlock(&mu);
    const uint64_t took = kv__now_ns() - t0;
    assert_true(took >= 30000000ull); /* on CLOCK_REALTIME it would be long past */
    assert_true(took < 5000000000ull);
    pthread_cond_destroy(&cv);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_clock_now_is_monotonic),
        cmocka_unit_test(test_clock_deadline_ns_is_now_plus_ms),
        cmocka_unit_test(test_clock_ns_to_ts_splits_exactly),
        cmocka_unit_test(test_clock_timed_wait_ends_at_deadline),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
