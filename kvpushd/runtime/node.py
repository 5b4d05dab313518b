"""The servicers' facade: check -> core event -> executor.run(actions).

Every method runs on the event loop and is a few lines: the checks live with the state they guard
(workers, inbound sessions and agents), the decisions in the core, the carrying out in the
executor. The core never sees a protobuf message, and the event loop never calls NIXL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import structlog

from ..config import Config
from ..core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from ..core.rendezvous import Registration
from ..core.types import Completion, FailureCode, Role, TransferMode
from ..events import EventHub, EventKind
from ..transfer.descs import RemoteAgent
from .executor import Executor
from .identity import Identity
from .inbound import Inbound, Origin
from .outbound import Outbound
from .peerbook import PeerBook
from .view import View
from .workers import (
    MemorySpec,
    RegionArg,
    Worker,
    Workers,
    check_block_ids,
    check_blocks,
    check_skip,
    check_transfer_id,
)

log = structlog.get_logger(__name__)


class Node:
    """One daemon: the rooms, wired. Servicers call these methods with plain values."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.ident = Identity(cfg.node_id, f"{cfg.advertise_host}:{cfg.listen_host_port[1]}")
        self.events = EventHub()
        self.draining = False
        self.workers = Workers(cfg, self.ident, self.events)
        self.inbound = Inbound(self._forget_remote, lambda o, why: self.executor.origin_lost(o, why))
        self.outbound = Outbound(self.ident, cfg.peer_api,
                                 lambda addr, why: self.executor.producer_lost(addr, why, restarted=True))
        self.peerbook = PeerBook(self.events, lambda: self.executor.live_addresses())
        self.executor = Executor(cfg, self.workers, self.inbound, self.outbound, self.events, self.peerbook)
        self.view = View(cfg, self.ident, self.events, self.workers, self.executor, self.inbound, self.outbound,
                         self.peerbook, lambda: self.draining)
        self._housekeeping: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.workers.xfer = self.executor.start(loop)
        self._housekeeping = loop.create_task(self._housekeep_forever())

    async def _housekeep_forever(self) -> None:
        """Heartbeats, peer silence, idle peers and workers that never opened a session: every
        heartbeat interval. Deadlines of transfers are not here: the executor's timer has them."""
        interval = max(0.05, min(self.cfg.transfer.heartbeat_interval_s, self.cfg.worker_api.session_grace_s) / 2)
        while True:
            await asyncio.sleep(interval)
            try:
                now = time.monotonic()
                self.executor.housekeeping(now)
                for wid in self.workers.without_session(now):
                    log.warning("worker never opened its session; detaching", worker_id=wid)
                    await self.detach(wid, "no session opened")
            except Exception:  # a bug here must not stop heartbeats for good
                log.exception("housekeeping failed")

    async def drain(self, timeout_s: float) -> None:
        """Stop taking new transfers; wait for what is in flight, bounded by ``timeout_s`` whatever
        the peers do; every Publish and Expect still gets its one completion; release all memory."""
        self.draining = True
        ex = self.executor
        why = f"daemon {self.ident.node_id} is shutting down"
        ex.run(ex.send.shutdown(why) + ex.recv.shutdown(why))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        grace = min(1.0, timeout_s / 4)  # kept for cancelling what is still in flight at the end
        # What is left are WRITEs in flight (and notices to peers): let them finish, bounded.
        while (len(ex.send) or ex.tasks) and loop.time() < deadline - grace:
            await asyncio.sleep(0.02)
        if len(ex.send) and ex.xfer is not None:
            log.warning("drain bound reached: cancelling transfers in flight", pending=len(ex.send))
            ex.xfer.cancel_inflight(f"{why}: drain_timeout_s = {timeout_s:g}s passed")
            while len(ex.send) and loop.time() < deadline:
                await asyncio.sleep(0.01)
        ex.run(ex.send.give_up(f"{why}: drain_timeout_s = {timeout_s:g}s passed"))  # legs nothing confirms
        for task in list(ex.tasks):  # peer calls that hang on a stalled peer
            task.cancel()
        if self._housekeeping is not None:
            self._housekeeping.cancel()
        ex.stop_timer()
        for wid in list(self.workers.by_id):
            await self.detach(wid, "daemon shutting down")
        await self.outbound.close()
        if ex.xfer is not None:
            await loop.run_in_executor(None, ex.xfer.stop)

    # -- worker API -----------------------------------------------------------------------------

    async def attach(self, engine_id: str, role: Role, tp_rank: int, tp_size: int, pp_rank: int,
                     memory: Sequence[MemorySpec], regions: Sequence[RegionArg], description: str) -> Worker:
        self._not_draining()
        return await self.workers.attach(engine_id, role, tp_rank, tp_size, pp_rank, memory, regions, description)

    def worker(self, worker_id: str) -> Worker:
        return self.workers.get(worker_id)

    def expect(self, worker_id: str, transfer_id: str, block_ids: Sequence[int],
               producer_address: str, producer_engine_id: str, producer_tp_size: int,
               transfer_mode: TransferMode = TransferMode.PUSH, skip_tokens: int = 0, traceparent: str = "") -> None:
        self._not_draining()
        w = self.workers.get(worker_id)
        if not w.role.can_receive:
            raise FailedPrecondition(f"worker {worker_id} attached as {w.role.name}: it cannot expect")
        check_blocks(w, block_ids, self.cfg)
        check_skip(w, skip_tokens)
        check_transfer_id(transfer_id)
        if not producer_engine_id:
            raise InvalidArgument("producer_engine_id must not be empty")
        self._bounded()
        actions = self.executor.recv.expect(time.monotonic(), w.worker_id, w.tp_rank, w.tp_size, transfer_id,
                                            block_ids, producer_address, producer_engine_id, producer_tp_size,
                                            TransferMode.parse(transfer_mode), skip_tokens=skip_tokens,
                                            layouts=w.regions)
        self.events.emit(EventKind.TRANSFER_STARTED, transfer_id=transfer_id, engine_id=w.engine_id,
                         worker_id=w.worker_id, side="recv", peer=producer_address, num_blocks=len(block_ids),
                         nbytes=len(block_ids) * w.block_bytes)
        if self.executor.tracing.enabled:
            self.executor.tracing.expect(w.worker_id, transfer_id, traceparent, w.engine_id, producer_address)
        self.executor.run(actions)

    def publish(self, worker_id: str, transfer_id: str, block_ids: Sequence[int], traceparent: str = "") -> None:
        self._not_draining()
        w = self.workers.get(worker_id)
        if not w.role.can_send:
            raise FailedPrecondition(f"worker {worker_id} attached as {w.role.name}: it cannot publish")
        check_blocks(w, block_ids, self.cfg)
        check_transfer_id(transfer_id)
        self._bounded()
        actions = self.executor.send.publish(time.monotonic(), w.worker_id, w.engine_id, w.tp_rank, w.tp_size,
                                             transfer_id, block_ids, layouts=w.regions)
        self.events.emit(EventKind.TRANSFER_STARTED, transfer_id=transfer_id, engine_id=w.engine_id,
                         worker_id=w.worker_id, side="send", num_blocks=len(block_ids))
        if self.executor.tracing.enabled:
            self.executor.tracing.publish(w.worker_id, transfer_id, traceparent, w.engine_id)
        self.executor.run(actions)

    def abort(self, worker_id: str, transfer_id: str) -> bool:
        w = self.workers.get(worker_id)
        ex = self.executor
        found_r, acts_r = ex.recv.abort(w.worker_id, transfer_id)
        found_s, acts_s = ex.send.abort(w.worker_id, w.engine_id, transfer_id)
        ex.run(acts_r + acts_s)
        return found_r or found_s

    def decline(self, worker_id: str, transfer_id: str, producer_address: str, producer_engine_id: str,
                reason: str) -> None:
        """Decode side: the worker will never Expect this transfer (its Expect failed before it got
        here); the prefill daemon hears so and frees the transfer's source blocks at once."""
        w = self.workers.get(worker_id)
        if not w.role.can_receive:
            raise FailedPrecondition(f"worker {worker_id} attached as {w.role.name}: it cannot decline")
        check_transfer_id(transfer_id)
        if not producer_engine_id or not producer_address:
            raise InvalidArgument("producer_address and producer_engine_id must not be empty")
        if self.executor.recv.pending(w.worker_id, transfer_id):
            raise FailedPrecondition(f"transfer {transfer_id[:256]!r} is pending on this worker: abort it instead")
        log.info("transfer declined", transfer_id=transfer_id[:256], worker_id=w.worker_id, peer=producer_address)
        self.executor.decline(producer_address[:256], transfer_id, producer_engine_id[:256], w.engine_id,
                              reason[:2000])

    def called(self, worker_id: str, commands: int) -> None:
        """Count a worker's Stream batch of ``commands`` commands, for status."""
        w = self.workers.live(worker_id)
        if w is not None:
            w.command_batches += 1
            w.stream_commands += commands

    def session_batches(self, worker_id: str) -> AsyncIterator[list[Completion]]:
        """The worker's completions in batches (the Stream RPC); the caller's end means detach."""
        return self.workers.session_batches(worker_id, self.detach)

    def wake(self, worker_id: str) -> None:
        """Wake the worker's session (the Stream RPC has answers of its own to send)."""
        w = self.workers.live(worker_id)
        if w is not None:
            w.wakeup.set()

    async def detach(self, worker_id: str, why: str) -> None:
        w = self.workers.mark_gone(worker_id)
        if w is None:
            return
        ex = self.executor
        ex.run(ex.send.worker_gone(worker_id) + ex.recv.worker_gone(worker_id))
        ex.figures.forget_worker(worker_id)
        if ex.tracing.enabled:
            ex.tracing.forget_worker(worker_id)
        await self.workers.release(w, why)  # waits for this worker's in-flight WRITEs

    # -- peer API (we are the prefill side) -----------------------------------------------------

    def handshake(self, protocol_version: int, compat_hash: str, node_id: str, peer_address: str,
                  instance_id: str, presented_token: str = "") -> str:
        """A peer daemon introduces itself; returns the secret token of its session."""
        token = self.inbound.handshake(protocol_version, compat_hash, node_id, peer_address, instance_id,
                                       presented_token, self.executor.send.origins())
        self.peerbook.contact(peer_address, node_id=node_id, inbound=True)
        return token

    def session_ok(self, instance_id: str, token: str) -> bool:
        return self.inbound.session_ok(instance_id, token)

    def channel_counts(self, instance_id: str, streams: int = 0, batches: int = 0) -> None:
        """A peer's Channel stream opened or closed (``streams`` +1 / -1), or brought ``batches`` (for status)."""
        o = self.inbound.origins.get(instance_id)
        if o is not None:
            o.streams = max(0, o.streams + streams)
            o.stream_batches += batches
            if streams < 0 and o.streams == 0:  # its last stream ended: housekeeping gives it a short grace
                o.stream_ended = time.monotonic()

    def register(self, origin_id: str, transfer_id: str, registration_id: int, producer_engine_id: str,
                 producer_tp_size: int, consumer_engine_id: str, consumer_rank: int,
                 consumer_tp_size: int, agent: RemoteAgent, block_ids: Sequence[int],
                 transfer_mode: TransferMode = TransferMode.PUSH, skip_tokens: int = 0, traceparent: str = "") -> bool:
        """A decode daemon's registration. Returns False when we need the agent's metadata."""
        self._not_draining()
        origin = self.inbound.caller(origin_id)
        check_transfer_id(transfer_id)
        self._peer_limits(origin, len(block_ids))
        self.peerbook.contact(origin.address, inbound=True)
        self.events.remember(transfer_id, producer_engine_id)
        if self.workers.producer(producer_engine_id) is None:
            raise NotFound(f"no prefill engine {producer_engine_id!r} is attached to node {self.ident.node_id}")
        known = self.inbound.consumers.admit(origin, agent, lambda: self.executor.send.agents_in_use(origin_id))
        if known is None:
            return False
        check_block_ids(block_ids, min(r.num_blocks for r in known.regions),
                        self.cfg.worker_api.max_blocks_per_request, f"transfer {transfer_id[:256]!r}: consumer regions")
        if not 0 <= skip_tokens < 1 << 31:
            raise InvalidArgument(f"transfer {transfer_id!r}: skip_tokens {skip_tokens} out of range")
        self._bounded()
        reg = Registration(registration_id, origin_id, transfer_id, producer_engine_id, producer_tp_size,
                           agent.name, consumer_rank, consumer_tp_size, tuple(block_ids),
                           TransferMode.parse(transfer_mode), skip_tokens=skip_tokens, layouts=known.regions)
        try:
            actions = self.executor.send.register(time.monotonic(), reg)
        except PermissionDenied as e:  # another daemon's registration: not replaceable by this one
            origin.refused += 1
            self.executor.counters.peer_calls_refused += 1
            log.warning("registration refused", peer_node=origin.node_id, peer_address=origin.address,
                        transfer_id=transfer_id[:256], consumer_rank=consumer_rank, reason=str(e))
            raise
        if traceparent and self.executor.tracing.enabled:
            self.executor.tracing.registration(transfer_id, traceparent[:128])
        self.executor.run(actions)
        return True

    def _peer_limits(self, origin: Origin, n_blocks: int | None) -> None:
        """What one decode daemon may ask of us: Registers (and Declines) per second, registrations and
        blocks held (``n_blocks`` None: a Decline, which holds nothing)."""
        pa = self.cfg.peer_api
        regs, blocks = self.executor.send.held_by(origin.instance_id)
        why = ""
        if not origin.take(pa.max_registers_per_s):
            why = (f"more than {pa.max_registers_per_s:g} Registers and Declines per second "
                   "(peer_api.max_registers_per_s)")
        elif n_blocks is not None and regs + 1 > pa.max_registrations_per_peer:
            why = (f"{regs} registrations pending from this daemon; at most {pa.max_registrations_per_peer} "
                   "(peer_api.max_registrations_per_peer)")
        elif n_blocks is not None and blocks + n_blocks > pa.max_blocks_per_peer:
            why = (f"{blocks} destination blocks held for this daemon, {n_blocks} more asked; at most "
                   f"{pa.max_blocks_per_peer} (peer_api.max_blocks_per_peer)")
        if why:
            origin.refused += 1
            self.executor.counters.peer_calls_refused += 1
            log.warning("peer limit reached", peer_node=origin.node_id, peer_address=origin.address, reason=why)
            raise ResourceExhausted(f"decode daemon {origin.node_id[:64]}: {why}", peer=origin.address)

    async def withdraw(self, origin_id: str, transfer_id: str, registration_id: int, code: FailureCode,
                       reason: str) -> None:
        """A decode daemon withdraws a registration; returns once no WRITE into it is in flight
        (bounded), so the decode side may then let its engine free the blocks."""
        ex = self.executor
        key = ex.send.transfer_of(origin_id, registration_id)
        ex.run(ex.send.withdraw(origin_id, transfer_id, registration_id, code, reason))
        if key is not None:
            await ex.wait_unwritten(key, registration_id, max(0.5, self.cfg.peer_api.rpc_timeout_s - 1.0))

    def declined(self, origin_id: str, transfer_id: str, producer_engine_id: str, consumer_engine_id: str,
                 reason: str) -> None:
        """A decode daemon will never register this transfer: fail its publishes now and later."""
        origin = self.inbound.caller(origin_id)
        check_transfer_id(transfer_id)
        self._peer_limits(origin, None)  # the Register budget covers declines too
        if self.workers.producer(producer_engine_id) is None:
            raise NotFound(f"no prefill engine {producer_engine_id[:256]!r} is attached to node {self.ident.node_id}")
        ex = self.executor
        why = f"decode engine {consumer_engine_id[:256]!r} on {origin.node_id[:64]}: {reason[:1000]}"
        actions = ex.send.decline(time.monotonic(), origin_id, producer_engine_id, transfer_id, why)
        ex.counters.declines_received += 1
        log.info("transfer declined by the decode side", transfer_id=transfer_id[:256], peer_node=origin.node_id,
                 reason=reason[:200])
        ex.run(actions)

    def peer_failed(self, caller_instance_id: str, transfer_id: str, registration_id: int, code: FailureCode,
                    reason: str) -> None:
        """The prefill daemon says a registration of ours will not be written.

        Only the daemon the registration was sent to may fail it, and only under its transfer id."""
        ex = self.executor
        sent = ex.recv.sent_to(registration_id)
        if sent is None:
            return  # already ended (finished, failed or withdrawn): nothing to do
        tid, address = sent
        peer = self.outbound.peers.get(address)
        if tid != transfer_id or peer is None or not caller_instance_id or peer.remote_instance != caller_instance_id:
            raise PermissionDenied(f"failure notice for registration {registration_id} (transfer "
                                   f"{transfer_id[:256]!r}) from a daemon it was not sent to")
        ex.run(ex.recv.failed(registration_id, code, reason))

    # -- pull mode ------------------------------------------------------------------------------

    def offer(self, caller_instance_id: str, transfer_id: str, registration_id: int, producer_rank: int,
              agent: RemoteAgent, block_ids: Sequence[int]) -> bool:
        """Pull mode, decode side: the prefill daemon offers a producer rank's source blocks.

        We READ only into the blocks our own worker registered for this very registration, and only
        when the caller is the prefill daemon the registration was sent to. Returns False when we
        need the producer agent's metadata.
        """
        ex = self.executor
        address = ex.recv.producer_address_of(registration_id)
        if address is None:
            raise NotFound(f"registration {registration_id} is not pending on node {self.ident.node_id}")
        peer = self.outbound.peers.get(address)
        origin = self.inbound.origins.get(caller_instance_id)
        if peer is None or origin is None or not caller_instance_id or peer.remote_instance != caller_instance_id:
            raise PermissionDenied(f"offer for registration {registration_id} (transfer {transfer_id[:256]!r}) "
                                   "from a daemon it was not sent to")
        origin = self.inbound.caller(caller_instance_id)
        if len(block_ids) > self.cfg.worker_api.max_blocks_per_request:
            raise InvalidArgument(f"offer of {len(block_ids)} blocks; at most "
                                  f"{self.cfg.worker_api.max_blocks_per_request}")
        known = self.inbound.producers.admit(origin, agent, set)
        if known is None:
            return False
        if block_ids and max(block_ids) >= min(r.num_blocks for r in known.regions):
            raise InvalidArgument(f"transfer {transfer_id[:256]!r}: source block id {max(block_ids)} out of range "
                                  f"(producer regions have {min(r.num_blocks for r in known.regions)} blocks)")
        ex.run(ex.recv.offer(registration_id, transfer_id, producer_rank, block_ids, producer_agent=known.name))
        return True

    def read_failed(self, caller_instance_id: str, registration_id: int, producer_rank: int, reason: str) -> None:
        """Pull mode, prefill side: the decode daemon says the READ of our offer failed."""
        origin = self.inbound.caller(caller_instance_id)
        ex = self.executor
        ex.run(ex.send.read_done(caller_instance_id, registration_id, producer_rank, False,
                                 f"decode daemon {origin.node_id}: {reason[:2000]}"))

    # -- checks ---------------------------------------------------------------------------------

    def _forget_remote(self, name: str) -> None:
        if self.executor.xfer is not None:
            self.executor.xfer.forget_remote(name)  # deferred by the thread while a transfer uses it

    def _not_draining(self) -> None:
        if self.draining:
            raise Unavailable(f"daemon {self.ident.node_id} is shutting down")

    def _bounded(self) -> None:
        ex = self.executor
        if len(ex.send) + len(ex.recv) >= self.cfg.transfer.max_pending:
            raise ResourceExhausted(f"more than {self.cfg.transfer.max_pending} transfers pending")
