/*
 * kv.h - umbrella header of kvcache, a paged KV-cache subsystem for LLM
 * serving engines: `#include <kvcache/kv.h>` gives every public module.
 *
 * It lives outside the modules (include/kvcache/) because it names all of
 * them; the installed tree puts it beside every public header in
 * include/kvcache/. Modules are listed bottom-up, in their dependency order
 * (docs/design.md): kvcache <- allocator <- {attention, connector} <-
 * binding. The *_hd.h addressing headers the kernels share are not part of
 * the installed API (docs/design.md, "Header tiers").
 * scripts/check-walls.py fails CI when a public header is missing here.
 */
#ifndef KV_H
#define KV_H

/* Core (kvcache/): status codes, version, dtypes, views, layouts, page tables. */
#include "kv_status.h"
#include "kv_version.h"
#include "kv_dtype.h"
#include "kv_threads.h"
#include "kv_view.h"
#include "kv_dlpack.h"
#include "kv_layout.h"
#include "kv_block_ops.h"
#include "kv_page_table.h"

/* Allocator (allocator/): arenas, the block pool, the cache object and the
 * paged cache every executor takes. */
#include "kv_arena.h"
#include "kv_block_pool.h"
#include "kv_cache.h"
#include "kv_paged.h"

/* Attention (attention/): the kernels. */
#include "kv_attn.h"

/* Connector (connector/): transfer plans, pack/unpack, the offload tier,
 * transports. */
#include "kv_plan.h"
#include "kv_offload.h"
#include "kv_pack.h"
#include "kv_transport.h"
#include "kv_xport_layers.h"

/* Binding (binding/): what bindings without a C compiler read (the ABI). */
#include "kv_abi.h"

#endif /* KV_H */
