"""Describe engine KV tensors to the daemon: host tensors in shared memory, CUDA tensors by IPC handle."""

from __future__ import annotations

from typing import Any

from .types import CudaMemory


def cuda_memory(tensor: Any) -> CudaMemory:
    """The CUDA IPC handle of a CUDA tensor's whole storage, naming its GPU by UUID."""
    import torch  # only for CUDA tensors, which means torch is there

    storage = tensor.untyped_storage()
    device, handle, size, offset, ref_h, ref_off, ev_h, ev_sync = storage._share_cuda_()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return CudaMemory(gpu_uuid=uuid, ipc_handle=bytes(handle), size=int(size), storage_offset=int(offset),
                      ref_counter_handle=bytes(ref_h or b""), ref_counter_offset=int(ref_off or 0),
                      event_handle=bytes(ev_h or b""), event_sync_required=bool(ev_sync))
