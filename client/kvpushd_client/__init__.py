"""Engine-side client of kvpushd: attach KV memory once, then expect/publish block ids per request."""

from .aio import AsyncKVPushClient, AsyncWorker
from .client import KVPushClient, Worker
from .reconnect import ReconnectingStreamWorker, ReconnectingWorker
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
    "KVLayout", "KVPushClient", "KVPushError", "ReconnectingStreamWorker", "ReconnectingWorker", "Region", "Role",
    "SharedBuffer", "ShmMemory", "StreamWorker", "TransferFigures", "Worker",
]
