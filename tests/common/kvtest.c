/* kvtest.c - helpers shared by the cmocka suites. */
#include <stdio.h>
#include <stdlib.h>

#include "kvtest.h"

const char *kvt_data_path(const char *name)
{
    static char buf[4096];
    const char *dir = getenv("KV_TEST_DATA_DIR");
    snprintf(buf, sizeof(buf), "%s/%s", dir && *dir ? dir : KV_TEST_DATA_DIR, name);
    return buf;
}
