"""The prefill side of the rendezvous: publishes x registrations -> legs (see core/__init__.py).

Its records, their tables and deadline keys are in sendstate.py; what a leg carries, legplan.py.
"""

from __future__ import annotations

from collections import OrderedDict

from .actions import Action, Deliver, Dropped, LegKey, Registration, SendFailNotice, StartWrite, StopWrite
from .deadlines import Deadlines
from .errors import AlreadyExists, InvalidArgument, PermissionDenied
from .ledger import Ledger, Moved
from .legplan import by_tokens, leg_action, mismatch
from .sendstate import (
    LEG_TABLE,
    PUB_TABLE,
    REG_TABLE,
    Binding,
    Declined,
    LegState,
    Publish,
    PublishLease,
    PubState,
    PullLease,
    RegistrationLease,
    RegState,
    SendDeadline,
    SendTransfer,
    SendView,
    view_of,
)
from .table import Move, step
from .topology import check_tp_pair, consumer_targets, writer_sources, writer_targets
from .types import Completion, CompletionKind, FailureCode, TransferMode, WorkerInfo
from .types import Publish as PublishCommand

MAX_DECLINED = 65536  # transfers remembered as declined (the oldest are forgotten first)
MAX_ENDED = 65536  # registrations remembered as ended (the oldest are forgotten first)

class SendSide:
    """Prefill-node rendezvous: publishes x registrations -> legs, and the questions asked of its tables."""

    def __init__(self, publish_timeout_s: float, registration_timeout_s: float) -> None:
        self.publish_timeout_s = publish_timeout_s
        self.registration_timeout_s = registration_timeout_s
        self._transfers: dict[tuple[str, str], SendTransfer] = {}
        self._by_reg: dict[tuple[str, int], tuple[str, str]] = {}  # (origin, reg id) -> key
        self._deadlines: Deadlines[SendDeadline] = Deadlines()
        # Pull legs offered and not yet settled: (origin, reg id, producer rank) <-> leg
        self._pulls: dict[PullLease, LegKey] = {}
        self._pull_of: dict[LegKey, PullLease] = {}
        self._now = 0.0  # the latest time an event brought (for legs started by a completion)
        # per decode daemon: (registrations, destination blocks) it holds here (its quota)
        self._held: dict[str, tuple[int, int]] = {}
        self._declined = Declined(MAX_DECLINED)
        # (origin, registration id) of registrations that ended here: a Register of one again (a
        # duplicate delivered late) is dropped, never held anew, so no WRITE goes into blocks whose
        # decode worker was already told how they ended
        self._ended: OrderedDict[tuple[str, int], None] = OrderedDict()

    # -- events -------------------------------------------------------------------------------

    def publish(self, now: float, w: WorkerInfo, cmd: PublishCommand) -> list[Action]:
        """Producer rank ``w``'s source blocks are complete (``w.regions``: its regions, if known;
        ``cmd.consumer_*``: the only decode daemon whose registrations are accepted, if named), or,
        progressive push (``cmd.layers`` > 0), will be once engine step ``cmd.step`` of its worker has
        computed them: push legs start now and are written layer group by layer group (the first
        ``cmd.ready_blocks`` blocks, complete already, at once), pull legs wait for ``sealed``."""
        worker_id, engine_id, rank, tp_size, layouts = w.worker_id, w.engine_id, w.tp_rank, w.tp_size, w.regions
        transfer_id, blocks, at_step, layers = cmd.transfer_id, tuple(cmd.block_ids), cmd.step, cmd.layers
        ready_blocks = cmd.ready_blocks
        consumer = Binding(cmd.consumer_node_id, cmd.consumer_tls_name)
        if not transfer_id:
            raise InvalidArgument("transfer_id must not be empty")
        if not blocks:
            raise InvalidArgument(f"transfer {transfer_id!r}: block_ids must not be empty")
        if not 0 <= ready_blocks <= len(blocks):
            raise InvalidArgument(f"transfer {transfer_id!r}: ready_blocks {ready_blocks} is more than the "
                                  f"{len(blocks)} block ids published (it counts the complete ones among them)")
        ready_blocks = ready_blocks if layers else 0  # without layers every block is complete now
        key = (engine_id, transfer_id)
        t = self._transfers.get(key)
        if t is None:
            why = self._declined.why(now, key)
            if why:
                return [Deliver(worker_id, Completion(CompletionKind.FAILED, transfer_id, FailureCode.ABORTED,
                                                      why, blocks),
                                Ledger("send", worker_id, engine_id, transfer_id, len(blocks), now))]
            t = self._transfers[key] = SendTransfer(engine_id, transfer_id, now)
        t.check_binding(consumer)
        old = t.publishes.get(rank)
        if step(PUB_TABLE, old.state if old else None, "publish", transfer_id) is Move.STAY:
            assert old is not None
            if old.block_ids == blocks and old.worker_id == worker_id and (
                    old.step, old.layers, old.ready_blocks) == (at_step, layers, ready_blocks):
                return []  # a retried Publish: idempotent
            raise AlreadyExists(f"transfer {transfer_id!r} is already published by engine {engine_id!r} rank "
                                f"{rank} with other blocks; abort it first")
        self._now = max(self._now, now)
        actions = [a for r in (t.bind(consumer) if consumer else ()) for a in self._drop_registration(
            t, r, "unbound", (FailureCode.PEER_REJECTED, t.refusal(r)))]
        t.publishes[rank] = Publish(worker_id, rank, tp_size, blocks, layouts, step=at_step, layers=layers,
                                    ready=layers == 0, ready_blocks=ready_blocks,
                                    ledger=Ledger("send", worker_id, engine_id, transfer_id, len(blocks), now,
                                                  traceparent=cmd.traceparent))
        self._deadlines.arm(PublishLease(engine_id, transfer_id, rank), now + self.publish_timeout_s)
        return actions + self._match(t, now)

    def register(self, now: float, reg: Registration) -> list[Action]:
        """The decode side's destination blocks for one consumer rank (forwarded by its daemon)."""
        check_tp_pair(reg.producer_tp_size, reg.consumer_tp_size)
        if not reg.block_ids:
            raise InvalidArgument(f"transfer {reg.transfer_id!r}: block_ids must not be empty")
        if step(REG_TABLE, RegState.HELD if (reg.origin, reg.registration_id) in self._by_reg else None,
                "register", reg.transfer_id) is Move.STAY:
            return []  # a retried Register: idempotent
        if (reg.origin, reg.registration_id) in self._ended:
            return [Dropped("registered", reg.transfer_id, f"registration {reg.registration_id} already ended here: "
                            "a registration id is held once")]
        key = (reg.producer_engine_id, reg.transfer_id)
        t = self._transfers.get(key)
        if t is not None and t.consumer and not t.consumer.admits(reg):
            raise PermissionDenied(t.refusal(reg), transfer_id=reg.transfer_id)
        if t is None:
            t = self._transfers[key] = SendTransfer(reg.producer_engine_id, reg.transfer_id, now)
        if t.consumer_tp is not None and t.consumer_tp != reg.consumer_tp_size:
            raise InvalidArgument(
                f"transfer {reg.transfer_id!r}: consumer TP size {reg.consumer_tp_size} differs from "
                f"an earlier registration's {t.consumer_tp}"
            )
        holder = t.rank_origin.get(reg.consumer_rank)
        if holder is not None and holder != reg.origin:
            raise PermissionDenied(f"transfer {reg.transfer_id[:256]!r}: consumer rank {reg.consumer_rank} is "
                                   "registered by another decode daemon; only that daemon may replace it",
                                   transfer_id=reg.transfer_id)
        self._now = max(self._now, now)
        actions: list[Action] = []
        old = t.registrations.get(reg.consumer_rank)
        if old is not None:
            # A re-submitted (e.g. preempted and re-allocated) decode request replaces its old
            # registration, and its daemon hears so; writes already posted into the old blocks
            # settle on their own (the new one is written once they have: one WRITE in flight
            # per publish and consumer rank).
            actions += self._drop_registration(t, old, "replaced",
                                               (FailureCode.SUPERSEDED, "replaced by a newer registration"))
        t.rank_origin[reg.consumer_rank] = reg.origin
        n, blocks = self._held.get(reg.origin, (0, 0))
        self._held[reg.origin] = (n + 1, blocks + len(reg.block_ids))
        t.consumer_tp = reg.consumer_tp_size
        t.mla = reg.mla
        t.registrations[reg.consumer_rank] = reg
        t.reg_ids[reg.consumer_rank] = reg.registration_id
        self._by_reg[(reg.origin, reg.registration_id)] = key
        self._deadlines.arm(RegistrationLease(*key, reg.consumer_rank), now + self.registration_timeout_s)
        actions += self._match(t, now)
        return actions

    def write_done(self, leg: LegKey, ok: bool, reason: str = "", result: Moved | None = None,
                   now: float = 0.0) -> list[Action]:
        """The runtime reports that a WRITE (or, in pull mode, the decode side's READ) completed or failed
        (``result``: the NIXL thread's figures of a WRITE, summed into the publish's ledger)."""
        pk = self._pull_of.pop(leg, None)
        if pk is not None:
            del self._pulls[pk]
            self._deadlines.disarm(pk)
        t = self._transfers.get((leg.engine_id, leg.transfer_id))
        pub = t.publishes.get(leg.producer_rank) if t is not None else None
        state = pub.legs.get(leg.registration_id) if pub is not None else None
        nxt = step(LEG_TABLE, state, "write_done" if ok else "write_failed", leg.transfer_id)
        if nxt is Move.DROP:
            return [Dropped("write_done", leg.transfer_id, f"leg {leg.producer_rank}->{leg.registration_id} "
                            f"is {state.value if state else 'gone'}")]
        assert t is not None and pub is not None
        if result is not None and pub.ledger is not None:
            pub.ledger.moved(result, now or self._now)
        pub.staged.discard(leg.registration_id)
        actions: list[Action] = []
        if nxt is LegState.DONE:
            pub.legs[leg.registration_id] = LegState.DONE
            t.written.setdefault(leg.registration_id, set()).add(leg.producer_rank)
        else:
            del pub.legs[leg.registration_id]
            reg = t.reg_by_id(leg.registration_id)
            what = "READ by the decode daemon" if pk is not None else "WRITE"
            msg = f"{what} from producer rank {leg.producer_rank} failed: {reason}"
            if reg is not None:
                actions += self._drop_registration(t, reg, "void", (FailureCode.TRANSFER_ERROR, msg))
            actions += self._fail_publish(t, pub, "leg_failed", FailureCode.TRANSFER_ERROR, msg)
        actions += t.release_notices()
        # A WRITE held back for this rank (a replacement registration) may start now.
        actions += self._match(t, self._now)
        return actions

    def sealed(self, worker_id: str, at_step: int) -> list[Action]:
        """Progressive push: the worker's doorbell says engine step ``at_step`` is complete: its
        publishes declared up to that step are whole (pull legs may be offered now)."""
        actions: list[Action] = []
        for t in list(self._transfers.values()):
            pubs = [p for p in t.publishes.values() if not p.ready and p.worker_id == worker_id and p.step <= at_step]
            for p in pubs:
                p.ready = True
            if pubs:
                actions += self._match(t, self._now)
        return actions

    def read_done(self, origin: str, registration_id: int, producer_rank: int, ok: bool,
                  reason: str = "") -> list[Action]:
        """Pull mode: the decode daemon ``origin`` READ a leg (its notification), or says the READ failed.

        Only a leg offered to that very daemon for that registration and rank is settled; anything
        else (late, duplicate, forged) is ignored.
        """
        leg = self._pulls.get(PullLease(origin, registration_id, producer_rank))
        if leg is None:
            return [Dropped("read_done", "", f"no READ of registration {registration_id} rank {producer_rank} "
                            "offered to that daemon is pending")]
        return self.write_done(leg, ok, reason)

    def withdraw(self, origin: str, transfer_id: str, registration_id: int, code: FailureCode,
                 reason: str) -> list[Action]:
        """The decode side gave up on a registration (abort, timeout, worker gone)."""
        key = self._by_reg.get((origin, registration_id))
        t = self._transfers[key] if key is not None else None
        reg = t.reg_by_id(registration_id) if t is not None else None
        if step(REG_TABLE, RegState.HELD if reg else None, "withdraw", transfer_id) is Move.DROP:
            return [Dropped("withdraw", transfer_id, f"registration {registration_id} already ended here")]
        assert t is not None and reg is not None
        # SUPERSEDED: the decode worker re-registers (new blocks); its publishes must not fail.
        fail = None if code is FailureCode.SUPERSEDED else (code, f"decode side: {reason}")
        return self._drop_registration(t, reg, "withdraw", None, fail_publishes=fail) + self._settle(t)

    def decline(self, now: float, origin: str, engine_id: str, transfer_id: str, reason: str) -> list[Action]:
        """The decode daemon ``origin`` says it will never register this transfer (its worker's Expect
        failed before reaching it). Its publishes fail now (ABORTED: the consumer gave up), and one
        published later fails at once, for publish_timeout_s. Only ranks ``origin`` registered (or
        none) may be declined by it: another decode daemon's registration is not its to end."""
        if not transfer_id:
            raise InvalidArgument("transfer_id must not be empty")
        key = (engine_id, transfer_id)
        t = self._transfers.get(key)
        if t is not None and any(o != origin for o in t.rank_origin.values()):
            raise PermissionDenied(f"transfer {transfer_id[:256]!r} is registered by another decode daemon; "
                                   "only that daemon may end it", transfer_id=transfer_id)
        self._now = max(self._now, now)
        msg = f"the decode side declined transfer {transfer_id[:256]!r}: {reason[:1000]}"
        self._declined.remember(key, now + self.publish_timeout_s, msg)
        if t is None:
            return []
        actions: list[Action] = []
        for reg in list(t.registrations.values()):
            actions += self._drop_registration(t, reg, "decline", (FailureCode.ABORTED, msg))
        for pub in t.publishes.values():
            actions += self._fail_publish(t, pub, "decline", FailureCode.ABORTED, msg)
        return actions + self._settle(t)

    def abort(self, worker_id: str, engine_id: str, transfer_id: str) -> tuple[bool, list[Action]]:
        """The prefill engine cancelled the request."""
        t = self._transfers.get((engine_id, transfer_id))
        pubs = [p for p in t.publishes.values() if p.worker_id == worker_id] if t else []
        if t is None or not pubs:
            return False, []
        actions = [a for pub in pubs for a in self._fail(t, pub, "abort", FailureCode.ABORTED,
                                                          "aborted by the engine", "aborted by the prefill engine")]
        return True, actions + self._settle(t)

    def worker_gone(self, worker_id: str) -> list[Action]:
        """A producer worker's session ended: its publishes die with it (no completion to deliver)."""
        actions: list[Action] = []
        for t in list(self._transfers.values()):
            for pub in [p for p in t.publishes.values() if p.worker_id == worker_id]:
                actions += self._fail(t, pub, "worker_gone", FailureCode.WORKER_GONE, "worker is gone",
                                      "prefill worker is gone")
            actions += self._settle(t)
        return [a for a in actions if not (isinstance(a, Deliver) and a.worker_id == worker_id)]

    def origin_lost(self, origin: str, reason: str) -> list[Action]:
        """A decode daemon is gone (restart or unreachable): its registrations are void."""
        actions: list[Action] = []
        for t in list(self._transfers.values()):
            for reg in [r for r in t.registrations.values() if r.origin == origin]:
                actions += self._drop_registration(
                    t, reg, "origin_lost", None, fail_publishes=(FailureCode.PEER_UNREACHABLE, reason))
            for rank in [k for k, o in t.rank_origin.items() if o == origin]:
                del t.rank_origin[rank]
            for rid in [k for k, n in t.notices.items() if n.origin == origin]:
                del t.notices[rid]  # nobody to tell
            actions += self._settle(t)
        # READs that daemon owed us will never be confirmed: the legs failed.
        for leg in [v for k, v in self._pulls.items() if k.origin == origin]:
            actions += self.write_done(leg, False, f"decode daemon lost before confirming the READ: {reason}")
        return actions

    def shutdown(self, reason: str) -> list[Action]:
        """The daemon is stopping: everything not yet written fails now; WRITEs in flight settle."""
        actions: list[Action] = []
        for t in list(self._transfers.values()):
            for pub in list(t.publishes.values()):
                actions += self._fail(t, pub, "shutdown", FailureCode.SHUTDOWN, reason)
            for reg in list(t.registrations.values()):
                actions += self._drop_registration(t, reg, "shutdown", (FailureCode.SHUTDOWN, reason))
            actions += self._settle(t)
        return actions

    def give_up(self, reason: str) -> list[Action]:
        """The daemon stops past its drain bound: every leg still in flight (a WRITE that was
        cancelled, a READ never confirmed) ends in failure, so every publish gets its completion."""
        actions: list[Action] = []
        for t in list(self._transfers.values()):
            for pub in list(t.publishes.values()):
                for rid in [r for r, st in pub.legs.items() if st is LegState.POSTED]:
                    actions += self.write_done(LegKey(t.engine_id, t.transfer_id, pub.rank, rid), False, reason)
        return actions

    def tick(self, now: float) -> list[Action]:
        """Expire publishes, registrations and offered READs whose deadline passed without progress."""
        self._now = max(self._now, now)
        actions: list[Action] = []
        for key in self._deadlines.pop_due(now):
            if isinstance(key, PullLease):
                pleg = self._pulls.get(key)
                if pleg is not None:
                    actions += self.write_done(pleg, False, f"READ not confirmed within "
                                                            f"{self.publish_timeout_s:g}s of the offer")
                continue
            t = self._transfers.get((key.engine_id, key.transfer_id))
            if t is None:
                continue
            if isinstance(key, PublishLease):
                pub = t.publishes.get(key.rank)
                if pub is None or step(PUB_TABLE, pub.state, "timeout", t.transfer_id) is Move.STAY:
                    continue
                if t.progressing(pub) or t.leased(pub):
                    self._deadlines.arm(key, now + self.publish_timeout_s)  # look again: a target may be dropped
                    continue
                msg = (f"no decode registration for transfer {t.transfer_id!r} within "
                       f"{self.publish_timeout_s:g}s of publish")
                actions += self._fail(t, pub, "timeout", FailureCode.TIMEOUT, msg)
            else:
                reg = t.registrations.get(key.consumer_rank)
                if reg is None:
                    continue
                if any(reg.registration_id in p.legs for p in t.publishes.values()):
                    self._deadlines.arm(key, now + self.registration_timeout_s)  # a source may not come
                    continue
                msg = (f"prefill engine {t.engine_id!r} did not publish transfer "
                       f"{t.transfer_id!r} within {self.registration_timeout_s:g}s")
                actions += self._drop_registration(t, reg, "timeout", (FailureCode.TIMEOUT, msg))
            actions += self._settle(t)
        return actions

    # -- internals ----------------------------------------------------------------------------

    def _match(self, t: SendTransfer, now: float) -> list[Action]:
        """Start every leg whose publish and registration are both present."""
        actions: list[Action] = []
        for pub in list(t.publishes.values()):
            if pub.state is PubState.FAILING:
                continue
            for reg in list(t.registrations.values()):
                if reg.registration_id in pub.legs or pub.rank in t.written.get(reg.registration_id, ()):
                    continue  # started by this publish, or written by an earlier publish of this rank
                if reg.consumer_rank not in writer_targets(pub.rank, pub.tp_size, reg.consumer_tp_size, reg.mla):
                    continue
                if reg.mode is TransferMode.PULL and not pub.ready:
                    continue  # a READ needs the whole KV: offered once the step is sealed
                if any(pub.leg_ranks.get(rid) == reg.consumer_rank for rid, st in pub.legs.items()
                       if st is LegState.POSTED):
                    continue  # one WRITE in flight per publish and consumer rank: this one follows it
                tokens = by_tokens(pub, reg)
                problem = mismatch(pub, reg, tokens)
                if problem:
                    actions += self._drop_registration(t, reg, "mismatch", (FailureCode.LAYOUT_MISMATCH, problem))
                    actions += self._fail(t, pub, "mismatch", FailureCode.LAYOUT_MISMATCH, problem)
                    break
                nxt = step(LEG_TABLE, pub.legs.get(reg.registration_id), "start", t.transfer_id)
                assert isinstance(nxt, LegState)
                pub.legs[reg.registration_id] = nxt
                pub.leg_ranks[reg.registration_id] = reg.consumer_rank
                action = leg_action(t, pub, reg, now, tokens)
                if pub.ledger is not None:
                    pub.ledger.meet(now, max(now - t.created, 0.0), reg.traceparent)
                if isinstance(action, StartWrite) and action.layers:
                    pub.staged.add(reg.registration_id)
                if reg.mode is TransferMode.PULL:
                    pk = PullLease(reg.origin, reg.registration_id, pub.rank)
                    self._pulls[pk] = action.leg
                    self._pull_of[action.leg] = pk
                    self._deadlines.arm(pk, now + self.publish_timeout_s)
                actions.append(action)
        return actions + self._settle(t)

    @staticmethod
    def _fail_publish(t: SendTransfer, pub: Publish, event: str, code: FailureCode, reason: str) -> list[Action]:
        """The publish fails (its first cause stands); its layer groups not yet posted never will be."""
        if step(PUB_TABLE, pub.state, event, t.transfer_id) is not PubState.FAILING:
            return []
        pub.state = PubState.FAILING
        pub.failure = (code, reason)
        return _stop(t, pub, pub.staged, reason)

    def _fail(self, t: SendTransfer, pub: Publish, event: str, code: FailureCode, reason: str,
              told: str = "") -> list[Action]:
        """The publish fails; registrations it would have written are void: their decode daemons are
        told (``told``: what they hear, if not ``reason``)."""
        actions: list[Action] = []
        for reg in list(t.registrations.values()):
            if reg.consumer_rank in consumer_targets(pub.rank, pub.tp_size, reg.consumer_tp_size):
                actions += self._drop_registration(t, reg, "void", (code, told or reason))
        return actions + self._fail_publish(t, pub, event, code, reason)

    def _drop_registration(
        self,
        t: SendTransfer,
        reg: Registration,
        event: str,
        notice: tuple[FailureCode, str] | None,
        fail_publishes: tuple[FailureCode, str] | None = None,
    ) -> list[Action]:
        actions: list[Action] = [a for pub in t.publishes.values()
                                 for a in _stop(t, pub, {reg.registration_id}, f"registration {event}")]
        self._consume(t, reg, event)
        if t.reg_ids.get(reg.consumer_rank) == reg.registration_id:
            del t.reg_ids[reg.consumer_rank]
        t.written.pop(reg.registration_id, None)
        if notice is not None:
            t.notices[reg.registration_id] = SendFailNotice(reg.origin, t.transfer_id, reg.registration_id, *notice)
            actions += t.release_notices()
        if fail_publishes is not None:
            for pub in t.publishes.values():
                if reg.consumer_rank in consumer_targets(pub.rank, pub.tp_size, reg.consumer_tp_size):
                    actions += self._fail_publish(t, pub, "target_failed", *fail_publishes)
        return actions

    def _settle(self, t: SendTransfer) -> list[Action]:
        """Report publishes that are finished, or failed with nothing left in flight."""
        actions: list[Action] = []
        for rank, pub in list(t.publishes.items()):
            if pub.posted():
                continue  # wait for in-flight WRITEs before the worker may free its blocks
            if pub.failure is not None:
                code, reason = pub.failure
                comp = Completion(CompletionKind.FAILED, t.transfer_id, code, reason, pub.block_ids)
                event = "settled"
            else:
                if t.consumer_tp is None or not all(
                        c in t.reg_ids and pub.rank in t.written.get(t.reg_ids[c], ())
                        for c in writer_targets(pub.rank, pub.tp_size, t.consumer_tp, t.mla)):
                    continue
                comp = Completion(CompletionKind.FINISHED_SENDING, t.transfer_id)
                event = "written"
            step(PUB_TABLE, pub.state, event, t.transfer_id)  # -> GONE
            del t.publishes[rank]
            self._deadlines.disarm(PublishLease(t.engine_id, t.transfer_id, rank))
            actions.append(Deliver(pub.worker_id, comp, pub.ledger))
        # A registration is consumed once every producer rank that writes to it has written.
        for reg in list(t.registrations.values()):
            sources = writer_sources(reg.consumer_rank, reg.producer_tp_size, reg.consumer_tp_size, reg.mla)
            if set(sources) <= t.written.get(reg.registration_id, set()):
                self._consume(t, reg, "written")
        if not t.publishes and not t.registrations:
            del self._transfers[t.key]
        return actions

    def _consume(self, t: SendTransfer, reg: Registration, event: str) -> None:
        """Forget a registration's blocks (written, or dropped); its id stays in reg_ids."""
        held = t.registrations.get(reg.consumer_rank) is reg
        step(REG_TABLE, RegState.HELD if held else None, event, t.transfer_id)  # -> GONE
        del t.registrations[reg.consumer_rank]
        n, blocks = self._held.pop(reg.origin, (0, 0))
        if n > 1:
            self._held[reg.origin] = (n - 1, blocks - len(reg.block_ids))
        self._deadlines.disarm(RegistrationLease(t.engine_id, t.transfer_id, reg.consumer_rank))
        self._by_reg.pop((reg.origin, reg.registration_id), None)
        self._ended[(reg.origin, reg.registration_id)] = None
        if len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)


    # -- queries ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._transfers)

    def next_deadline(self) -> float | None:
        return self._deadlines.next()

    def origins(self) -> set[str]:
        """Decode daemons that hold registrations here, or owe us a READ (they must keep sending heartbeats)."""
        return set(self._held) | {pk.origin for pk in self._pulls}

    def holds(self, origin: str) -> bool:
        """Whether ``origin`` is one of ``origins()``, without going through every transfer (a handshake
        asks it: with 10,000 decode daemons registered, the whole set per handshake cost O(N) each)."""
        return origin in self._held or any(pk.origin == origin for pk in self._pulls)

    def held_by(self, origin: str) -> tuple[int, int]:
        """(registrations, destination blocks) the decode daemon ``origin`` holds here."""
        return self._held.get(origin, (0, 0))

    def pull_pending(self, origin: str, registration_id: int, producer_rank: int) -> bool:
        """Whether that pull leg is still offered (not confirmed, failed or given up on)."""
        return PullLease(origin, registration_id, producer_rank) in self._pulls

    def pulling(self) -> int:
        """Pull legs offered whose READ is not settled (the runtime polls READ notifications meanwhile)."""
        return len(self._pulls)

    def transfer_of(self, origin: str, registration_id: int) -> tuple[str, str] | None:
        """Key of the transfer a registration belongs to (None: unknown here)."""
        return self._by_reg.get((origin, registration_id))

    def writing_into(self, key: tuple[str, str], registration_id: int) -> bool:
        """A WRITE into this registration's blocks is still in flight (even after it was withdrawn)."""
        t = self._transfers.get(key)
        return t is not None and any(p.legs.get(registration_id) is LegState.POSTED for p in t.publishes.values())

    def agents_in_use(self, origin: str) -> set[str]:
        """Consumer agents that registrations from ``origin`` pending here refer to."""
        return {r.consumer_agent for t in self._transfers.values() for r in t.registrations.values()
                if r.origin == origin}

    def origin_of(self, leg: LegKey) -> str:
        """The decode daemon (its peer key) whose registration a leg writes into ("" once that is gone)."""
        t = self._transfers.get((leg.engine_id, leg.transfer_id))
        regs = t.registrations.values() if t is not None else ()
        return next((r.origin for r in regs if r.registration_id == leg.registration_id), "")

    def _publish(self, engine_id: str, transfer_id: str, rank: int) -> Publish | None:
        t = self._transfers.get((engine_id, transfer_id))
        return t.publishes.get(rank) if t is not None else None

    def ledger_of(self, leg: LegKey) -> Ledger | None:
        """The books of the publish a leg belongs to (None once it ended)."""
        return self.publish_ledger(leg.engine_id, leg.transfer_id, leg.producer_rank)

    def publish_ledger(self, engine_id: str, transfer_id: str, rank: int) -> Ledger | None:
        pub = self._publish(engine_id, transfer_id, rank)
        return pub.ledger if pub is not None else None

    def ledgers_of(self, worker_id: str) -> list[Ledger]:
        """The books of a worker's publishes still pending."""
        return [p.ledger for t in self._transfers.values() for p in t.publishes.values()
                if p.worker_id == worker_id and p.ledger is not None]

    def held_blocks(self) -> int:
        """Source blocks of local workers that pending publishes cover."""
        # copies first: the metrics endpoint asks from its own thread
        return sum(len(p.block_ids) for t in list(self._transfers.values()) for p in list(t.publishes.values()))

    def has_publish(self, engine_id: str, transfer_id: str, rank: int) -> bool:
        return self._publish(engine_id, transfer_id, rank) is not None

    def views(self, now: float) -> list[SendView]:
        return [view_of(t, now) for t in self._transfers.values()]


def _stop(t: SendTransfer, pub: Publish, reg_ids: set[int], reason: str) -> list[Action]:
    """StopWrite for the legs of ``pub`` into ``reg_ids`` still written layer group by layer group."""
    out: list[Action] = []
    for rid in [r for r in reg_ids if r in pub.staged]:
        pub.staged.discard(rid)
        if pub.legs.get(rid) is LegState.POSTED:
            out.append(StopWrite(LegKey(t.engine_id, t.transfer_id, pub.rank, rid), reason))
    return out
