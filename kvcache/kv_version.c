/* kv_version.c - the version of the library actually linked. */
#include "kv.h"

const char *kv_version(void)
{
    return KV_VERSION_STRING;
}
