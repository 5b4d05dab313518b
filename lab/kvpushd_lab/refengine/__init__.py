"""A tiny deterministic reference engine: real KV caches, paged in vLLM's layout, moved by kvpushd.

``model``: ``TinyModel`` (seeded weights, float32, CPU) and ``PagedKV`` (per layer K and V blocks over
shared memory, described as kvpushd regions). ``engine``: a vLLM-like scheduler/engine loop with
``KVHooks`` where a KV connector acts. ``kvpushd_hooks``: those hooks over ``kvpushd_client``.
``fake``: the same hooks in process (a memory copy for the transfer), for tests without daemons.
"""

from .engine import BlockAllocator, Engine, EngineRole, KVEvents, KVHooks, Request, RequestOutput, Status
from .fake import LocalKVNetwork, copy_blocks
from .kvpushd_hooks import KVPushdHooks
from .model import PagedKV, TinyConfig, TinyModel, as_caches, kv_slice, random_prompt

__all__ = [
    "BlockAllocator", "Engine", "EngineRole", "KVEvents", "KVHooks", "KVPushdHooks", "LocalKVNetwork", "PagedKV",
    "Request", "RequestOutput", "Status", "TinyConfig", "TinyModel", "as_caches", "copy_blocks", "kv_slice",
    "random_prompt",
]
