/* kv_status.c - status names, messages and the per-thread last error. */
#include <stdarg.h>
#include <stdio.h>

#include "kvcache_int.h"

static _Thread_local char kv__last_error[512];

const char *kv_status_name(kv_status s)
{
    switch (s) {
#define KV__STATUS_NAME(name, value, msg)                                                          \
    case name:                                                                                     \
        return #name;
        KV_STATUS_MAP(KV__STATUS_NAME)
#undef KV__STATUS_NAME
    }
    return "KV_UNKNOWN_STATUS";
}

const char *kv_strerror(kv_status s)
{
    switch (s) {
#define KV__STATUS_MSG(name, value, msg)                                                           \
    case name:                                                                                     \
        return msg;
        KV_STATUS_MAP(KV__STATUS_MSG)
#undef KV__STATUS_MSG
    }
    return "unknown status";
}

const char *kv_last_error(void)
{
    return kv__last_error;
}

kv_status kv__error(kv_status s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(kv__last_error, sizeof(kv__last_error), fmt, ap);
    va_end(ap);
    return s;
}

kv_status kv__ok(void)
{
    kv__last_error[0] = '\0';
    return KV_OK;
}

const char *kv__fmt_list(char *buf, size_t cap, const int64_t *v, int n)
{
    size_t used = 0;
    if (cap == 0)
        return buf;
    buf[0] = '\0';
    used += (size_t)snprintf(buf + used, cap - used, "[");
    for (int i = 0; i < n && used < cap; i++)
        used += (size_t)snprintf(buf + used, cap - used, i ? ",%lld" : "%lld", (long long)v[i]);
    if (used < cap)
        snprintf(buf + used, cap - used, "]");
    return buf;
}
