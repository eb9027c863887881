/*
 * kv_abi.h - the size, alignment and field offsets of the public structs,
 * read at run time by bindings that declare them without a C compiler (the
 * Python package declares them in ctypes and checks every field against
 * these at import, so a binding built against other headers fails loudly
 * instead of reading the wrong bytes).
 *
 * It is the binding/ module: what a binding built without a C compiler needs
 * from the library. It sits above every other module because it names
 * structs of all of them. The table covers the structs the Python package
 * uses; a name not in it is KV_ERR_NOT_FOUND.
 */
#ifndef KV_ABI_H
#define KV_ABI_H

#include <stddef.h>

#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* sizeof and _Alignof of struct `name` ("kv_layout", without "struct").
 * KV_ERR_NULL; KV_ERR_NOT_FOUND (not in the table). */
KV_API KV_NODISCARD kv_status kv_abi_struct(const char *name, size_t *size, size_t *align);

/* offsetof and sizeof of field `field` of struct `name` (arrays: the whole
 * array). KV_ERR_NULL; KV_ERR_NOT_FOUND (struct or field not in the table,
 * named). */
KV_API KV_NODISCARD kv_status kv_abi_field(const char *name, const char *field, size_t *offset,
                                           size_t *size);

#ifdef __cplusplus
}
#endif

#endif /* KV_ABI_H */
