"""The servicers' facade: check -> rendezvous event -> run(actions).

Every method runs on the event loop and is a few lines: the checks live with the state they guard
(workers, inbound sessions and agents), the decisions in the rendezvous' core, the carrying out in
the executor, and what happened goes onto the observation stream once. The core never sees a
protobuf message, and the event loop never calls NIXL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import structlog
from kvpushd_client.types import Abort, Decline, Expect, Publish

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
from ..core.types import Completion, TransferMode
from ..events import EventHub, EventKind
from ..tracing import Tracing
from .checks import check_block_ids, check_transfer_id
from .executor import Executor
from .identity import Identity
from .inbound import Hello, Origin
from .observe import Counted, Observations, PeerHeard
from .peerbook import PeerBook
from .peerops import Declined, Notice, Offer, ReadFailed, Register
from .rendezvous import Rendezvous
from .tally import Tally
from .view import View
from .workers import Attach, Worker, Workers, check_blocks, check_progressive, check_skip

log = structlog.get_logger(__name__)


class Node:
    """One daemon: the rooms, wired. Servicers call these methods with plain values.

    What happens is emitted on ``obs``; its sinks (the books below, metrics, tracing) are
    registered by the composition root (app.py). ``tracing`` is asked for the context a Register
    carries."""

    def __init__(self, cfg: Config, tracing: Tracing | None = None) -> None:
        self.cfg = cfg
        self.ident = Identity(cfg.node_id, f"{cfg.advertise_host}:{cfg.listen_host_port[1]}")
        self.obs = Observations()
        self.events = EventHub()
        self.draining = False
        self.rv = Rendezvous(cfg)
        self.workers = Workers(cfg, self.ident, self.events)
        self.tracing = tracing or Tracing()
        self.ex = Executor(cfg, self.ident, self.rv, self.workers, self.obs, self.tracing)
        self.run = self.ex.run
        self.inbound, self.outbound = self.ex.inbound, self.ex.outbound
        self.peerbook = PeerBook(self.events, self.ex.live_addresses)
        self.tally = Tally(self.peerbook)
        self.view = View(self.workers, self.rv, self.ex, self.tally, self.peerbook, lambda: self.draining)
        self._housekeeping: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.workers.xfer = self.ex.start(loop)
        self._housekeeping = loop.create_task(self._housekeep_forever())

    async def _housekeep_forever(self) -> None:
        """Heartbeats, peer silence, idle peers and workers that never opened a session: every
        heartbeat interval. Deadlines of transfers are not here: the executor's timer has them."""
        interval = max(0.05, min(self.cfg.transfer.heartbeat_interval_s, self.cfg.worker_api.session_grace_s) / 2)
        while True:
            await asyncio.sleep(interval)
            try:
                now = time.monotonic()
                self.ex.housekeeping(now)
                self.peerbook.forget_idle(time.time(), self.ex.idle_s)
                for wid in self.workers.without_session(now):
                    log.warning("worker never opened its session; detaching", worker_id=wid)
                    await self.detach(wid, "no session opened")
            except Exception:  # a bug here must not stop heartbeats for good
                log.exception("housekeeping failed")

    async def drain(self, timeout_s: float) -> None:
        """Stop taking new transfers; wait for what is in flight, bounded by ``timeout_s`` whatever
        the peers do; every Publish and Expect still gets its one completion; release all memory."""
        self.draining = True
        ex, send = self.ex, self.rv.send
        why = f"daemon {self.ident.node_id} is shutting down"
        self.run(self.rv.shutdown(why))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        grace = min(1.0, timeout_s / 4)  # kept for cancelling what is still in flight at the end
        # What is left are WRITEs in flight (and notices to peers): let them finish, bounded.
        while (len(send) or ex.tasks) and loop.time() < deadline - grace:
            await asyncio.sleep(0.02)
        if len(send) and ex.xfer is not None:
            log.warning("drain bound reached: cancelling transfers in flight", pending=len(send))
            ex.xfer.cancel_inflight(f"{why}: drain_timeout_s = {timeout_s:g}s passed")
            while len(send) and loop.time() < deadline:
                await asyncio.sleep(0.01)
        self.run(send.give_up(f"{why}: drain_timeout_s = {timeout_s:g}s passed"))  # legs nothing confirms
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

    async def attach(self, a: Attach) -> Worker:
        self._not_draining()
        return await self.workers.attach(a)

    def worker(self, worker_id: str) -> Worker:
        return self.workers.get(worker_id)

    def expect(self, worker_id: str, cmd: Expect) -> None:
        self._not_draining()
        w = self.workers.get(worker_id)
        if not w.role.can_receive:
            raise FailedPrecondition(f"worker {worker_id} attached as {w.role.name}: it cannot expect")
        check_blocks(w, cmd.block_ids, self.cfg)
        check_skip(w, cmd.skip_tokens)
        check_transfer_id(cmd.transfer_id)
        if not cmd.producer_engine_id:
            raise InvalidArgument("producer_engine_id must not be empty")
        self.rv.bounded()
        again = self.rv.recv.pending(w.worker_id, cmd.transfer_id)
        actions = self.rv.recv.expect(time.monotonic(), w, cmd)
        if not again:
            self._started(w, cmd.transfer_id, "recv")
        self.run(actions)

    def publish(self, worker_id: str, cmd: Publish) -> None:
        """``cmd.consumer_*``: the only decode daemon whose registration is accepted (both "": the first).
        ``step``, ``layers``: progressive push (declared before that engine step computes the blocks);
        ``ready_blocks``: how many of the first blocks are complete already (written at once)."""
        self._not_draining()
        w = self.workers.get(worker_id)
        if not w.role.can_send:
            raise FailedPrecondition(f"worker {worker_id} attached as {w.role.name}: it cannot publish")
        check_blocks(w, cmd.block_ids, self.cfg)
        check_transfer_id(cmd.transfer_id)
        if max(len(cmd.consumer_node_id), len(cmd.consumer_tls_name)) > 256:
            raise InvalidArgument("consumer_node_id and consumer_tls_name are limited to 256 characters")
        check_progressive(w, cmd.step, cmd.layers)
        self.rv.bounded()
        again = self.rv.send.has_publish(w.engine_id, cmd.transfer_id, w.tp_rank)
        actions = self.rv.send.publish(time.monotonic(), w, cmd)
        if cmd.layers:
            self.ex.watch_step(w.worker_id, cmd.step)
        if not again:
            self._started(w, cmd.transfer_id, "send")
        self.run(actions)

    def _started(self, w: Worker, transfer_id: str, side: str) -> None:
        """A new transfer was taken (not a retry): Watch hears of it from its ledger."""
        led = self.rv.ledger(w.worker_id, w.engine_id, w.tp_rank, transfer_id, side)
        if led is not None:
            self.events.transfer(EventKind.TRANSFER_STARTED, led)

    def abort(self, worker_id: str, cmd: Abort) -> bool:
        w = self.workers.get(worker_id)
        found, actions = self.rv.abort(w.worker_id, w.engine_id, cmd.transfer_id)
        self.run(actions)
        return found

    def decline(self, worker_id: str, cmd: Decline) -> None:
        """Decode side: the worker will never Expect this transfer (its Expect failed before it got
        here); the prefill daemon hears so and frees the transfer's source blocks at once."""
        w = self.workers.get(worker_id)
        if not w.role.can_receive:
            raise FailedPrecondition(f"worker {worker_id} attached as {w.role.name}: it cannot decline")
        tid, address, engine = cmd.transfer_id, cmd.producer_address, cmd.producer_engine_id
        check_transfer_id(tid)
        if not engine or not address:
            raise InvalidArgument("producer_address and producer_engine_id must not be empty")
        if self.rv.recv.pending(w.worker_id, tid):
            raise FailedPrecondition(f"transfer {tid[:256]!r} is pending on this worker: abort it instead")
        log.info("transfer declined", transfer_id=tid[:256], worker_id=w.worker_id, peer=address)
        self.ex.decline(address[:256], tid, engine[:256], w.engine_id, cmd.reason[:2000])

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
            await self.workers.releasing(worker_id)
            return
        self.ex.worker_gone(worker_id, why)
        await self.workers.release(w, why)  # waits for this worker's in-flight WRITEs

    # -- peer API (we are the prefill side) -----------------------------------------------------

    def handshake(self, hello: Hello) -> str:
        """A peer daemon introduces itself; returns the secret token of its session."""
        token, replaced = self.inbound.handshake(hello, self.rv.send.holds)
        for old in replaced:
            self.ex.origin_lost(old, f"peer {old.node_id} at {old.address} restarted")
        self.obs.emit(PeerHeard(hello.peer_address, hello.node_id, inbound=True))
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

    def register(self, origin_id: str, item: Register) -> bool:
        """A decode daemon's registration. Returns False when we need the agent's metadata."""
        self._not_draining()
        origin = self.inbound.caller(origin_id)
        tid, engine = item.transfer_id, item.producer_engine_id
        check_transfer_id(tid)
        self._peer_limits(origin, len(item.block_ids))
        if origin.book_contact():
            self.obs.emit(PeerHeard(origin.address, inbound=True))
        if self.workers.producer(engine) is None:
            raise NotFound(f"no prefill engine {engine!r} is attached to node {self.ident.node_id}")
        known = self.inbound.consumers.admit(origin, item.agent, lambda: self.rv.send.agents_in_use(origin_id))
        if known is None:
            return False
        check_block_ids(item.block_ids, min(r.num_blocks for r in known.regions),
                        self.cfg.worker_api.max_blocks_per_request, f"transfer {tid[:256]!r}: consumer regions")
        if not 0 <= item.skip_tokens < 1 << 31:
            raise InvalidArgument(f"transfer {tid!r}: skip_tokens {item.skip_tokens} out of range")
        self.rv.bounded()
        reg = Registration(item.registration_id, origin_id, tid, engine, item.producer_tp_size, item.agent.name,
                           item.consumer_rank, item.consumer_tp_size, item.block_ids,
                           TransferMode.parse(item.mode), skip_tokens=item.skip_tokens, layouts=known.regions,
                           node_id=origin.node_id, tls_names=origin.tls_names, traceparent=item.traceparent[:128])
        try:
            actions = self.rv.send.register(time.monotonic(), reg)
        except PermissionDenied as e:  # another daemon's registration: not replaceable by this one
            origin.refused += 1
            self.obs.emit(Counted("peer_calls_refused"))
            log.warning("registration refused", peer_node=origin.node_id, peer_address=origin.address,
                        transfer_id=tid[:256], consumer_rank=item.consumer_rank, reason=str(e))
            raise
        self.run(actions)
        return True

    def _peer_limits(self, origin: Origin, n_blocks: int | None) -> None:
        """What one decode daemon may ask of us: Registers (and Declines) per second, registrations and
        blocks held (``n_blocks`` None: a Decline, which holds nothing)."""
        pa = self.cfg.peer_api
        regs = blocks = 0
        for instance in self.inbound.of_identity(origin):  # the caller's sessions share its quotas
            r, b = self.rv.send.held_by(instance)
            regs, blocks = regs + r, blocks + b
        why = ""
        if not origin.take(pa.max_registers_per_s):
            why = (f"more than {pa.max_registers_per_s:g} Registers and Declines per second "
                   "(peer_api.max_registers_per_s)")
        elif n_blocks is not None and regs + 1 > pa.max_registrations_per_peer:
            why = (f"{regs} registrations pending from {origin.identity[:128]}; at most "
                   f"{pa.max_registrations_per_peer} (peer_api.max_registrations_per_peer)")
        elif n_blocks is not None and blocks + n_blocks > pa.max_blocks_per_peer:
            why = (f"{blocks} destination blocks held for {origin.identity[:128]}, {n_blocks} more asked; at most "
                   f"{pa.max_blocks_per_peer} (peer_api.max_blocks_per_peer)")
        if why:
            origin.refused += 1
            self.obs.emit(Counted("peer_calls_refused"))
            log.warning("peer limit reached", peer_node=origin.node_id, peer_address=origin.address, reason=why)
            raise ResourceExhausted(f"decode daemon {origin.node_id[:64]}: {why}", peer=origin.address)

    async def withdraw(self, origin_id: str, n: Notice) -> None:
        """A decode daemon withdraws a registration; returns once no WRITE into it is in flight
        (bounded), so the decode side may then let its engine free the blocks."""
        key = self.rv.send.transfer_of(origin_id, n.registration_id)
        self.run(self.rv.send.withdraw(origin_id, n.transfer_id, n.registration_id, n.code, n.reason))
        if key is not None:
            await self.ex.wait_unwritten(key, n.registration_id, max(0.5, self.cfg.peer_api.rpc_timeout_s - 1.0))

    def declined(self, origin_id: str, item: Declined) -> None:
        """A decode daemon will never register this transfer: fail its publishes now and later."""
        origin = self.inbound.caller(origin_id)
        tid, engine = item.transfer_id, item.producer_engine_id
        check_transfer_id(tid)
        self._peer_limits(origin, None)  # the Register budget covers declines too
        if self.workers.producer(engine) is None:
            raise NotFound(f"no prefill engine {engine[:256]!r} is attached to node {self.ident.node_id}")
        why = f"decode engine {item.consumer_engine_id[:256]!r} on {origin.node_id[:64]}: {item.reason[:1000]}"
        actions = self.rv.send.decline(time.monotonic(), origin_id, engine, tid, why)
        self.obs.emit(Counted("declines_received"))
        log.info("transfer declined by the decode side", transfer_id=tid[:256], peer_node=origin.node_id,
                 reason=item.reason[:200])
        self.run(actions)

    def peer_failed(self, caller_instance_id: str, n: Notice) -> None:
        """The prefill daemon says a registration of ours will not be written.

        Only the daemon the registration was sent to may fail it, and only under its transfer id."""
        sent = self.rv.recv.sent_to(n.registration_id)
        if sent is None:
            return  # already ended (finished, failed or withdrawn): nothing to do
        tid, address = sent
        if tid != n.transfer_id or not self.outbound.is_instance(address, caller_instance_id):
            raise PermissionDenied(f"failure notice for registration {n.registration_id} (transfer "
                                   f"{n.transfer_id[:256]!r}) from a daemon it was not sent to")
        self.run(self.rv.recv.failed(n.registration_id, n.code, n.reason))

    # -- pull mode ------------------------------------------------------------------------------

    def offer(self, caller_instance_id: str, item: Offer) -> bool:
        """Pull mode, decode side: the prefill daemon offers a producer rank's source blocks.

        We READ only into the blocks our own worker registered for this very registration, and only
        when the caller is the prefill daemon the registration was sent to. Returns False when we
        need the producer agent's metadata.
        """
        transfer_id, registration_id, block_ids = item.transfer_id, item.registration_id, item.block_ids
        address = self.rv.recv.producer_address_of(registration_id)
        if address is None:
            raise NotFound(f"registration {registration_id} is not pending on node {self.ident.node_id}")
        caller = caller_instance_id
        if caller not in self.inbound.origins or not self.outbound.is_instance(address, caller):
            raise PermissionDenied(f"offer for registration {registration_id} (transfer {transfer_id[:256]!r}) "
                                   "from a daemon it was not sent to")
        origin = self.inbound.caller(caller_instance_id)
        if len(block_ids) > self.cfg.worker_api.max_blocks_per_request:
            raise InvalidArgument(f"offer of {len(block_ids)} blocks; at most "
                                  f"{self.cfg.worker_api.max_blocks_per_request}")
        known = self.inbound.producers.admit(origin, item.agent, set)
        if known is None:
            return False
        if block_ids and max(block_ids) >= min(r.num_blocks for r in known.regions):
            raise InvalidArgument(f"transfer {transfer_id[:256]!r}: source block id {max(block_ids)} out of range "
                                  f"(producer regions have {min(r.num_blocks for r in known.regions)} blocks)")
        self.run(self.rv.recv.offer(registration_id, transfer_id, item.producer_rank, block_ids,
                                    producer_agent=known.name))
        return True

    def read_failed(self, caller_instance_id: str, item: ReadFailed) -> None:
        """Pull mode, prefill side: the decode daemon says the READ of our offer failed."""
        origin = self.inbound.caller(caller_instance_id)
        self.run(self.rv.send.read_done(caller_instance_id, item.registration_id, item.producer_rank, False,
                                        f"decode daemon {origin.node_id}: {item.reason[:2000]}"))

    # -- checks ---------------------------------------------------------------------------------

    def _not_draining(self) -> None:
        if self.draining:
            raise Unavailable(f"daemon {self.ident.node_id} is shutting down")
