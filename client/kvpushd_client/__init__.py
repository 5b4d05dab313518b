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
    Abort,
    Attach,
    Command,
    Completion,
    CompletionKind,
    CudaMemory,
    DaemonUnavailable,
    Decline,
    Expect,
    KVLayout,
    KVPushError,
    MemfdMemory,
    Publish,
    Region,
    Role,
    TransferFigures,
    TransferMode,
)

__all__ = [
    "Abort", "Attach", "Command", "Completion", "CompletionKind", "CudaMemory", "DaemonUnavailable", "Decline",
    "Expect", "KVLayout", "KVPushClient", "KVPushError", "MemfdMemory", "Publish", "ReconnectingStreamWorker",
    "Region", "Role", "SealedBuffer", "StreamWorker", "TransferFigures",
    "TransferMode",
]

_LAZY = {"KVPushClient": "client", "ReconnectingStreamWorker": "reconnect", "SealedBuffer": "shm",
         "StreamWorker": "stream"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
