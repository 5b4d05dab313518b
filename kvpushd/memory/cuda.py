"""GPU KV memory: CUDA IPC handles from the worker, opened with torch in the daemon.

Handles name the GPU by UUID, because ordinals differ between processes that see different
CUDA_VISIBLE_DEVICES. Needs a GPU and a CUDA build of torch; tested only where both exist
(tests/daemon/test_cuda_ipc.py skips otherwise).
"""

from __future__ import annotations

from typing import Any

from ..core.errors import FailedPrecondition, InvalidArgument, NotFound


def normalize_uuid(uuid: str) -> str:
    u = uuid.strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def gpu_ordinal(uuid: str) -> int:
    """The local CUDA ordinal of the GPU with this UUID."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a daemon dependency
        raise FailedPrecondition("CUDA IPC memory needs torch in the daemon") from None
    if not torch.cuda.is_available():
        raise FailedPrecondition("CUDA IPC memory handed to a daemon that sees no GPU")
    want = normalize_uuid(uuid)
    for i in range(torch.cuda.device_count()):
        if normalize_uuid(str(torch.cuda.get_device_properties(i).uuid)) == want:
            return i
    raise NotFound(f"no GPU with UUID {uuid!r} is visible to the daemon")


class CudaIpcMapping:
    """A worker's CUDA allocation opened through its IPC handle."""

    mem_type = "VRAM"

    def __init__(self, gpu_uuid: str, ipc_handle: bytes, size: int, storage_offset: int,
                 ref_counter_handle: bytes, ref_counter_offset: int, event_handle: bytes,
                 event_sync_required: bool) -> None:
        if size <= 0:
            raise InvalidArgument(f"CUDA IPC handle: size must be positive, got {size}")
        if not ipc_handle:
            raise InvalidArgument("CUDA IPC handle is empty")
        import torch

        self.device_id = gpu_ordinal(gpu_uuid)
        try:
            with torch.cuda.device(self.device_id):
                self._storage: Any = torch.UntypedStorage._new_shared_cuda(
                    self.device_id, ipc_handle, size, storage_offset,
                    ref_counter_handle or None, ref_counter_offset,
                    event_handle or None, event_sync_required,
                )
        except RuntimeError as e:
            raise InvalidArgument(f"CUDA IPC handle cannot be opened: {e}") from None
        self.addr = int(self._storage.data_ptr())
        self.size = size

    def close(self) -> None:
        self._storage = None

