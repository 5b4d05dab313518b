"""A worker's KV cache as the daemon takes it: engine tensors -> memory handles + regions.

Host KV must live in named POSIX shared memory the daemon can open; CUDA KV goes by IPC handle.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import itertools
import os
import re
import secrets
from collections.abc import Iterable
from typing import Any

import torch

from ..memory import cuda_memory
from ..types import Memory, Region, ShmMemory
from .utils import logger

MAX_REGIONS = 4096  # the daemon's limit per worker
# Shared memory this connector made: the daemon removes such a name once no process holds its lock.
OWNED_SHM_PREFIX = "kvpushd-kv-"
_owned: dict[str, int] = {}  # name -> the open fd whose shared flock says "this process still uses it"


def _natural_key(name: str) -> list[Any]:
    """"layers.2" before "layers.10", so P and D list regions in the same order."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _shm_location(ptr: int) -> tuple[str, int, int, int] | None:
    """(path, offset of ptr in the file, bytes mapped from ptr on, file size) of a file mapping."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo_s, hi_s = parts[0].split("-")
            lo, hi = int(lo_s, 16), int(hi_s, 16)
            if lo <= ptr < hi:
                path = parts[5].rstrip("\n") if len(parts) > 5 else ""
                if not path.startswith("/"):
                    return None
                size = os.stat(path).st_size if not path.endswith(" (deleted)") else 0
                return path, ptr - lo + int(parts[2], 16), hi - ptr, size
    return None


def _host_memory(storage: Any, what: str, move_to_shm: bool) -> tuple[ShmMemory, int]:
    """The named /dev/shm object a host storage lives in, and the storage's offset in it.

    A storage already in a named /dev/shm file (made by the engine) is taken as it is. Otherwise
    (private memory, or torch's ``share_memory_()``, which maps an already unlinked file the daemon
    cannot open by name) it is moved into one this connector makes (``_move_to_owned_shm``); private
    memory only when the operator asked for it.
    """
    loc = _shm_location(storage.data_ptr())
    named = loc is not None and loc[0].startswith("/dev/shm/") and not loc[0].endswith(" (deleted)")
    if not named:
        if not (storage.is_shared() or move_to_shm):
            raise RuntimeError(
                f"kvpushd: {what} is in private host memory; the daemon can only reach host KV in POSIX "
                "shared memory. Allocate it with tensor.share_memory_(), or set "
                '"kvpushd_host_kv_to_shm": true in kv_connector_extra_config to move it there at start.')
        if not storage.is_shared():
            logger.warning("kvpushd: moving %s (%d bytes) into POSIX shared memory", what, storage.nbytes())
        _move_to_owned_shm(storage)
        loc = _shm_location(storage.data_ptr())
        if loc is None or not loc[0].startswith("/dev/shm/") or loc[0].endswith(" (deleted)"):
            raise RuntimeError(f"kvpushd: {what} is not in a named /dev/shm object even after moving it")
    assert loc is not None
    path, offset, mapped, size = loc
    if mapped < storage.nbytes():
        raise RuntimeError(f"kvpushd: {what} spans more than one mapping of {path}")
    return ShmMemory(path[len("/dev/shm/"):], size), offset


def _move_to_owned_shm(storage: Any) -> str:
    """Move a host storage, in place, into /dev/shm/kvpushd-kv-<pid>-<hex>, held by a shared flock.

    One copy; the storage swaps its data pointer, so every tensor and view of it stays valid. Not
    torch's ``_share_filename_cpu_``: nobody unlinks its /dev/shm/torch_* file when the worker is
    SIGKILLed (vLLM's default shutdown) and its torch_shm_manager dies with it, so the whole KV cache
    would stay behind. The lock lives exactly as long as some process holds this open file (the
    worker; in any pid namespace): the daemon removes a kvpushd-kv-* name on detach, or at its start,
    once it can take the lock exclusively, so the name outlives a daemon restart (a live worker
    re-attaches by it) but not the worker. A clean exit removes it here (``release_owned_shm``).
    """
    import torch

    n = storage.nbytes()
    for _ in range(8):
        name = f"{OWNED_SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        path = f"/dev/shm/{name}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o660)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            # A daemon's sweep may have taken the name between open and lock: then make another.
            if os.fstat(fd).st_nlink == 0 or os.stat(path).st_ino != os.fstat(fd).st_ino:
                os.close(fd)
                continue
            os.ftruncate(fd, n)
            shared = torch.UntypedStorage.from_file(path, True, n)
            shared.copy_(storage)
            storage._swap_data_ptr_(shared)  # `shared` now holds the private memory, freed with it
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        if not _owned:
            atexit.register(release_owned_shm)
        _owned[name] = fd
        return path
    raise RuntimeError("kvpushd: could not create a shared memory object for the KV cache")


def release_owned_shm(names: Iterable[str] | None = None) -> None:
    """Unlink shared memory this process made (these names; None: all of them, at exit). Mappings stay valid."""
    for name in list(_owned) if names is None else [n for n in names if n in _owned]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")
        os.close(_owned.pop(name))


def _block_regions(t: torch.Tensor, num_blocks: int, what: str) -> list[tuple[int, int, int, int]]:
    """(byte offset from t's first element, num_blocks, block_len, block_stride) for each region of t.

    The block dimension is dim 0 (vLLM 0.33.0: per layer [B, H, N, C] with K and V packed in C, or the
    "joined" [B, 2, ...]), dim 1 for the K/V split [2, B, ...], or dim 0 holding kernel blocks
    (num_blocks * r). Within one block, the densest dims (by stride) whose bytes abut form one
    descriptor (block_len); every index of the remaining dims (K/V of the split layout, heads of a
    head-outer layout) is one more region.
    """
    shape, strides = list(t.shape), list(t.stride())
    if t.dim() >= 1 and shape[0] == num_blocks:
        bd = 0
    elif t.dim() >= 2 and shape[1] == num_blocks:
        bd = 1
    elif t.dim() >= 1 and num_blocks > 0 and shape[0] % num_blocks == 0:
        ratio = shape[0] // num_blocks
        shape = [num_blocks, ratio, *shape[1:]]
        strides = [strides[0] * ratio, *strides]
        bd = 0
    else:
        raise RuntimeError(f"kvpushd: {what} of shape {tuple(t.shape)} has no dimension of {num_blocks} blocks")
    es = t.element_size()
    inner = sorted((d for d in range(len(shape)) if d != bd and shape[d] > 1), key=lambda d: strides[d])
    dense = 1
    n_dense = 0
    for d in inner:
        if strides[d] != dense:
            break
        dense *= shape[d]
        n_dense += 1
    outer = inner[n_dense:]
    block_len, block_stride = dense * es, strides[bd] * es
    if block_stride < block_len:
        raise RuntimeError(f"kvpushd: {what}: blocks overlap (stride {block_stride} < length {block_len} bytes)")
    n_outer = 1
    for d in outer:
        n_outer *= shape[d]
    if n_outer > MAX_REGIONS:
        raise RuntimeError(f"kvpushd: {what} would need {n_outer} regions per layer (layout too fragmented)")
    out = []
    for idx in itertools.product(*(range(shape[d]) for d in sorted(outer))):
        off = sum(i * strides[d] * es for i, d in zip(idx, sorted(outer), strict=True))
        out.append((off, shape[bd], block_len, block_stride))
    return out


def describe_kv_caches(kv_caches: dict[str, Any], num_blocks: int, host_kv_to_shm: bool = False,
                       ) -> tuple[list[Memory], list[Region]]:
    """Memory handles (one per backing allocation) and regions (per layer) of a worker's KV cache."""
    memory: list[Memory] = []
    index: dict[Any, int] = {}
    regions: list[Region] = []
    seen: set[tuple[int, int, int, int, int]] = set()
    for name in sorted(kv_caches, key=_natural_key):
        t = kv_caches[name]
        what = f"KV cache of layer {name!r}"
        if not isinstance(t, torch.Tensor):
            raise NotImplementedError(f"kvpushd: {what} is a {type(t).__name__}, not one tensor "
                                      "(state-space / hybrid caches are not supported)")
        storage = t.untyped_storage()
        if t.is_cuda:
            key: Any = ("cuda", t.device.index, storage.data_ptr())
            if key not in index:
                index[key] = len(memory)
                memory.append(cuda_memory(t))
            base = 0  # the daemon opens the storage itself: offsets count from its first byte
        elif t.device.type == "cpu":
            mem, base = _host_memory(storage, what, host_kv_to_shm)
            key = ("shm", mem.name)
            if key not in index:
                index[key] = len(memory)
                memory.append(mem)
        else:
            raise NotImplementedError(f"kvpushd: {what} is on {t.device}; only CUDA and host KV are supported")
        mi = index[key]
        first = base + int(t.storage_offset()) * t.element_size()
        for off, nb, blen, bstride in _block_regions(t, num_blocks, what):
            r = (mi, first + off, nb, blen, bstride)
            if r not in seen:  # layers sharing one cache (KV sharing) transfer once
                seen.add(r)
                regions.append(Region(mi, first + off, nb, blen, bstride))
    if not regions:
        raise RuntimeError("kvpushd: no KV cache tensors to register")
    if len(regions) > MAX_REGIONS:
        raise RuntimeError(f"kvpushd: {len(regions)} KV regions; the daemon takes at most {MAX_REGIONS}")
    return memory, regions
