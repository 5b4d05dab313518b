"""The doorbell for GPU KV: the progress word written by the CUDA stream, not by the engine thread.

With GPU KV the engine thread runs ahead of the GPU: when ``save_kv_layer`` returns, the kernels that
write the layer's KV are only queued. A store from the CPU (kvpushd_client.doorbell.Doorbell) would tell
the daemon a layer is ready that the GPU has not computed yet, and its NIXL WRITE would carry stale bytes.
So every ring here is an operation queued on the stream that writes the KV, and it lands in the word
when the GPU gets there. The word, its page (/dev/shm/kvpushd-kv-bell-*) and the daemon's reader
(kvpushd.memory.doorbell) are those of the host doorbell; only the writer changes.

The page is registered with the driver (``cuMemHostRegister``: pinned, mapped into the device's address
space, portable to every context), and each ring queues, on the current stream:

* ``cuStreamWriteValue64_v2(stream, dptr, step << 16 | layers, 0)`` where the device supports 64-bit
  stream memory operations (``CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS``, 122; the v2 API, on by
  default since CUDA 11.7, which cuda.h 12+ names plain ``cuStreamWriteValue64``); else
* a stream-ordered copy: two ``cuMemsetD32Async`` into an 8-byte device scratch word (the value travels
  in the call, so nothing on the host has to stay put for the GPU), then one 8-byte
  ``cuMemcpyDtoHAsync`` into the page.

Why the daemon may trust what it reads. Ordering: a stream runs its operations in the order queued, so
the write (or the copy) starts only after every kernel queued before it on that stream, the layer's KV
writes among them, has completed; with flags 0 the write also carries the driver's memory fence, like
``__threadfence_system()`` scoped to the stream (the v2 API has no flag to drop it). Visibility: the
page is ordinary host memory, pinned and mapped for the GPU; the GPU's 8-byte write goes to the same
physical page the daemon has mapped read-only, which the CPU reads coherently. The step's own
``step()`` is queued on the stream too: a later step in the word tells the daemon the earlier one is
complete, which must not be claimed before the GPU finished it either.

The copy path assumes the copy engine writes the aligned 8 bytes as one transaction, as the 64-bit
stream write does (a torn word could only differ in its upper half, which changes once every 65,536
steps).

The rings must be queued on the stream that writes the KV (by default the current torch stream, as
vLLM's forward runs), outside CUDA graph capture (vLLM's piecewise graphs call the per-layer hooks
eagerly): a captured ring would replay the value of the step it was captured in, an earlier step the
daemon takes for "nothing yet", so the transfer would wait and time out, never go early. Not
thread-safe, as the host doorbell.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Callable
from ctypes import POINTER, c_int, c_size_t, c_uint, c_uint64, c_void_p
from typing import Any

from .cuda import CudaCalls, load_libcuda
from .doorbell import SIZE, Doorbell

log = logging.getLogger("kvpushd_client")

# cuda.h
CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
# 64-bit ops of the v2 stream memory API (cuda.h 11.7/11.8: ..._V2; 12+: this name). 92/93 are the v1
# attributes (deprecated, and the v1 API is off unless the nvidia module has NVreg_EnableStreamMemOPs=1).
CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = 122
CU_STREAM_WRITE_VALUE_DEFAULT = 0

STREAM_WRITE = "stream_write_value64"  # the paths, as GpuDoorbell.path and the log line say them
STREAM_COPY = "stream_copy"

# Every driver function used here: (restype, argtypes), as cuda.h declares it (CUresult is an enum: int;
# CUdeviceptr a 64-bit integer; CUstream and CUcontext pointers; CUdevice an int). The exported names
# are the versioned ones cuda.h maps its plain names to.
SIGNATURES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "cuInit": (c_int, (c_uint,)),
    "cuCtxGetCurrent": (c_int, (POINTER(c_void_p),)),
    "cuCtxGetDevice": (c_int, (POINTER(c_int),)),
    "cuCtxPushCurrent_v2": (c_int, (c_void_p,)),
    "cuCtxPopCurrent_v2": (c_int, (POINTER(c_void_p),)),
    "cuCtxSynchronize": (c_int, ()),
    "cuDeviceGetAttribute": (c_int, (POINTER(c_int), c_int, c_int)),
    "cuMemHostRegister_v2": (c_int, (c_void_p, c_size_t, c_uint)),
    "cuMemHostGetDevicePointer_v2": (c_int, (POINTER(c_uint64), c_void_p, c_uint)),
    "cuMemHostUnregister": (c_int, (c_void_p,)),
    "cuStreamWriteValue64_v2": (c_int, (c_void_p, c_uint64, c_uint64, c_uint)),
    "cuMemAlloc_v2": (c_int, (POINTER(c_uint64), c_size_t)),
    "cuMemFree_v2": (c_int, (c_uint64,)),
    "cuMemsetD32Async": (c_int, (c_uint64, c_uint, c_size_t, c_void_p)),
    "cuMemcpyDtoHAsync_v2": (c_int, (c_void_p, c_uint64, c_size_t, c_void_p)),
}
OPTIONAL = frozenset({"cuStreamWriteValue64_v2"})  # a driver before CUDA 11.7 lacks it: the copy path


class GpuDoorbellError(RuntimeError):
    """The GPU doorbell cannot work here; the message says what is missing."""


def bind(lib: Any) -> dict[str, Any]:
    """The driver functions of ``lib`` with their signatures set (an optional one missing: None)."""
    fns: dict[str, Any] = {}
    for name, (restype, argtypes) in SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if name in OPTIONAL:
                fns[name] = None
                continue
            raise GpuDoorbellError(f"the CUDA driver has no {name}: needs a driver of CUDA 11.7 or later") from None
        fn.restype = restype
        fn.argtypes = list(argtypes)
        fns[name] = fn
    return fns


def torch_stream() -> Callable[[], int]:
    """The current torch CUDA stream, asked at each ring (the stream vLLM's forward runs on)."""
    try:
        import torch
    except ImportError:
        raise GpuDoorbellError("the GPU doorbell rings on torch's current CUDA stream: no torch here") from None
    if not torch.cuda.is_available():
        raise GpuDoorbellError("the GPU doorbell needs a CUDA GPU: torch.cuda.is_available() is false")
    current = torch.cuda.current_stream

    def stream() -> int:
        return int(current().cuda_stream)

    return stream


class GpuDoorbell(Doorbell, CudaCalls):
    """The writer's side for GPU KV: each ring is queued on the CUDA stream (see the module's text).

    Create it on the engine thread once CUDA is in use there (in a vLLM worker: once the KV caches are
    allocated, where they are registered with the daemon). ``path``: None picks the stream write where
    the device has it, else the copy; ``STREAM_COPY`` forces the copy (tests). ``lib`` and ``stream``
    replace libcuda and torch's current stream (tests without a GPU)."""

    error = GpuDoorbellError

    def __init__(self, *, path: str | None = None, lib: Any = None, stream: Callable[[], int] | None = None) -> None:
        if sys.byteorder != "little":
            raise GpuDoorbellError("the GPU doorbell's copy path assumes a little-endian host")
        if path not in (None, STREAM_WRITE, STREAM_COPY):
            raise ValueError(f"path must be None, {STREAM_WRITE!r} or {STREAM_COPY!r}, not {path!r}")
        if lib is None:
            lib = load_libcuda(GpuDoorbellError, "the GPU doorbell",
                               "; with host KV use the host doorbell (make_doorbell(kv_on_cuda=False))")
        self.lib = lib
        self._fns = fns = bind(lib)
        self._stream = stream if stream is not None else torch_stream()
        self._check("cuInit", fns["cuInit"](0))
        ctx = self._context(torch_sync=stream is None)
        dev = c_int(-1)
        self._check("cuCtxGetDevice", fns["cuCtxGetDevice"](ctypes.byref(dev)))
        self.device = dev.value
        memops = c_int(0)
        if fns["cuStreamWriteValue64_v2"] is not None:
            self._check("cuDeviceGetAttribute(CAN_USE_64_BIT_STREAM_MEM_OPS)", fns["cuDeviceGetAttribute"](
                ctypes.byref(memops), CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev))
        if path == STREAM_WRITE and not memops.value:
            raise GpuDoorbellError(f"CUDA device {dev.value} has no 64-bit stream memory operations")
        self.path = STREAM_WRITE if memops.value and path != STREAM_COPY else STREAM_COPY
        self._ctx = ctx
        self._host = 0      # the page, registered (0: not yet)
        self._dptr = 0      # its device address
        self._scratch = 0   # the copy path's device word
        super().__init__()
        try:
            self._map()
        except BaseException:
            self.close()
            raise
        log.info("kvpushd doorbell %s: GPU doorbell on CUDA device %d, path %s: the stream writes the progress "
                 "word with %s", self.name, self.device, self.path,
                 "cuStreamWriteValue64 (stream memory operations)" if self.path == STREAM_WRITE else
                 "a stream-ordered copy (cuMemsetD32Async + cuMemcpyDtoHAsync; this device or driver has no "
                 "64-bit stream memory operations)")

    def _context(self, torch_sync: bool) -> int:
        """The context current on this thread (torch's primary context once torch used CUDA here)."""
        ctx = c_void_p()
        self._check("cuCtxGetCurrent", self._fns["cuCtxGetCurrent"](ctypes.byref(ctx)))
        if not ctx.value and torch_sync:
            import torch

            torch.cuda.synchronize()  # a runtime call: binds the device's primary context to this thread
            self._check("cuCtxGetCurrent", self._fns["cuCtxGetCurrent"](ctypes.byref(ctx)))
        if not ctx.value:
            raise GpuDoorbellError("no CUDA context is current on this thread: create the GPU doorbell on the "
                                   "engine thread once it uses CUDA (after the KV caches are allocated)")
        return ctx.value

    def _map(self) -> None:
        fns = self._fns
        host = ctypes.addressof(self._word)  # the page's first byte (mmap: page-aligned)
        self._check("cuMemHostRegister(doorbell page)",
                    fns["cuMemHostRegister_v2"](host, SIZE, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE))
        self._host = host
        dptr = c_uint64(0)
        self._check("cuMemHostGetDevicePointer", fns["cuMemHostGetDevicePointer_v2"](ctypes.byref(dptr), host, 0))
        self._dptr = dptr.value
        if self.path == STREAM_COPY:
            scratch = c_uint64(0)
            self._check("cuMemAlloc(8)", fns["cuMemAlloc_v2"](ctypes.byref(scratch), 8))
            self._scratch = scratch.value
        self._write = fns["cuStreamWriteValue64_v2"]
        self._memset = fns["cuMemsetD32Async"]
        self._dtoh = fns["cuMemcpyDtoHAsync_v2"]

    def _ring(self, value: int) -> None:
        """Queue ``value`` into the word on the current stream (lands when the GPU gets there)."""
        if not self._host:
            raise GpuDoorbellError(f"doorbell {self.name} is closed")
        s = self._stream()
        if self.path == STREAM_WRITE:
            self._check("cuStreamWriteValue64", self._write(s, self._dptr, value, CU_STREAM_WRITE_VALUE_DEFAULT))
            return
        self._check("cuMemsetD32Async", self._memset(self._scratch, value & 0xFFFFFFFF, 1, s))
        self._check("cuMemsetD32Async", self._memset(self._scratch + 4, value >> 32, 1, s))
        self._check("cuMemcpyDtoHAsync", self._dtoh(self._host, self._scratch, 8, s))

    def close(self) -> None:
        """Wait for queued rings, unregister the page, free the scratch word, then unmap and remove it.
        Driver errors are logged, not raised: the page is removed in any case."""
        if self._host or self._scratch:
            fns = self._fns
            pushed = not fns["cuCtxPushCurrent_v2"](self._ctx)  # close may run on another thread
            try:
                for rc, what in self._release(fns):
                    if rc:
                        log.warning("kvpushd doorbell %s: %s failed on close: CUDA error %d", self.name, what, rc)
            finally:
                if pushed:
                    fns["cuCtxPopCurrent_v2"](ctypes.byref(c_void_p()))
        super().close()

    def _release(self, fns: dict[str, Any]) -> list[tuple[int, str]]:
        # a ring still queued would write into a page no longer registered: let the GPU get past it first
        out = [(fns["cuCtxSynchronize"](), "cuCtxSynchronize")]
        if self._host:
            out.append((fns["cuMemHostUnregister"](self._host), "cuMemHostUnregister"))
            self._host = self._dptr = 0
        if self._scratch:
            out.append((fns["cuMemFree_v2"](self._scratch), "cuMemFree"))
            self._scratch = 0
        return out


def make_doorbell(kv_on_cuda: bool) -> Doorbell:
    """The doorbell for a worker's KV: rung by the CUDA stream for GPU KV (raises GpuDoorbellError where
    that cannot work: never a host doorbell for GPU KV, whose stores would run ahead of the GPU), by the
    engine thread's stores for host KV."""
    return GpuDoorbell() if kv_on_cuda else Doorbell()
