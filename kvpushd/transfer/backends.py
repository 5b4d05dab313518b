"""Backend policy: which NIXL init parameters pick devices and threads, and what status shows."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

# NIXL init parameters that select network devices, per backend (UCX 1.5.1 reads device_list, HCA
# names to which it appends ":1"; newer NIXL reads ucx_devices too). LIBFABRIC picks its rails itself.
DEVICE_KEYS: dict[str, tuple[str, ...]] = {"UCX": ("device_list", "ucx_devices")}
# Keys NIXL 1.5.1 plugins read although get_plugin_params does not list them.
UNADVERTISED: dict[str, frozenset[str]] = {
    "UCX": frozenset({"device_list", "num_threads", "split_batch_size", "engine_config"}),
    "LIBFABRIC": frozenset({"num_threads", "split_batch_size", "max_bw_per_dram_seg"}),
}
# How nixl_agent_config(num_threads=N) spells N for each backend (transfer.nixl_threads).
THREADS_KEY = {"UCX": "num_threads", "OBJ": "num_threads", "LIBFABRIC": "num_threads", "GDS_MT": "thread_count",
                "UCCL": "num_cpus"}


@dataclass(frozen=True, slots=True)
class AgentBackend:
    """One backend of a worker's agent, as the status API shows it."""

    name: str
    params: dict[str, str]  # as NIXL reports them once created (get_backend_params)
    devices: str  # network devices it is limited to; "": the backend (or UCX) picks
    devices_from: str  # where ``devices`` comes from: a parameter name, or "env UCX_NET_DEVICES"
    device: str  # where the worker's KV lives ("host", "gpu0"): the transfer.device_params entry used


def memory_device(mem_type: str, mappings: Sequence[tuple[int, int, int]]) -> str:
    """"host" for shared memory, "gpu<N>" for CUDA memory on device N (its first mapping)."""
    return "host" if mem_type == "DRAM" or not mappings else f"gpu{mappings[0][2]}"


def agent_devices(backend: str, params: dict[str, str]) -> tuple[str, str]:
    """The network devices ``backend`` is limited to, and where that comes from."""
    for key in DEVICE_KEYS.get(backend, ()):
        if params.get(key, "").strip():
            return params[key], key
    if backend == "UCX" and os.environ.get("UCX_NET_DEVICES"):
        return os.environ["UCX_NET_DEVICES"], "env UCX_NET_DEVICES"
    return "", ""

