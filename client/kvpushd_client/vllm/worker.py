"""Worker side (one per TP rank): hands the daemon this worker's KV memory once, then per request only
block ids; reports finished sends and receives to vLLM. Daemon calls run on a background thread: the
engine thread only queues them and reads completions the session stream already delivered, so a step
never waits on a gRPC call, let alone on a transfer.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..client import KVPushClient, Worker
from ..types import Completion, CompletionKind, DaemonUnavailable, KVPushError, Role
from .layout import describe_kv_caches
from .metadata import ExpectReq, KVPushdConnectorMetadata, PublishReq
from .utils import Settings, logger

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Call outcomes that do not say whether the daemon acted on the call.
_UNSURE = frozenset({"DEADLINE_EXCEEDED", "UNKNOWN", "INTERNAL"})



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



class KVPushdConnectorWorker:
    """The worker-side half of KVPushdConnector (one per TP rank)."""

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

