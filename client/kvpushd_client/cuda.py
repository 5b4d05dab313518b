"""CUDA memory as engines allocate it: which allocations a CUDA IPC handle can share, and why not.

Three allocators put vLLM's GPU KV in three kinds of memory:

* PyTorch's caching allocator (the default): cudaMalloc segments. CUDA IPC shares them; the daemon opens
  the handle (kvpushd/memory/cuda.py).
* PyTorch's expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``): CUDA virtual memory
  whose pages the allocator maps and unmaps as it grows and shrinks, so a NIXL registration can end up on
  pages that moved. Refused, naming the setting (vLLM refuses a KV connector with it too).
* vLLM's cumem allocator (``--enable-sleep-mode`` or ``--enable-cumem-allocator``): ``cuMemCreate``
  allocations. ``cudaIpcGetMemHandle`` does not apply to them, and they cannot be exported as POSIX file
  descriptors either: vLLM creates them with no shareable handle type (``requestedHandleTypes`` is left
  at NONE, so ``cuMemExportToShareableHandle`` refuses), and sleep mode releases and re-creates their
  pages, which would leave the daemon's registration on freed memory. Refused, naming the vLLM options.

The decision is :func:`check_shareable`, plain logic over what the driver and torch said, so it is tested
without a GPU. The driver is asked through ctypes (libcuda), nothing to install.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
from dataclasses import dataclass
from typing import Any

# CUpointer_attribute (cuda.h)
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12
CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES = 14
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1

# torch's shareable handle (c10/cuda/CUDACachingAllocator.cpp): a version byte, then the kind
TORCH_HANDLE_CUDA_MALLOC = ord("c")
TORCH_HANDLE_EXPANDABLE_SEGMENT = ord("e")
CUDA_IPC_HANDLE_SIZE = 64

SENTINEL_BYTES = 16

EXPANDABLE_MESSAGE = (
    "this CUDA KV tensor lives in a PyTorch expandable segment (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF "
    "has expandable_segments:True): the allocator maps and unmaps its pages as it grows, so the daemon's NIXL "
    "registration could end up on pages that moved. Unset expandable_segments (or set "
    "expandable_segments:False) for the engine process; vLLM refuses a KV connector with it as well.")
VMM_MESSAGE = (
    "this CUDA KV tensor lives in CUDA virtual memory (cuMemCreate), as vLLM's cumem allocator makes it "
    "(--enable-sleep-mode, or --enable-cumem-allocator): CUDA IPC handles cannot share it, and vLLM creates "
    "it with no shareable handle type, so it cannot be exported as a file descriptor either (sleep mode "
    "also releases and re-creates its pages under the daemon's registration). Start vLLM without "
    "--enable-sleep-mode and --enable-cumem-allocator to hand GPU KV to kvpushd.")


class CudaMemoryError(ValueError):
    """KV memory a CUDA IPC handle cannot share; the message says which setting to change."""


def alloc_conf_expandable(env: dict[str, str] | None = None) -> bool:
    """Whether the process's PyTorch allocator settings turn expandable segments on."""
    env = dict(os.environ) if env is None else env
    for key in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        for item in env.get(key, "").split(","):
            k, _, v = item.partition(":")
            if k.strip() == "expandable_segments" and v.strip().lower() == "true":
                return True
    return False


def handle_kind(ipc_handle: bytes) -> str:
    """What torch's ``_share_cuda_()`` handle shares: cuda_malloc, expandable_segment, legacy or unknown."""
    if len(ipc_handle) == CUDA_IPC_HANDLE_SIZE:
        return "legacy"  # a bare cudaIpcMemHandle_t (torch before the versioned format)
    if len(ipc_handle) >= 2:
        if ipc_handle[1] == TORCH_HANDLE_CUDA_MALLOC and len(ipc_handle) == 2 + CUDA_IPC_HANDLE_SIZE:
            return "cuda_malloc"
        if ipc_handle[1] == TORCH_HANDLE_EXPANDABLE_SEGMENT:
            return "expandable_segment"
    return "unknown"


def check_shareable(legacy_ipc_capable: bool | None, kind: str | None, share_error: str | None = None,
                    expandable_env: bool = False) -> None:
    """Raise CudaMemoryError unless the memory can travel as a CUDA IPC handle.

    ``legacy_ipc_capable``: the driver's CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE (None: not asked);
    ``kind``: :func:`handle_kind` of the handle torch made (None: torch raised ``share_error``)."""
    if kind == "expandable_segment":
        raise CudaMemoryError(EXPANDABLE_MESSAGE)
    if legacy_ipc_capable is False or kind is None:
        if expandable_env and kind is not None:
            raise CudaMemoryError(EXPANDABLE_MESSAGE)
        why = f" (torch: {share_error})" if share_error else ""
        also = (" PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True as well: unset it too, or the tensor "
                "lands in an expandable segment, which kvpushd refuses too.") if expandable_env else ""
        raise CudaMemoryError(VMM_MESSAGE + why + also)
    if kind == "unknown":
        raise CudaMemoryError("torch made a CUDA IPC handle of a format kvpushd does not know; "
                              "use a torch release with the versioned handle ('c' or 'e' after the version byte)")


@dataclass(frozen=True, slots=True)
class PointerInfo:
    device_ordinal: int             # -1: the driver did not say
    legacy_ipc_capable: bool | None  # None: the driver did not say
    range_start: int
    range_size: int                 # 0: the driver did not say


def load_libcuda(error: type[Exception] = OSError, who: str = "kvpushd", then: str = "") -> ctypes.CDLL:
    """libcuda.so.1, or ``error`` saying that ``who`` needs it, why it did not load, and ``then`` (what to do)."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise error(f"{who} needs the CUDA driver (libcuda.so.1), which cannot be loaded here ({e}){then}") from None


class CudaCalls:
    """What the ctypes wrappers of libcuda (``lib``) share: ``_check`` raises the wrapper's own ``error``
    for a CUresult other than CUDA_SUCCESS, named as the driver names it."""

    error: type[Exception] = OSError
    lib: Any

    def _check(self, what: str, rc: int) -> None:
        if rc:
            name = ctypes.c_char_p()
            with contextlib.suppress(Exception):  # a stand-in lib may not have it: the number still says
                self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise self.error(f"{what} failed: {(name.value or b'?').decode(errors='replace')} ({rc})")

    def device_uuid(self, ordinal: int) -> str:
        """The UUID of the GPU with this ordinal, spelled as nvidia-smi and torch spell it."""
        dev, raw = ctypes.c_int(), (ctypes.c_ubyte * 16)()
        self._check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(dev), ordinal))
        self._check("cuDeviceGetUuid", self.lib.cuDeviceGetUuid(raw, dev))
        h = bytes(raw).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class Driver(CudaCalls):
    """The few CUDA driver calls kvpushd needs, through ctypes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._check("cuInit", lib.cuInit(0))

    def attribute(self, ptr: int, attr: int, ctype: type[ctypes._SimpleCData] = ctypes.c_uint64) -> int:  # type: ignore[type-arg]
        v = ctype(0)
        self._check(f"cuPointerGetAttribute({attr})",
                    self.lib.cuPointerGetAttribute(ctypes.byref(v), attr, ctypes.c_uint64(ptr)))
        return int(v.value)

    def _maybe(self, ptr: int, attr: int, ctype: type[ctypes._SimpleCData], default: int) -> int:  # type: ignore[type-arg]
        try:
            return self.attribute(ptr, attr, ctype)
        except OSError:
            return default

    def pointer(self, ptr: int) -> PointerInfo:
        """What the driver knows of a device pointer (needs a current context on its device)."""
        legacy = self._maybe(ptr, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ctypes.c_int, -1)
        return PointerInfo(
            device_ordinal=self._maybe(ptr, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ctypes.c_int, -1),
            legacy_ipc_capable=None if legacy < 0 else bool(legacy),
            range_start=self._maybe(ptr, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ctypes.c_uint64, 0),
            range_size=self._maybe(ptr, CU_POINTER_ATTRIBUTE_RANGE_SIZE, ctypes.c_uint64, 0))


@functools.cache
def driver() -> Driver | None:
    """libcuda through ctypes, or None where there is none (no GPU driver on this machine)."""
    try:
        return Driver(load_libcuda())
    except OSError:
        return None


def uuid_hex(uuid: str) -> str:
    """A GPU UUID in one spelling: lower-case hex digits, no 'GPU-' prefix and no dashes."""
    u = uuid.strip().lower()
    u = u[4:] if u.startswith("gpu-") else u
    return re.sub(r"[^0-9a-f]", "", u)
