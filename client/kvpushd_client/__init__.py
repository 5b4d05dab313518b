"""Engine-side client of kvpushd: attach KV memory once, then expect/publish block ids per request on
the worker's stream."""

from .aio import AsyncKVPushClient, AsyncWorker
from .client import KVPushClient
from .reconnect import ReconnectingStreamWorker
from .shm import SharedBuffer
from .stream import StreamWorker
from .types import (
    Completion,
    CompletionKind,
    CudaMemory,
    DaemonUnavailable,
    KVLayout,
    KVPushError,
    Region,
    Role,
    ShmMemory,
    TransferFigures,
)

__all__ = [
    "AsyncKVPushClient", "AsyncWorker", "Completion", "CompletionKind", "CudaMemory", "DaemonUnavailable",
    "KVLayout", "KVPushClient", "KVPushError", "ReconnectingStreamWorker", "Region", "Role", "SharedBuffer",
    "ShmMemory", "StreamWorker", "TransferFigures",
]
