"""The decode side of the rendezvous: one record per Expect, counting producer ranks (see core/__init__.py)."""

from __future__ import annotations

import itertools
import secrets
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import msgspec

from . import notif
from .actions import Action, Deliver, Dropped, ReadKey, SendReadFailed, SendRegister, SendWithdraw, StartRead
from .deadlines import Deadlines
from .errors import AlreadyExists, InvalidArgument, NotFound, PermissionDenied
from .ledger import Ledger, Moved
from .table import Move, State, step
from .topology import block_parts, check_tp_pair, writer_sources
from .types import Completion, CompletionKind, Expect, FailureCode, TransferMode, WorkerInfo


class RecvState(State):
    REGISTERING = "registering"  # Register sent to the prefill daemon, no answer yet
    REGISTERED = "registered"    # the prefill daemon holds the registration; waiting for WRITEs


_PUSH, _PULL = TransferMode.PUSH, TransferMode.PULL
MODES = (_PUSH, _PULL)  # a receive's mode (UNSPECIFIED reads as PUSH at the boundary)
GONE, DROP, STAY = Move.GONE, Move.DROP, Move.STAY
# How a receive ends early, in any mode and state: its Register failed or the prefill side failed
# it, aborted, its worker gone, the daemon stopping, its prefill daemon lost, expired, or replaced
# by a newer Expect of the same (worker, transfer) with other blocks.
RECV_ENDS = ("failed", "abort", "worker_gone", "shutdown", "producer_lost", "timeout", "replaced")
RecvKey = tuple[TransferMode | None, RecvState | None]  # (mode, state); (None, None): no such receive
# The decode side's receive, by mode: ((mode, state), event) -> the state it moves to, GONE, DROP
# or STAY. A WRITE may land (notified) before the answer to Register does; an offer may come
# before it too. ``landed``: the last expected producer rank landed (FINISHED_RECEIVING). A READ
# starts only from an offer (which moves to REGISTERED), so no READ ends in REGISTERING; a WRITE
# notification for a pull registration is dropped, and an offer for a push one is illegal. An
# offer for no receive at all is NotFound, checked before the table (the caller named it).
RECV_TABLE: dict[tuple[RecvKey, str], RecvState | Move] = {
    **{((m, st), "registered"): RecvState.REGISTERED for m in MODES for st in RecvState},
    **{((m, st), "expect"): STAY for m in MODES for st in RecvState},  # a retry (else: replaced)
    **{((m, st), e): GONE for m in MODES for st in RecvState for e in RECV_ENDS},
    **{((_PUSH, st), "notified"): st for st in RecvState},
    **{((_PUSH, st), "landed"): GONE for st in RecvState},
    **{((_PULL, st), "offer"): RecvState.REGISTERED for st in RecvState},
    **{((_PULL, st), "notified"): DROP for st in RecvState},
    ((_PULL, RecvState.REGISTERED), "read_done"): RecvState.REGISTERED,
    ((_PULL, RecvState.REGISTERED), "read_failed"): GONE,
    ((_PULL, RecvState.REGISTERED), "landed"): GONE,
    ((None, None), "expect"): RecvState.REGISTERING,
    ((None, None), "registered"): DROP,   # it ended before the answer to its Register
    ((None, None), "notified"): DROP,     # a stray or late notification
    ((None, None), "failed"): DROP,       # it ended already
    ((None, None), "read_done"): DROP,    # it ended while its READ was in flight
    ((None, None), "read_failed"): STAY,  # the prefill side is told all the same (it holds its blocks)
    ((None, None), "abort"): STAY,        # nothing to abort
}


def recv_step(mode: TransferMode | None, state: RecvState | None, event: str, transfer_id: str) -> RecvState | Move:
    return step(RECV_TABLE, (mode, state), event, transfer_id)


class ExpectLease(msgspec.Struct, frozen=True, gc=False):
    """A receive's deadline (expect_timeout_s): the deadline key of the decode side."""

    registration_id: int


@dataclass(slots=True)
class _Recv:
    worker_id: str
    transfer_id: str
    registration_id: int
    block_ids: tuple[int, ...]
    producer_address: str
    producer_engine_id: str
    expected: frozenset[int]
    created: float
    state: RecvState = RecvState.REGISTERING
    landed: set[int] = field(default_factory=set)
    mode: TransferMode = TransferMode.PUSH
    producer_tp_size: int = 1
    consumer_rank: int = 0
    consumer_tp_size: int = 1
    reading: set[int] = field(default_factory=set)  # pull: producer ranks whose READ is posted
    # progressive push: producer rank -> (its layer groups, bitmask of those notified so far)
    layers: dict[int, tuple[int, int]] = field(default_factory=dict)
    ledger: Ledger | None = None  # its books (set by RecvSide.expect)


@dataclass(frozen=True, slots=True)
class RecvView:
    """What the status API shows of one decode-side transfer."""

    worker_id: str
    transfer_id: str
    registration_id: int
    state: str
    age_s: float
    waiting_for: str
    num_blocks: int
    producer_address: str
    mode: str = "push"


class RecvSide:
    """Decode-node rendezvous: one record per Expect, done when every producer rank has landed."""

    def __init__(self, expect_timeout_s: float, first_registration_id: int = 1, random_ids: bool = False) -> None:
        """``random_ids``: registration ids are random 63-bit numbers, not a sequence. The prefill
        daemon a registration goes to learns its id; a third party cannot guess it, so failure
        notices and offers that name it come from that daemon (the daemon itself checks the sender)."""
        self.expect_timeout_s = expect_timeout_s
        self._next_id = itertools.count(first_registration_id)
        self._random_ids = random_ids
        self._random = _random_ids()
        # FAILED completions deferred until the prefill daemon answers a withdrawal (no WRITE into
        # the blocks is in flight any more), by registration id; until then the (worker, transfer)
        # may not be Expected again.
        self._ending: dict[int, Deliver] = {}
        self._ending_keys: set[tuple[str, str]] = set()
        self._by_key: dict[tuple[str, str], _Recv] = {}
        self._by_reg: dict[int, _Recv] = {}
        self._deadlines: Deadlines[ExpectLease] = Deadlines()
        self.stray_notifications = 0

    def __len__(self) -> int:
        return len(self._by_reg)

    def next_deadline(self) -> float | None:
        return self._deadlines.next()

    def withdraw_answered(self, registration_id: int) -> list[Action]:
        """The prefill daemon answered a SendWithdraw (or could not be reached): deliver the FAILED
        deferred until then; the transfer id may be Expected again."""
        d = self._ending.pop(registration_id, None)
        if d is None:
            return []
        self._ending_keys.discard((d.worker_id, d.completion.transfer_id))
        return [d]

    def sent_to(self, registration_id: int) -> tuple[str, str] | None:
        """(transfer id, producer address) of a pending registration, or None (failure notices and
        offers must come from that prefill daemon)."""
        r = self._by_reg.get(registration_id)
        return None if r is None else (r.transfer_id, r.producer_address)

    def pending(self, worker_id: str, transfer_id: str) -> bool:
        """The worker's Expect of this transfer is pending (or still ending) here."""
        key = (worker_id, transfer_id)
        return key in self._by_key or key in self._ending_keys

    def producer_addresses(self) -> set[str]:
        """Prefill daemons that pending receives wait on (we send them heartbeats)."""
        return {r.producer_address for r in self._by_reg.values()}

    def views(self, now: float) -> list[RecvView]:
        out = []
        for r in self._by_reg.values():
            if r.state is RecvState.REGISTERING:
                waiting = f"prefill daemon {r.producer_address} to accept the registration"
            elif r.mode is TransferMode.PULL:
                offers = sorted(r.expected - r.landed - r.reading)
                waiting = ", ".join(([f"READ(s) of producer rank(s) {sorted(r.reading)}"] if r.reading else [])
                                    + ([f"offer(s) for producer rank(s) {offers}"] if offers else []))
            else:
                missing = sorted(r.expected - r.landed)
                waiting = f"WRITE notification(s) from producer rank(s) {missing}"
            out.append(RecvView(r.worker_id, r.transfer_id, r.registration_id, r.state.value,
                                now - r.created, waiting, len(r.block_ids), r.producer_address,
                                r.mode.name.lower()))
        return out

    def expect(self, now: float, w: WorkerInfo, cmd: Expect) -> list[Action]:
        """Decode worker ``w`` allocated destination blocks: register them with the prefill side.

        ``cmd.skip_tokens``: the worker holds the prompt's first tokens already (``block_ids`` start
        there). Its regions all replicated (MLA): fewer producer ranks write to it."""
        worker_id, consumer_rank, consumer_tp_size, layouts = w.worker_id, w.tp_rank, w.tp_size, w.regions
        transfer_id, blocks, producer_address = cmd.transfer_id, tuple(cmd.block_ids), cmd.producer_address
        producer_engine_id, producer_tp_size = cmd.producer_engine_id, cmd.producer_tp_size
        mode = TransferMode.parse(cmd.transfer_mode)
        mla = bool(layouts) and all(r.replicated for r in layouts)
        if not transfer_id:
            raise InvalidArgument("transfer_id must not be empty")
        if (worker_id, transfer_id) in self._ending_keys:
            raise AlreadyExists(f"transfer {transfer_id!r} is still ending on this worker (its withdrawal is "
                                "not answered yet, a WRITE may be landing): Expect it again after its FAILED")
        if not blocks:
            raise InvalidArgument(f"transfer {transfer_id!r}: block_ids must not be empty")
        if not producer_address:
            raise InvalidArgument(f"transfer {transfer_id!r}: producer_address must not be empty")
        check_tp_pair(producer_tp_size, consumer_tp_size)
        actions: list[Action] = []
        ledger = Ledger("recv", worker_id, w.engine_id, transfer_id, len(blocks), now, len(blocks) * w.block_bytes,
                        producer_address, traceparent=cmd.traceparent)
        old = self._by_key.get((worker_id, transfer_id))
        if old is not None:
            recv_step(old.mode, old.state, "expect", transfer_id)  # STAY
            if (old.block_ids, old.producer_address, old.producer_engine_id, old.mode) == (
                blocks, producer_address, producer_engine_id, mode):
                return []  # a retried Expect: idempotent
            # Re-submitted after preemption with new blocks: the new registration replaces the old
            # (the same transfer: its books go on, from when it was first taken).
            if old.ledger is not None:
                ledger.taken = old.ledger.taken
            actions += self._end(old, "replaced", FailureCode.SUPERSEDED, "replaced by a newer Expect", "")
        rid = next(self._next_id)
        if self._random_ids:
            rid = next(self._random)
            while rid in self._by_reg:
                rid = next(self._random)
        state = recv_step(None, None, "expect", transfer_id)
        assert isinstance(state, RecvState)
        r = _Recv(worker_id, transfer_id, rid, blocks, producer_address, producer_engine_id,
                  frozenset(writer_sources(consumer_rank, producer_tp_size, consumer_tp_size, mla)),
                  now, state, mode=mode, producer_tp_size=producer_tp_size, consumer_rank=consumer_rank,
                  consumer_tp_size=consumer_tp_size, ledger=ledger)
        self._by_key[(worker_id, transfer_id)] = r
        self._by_reg[rid] = r
        self._deadlines.arm(ExpectLease(rid), now + self.expect_timeout_s)
        actions.append(SendRegister(producer_address, rid, worker_id, transfer_id, producer_engine_id,
                                    producer_tp_size, consumer_rank, consumer_tp_size, blocks, mode, cmd.skip_tokens))
        return actions

    def registered(self, registration_id: int) -> list[Action]:
        """The prefill daemon accepted the registration."""
        r = self._by_reg.get(registration_id)
        nxt = recv_step(*self._key(r), "registered", r.transfer_id if r else "")
        if nxt is Move.DROP:
            return [Dropped("registered", "", f"registration {registration_id} ended before its Register answer")]
        assert r is not None and isinstance(nxt, RecvState)
        r.state = nxt
        return []

    def notified(self, registration_id: int, producer_rank: int, first: int = 0, count: int = 1,
                 total: int = 1, now: float = 0.0) -> list[Action]:
        """A WRITE's notification arrived: that producer rank's bytes have landed, or (progressive
        push) its layers ``first`` to ``first + count`` of ``total``; the rank has landed once every
        one of its layers has, so decode never takes a partial KV for a complete one."""
        r = self._by_reg.get(registration_id)
        mine = r if r is not None and producer_rank in r.expected else None
        if recv_step(*self._key(mine), "notified", r.transfer_id if r else "") is Move.DROP:
            self.stray_notifications += 1
            return [Dropped("notified", r.transfer_id if r else "", f"no pending push registration "
                            f"{registration_id} expects producer rank {producer_rank}")]
        assert mine is not None
        if mine.ledger is not None and now:
            mine.ledger.written = now
        if total == 1 or producer_rank in mine.landed:
            return self._landed(mine, producer_rank)  # (again: counts once)
        want, got = mine.layers.get(producer_rank, (total, 0))
        bits = ((1 << count) - 1) << first
        if want != total or got & bits or first < 0 or count < 1 or first + count > total:
            self.stray_notifications += 1
            return [Dropped("notified", mine.transfer_id, f"layers {first}+{count} of {total} from producer rank "
                            f"{producer_rank} do not fit those notified ({got:#x} of {want})")]
        got |= bits
        if got != (1 << total) - 1:
            mine.layers[producer_rank] = (total, got)
            return []
        mine.layers.pop(producer_rank, None)
        return self._landed(mine, producer_rank)

    def ledger(self, worker_id: str, transfer_id: str) -> Ledger | None:
        r = self._by_key.get((worker_id, transfer_id))
        return r.ledger if r is not None else None

    def ledgers_of(self, worker_id: str) -> list[Ledger]:
        """The books of a worker's receives still pending."""
        return [r.ledger for r in self._by_reg.values() if r.worker_id == worker_id and r.ledger is not None]

    def held_blocks(self) -> int:
        """Destination blocks of local workers that pending receives cover (ending ones too: their
        worker holds them until told FAILED)."""
        # copies first: the metrics endpoint asks from its own thread
        return (sum(len(r.block_ids) for r in list(self._by_reg.values()))
                + sum(len(d.completion.block_ids) for d in list(self._ending.values())))

    def offer(self, registration_id: int, transfer_id: str, producer_rank: int,
              src_blocks: Iterable[int], producer_agent: str = "") -> list[Action]:
        """Pull mode: the prefill daemon offers a producer rank's source blocks; READ them.

        The runtime has checked that the caller is the daemon the registration was sent to. Here:
        the registration is pending, in pull mode, under this transfer id, expects this producer
        rank, and the offer covers exactly as many blocks as it registered. Only then is a READ
        started, always into this registration's own blocks. A repeated offer is ignored.
        """
        src = tuple(src_blocks)
        r = self._by_reg.get(registration_id)
        if r is None:
            raise NotFound(f"registration {registration_id} is not pending here (finished, failed or withdrawn)")
        if r.transfer_id != transfer_id:
            raise PermissionDenied(f"registration {registration_id} is not for transfer {transfer_id[:256]!r}")
        nxt = recv_step(r.mode, r.state, "offer", transfer_id)
        assert isinstance(nxt, RecvState)
        if producer_rank not in r.expected:
            raise InvalidArgument(f"transfer {transfer_id!r}: producer rank {producer_rank} does not feed this "
                                  f"registration (expects ranks {sorted(r.expected)})")
        if len(src) != len(r.block_ids):
            raise InvalidArgument(f"transfer {transfer_id!r}: offer of {len(src)} source blocks for "
                                  f"{len(r.block_ids)} destination blocks")
        if producer_rank in r.reading or producer_rank in r.landed:
            return [Dropped("offer", transfer_id, f"producer rank {producer_rank} was offered already")]
        r.reading.add(producer_rank)
        r.state = nxt
        key = ReadKey(r.producer_address, r.transfer_id, registration_id, producer_rank)
        src_part, dst_part = block_parts(producer_rank, r.producer_tp_size, r.consumer_rank, r.consumer_tp_size)
        return [StartRead(key, r.worker_id, r.producer_tp_size, r.consumer_rank, r.consumer_tp_size, src,
                          r.block_ids, producer_agent, notif.encode_read(registration_id, producer_rank),
                          src_part, dst_part)]

    def read_done(self, key: ReadKey, ok: bool, reason: str = "", result: Moved | None = None,
                  now: float = 0.0) -> list[Action]:
        """Pull mode: a READ completed (the rank has landed) or failed (the receive fails, prefill is told).

        A failed READ is reported to the prefill daemon even when the receive already ended (abort,
        timeout), since the prefill side holds its blocks until it hears how the READ ended.
        """
        r = self._by_reg.get(key.registration_id)
        mine = r if r is not None and key.producer_rank in r.reading else None
        tid = mine.transfer_id if mine else key.transfer_id
        nxt = recv_step(*self._key(mine), "read_done" if ok else "read_failed", tid)
        if nxt is Move.DROP:
            return [Dropped("read_done", key.transfer_id, "the receive ended while its READ was in flight")]
        if mine is not None and mine.ledger is not None and result is not None:
            mine.ledger.moved(result, now)
        if ok:
            assert mine is not None
            mine.reading.discard(key.producer_rank)
            return self._landed(mine, key.producer_rank)
        actions: list[Action] = [SendReadFailed(key, reason)]
        if mine is not None:
            mine.reading.discard(key.producer_rank)
            actions.append(self._fail(mine, "read_failed", FailureCode.TRANSFER_ERROR,
                                      f"READ from producer rank {key.producer_rank} failed: {reason}"))
        return actions

    def failed(self, registration_id: int, code: FailureCode, reason: str) -> list[Action]:
        """The prefill side (or our Register call) failed this registration."""
        r = self._by_reg.get(registration_id)
        if recv_step(*self._key(r), "failed", r.transfer_id if r else "") is Move.DROP:
            return [Dropped("failed", "", f"registration {registration_id} already ended")]
        assert r is not None
        return [self._fail(r, "failed", code, reason)]

    def abort(self, worker_id: str, transfer_id: str) -> tuple[bool, list[Action]]:
        r = self._by_key.get((worker_id, transfer_id))
        if recv_step(*self._key(r), "abort", transfer_id) is Move.STAY:
            return False, []
        assert r is not None
        return True, self._end(r, "abort", FailureCode.ABORTED, "aborted by the decode engine", "deferred")

    def worker_gone(self, worker_id: str) -> list[Action]:
        return [a for r in [r for r in self._by_reg.values() if r.worker_id == worker_id]
                for a in self._end(r, "worker_gone", FailureCode.WORKER_GONE, "decode worker is gone", "")]

    def shutdown(self, reason: str) -> list[Action]:
        """The daemon is stopping: every receive fails now, and its registration is withdrawn."""
        return [a for r in list(self._by_reg.values()) for a in self._end(r, "shutdown", FailureCode.SHUTDOWN,
                                                                           reason, "now")]

    def producer_lost(self, producer_address: str, code: FailureCode, reason: str,
                      registered_only: bool = False) -> list[Action]:
        """The prefill daemon at this address died, restarted or became unreachable.

        After a restart only registrations the old instance had accepted are lost
        (``registered_only``); those still being registered go to the new instance.
        """
        actions: list[Action] = []
        for r in [r for r in self._by_reg.values() if r.producer_address == producer_address
                  and not (registered_only and r.state is RecvState.REGISTERING)]:
            actions.append(self._fail(r, "producer_lost", code, reason))
        return actions

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for key in self._deadlines.pop_due(now):
            r = self._by_reg[key.registration_id]
            msg = (f"transfer {r.transfer_id!r} not received within {self.expect_timeout_s:g}s "
                   f"(landed ranks {sorted(r.landed)} of {sorted(r.expected)}, state {r.state.value})")
            actions += self._end(r, "timeout", FailureCode.TIMEOUT, msg, "deferred")
        return actions

    @staticmethod
    def _key(r: _Recv | None) -> RecvKey:
        return (None, None) if r is None else (r.mode, r.state)

    def _landed(self, r: _Recv, producer_rank: int) -> list[Action]:
        """A producer rank's bytes landed; the last one finishes the receive."""
        r.landed.add(producer_rank)
        if r.landed != r.expected:
            return []
        self._remove(r, "landed")
        return [Deliver(r.worker_id, Completion(CompletionKind.FINISHED_RECEIVING, r.transfer_id), r.ledger)]

    def _end(self, r: _Recv, event: str, code: FailureCode, reason: str, fail: str) -> list[Action]:
        """End a receive and withdraw its registration. Its FAILED goes ``"now"``, or ``"deferred"``
        until the prefill daemon answers the withdrawal (no WRITE into the blocks is in flight any
        more; until then the (worker, transfer) may not be Expected again), or not at all (``""``)."""
        d = self._fail(r, event, code, reason)
        if fail == "deferred":
            self._ending[r.registration_id] = d
            self._ending_keys.add((r.worker_id, r.transfer_id))
        out: list[Action] = [d] if fail == "now" else []
        return [*out, SendWithdraw(r.producer_address, r.transfer_id, r.registration_id, code, reason)]

    def _remove(self, r: _Recv, event: str) -> None:
        recv_step(r.mode, r.state, event, r.transfer_id)  # -> GONE
        del self._by_reg[r.registration_id]
        del self._by_key[(r.worker_id, r.transfer_id)]
        self._deadlines.disarm(ExpectLease(r.registration_id))

    def _fail(self, r: _Recv, event: str, code: FailureCode, reason: str) -> Deliver:
        """End a receive (``event``) in failure: its FAILED, for the caller to deliver or defer."""
        self._remove(r, event)
        return Deliver(r.worker_id, Completion(CompletionKind.FAILED, r.transfer_id, code, reason, r.block_ids),
                       r.ledger)


def _random_ids(batch: int = 512) -> Iterator[int]:
    """Random 63-bit registration ids, never 0, from the OS's CSPRNG: ``batch`` of them per read (one
    getrandom call per 512 Expects, not one each)."""
    while True:
        for v in struct.unpack(f"<{batch}Q", secrets.token_bytes(8 * batch)):
            yield (v >> 1) or 1
