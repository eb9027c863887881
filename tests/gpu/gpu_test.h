/* gpu_test.h - the abort-on-failure check shared by the GPU test programs. */
#ifndef GPU_TEST_H
#define GPU_TEST_H

#include <stdio.h>
#include <stdlib.h>

#include <kvcache/kv.h>

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "FAIL %s:%d: %s (%s)\n", __FILE__, __LINE__, #c, kv_last_error());     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#endif /* GPU_TEST_H */
