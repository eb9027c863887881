/*
 * kv.h - umbrella header for kvcache, a paged KV-cache subsystem for LLM
 * serving engines. Include this to get every public module.
 */
#ifndef KV_H
#define KV_H

/* Version of these headers (kv_version() gives the linked library's). */
#define KV_VERSION_MAJOR 0
#define KV_VERSION_MINOR 1
#define KV_VERSION_PATCH 0
#define KV_VERSION_STRING "0.1.0"

/* Core (kvcache/). */
#include "kv_block_ops.h"
#include "kv_dtype.h"
#include "kv_layout.h"
#include "kv_mem.h"
#include "kv_page_table.h"
#include "kv_status.h"
#include "kv_view.h"

/* Allocator (allocator/). The umbrella is the one kvcache/ header that names
 * other modules: it is what an engine includes, and it is installed with all
 * public headers in one include/kvcache/ directory. */
#include "kv_arena.h"
#include "kv_block_pool.h"
#include "kv_cache.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "0.1.0": the version of the library actually linked. */
KV_API const char *kv_version(void);

#ifdef __cplusplus
}
#endif

#endif /* KV_H */
