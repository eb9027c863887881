/*
 * kv_version.h - the version of these headers and of the linked library.
 *
 * The major version is the shared library's SONAME (libkvcache.so.0); while
 * it is 0, a minor version may change the ABI (config struct sizes, ops
 * table versions), and the config structs' struct_size field refuses a
 * mismatched caller instead of misreading it.
 */
#ifndef KV_VERSION_H
#define KV_VERSION_H

#include "kv_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Version of these headers (kv_version() gives the linked library's). */
#define KV_VERSION_MAJOR 0
#define KV_VERSION_MINOR 2
#define KV_VERSION_PATCH 0
#define KV_VERSION_STRING "0.2.0"

/* "0.2.0": the version of the library actually linked. */
KV_API const char *kv_version(void);

/* One line saying how the linked library was built:
 * "kvcache 0.2.0 host-memory=jemalloc cuda=yes rdma=no" (host-memory is
 * libc in sanitizer builds; cuda/rdma say whether that backend's code was
 * compiled in, not whether a device is present). */
KV_API const char *kv_build_info(void);

#ifdef __cplusplus
}
#endif

#endif /* KV_VERSION_H */
