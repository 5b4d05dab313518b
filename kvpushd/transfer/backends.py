"""Backend policy: which NIXL init parameters pick devices and threads, and what status shows."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import Mapping, Sequence
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



# UCX transports that reach a GPU's memory through a NIC (GPUDirect RDMA): the only fast way UCX has for
# CUDA virtual memory, which its cuda_ipc transport cannot share (nixl#1754).
_UCX_RDMA = ("rc", "dc", "ud", "ib", "all")


def ucx_rdma_allowed(ucx_tls: str) -> bool:
    """Whether ``UCX_TLS`` (unset: every transport) leaves UCX an RDMA transport to use."""
    tls = [t.strip() for t in ucx_tls.split(",") if t.strip()]
    if not tls:
        return True
    if tls[0].startswith("^"):  # an exclusion list: RDMA stays unless every kind of it is named
        gone = {tls[0][1:], *tls[1:]}
        return not ({"rc", "dc", "ud"} <= {t.split("_")[0] for t in gone} or "ib" in gone)
    return any(t.split("_")[0] in _UCX_RDMA for t in tls)


def vmm_transport_note(worker_id: str, backends: Sequence[AgentBackend],
                       env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """What a worker whose KV is CUDA virtual memory (vLLM 0.34's extensible KV cache, imported by
    fd) gets from its agent's backends: ("warning" | "info", the line the daemon logs at attach).

    UCX moves GPU memory within a node by cuda_ipc, which shares only cudaMalloc memory: a VMM
    range registers, but a WRITE between two GPUs of one node then falls to UCX's software emulation
    over TCP (measured by nixl#1754 at about 0.3 GB/s against 200 GB/s) unless an RDMA NIC with
    GPUDirect carries it; across nodes UCX needs GPUDirect RDMA either way. LIBFABRIC (EFA) reads
    GPU memory through FI_HMEM, which takes VMM ranges as it takes any CUDA memory."""
    env = os.environ if env is None else env  # the daemon's own: its agents read it
    names = [b.name for b in backends]
    fix = ('kv_connector_extra_config {"kvpushd_kv_cache_access": "legacy_ipc"} keeps the KV in cudaMalloc '
           "memory shared by CUDA IPC (vLLM's extensible KV cache off)")
    head = f"worker {worker_id}: KV cache in CUDA virtual memory (by fd), backends {names}"
    if "UCX" not in names:
        return "info", f"{head}: GPU memory through the backend's own registration (FI_HMEM for LIBFABRIC)"
    tls = env.get("UCX_TLS", "")
    if not ucx_rdma_allowed(tls):
        return "warning", (f"{head}: UCX_TLS={tls!r} leaves UCX no RDMA transport, and UCX's cuda_ipc cannot "
                           "share CUDA virtual memory (nixl#1754): every WRITE of this worker takes UCX's "
                           f"emulated path over TCP (well under 1 GB/s). Allow rc/dc with GPUDirect RDMA, or {fix}")
    return "warning", (f"{head}: UCX's cuda_ipc cannot share CUDA virtual memory (nixl#1754), so a WRITE to or "
                       "from a GPU of this same node takes UCX's emulated path over TCP (well under 1 GB/s) "
                       "unless an RDMA NIC with GPUDirect carries it; across nodes it needs GPUDirect RDMA "
                       f"(nvidia-peermem or DMA-BUF). Where prefill and decode share a node, {fix}. "
                       "UCX_PROTO_INFO=y shows the path each transfer took")


_SIOCGIFFLAGS, _IFF_RUNNING = 0x8913, 0x40
_IFREQ = struct.Struct("16sh22x")  # struct ifreq (40 bytes): the name, then ifr_flags at the union's start


def iface_not_running(env: Mapping[str, str]) -> str:
    """Why libfabric's tcp provider has no address to listen on, where that is the reason: ``FI_TCP_IFACE``
    names an interface that does not exist in this network namespace or is not RUNNING (down, or up without
    a carrier yet). The provider then enables its endpoint without a socket and NIXL reports only
    "fi_enable failed: Bad file descriptor". '' where no such interface is named or it runs."""
    name = env.get("FI_TCP_IFACE", "")
    if not name:
        return ""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = fcntl.ioctl(s, _SIOCGIFFLAGS, _IFREQ.pack(name.encode()[:15], 0))
    except OSError as e:
        return f"FI_TCP_IFACE={name}: no such interface here ({e.strerror})"
    if _IFREQ.unpack(req)[1] & _IFF_RUNNING:
        return ""
    return (f"FI_TCP_IFACE={name}: the interface is not running (down, or no carrier yet), so libfabric's tcp "
            "provider finds no address on it; start the daemon once the link is up (systemd: After= "
            "network-online.target)")
