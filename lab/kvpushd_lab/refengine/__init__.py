"""A tiny deterministic reference engine: real KV caches, paged in vLLM's layout, moved by kvpushd.

``config``: ``TinyConfig``, the model's shape. ``model``: ``TinyModel`` (seeded weights, float32, CPU).
``kv``: ``PagedKV`` (per layer K and V blocks over shared memory, described as kvpushd regions) and
the block gather, scatter and copy over a TP group's caches. ``engine``: a vLLM-like scheduler/engine loop with
``KVHooks`` where a KV connector acts. ``kvpushd_hooks``: those hooks over ``kvpushd_client``.
``fake``: the same hooks in process (a memory copy for the transfer), for tests without daemons.
"""

from .config import TinyConfig, kv_slice
from .engine import BlockAllocator, Engine, EngineRole, KVEvents, KVHooks, Request, RequestOutput, Status
from .fake import LocalKVNetwork
from .kv import PagedKV, as_caches, copy_blocks
from .kvpushd_hooks import KVPushdHooks
from .model import TinyModel, random_prompt

__all__ = [
    "BlockAllocator", "Engine", "EngineRole", "KVEvents", "KVHooks", "KVPushdHooks", "LocalKVNetwork", "PagedKV",
    "Request", "RequestOutput", "Status", "TinyConfig", "TinyModel", "as_caches", "copy_blocks", "kv_slice",
    "random_prompt",
]
