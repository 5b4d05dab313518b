"""vLLM 0.33.0 KV connector (push mode) whose transfers run in the kvpushd daemon of each node.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVPushdConnector",
                           "kv_connector_module_path": "kvpushd_client.vllm_connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvpushd_socket": "/run/kvpushd/worker.sock"}}'

It is a drop-in for vLLM's ``NixlPushConnector``: the same proxy
(``disagg_proxy_pushconnector_demo.py``), the same request flow and the same ``kv_transfer_params``
(``do_remote_prefill``, ``do_remote_decode``, ``remote_engine_id``, ``remote_host``, ``remote_port``,
``tp_size``, ``pp_size``, ``remote_request_id``; prefill answers with ``transfer_mode="push"``). Only
``remote_host``/``remote_port`` now name the prefill node's *daemon* (its peer API, e.g. port 7700)
instead of the NIXL side channel.

Transfer ids: vLLM 0.33.0 has no ``transfer_id`` parameter. The proxy sends one ``X-Request-Id`` to
both engines and each engine appends ``-<8 hex>`` (``InputProcessor.assign_request_id``), so both sides
use the request id with that suffix stripped -- the same rule ``NixlPushConnector`` matches by
(``get_base_request_id``). A ``transfer_id`` in ``kv_transfer_params`` wins when a router sets one.

Division of work: the scheduler side (engine core process) decides what to expect, publish and abort
and ships it to the workers in the connector metadata. Each worker hands the daemon its KV memory
once (``register_kv_caches``), then per request only block ids. Daemon calls run on a background
thread: the engine thread only queues them and reads completions the session stream already
delivered, so a step never waits on a gRPC call, let alone on a transfer.

This module imports vLLM; nothing else in ``kvpushd_client`` imports this module.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import itertools
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from .client import KVPushClient, Worker
from .memory import cuda_memory
from .types import Completion, CompletionKind, DaemonUnavailable, KVPushError, Memory, Region, Role, ShmMemory

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under "vllm." so vLLM's handlers and VLLM_LOGGING_LEVEL apply.
logger = init_logger("vllm.kvpushd_connector")

DEFAULT_SOCKET = "/run/kvpushd/worker.sock"
_RANDOM_SUFFIX_RE = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)
_MAX_REGIONS = 4096  # the daemon's limit per worker
# Call outcomes that do not say whether the daemon acted on the call.
_UNSURE = frozenset({"DEADLINE_EXCEEDED", "UNKNOWN", "INTERNAL"})


# ------------------------------------------------------------------------------------------------
# Pure helpers


def base_request_id(request_id: str) -> str:
    """The request id without vLLM's per-engine ``-<8 hex>`` suffix (what P and D share)."""
    return _RANDOM_SUFFIX_RE.sub("", request_id)


def transfer_id_for(request_id: str, params: dict[str, Any] | None) -> str:
    """The transfer id both nodes derive for one request (see the module docstring)."""
    explicit = (params or {}).get("transfer_id")
    return str(explicit) if explicit else base_request_id(request_id)


def daemon_engine_id(engine_id: str) -> str:
    """vLLM engine ids as the daemon accepts them (it forbids '.')."""
    return engine_id.replace(".", "_")


def producer_address(params: dict[str, Any]) -> str:
    host, port = str(params["remote_host"]), int(params["remote_port"])
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def remote_params_problem(params: dict[str, Any]) -> str | None:
    """Why a decode request's kv_transfer_params cannot drive a push, or None."""
    missing = [k for k in ("remote_engine_id", "remote_host", "remote_port") if params.get(k) in (None, "")]
    if missing:
        return f"kv_transfer_params lack {', '.join(missing)}"
    try:
        port = int(params["remote_port"])
        tp = int(params.get("tp_size") or 1)
        pp = int(params.get("pp_size") or 1)
    except (TypeError, ValueError):
        return "remote_port, tp_size and pp_size must be integers"
    if not 0 < port < 65536:
        return f"remote_port {port} is not a port"
    if tp < 1:
        return f"tp_size {tp} must be positive"
    if pp != 1:
        return f"the prefill engine runs pp_size={pp}; kvpushd pushes from pp_size=1 engines only"
    return None


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config`` keys, validated once."""

    socket: str = DEFAULT_SOCKET
    connect_timeout_s: float = 30.0   # register_kv_caches waits this long for the daemon
    rpc_timeout_s: float = 10.0
    reconnect_interval_s: float = 0.5
    host_kv_to_shm: bool = False      # move private host KV into POSIX shm at start (one copy)
    peer_address: str | None = None   # what prefill advertises as remote_host:remote_port

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> Settings:
        def num(key: str, default: float) -> float:
            v = float(extra.get(key, default))
            if v <= 0:
                raise ValueError(f"kv_connector_extra_config.{key} must be positive, got {v}")
            return v

        peer = extra.get("kvpushd_peer_address")
        if peer is not None:
            split_host_port(str(peer))
        return cls(
            socket=str(extra.get("kvpushd_socket") or os.environ.get("KVPUSHD_SOCKET") or DEFAULT_SOCKET),
            connect_timeout_s=num("kvpushd_connect_timeout_s", cls.connect_timeout_s),
            rpc_timeout_s=num("kvpushd_rpc_timeout_s", cls.rpc_timeout_s),
            reconnect_interval_s=num("kvpushd_reconnect_interval_s", cls.reconnect_interval_s),
            host_kv_to_shm=bool(extra.get("kvpushd_host_kv_to_shm", False)),
            peer_address=str(peer) if peer is not None else None,
        )


# ------------------------------------------------------------------------------------------------
def transfer_mode_of(params: dict[str, Any]) -> str:
    """kv_transfer_params["transfer_mode"]: "push" (default) or "pull"; anything else is pushed."""
    mode = str(params.get("transfer_mode") or "push").lower()
    if mode not in ("push", "pull"):
        logger.warning("kvpushd: unknown transfer_mode %r; using push", mode)
        return "push"
    return mode


# Scheduler -> worker metadata (plain data: it is pickled to the workers)


@dataclass(frozen=True)
class ExpectReq:
    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    producer_address: str
    producer_engine_id: str
    producer_tp_size: int
    transfer_mode: str = "push"


@dataclass(frozen=True)
class PublishReq:
    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class AbortReq:
    req_id: str
    transfer_id: str


@dataclass
class KVPushdConnectorMetadata(KVConnectorMetadata):
    """One step's work for every worker: processed in the order expects, publishes, aborts."""

    expects: list[ExpectReq] = field(default_factory=list)
    publishes: list[PublishReq] = field(default_factory=list)
    aborts: list[AbortReq] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------
# KV layout: engine tensors -> memory handles + regions


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

    torch's ``share_memory_()`` (file_descriptor strategy, Linux default) maps an already unlinked
    /dev/shm file the daemon cannot open by name; ``_share_filename_cpu_()`` moves the storage into a
    named one (file_system strategy: /dev/shm/torch_<pid>_..., data after a 64-byte refcount header),
    keeping every view valid. Private memory is moved only when the operator asked for it.
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
        storage._share_filename_cpu_()
        loc = _shm_location(storage.data_ptr())
        if loc is None or not loc[0].startswith("/dev/shm/") or loc[0].endswith(" (deleted)"):
            raise RuntimeError(f"kvpushd: {what} is not in a named /dev/shm object even after sharing it")
    assert loc is not None
    path, offset, mapped, size = loc
    if mapped < storage.nbytes():
        raise RuntimeError(f"kvpushd: {what} spans more than one mapping of {path}")
    return ShmMemory(path[len("/dev/shm/"):], size), offset


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
    if n_outer > _MAX_REGIONS:
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
    if len(regions) > _MAX_REGIONS:
        raise RuntimeError(f"kvpushd: {len(regions)} KV regions; the daemon takes at most {_MAX_REGIONS}")
    return memory, regions


# ------------------------------------------------------------------------------------------------
# Scheduler side


class _SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, engine_id: str, settings: Settings) -> None:
        pc = vllm_config.parallel_config
        self.engine_id = engine_id
        self.settings = settings
        self.tp_size = pc.tensor_parallel_size
        self.pp_size = pc.pipeline_parallel_size
        self.dcp_size = getattr(pc, "decode_context_parallel_size", 1)
        self._expects: list[ExpectReq] = []
        self._publishes: list[PublishReq] = []
        self._aborts: list[AbortReq] = []
        self._recving: dict[str, str] = {}  # decode: req id -> transfer id, until finished_recving
        self._sending: dict[str, str] = {}  # prefill: req id -> transfer id, until finished_sending
        self._peer: tuple[str, int] | None = split_host_port(settings.peer_address) if settings.peer_address \
            else None
        self._peer_next_try = 0.0

    # decode side ---------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        problem = remote_params_problem(params)
        if problem is not None:
            logger.error("kvpushd: request %s asks for a remote prefill but %s; prefilling it here instead",
                         request.request_id, problem)
            params["do_remote_prefill"] = False
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return  # also the second call, after the KV arrived: the flag is cleared below
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return
        groups = blocks.get_unhashed_block_ids_all_groups()
        block_ids = tuple(groups[0]) if groups else ()  # empty: the worker reports it done at once
        tid = transfer_id_for(request.request_id, params)
        self._expects.append(ExpectReq(
            request.request_id, tid, block_ids, producer_address(params),
            daemon_engine_id(str(params["remote_engine_id"])), int(params.get("tp_size") or 1),
            transfer_mode_of(params)))
        self._recving[request.request_id] = tid

    # both sides ----------------------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        tid = self._recving.get(rid)
        if tid is not None:
            # Decode request finished (aborted) before its KV arrived. vLLM keeps its blocks until
            # the workers report finished_recving; they abort the transfer on both nodes first.
            self._aborts.append(AbortReq(rid, tid))
            return False, None
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted or failed prefill: nothing to push; decode times out
        blocks = tuple(block_ids)
        if blocks:
            tid = transfer_id_for(rid, params)
            self._publishes.append(PublishReq(rid, tid, blocks))
            self._sending[rid] = tid
        host, port = self._advertised_address()
        return bool(blocks), {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(blocks),
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": host,
            "remote_port": port,
            "tp_size": self.tp_size,
            "dcp_size": self.dcp_size,
            "pp_size": self.pp_size,
            "remote_num_tokens": request.num_computed_tokens,
            "transfer_mode": transfer_mode_of(params),
            "transfer_id": transfer_id_for(rid, params),
        }

    def _advertised_address(self) -> tuple[str | None, int | None]:
        """This node's daemon peer address (asked once; what decode uses as remote_host/port)."""
        if self._peer is None and time.monotonic() >= self._peer_next_try:
            try:
                with KVPushClient(self.settings.socket, timeout_s=1.0) as c:
                    self._peer = split_host_port(c.status().peer_address)
            except (KVPushError, ValueError) as e:
                self._peer_next_try = time.monotonic() + 30.0
                logger.error("kvpushd: cannot ask the daemon at %s for its peer address (%s); prefill "
                             "responses carry no remote_host/remote_port", self.settings.socket, e)
        return self._peer if self._peer is not None else (None, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPushdConnectorMetadata:
        meta = KVPushdConnectorMetadata(self._expects, self._publishes, self._aborts)
        self._expects, self._publishes, self._aborts = [], [], []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for rid in connector_output.finished_sending or ():
            self._sending.pop(rid, None)
        for rid in connector_output.finished_recving or ():
            self._recving.pop(rid, None)

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while blocks wait to be pushed (their free comes from a worker)."""
        return bool(self._sending or self._expects or self._publishes or self._aborts)


# ------------------------------------------------------------------------------------------------
# Worker side: the daemon link (a background thread makes every call)


class _OpState(enum.Enum):
    QUEUED = 0
    STARTED = 1
    CANCELLED = 2


@dataclass(eq=False)
class _Op:
    kind: str  # "expect", "publish", "abort"
    pending: _Pending
    state: _OpState = _OpState.QUEUED
    epoch: int | None = None         # the attachment it ran on
    target_epoch: int | None = None  # abort: only on the attachment its expect ran on


@dataclass(eq=False)
class _Pending:
    """One request's transfer on this worker, from metadata to its one report."""

    recv: bool
    req: ExpectReq | PublishReq
    op: _Op | None = None
    aborted: bool = False
    done: bool = False


class _DaemonLink:
    """The attachment to the local daemon, re-made after a daemon restart.

    The engine thread calls ``submit``/``cancel``/``poll`` (no RPC, a lock and a queue); the thread
    makes the calls and re-attaches. Every attachment is an epoch: when one is lost, what ran on it is
    failed by the engine thread, what is still queued goes to the next one.
    """

    def __init__(self, settings: Settings, attach: dict[str, Any]) -> None:
        self.settings = settings
        self._attach_args = attach
        self._lock = threading.Lock()
        self._q: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._events: collections.deque[tuple[Any, ...]] = collections.deque()
        self.client: KVPushClient | None = None
        self.worker: Worker | None = None
        self.epoch = 0
        self._lost_epoch = 0
        self._next_attempt = 0.0
        self._failed_attempts = 0
        self._stopped = False
        self._thread: threading.Thread | None = None

    @property
    def connected(self) -> bool:
        with self._lock:
            return self.worker is not None and self.worker.alive and self.epoch > self._lost_epoch

    def start(self) -> None:
        """Attach (waiting up to connect_timeout_s for the daemon), then start the thread."""
        deadline = time.monotonic() + self.settings.connect_timeout_s
        while True:
            try:
                self._attach()
                break
            except DaemonUnavailable as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"kvpushd: no daemon answers on {self.settings.socket} after "
                        f"{self.settings.connect_timeout_s:g}s ({e}); start kvpushd on this node or set "
                        "kv_connector_extra_config.kvpushd_socket") from None
                time.sleep(0.2)
            except KVPushError as e:
                raise RuntimeError(f"kvpushd: the daemon on {self.settings.socket} refused this worker's "
                                   f"KV memory: {e}") from None
        self._thread = threading.Thread(target=self._run, name="kvpushd-connector", daemon=True)
        self._thread.start()

    def _attach(self) -> None:
        client = KVPushClient(self.settings.socket, timeout_s=self.settings.rpc_timeout_s)
        try:
            worker = client.attach(**self._attach_args)
        except BaseException:
            client.close()
            raise
        with self._lock:
            old = (self.client, self.worker)
            self.client, self.worker = client, worker
            self.epoch += 1
            epoch = self.epoch
        _close_quietly(*old)
        logger.info("kvpushd: attached to %s as worker %s (attachment %d, peer address %s)",
                    self.settings.socket, worker.worker_id, epoch, worker.peer_address)

    # engine thread -----------------------------------------------------------------------------
    def submit(self, op: _Op) -> None:
        self._q.put(op)

    def cancel(self, op: _Op) -> bool:
        """Withdraw a queued op; False once the thread has started it."""
        with self._lock:
            if op.state is _OpState.QUEUED:
                op.state = _OpState.CANCELLED
                return True
            return False

    def poll(self) -> list[tuple[Any, ...]]:
        """Completions and link events since the last poll, in order (no RPC)."""
        with self._lock:
            w = self.worker
            if w is not None and self.epoch > self._lost_epoch and not w.alive:
                self._mark_lost_locked(w, str(w.session_error or "session ended"))
            elif w is not None and self.epoch > self._lost_epoch:
                for c in w.completions():
                    self._events.append(("completion", self.epoch, c))
            out = list(self._events)
            self._events.clear()
        return out

    def close(self) -> None:
        with self._lock:
            self._stopped = True
            old = (self.client, self.worker)
            self.client = self.worker = None
        self._q.put(None)
        if self._thread is not None:
            self._thread.join(timeout=self.settings.rpc_timeout_s + 5)
        _close_quietly(*old)

    # both threads, under the lock ---------------------------------------------------------------
    def _mark_lost_locked(self, w: Worker, reason: str) -> None:
        if self.epoch <= self._lost_epoch or w is not self.worker:
            return
        self._lost_epoch = self.epoch
        for c in w.completions():  # delivered before the loss: still true
            self._events.append(("completion", self.epoch, c))
        self._events.append(("lost", self.epoch, reason))

    # the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        interval = self.settings.reconnect_interval_s
        while True:
            try:
                op = self._q.get(timeout=interval)
            except queue.Empty:
                op = None
            with self._lock:
                if self._stopped:
                    return
                w = self.worker
                if w is not None and self.epoch > self._lost_epoch and not w.alive:
                    self._mark_lost_locked(w, str(w.session_error or "session ended"))
            if not self.connected and time.monotonic() >= self._next_attempt:
                self._reconnect()
            if op is not None:
                self._execute(op)

    def _reconnect(self) -> None:
        self._next_attempt = time.monotonic() + self.settings.reconnect_interval_s
        try:
            self._attach()
        except KVPushError as e:
            self._failed_attempts += 1
            if self._failed_attempts == 1 or self._failed_attempts % 120 == 0:
                logger.error("kvpushd: re-attaching to the daemon at %s failed (%d tries so far): %s",
                             self.settings.socket, self._failed_attempts, e)
            return
        if self._failed_attempts or self.epoch > 1:
            logger.warning("kvpushd: re-attached to the daemon at %s after it restarted", self.settings.socket)
        self._failed_attempts = 0

    def _execute(self, op: _Op) -> None:
        with self._lock:
            if op.state is _OpState.CANCELLED:
                return
            op.state = _OpState.STARTED
            w, epoch = self.worker, self.epoch
            usable = w is not None and w.alive and epoch > self._lost_epoch
            if op.kind == "abort" and (not usable or op.target_epoch != epoch):
                return  # its expect died with an earlier attachment: the loss already reported it
            if not usable:
                self._events.append(("op_failed", op, DaemonUnavailable("UNAVAILABLE", "not attached to "
                                                                        "the daemon")))
                return
            op.epoch = epoch
        assert w is not None
        req = op.pending.req
        try:
            if op.kind == "expect":
                assert isinstance(req, ExpectReq)
                w.expect(req.transfer_id, req.block_ids, req.producer_address, req.producer_engine_id,
                         req.producer_tp_size, transfer_mode=req.transfer_mode)
            elif op.kind == "publish":
                w.publish(req.transfer_id, req.block_ids)
            else:
                w.abort(req.transfer_id)
        except KVPushError as e:
            with self._lock:
                self._events.append(("op_failed", op, e))
                if isinstance(e, DaemonUnavailable) or e.code == "NOT_FOUND":  # daemon gone or forgot us
                    self._mark_lost_locked(w, str(e))


def _close_quietly(client: KVPushClient | None, worker: Worker | None) -> None:
    if worker is not None:
        with contextlib.suppress(Exception):  # the daemon is gone or restarted: nothing left there
            worker.detach()
    if client is not None:
        client.close()


# ------------------------------------------------------------------------------------------------
# Worker side: request bookkeeping


class _WorkerSide:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, engine_id: str,
                 role: Role, settings: Settings) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.role = role
        self.num_blocks = kv_cache_config.num_blocks
        self.tp_rank, self.tp_size = _tp_rank_and_size(vllm_config)
        self._link: _DaemonLink | None = None
        self._recv: dict[str, _Pending] = {}          # req id -> pending receive
        self._send: dict[str, _Pending] = {}          # req id -> pending send
        self._recv_by_tid: dict[str, _Pending] = {}
        self._send_by_tid: dict[str, _Pending] = {}
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._meta_done: KVConnectorMetadata | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        memory, regions = describe_kv_caches(kv_caches, self.num_blocks, self.settings.host_kv_to_shm)
        logger.info("kvpushd: registering %d KV region(s) in %d memory object(s), %d blocks, block_len %s",
                    len(regions), len(memory), self.num_blocks, sorted({r.block_len for r in regions}))
        self._link = _DaemonLink(self.settings, {
            "engine_id": self.engine_id, "role": self.role, "tp_rank": self.tp_rank, "tp_size": self.tp_size,
            "memory": memory, "regions": regions, "description": f"vllm pid {os.getpid()}"})
        self._link.start()

    @property
    def link(self) -> _DaemonLink:
        if self._link is None:
            raise RuntimeError("kvpushd: register_kv_caches() has not run on this worker")
        return self._link

    # metadata ------------------------------------------------------------------------------------
    def process(self, meta: KVConnectorMetadata | None) -> None:
        """Queue this step's daemon calls (once per metadata; called from several hooks)."""
        if meta is None or meta is self._meta_done or not isinstance(meta, KVPushdConnectorMetadata):
            return
        self._meta_done = meta
        for e in meta.expects:
            self._start(True, e, self._recv, self._recv_by_tid, "expect")
        for p in meta.publishes:
            self._start(False, p, self._send, self._send_by_tid, "publish")
        for a in meta.aborts:
            pend = self._recv.get(a.req_id)
            if pend is None or pend.aborted:
                continue  # already reported
            pend.aborted = True
            assert pend.op is not None
            if self.link.cancel(pend.op):
                self._finish(pend, ok=True, why="aborted before the daemon saw it")
            elif pend.op.epoch is not None:
                self._link_abort(pend, pend.op.epoch)

    def _start(self, recv: bool, req: ExpectReq | PublishReq, by_req: dict[str, _Pending],
               by_tid: dict[str, _Pending], kind: str) -> None:
        pend = _Pending(recv, req)
        if not req.block_ids:
            self._finish(pend, ok=True, tracked=False)  # nothing to move (vLLM allocated no new block)
            return
        if req.req_id in by_req:
            logger.error("kvpushd: request %s was handed to this worker twice; ignoring the repeat", req.req_id)
            return
        if req.transfer_id in by_tid:
            self._finish(pend, ok=False, why=f"transfer id {req.transfer_id!r} is already in use on this worker",
                         tracked=False)
            return
        by_req[req.req_id] = pend
        by_tid[req.transfer_id] = pend
        pend.op = _Op(kind, pend)
        self.link.submit(pend.op)

    # results -------------------------------------------------------------------------------------
    def _finish(self, pend: _Pending, ok: bool, why: str = "", tracked: bool = True) -> None:
        if pend.done:
            return
        pend.done = True
        req = pend.req
        if tracked:
            (self._recv if pend.recv else self._send).pop(req.req_id, None)
            (self._recv_by_tid if pend.recv else self._send_by_tid).pop(req.transfer_id, None)
        if pend.recv:
            self._done_recving.add(req.req_id)
            if not ok and not pend.aborted:
                self._load_errors.update(req.block_ids)
                logger.error("kvpushd: KV for request %s (transfer %s) did not arrive: %s; vLLM's "
                             "kv_load_failure_policy applies", req.req_id, req.transfer_id, why)
        else:
            self._done_sending.add(req.req_id)
            if not ok:
                logger.error("kvpushd: pushing the KV of request %s (transfer %s) failed: %s; its blocks "
                             "are freed and the decode side will not get them", req.req_id, req.transfer_id, why)

    def _on_completion(self, epoch: int, c: Completion) -> None:
        r, s = self._recv_by_tid.get(c.transfer_id), self._send_by_tid.get(c.transfer_id)
        if c.kind is CompletionKind.FINISHED_RECEIVING:
            cands = [r]
        elif c.kind is CompletionKind.FINISHED_SENDING:
            cands = [s]
        elif r is not None and s is not None:  # both directions on a kv_both worker: match the blocks
            cands = [r] if tuple(c.block_ids) == r.req.block_ids else [s]
        else:
            cands = [r, s]
        for pend in cands:
            if pend is not None and pend.op is not None and pend.op.epoch == epoch:
                if c.ok:
                    self._finish(pend, ok=True)
                elif c.code == "ABORTED" and not pend.recv:
                    logger.warning("kvpushd: push of request %s cancelled: %s", pend.req.req_id, c.reason)
                    self._finish(pend, ok=True)
                else:
                    self._finish(pend, ok=False, why=f"{c.code}: {c.reason}")
                return

    def _on_lost(self, epoch: int, reason: str) -> None:
        victims = [p for p in itertools.chain(self._recv.values(), self._send.values())
                   if p.op is not None and p.op.epoch is not None and p.op.epoch <= epoch]
        logger.error("kvpushd: lost the daemon at %s (%s); failing %d transfer(s) in flight and re-attaching",
                     self.settings.socket, reason, len(victims))
        for p in victims:
            self._finish(p, ok=p.aborted, why=f"the kvpushd daemon went away ({reason})")

    def _poll(self) -> None:
        if self._link is None:
            return
        for ev in self._link.poll():
            if ev[0] == "completion":
                self._on_completion(ev[1], ev[2])
            elif ev[0] == "lost":
                self._on_lost(ev[1], ev[2])
            elif ev[0] == "op_failed":
                op, err = ev[1], ev[2]
                pend = op.pending
                if op.kind != "abort" and op.epoch is not None and err.code in _UNSURE:
                    # The daemon may have taken the call after all: make sure it lets go of the
                    # blocks vLLM is about to free (best effort, same attachment only).
                    self._link_abort(pend, op.epoch)
                if pend.op is op or op.kind == "abort":
                    self._finish(pend, ok=pend.aborted, why=f"daemon call {op.kind} failed: {err}")

    def _link_abort(self, pend: _Pending, epoch: int) -> None:
        self.link.submit(_Op("abort", pend, target_epoch=epoch))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Sends exist only for requests vLLM already finished (request_finished published them), so
        # every id reported here is one vLLM handed in finished_req_ids.
        self._poll()
        sending, recving = self._done_sending, self._done_recving
        self._done_sending, self._done_recving = set(), set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        if self._link is not None:
            self._link.close()


def _tp_rank_and_size(vllm_config: VllmConfig) -> tuple[int, int]:
    pc = vllm_config.parallel_config
    try:
        from vllm.distributed.parallel_state import get_tp_group

        g = get_tp_group()
        return int(g.rank_in_group), int(g.world_size)
    except (AssertionError, ImportError, AttributeError):
        if pc.tensor_parallel_size != 1:
            raise RuntimeError("kvpushd: the tensor-parallel group is not initialised in this worker") from None
        return 0, 1


# ------------------------------------------------------------------------------------------------
# The connector


_ROLES = {"kv_producer": Role.PRODUCER, "kv_consumer": Role.CONSUMER, "kv_both": Role.BOTH, None: Role.BOTH}


class KVPushdConnector(KVConnectorBase_V1):
    """Push-mode P/D connector whose transfers the node's kvpushd daemon carries out."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kvt = self._kv_transfer_config
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size > 1:
            raise NotImplementedError("KVPushdConnector supports pipeline_parallel_size=1 only")
        if getattr(pc, "decode_context_parallel_size", 1) > 1:
            raise NotImplementedError("KVPushdConnector does not support decode context parallelism")
        if len(kv_cache_config.kv_cache_groups) > 1:
            raise NotImplementedError(
                "KVPushdConnector needs one KV cache group (block ids index every layer alike); this model "
                f"has {len(kv_cache_config.kv_cache_groups)}")
        assert kvt is not None and kvt.engine_id is not None
        self.engine_id = daemon_engine_id(kvt.engine_id)
        self.settings = Settings.from_extra_config(dict(kvt.kv_connector_extra_config or {}))
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(vllm_config, self.engine_id, self.settings)
        else:
            self._worker = _WorkerSide(vllm_config, kv_cache_config, self.engine_id, _ROLES[kvt.kv_role],
                                       self.settings)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: the daemon holds CUDA IPC mappings of the KV, which sleep mode would unmap."""
        return False

    # scheduler side ------------------------------------------------------------------------------
    @property
    def scheduler_side(self) -> _SchedulerSide:
        assert self._sched is not None, "scheduler-side method called on a worker connector"
        return self._sched

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_push_work()

    # worker side ---------------------------------------------------------------------------------
    @property
    def worker_side(self) -> _WorkerSide:
        assert self._worker is not None, "worker-side method called on a scheduler connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.process(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # the KV of a waiting request is complete before vLLM schedules it

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # nothing per layer: finished requests are published as a whole

    def wait_for_save(self) -> None:
        self.worker_side.process(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        w = self.worker_side
        w.process(self._connector_metadata)
        return w.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()


__all__ = [
    "AbortReq", "ExpectReq", "KVPushdConnector", "KVPushdConnectorMetadata", "PublishReq", "Settings",
    "base_request_id", "describe_kv_caches", "transfer_id_for",
]
