"""A worker's KV cache as the daemon takes it: engine tensors -> memory handles + regions.

Host KV goes as a sealed memfd, handed over by descriptor; CUDA KV goes by IPC handle, or, vLLM 0.34's
extensible KV cache (CUDA virtual memory), chunk by chunk by descriptor.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..memory import gpu_memory
from ..shm import sealed_memfd
from ..types import KVLayout, MemfdMemory, Memory, Region
from ..vmm import VmmMemory
from .utils import logger

MAX_REGIONS = 4096  # the daemon's limit per worker
# The memfds this connector made (their names show in /proc/<pid>/maps as "/memfd:kvpushd-kv-...").
OWNED_SHM_PREFIX = "kvpushd-kv-"
_owned: dict[str, int] = {}  # memfd name -> its descriptor


def natural_key(name: str) -> list[Any]:
    """"layers.2" before "layers.10", so P and D list regions in the same order."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _shm_location(ptr: int) -> tuple[str, int, int] | None:
    """(path, offset of ptr in the file, bytes mapped from ptr on) of a file mapping."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo_s, hi_s = parts[0].split("-")
            lo, hi = int(lo_s, 16), int(hi_s, 16)
            if lo <= ptr < hi:
                path = parts[5].rstrip("\n") if len(parts) > 5 else ""
                if not path.startswith("/"):
                    return None
                return path, ptr - lo + int(parts[2], 16), hi - ptr
    return None


def _host_memory(storage: Any, what: str, move_to_shm: bool) -> tuple[MemfdMemory, int]:
    """The sealed memfd a host storage lives in, and the storage's offset in it.

    A storage in a memfd this connector made is taken as it is. Any other (private memory, torch's
    ``share_memory_()``, a /dev/shm file, none of which the worker can hand over safely) is moved into
    one (``_move_to_owned_memfd``); private memory only when the operator asked for it.
    """
    loc = _shm_location(storage.data_ptr())
    fd = _owned_memfd(loc[0]) if loc is not None else None
    if fd is None:
        if not (storage.is_shared() or move_to_shm):
            raise RuntimeError(
                f"kvpushd: {what} is in private host memory; the daemon can only reach host KV in shared "
                "memory. Allocate it with tensor.share_memory_(), or set "
                '"kvpushd_host_kv_to_shm": true in kv_connector_extra_config to move it there at start.')
        if not storage.is_shared():
            logger.warning("kvpushd: moving %s (%d bytes) into shared memory", what, storage.nbytes())
        _move_to_owned_memfd(storage)
        loc = _shm_location(storage.data_ptr())
        fd = _owned_memfd(loc[0]) if loc is not None else None
        if fd is None:
            raise RuntimeError(f"kvpushd: {what} is not in the connector's memfd even after moving it")
    assert loc is not None
    path, offset, mapped = loc
    if mapped < storage.nbytes():
        raise RuntimeError(f"kvpushd: {what} spans more than one mapping of {path}")
    return MemfdMemory(fd, os.fstat(fd).st_size), offset


def _owned_memfd(path: str) -> int | None:
    """The descriptor of a memfd this connector made, by its path in /proc/self/maps."""
    m = re.fullmatch(r"/memfd:(.*) \(deleted\)", path)
    return _owned.get(m.group(1)) if m else None


def _move_to_owned_memfd(storage: Any) -> int:
    """Move a host storage, in place, into a new memfd sealed against shrinking and growing.

    One copy; the storage swaps its data pointer, so every tensor and view of it stays valid. The
    daemon gets the descriptor at every attach (kvpushd_client.handover): no name to leave
    behind in /dev/shm, whoever dies first, and nobody can truncate the memory under a WRITE (a
    named object cut while the daemon copied into it killed the daemon with SIGBUS). The memory
    goes with the last descriptor and mapping: this worker's and, until it detaches us, the daemon's.
    """
    n = storage.nbytes()
    name = f"{OWNED_SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    fd = sealed_memfd(name, n)
    try:
        shared = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", True, n)
        shared.copy_(storage)
        storage._swap_data_ptr_(shared)  # `shared` now holds the private memory, freed with it
    except BaseException:
        os.close(fd)
        raise
    _owned[name] = fd
    return fd


def release_owned_shm(names: Iterable[str]) -> None:
    """Close the memfds this process made of these names. Mappings stay valid."""
    for name in [n for n in names if n in _owned]:
        os.close(_owned.pop(name))


def owned_memfd_names(memory: Iterable[Memory | VmmMemory]) -> list[str]:
    """The names of the connector's memfds among ``memory`` (what release_owned_shm takes)."""
    fds = {m.fd for m in memory if isinstance(m, MemfdMemory)}
    return [name for name, fd in _owned.items() if fd in fds]


@dataclass(frozen=True)
class Geometry:
    """What a region says of one block's inside (the daemon splits blocks between TP ranks by it)."""

    block_tokens: int = 0   # 0: not known
    num_heads: int = 0
    layout: KVLayout = KVLayout.HND


UNKNOWN = Geometry()


def _logical_dims(t: torch.Tensor, spec: Any) -> tuple[int | None, int, int] | None:
    """(K/V dim or None, heads dim, tokens dim) of a layer's KV tensor in vLLM's logical shape, or None.

    vLLM 0.32/0.33 hand every attention layer a 4D view [B, H, N, C] (C: K and V packed, RFC #42082)
    whatever its physical order; older backends used [2, B, N, H, D] or [B, 2, N, H, D]. The spec's
    head count and block size must match the dims, or the layout is not guessed.
    """
    heads, bs = getattr(spec, "num_kv_heads", None), getattr(spec, "block_size", None)
    if not heads or not bs:
        return None
    shape = tuple(t.shape)
    if t.dim() == 4 and shape[1] == heads and shape[2] == bs:
        return None, 1, 2
    if t.dim() == 5 and 2 in (shape[0], shape[1]) and shape[2] == bs and shape[3] == heads:
        return (0 if shape[0] == 2 else 1), 3, 2
    return None


def _block_regions(t: torch.Tensor, num_blocks: int, what: str, spec: Any = None,
                   ) -> list[tuple[int, int, int, int, Geometry]]:
    """(byte offset from t's first element, num_blocks, block_len, block_stride, geometry) per region of t.

    The block dimension is dim 0 (vLLM 0.33.0: per layer [B, H, N, C] with K and V packed in C, or the
    "joined" [B, 2, ...]), dim 1 for the K/V split [2, B, ...], or dim 0 holding kernel blocks
    (num_blocks * r). Within one block, the densest dims (by stride) whose bytes abut form one
    descriptor (block_len); every index of the remaining dims (K/V of the split layout, heads of a
    head-outer layout) is one more region. With the layer's KV cache spec the block's inside is
    read from the strides: heads before tokens (HND) or tokens first (NHD); K and V then stay
    separate regions, so that a block holds [heads, tokens, head bytes] in one order or the other.
    """
    shape, strides = list(t.shape), list(t.stride())
    dims = _logical_dims(t, spec) if spec is not None else None
    if t.dim() >= 1 and shape[0] == num_blocks and (dims is None or dims[0] != 0):
        bd = 0
    elif t.dim() >= 2 and shape[1] == num_blocks:
        bd = 1
    elif t.dim() >= 1 and num_blocks > 0 and shape[0] % num_blocks == 0:
        ratio = shape[0] // num_blocks
        shape = [num_blocks, ratio, *shape[1:]]
        strides = [strides[0] * ratio, *strides]
        bd = 0
        dims = None  # a block of several kernel blocks: not [heads, tokens, head bytes]
    else:
        raise RuntimeError(f"kvpushd: {what} of shape {tuple(t.shape)} has no dimension of {num_blocks} blocks")
    es = t.element_size()
    keep_outer = {dims[0]} if dims is not None and dims[0] is not None else set()
    inner = sorted((d for d in range(len(shape)) if d != bd and shape[d] > 1), key=lambda d: strides[d])
    dense = 1
    n_dense = 0
    for d in inner:
        if strides[d] != dense or d in keep_outer:
            break
        dense *= shape[d]
        n_dense += 1
    outer = sorted(inner[n_dense:])
    block_len, block_stride = dense * es, strides[bd] * es
    if block_stride < block_len:
        raise RuntimeError(f"kvpushd: {what}: blocks overlap (stride {block_stride} < length {block_len} bytes)")
    n_outer = 1
    for d in outer:
        n_outer *= shape[d]
    if n_outer > MAX_REGIONS:
        raise RuntimeError(f"kvpushd: {what} would need {n_outer} regions per layer (layout too fragmented)")
    geo = _geometry(shape, strides, set(inner[:n_dense]), dims)
    out = []
    for idx in itertools.product(*(range(shape[d]) for d in outer)):
        off = sum(i * strides[d] * es for i, d in zip(idx, outer, strict=True))
        out.append((off, shape[bd], block_len, block_stride, geo))
    return out


def _geometry(shape: list[int], strides: list[int], dense: set[int],
              dims: tuple[int | None, int, int] | None) -> Geometry:
    """HND or NHD, heads and tokens of one region's block, from the dims the block is made of."""
    if dims is None:
        return UNKNOWN
    _, hd, nd = dims
    heads, tokens = shape[hd], shape[nd]
    if tokens > 1 and nd not in dense:
        return UNKNOWN  # tokens split over regions: no layout the daemon knows
    rest = [d for d in dense if d not in (hd, nd)]
    if rest and tokens > 1 and max(strides[d] for d in rest) > strides[nd]:
        return UNKNOWN  # something (K/V) between the tokens and the head bytes
    if heads == 1 or hd not in dense:
        return Geometry(tokens, 1, KVLayout.HND)  # one head per region (or per rank)
    if rest and max(strides[d] for d in rest) > strides[hd]:
        return UNKNOWN
    layout = KVLayout.HND if strides[hd] > strides[nd] or tokens == 1 else KVLayout.NHD
    return Geometry(tokens, heads, layout)


def layer_specs(kv_cache_config: Any) -> dict[str, Any]:
    """Layer name -> its KV cache spec (each group's, or the per-layer one of a uniform-type group)."""
    out: dict[str, Any] = {}
    for g in kv_cache_config.kv_cache_groups:
        per_layer = getattr(g.kv_cache_spec, "kv_cache_specs", None)
        for name in g.layer_names:
            out[name] = per_layer[name] if isinstance(per_layer, dict) and name in per_layer else g.kv_cache_spec
    return out


def describe_kv_caches(kv_caches: dict[str, Any], num_blocks: int, host_kv_to_shm: bool = False,
                       specs: dict[str, Any] | None = None, exports_fd: bool = False,
                       ) -> tuple[list[Memory | VmmMemory], list[Region], list[list[str]]]:
    """Memory handles (one per backing allocation) and regions (per layer, and once for layers that
    view the same bytes alike) of a worker's KV cache, and per region the layers whose KV it holds
    (several where layers view one allocation alike): a region is complete in a step once all of them
    wrote it (progress.py). ``specs`` (layer name -> KV cache spec) let the regions say their layout,
    heads and block size in tokens. ``exports_fd``: CUDA virtual memory goes by file descriptor (vLLM
    0.34 under ``EXPORTS_FD``)."""
    memory: list[Memory | VmmMemory] = []
    index: dict[Any, int] = {}
    regions: list[Region] = []
    owners: list[list[str]] = []
    seen: dict[tuple[int, int, int, int, int], tuple[Geometry, str, int]] = {}
    for name in sorted(kv_caches, key=natural_key):
        t = kv_caches[name]
        what = f"KV cache of layer {name!r}"
        if not isinstance(t, torch.Tensor):
            raise NotImplementedError(f"kvpushd: {what} is a {type(t).__name__}, not one tensor "
                                      "(state-space / hybrid caches are not supported)")
        storage = t.untyped_storage()
        mem: MemfdMemory | None = None
        if t.is_cuda:
            key: Any = ("cuda", t.device.index, storage.data_ptr())
            base = 0  # the daemon opens the storage itself: offsets count from its first byte
        elif t.device.type == "cpu":
            mem, base = _host_memory(storage, what, host_kv_to_shm)
            key = ("memfd", mem.fd)
        else:
            raise NotImplementedError(f"kvpushd: {what} is on {t.device}; only CUDA and host KV are supported")
        if key not in index:  # CUDA: one handle per allocation, made once
            index[key] = len(memory)
            memory.append(gpu_memory(t, exports_fd) if mem is None else mem)
        mi = index[key]
        first = base + int(t.storage_offset()) * t.element_size()
        for off, nb, blen, bstride, geo in _block_regions(t, num_blocks, what, (specs or {}).get(name)):
            r = (mi, first + off, nb, blen, bstride)
            if r in seen:  # layers sharing one allocation (hybrid groups, KV sharing) transfer it once
                if seen[r][0] != geo:
                    raise NotImplementedError(
                        f"kvpushd: layers {seen[r][1]!r} and {name!r} view the same KV memory with different "
                        f"block layouts ({seen[r][0]} vs {geo}); such a model is not supported")
                owners[seen[r][2]].append(name)
                continue
            seen[r] = (geo, name, len(regions))
            owners.append([name])
            regions.append(Region(mi, first + off, nb, blen, bstride, block_size_tokens=geo.block_tokens,
                                  layout=geo.layout, num_heads=geo.num_heads))
    if not regions:
        raise RuntimeError("kvpushd: no KV cache tensors to register")
    if len(regions) > MAX_REGIONS:
        raise RuntimeError(f"kvpushd: {len(regions)} KV regions; the daemon takes at most {MAX_REGIONS}")
    return memory, regions, owners
