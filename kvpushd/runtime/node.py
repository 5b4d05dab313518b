"""The one driver of the core: every event goes in here, and what the core decides is carried out here.

The servicers call the worker and peer methods with plain values; the NIXL thread reports WRITEs,
READs, notifications and sealed steps; the peer calls (peercalls.py) bring back what peers answered;
one timer brings the core's next deadline. Each is checked (the checks live with the state they
guard: workers, inbound sessions, agents), fed to the rendezvous' core, and ``run`` carries out the
actions that come out: deliver a completion, hand a WRITE or READ to the NIXL thread, call a peer.
At the end of each loop turn that ran the core, the NIXL thread hears of changed counts and the one
timer is re-armed at the core's next deadline (aioquic's ``call_at`` pattern): no polling tick. What
happened goes onto the observation stream once. The core never sees a protobuf message, and the
event loop never calls NIXL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from kvpushd_client.types import Abort, Decline, Expect, Publish

from ..config import Config, backend_init_params
from ..core.actions import (
    Action,
    Deliver,
    Dropped,
    Registration,
    SendFailNotice,
    SendOffer,
    SendReadFailed,
    SendRegister,
    SendWithdraw,
    StartRead,
    StartWrite,
    StopWrite,
)
from ..core.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvpushdError,
    NotFound,
    PeerUnreachable,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from ..core.ledger import Ledger
from ..core.notif import Notified
from ..core.recv import RecvSide
from ..core.send import SendSide
from ..core.types import Completion, CompletionKind, FailureCode, Figures, TransferMode
from ..events import EventHub, EventKind
from ..tracing import Tracing
from ..transfer.records import ReadResult, WriteResult
from ..transfer.thread import TransferThread
from . import observe as o
from .checks import check_block_ids, check_transfer_id
from .identity import Identity
from .inbound import Hello, Origin
from .peerbook import PeerBook
from .peercalls import PeerCalls
from .peerops import Declined, Notice, Offer, ReadFailed, Register
from .tally import Tally
from .view import View
from .workers import Attach, Worker, Workers, check_command

log = structlog.get_logger(__name__)


class Node:
    """One daemon: the rooms, wired, and the one driver of its core.

    What happens is emitted on ``obs``; its sinks (the books below, metrics, tracing) are
    registered by the composition root (app.py). ``tracing`` is asked for the context a Register
    carries."""

    def __init__(self, cfg: Config, tracing: Tracing | None = None) -> None:
        self.cfg = cfg
        self.ident = Identity(cfg.node_id, f"{cfg.advertise_host}:{cfg.listen_host_port[1]}")
        self.obs = o.Observations()
        self.events = EventHub()
        self.draining = False
        t = cfg.transfer
        self.send = SendSide(t.publish_timeout_s, t.expect_timeout_s)
        # Registration ids are random (63 bits): they do not collide with stale notifications addressed
        # to a previous instance, and only the prefill daemon a registration went to knows its id.
        self.recv = RecvSide(t.expect_timeout_s, random_ids=True)
        self.workers = Workers(cfg, self.ident, self.events)
        self.tracing = tracing or Tracing()
        self.peers = PeerCalls(cfg, self.ident, self.send, self.recv, self.workers, self.obs, self.tracing, self)
        self.inbound, self.outbound = self.peers.inbound, self.peers.outbound
        self.peerbook = PeerBook(self.events, self.peers.live_addresses)
        self.tally = Tally(self.peerbook)
        self.view = View(self.workers, self.send, self.recv, self.peers, self.tally, self.peerbook,
                         lambda: self.draining)
        self.xfer: TransferThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._housekeeping: asyncio.Task[None] | None = None
        self._settle_waiters: list[asyncio.Future[None]] = []  # withdrawals waiting on WRITEs in flight
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._after_turn = False  # _turn_ended is scheduled
        # what carries out each kind of action (the core's action classes are final)
        p = self.peers
        self._do: dict[type, Callable[[Any], None]] = {
            Deliver: self._deliver, StartWrite: self._start_write, StopWrite: self._stop_write,
            StartRead: self._start_read, SendRegister: p.register, SendFailNotice: p.fail,
            SendWithdraw: p.withdraw, SendOffer: p.offer, SendReadFailed: p.read_failed, Dropped: self._dropped,
        }

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        t = self.cfg.transfer
        self._loop = loop
        self.xfer = TransferThread(loop, t, TransferThread.Reports(self._on_writes, self._on_notifs, self._on_reads,
                                                                   self._on_read_notifs, self._on_sealed),
                                   params_for=lambda b, dev: backend_init_params(t, b, dev))
        self.xfer.start()
        self.workers.xfer = self.xfer
        self._housekeeping = loop.create_task(self._housekeep_forever())

    async def _housekeep_forever(self) -> None:
        """Heartbeats, peer silence, idle peers and workers that never opened a session: every
        heartbeat interval. Deadlines of transfers are not here: the one timer has them."""
        interval = max(0.05, min(self.cfg.transfer.heartbeat_interval_s, self.cfg.worker_api.session_grace_s) / 2)
        while True:
            await asyncio.sleep(interval)
            try:
                now = time.monotonic()
                self.peers.housekeeping(now)
                self.peerbook.forget_idle(time.time(), self.peers.idle_s)
                for wid in self.workers.without_session(now):
                    log.warning("worker never opened its session; detaching", worker_id=wid)
                    await self.detach(wid, "no session opened")
            except Exception:  # a bug here must not stop heartbeats for good
                log.exception("housekeeping failed")

    async def drain(self, timeout_s: float) -> None:
        """Stop taking new transfers; wait for what is in flight, bounded by ``timeout_s`` whatever
        the peers do; every Publish and Expect still gets its one completion; release all memory."""
        self.draining = True
        send, tasks = self.send, self.peers.tasks
        why = f"daemon {self.ident.node_id} is shutting down"
        self.run(send.shutdown(why) + self.recv.shutdown(why))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        grace = min(1.0, timeout_s / 4)  # kept for cancelling what is still in flight at the end
        # What is left are WRITEs in flight (and notices to peers): let them finish, bounded.
        while (len(send) or tasks) and loop.time() < deadline - grace:
            await asyncio.sleep(0.02)
        if len(send) and self.xfer is not None:
            log.warning("drain bound reached: cancelling transfers in flight", pending=len(send))
            self.xfer.cancel_inflight(f"{why}: drain_timeout_s = {timeout_s:g}s passed")
            while len(send) and loop.time() < deadline:
                await asyncio.sleep(0.01)
        self.run(send.give_up(f"{why}: drain_timeout_s = {timeout_s:g}s passed"))  # legs nothing confirms
        for task in list(tasks):  # peer calls that hang on a stalled peer
            task.cancel()
        if self._housekeeping is not None:
            self._housekeeping.cancel()
        self.stop_timer()
        for wid in list(self.workers.by_id):
            await self.detach(wid, "daemon shutting down")
        await self.outbound.close()
        if self.xfer is not None:
            await loop.run_in_executor(None, self.xfer.stop)

    # -- worker API -----------------------------------------------------------------------------

    async def attach(self, a: Attach) -> Worker:
        self._not_draining()
        return await self.workers.attach(a)

    def expect(self, worker_id: str, cmd: Expect) -> None:
        self._not_draining()
        w = self.workers.get(worker_id)
        check_command(w, cmd, self.cfg)
        self._bounded()
        again = self.recv.pending(w.worker_id, cmd.transfer_id)
        actions = self.recv.expect(time.monotonic(), w, cmd)
        if not again and (led := self.recv.ledger(w.worker_id, cmd.transfer_id)) is not None:
            self.events.transfer(EventKind.TRANSFER_STARTED, led)  # a new transfer (not a retry): for Watch
        self.run(actions)

    def publish(self, worker_id: str, cmd: Publish) -> None:
        """``cmd.consumer_*``: the only decode daemon whose registration is accepted (both "": the first).
        ``step``, ``layers``: progressive push (declared before that engine step computes the blocks);
        ``ready_blocks``: how many of the first blocks are complete already (written at once)."""
        self._not_draining()
        w = self.workers.get(worker_id)
        check_command(w, cmd, self.cfg)
        self._bounded()
        again = self.send.has_publish(w.engine_id, cmd.transfer_id, w.tp_rank)
        actions = self.send.publish(time.monotonic(), w, cmd)
        if cmd.layers and self.xfer is not None:  # progressive push: the thread watches the worker's doorbell
            self.xfer.watch_step(w.worker_id, cmd.step)
        if not again and (led := self.send.publish_ledger(w.engine_id, cmd.transfer_id, w.tp_rank)) is not None:
            self.events.transfer(EventKind.TRANSFER_STARTED, led)
        self.run(actions)

    def abort(self, worker_id: str, cmd: Abort) -> bool:
        w = self.workers.get(worker_id)
        found_r, acts_r = self.recv.abort(w.worker_id, cmd.transfer_id)
        found_s, acts_s = self.send.abort(w.worker_id, w.engine_id, cmd.transfer_id)
        self.run(acts_r + acts_s)
        return found_r or found_s

    def decline(self, worker_id: str, cmd: Decline) -> None:
        """Decode side: the worker will never Expect this transfer (its Expect failed before it got
        here); the prefill daemon hears so and frees the transfer's source blocks at once."""
        w = self.workers.get(worker_id)
        check_command(w, cmd, self.cfg)
        tid, address, engine = cmd.transfer_id, cmd.producer_address, cmd.producer_engine_id
        if self.recv.pending(w.worker_id, tid):
            raise FailedPrecondition(f"transfer {tid[:256]!r} is pending on this worker: abort it instead")
        log.info("transfer declined", transfer_id=tid[:256], worker_id=w.worker_id, peer=address)
        self.peers.decline(address[:256], tid, engine[:256], w.engine_id, cmd.reason[:2000])

    async def detach(self, worker_id: str, why: str) -> None:
        w = self.workers.mark_gone(worker_id)
        if w is None:
            await self.workers.releasing(worker_id)
            return
        self.worker_gone(worker_id, why)
        await self.workers.release(w, why)  # waits for this worker's in-flight WRITEs

    def worker_gone(self, worker_id: str, why: str) -> None:
        """A worker detached: each of its transfers still pending ends now for the books (its own
        completion, if one follows when its WRITEs in flight settle, goes nowhere)."""
        now = time.monotonic()
        for led in [*self.send.ledgers_of(worker_id), *self.recv.ledgers_of(worker_id)]:
            led.done = now
            self.obs.emit(o.Ended(Completion(CompletionKind.FAILED, led.transfer_id, FailureCode.WORKER_GONE,
                                             f"worker detached: {why}", (), Figures()), led))
        self.run(self.send.worker_gone(worker_id) + self.recv.worker_gone(worker_id))

    # -- peer API (we are the prefill side) -----------------------------------------------------

    def handshake(self, hello: Hello) -> str:
        """A peer daemon introduces itself; returns the secret token of its session."""
        token, replaced = self.inbound.handshake(hello, self.send.holds)
        for old in replaced:
            self.origin_lost(old, f"peer {old.node_id} at {old.address} restarted")
        self.obs.emit(o.PeerHeard(hello.peer_address, hello.node_id, inbound=True))
        return token

    def register(self, origin_id: str, item: Register) -> bool:
        """A decode daemon's registration. Returns False when we need the agent's metadata."""
        self._not_draining()
        origin = self.inbound.caller(origin_id)
        tid, engine = item.transfer_id, item.producer_engine_id
        check_transfer_id(tid)
        self._peer_limits(origin, len(item.block_ids))
        if origin.book_contact():
            self.obs.emit(o.PeerHeard(origin.address, inbound=True))
        if self.workers.producer(engine) is None:
            raise NotFound(f"no prefill engine {engine!r} is attached to node {self.ident.node_id}")
        known = self.inbound.consumers.admit(origin, item.agent, lambda: self.send.agents_in_use(origin_id))
        if known is None:
            return False
        check_block_ids(item.block_ids, min(r.num_blocks for r in known.regions),
                        self.cfg.worker_api.max_blocks_per_request, f"transfer {tid[:256]!r}: consumer regions")
        if not 0 <= item.skip_tokens < 1 << 31:
            raise InvalidArgument(f"transfer {tid!r}: skip_tokens {item.skip_tokens} out of range")
        self._bounded()
        reg = Registration(item.registration_id, origin_id, tid, engine, item.producer_tp_size, item.agent.name,
                           item.consumer_rank, item.consumer_tp_size, item.block_ids,
                           TransferMode.parse(item.mode), skip_tokens=item.skip_tokens, layouts=known.regions,
                           node_id=origin.node_id, tls_names=origin.tls_names, traceparent=item.traceparent[:128])
        try:
            actions = self.send.register(time.monotonic(), reg)
        except PermissionDenied as e:  # another daemon's registration: not replaceable by this one
            origin.refused += 1
            log.warning("registration refused", peer_node=origin.node_id, peer_address=origin.address,
                        transfer_id=tid[:256], consumer_rank=item.consumer_rank, reason=str(e))
            raise
        self.run(actions)
        return True

    def _peer_limits(self, origin: Origin, n_blocks: int | None) -> None:
        why = self.inbound.over_quota(origin, n_blocks, self.send.held_by, self.cfg.peer_api)
        if why:
            origin.refused += 1
            log.warning("peer limit reached", peer_node=origin.node_id, peer_address=origin.address, reason=why)
            raise ResourceExhausted(f"decode daemon {origin.node_id[:64]}: {why}", peer=origin.address)

    async def withdraw(self, origin_id: str, n: Notice) -> None:
        """A decode daemon withdraws a registration; returns once no WRITE into it is in flight
        (bounded), so the decode side may then let its engine free the blocks."""
        key = self.send.transfer_of(origin_id, n.registration_id)
        self.run(self.send.withdraw(origin_id, n.transfer_id, n.registration_id, n.code, n.reason))
        if key is not None:
            await self._wait_unwritten(key, n.registration_id, max(0.5, self.cfg.peer_api.rpc_timeout_s - 1.0))

    def declined(self, origin_id: str, item: Declined) -> None:
        """A decode daemon will never register this transfer: fail its publishes now and later."""
        origin = self.inbound.caller(origin_id)
        tid, engine = item.transfer_id, item.producer_engine_id
        check_transfer_id(tid)
        self._peer_limits(origin, None)  # the Register budget covers declines too
        if self.workers.producer(engine) is None:
            raise NotFound(f"no prefill engine {engine[:256]!r} is attached to node {self.ident.node_id}")
        why = f"decode engine {item.consumer_engine_id[:256]!r} on {origin.node_id[:64]}: {item.reason[:1000]}"
        actions = self.send.decline(time.monotonic(), origin_id, engine, tid, why)
        self.obs.emit(o.Counted("declines_received"))
        log.info("transfer declined by the decode side", transfer_id=tid[:256], peer_node=origin.node_id,
                 reason=item.reason[:200])
        self.run(actions)

    def peer_failed(self, caller_instance_id: str, n: Notice) -> None:
        """The prefill daemon says a registration of ours will not be written.

        Only the daemon the registration was sent to may fail it, and only under its transfer id."""
        sent = self.recv.sent_to(n.registration_id)
        if sent is None:
            return  # already ended (finished, failed or withdrawn): nothing to do
        tid, address = sent
        if tid != n.transfer_id or not self.outbound.is_instance(address, caller_instance_id):
            raise PermissionDenied(f"failure notice for registration {n.registration_id} (transfer "
                                   f"{n.transfer_id[:256]!r}) from a daemon it was not sent to")
        self.run(self.recv.failed(n.registration_id, n.code, n.reason))

    # -- pull mode ------------------------------------------------------------------------------

    def offer(self, caller_instance_id: str, item: Offer) -> bool:
        """Pull mode, decode side: the prefill daemon offers a producer rank's source blocks.

        We READ only into the blocks our own worker registered for this very registration, and only
        when the caller is the prefill daemon the registration was sent to. Returns False when we
        need the producer agent's metadata.
        """
        transfer_id, registration_id, block_ids = item.transfer_id, item.registration_id, item.block_ids
        sent = self.recv.sent_to(registration_id)
        if sent is None:
            raise NotFound(f"registration {registration_id} is not pending on node {self.ident.node_id}")
        address = sent[1]
        if caller_instance_id not in self.inbound.origins or not self.outbound.is_instance(address, caller_instance_id):
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
        self.run(self.recv.offer(registration_id, transfer_id, item.producer_rank, block_ids,
                                    producer_agent=known.name))
        return True

    def read_failed(self, caller_instance_id: str, item: ReadFailed) -> None:
        """Pull mode, prefill side: the decode daemon says the READ of our offer failed."""
        origin = self.inbound.caller(caller_instance_id)
        self.run(self.send.read_done(caller_instance_id, item.registration_id, item.producer_rank, False,
                                        f"decode daemon {origin.node_id}: {item.reason[:2000]}"))

    # -- NIXL callbacks (on the loop): core event, then emit -------------------------------------

    def _on_writes(self, results: list[WriteResult]) -> None:
        actions: list[Action] = []
        now, debug = time.monotonic(), log.is_enabled_for(logging.DEBUG)
        for r in results:
            if not r.ok:  # the ledger has the rest (the completion's figures, Watch, the metrics, the spans)
                led, origin = self.send.ledger_of(r.leg), self.inbound.origins.get(self.send.origin_of(r.leg))
                self.obs.emit(o.WriteDone(r, r.leg.transfer_id, led.worker_id if led else "",
                                          origin.address if origin else ""))
            actions += self.send.write_done(r.leg, r.ok, r.reason, r, now)
            if debug:  # its arguments are built only then (bench critical-path reads these lines)
                log.debug("write done", transfer_id=r.leg.transfer_id, engine_id=r.leg.engine_id, ok=r.ok,
                          post_us=round(r.post_s * 1e6), queue_us=round(r.queue_s * 1e6),
                          xfer_us=round(r.xfer_s * 1e6), descriptors=r.descs_posted, bytes=r.nbytes)
        self.run(actions)

    def _on_sealed(self, steps: list[tuple[str, int]]) -> None:
        actions: list[Action] = []
        for worker_id, step in steps:
            actions += self.send.sealed(worker_id, step)
        self.run(actions)

    def _on_notifs(self, notifs: list[Notified]) -> None:
        actions: list[Action] = []
        now = time.monotonic()
        for n in notifs:
            actions += self.recv.notified(*n, now=now)
        self.obs.emit(o.Counted("notifications_received", len(notifs)))
        self.run(actions)

    def _on_read_notifs(self, notifs: list[tuple[str, int, int]]) -> None:
        """Pull mode, prefill side: READ notifications on our producer agents (the READ completed)."""
        actions: list[Action] = []
        for agent_name, rid, rank in notifs:
            origin = self.inbound.origin_of_consumer_agent(agent_name)
            if origin is None:
                log.info("READ notification from an unknown agent", remote_agent=agent_name[:128])
                continue
            actions += self.send.read_done(origin.instance_id, rid, rank, True)
        self.run(actions)

    def _on_reads(self, results: list[ReadResult]) -> None:
        """Pull mode, decode side: READs this daemon posted have completed (or failed)."""
        actions: list[Action] = []
        now, debug = time.monotonic(), log.is_enabled_for(logging.DEBUG)
        for r in results:
            actions += self.recv.read_done(r.key, r.ok, r.reason, r, now)
            if debug:
                log.debug("read done", transfer_id=r.key.transfer_id, ok=r.ok, reason=r.reason,
                          post_us=round(r.post_s * 1e6), xfer_us=round(r.xfer_s * 1e6), bytes=r.nbytes)
        self.run(actions)

    # -- what peers answered (from peercalls.py), and peers lost -------------------------------------

    def registered(self, batch: Sequence[SendRegister], results: Sequence[KvpushdError | None]) -> None:
        """A prefill daemon answered Registers: each None, or why it refused or could not be reached."""
        actions: list[Action] = []
        for a, err in zip(batch, results, strict=True):
            if err is None:
                actions += self.recv.registered(a.registration_id)
            else:
                code = FailureCode.PEER_UNREACHABLE if isinstance(err, PeerUnreachable) else FailureCode.PEER_REJECTED
                actions += self.recv.failed(a.registration_id, code, str(err))
        self.run(actions)

    def withdraw_answered(self, registration_id: int) -> None:
        """The prefill daemon answered a withdrawal (or is gone): no WRITE into its blocks is in flight."""
        self.run(self.recv.withdraw_answered(registration_id))

    def offer_failed(self, a: SendOffer, why: str) -> None:
        """Pull mode, prefill side: the decode daemon did not start the READ of an offer (or is gone)."""
        reg = a.registration
        self.run(self.send.read_done(reg.origin, reg.registration_id, a.producer_rank, False, why))

    def producer_lost(self, address: str, reason: str, restarted: bool = False) -> None:
        """A prefill daemon is unreachable (or restarted): its pending receives fail now."""
        self.obs.emit(o.PeerLost(address, reason))
        self.run(self.recv.producer_lost(address, FailureCode.PEER_UNREACHABLE, reason, registered_only=restarted))

    def origin_lost(self, origin: Origin, reason: str) -> None:
        """A daemon that called us is gone (silent, or restarted): what it had pending here fails."""
        regs, _ = self.send.held_by(origin.instance_id)
        log.warning("decode daemon lost", peer_node=origin.node_id, peer_address=origin.address, reason=reason,
                    registrations=regs)
        self.obs.emit(o.PeerLost(origin.address, reason, inbound=True))
        if self.xfer is not None:  # its WRITEs (and READs) in flight end now, releasing their blocks
            self.xfer.cancel_to([*self.inbound.consumers.names_of(origin.instance_id),
                                 *self.inbound.producers.names_of(origin.instance_id)], f"peer lost: {reason}")
        self.inbound.drop(origin)
        self.run(self.send.origin_lost(origin.instance_id, reason))

    def forget_remote(self, name: str) -> None:
        if self.xfer is not None:
            self.xfer.forget_remote(name)  # deferred by the thread while a transfer uses it

    # -- carrying out core actions --------------------------------------------------------------

    def run(self, actions: Sequence[Action]) -> None:
        do = self._do
        for a in actions:
            do[type(a)](a)
        if not self._after_turn and self._loop is not None:  # once per loop turn, however many runs it has
            self._after_turn = True
            self._loop.call_soon(self._turn_ended)

    def _turn_ended(self) -> None:
        """After the runs of one loop turn: the NIXL thread hears of changed counts, withdrawals waiting
        on WRITEs look again, and the timer is armed at the core's next deadline."""
        self._after_turn = False
        self._tell_thread()
        if self._settle_waiters:
            waiters, self._settle_waiters = self._settle_waiters, []
            for f in waiters:
                if not f.done():
                    f.set_result(None)
        self._arm()

    def _tell_thread(self) -> None:
        """The NIXL thread polls while READs are offered or receives wait: it hears of a changed count only."""
        if (x := self.xfer) is not None:
            if (n := self.send.pulling()) != x.pulling:
                x.set_pulling(n)
            if (n := len(self.recv) + self.peers.withdrawing) != x.expecting:
                x.set_expecting(n)

    def _arm(self) -> None:
        """One timer at the core's next deadline; re-armed at the end of every loop turn that ran the core."""
        if self._loop is None:
            return
        nxt = min((d for d in (self.send.next_deadline(), self.recv.next_deadline()) if d is not None), default=None)
        if nxt is None:
            self.stop_timer()
            return
        if self._timer is not None and self._timer_at <= nxt:
            return  # armed for as early or earlier: it re-arms when it fires
        self.stop_timer()
        self._timer_at = nxt
        # a millisecond late rather than early: the loop's clock may round the delay down
        self._timer = self._loop.call_later(max(nxt - time.monotonic(), 0.0) + 1e-3, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        try:
            now = time.monotonic()
            self.run(self.send.tick(now) + self.recv.tick(now))
        except Exception:  # a bug here must not stop deadlines for good
            log.exception("deadline handling failed")
            self._arm()

    def _deliver(self, a: Deliver) -> None:
        worker_id, c, led = a.worker_id, a.completion, a.ledger
        if led is None:  # refused before any record of it was made
            led = Ledger("send" if c.kind is CompletionKind.FINISHED_SENDING else "recv", worker_id, "",
                         c.transfer_id, len(c.block_ids), time.monotonic())
        ended = led.done  # its worker went first: the end was told then
        led.done = ended or time.monotonic()
        c = Completion(c.kind, c.transfer_id, c.code, c.reason, c.block_ids,
                       led.figures(c.kind is CompletionKind.FINISHED_RECEIVING))
        if not ended:
            self.obs.emit(o.Ended(c, led))
        self.workers.deliver(worker_id, c)

    def _start_write(self, a: StartWrite) -> None:
        assert self.xfer is not None
        reg = a.registration
        origin = self.inbound.origins.get(reg.origin)
        peer = origin.address if origin is not None else ""
        if (led := self.send.ledger_of(a.leg)) is not None:
            led.peer = peer
        agent = self.inbound.consumers.get(reg.consumer_agent)
        if agent is None:  # evicted meanwhile (cannot happen while registered): fail loudly rather than hang
            self._on_writes([WriteResult(a.leg, False, "consumer agent unknown", 0, 0, 0, 0, 0)])
            return
        self.xfer.post(a, agent)

    def _stop_write(self, a: StopWrite) -> None:
        if self.xfer is not None:
            self.xfer.stop_write(a.leg, a.reason)

    def _dropped(self, a: Dropped) -> None:
        self.obs.emit(a)  # the core's record, as it is (the tally counts it)
        log.debug("late event dropped", late_event=a.event, transfer_id=a.transfer_id, why=a.why)

    def _start_read(self, a: StartRead) -> None:
        assert self.xfer is not None
        agent = self.inbound.producers.get(a.producer_agent)
        if agent is None:
            self._on_reads([ReadResult(a.key, False, "producer agent unknown", 0, 0, 0, 0, 0)])
            return
        self.xfer.post(a, agent)

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _wait_unwritten(self, key: tuple[str, str], registration_id: int, timeout_s: float) -> None:
        """Return once no WRITE into that registration is in flight (bounded by ``timeout_s``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.send.writing_into(key, registration_id) and loop.time() < deadline:
            settled: asyncio.Future[None] = loop.create_future()  # woken by run after any core change
            self._settle_waiters.append(settled)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(settled, deadline - loop.time())

    # -- checks ---------------------------------------------------------------------------------

    def _bounded(self) -> None:
        """Refuse a new transfer past ``transfer.max_pending``."""
        if len(self.send) + len(self.recv) >= (n := self.cfg.transfer.max_pending):
            raise ResourceExhausted(f"more than {n} transfers pending")

    def _not_draining(self) -> None:
        if self.draining:
            raise Unavailable(f"daemon {self.ident.node_id} is shutting down")
