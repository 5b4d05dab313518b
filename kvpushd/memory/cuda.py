"""GPU KV memory: CUDA IPC handles from the worker, opened with torch in the daemon.

Handles name the GPU by UUID, because ordinals differ between processes that see different
CUDA_VISIBLE_DEVICES. Needs a GPU and a CUDA build of torch; tested only where both exist
(tests/daemon/test_cuda_ipc.py and tests/daemon/test_gpu_*.py skip otherwise).

Never a silent wrong mapping: before the memory goes to NIXL, :func:`check_mapping` compares what was
mapped with what the worker said (size, GPU, the driver's range around the address) and reads back the
sentinel the worker wrote; only then are the worker's original bytes put back. Memory an IPC handle
cannot share (PyTorch's expandable segments, vLLM's cumem allocator) is refused with the setting to
change (kvpushd_client.cuda says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpushd_client.cuda import EXPANDABLE_MESSAGE, driver, handle_kind, uuid_hex
from kvpushd_client.types import CudaMemory

from ..core.errors import FailedPrecondition, InvalidArgument, NotFound

MAX_SENTINEL = 64


def gpu_ordinal(uuid: str) -> int:
    """The local CUDA ordinal of the GPU with this UUID."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a daemon dependency
        raise FailedPrecondition("CUDA IPC memory needs torch in the daemon") from None
    if not torch.cuda.is_available():
        raise FailedPrecondition("CUDA IPC memory handed to a daemon that sees no GPU")
    want = uuid_hex(uuid)
    for i in range(torch.cuda.device_count()):
        if uuid_hex(str(torch.cuda.get_device_properties(i).uuid)) == want:
            return i
    raise NotFound(f"no GPU with UUID {uuid!r} is visible to the daemon")


def check_sentinel(what: str, sentinel: bytes, restore: bytes) -> None:
    """A handle's sentinel (CUDA IPC or VMM): at most ``MAX_SENTINEL`` bytes, its restore bytes none or as many."""
    if len(sentinel) > MAX_SENTINEL or len(restore) not in (0, len(sentinel)):
        raise InvalidArgument(f"{what}: sentinel of {len(sentinel)} bytes (at most {MAX_SENTINEL}) and restore "
                              f"bytes of {len(restore)} (none or as many)")


def check_handle(ipc_handle: bytes, sentinel: bytes, sentinel_offset: int, sentinel_restore: bytes,
                 size: int) -> None:
    """What can be refused before anything is mapped."""
    if size <= 0:
        raise InvalidArgument(f"CUDA IPC handle: size must be positive, got {size}")
    if not ipc_handle:
        raise InvalidArgument("CUDA IPC handle is empty")
    kind = handle_kind(ipc_handle)
    if kind == "expandable_segment":
        raise FailedPrecondition("kvpushd cannot register this GPU KV: " + EXPANDABLE_MESSAGE)
    if kind == "unknown":
        raise InvalidArgument(f"CUDA IPC handle of {len(ipc_handle)} bytes in no format kvpushd knows")
    check_sentinel("CUDA IPC handle", sentinel, sentinel_restore)
    if sentinel and sentinel_offset + len(sentinel) > size:
        raise InvalidArgument(f"CUDA IPC handle: sentinel at {sentinel_offset} + {len(sentinel)} bytes lies "
                              f"outside the {size} bytes handed over")


@dataclass(frozen=True, slots=True)
class Mapped:
    """What the daemon sees of a mapping, for :func:`check_mapping`."""

    addr: int
    size: int                  # bytes the mapped storage holds
    device_ordinal: int        # where the driver says the address lives (-1: not asked)
    range_start: int = 0       # the driver's allocation around the address (size 0: not asked)
    range_size: int = 0
    probe: bytes = b""         # bytes read at the sentinel's place


def check_mapping(m: Mapped, want_size: int, want_ordinal: int, sentinel: bytes) -> None:
    """Refuse a mapping that is not what the worker described; the message says what differs."""
    if m.size != want_size:
        raise InvalidArgument(f"CUDA IPC mapping holds {m.size} bytes, the worker declared {want_size}")
    if m.device_ordinal >= 0 and m.device_ordinal != want_ordinal:
        raise InvalidArgument(f"CUDA IPC mapping lives on GPU ordinal {m.device_ordinal}, not on {want_ordinal} "
                              "(the GPU the worker named by UUID)")
    if m.range_size and not (m.range_start <= m.addr and m.addr + want_size <= m.range_start + m.range_size):
        raise InvalidArgument(f"CUDA IPC mapping [{m.addr:#x}, +{want_size}) runs outside its allocation "
                              f"[{m.range_start:#x}, +{m.range_size})")
    if sentinel and m.probe != sentinel:
        raise InvalidArgument("CUDA IPC mapping does not hold the sentinel the worker wrote (a different "
                              "allocation, or the wrong offset in it); refusing to register it")


class CudaIpcMapping:
    """A worker's CUDA allocation opened through its IPC handle, checked before anyone registers it."""

    mem_type = "VRAM"

    def __init__(self, h: CudaMemory) -> None:
        """``h``: the worker's handle as the Attach carried it (its sentinel armed already)."""
        check_handle(h.ipc_handle, h.sentinel, h.sentinel_offset, h.sentinel_restore, h.size)
        import torch

        self.device_id = gpu_ordinal(h.gpu_uuid)
        try:
            with torch.cuda.device(self.device_id):
                self._storage: Any = torch.UntypedStorage._new_shared_cuda(
                    self.device_id, h.ipc_handle, h.size, h.storage_offset,
                    h.ref_counter_handle or None, h.ref_counter_offset,
                    h.event_handle or None, h.event_sync_required,
                )
        except RuntimeError as e:
            raise InvalidArgument(f"CUDA IPC handle cannot be opened: {e}") from None
        self.addr = int(self._storage.data_ptr())
        self.size = h.size
        try:
            self._verify(h.sentinel, h.sentinel_offset, h.sentinel_restore)
        except BaseException:
            self.close()
            raise

    def _view(self, offset: int, n: int) -> Any:
        import torch

        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{self.device_id}").set_(
            self._storage, offset, (n,), (1,))

    def _verify(self, sentinel: bytes, offset: int, restore: bytes) -> None:
        import torch

        ordinal, start, span = -1, 0, 0
        drv = driver()
        if drv is not None:
            with torch.cuda.device(self.device_id):
                info = drv.pointer(self.addr)
            ordinal, start, span = info.device_ordinal, info.range_start, info.range_size
        probe = b""
        if sentinel:
            probe = bytes(self._view(offset, len(sentinel)).cpu().numpy().tobytes())
        check_mapping(Mapped(self.addr, int(self._storage.nbytes()), ordinal, start, span, probe),
                      self.size, self.device_id, sentinel)
        if sentinel and restore:
            self._view(offset, len(restore)).copy_(torch.frombuffer(bytearray(restore), dtype=torch.uint8))
            torch.cuda.synchronize(self.device_id)

    def close(self) -> None:
        self._storage = None
