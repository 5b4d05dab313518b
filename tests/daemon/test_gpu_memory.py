"""CUDA memory as vLLM allocates it, without a GPU: which allocations may be handed over, the messages
that name the setting to change, the daemon's check of what it mapped, and the sentinel each attach arms.

The daemon-side refusals run against real daemons: a handle torch makes for an expandable segment is
refused before anything is mapped (no GPU needed), and the daemon goes on.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
from kvpushd_client import Attach, CudaMemory, KVPushError, Region, Role, _convert
from kvpushd_client.cuda import (
    CUDA_IPC_HANDLE_SIZE,
    CudaMemoryError,
    Driver,
    alloc_conf_expandable,
    check_shareable,
    handle_kind,
    load_libcuda,
    uuid_hex,
)

from kvpushd.core.errors import FailedPrecondition, InvalidArgument
from kvpushd.memory.cuda import Mapped, check_handle, check_mapping

MALLOC = bytes([2]) + b"c" + bytes(range(CUDA_IPC_HANDLE_SIZE))
EXPANDABLE = bytes([2]) + b"e" + b"\x01" * 40


def test_alloc_conf_names_both_variables() -> None:
    assert alloc_conf_expandable({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert alloc_conf_expandable({"PYTORCH_ALLOC_CONF": "max_split_size_mb:512, expandable_segments:true"})
    assert not alloc_conf_expandable({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert not alloc_conf_expandable({})


def test_handle_kinds() -> None:
    assert handle_kind(MALLOC) == "cuda_malloc"
    assert handle_kind(EXPANDABLE) == "expandable_segment"
    assert handle_kind(b"\x00" * CUDA_IPC_HANDLE_SIZE) == "legacy"
    assert handle_kind(b"\x02c\x00") == "unknown"
    assert handle_kind(b"") == "unknown"


def test_caching_allocator_memory_is_shared() -> None:
    check_shareable(True, "cuda_malloc")
    check_shareable(None, "cuda_malloc")  # no driver to ask: torch's handle decides
    check_shareable(True, "legacy")


def test_expandable_segments_refused_naming_the_setting() -> None:
    with pytest.raises(CudaMemoryError, match=r"PYTORCH_CUDA_ALLOC_CONF.*expandable_segments:True"):
        check_shareable(False, "expandable_segment")
    # the driver says VMM and the process turns expandable segments on: that is the cause named
    with pytest.raises(CudaMemoryError, match="expandable_segments"):
        check_shareable(False, "cuda_malloc", None, expandable_env=True)


def test_cumem_allocator_refused_naming_the_vllm_options() -> None:
    # vLLM's cumem pool: the driver says not IPC-capable and torch's cudaIpcGetMemHandle raised
    with pytest.raises(CudaMemoryError) as ei:
        check_shareable(False, None, "CUDA error: invalid argument", expandable_env=True)
    msg = str(ei.value)
    assert "--enable-sleep-mode" in msg and "--enable-cumem-allocator" in msg
    assert "cuMemCreate" in msg and "invalid argument" in msg
    with pytest.raises(CudaMemoryError, match="--enable-sleep-mode"):
        check_shareable(False, "cuda_malloc")
    with pytest.raises(CudaMemoryError, match="--enable-cumem-allocator"):
        check_shareable(None, None, "boom")


def test_unknown_handle_format_refused() -> None:
    with pytest.raises(CudaMemoryError, match="format"):
        check_shareable(True, "unknown")


def test_uuid_spellings() -> None:
    assert uuid_hex("GPU-8A3C0D12-aaaa-bbbb-cccc-0123456789ab") == uuid_hex("8a3c0d12aaaabbbbcccc0123456789ab")


class _Lib:
    """A stand-in libcuda for the checks every ctypes wrapper shares (kvpushd_client.cuda.CudaCalls)."""

    def cuGetErrorName(self, rc: int, ref: Any) -> int:
        ref._obj.value = b"CUDA_ERROR_INVALID_VALUE"
        return 0

    def cuDeviceGet(self, ref: Any, ordinal: int) -> int:
        ref._obj.value = ordinal
        return 0

    def cuDeviceGetUuid(self, raw: Any, dev: Any) -> int:
        ctypes.memmove(raw, bytes(range(16)), 16)
        return 0


def test_each_libcuda_wrapper_raises_its_own_error_naming_the_call_and_result() -> None:
    from kvpushd_client.gpu_doorbell import GpuDoorbell, GpuDoorbellError
    from kvpushd_client.vmm import CudaDriver, VmmError

    from kvpushd.memory.vmm import CudaDriver as DaemonDriver
    from kvpushd.memory.vmm import VmmImportError

    assert (Driver.error, GpuDoorbell.error) == (OSError, GpuDoorbellError)
    for drv, error in ((CudaDriver(_Lib()), VmmError), (DaemonDriver(_Lib()), VmmImportError)):  # type: ignore[arg-type]
        drv._check("cuMemMap", 0)
        with pytest.raises(error, match=r"^cuMemMap failed: CUDA_ERROR_INVALID_VALUE \(1\)$"):
            drv._check("cuMemMap", 1)
        assert drv.device_uuid(0) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
        assert uuid_hex(drv.device_uuid(0)) == bytes(range(16)).hex()
    with pytest.raises(VmmError, match=r"^cuMemMap failed: \? \(2\)$"):  # a driver that cannot name it
        CudaDriver(object())._check("cuMemMap", 2)  # type: ignore[arg-type]


def test_load_libcuda_raises_the_callers_error() -> None:
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this machine has a CUDA driver")
    except OSError:
        pass
    with pytest.raises(FailedPrecondition, match=r"^the test needs the CUDA driver \(libcuda.so.1\), which cannot be "
                                                 r"loaded here \(.*\); do this$"):
        load_libcuda(FailedPrecondition, "the test", "; do this")
    with pytest.raises(OSError, match="kvpushd needs the CUDA driver"):
        load_libcuda()


def test_daemon_refuses_before_mapping() -> None:
    with pytest.raises(FailedPrecondition, match="expandable_segments"):
        check_handle(EXPANDABLE, b"", 0, b"", 4096)
    with pytest.raises(InvalidArgument, match="no format"):
        check_handle(b"\x02z", b"", 0, b"", 4096)
    with pytest.raises(InvalidArgument, match="outside"):
        check_handle(MALLOC, b"s" * 16, 4090, b"r" * 16, 4096)
    with pytest.raises(InvalidArgument, match="sentinel"):
        check_handle(MALLOC, b"s" * 65, 0, b"", 4096)
    with pytest.raises(InvalidArgument, match="restore"):
        check_handle(MALLOC, b"s" * 16, 0, b"r" * 3, 4096)
    check_handle(MALLOC, b"s" * 16, 0, b"r" * 16, 4096)


def test_daemon_checks_what_it_mapped() -> None:
    s = b"0123456789abcdef"
    good = Mapped(addr=0x1000, size=4096, device_ordinal=1, range_start=0x0, range_size=0x10000, probe=s)
    check_mapping(good, 4096, 1, s)
    for bad, why in [
        (Mapped(0x1000, 2048, 1, 0, 0x10000, s), "holds 2048 bytes"),
        (Mapped(0x1000, 4096, 0, 0, 0x10000, s), "ordinal 0"),
        (Mapped(0x1000, 4096, 1, 0, 0x1800, s), "outside its allocation"),
        (Mapped(0x1000, 4096, 1, 0, 0x10000, b"\x00" * 16), "sentinel"),
    ]:
        with pytest.raises(InvalidArgument, match=why):
            check_mapping(bad, 4096, 1, s)
    check_mapping(Mapped(0x1000, 4096, -1, 0, 0, b""), 4096, 1, b"")  # nothing to ask: size only


def test_each_attach_request_arms_a_fresh_sentinel() -> None:
    calls: list[int] = []

    def arm() -> tuple[bytes, int, bytes]:
        calls.append(1)
        return bytes([len(calls)]) * 16, 0, b"\x00" * 16

    m = CudaMemory("GPU-0", MALLOC, 1 << 20, arm_sentinel=arm)
    reqs = [_convert.attach_request(Attach("e", Role.PRODUCER, 0, 1, [m], [Region(0, 0, 4, 4096)]))
            for _ in range(2)]
    got = [r.memory[0].cuda_ipc for r in reqs]
    assert [g.sentinel for g in got] == [b"\x01" * 16, b"\x02" * 16]
    assert all(g.sentinel_restore == b"\x00" * 16 and g.ipc_handle == MALLOC for g in got)
    plain = CudaMemory("GPU-0", MALLOC, 4096, sentinel=b"x" * 16, sentinel_offset=8, sentinel_restore=b"y" * 16)
    c = _convert.attach_request(Attach("e", Role.PRODUCER, 0, 1, [plain], [Region(0, 0, 1, 4096)])).memory[0].cuda_ipc
    assert (c.sentinel, c.sentinel_offset, c.sentinel_restore) == (b"x" * 16, 8, b"y" * 16)


def test_daemon_refuses_expandable_segment_and_goes_on(daemon_pair) -> None:
    p, _ = daemon_pair
    regions = [Region(0, 0, 4, 4096)]
    with pytest.raises(KVPushError) as ei:
        p.client.attach("gpu-e", Role.PRODUCER, 0, 1, [CudaMemory("GPU-0", EXPANDABLE, 16384)], regions)
    assert ei.value.code == "FAILED_PRECONDITION"
    assert "expandable_segments" in ei.value.message and "PYTORCH_CUDA_ALLOC_CONF" in ei.value.message
    with pytest.raises(KVPushError) as ei:
        p.client.attach("gpu-s", Role.PRODUCER, 0, 1,
                        [CudaMemory("GPU-0", MALLOC, 16384, sentinel=b"s" * 16, sentinel_offset=16380)], regions)
    assert ei.value.code == "INVALID_ARGUMENT" and "sentinel" in ei.value.message
    st = p.client.status()
    assert not st.workers
