/* kv_dtype.c - dtype sizes, names and parsing. */
#include <string.h>

#include "kv_dtype.h"
#include "kv_lib.h"

size_t kv_dtype_size(kv_dtype dt)
{
    switch (dt) {
#define KV__DTYPE_SIZE(e, name, bytes)                                                             \
    case e:                                                                                        \
        return bytes;
        KV_DTYPE_MAP(KV__DTYPE_SIZE)
#undef KV__DTYPE_SIZE
    case KV_DTYPE_COUNT:
        break;
    }
    return 0;
}

const char *kv_dtype_name(kv_dtype dt)
{
    switch (dt) {
#define KV__DTYPE_NAME(e, name, bytes)                                                             \
    case e:                                                                                        \
        return name;
        KV_DTYPE_MAP(KV__DTYPE_NAME)
#undef KV__DTYPE_NAME
    case KV_DTYPE_COUNT:
        break;
    }
    return "?";
}

static const struct {
    const char *alias;
    kv_dtype dt;
} kv__dtype_aliases[] = {
    {"float32", KV_F32},   {"float", KV_F32},    {"float16", KV_F16},   {"half", KV_F16},
    {"bfloat16", KV_BF16}, {"fp8", KV_FP8_E4M3}, {"e4m3", KV_FP8_E4M3}, {"e5m2", KV_FP8_E5M2},
    {"int8", KV_I8},       {"int32", KV_I32},    {"int64", KV_I64},     {"uint8", KV_U8},
    {"float64", KV_F64},   {"double", KV_F64},
};

kv_status kv_dtype_parse(const char *name, kv_dtype *out)
{
    if (!name || !out)
        return kv__error(KV_ERR_NULL, "kv_dtype_parse: name=%p out=%p", (const void *)name,
                         (void *)out);
    for (int i = 0; i < KV_DTYPE_COUNT; i++) {
        if (strcmp(name, kv_dtype_name((kv_dtype)i)) == 0) {
            *out = (kv_dtype)i;
            return kv__ok();
        }
    }
    for (size_t i = 0; i < sizeof(kv__dtype_aliases) / sizeof(kv__dtype_aliases[0]); i++) {
        if (strcmp(name, kv__dtype_aliases[i].alias) == 0) {
            *out = kv__dtype_aliases[i].dt;
            return kv__ok();
        }
    }
    return kv__error(KV_ERR_INVALID_ARG,
                     "unknown dtype '%s' (known: f32 f16 bf16 fp8_e4m3 fp8_e5m2 i8 i32 i64 u8 f64)",
                     name);
}
