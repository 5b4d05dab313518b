"""Describe engine KV tensors to the daemon: host tensors in shared memory, CUDA tensors by IPC handle."""

from __future__ import annotations

import os
from typing import Any

from .cuda import SENTINEL_BYTES, CudaMemoryError, alloc_conf_expandable, check_shareable, driver, handle_kind
from .types import CudaMemory

__all__ = ["CudaMemoryError", "cuda_memory"]


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
