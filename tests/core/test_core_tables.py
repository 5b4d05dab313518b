"""Every row of the rendezvous' transition tables, driven through the sides' public events, and
every (state, event) a table leaves out, which is an IllegalTransition naming state and event.

Each row has a scenario: it builds a record in the row's state, fires the event through the
side's API, and checks that the side consulted exactly that row (a recorder wraps the tables'
``step``) and that the record ended where the row says: in the row's state, gone, unchanged and
reported as Dropped (DROP), or unchanged and unreported (STAY). A row without a scenario fails.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from support.core import WorkerRef, leg_state, publish_state, registration_state

import kvpushd.core.recv as recv_mod
import kvpushd.core.send as send_mod
from kvpushd.core import table as table_mod
from kvpushd.core.actions import (
    Action,
    Deliver,
    Dropped,
    LegKey,
    ReadKey,
    Registration,
    SendReadFailed,
    SendRegister,
    StartRead,
    StartWrite,
)
from kvpushd.core.errors import FailedPrecondition, IllegalTransition
from kvpushd.core.recv import RECV_TABLE, RecvSide, RecvState
from kvpushd.core.send import SendSide
from kvpushd.core.sendstate import LEG_TABLE, PUB_TABLE, REG_TABLE, LegState, PubState, RegState
from kvpushd.core.table import Move
from kvpushd.core.types import CompletionKind, Expect, FailureCode, Publish, TransferMode

T0 = 1000.0
PUB_TO, REG_TO, EXP_TO = 30.0, 20.0, 40.0
ENGINE, ORIGIN, ADDR, TID = "prefill-engine", "decode-instance", "prefill-node:7070", "req-1"
SRC, DST = (11, 12, 13), (21, 22, 23)
TABLES: dict[str, dict[Any, Any]] = {"pub": PUB_TABLE, "reg": REG_TABLE, "leg": LEG_TABLE, "recv": RECV_TABLE}


# -- a recorder of the rows the sides consult ------------------------------------------------------


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any, str]]:
    calls: list[tuple[str, Any, str]] = []
    names = {id(t): n for n, t in TABLES.items()}

    def recording(table: Any, state: Any, event: str, transfer_id: str = "") -> Any:
        calls.append((names[id(table)], state, event))
        return table_mod.step(table, state, event, transfer_id)

    monkeypatch.setattr(send_mod, "step", recording)
    monkeypatch.setattr(recv_mod, "step", recording)
    return calls


# -- the prefill side ------------------------------------------------------------------------------


def reg(rid: int = 7, crank: int = 0, ctp: int = 1, ptp: int = 1, mode: TransferMode = TransferMode.PUSH,
        blocks: tuple[int, ...] = DST) -> Registration:
    return Registration(rid, ORIGIN, TID, ENGINE, ptp, "agent", crank, ctp, blocks, mode)


@dataclass
class Send:
    """A prefill side with publish rank 0 (worker pw) of TID and what the last event returned."""

    s: SendSide = field(default_factory=lambda: SendSide(PUB_TO, REG_TO))
    legs: list[LegKey] = field(default_factory=list)
    out: list[Action] = field(default_factory=list)

    def run(self, actions: list[Action]) -> list[Action]:
        self.legs += [a.leg for a in actions if isinstance(a, StartWrite)]
        self.out = actions
        return actions

    def publish(self, tp: int = 1) -> None:
        self.run(self.s.publish(T0, WorkerRef("pw", ENGINE, 0, tp), Publish(TID, SRC)))

    def register(self, r: Registration) -> None:
        self.run(self.s.register(T0, r))

    @property
    def pub(self) -> PubState | None:
        return publish_state(self.s, ENGINE, TID, 0)

    def failed_with(self, code: FailureCode) -> bool:
        return any(isinstance(a, Deliver) and a.completion.kind is CompletionKind.FAILED
                   and a.completion.code is code for a in self.out)


def waiting_with_a_leg(ctp: int = 2) -> Send:
    """A WAITING publish whose WRITE into consumer rank 0 is posted (consumer TP 2: rank 1 not registered)."""
    x = Send()
    x.register(reg(7, 0, ctp))
    x.publish()
    assert len(x.legs) == 1 and x.pub is PubState.WAITING
    return x


def failing() -> Send:
    """A FAILING publish (aborted) kept by its posted WRITE."""
    x = waiting_with_a_leg()
    found, _ = x.s.abort("pw", ENGINE, TID)
    assert found and x.pub is PubState.FAILING
    return x


# How each publish failure is brought about, from a publish in a given state (a scenario of
# its own setup and firing), and the failure code it leaves when it was the first.
def pub_failure(event: str, start: PubState) -> Callable[[], tuple[Send, FailureCode]]:
    def run() -> tuple[Send, FailureCode]:
        if event == "timeout" and start is PubState.WAITING:  # nothing holds the lease
            x = Send()
            x.publish()
            x.run(x.s.tick(T0 + PUB_TO + 1))
            return x, FailureCode.TIMEOUT
        if event == "mismatch":  # the decode side expects producer TP 2
            x = Send()
            x.publish()
            x.register(reg(7, 0, 1, ptp=2))
            return x, FailureCode.LAYOUT_MISMATCH
        x = waiting_with_a_leg() if start is PubState.WAITING else failing()
        if event == "abort":
            x.run(x.s.abort("pw", ENGINE, TID)[1])
        elif event == "worker_gone":
            x.run(x.s.worker_gone("pw"))
        elif event == "timeout":  # the aborted publish's lease runs out: its cause stands
            x.run(x.s.tick(T0 + PUB_TO + 1))
        elif event == "leg_failed":
            x.run(x.s.write_done(x.legs[0], False, "injected"))
        elif event == "target_failed":  # a registration it writes into: withdrawn (or a new one, once failing)
            if start is PubState.FAILING:
                x.register(reg(8, 0, 2))
            x.run(x.s.withdraw(ORIGIN, TID, 8 if start is PubState.FAILING else 7, FailureCode.ABORTED, "gone"))
        elif event == "decline":
            x.run(x.s.decline(T0, ORIGIN, ENGINE, TID, "no"))
        elif event == "shutdown":
            x.run(x.s.shutdown("stopping"))
        else:  # pragma: no cover
            raise AssertionError(event)
        return x, {"abort": FailureCode.ABORTED, "worker_gone": FailureCode.WORKER_GONE,
                   "leg_failed": FailureCode.TRANSFER_ERROR, "target_failed": FailureCode.ABORTED,
                   "decline": FailureCode.ABORTED, "shutdown": FailureCode.SHUTDOWN,
                   "timeout": FailureCode.TIMEOUT}[event]
    return run


def pub_rows() -> Iterator[tuple[Any, Callable[[list[Any]], None]]]:
    def new(seen: list[Any]) -> None:
        x = Send()
        x.publish()
        assert ("pub", None, "publish") in seen and x.pub is PubState.WAITING

    def retry(start: PubState) -> Callable[[list[Any]], None]:
        def run(seen: list[Any]) -> None:
            x = waiting_with_a_leg() if start is PubState.WAITING else failing()
            seen.clear()
            assert x.s.publish(T0, WorkerRef("pw", ENGINE, 0, 1), Publish(TID, SRC)) == []
            assert seen == [("pub", start, "publish")] and x.pub is start
        return run

    def written(seen: list[Any]) -> None:
        x = waiting_with_a_leg(ctp=1)
        seen.clear()
        x.run(x.s.write_done(x.legs[0], True))
        assert ("pub", PubState.WAITING, "written") in seen and x.pub is None
        assert [a.completion.kind for a in x.out if isinstance(a, Deliver)] == [CompletionKind.FINISHED_SENDING]

    def settled(seen: list[Any]) -> None:
        x = failing()
        seen.clear()
        x.run(x.s.write_done(x.legs[0], True))
        assert ("pub", PubState.FAILING, "settled") in seen and x.pub is None and x.failed_with(FailureCode.ABORTED)

    def fails(event: str, start: PubState) -> Callable[[list[Any]], None]:
        def run(seen: list[Any]) -> None:
            x, code = pub_failure(event, start)()
            assert ("pub", start, event) in seen, seen
            if start is PubState.WAITING:  # failing now, or already reported (nothing was in flight)
                assert x.pub is PubState.FAILING or x.failed_with(code)
            else:  # the first cause stands
                assert x.pub is PubState.FAILING or x.failed_with(FailureCode.ABORTED)
        return run

    yield (None, "publish"), new
    for st in PubState:
        yield (st, "publish"), retry(st)
    yield (PubState.WAITING, "written"), written
    yield (PubState.FAILING, "settled"), settled
    for (st, ev), _ in PUB_TABLE.items():
        if st is not None and ev not in ("publish", "written", "settled"):
            yield (st, ev), fails(ev, st)


def reg_rows() -> Iterator[tuple[Any, Callable[[list[Any]], None]]]:
    def new(seen: list[Any]) -> None:
        x = Send()
        x.register(reg())
        assert ("reg", None, "register") in seen and registration_state(x.s, ORIGIN, 7) is RegState.HELD

    def retry(seen: list[Any]) -> None:
        x = Send()
        x.register(reg())
        seen.clear()
        assert x.s.register(T0, reg()) == []
        assert seen == [("reg", RegState.HELD, "register")]

    def withdrawn_twice(seen: list[Any]) -> None:
        x = Send()
        assert all(isinstance(a, Dropped) for a in x.s.withdraw(ORIGIN, TID, 7, FailureCode.ABORTED, "x"))
        assert seen == [("reg", None, "withdraw")]

    def written(seen: list[Any]) -> None:
        x = waiting_with_a_leg(ctp=1)
        x.run(x.s.write_done(x.legs[0], True))
        assert ("reg", RegState.HELD, "written") in seen and registration_state(x.s, ORIGIN, 7) is None

    fire: dict[str, Callable[[Send], None]] = {
        "withdraw": lambda x: x.run(x.s.withdraw(ORIGIN, TID, 7, FailureCode.ABORTED, "x")),
        "replaced": lambda x: x.register(reg(8)),
        "timeout": lambda x: x.run(x.s.tick(T0 + REG_TO + 1)),
        "void": lambda x: (x.publish(), x.run(x.s.write_done(x.legs[0], False, "injected"))),
        "mismatch": lambda x: x.publish(),  # the registration expects producer TP 2
        "decline": lambda x: x.run(x.s.decline(T0, ORIGIN, ENGINE, TID, "no")),
        "origin_lost": lambda x: x.run(x.s.origin_lost(ORIGIN, "restarted")),
        "shutdown": lambda x: x.run(x.s.shutdown("stopping")),
        # the publish binds the transfer to another decode node than the one that registered
        "unbound": lambda x: x.run(x.s.publish(T0, WorkerRef("pw", ENGINE, 0, 1),
                                               Publish(TID, SRC, consumer_node_id="decode-b"))),
    }

    def ends(event: str) -> Callable[[list[Any]], None]:
        def run(seen: list[Any]) -> None:
            x = Send()
            x.register(reg(7, ptp=2) if event == "mismatch" else reg())
            seen.clear()
            fire[event](x)
            assert ("reg", RegState.HELD, event) in seen and registration_state(x.s, ORIGIN, 7) is None
        return run

    yield (None, "register"), new
    yield (RegState.HELD, "register"), retry
    yield (None, "withdraw"), withdrawn_twice
    yield (RegState.HELD, "written"), written
    for (st, ev), _ in REG_TABLE.items():
        if st is RegState.HELD and ev in fire:
            yield (st, ev), ends(ev)


def leg_rows() -> Iterator[tuple[Any, Callable[[list[Any]], None]]]:
    def start(seen: list[Any]) -> None:
        x = waiting_with_a_leg()
        assert ("leg", None, "start") in seen and leg_state(x.s, x.legs[0]) is LegState.POSTED

    def done(ok: bool, twice: bool) -> Callable[[list[Any]], None]:
        def run(seen: list[Any]) -> None:
            x = waiting_with_a_leg()  # consumer rank 1 never registers: the publish stays
            if twice:
                x.run(x.s.write_done(x.legs[0], True))
            seen.clear()
            acts = x.s.write_done(x.legs[0], ok, "" if ok else "injected")
            before = LegState.DONE if twice else LegState.POSTED
            assert seen[0] == ("leg", before, "write_done" if ok else "write_failed")
            if twice:
                assert acts and all(isinstance(a, Dropped) for a in acts)
                assert leg_state(x.s, x.legs[0]) is LegState.DONE
            else:
                assert leg_state(x.s, x.legs[0]) is (LegState.DONE if ok else None)
        return run

    def gone(ok: bool) -> Callable[[list[Any]], None]:
        def run(seen: list[Any]) -> None:
            acts = SendSide(PUB_TO, REG_TO).write_done(LegKey(ENGINE, TID, 0, 7), ok)
            assert seen == [("leg", None, "write_done" if ok else "write_failed")]
            assert acts and all(isinstance(a, Dropped) for a in acts)
        return run

    yield (None, "start"), start
    yield (LegState.POSTED, "write_done"), done(True, False)
    yield (LegState.POSTED, "write_failed"), done(False, False)
    yield (LegState.DONE, "write_done"), done(True, True)
    yield (LegState.DONE, "write_failed"), done(False, True)
    yield (None, "write_done"), gone(True)
    yield (None, "write_failed"), gone(False)


# -- the decode side -------------------------------------------------------------------------------


@dataclass
class Recv:
    r: RecvSide = field(default_factory=lambda: RecvSide(EXP_TO, first_registration_id=50))
    mode: TransferMode = TransferMode.PUSH
    ptp: int = 1
    rid: int = 0
    out: list[Action] = field(default_factory=list)

    def expect(self, blocks: tuple[int, ...] = DST) -> list[Action]:
        return self.r.expect(T0, WorkerRef("dw", "", 0, 1),
                             Expect(TID, blocks, ADDR, ENGINE, self.ptp, transfer_mode=self.mode))

    @property
    def state(self) -> RecvState | None:
        views = [v for v in self.r.views(T0) if v.registration_id == self.rid]
        return RecvState(views[0].state) if views else None

    def offer(self, rank: int = 0) -> StartRead:
        (a,) = self.r.offer(self.rid, TID, rank, SRC)
        assert isinstance(a, StartRead)
        return a


def receive(mode: TransferMode | None, st: RecvState | None, ptp: int = 1) -> Recv:
    x = Recv(mode=mode or TransferMode.PUSH, ptp=ptp)
    if mode is None:
        return x
    (sr,) = x.expect()
    assert isinstance(sr, SendRegister)
    x.rid = sr.registration_id
    if st is RecvState.REGISTERED:
        x.r.registered(x.rid)
    assert x.state is st
    return x


RECV_FIRE: dict[str, Callable[[Recv], list[Action]]] = {
    "registered": lambda x: x.r.registered(x.rid or 999),
    "expect": lambda x: x.expect(),
    "failed": lambda x: x.r.failed(x.rid or 999, FailureCode.PEER_REJECTED, "no"),
    "abort": lambda x: x.r.abort("dw", TID)[1],
    "worker_gone": lambda x: x.r.worker_gone("dw"),
    "shutdown": lambda x: x.r.shutdown("stopping"),
    "producer_lost": lambda x: x.r.producer_lost(ADDR, FailureCode.PEER_UNREACHABLE, "reset"),
    "timeout": lambda x: x.r.tick(T0 + EXP_TO + 1),
    "replaced": lambda x: x.expect((1, 2, 3)),
    "notified": lambda x: x.r.notified(x.rid or 999, 0),
    "landed": lambda x: x.r.notified(x.rid, 0) if x.mode is TransferMode.PUSH else x.r.read_done(x.offer().key, True),
    "offer": lambda x: [x.offer()],
    "read_done": lambda x: x.r.read_done(x.offer().key if x.rid else ReadKey(ADDR, TID, 999, 0), True),
    "read_failed": lambda x: x.r.read_done(x.offer().key if x.rid else ReadKey(ADDR, TID, 999, 0), False, "bad"),
}


def recv_rows() -> Iterator[tuple[Any, Callable[[list[Any]], None]]]:
    def row(key: Any, event: str, want: Any) -> Callable[[list[Any]], None]:
        (mode, st) = key

        def run(seen: list[Any]) -> None:
            # two producer ranks where one landing must leave the receive open
            x = receive(mode, st, ptp=2 if event in ("notified", "read_done") and want is not Move.DROP else 1)
            seen.clear()
            acts = RECV_FIRE[event](x)
            assert ("recv", key, event) in seen, seen
            if want is Move.GONE:
                assert x.state is None and len(x.r) == (1 if event == "replaced" else 0)
            elif want is Move.DROP:
                assert acts and all(isinstance(a, Dropped) for a in acts) and x.state is st
            elif want is Move.STAY:
                assert not any(isinstance(a, Dropped) for a in acts) and x.state is st
                if event == "read_failed":
                    assert [type(a) for a in acts] == [SendReadFailed]  # the prefill side is told
            else:
                assert x.state is want or (key == (None, None) and len(x.r) == 1)
        return run

    for (key, event), want in RECV_TABLE.items():
        yield (key, event), row(key, event, want)


SCENARIOS: dict[str, dict[Any, Callable[[list[Any]], None]]] = {
    "pub": dict(pub_rows()), "reg": dict(reg_rows()), "leg": dict(leg_rows()), "recv": dict(recv_rows())}
ROWS = [(name, row) for name, t in TABLES.items() for row in t]


def _id(v: Any) -> str:
    return table_mod.state_name(v) if not isinstance(v, str) else v


@pytest.mark.parametrize(("name", "row"), ROWS, ids=[f"{n}-{_id(r[0])}-{r[1]}".replace(" ", "_") for n, r in ROWS])
def test_every_row_is_reached_through_the_api(name: str, row: Any, seen: list[Any]) -> None:
    SCENARIOS[name][row](seen)


def test_every_scenario_names_a_row() -> None:
    for name, rows in SCENARIOS.items():
        assert set(rows) == set(TABLES[name]), name


# -- what the tables leave out -----------------------------------------------------------------------


def _states(name: str) -> list[Any]:
    if name == "recv":
        return [(None, None), *itertools.product((TransferMode.PUSH, TransferMode.PULL), RecvState)]
    enum_of = {"pub": PubState, "reg": RegState, "leg": LegState}[name]
    return [None, *enum_of]


ILLEGAL = [(name, st, ev) for name, t in TABLES.items() for st in _states(name)
           for ev in sorted({e for _, e in t}) if (st, ev) not in t]


def test_the_illegal_list_is_what_the_tables_forbid() -> None:
    # a few that must stay illegal: a leg starts once, nothing ends a receive that is not there,
    # no READ ends before its offer, a push receive takes no offer, a failing publish is not matched
    for must in [("leg", LegState.POSTED, "start"), ("leg", LegState.DONE, "start"),
                 ("recv", (None, None), "timeout"), ("recv", (TransferMode.PULL, RecvState.REGISTERING), "read_done"),
                 ("recv", (TransferMode.PUSH, RecvState.REGISTERED), "offer"), ("pub", PubState.FAILING, "mismatch"),
                 ("pub", None, "abort"), ("reg", None, "timeout"), ("pub", PubState.FAILING, "written")]:
        assert must in ILLEGAL, must
    assert len(ILLEGAL) == sum(len(_states(n)) * len({e for _, e in t}) - len(t) for n, t in TABLES.items())


@pytest.mark.parametrize(("name", "state", "event"), ILLEGAL,
                         ids=[f"{n}-{_id(s)}-{e}".replace(" ", "_") for n, s, e in ILLEGAL])
def test_every_left_out_pair_is_an_illegal_transition(name: str, state: Any, event: str) -> None:
    with pytest.raises(IllegalTransition) as ei:
        table_mod.step(TABLES[name], state, event, TID)
    assert ei.value.state == table_mod.state_name(state) and ei.value.event == event
    assert ei.value.transfer_id == TID and event in ei.value.message and ei.value.state in ei.value.message
    assert isinstance(ei.value, FailedPrecondition)  # the rpc layer: FAILED_PRECONDITION


@pytest.mark.parametrize("st", list(RecvState))
def test_an_offer_for_a_push_receive_is_illegal_and_leaves_no_trace(st: RecvState) -> None:
    """The one illegal pair a peer can bring: it is refused and the receive goes on untouched."""
    x = receive(TransferMode.PUSH, st)
    before = x.r.views(T0)
    with pytest.raises(IllegalTransition) as ei:
        x.r.offer(x.rid, TID, 0, SRC)
    assert (ei.value.state, ei.value.event) == (f"push {st.name.lower()}", "offer")
    assert x.r.views(T0) == before and x.r.notified(x.rid, 0)[0].completion.kind is CompletionKind.FINISHED_RECEIVING
