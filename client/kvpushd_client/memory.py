"""Describe engine KV tensors to the daemon: host tensors in shared memory, CUDA tensors by IPC handle, or,
CUDA virtual memory (vLLM 0.34's extensible KV cache under ``EXPORTS_FD``), its chunks by file descriptor."""

from __future__ import annotations

import os
from typing import Any

from .cuda import SENTINEL_BYTES, CudaMemoryError, alloc_conf_expandable, check_shareable, driver, handle_kind
from .types import CudaMemory
from .vmm import VmmError, VmmMemory, export_range

__all__ = ["CudaMemoryError", "cuda_memory", "gpu_memory", "vmm_memory"]

VMM_EXPORT_MESSAGE = (
    "this CUDA KV tensor lives in CUDA virtual memory (vLLM 0.34's extensible KV cache, or another cuMemCreate "
    "allocator) and its chunks could not be exported as file descriptors")


def _bytes_view(storage: Any, n: int) -> Any:
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (n,), (1,))


def _sentinel_writer(storage: Any) -> Any:
    """A function that writes a fresh sentinel at byte 0 of the storage and returns (sentinel, 0, restore).

    The daemon reads it through its own mapping and writes ``restore`` back; if an attach fails before
    that, the next call keeps the true original bytes (it recognises its own sentinel)."""
    import torch

    n = min(SENTINEL_BYTES, int(storage.nbytes()))
    state: dict[str, bytes] = {}

    def arm() -> tuple[bytes, int, bytes]:
        view = _bytes_view(storage, n)
        current = bytes(view.cpu().numpy().tobytes())
        restore = state["restore"] if current == state.get("sentinel") else current
        sentinel = os.urandom(n)
        while sentinel == restore:
            sentinel = os.urandom(n)
        view.copy_(torch.frombuffer(bytearray(sentinel), dtype=torch.uint8))
        torch.cuda.synchronize(storage.device)
        state.update(sentinel=sentinel, restore=restore)
        return sentinel, 0, restore

    return arm


def cuda_memory(tensor: Any, sentinel: bool = True) -> CudaMemory:
    """The CUDA IPC handle of a CUDA tensor's whole storage, naming its GPU by UUID.

    Raises CudaMemoryError (naming the setting to change) for memory an IPC handle cannot share: PyTorch's
    expandable segments and vLLM's cumem allocator (kvpushd_client.cuda). ``sentinel``: each attach request
    writes 16 random bytes at the storage's first byte for the daemon to check its mapping by, and the
    daemon puts the original bytes back before it registers the memory."""
    import torch  # only for CUDA tensors, which means torch is there

    storage = tensor.untyped_storage()
    legacy: bool | None = None
    drv = driver()
    if drv is not None:
        with torch.cuda.device(tensor.device):
            legacy = drv.pointer(int(storage.data_ptr())).legacy_ipc_capable
    try:
        device, handle, size, offset, ref_h, ref_off, ev_h, ev_sync = storage._share_cuda_()
    except RuntimeError as e:
        check_shareable(legacy, None, str(e).splitlines()[0] if str(e) else type(e).__name__,
                        alloc_conf_expandable())
        raise  # pragma: no cover - check_shareable raised
    check_shareable(legacy, handle_kind(bytes(handle)), None, alloc_conf_expandable())
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return CudaMemory(gpu_uuid=uuid, ipc_handle=bytes(handle), size=int(size), storage_offset=int(offset),
                      ref_counter_handle=bytes(ref_h or b""), ref_counter_offset=int(ref_off or 0),
                      event_handle=bytes(ev_h or b""), event_sync_required=bool(ev_sync),
                      arm_sentinel=_sentinel_writer(storage) if sentinel else None)


def vmm_memory(storage: Any, device: int, sentinel: bool = True, drv: Any = None) -> VmmMemory:
    """The chunks of CUDA virtual memory under a CUDA storage, each exported as a file descriptor (kept open
    until ``close()``: a restarted daemon gets them again); the caller has the storage's device current.
    vLLM 0.34 gives each layer of its extensible KV cache a storage over its segment's committed blocks,
    which start a chunk. ``drv``: a ``kvpushd_client.vmm.Driver`` (libcuda by default)."""
    from .vmm import CudaDriver

    try:
        d = drv if drv is not None else CudaDriver()
        exp = export_range(d, int(storage.data_ptr()), int(storage.nbytes()), device)
    except (VmmError, OSError) as e:
        raise CudaMemoryError(f"{VMM_EXPORT_MESSAGE}: {e}") from None
    return VmmMemory(exp.device_uuid, exp.size, exp.granularity, exp.chunks,
                     arm_sentinel=_sentinel_writer(storage) if sentinel else None)


def gpu_memory(tensor: Any, exports_fd: bool) -> CudaMemory | VmmMemory:
    """A CUDA tensor's storage for an Attach: by file descriptor where it is CUDA virtual memory and the
    connector declared ``EXPORTS_FD`` (vLLM then made its chunks exportable), else by CUDA IPC handle
    (which refuses virtual memory, naming the setting to change)."""
    drv = driver() if exports_fd else None
    if drv is not None:
        import torch  # only for CUDA tensors, which means torch is there

        storage = tensor.untyped_storage()
        with torch.cuda.device(tensor.device):
            if drv.pointer(int(storage.data_ptr())).legacy_ipc_capable is False:
                return vmm_memory(storage, int(tensor.device.index))
    return cuda_memory(tensor)
