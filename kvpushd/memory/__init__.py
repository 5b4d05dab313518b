"""Opening workers' memory handles: the only place that touches raw addresses.

A Mapping is a piece of a worker's memory, mapped into the daemon, with the address NIXL registers.
KV bytes are never copied by the daemon: NIXL moves them between the workers' memories.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpushd_client.types import CudaMemory, ShmMemory  # what the wire's handles say: one definition

from ..core.errors import PermissionDenied


class Mapping(Protocol):
    addr: int
    size: int
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class MemfdSpec:
    token: bytes  # what the descriptor came under on the fd socket (memory/fdpass.py)
    size: int


MemorySpec = ShmMemory | CudaMemory | MemfdSpec


def open_all(memory: Sequence[MemorySpec], fds: dict[bytes, int] | None = None) -> list[Mapping]:
    """Open every handle, or none (closing what was opened when one fails); ``fds``: the memfds'
    descriptors by token, each closed here whatever happens."""
    from .shm import ShmMapping

    fds = dict(fds or {})
    out: list[Mapping] = []
    try:
        for i, spec in enumerate(memory):
            if isinstance(spec, ShmMemory):
                raise PermissionDenied(
                    f"memory {i}: host KV by /dev/shm name is refused: a worker could truncate it under a "
                    "WRITE; hand a sealed memfd (kvpushd_client.SealedBuffer)")
            if isinstance(spec, MemfdSpec):
                out.append(ShmMapping(fds.pop(spec.token), spec.size, f"memfd of memory {i}"))
            else:
                from .cuda import CudaIpcMapping

                out.append(CudaIpcMapping(spec))
    except BaseException:
        for m in out:
            m.close()
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    return out
