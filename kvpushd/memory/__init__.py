"""Opening workers' memory handles: the only place that touches raw addresses.

A Mapping is a piece of a worker's memory, mapped into the daemon, with the address NIXL registers.
KV bytes are never copied by the daemon: NIXL moves them between the workers' memories.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvpushd_client.types import CudaMemory  # what the wire's handle says: one definition

from ..core.errors import InvalidArgument
from .vmm import VmmSpec, close_fds, open_vmm

if TYPE_CHECKING:
    from .fdpass import FdInbox


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


MemorySpec = CudaMemory | MemfdSpec | VmmSpec


def open_all(memory: Sequence[MemorySpec], fds: dict[bytes, int] | None = None) -> list[Mapping]:
    """Open every handle, or none (closing what was opened when one fails); ``fds``: the memfds'
    descriptors by token, each closed here whatever happens."""
    from .shm import ShmMapping

    fds = dict(fds or {})
    out: list[Mapping] = []
    try:
        for i, spec in enumerate(memory):
            if isinstance(spec, MemfdSpec):
                out.append(ShmMapping(fds.pop(spec.token), spec.size, f"memfd of memory {i}"))
            elif isinstance(spec, VmmSpec):  # CUDA virtual memory by its chunks' descriptors (memory/vmm.py)
                chunk_fds = [fds.pop(t) for t in spec.tokens]
                try:
                    out.append(open_vmm(spec, chunk_fds))
                finally:
                    close_fds(chunk_fds)
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


def take_fds(inbox: FdInbox, memory: Sequence[MemorySpec]) -> dict[bytes, int]:
    """The descriptors of the sealed memfds and VMM chunks among ``memory``, each taken from the fd
    socket as the kind it was sent as (all or none: what was taken is closed when one is missing)."""
    from .fdpass import MEMFD, VMM

    named = [(m.token, MEMFD) for m in memory if isinstance(m, MemfdSpec)]
    named += [(t, VMM) for m in memory if isinstance(m, VmmSpec) for t in m.tokens]
    kinds = dict(named)
    if len(kinds) != len(named):
        raise InvalidArgument("two memfd handles or VMM chunks name the same token")
    fds: dict[bytes, int] = {}
    try:
        for t, kind in kinds.items():
            fds[t] = inbox.take(t, kind)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds
