/* kv_version.c - the version and build of the library actually linked. */
#include <stdio.h>

#include "kv_mem.h"
#include "kv_version.h"

const char *kv_version(void)
{
    return KV_VERSION_STRING;
}

const char *kv_build_info(void)
{
    static _Thread_local char line[128];
    snprintf(line, sizeof(line), "kvcache %s host-memory=%s cuda=%s rdma=%s", KV_VERSION_STRING,
             kv__mem_backend(), KV_HAVE_CUDA ? "yes" : "no", KV_HAVE_RDMA ? "yes" : "no");
    return line;
}
