/*
 * kv.h - umbrella header for kvcache, a paged KV-cache subsystem for LLM
 * serving engines. Include this to get every public module.
 */
#ifndef KV_H
#define KV_H

#define KV_VERSION_MAJOR 0
#define KV_VERSION_MINOR 1
#define KV_VERSION_PATCH 0
#define KV_VERSION_STRING "0.1.0"

#include "kv_dtype.h"
#include "kv_mem.h"
#include "kv_status.h"
#include "kv_view.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "0.1.0": the version of the library actually linked. */
KV_API const char *kv_version(void);

#ifdef __cplusplus
}
#endif

#endif /* KV_H */
