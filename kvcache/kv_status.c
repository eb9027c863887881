/* kv_status.c - status names, messages and the per-thread last error. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "kv_lib.h"
#include "kv_version.h"

static _Thread_local char kv__last_error[1024];
static _Thread_local unsigned kv__muted;

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
    if (kv__muted)
        return s;
    va_start(ap, fmt);
    vsnprintf(kv__last_error, sizeof(kv__last_error), fmt, ap);
    va_end(ap);
    return s;
}

kv_status kv__error_wrap(kv_status s, const char *fmt, ...)
{
    char inner[sizeof(kv__last_error)];
    va_list ap;
    int n;

    if (kv__muted)
        return s;
    snprintf(inner, sizeof(inner), "%s", kv__last_error[0] ? kv__last_error : "(no detail)");
    va_start(ap, fmt);
    n = vsnprintf(kv__last_error, sizeof(kv__last_error), fmt, ap);
    va_end(ap);
    if (n < 0)
        return s;
    /* append ": inner", cut (never overrun) when it does not fit */
    size_t used = (size_t)n < sizeof(kv__last_error) ? (size_t)n : sizeof(kv__last_error) - 1;
    size_t room = sizeof(kv__last_error) - 1 - used;
    size_t len = strlen(inner);
    if (room >= 2) {
        memcpy(kv__last_error + used, ": ", 2);
        used += 2;
        room -= 2;
        if (len > room)
            len = room;
        memcpy(kv__last_error + used, inner, len);
        used += len;
    }
    kv__last_error[used] = '\0';
    return s;
}

kv_status kv__ok(void)
{
    if (!kv__muted)
        kv__last_error[0] = '\0';
    return KV_OK;
}

void kv__error_clear(void)
{
    if (!kv__muted)
        kv__last_error[0] = '\0';
}

void kv__error_mute(void)
{
    kv__muted++;
}

void kv__error_unmute(void)
{
    if (kv__muted)
        kv__muted--;
}

/* The one alignment check: a device pointer or a host array, `why` says
 * what a misaligned one would do. */
static kv_status check_aligned(const char *fn, const char *name, const void *p, size_t align,
                               const char *why)
{
    if ((uintptr_t)p % align == 0)
        return KV_OK;
    return kv__error(KV_ERR_INVALID_ARG, "%s: %s=%p is not %zu-byte aligned (%s)", fn, name, p,
                     align, why);
}

kv_status kv__check_dev_aligned(const char *fn, const char *name, const void *p, size_t align)
{
    return check_aligned(fn, name, p, align,
                         "the kernel's loads would fault: cudaErrorMisalignedAddress");
}

kv_status kv__check_aligned(const char *fn, const char *name, const void *p, size_t align)
{
    return check_aligned(fn, name, p, align, "its elements are read as aligned words");
}

kv_status kv__check_struct_size(const char *fn, const char *type, size_t got, size_t want)
{
    char upper[64];
    size_t i = 0;

    if (got == want)
        return KV_OK;
    for (; type[i] && i + 1 < sizeof(upper); i++)
        upper[i] = (char)(type[i] >= 'a' && type[i] <= 'z' ? type[i] - 'a' + 'A' : type[i]);
    upper[i] = '\0';
    if (got == 0)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: struct %s has struct_size 0: start it with %s_init() or %s_INIT", fn,
                         type, type, upper);
    return kv__error(KV_ERR_INVALID_ARG,
                     "%s: struct %s has struct_size %zu but this library (kvcache %s) was built "
                     "with %zu: the caller was compiled against other kvcache headers",
                     fn, type, got, KV_VERSION_STRING, want);
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
        used += (size_t)snprintf(buf + used, cap - used, "]");
    if (used >= cap && cap >= 5)
        memcpy(buf + cap - 5, "...]", 5); /* truncated: say so */
    return buf;
}
