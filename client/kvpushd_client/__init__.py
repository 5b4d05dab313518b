"""Engine-side client of kvpushd: attach KV memory once, then expect/publish block ids per request on
the worker's stream.

The classes that talk gRPC are imported on first use, so ``kvpushd_client.types`` and ``.errors``
(records, enums and error kinds the daemon's core shares) load without grpc."""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import KVPushClient
    from .reconnect import ReconnectingStreamWorker
    from .shm import SealedBuffer
    from .stream import StreamWorker
from .types import (
    Completion,
    CompletionKind,
    CudaMemory,
    DaemonUnavailable,
    KVLayout,
    KVPushError,
    MemfdMemory,
    Region,
    Role,
    ShmMemory,
    TransferFigures,
)

__all__ = [
    "Completion", "CompletionKind", "CudaMemory", "DaemonUnavailable", "KVLayout", "KVPushClient", "KVPushError",
    "MemfdMemory", "ReconnectingStreamWorker", "Region", "Role", "SealedBuffer", "ShmMemory", "StreamWorker",
    "TransferFigures",
]

_LAZY = {"KVPushClient": "client", "ReconnectingStreamWorker": "reconnect", "SealedBuffer": "shm",
         "StreamWorker": "stream"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
