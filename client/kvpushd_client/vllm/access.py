"""How the daemon reaches this engine's KV, as vLLM 0.34's ``KVCacheAccess`` (a pure decision; no vLLM).

vLLM 0.34 makes its **extensible KV cache** the default on CUDA: CUDA virtual memory (``cuMemCreate``
chunks mapped into one reserved range) that CUDA IPC cannot share. A connector declares what it needs
(``kv_cache_access``), and vLLM allocates to fit or turns the cache off (``vllm/config/vllm.py``,
``_resolve_extensible_kv_cache``):

* ``EXPORTS_FD``: vLLM creates the chunks with the POSIX-fd handle type; the worker exports each chunk as
  a file descriptor and the daemon imports and maps them (``kvpushd_client.vmm``). Where the extensible
  cache cannot be on, vLLM raises ValueError at start, so it is declared only where it can.
* ``LEGACY_IPC``: vLLM turns the extensible cache off; the KV is an ordinary allocation, shared by CUDA
  IPC as on vLLM 0.33. Chosen with ``kvpushd_kv_cache_access: "legacy_ipc"``, and on CUDA wherever the
  extensible cache could not be on anyway (it is off then; saying so costs nothing and is true).
* ``IN_PROCESS`` (vLLM's default): the KV is not on CUDA (host KV goes to the daemon by memfd); nothing
  to declare.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

SETTING_KEY = "kvpushd_kv_cache_access"
SETTINGS = ("auto", "legacy_ipc")


class Choice(enum.Enum):
    IN_PROCESS = "in_process"
    EXPORTS_FD = "exports_fd"
    LEGACY_IPC = "legacy_ipc"


@dataclass(frozen=True)
class AccessFacts:
    """What the decision reads: the setting, the platform, and what keeps vLLM's extensible cache off."""

    setting: object = None              # kv_connector_extra_config["kvpushd_kv_cache_access"]
    platform_is_cuda: bool = False
    platform_is_rocm: bool = False
    kv_buffer_device: str = "cuda"
    extensible_blockers: tuple[str, ...] = ()  # settings under which vLLM 0.34 cannot have the cache on


def parse_setting(value: object) -> str:
    """``auto`` (None too) or ``legacy_ipc``; anything else is refused, naming the key."""
    s = "auto" if value is None else str(value).strip().lower()
    if s not in SETTINGS:
        raise ValueError(f"kv_connector_extra_config.{SETTING_KEY} must be one of {', '.join(SETTINGS)}, "
                         f"got {value!r}")
    return s


def decide_access(f: AccessFacts) -> Choice:
    """The flag for ``kv_cache_access``; see the module docstring."""
    setting = parse_setting(f.setting)
    if not (f.platform_is_cuda or f.platform_is_rocm) or f.kv_buffer_device != "cuda":
        return Choice.IN_PROCESS  # host KV (CPU): vLLM has no extensible cache there, and must not raise
    if setting == "legacy_ipc" or f.platform_is_rocm or f.extensible_blockers:
        # ROCm: vLLM refuses exported driver-mapped memory there; the daemon opens ROCm KV by IPC
        return Choice.LEGACY_IPC
    return Choice.EXPORTS_FD
