"""Plain-value inputs for the core."""

from __future__ import annotations

from dataclasses import dataclass

from kvpushd.core.layout import Shape


@dataclass(frozen=True, slots=True)
class WorkerRef:
    """A WorkerInfo of plain values (tests feed the core with it)."""

    worker_id: str
    engine_id: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    regions: tuple[Shape, ...] = ()
    block_bytes: int = 0
