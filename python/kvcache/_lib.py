"""The C library through ctypes: loading it, its structs, its functions.

ABI mode: nothing is compiled at install time. Every ctypes Structure below
mirrors a public C struct; at import each one's size and every field's
offset and size are compared with what the loaded library reports
(kv_abi_struct / kv_abi_field), so a package and a library built from
different headers fail at import with the struct and field named, instead
of reading the wrong bytes later.
"""
import ctypes
import ctypes.util
import os

c_i64p = ctypes.POINTER(ctypes.c_int64)
c_i32p = ctypes.POINTER(ctypes.c_int32)
c_u32p = ctypes.POINTER(ctypes.c_uint32)
c_u64p = ctypes.POINTER(ctypes.c_uint64)
vp = ctypes.c_void_p

KV_MAX_DIMS = 8


def _candidates():
    env = os.environ.get("KVCACHE_LIBRARY")
    if env:
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    out = [os.path.join(here, "libkvcache.so")]  # bundled by pip install
    root = os.path.dirname(os.path.dirname(here))  # a build tree: python/kvcache -> repo
    out.append(os.path.join(root, "build-libc", "libkvcache.so"))
    found = ctypes.util.find_library("kvcache")
    if found:
        out.append(found)
    return out


def _load():
    errors = []
    for path in _candidates():
        if not os.path.sep in path or os.path.exists(path):
            try:
                return ctypes.CDLL(path), path
            except OSError as e:  # e.g. a jemalloc build: no static TLS left for it
                errors.append("%s: %s" % (path, e))
    raise ImportError(
        "kvcache: no loadable libkvcache.so (set KVCACHE_LIBRARY, or build the package's "
        "flavour with `make MALLOC=libc lib`): " + "; ".join(errors or ["none found"]))


lib, path = _load()


# ---- structs ---------------------------------------------------------------


class LayoutConfig(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_layers", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("block_tokens", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("dtype", ctypes.c_int),
        ("order", ctypes.c_int),
        ("arrange", ctypes.c_int),
        ("kv_packed", ctypes.c_bool),
        ("block_pad_elems", ctypes.c_int64),
        ("block_stride_bytes", ctypes.c_int64),
        ("align_bytes", ctypes.c_int64),
        ("k_only", ctypes.c_bool),
    ]


_LAYOUT_I64 = ["elem_bytes", "align_bytes", "kv_planes", "block_elems", "block_bytes",
               "block_stride_elems", "block_stride_bytes",
               "stride_layer_elems", "stride_kv_elems", "stride_block_elems",
               "stride_token_elems", "stride_head_elems", "stride_dim_elems",
               "stride_layer_bytes", "stride_kv_bytes", "stride_block_bytes",
               "stride_token_bytes", "stride_head_bytes", "stride_dim_bytes",
               "total_elems", "total_bytes"]


class LayoutC(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int64) for n in
                 ("num_layers", "num_blocks", "block_tokens", "num_heads", "head_dim")] +
                [("dtype", ctypes.c_int), ("order", ctypes.c_int), ("arrange", ctypes.c_int),
                 ("kv_packed", ctypes.c_bool)] +
                [(n, ctypes.c_int64) for n in _LAYOUT_I64] +
                [("fingerprint", ctypes.c_uint64), ("block_format_fingerprint", ctypes.c_uint64),
                 ("k_only", ctypes.c_bool)])


class CacheConfig(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("layout", LayoutConfig),
        ("mem_kind", ctypes.c_int),
        ("device", ctypes.c_int),
        ("max_seqs", ctypes.c_uint32),
        ("max_blocks_per_seq", ctypes.c_uint32),
        ("page_ratio", ctypes.c_uint32),
        ("enable_prefix_caching", ctypes.c_bool),
        ("zero_fill", ctypes.c_bool),
        ("on_event", vp),
        ("event_user", vp),
        ("head_offset", ctypes.c_uint32),
    ]


class PoolStats(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_uint32) for n in ("capacity", "free_blocks", "used_blocks",
                                               "cached_blocks", "used_high_water",
                                               "hashed_blocks")] +
                [(n, ctypes.c_uint64) for n in ("hits", "misses", "evictions", "stored")])


class TableStats(ctypes.Structure):
    _fields_ = [
        ("live_seqs", ctypes.c_uint32),
        ("held_blocks", ctypes.c_uint64),
        ("cow_copies", ctypes.c_uint64),
        ("copies_held", ctypes.c_uint32),
        ("reused_blocks", ctypes.c_uint64),
        ("committed", ctypes.c_uint64),
        ("commit_failures", ctypes.c_uint64),
    ]


class TokenRange(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("count", ctypes.c_uint64)]


class VllmExportSizes(ctypes.Structure):
    _fields_ = [
        ("block_table_cols", ctypes.c_uint32),
        ("block_table_len", ctypes.c_uint64),
        ("slot_mapping_len", ctypes.c_uint64),
        ("seq_lens_len", ctypes.c_uint64),
    ]


class VllmExport(ctypes.Structure):
    _fields_ = [
        ("block_table", c_i32p),
        ("block_table_len", ctypes.c_uint64),
        ("block_table_cols", ctypes.c_uint32),
        ("block_table_pad", ctypes.c_int32),
        ("slot_mapping", c_i64p),
        ("slot_mapping_len", ctypes.c_uint64),
        ("tokens_per_seq", ctypes.c_uint32),
        ("seq_lens", c_i64p),
        ("seq_lens_len", ctypes.c_uint64),
        ("sizes", ctypes.POINTER(VllmExportSizes)),
    ]


class FlashinferExport(ctypes.Structure):
    _fields_ = [
        ("indptr", c_i32p),
        ("indptr_len", ctypes.c_uint64),
        ("indices", c_i32p),
        ("indices_len", ctypes.c_uint64),
        ("last_page_len", c_i32p),
        ("last_page_len_len", ctypes.c_uint64),
    ]


class BlockCopy(ctypes.Structure):
    _fields_ = [("src", ctypes.c_uint32), ("dst", ctypes.c_uint32), ("tokens", ctypes.c_uint32)]


class ViewC(ctypes.Structure):
    _fields_ = [
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("shape", ctypes.c_int64 * KV_MAX_DIMS),
        ("strides", ctypes.c_int64 * KV_MAX_DIMS),
        ("offset", ctypes.c_int64),
        ("base", vp),
        ("storage_bytes", ctypes.c_size_t),
    ]


class PagedCache(ctypes.Structure):
    _fields_ = [("layout", LayoutC), ("base", vp), ("storage_bytes", ctypes.c_size_t),
                ("mem", ctypes.c_int)]


class Scales(ctypes.Structure):
    _fields_ = [("k", ctypes.POINTER(ctypes.c_float)), ("v", ctypes.POINTER(ctypes.c_float)),
                ("n", ctypes.c_uint32), ("layers", ctypes.c_uint32)]


class Pages(ctypes.Structure):
    _fields_ = [
        ("format", ctypes.c_int),
        ("n_seqs", ctypes.c_uint32),
        ("page_ratio", ctypes.c_uint32),
        ("indptr", c_i32p),
        ("indices", c_i32p),
        ("last_page_len", c_i32p),
        ("block_table", c_i32p),
        ("block_table_cols", ctypes.c_uint32),
        ("seq_lens", c_i64p),
    ]


class PlanConfig(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("src_head0", ctypes.c_int64),
                ("dst_head0", ctypes.c_int64), ("n_heads", ctypes.c_int64),
                ("src_layer0", ctypes.c_int64), ("dst_layer0", ctypes.c_int64),
                ("n_layers", ctypes.c_int64)]


class CopyBlocksOpts(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("layer0", ctypes.c_uint32),
                ("n_layers", ctypes.c_uint32), ("planes", ctypes.c_uint32)]


class AttnOpts(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("window_left", ctypes.c_int32),
                ("logit_soft_cap", ctypes.c_float), ("lse", ctypes.POINTER(ctypes.c_float)),
                ("lse_stride", ctypes.c_int64)]


# DLPack 0.6 (dlpack/dlpack.h)
class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", vp),
        ("device", DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", DLDataType),
        ("shape", c_i64p),
        ("strides", c_i64p),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", vp),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))),
]

_ABI = {
    "kv_layout_config": LayoutConfig,
    "kv_layout": LayoutC,
    "kv_cache_config": CacheConfig,
    "kv_block_pool_stats": PoolStats,
    "kv_page_table_stats": TableStats,
    "kv_token_range": TokenRange,
    "kv_vllm_export": VllmExport,
    "kv_vllm_export_sizes": VllmExportSizes,
    "kv_flashinfer_export": FlashinferExport,
    "kv_block_copy": BlockCopy,
    "kv_view": ViewC,
    "kv_paged_cache": PagedCache,
    "kv_scales": Scales,
    "kv_pages": Pages,
    "kv_plan_config": PlanConfig,
    "kv_copy_blocks_opts": CopyBlocksOpts,
    "kv_attn_opts": AttnOpts,
}

# ---- functions -------------------------------------------------------------

_ST = ctypes.c_int  # kv_status
_PROTOS = {
    "kv_version": (ctypes.c_char_p, []),
    "kv_status_name": (ctypes.c_char_p, [_ST]),
    "kv_last_error": (ctypes.c_char_p, []),
    "kv_abi_struct": (_ST, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t),
                            ctypes.POINTER(ctypes.c_size_t)]),
    "kv_abi_field": (_ST, [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t),
                           ctypes.POINTER(ctypes.c_size_t)]),
    "kv_dtype_parse": (_ST, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]),
    "kv_dtype_name": (ctypes.c_char_p, [ctypes.c_int]),
    "kv_dtype_size": (ctypes.c_size_t, [ctypes.c_int]),
    "kv_layout_init": (_ST, [ctypes.POINTER(LayoutConfig), ctypes.POINTER(LayoutC)]),
    "kv_cache_create": (_ST, [ctypes.POINTER(CacheConfig), ctypes.POINTER(vp)]),
    "kv_cache_destroy": (None, [vp]),
    "kv_cache_retain": (vp, [vp]),
    "kv_cache_layout": (ctypes.POINTER(LayoutC), [vp]),
    "kv_cache_pool": (vp, [vp]),
    "kv_cache_page_table": (vp, [vp]),
    "kv_cache_kv_view": (_ST, [vp, ctypes.c_uint32, ctypes.c_int, ctypes.POINTER(ViewC)]),
    "kv_cache_to_dlpack": (_ST, [vp, ctypes.POINTER(ViewC),
                                 ctypes.POINTER(ctypes.POINTER(DLManagedTensor))]),
    "kv_view_from_dlpack": (_ST, [ctypes.POINTER(DLManagedTensor), ctypes.POINTER(ViewC),
                                  ctypes.POINTER(DLDevice)]),
    "kv_view_select": (_ST, [ctypes.POINTER(ViewC), ctypes.c_int, ctypes.c_int64,
                             ctypes.POINTER(ViewC)]),
    "kv_view_narrow": (_ST, [ctypes.POINTER(ViewC), ctypes.c_int, ctypes.c_int64,
                             ctypes.c_int64, ctypes.POINTER(ViewC)]),
    "kv_dlpack_capsule_api": (None, [vp, vp]),
    "kv_dlpack_capsule_destructor": (None, [vp]),
    "kv_cache_paged": (_ST, [vp, ctypes.POINTER(PagedCache)]),
    "kv_paged_check": (_ST, [ctypes.POINTER(PagedCache), ctypes.c_bool]),
    "kv_attn_write": (_ST, [PagedCache, ctypes.c_int32, ctypes.POINTER(ViewC),
                            ctypes.POINTER(ViewC), c_i64p, ctypes.c_int64,
                            ctypes.POINTER(Scales)]),
    "kv_attn_read": (_ST, [PagedCache, ctypes.c_int32, ctypes.POINTER(Pages),
                           ctypes.POINTER(ViewC), ctypes.POINTER(ViewC), ctypes.POINTER(Scales)]),
    "kv_attn_write_i32": (_ST, [PagedCache, ctypes.c_int32, ctypes.POINTER(ViewC),
                                ctypes.POINTER(ViewC), c_i32p, ctypes.c_int64,
                                ctypes.POINTER(Scales)]),
    "kv_attn_copy_blocks": (_ST, [PagedCache, ctypes.POINTER(BlockCopy), ctypes.c_uint32]),
    "kv_attn_copy_blocks_ex": (_ST, [PagedCache, PagedCache, ctypes.POINTER(BlockCopy),
                                     ctypes.c_uint32, ctypes.POINTER(CopyBlocksOpts)]),
    "kv_attn_decode": (_ST, [PagedCache, ctypes.c_uint32, ctypes.POINTER(ViewC),
                             ctypes.POINTER(Pages), ctypes.c_float, ctypes.POINTER(Scales),
                             ctypes.POINTER(ViewC)]),
    "kv_attn_decode_mla": (_ST, [PagedCache, ctypes.c_uint32, ctypes.POINTER(ViewC),
                                 ctypes.POINTER(Pages), ctypes.c_int64, ctypes.c_float,
                                 ctypes.POINTER(Scales), ctypes.POINTER(ViewC)]),
    "kv_attn_decode_ex": (_ST, [PagedCache, ctypes.c_uint32, ctypes.POINTER(ViewC),
                                ctypes.POINTER(Pages), ctypes.c_float, ctypes.POINTER(Scales),
                                ctypes.POINTER(ViewC), ctypes.POINTER(AttnOpts)]),
    "kv_attn_prefill": (_ST, [PagedCache, ctypes.c_uint32, ctypes.POINTER(ViewC), c_i32p,
                              ctypes.POINTER(Pages), ctypes.c_float, ctypes.POINTER(Scales),
                              ctypes.POINTER(ViewC), ctypes.POINTER(AttnOpts)]),
    "kv_attn_prefill_mla": (_ST, [PagedCache, ctypes.c_uint32, ctypes.POINTER(ViewC), c_i32p,
                                  ctypes.POINTER(Pages), ctypes.c_int64, ctypes.c_float,
                                  ctypes.POINTER(Scales), ctypes.POINTER(ViewC),
                                  ctypes.POINTER(AttnOpts)]),
    "kv_pack_size": (_ST, [ctypes.POINTER(LayoutC), ctypes.POINTER(PlanConfig),
                           ctypes.c_uint64, c_u64p]),
    "kv_pack": (_ST, [vp, PagedCache, c_u32p, ctypes.c_uint32, ctypes.c_uint64, vp,
                      ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                      ctypes.POINTER(PlanConfig)]),
    "kv_unpack": (_ST, [vp, vp, ctypes.c_size_t, PagedCache, c_u32p, ctypes.c_uint32,
                        ctypes.POINTER(PlanConfig)]),
    "kv_set_threads": (_ST, [ctypes.c_int]),
    "kv_threads": (ctypes.c_int, []),
    "kv_block_pool_stats_get": (None, [vp, ctypes.POINTER(PoolStats)]),
    "kv_block_pool_ref_count": (ctypes.c_uint32, [vp, ctypes.c_uint32]),
    "kv_page_table_seq_create": (_ST, [vp, c_u32p]),
    "kv_page_table_seq_set_extra_key": (_ST, [vp, ctypes.c_uint32, ctypes.c_uint64]),
    "kv_page_table_seq_reuse_prefix": (_ST, [vp, ctypes.c_uint32, c_i32p, ctypes.c_uint64,
                                             c_u64p]),
    "kv_page_table_seq_append": (_ST, [vp, ctypes.c_uint32, c_i32p, ctypes.c_uint64]),
    "kv_page_table_blocks_needed": (_ST, [vp, ctypes.c_uint32, ctypes.c_uint64, c_u32p]),
    "kv_page_table_seq_fork": (_ST, [vp, ctypes.c_uint32, c_u32p]),
    "kv_page_table_seq_truncate": (_ST, [vp, ctypes.c_uint32, ctypes.c_uint64]),
    "kv_page_table_seq_free": (_ST, [vp, ctypes.c_uint32]),
    "kv_page_table_seq_len": (_ST, [vp, ctypes.c_uint32, c_u64p]),
    "kv_page_table_seq_blocks": (_ST, [vp, ctypes.c_uint32, ctypes.POINTER(c_u32p), c_u32p]),
    "kv_page_table_slot": (_ST, [vp, ctypes.c_uint32, ctypes.c_uint64, c_i64p]),
    "kv_page_table_pending_copies": (ctypes.c_uint32, [vp]),
    "kv_page_table_take_copies": (_ST, [vp, ctypes.POINTER(BlockCopy), ctypes.c_uint32,
                                        c_u32p]),
    "kv_page_table_copies_done": (_ST, [vp]),
    "kv_page_table_stats_get": (None, [vp, ctypes.POINTER(TableStats)]),
    "kv_page_table_export_vllm": (_ST, [vp, c_u32p, ctypes.c_uint32, ctypes.POINTER(TokenRange),
                                        ctypes.POINTER(VllmExport)]),
    "kv_page_table_export_flashinfer": (_ST, [vp, c_u32p, ctypes.c_uint32,
                                              ctypes.POINTER(FlashinferExport), c_u64p]),
}

# ---- the transport (connector/transport/kv_transport.h, kv_xport_layers.h) --
# Declared in their own block, checked by the same _check_abi as the others
# (binding/kv_abi.c: KV__ABI_XPORT_STRUCTS); used by transport.py.

KV_XPORT_BLOB_MAX = 256
KV_XPORT_NOTIFY_MAX = 4096
KV_XLAYER_TAG = 0x574C564B


class PlanStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("window_tokens", "window_src_blocks",
                                             "window_dst_blocks", "rows", "runs", "copies",
                                             "window_bytes")]


class XportConfig(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("kind", ctypes.c_int),
        ("listen_host", ctypes.c_char_p),
        ("listen_port", ctypes.c_uint16),
        ("token", ctypes.c_uint64),
        ("fingerprint", ctypes.c_uint64),
        ("conns_per_peer", ctypes.c_uint32),
        ("timeout_ms", ctypes.c_uint32),
        ("max_pending_notes", ctypes.c_uint32),
        ("max_pending_reads", ctypes.c_uint32),
        ("max_handshakes", ctypes.c_uint32),
        ("frames_per_round", ctypes.c_uint32),
        ("rdma_busy_poll", ctypes.c_bool),
        ("rdma_device", ctypes.c_char_p),
        ("rdma_port", ctypes.c_uint32),
        ("rdma_gid_index", ctypes.c_int32),
        ("plan_gather_below_bytes", ctypes.c_uint32),
        ("rdma_devices", ctypes.POINTER(ctypes.c_char_p)),  # rails; None: one rail
        ("n_rdma_devices", ctypes.c_uint32),
    ]


class XportIo(ctypes.Structure):
    _fields_ = [("local", vp), ("local_off", ctypes.c_uint64), ("remote", vp),
                ("remote_off", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


class XportNotify(ctypes.Structure):
    _fields_ = [("tag", ctypes.c_uint64), ("msg", vp), ("len", ctypes.c_uint32)]


class XportMsg(ctypes.Structure):
    _fields_ = [("peer_id", ctypes.c_uint64), ("tag", ctypes.c_uint64), ("len", ctypes.c_uint32),
                ("data", ctypes.c_ubyte * KV_XPORT_NOTIFY_MAX)]


class XportStats(ctypes.Structure):
    _fields_ = ([("struct_size", ctypes.c_size_t)] +
                [(n, ctypes.c_uint64) for n in ("peers_refused", "handshakes_over_limit",
                                                "notes_refused", "reads_refused",
                                                "frames_stalled", "sends_stalled",
                                                "accept_backoffs")] +
                [("accept_last_errno", ctypes.c_int)] +
                [(n, ctypes.c_uint64) for n in ("plans_gathered", "plans_direct",
                                                "plan_segments", "plan_entries")])


_U32, _I32, _ENUM = ctypes.c_uint32, ctypes.c_int32, ctypes.c_int


class XportRailInfo(ctypes.Structure):
    _fields_ = [("device", ctypes.c_char * 64), ("port", _U32), ("link", _ENUM), ("lid", _U32),
                ("gid_index", _I32), ("gid_type", _ENUM), ("gid", ctypes.c_uint8 * 16),
                ("active_mtu", _U32), ("numa_node", _I32), ("regions", _U32),
                ("pci_bus_id", ctypes.c_char * 24), ("qps", _U32),
                ("path_mtu", _U32), ("grh", ctypes.c_bool), ("hop_limit", _U32),
                ("remote_lid", _U32), ("remote_gid", ctypes.c_uint8 * 16)]


class XportInfo(ctypes.Structure):  # kv_xport_info: what a transport or a peer uses
    _fields_ = [("struct_size", ctypes.c_size_t), ("kind", _ENUM),
                ("rdma_device", ctypes.c_char * 64), ("rdma_port", _U32), ("rdma_link", _ENUM),
                ("rdma_lid", _U32), ("rdma_gid_index", _I32), ("rdma_gid_type", _ENUM),
                ("rdma_gid", ctypes.c_uint8 * 16), ("rdma_active_mtu", _U32), ("rdma_qps", _U32),
                ("rdma_path_mtu", _U32), ("rdma_grh", ctypes.c_bool), ("rdma_hop_limit", _U32),
                ("rdma_remote_lid", _U32), ("rdma_remote_gid", ctypes.c_uint8 * 16),
                ("rdma_rails", _U32), ("rdma_peer_rails", _U32),
                ("rdma_rail", XportRailInfo * 8), ("path", _ENUM),
                ("path_why", ctypes.c_char * 256)]


class XlayerConfig(ctypes.Structure):  # kv_xlayer_rx_config and kv_xlayer_tx_config
    _fields_ = [("struct_size", ctypes.c_size_t), ("max_requests", ctypes.c_uint32),
                ("max_layers", ctypes.c_uint32)]


class XlayerDone(ctypes.Structure):
    _fields_ = [("request", ctypes.c_uint64), ("status", ctypes.c_int)]


class XlayerRxStats(ctypes.Structure):
    _fields_ = ([("struct_size", ctypes.c_size_t)] +
                [(n, ctypes.c_uint64) for n in ("notes_layers", "notes_abort", "notes_late",
                                                "notes_refused")] +
                [("tracked", ctypes.c_uint32), ("waiting", ctypes.c_uint32)])


_ABI.update({
    "kv_plan_stats": PlanStats,
    "kv_xport_config": XportConfig,
    "kv_xport_io": XportIo,
    "kv_xport_notify": XportNotify,
    "kv_xport_msg": XportMsg,
    "kv_xport_stats": XportStats,
    "kv_xport_rail_info": XportRailInfo,
    "kv_xport_info": XportInfo,
    "kv_xlayer_rx_config": XlayerConfig,
    "kv_xlayer_tx_config": XlayerConfig,
    "kv_xlayer_done": XlayerDone,
    "kv_xlayer_rx_stats": XlayerRxStats,
})

_vpp = ctypes.POINTER(vp)
_u16 = ctypes.c_uint16
_PROTOS.update({
    "kv_plan_create": (_ST, [ctypes.POINTER(LayoutC), ctypes.POINTER(LayoutC),
                             ctypes.POINTER(PlanConfig), _vpp]),
    "kv_plan_destroy": (None, [vp]),
    "kv_plan_stats_get": (_ST, [vp, ctypes.POINTER(PlanStats)]),
    "kv_xport_kind_name": (ctypes.c_char_p, [ctypes.c_int]),
    "kv_xport_create": (_ST, [ctypes.POINTER(XportConfig), _vpp]),
    "kv_xport_destroy": (_ST, [vp]),
    "kv_xport_port": (_u16, [vp]),
    "kv_xport_info_get": (_ST, [vp, ctypes.POINTER(XportInfo)]),
    "kv_xport_peer_info_get": (_ST, [vp, ctypes.POINTER(XportInfo)]),
    "kv_xport_info_format": (ctypes.c_int, [ctypes.POINTER(XportInfo), ctypes.c_char_p,
                                            ctypes.c_size_t]),
    "kv_xport_connect": (_ST, [vp, ctypes.c_char_p, _u16, _vpp]),
    "kv_xport_accept": (_ST, [vp, ctypes.c_uint32, _vpp]),
    "kv_xport_peer_state_get": (_ST, [vp, ctypes.POINTER(ctypes.c_int),
                                      ctypes.POINTER(ctypes.c_int)]),
    "kv_xport_peer_wait": (_ST, [vp, ctypes.c_uint32, ctypes.POINTER(ctypes.c_int)]),
    "kv_xport_peer_close": (None, [vp]),
    "kv_xport_peer_id": (ctypes.c_uint64, [vp]),
    "kv_xport_mem_reg": (_ST, [vp, vp, ctypes.c_size_t, ctypes.c_int, _vpp]),
    "kv_xport_mem_dereg": (_ST, [vp]),
    "kv_xport_mem_expose": (_ST, [vp, vp, vp, ctypes.c_size_t,
                                  ctypes.POINTER(ctypes.c_size_t)]),
    "kv_xport_mem_unexpose": (_ST, [vp, vp]),
    "kv_xport_mem_bytes": (ctypes.c_uint64, [vp]),
    "kv_xport_rmem_bytes": (ctypes.c_uint64, [vp]),
    "kv_xport_rmem_import": (_ST, [vp, vp, ctypes.c_size_t, _vpp]),
    "kv_xport_rmem_free": (_ST, [vp]),
    "kv_xport_read": (_ST, [vp, ctypes.POINTER(XportIo), ctypes.c_uint32, _vpp]),
    "kv_xport_write": (_ST, [vp, ctypes.POINTER(XportIo), ctypes.c_uint32,
                             ctypes.POINTER(XportNotify), _vpp]),
    "kv_xport_write_plan": (_ST, [vp, vp, vp, ctypes.c_uint64, c_u32p, ctypes.c_uint32, vp,
                                  ctypes.c_uint64, c_u32p, ctypes.c_uint32, ctypes.c_uint64,
                                  ctypes.POINTER(XportNotify), _vpp]),
    "kv_xport_xfer_test": (_ST, [vp, ctypes.POINTER(ctypes.c_int)]),
    "kv_xport_xfer_wait": (_ST, [vp, ctypes.c_uint32, ctypes.POINTER(ctypes.c_int)]),
    "kv_xport_xfer_cancel": (_ST, [vp]),
    "kv_xport_xfer_results": (_ST, [vp, ctypes.POINTER(ctypes.POINTER(ctypes.c_int)),
                                    c_u32p]),
    "kv_xport_xfer_note_status": (_ST, [vp, ctypes.POINTER(ctypes.c_int)]),
    "kv_xport_xfer_error": (ctypes.c_char_p, [vp]),
    "kv_xport_xfer_free": (_ST, [vp]),
    "kv_xport_notify_poll": (_ST, [vp, ctypes.c_uint32, ctypes.POINTER(XportMsg)]),
    "kv_xport_stats_get": (_ST, [vp, ctypes.POINTER(XportStats)]),
    "kv_xlayer_rx_create": (_ST, [ctypes.POINTER(XlayerConfig), _vpp]),
    "kv_xlayer_rx_destroy": (_ST, [vp]),
    "kv_xlayer_rx_expect": (_ST, [vp, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32]),
    "kv_xlayer_rx_feed": (_ST, [vp, ctypes.POINTER(XportMsg)]),
    "kv_xlayer_rx_wait": (_ST, [vp, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32]),
    "kv_xlayer_rx_fail": (_ST, [vp, ctypes.c_uint64, _ST]),
    "kv_xlayer_rx_release": (_ST, [vp, ctypes.c_uint64]),
    "kv_xlayer_rx_finished": (_ST, [vp, ctypes.POINTER(XlayerDone), ctypes.c_uint32, c_u32p]),
    "kv_xlayer_rx_stats_get": (_ST, [vp, ctypes.POINTER(XlayerRxStats)]),
    "kv_xlayer_tx_create": (_ST, [ctypes.POINTER(XlayerConfig), _vpp]),
    "kv_xlayer_tx_destroy": (_ST, [vp]),
    "kv_xlayer_tx_begin": (_ST, [vp, vp, ctypes.c_uint64, ctypes.c_uint32]),
    "kv_xlayer_tx_post": (_ST, [vp, ctypes.c_uint64, vp, ctypes.c_uint32, ctypes.c_uint32, vp,
                                ctypes.c_uint64, c_u32p, ctypes.c_uint32, vp, ctypes.c_uint64,
                                c_u32p, ctypes.c_uint32, ctypes.c_uint64]),
    "kv_xlayer_tx_cancel": (_ST, [vp, ctypes.c_uint64]),
    "kv_xlayer_tx_wait": (_ST, [vp, ctypes.c_uint64, ctypes.c_uint32]),
    "kv_xlayer_tx_finished": (_ST, [vp, ctypes.POINTER(XlayerDone), ctypes.c_uint32, c_u32p]),
})

# ---- the CUDA kernels with device-resident indices (attention/kv_attn.h) ----
# Their own block, checked by the same _check_abi (binding/kv_abi.c:
# KV__ABI_CUDA_STRUCTS); used by cuda.py. A stream is a cudaStream_t handle
# (an int; 0: the legacy default stream). The error record (struct
# kv_attn_cuda_errors) lives in device memory and is only passed around.

KV_PAGES_CSR, KV_PAGES_BLOCK_TABLE = 1, 2
KV_ATTN_DEV_SCALES_MAX = 128
KV_MEM_DEVICE = 2


class DevPages(ctypes.Structure):
    _fields_ = [
        ("n_seqs", ctypes.c_uint32),
        ("page_ratio", ctypes.c_uint32),
        ("indptr", vp),
        ("indices", vp),
        ("n_pages", ctypes.c_int64),
        ("last_page_len", vp),
        ("format", ctypes.c_int),
        ("block_table", vp),
        ("block_table_cols", ctypes.c_uint32),
        ("seq_lens", vp),
    ]


class DevScales(ctypes.Structure):
    _fields_ = [("k", vp), ("v", vp), ("n", ctypes.c_uint32), ("layers", ctypes.c_uint32),
                ("device", ctypes.c_uint32)]


class CudaErrorInfo(ctypes.Structure):
    _fields_ = [("count", ctypes.c_uint64), ("array", ctypes.c_int), ("index", ctypes.c_int64),
                ("value", ctypes.c_int64)]


_ABI.update({
    "kv_attn_dev_pages": DevPages,
    "kv_attn_dev_scales": DevScales,
    "kv_attn_cuda_error_info": CudaErrorInfo,
})

_PV = ctypes.POINTER(ViewC)
_PROTOS.update({
    "kv_attn_cuda_errors_create": (_ST, [ctypes.POINTER(vp)]),
    "kv_attn_cuda_errors_destroy": (None, [vp]),
    "kv_attn_cuda_errors_reset": (_ST, [vp, vp]),
    "kv_attn_cuda_errors_get": (_ST, [vp, ctypes.POINTER(CudaErrorInfo), vp]),
    "kv_attn_write_cuda_dev": (_ST, [PagedCache, ctypes.c_int32, _PV, _PV, vp, ctypes.c_int64,
                                     ctypes.POINTER(DevScales), vp, vp]),
    "kv_attn_read_cuda_dev": (_ST, [PagedCache, ctypes.c_int32, ctypes.POINTER(DevPages), vp,
                                    _PV, _PV, ctypes.POINTER(DevScales), vp, vp]),
    "kv_attn_decode_cuda_dev": (_ST, [PagedCache, ctypes.c_uint32, _PV, ctypes.POINTER(DevPages),
                                      ctypes.c_float, ctypes.POINTER(DevScales), _PV, vp, vp]),
    "kv_attn_copy_blocks_cuda_dev": (_ST, [PagedCache, vp, ctypes.c_uint32, vp, vp]),
    "kv_attn_copy_blocks_ex_cuda_dev": (_ST, [PagedCache, PagedCache, vp, ctypes.c_uint32,
                                              ctypes.POINTER(CopyBlocksOpts), vp, vp]),
})

for _name, (_res, _args) in _PROTOS.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args


class AbiMismatch(ImportError):
    """The loaded library's structs differ from this package's declarations."""


def _check_abi():
    size, align = ctypes.c_size_t(), ctypes.c_size_t()
    for name, cls in _ABI.items():
        if lib.kv_abi_struct(name.encode(), ctypes.byref(size), ctypes.byref(align)) != 0:
            raise AbiMismatch("kvcache: %s has no struct %s: %s" %
                              (path, name, lib.kv_last_error().decode()))
        if size.value != ctypes.sizeof(cls):
            raise AbiMismatch("kvcache: struct %s is %d bytes in %s, %d in this package" %
                              (name, size.value, path, ctypes.sizeof(cls)))
        for fname, _ in cls._fields_:
            if lib.kv_abi_field(name.encode(), fname.encode(), ctypes.byref(size),
                                ctypes.byref(align)) != 0:
                raise AbiMismatch("kvcache: %s: %s" % (path, lib.kv_last_error().decode()))
            mine = getattr(cls, fname)
            if size.value != mine.offset or align.value != mine.size:
                raise AbiMismatch(
                    "kvcache: field %s.%s at offset %d size %d in %s, offset %d size %d in "
                    "this package" % (name, fname, size.value, align.value, path, mine.offset,
                                      mine.size))


_check_abi()
