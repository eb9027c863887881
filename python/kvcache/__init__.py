"""kvcache: a paged KV cache for LLM serving engines, from Python.

    import kvcache, torch
    lay = kvcache.Layout(num_layers=2, num_blocks=64, block_tokens=16,
                         num_heads=4, head_dim=64, dtype="bf16")
    with kvcache.Cache(lay, max_seqs=8) as c:
        s = c.seq_create()
        c.append(s, range(40))
        block_table, slot_mapping = c.export_vllm([s])
        k0 = torch.from_dlpack(c.kv(0, 0))      # layer 0's K, zero-copy

An engine's own memory and page tables: kvcache.PagedCache(layout, tensor)
and kvcache.Pages.from_block_table / from_csr (python/README.md). Moving
blocks to another process: kvcache.Transport, Plan, LayerTx / LayerRx
(kvcache.transport). On the GPU: a PagedCache over CUDA memory runs the
CUDA kernels with device-resident indices on the caller's stream, its
invalid indices in a kvcache.DeviceErrors record (kvcache.cuda).

Over libkvcache.so through ctypes (see python/README.md for why). Every
failed call raises a KvError subclass with the C library's message.
"""
from . import _lib
from .cache import Cache, Layout, Pages, View
from .paged import PagedCache
from .cuda import DeviceErrors, ErrorInfo
from .transport import Transport, Peer, Mem, RemoteMem, Transfer, Plan, LayerTx, LayerRx, Note
from .errors import (KvError, InvalidArgument, NullArgument, BadDim, BadShape, OutOfBounds,
                     NeedsCopy, Overlap, Overflow, NoMemory, NoBlocks, NotFound, BadState,
                     Unsupported, TooCostly, Mismatch, IoError, Timeout, Cancelled, Corrupt,
                     Internal, Capacity, DeviceError)

__version__ = _lib.lib.kv_version().decode()


def threads() -> int:
    """Threads the CPU kernels use (OpenMP; process-wide)."""
    return _lib.lib.kv_threads()


def set_threads(n: int) -> None:
    """Threads for the CPU kernels: n >= 1, or 0 for every core this process
    may run on, capped by its cgroup CPU quota (the default)."""
    from ._ints import INT, integer
    from .errors import check
    check(_lib.lib.kv_set_threads(integer(n, "n", INT)))


def cuda_available() -> bool:
    """Whether the loaded library runs its CUDA kernels here (built with
    CUDA, a usable device): what a PagedCache over CUDA memory needs."""
    from .cuda import available
    return available()


library_path = _lib.path

__all__ = ["Cache", "Layout", "View", "KvError", "InvalidArgument", "NullArgument", "BadDim",
           "BadShape", "OutOfBounds", "NeedsCopy", "Overlap", "Overflow", "NoMemory",
           "NoBlocks", "NotFound", "BadState", "Unsupported", "TooCostly", "Mismatch",
           "IoError", "Timeout", "Cancelled", "Corrupt", "Internal", "Capacity", "DeviceError",
           "library_path", "threads", "set_threads", "Pages", "PagedCache",
           "Transport", "Peer", "Mem", "RemoteMem", "Transfer", "Plan", "LayerTx", "LayerRx",
           "Note", "DeviceErrors", "ErrorInfo", "cuda_available"]
