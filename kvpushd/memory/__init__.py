"""Opening workers' memory handles: the only place that touches raw addresses.

A Mapping is a piece of a worker's memory, mapped into the daemon, with the address NIXL registers.
KV bytes are never copied by the daemon: NIXL moves them between the workers' memories.
"""

from __future__ import annotations

from typing import Protocol


class Mapping(Protocol):
    addr: int
    size: int
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int

    def close(self) -> None: ...

