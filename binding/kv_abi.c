/* kv_abi.c - the struct table of kv_abi.h. */
#include <stddef.h>
#include <string.h>

#include "kv_abi.h"
#include "kv_attn.h"
#include "kv_plan.h"
#include "kv_block_pool.h"
#include "kv_cache.h"
#include "kv_layout.h"
#include "kv_lib.h"
#include "kv_page_table.h"
#include "kv_view.h"
#include "kv_transport.h"
#include "kv_xport_layers.h"

/* X(struct, field) for every field of every struct in the table. */
#define KV__ABI_FIELDS(X)                                                                          \
    X(kv_layout_config, struct_size)                                                               \
    X(kv_layout_config, num_layers)                                                                \
    X(kv_layout_config, num_blocks)                                                                \
    X(kv_layout_config, block_tokens)                                                              \
    X(kv_layout_config, num_heads)                                                                 \
    X(kv_layout_config, head_dim)                                                                  \
    X(kv_layout_config, dtype)                                                                     \
    X(kv_layout_config, order)                                                                     \
    X(kv_layout_config, arrange)                                                                   \
    X(kv_layout_config, kv_packed)                                                                 \
    X(kv_layout_config, block_pad_elems)                                                           \
    X(kv_layout_config, block_stride_bytes)                                                        \
    X(kv_layout_config, align_bytes)                                                               \
    X(kv_layout_config, k_only)                                                                    \
    X(kv_layout, num_layers)                                                                       \
    X(kv_layout, num_blocks)                                                                       \
    X(kv_layout, block_tokens)                                                                     \
    X(kv_layout, num_heads)                                                                        \
    X(kv_layout, head_dim)                                                                         \
    X(kv_layout, dtype)                                                                            \
    X(kv_layout, order)                                                                            \
    X(kv_layout, arrange)                                                                          \
    X(kv_layout, kv_packed)                                                                        \
    X(kv_layout, elem_bytes)                                                                       \
    X(kv_layout, align_bytes)                                                                      \
    X(kv_layout, kv_planes)                                                                        \
    X(kv_layout, block_elems)                                                                      \
    X(kv_layout, block_bytes)                                                                      \
    X(kv_layout, block_stride_elems)                                                               \
    X(kv_layout, block_stride_bytes)                                                               \
    X(kv_layout, stride_layer_elems)                                                               \
    X(kv_layout, stride_kv_elems)                                                                  \
    X(kv_layout, stride_block_elems)                                                               \
    X(kv_layout, stride_token_elems)                                                               \
    X(kv_layout, stride_head_elems)                                                                \
    X(kv_layout, stride_dim_elems)                                                                 \
    X(kv_layout, stride_layer_bytes)                                                               \
    X(kv_layout, stride_kv_bytes)                                                                  \
    X(kv_layout, stride_block_bytes)                                                               \
    X(kv_layout, stride_token_bytes)                                                               \
    X(kv_layout, stride_head_bytes)                                                                \
    X(kv_layout, stride_dim_bytes)                                                                 \
    X(kv_layout, total_elems)                                                                      \
    X(kv_layout, total_bytes)                                                                      \
    X(kv_layout, fingerprint)                                                                      \
    X(kv_layout, block_format_fingerprint)                                                         \
    X(kv_layout, k_only)                                                                           \
    X(kv_cache_config, struct_size)                                                                \
    X(kv_cache_config, layout)                                                                     \
    X(kv_cache_config, mem_kind)                                                                   \
    X(kv_cache_config, device)                                                                     \
    X(kv_cache_config, max_seqs)                                                                   \
    X(kv_cache_config, max_blocks_per_seq)                                                         \
    X(kv_cache_config, page_ratio)                                                                 \
    X(kv_cache_config, enable_prefix_caching)                                                      \
    X(kv_cache_config, zero_fill)                                                                  \
    X(kv_cache_config, on_event)                                                                   \
    X(kv_cache_config, event_user)                                                                 \
    X(kv_cache_config, head_offset)                                                                \
    X(kv_block_pool_stats, capacity)                                                               \
    X(kv_block_pool_stats, free_blocks)                                                            \
    X(kv_block_pool_stats, used_blocks)                                                            \
    X(kv_block_pool_stats, cached_blocks)                                                          \
    X(kv_block_pool_stats, used_high_water)                                                        \
    X(kv_block_pool_stats, hashed_blocks)                                                          \
    X(kv_block_pool_stats, hits)                                                                   \
    X(kv_block_pool_stats, misses)                                                                 \
    X(kv_block_pool_stats, evictions)                                                              \
    X(kv_block_pool_stats, stored)                                                                 \
    X(kv_page_table_stats, live_seqs)                                                              \
    X(kv_page_table_stats, held_blocks)                                                            \
    X(kv_page_table_stats, cow_copies)                                                             \
    X(kv_page_table_stats, copies_held)                                                            \
    X(kv_page_table_stats, reused_blocks)                                                          \
    X(kv_page_table_stats, committed)                                                              \
    X(kv_page_table_stats, commit_failures)                                                        \
    X(kv_token_range, start)                                                                       \
    X(kv_token_range, count)                                                                       \
    X(kv_vllm_export, block_table)                                                                 \
    X(kv_vllm_export, block_table_len)                                                             \
    X(kv_vllm_export, block_table_cols)                                                            \
    X(kv_vllm_export, block_table_pad)                                                             \
    X(kv_vllm_export, slot_mapping)                                                                \
    X(kv_vllm_export, slot_mapping_len)                                                            \
    X(kv_vllm_export, tokens_per_seq)                                                              \
    X(kv_vllm_export, seq_lens)                                                                    \
    X(kv_vllm_export, seq_lens_len)                                                                \
    X(kv_vllm_export, sizes)                                                                       \
    X(kv_vllm_export_sizes, block_table_cols)                                                      \
    X(kv_vllm_export_sizes, block_table_len)                                                       \
    X(kv_vllm_export_sizes, slot_mapping_len)                                                      \
    X(kv_vllm_export_sizes, seq_lens_len)                                                          \
    X(kv_flashinfer_export, indptr)                                                                \
    X(kv_flashinfer_export, indptr_len)                                                            \
    X(kv_flashinfer_export, indices)                                                               \
    X(kv_flashinfer_export, indices_len)                                                           \
    X(kv_flashinfer_export, last_page_len)                                                         \
    X(kv_flashinfer_export, last_page_len_len)                                                     \
    X(kv_block_copy, src)                                                                          \
    X(kv_block_copy, dst)                                                                          \
    X(kv_block_copy, tokens)                                                                       \
    X(kv_view, dtype)                                                                              \
    X(kv_view, ndim)                                                                               \
    X(kv_view, shape)                                                                              \
    X(kv_view, strides)                                                                            \
    X(kv_view, offset)                                                                             \
    X(kv_view, base)                                                                               \
    X(kv_view, storage_bytes)                                                                      \
    X(kv_paged_cache, layout)                                                                      \
    X(kv_paged_cache, base)                                                                        \
    X(kv_paged_cache, storage_bytes)                                                               \
    X(kv_paged_cache, mem)                                                                         \
    X(kv_scales, k)                                                                                \
    X(kv_scales, v)                                                                                \
    X(kv_scales, n)                                                                                \
    X(kv_scales, layers)                                                                           \
    X(kv_pages, format)                                                                            \
    X(kv_pages, n_seqs)                                                                            \
    X(kv_pages, page_ratio)                                                                        \
    X(kv_pages, indptr)                                                                            \
    X(kv_pages, indices)                                                                           \
    X(kv_pages, last_page_len)                                                                     \
    X(kv_pages, block_table)                                                                       \
    X(kv_pages, block_table_cols)                                                                  \
    X(kv_pages, seq_lens)                                                                          \
    X(kv_plan_config, struct_size)                                                                 \
    X(kv_plan_config, src_head0)                                                                   \
    X(kv_plan_config, dst_head0)                                                                   \
    X(kv_plan_config, n_heads)                                                                     \
    X(kv_plan_config, src_layer0)                                                                  \
    X(kv_plan_config, dst_layer0)                                                                  \
    X(kv_plan_config, n_layers)                                                                    \
    X(kv_copy_blocks_opts, struct_size)                                                            \
    X(kv_copy_blocks_opts, layer0)                                                                 \
    X(kv_copy_blocks_opts, n_layers)                                                               \
    X(kv_copy_blocks_opts, planes)                                                                 \
    X(kv_attn_opts, struct_size)                                                                   \
    X(kv_attn_opts, window_left)                                                                   \
    X(kv_attn_opts, logit_soft_cap)                                                                \
    X(kv_attn_opts, lse)                                                                           \
    X(kv_attn_opts, lse_stride)

#define KV__ABI_STRUCTS(X)                                                                         \
    X(kv_layout_config)                                                                            \
    X(kv_layout)                                                                                   \
    X(kv_cache_config)                                                                             \
    X(kv_block_pool_stats)                                                                         \
    X(kv_page_table_stats)                                                                         \
    X(kv_token_range)                                                                              \
    X(kv_vllm_export)                                                                              \
    X(kv_vllm_export_sizes)                                                                        \
    X(kv_flashinfer_export)                                                                        \
    X(kv_block_copy)                                                                               \
    X(kv_view)                                                                                     \
    X(kv_paged_cache)                                                                              \
    X(kv_scales)                                                                                   \
    X(kv_pages)                                                                                    \
    X(kv_plan_config)                                                                              \
    X(kv_copy_blocks_opts)                                                                         \
    X(kv_attn_opts)

/* The transport's structs (kv_transport.h, kv_xport_layers.h) and the plan's
 * stats: the Python package's transport bindings (python/kvcache/transport.py). */
#define KV__ABI_XPORT_FIELDS(X)                                                                    \
    X(kv_plan_stats, window_tokens)                                                                \
    X(kv_plan_stats, window_src_blocks)                                                            \
    X(kv_plan_stats, window_dst_blocks)                                                            \
    X(kv_plan_stats, rows)                                                                         \
    X(kv_plan_stats, runs)                                                                         \
    X(kv_plan_stats, copies)                                                                       \
    X(kv_plan_stats, window_bytes)                                                                 \
    X(kv_xport_config, struct_size)                                                                \
    X(kv_xport_config, kind)                                                                       \
    X(kv_xport_config, listen_host)                                                                \
    X(kv_xport_config, listen_port)                                                                \
    X(kv_xport_config, token)                                                                      \
    X(kv_xport_config, fingerprint)                                                                \
    X(kv_xport_config, conns_per_peer)                                                             \
    X(kv_xport_config, timeout_ms)                                                                 \
    X(kv_xport_config, max_pending_notes)                                                          \
    X(kv_xport_config, max_pending_reads)                                                          \
    X(kv_xport_config, max_handshakes)                                                             \
    X(kv_xport_config, frames_per_round)                                                           \
    X(kv_xport_config, rdma_busy_poll)                                                             \
    X(kv_xport_config, rdma_device)                                                                \
    X(kv_xport_config, rdma_port)                                                                  \
    X(kv_xport_config, rdma_gid_index)                                                             \
    X(kv_xport_config, plan_gather_below_bytes)                                                    \
    X(kv_xport_config, rdma_devices)                                                               \
    X(kv_xport_config, n_rdma_devices)                                                             \
    X(kv_xport_io, local)                                                                          \
    X(kv_xport_io, local_off)                                                                      \
    X(kv_xport_io, remote)                                                                         \
    X(kv_xport_io, remote_off)                                                                     \
    X(kv_xport_io, bytes)                                                                          \
    X(kv_xport_notify, tag)                                                                        \
    X(kv_xport_notify, msg)                                                                        \
    X(kv_xport_notify, len)                                                                        \
    X(kv_xport_msg, peer_id)                                                                       \
    X(kv_xport_msg, tag)                                                                           \
    X(kv_xport_msg, len)                                                                           \
    X(kv_xport_msg, data)                                                                          \
    X(kv_xport_stats, struct_size)                                                                 \
    X(kv_xport_stats, peers_refused)                                                               \
    X(kv_xport_stats, handshakes_over_limit)                                                       \
    X(kv_xport_stats, notes_refused)                                                               \
    X(kv_xport_stats, reads_refused)                                                               \
    X(kv_xport_stats, frames_stalled)                                                              \
    X(kv_xport_stats, sends_stalled)                                                               \
    X(kv_xport_stats, accept_backoffs)                                                             \
    X(kv_xport_stats, accept_last_errno)                                                           \
    X(kv_xport_stats, plans_gathered)                                                              \
    X(kv_xport_stats, plans_direct)                                                                \
    X(kv_xport_stats, plan_segments)                                                               \
    X(kv_xport_stats, plan_entries)                                                                \
    X(kv_xport_rail_info, device)                                                                  \
    X(kv_xport_rail_info, port)                                                                    \
    X(kv_xport_rail_info, link)                                                                    \
    X(kv_xport_rail_info, lid)                                                                     \
    X(kv_xport_rail_info, gid_index)                                                               \
    X(kv_xport_rail_info, gid_type)                                                                \
    X(kv_xport_rail_info, gid)                                                                     \
    X(kv_xport_rail_info, active_mtu)                                                              \
    X(kv_xport_rail_info, numa_node)                                                               \
    X(kv_xport_rail_info, regions)                                                                 \
    X(kv_xport_rail_info, pci_bus_id)                                                              \
    X(kv_xport_rail_info, qps)                                                                     \
    X(kv_xport_rail_info, path_mtu)                                                                \
    X(kv_xport_rail_info, grh)                                                                     \
    X(kv_xport_rail_info, hop_limit)                                                               \
    X(kv_xport_rail_info, remote_lid)                                                              \
    X(kv_xport_rail_info, remote_gid)                                                              \
    X(kv_xport_info, struct_size)                                                                  \
    X(kv_xport_info, kind)                                                                         \
    X(kv_xport_info, rdma_device)                                                                  \
    X(kv_xport_info, rdma_port)                                                                    \
    X(kv_xport_info, rdma_link)                                                                    \
    X(kv_xport_info, rdma_lid)                                                                     \
    X(kv_xport_info, rdma_gid_index)                                                               \
    X(kv_xport_info, rdma_gid_type)                                                                \
    X(kv_xport_info, rdma_gid)                                                                     \
    X(kv_xport_info, rdma_active_mtu)                                                              \
    X(kv_xport_info, rdma_qps)                                                                     \
    X(kv_xport_info, rdma_path_mtu)                                                                \
    X(kv_xport_info, rdma_grh)                                                                     \
    X(kv_xport_info, rdma_hop_limit)                                                               \
    X(kv_xport_info, rdma_remote_lid)                                                              \
    X(kv_xport_info, rdma_remote_gid)                                                              \
    X(kv_xport_info, rdma_rails)                                                                   \
    X(kv_xport_info, rdma_peer_rails)                                                              \
    X(kv_xport_info, rdma_rail)                                                                    \
    X(kv_xport_info, path)                                                                         \
    X(kv_xport_info, path_why)                                                                     \
    X(kv_xlayer_rx_config, struct_size)                                                            \
    X(kv_xlayer_rx_config, max_requests)                                                           \
    X(kv_xlayer_rx_config, max_layers)                                                             \
    X(kv_xlayer_tx_config, struct_size)                                                            \
    X(kv_xlayer_tx_config, max_requests)                                                           \
    X(kv_xlayer_tx_config, max_layers)                                                             \
    X(kv_xlayer_done, request)                                                                     \
    X(kv_xlayer_done, status)                                                                      \
    X(kv_xlayer_rx_stats, struct_size)                                                             \
    X(kv_xlayer_rx_stats, notes_layers)                                                            \
    X(kv_xlayer_rx_stats, notes_abort)                                                             \
    X(kv_xlayer_rx_stats, notes_late)                                                              \
    X(kv_xlayer_rx_stats, notes_refused)                                                           \
    X(kv_xlayer_rx_stats, tracked)                                                                 \
    X(kv_xlayer_rx_stats, waiting)

#define KV__ABI_XPORT_STRUCTS(X)                                                                   \
    X(kv_plan_stats)                                                                               \
    X(kv_xport_config)                                                                             \
    X(kv_xport_io)                                                                                 \
    X(kv_xport_notify)                                                                             \
    X(kv_xport_msg)                                                                                \
    X(kv_xport_stats)                                                                              \
    X(kv_xport_rail_info)                                                                          \
    X(kv_xport_info)                                                                               \
    X(kv_xlayer_rx_config)                                                                         \
    X(kv_xlayer_tx_config)                                                                         \
    X(kv_xlayer_done)                                                                              \
    X(kv_xlayer_rx_stats)

/* The device-index CUDA entries' structs (kv_attn.h, "CUDA kernels with
 * device-resident indices"): the Python package's GPU path
 * (python/kvcache/cuda.py). */
#define KV__ABI_CUDA_FIELDS(X)                                                                     \
    X(kv_attn_dev_pages, n_seqs)                                                                   \
    X(kv_attn_dev_pages, page_ratio)                                                               \
    X(kv_attn_dev_pages, indptr)                                                                   \
    X(kv_attn_dev_pages, indices)                                                                  \
    X(kv_attn_dev_pages, n_pages)                                                                  \
    X(kv_attn_dev_pages, last_page_len)                                                            \
    X(kv_attn_dev_pages, format)                                                                   \
    X(kv_attn_dev_pages, block_table)                                                              \
    X(kv_attn_dev_pages, block_table_cols)                                                         \
    X(kv_attn_dev_pages, seq_lens)                                                                 \
    X(kv_attn_dev_scales, k)                                                                       \
    X(kv_attn_dev_scales, v)                                                                       \
    X(kv_attn_dev_scales, n)                                                                       \
    X(kv_attn_dev_scales, layers)                                                                  \
    X(kv_attn_dev_scales, device)                                                                  \
    X(kv_attn_cuda_error_info, count)                                                              \
    X(kv_attn_cuda_error_info, array)                                                              \
    X(kv_attn_cuda_error_info, index)                                                              \
    X(kv_attn_cuda_error_info, value)

#define KV__ABI_CUDA_STRUCTS(X)                                                                    \
    X(kv_attn_dev_pages)                                                                           \
    X(kv_attn_dev_scales)                                                                          \
    X(kv_attn_cuda_error_info)

static const struct {
    const char *name;
    size_t size, align;
} kv__abi_structs[] = {
#define KV__ABI_S(s) {#s, sizeof(struct s), _Alignof(struct s)},
    KV__ABI_STRUCTS(KV__ABI_S) KV__ABI_XPORT_STRUCTS(KV__ABI_S) KV__ABI_CUDA_STRUCTS(KV__ABI_S)
#undef KV__ABI_S
};

static const struct {
    const char *strct, *field;
    size_t offset, size;
} kv__abi_fields[] = {
#define KV__ABI_F(s, f) {#s, #f, offsetof(struct s, f), sizeof(((struct s *)0)->f)},
    KV__ABI_FIELDS(KV__ABI_F) KV__ABI_XPORT_FIELDS(KV__ABI_F) KV__ABI_CUDA_FIELDS(KV__ABI_F)
#undef KV__ABI_F
};

kv_status kv_abi_struct(const char *name, size_t *size, size_t *align)
{
    if (!name || !size || !align)
        return kv__error(KV_ERR_NULL, "kv_abi_struct: %s is NULL",
                         !name   ? "name"
                         : !size ? "size"
                                 : "align");
    for (size_t i = 0; i < sizeof(kv__abi_structs) / sizeof(kv__abi_structs[0]); i++)
        if (strcmp(kv__abi_structs[i].name, name) == 0) {
            *size = kv__abi_structs[i].size;
            *align = kv__abi_structs[i].align;
            return kv__ok();
        }
    return kv__error(KV_ERR_NOT_FOUND, "kv_abi_struct: no struct \"%s\" in the table", name);
}

kv_status kv_abi_field(const char *name, const char *field, size_t *offset, size_t *size)
{
    if (!name || !field || !offset || !size)
        return kv__error(KV_ERR_NULL, "kv_abi_field: %s is NULL",
                         !name     ? "name"
                         : !field  ? "field"
                         : !offset ? "offset"
                                   : "size");
    for (size_t i = 0; i < sizeof(kv__abi_fields) / sizeof(kv__abi_fields[0]); i++)
        if (strcmp(kv__abi_fields[i].strct, name) == 0 &&
            strcmp(kv__abi_fields[i].field, field) == 0) {
            *offset = kv__abi_fields[i].offset;
            *size = kv__abi_fields[i].size;
            return kv__ok();
        }
    return kv__error(KV_ERR_NOT_FOUND,
                     "kv_abi_field: no field \"%s\" of struct \"%s\" in the table", field, name);
}
