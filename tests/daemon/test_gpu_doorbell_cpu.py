"""The GPU doorbell without a GPU: the factory, the errors without CUDA, the ctypes signatures of every
driver function it calls, and its whole life against a stand-in libcuda (tests/support/fake_libcuda.c)
that queues stream operations until the "GPU" gets there, read back by the daemon's own reader.

On a GPU the same is checked for real by tests/daemon/test_gpu_doorbell.py (scripts/gpu_check.sh).
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from kvpushd_client import gpu_doorbell
from kvpushd_client.doorbell import PREFIX, SEALED, Doorbell
from kvpushd_client.gpu_doorbell import (
    SIGNATURES,
    STREAM_COPY,
    STREAM_WRITE,
    GpuDoorbell,
    GpuDoorbellError,
    make_doorbell,
)

from kvpushd.memory.doorbell import Doorbell as Reader

SRC = Path(__file__).resolve().parents[1] / "support" / "fake_libcuda.c"
STREAM = 0x5EED


def _bells() -> set[str]:
    """This process's doorbell pages still open (memfds by name)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{PREFIX}{os.getpid()}-"):
                out.add(fd)
    return out


def _reader(bell: Doorbell) -> Reader:
    """The daemon's side of the page (a descriptor of its own, as if handed over)."""
    return Reader(os.open(bell.proc_path, os.O_RDONLY | os.O_CLOEXEC), bell.name)


def _has_libcuda() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def test_factory_picks_the_host_doorbell_for_host_kv() -> None:
    bell = make_doorbell(kv_on_cuda=False)
    try:
        assert type(bell) is Doorbell
        seq = bell.step()
        bell.layer_done(2)
        r = _reader(bell)
        assert r.ready(seq, 4) == 2
        r.close()
    finally:
        bell.close()


@pytest.mark.skipif(_has_libcuda(), reason="this machine has a CUDA driver")
def test_gpu_doorbell_without_cuda_says_so_and_leaves_nothing() -> None:
    before = _bells()
    for make in (GpuDoorbell, lambda: make_doorbell(kv_on_cuda=True)):
        with pytest.raises(GpuDoorbellError, match=r"CUDA driver \(libcuda.so.1\)"):
            make()
    assert _bells() == before


@pytest.mark.skipif(_has_libcuda(), reason="this machine has a CUDA driver")
def test_attach_with_gpu_memory_and_a_new_doorbell_asks_for_the_gpu_one(tmp_path: Path) -> None:
    """doorbell=True with CUDA memory: the stream must ring it, so without CUDA attach refuses before any RPC."""
    from kvpushd_client import CudaMemory, KVPushClient, Region, Role

    before = _bells()
    c = KVPushClient(str(tmp_path / "no-daemon.sock"), timeout_s=1)
    mem = CudaMemory("GPU-0", b"\0" * 66, 1 << 20)
    with pytest.raises(GpuDoorbellError, match="libcuda"):
        c.attach("prefill", Role.PRODUCER, 0, 1, [mem], [Region(0, 0, 4, 4096)], doorbell=True)
    c.close()
    assert _bells() == before


def test_every_driver_function_called_has_its_signature() -> None:
    """Without argtypes ctypes passes Python ints as C int: a 64-bit device address or value would be cut."""
    tree = ast.parse(Path(gpu_doorbell.__file__).read_text())
    used = {n.slice.value for n in ast.walk(tree)
            if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)
            and n.slice.value.startswith("cu")}
    assert used == set(SIGNATURES), (used ^ set(SIGNATURES))
    lib = SimpleNamespace(**{name: SimpleNamespace() for name in SIGNATURES})
    fns = gpu_doorbell.bind(lib)
    for name, (restype, argtypes) in SIGNATURES.items():
        assert fns[name].restype is restype is ctypes.c_int, name
        assert fns[name].argtypes == list(argtypes), name
    # 64-bit where cuda.h has CUdeviceptr / cuuint64_t; pointers for streams and host addresses
    write = SIGNATURES["cuStreamWriteValue64_v2"][1]
    assert write == (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint)
    assert ctypes.sizeof(ctypes.c_uint64) == 8
    del lib.cuStreamWriteValue64_v2  # optional: a driver before CUDA 11.7
    assert gpu_doorbell.bind(lib)["cuStreamWriteValue64_v2"] is None
    del lib.cuMemHostRegister_v2
    with pytest.raises(GpuDoorbellError, match="cuMemHostRegister_v2"):
        gpu_doorbell.bind(lib)


@pytest.fixture(scope="module")
def fake_libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ctypes.CDLL]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libcuda")
    d = tmp_path_factory.mktemp("fakecuda")
    libs = {}
    for name, extra in (("full", []), ("nomemops", ["-DNO_MEMOPS"])):
        out = d / f"libfakecuda_{name}.so"
        subprocess.run([cc, "-O1", "-Wall", "-Werror", "-shared", "-fPIC", *extra, "-o", str(out), str(SRC)],
                       check=True, capture_output=True)
        libs[name] = ctypes.CDLL(str(out))
    return libs


@pytest.fixture
def fake(fake_libs: dict[str, ctypes.CDLL]) -> Iterator[ctypes.CDLL]:
    lib = fake_libs["full"]
    lib.fake_reset()
    yield lib
    assert ctypes.c_int.in_dll(lib, "fake_errors").value == 0


def _int(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.c_ulonglong.in_dll(lib, name).value if name in ("fake_registered", "fake_registered_size",
                                                                    "fake_last_stream") \
        else ctypes.c_int.in_dll(lib, name).value


@pytest.mark.parametrize("memops", [1, 0])
def test_rings_land_only_when_the_stream_gets_there(fake: ctypes.CDLL, memops: int,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    ctypes.c_int.in_dll(fake, "fake_memops").value = memops
    before = _bells()
    with caplog.at_level("INFO", logger="kvpushd_client"):
        bell = GpuDoorbell(lib=fake, stream=lambda: STREAM)
    assert bell.path == (STREAM_WRITE if memops else STREAM_COPY)
    assert bell.path in caplog.text and bell.name in caplog.text
    assert bell.device == 3
    assert _int(fake, "fake_registered") % 4096 == 0 and _int(fake, "fake_registered_size") == 4096
    assert ctypes.c_uint.in_dll(fake, "fake_register_flags").value == 0x03  # DEVICEMAP | PORTABLE
    assert _int(fake, "fake_allocs") == (0 if memops else 1)
    r = _reader(bell)
    try:
        seq = bell.step()
        bell.layer_done(1)
        assert r.ready(seq, 4) == 0  # queued, not reached: the daemon sees nothing of the step
        assert fake.fake_run() == (2 if memops else 6)
        assert r.ready(seq, 4) == 1
        assert _int(fake, "fake_last_stream") == STREAM
        bell.layer_done(3)
        bell.layer_done(2)  # not more than before: nothing queued
        assert fake.fake_queued() == (1 if memops else 3)
        assert r.ready(seq, 4) == 1
        fake.fake_run()
        assert r.ready(seq, 4) == 3 and not r.complete(seq)
        bell.seal()
        fake.fake_run()
        assert r.complete(seq)
        bell.seq = (1 << 40) + 5  # both halves of the word travel (the copy path writes it as two 32-bit halves)
        big = bell.step()
        bell.layer_done(7)
        assert r.ready(big, 8) == 0
        fake.fake_run()
        assert r.ready(big, 8) == 7 and r.complete(seq)
        assert r.word() == (big << 16) | 7
        bell.layer_done(8)  # queued, then closed: close waits for the GPU before it unregisters
    finally:
        r.close()
        bell.close()
    assert fake.fake_queued() == 0 and _int(fake, "fake_synchronized") == 1
    assert _int(fake, "fake_unregistered") == 1 and _int(fake, "fake_registered") == 0
    assert _int(fake, "fake_allocs") == 0
    assert _int(fake, "fake_pushed") == _int(fake, "fake_popped") == 1
    assert _bells() == before
    bell.close()  # twice: nothing more
    assert _int(fake, "fake_unregistered") == 1
    with pytest.raises(GpuDoorbellError, match="closed"):
        bell.step()


def test_a_driver_without_stream_memory_operations_gets_the_copy(fake_libs: dict[str, ctypes.CDLL]) -> None:
    lib = fake_libs["nomemops"]
    lib.fake_reset()
    bell = GpuDoorbell(lib=lib, stream=lambda: STREAM)
    try:
        assert bell.path == STREAM_COPY
        r = _reader(bell)
        seq = bell.step()
        bell.seal()
        assert not r.complete(seq)
        lib.fake_run()
        assert r.complete(seq) and r.word() == (seq << 16) | SEALED
        r.close()
    finally:
        bell.close()
    assert ctypes.c_int.in_dll(lib, "fake_errors").value == 0


def test_forced_paths_and_no_context(fake: ctypes.CDLL) -> None:
    before = _bells()
    bell = GpuDoorbell(lib=fake, stream=lambda: 0, path=STREAM_COPY)  # the fallback, on a device with memops
    assert bell.path == STREAM_COPY
    bell.close()
    ctypes.c_int.in_dll(fake, "fake_memops").value = 0
    with pytest.raises(GpuDoorbellError, match="no 64-bit stream memory operations"):
        GpuDoorbell(lib=fake, stream=lambda: 0, path=STREAM_WRITE)
    with pytest.raises(ValueError, match="path"):
        GpuDoorbell(lib=fake, stream=lambda: 0, path="store")
    ctypes.c_int.in_dll(fake, "fake_has_ctx").value = 0
    with pytest.raises(GpuDoorbellError, match="no CUDA context is current"):
        GpuDoorbell(lib=fake, stream=lambda: 0)
    assert _bells() == before
    assert _int(fake, "fake_registered") == 0 and _int(fake, "fake_allocs") == 0
