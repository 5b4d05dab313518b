"""Test helpers over kvpushd_client.vmm: several segments of one range, and a sentinel by driver copies."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

from kvpushd_client.vmm import CudaDriver as _CudaDriver
from kvpushd_client.vmm import Driver, VmmChunk, VmmExport, VmmMemory, export_range

from kvpushd.memory.vmm import CudaDriver as _DaemonDriver


class CudaDriver(_CudaDriver):
    """The worker's driver with the daemon's synchronous copies (both wrap ``lib`` and ``_check`` alike)."""

    read = _DaemonDriver.read
    write = _DaemonDriver.write


def export_segments(driver: Driver, base: int, reserved: int, segments: Sequence[tuple[int, int]],
                    device: int) -> VmmMemory:
    """The chunks mapped in each ``(offset, size)`` of the range at ``base`` (vLLM: one segment per
    layer, a committed prefix of each), exported; offsets are in the range."""
    chunks: list[VmmChunk] = []
    granularity, uuid = driver.granularity(device), driver.device_uuid(device)
    try:
        for off, size in segments:
            if size:
                exp = export_range(driver, base + off, size, device)
                chunks += [VmmChunk(off + c.offset, c.size, c.fd) for c in exp.chunks]
    except BaseException:
        VmmExport(0, 0, "", tuple(chunks)).close()
        raise
    return VmmMemory(uuid, reserved, granularity, tuple(chunks))


def sentinel_arm(driver: CudaDriver, base: int, offset: int = 0, n: int = 16) -> Callable[[], tuple[bytes, int, bytes]]:
    """``VmmMemory.arm_sentinel`` for the range at ``base``: writes ``n`` random bytes at ``offset`` (a mapped
    byte) and returns them with the bytes that were there, which the daemon writes back after its check.
    Synchronous copies: the bytes are on the GPU before the Attach leaves."""

    def arm() -> tuple[bytes, int, bytes]:
        old = driver.read(base + offset, n)
        s = secrets.token_bytes(n)
        while s == old:
            s = secrets.token_bytes(n)
        driver.write(base + offset, s)
        return s, offset, old

    return arm
