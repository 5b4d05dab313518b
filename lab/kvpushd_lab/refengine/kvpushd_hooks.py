"""``KVHooks`` backed by a kvpushd daemon, through the client library only.

One engine drives one worker per TP rank (each rank's ``PagedKV`` is attached as its own worker
with its ``tp_rank``/``tp_size``, as the ranks of a real TP engine would be). Each worker's session
is one ``WorkerService.Stream`` (``KVPushClient.attach`` -> ``StreamWorker``): the engine
thread only appends commands to the step's batch, and ``end_step()``, which the engine calls once
per step, sends each rank's batch as one ``CommandBatch``. Per request:

* prefill: ``on_prefill_done`` -> ``send_nowait(Publish(req_id, blocks))`` on every rank; the returned
  kv_params name this daemon's peer address as ``remote_host``/``remote_port`` (vLLM's names);
* prefill, progressive push (``progressive``; attached with a doorbell per rank): the publish is
  declared in ``on_prefill_start``, before the forward, as the doorbell's next step with one layer
  group per model layer (layer l's K and V are regions 2l and 2l+1, so the model must own every
  region), and that step goes out at once; ``on_layer_done(n)`` rings each rank's doorbell as the
  forward writes its layers, and ``on_prefill_done`` seals the step instead of publishing;
* decode: ``on_blocks_allocated`` -> ``send_nowait(Expect(transfer_id, blocks, remote address,
  remote_engine_id, tp_size))`` on every rank;
* ``poll`` reads each worker's completions (no RPC: the stream's reader thread delivered them). A
  request is finished once every rank has its completion: finished sending / receiving if all
  succeeded, failed (with the reasons) otherwise. Blocks are only reported when no rank still has
  the transfer pending, so freeing them is safe.

A command the daemon refuses comes back as that rank's FAILED completion ("REFUSED"); the first failed
rank aborts the others, and the request is reported failed once every rank's completion is in. A
worker whose session ended (``alive`` false) fails whatever it still had pending.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpushd_client import (
    Abort,
    CompletionKind,
    Expect,
    KVPushClient,
    KVPushError,
    Publish,
    Role,
    StreamWorker,
    TransferMode,
)

from .engine import KVEvents
from .kv import PagedKV, as_caches


@dataclass
class _Pending:
    req_id: str
    sending: bool
    waiting: set[int]                          # ranks whose completion is still due
    errors: list[str] = field(default_factory=list)
    aborted: bool = False


class KVPushdHooks:
    """Connector hooks for one engine: ``workers[r]`` is TP rank r's attached worker."""

    def __init__(self, workers: Sequence[StreamWorker], engine_id: str, transfer_mode: str = "push",
                 progressive: bool = False, layers: int = 0, extra_spans: int = 0) -> None:
        if not workers:
            raise ValueError("no workers")
        if progressive and (layers < 1 or any(w.doorbell is None for w in workers)):
            raise ValueError("progressive push needs the model's layer count and a doorbell on every rank")
        if transfer_mode not in ("push", "pull"):
            raise ValueError(f"transfer_mode {transfer_mode!r}: 'push' or 'pull'")
        self.transfer_mode = transfer_mode  # used when a request's kv_params do not say
        self.workers = list(workers)
        self.engine_id = engine_id
        self.tp_size = len(self.workers)
        self._pending: dict[str, _Pending] = {}   # transfer id -> what is still due
        self._failed_now: dict[str, str] = {}
        self.unknown_completions = 0
        self.progressive = progressive  # may be switched per request (kvpushd bench handover does)
        self.layers = layers
        self._declared: set[str] = set()   # progressive publishes whose forward has not ended
        self._ringing = False
        self.extra_spans = extra_spans  # > 0: the extra regions are listed in this many spans, span l in group l

    @classmethod
    def attach(cls, client: KVPushClient | Sequence[KVPushClient], engine_id: str, role: Role,
               kv: PagedKV | Sequence[PagedKV], description: str = "", transfer_mode: str = "push",
               progressive: bool = False) -> KVPushdHooks:
        """Attach every rank cache (each must live in shared memory: ``PagedKV.shared``) as a worker.

        ``client`` is one client for all ranks, or one per rank. ``progressive``: each rank gets a
        doorbell, and prefills declare their publish before the forward."""
        caches = as_caches(kv)
        # Extra regions (which the model never reads) are listed spread among the model's layers when they
        # divide evenly (layer group l: layer l's share of them, then its K and V; the engine's hooks write
        # that share before layer l is rung: ``extra_spans``). Otherwise one layer group, the whole leg
        # written once the step is sealed (still declared before the forward).
        spread = caches[0].spreads_extra
        layers = 1 if caches[0].extra_regions and not spread else caches[0].cfg.num_layers
        clients = [client] * len(caches) if isinstance(client, KVPushClient) else list(client)
        workers: list[StreamWorker] = []
        try:
            for c, cl in zip(caches, clients, strict=True):
                if c.shm is None:
                    raise ValueError("kvpushd needs the KV cache in shared memory (PagedKV.shared)")
                workers.append(cl.attach(engine_id, role, c.tp_rank, c.tp_size, [c.shm.memory],
                                         c.regions(spread=spread),
                                         description=description or f"refengine {engine_id} rank {c.tp_rank}",
                                         doorbell=progressive))
        except BaseException:
            for w in workers:
                w.detach()
            raise
        return cls(workers, engine_id, transfer_mode, progressive, layers, layers if spread else 0)

    @property
    def peer_address(self) -> str:
        return self.workers[0].peer_address

    # --- KVHooks --------------------------------------------------------------------------

    def on_prefill_start(self, req_id: str, block_ids: Sequence[int]) -> None:
        """Progressive push: declare the publish as the doorbell's next step and send it now."""
        if not self.progressive:
            return

        def declare(w: StreamWorker) -> None:
            assert w.doorbell is not None
            w.send_nowait(Publish(req_id, tuple(block_ids), step=w.doorbell.step(), layers=self.layers))

        self._start(req_id, req_id, True, declare)
        if req_id in self._failed_now:
            raise RuntimeError(self._failed_now.pop(req_id))
        self.end_step()  # the declaration must reach the daemon before the layers are written
        self._declared.add(req_id)
        self._ringing = True

    def on_layer_done(self, n: int) -> None:
        if self._ringing and self.layers > 1:  # one group: the seal says it
            for w in self.workers:
                assert w.doorbell is not None
                w.doorbell.layer_done(n)

    def on_prefill_done(self, req_id: str, block_ids: Sequence[int]) -> dict[str, Any]:
        if req_id in self._declared:
            self._declared.discard(req_id)
            self._ringing = False
            for w in self.workers:
                assert w.doorbell is not None
                w.doorbell.seal()
        else:
            self._start(req_id, req_id, True, lambda w: w.send_nowait(Publish(req_id, tuple(block_ids))))
        host, _, port = self.peer_address.rpartition(":")
        return {"transfer_id": req_id, "remote_engine_id": self.engine_id, "remote_host": host,
                "remote_port": int(port), "tp_size": self.tp_size}

    def on_blocks_allocated(self, req_id: str, block_ids: Sequence[int], kv_params: Mapping[str, Any]) -> None:
        tid = str(kv_params.get("transfer_id") or req_id)
        address = f"{kv_params['remote_host']}:{int(kv_params['remote_port'])}"
        producer = str(kv_params["remote_engine_id"])
        tp = int(kv_params.get("tp_size") or 1)
        mode = str(kv_params.get("transfer_mode") or self.transfer_mode)
        if mode not in ("push", "pull"):
            self._failed_now[req_id] = f"transfer_mode {mode!r}: 'push' or 'pull'"
            return
        self._start(req_id, tid, False, lambda w: w.send_nowait(Expect(tid, tuple(block_ids), address, producer, tp,
                                                                  transfer_mode=TransferMode.parse(mode))))

    def poll(self) -> KVEvents:
        ev = KVEvents(set(), set(), self._failed_now)
        self._failed_now = {}
        for rank, w in enumerate(self.workers):
            for c in w.completions():
                p = self._pending.get(c.transfer_id)
                if p is None or rank not in p.waiting:
                    self.unknown_completions += 1
                    continue
                p.waiting.discard(rank)
                if c.kind is CompletionKind.FAILED:
                    p.errors.append(f"rank {rank}: {c.code} {c.reason}".strip())
                    if not p.aborted:  # one rank failed: the others stop waiting now, not at a timeout
                        p.aborted = True
                        for r in p.waiting:
                            self.workers[r].send_nowait(Abort(c.transfer_id))
            if not w.alive:  # session gone: the daemon released everything this rank held
                for p in self._pending.values():
                    if rank in p.waiting:
                        p.waiting.discard(rank)
                        p.errors.append(f"rank {rank}: session ended ({w.session_error})")
        for tid, p in list(self._pending.items()):
            if p.waiting:
                continue
            del self._pending[tid]
            if p.errors:
                ev.failed[p.req_id] = "; ".join(p.errors)
            elif p.sending:
                ev.finished_sending.add(p.req_id)
            else:
                ev.finished_recving.add(p.req_id)
        return ev

    def end_step(self) -> None:
        """The engine step is scheduled: each rank's batch goes out as one message."""
        for w in self.workers:
            w.step()

    # --- helpers ---------------------------------------------------------------------------

    def _start(self, req_id: str, tid: str, sending: bool, call: Any) -> None:
        if tid in self._pending:
            self._failed_now[req_id] = f"transfer {tid!r} already pending"
            return
        p = _Pending(req_id, sending, set())
        for rank, w in enumerate(self.workers):
            try:
                call(w)
                p.waiting.add(rank)
            except KVPushError as e:
                p.errors.append(f"rank {rank}: {e}")
                break
        if p.errors:
            for rank in sorted(p.waiting):  # undo: their completion (FAILED) still comes and is waited for
                try:
                    self.workers[rank].send(Abort(tid))
                except KVPushError as e:
                    p.errors.append(f"rank {rank}: abort: {e}")
        if p.waiting:
            self._pending[tid] = p
        elif p.errors:
            self._failed_now[req_id] = "; ".join(p.errors)

    def abort(self, req_id: str) -> None:
        """Abort a pending transfer on every rank (its completions still arrive)."""
        if req_id in self._declared:
            self._declared.discard(req_id)
            self._ringing = False
        for tid, p in self._pending.items():
            if p.req_id == req_id:
                for rank in p.waiting:
                    self.workers[rank].send_nowait(Abort(tid))

    def close(self) -> None:
        """Detach every rank's worker (the daemon fails whatever is still pending)."""
        for w in self.workers:
            w.detach()
