"""The outbound peer link as a pure state machine: every (state, event) is a row of the table or an
IllegalTransition, and the timing rules (handshake back-off, silence, heartbeats, idleness) are
plain inputs of ``now``: no clock, no sleep."""

from __future__ import annotations

import pytest

from kvpushd.core.errors import IllegalTransition
from kvpushd.core.peerlink import (
    HANDSHAKE_BACKOFF_MAX_S,
    HANDSHAKE_BACKOFF_S,
    TABLE,
    LinkEvent,
    LinkState,
    PeerLink,
    backoff_s,
    step,
)

S, E = LinkState, LinkEvent

ROWS = [
    (S.NEW, E.HANDSHAKE, S.HANDSHAKING),
    (S.HANDSHAKING, E.HANDSHAKE, S.HANDSHAKING),
    (S.CONNECTED, E.HANDSHAKE, S.HANDSHAKING),  # forced: the peer said it does not know us
    (S.UNREACHABLE, E.HANDSHAKE, S.UNREACHABLE),  # stays so until a handshake succeeds
    (S.NEW, E.HANDSHAKE_OK, S.CONNECTED),
    (S.HANDSHAKING, E.HANDSHAKE_OK, S.CONNECTED),
    (S.CONNECTED, E.HANDSHAKE_OK, S.CONNECTED),
    (S.UNREACHABLE, E.HANDSHAKE_OK, S.CONNECTED),
    (S.NEW, E.REFUSED, S.NEW),
    (S.HANDSHAKING, E.REFUSED, S.HANDSHAKING),  # a refused handshake is tried again on the next call
    (S.CONNECTED, E.REFUSED, S.CONNECTED),
    (S.UNREACHABLE, E.REFUSED, S.UNREACHABLE),
    (S.NEW, E.UNREACHABLE, S.UNREACHABLE),
    (S.HANDSHAKING, E.UNREACHABLE, S.UNREACHABLE),
    (S.CONNECTED, E.UNREACHABLE, S.UNREACHABLE),
    (S.UNREACHABLE, E.UNREACHABLE, S.UNREACHABLE),
    (S.NEW, E.STREAM_BROKEN, S.NEW),
    (S.HANDSHAKING, E.STREAM_BROKEN, S.HANDSHAKING),
    (S.CONNECTED, E.STREAM_BROKEN, S.UNREACHABLE),  # the next call handshakes first
    (S.UNREACHABLE, E.STREAM_BROKEN, S.UNREACHABLE),
]


@pytest.mark.parametrize(("state", "event", "after"), ROWS)
def test_table(state: LinkState, event: LinkEvent, after: LinkState) -> None:
    assert step(state, event) is after


def test_rows_cover_the_table() -> None:
    assert {(s, e) for s, e, _ in ROWS} == set(TABLE)


def test_an_event_the_table_does_not_name_is_illegal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(TABLE, (S.NEW, E.STREAM_BROKEN))
    with pytest.raises(IllegalTransition, match=r"'stream_broken' is not allowed in state 'new'"):
        step(S.NEW, E.STREAM_BROKEN)


def test_handshake_backs_off_after_an_unreachable_peer() -> None:
    link = PeerLink(created=100.0)
    assert link.handshake_due()
    link.handshaking()
    link.handshake_failed(100.5, "UNAVAILABLE: connection refused", unreachable=True)
    assert link.state is S.UNREACHABLE and link.last_error.startswith("UNAVAILABLE")
    assert link.backing_off(100.5 + HANDSHAKE_BACKOFF_S - 0.01)  # jitter 1.0 (the default): the full delay
    assert not link.backing_off(100.5 + HANDSHAKE_BACKOFF_S)
    assert link.retry_in(100.5) == HANDSHAKE_BACKOFF_S and link.retry_in(200.0) == 0.0
    link.handshaking()
    assert link.state is S.UNREACHABLE  # until it answers
    link.connected(102.0)
    assert (link.state, link.since, link.last_ok, link.failing_since) == (S.CONNECTED, 102.0, 102.0, 0.0)
    assert (link.failures, link.retry_at) == (0, 0.0)  # the next failure backs off from the start again
    assert not link.handshake_due() and link.handshake_due(force=True)


def test_a_refused_handshake_does_not_back_off() -> None:
    link = PeerLink(created=0.0)
    link.handshaking()
    link.handshake_failed(1.0, "FAILED_PRECONDITION: incompatible peer", unreachable=False)
    assert link.state is S.HANDSHAKING and not link.backing_off(1.0) and link.handshake_due()
    assert link.failures == 0 and link.retry_in(1.0) == 0.0


@pytest.mark.parametrize(("failures", "jitter", "delay"), [
    (0, 1.0, 0.0),  # no failure: no wait
    (1, 1.0, 1.0),
    (1, 0.0, 0.5),  # the jitter takes it down to half, never below
    (2, 1.0, 2.0),
    (3, 0.5, 3.0),  # 4 s x 0.75
    (4, 1.0, HANDSHAKE_BACKOFF_MAX_S),  # 8 s capped
    (1000, 1.0, HANDSHAKE_BACKOFF_MAX_S),  # no overflow however many
    (1000, 0.0, HANDSHAKE_BACKOFF_MAX_S / 2),
    (1, 7.0, 1.0),  # a jitter out of 0-1 is clamped
    (1, -1.0, 0.5),
])
def test_backoff_is_exponential_capped_and_jittered(failures: int, jitter: float, delay: float) -> None:
    assert backoff_s(failures, jitter) == pytest.approx(delay)


def test_failures_in_a_row_double_the_backoff() -> None:
    link = PeerLink(created=0.0)
    now, waits = 0.0, []
    for _ in range(5):
        link.handshaking()
        link.handshake_failed(now, "UNAVAILABLE", unreachable=True, jitter=1.0, base_s=0.25, max_s=2.0)
        waits.append(link.retry_in(now))
        assert link.backing_off(now) and not link.backing_off(now + waits[-1])
        now += waits[-1]
    assert waits == [0.25, 0.5, 1.0, 2.0, 2.0] and link.failures == 5


@pytest.mark.parametrize(("failing_since", "now", "timeout", "silent"), [
    (0.0, 100.0, 5.0, False),  # healthy
    (90.0, 95.0, 5.0, False),  # failing for exactly the timeout: not yet
    (90.0, 95.01, 5.0, True),
])
def test_silence(failing_since: float, now: float, timeout: float, silent: bool) -> None:
    link = PeerLink(created=0.0, failing_since=failing_since)
    assert link.silent(now, timeout) is silent
    assert link.failing_since == (0.0 if silent else failing_since)  # the failure clock restarts once lost


def test_stream_broken_and_heartbeats_keep_the_first_failure() -> None:
    link = PeerLink(created=0.0, state=S.CONNECTED)
    link.stream_broken(10.0)
    assert link.state is S.UNREACHABLE and link.failing_since == 10.0
    link.beat_failed(12.0)
    assert link.failing_since == 10.0
    link.beat_answered(13.0)
    assert link.failing_since == 0.0 and link.last_ok == 13.0


@pytest.mark.parametrize(("last_beat", "beating", "now", "due"), [
    (0.0, False, 1.0, True),
    (10.0, False, 10.9, False),
    (10.0, False, 11.0, True),
    (10.0, True, 20.0, False),  # one heartbeat at a time
])
def test_beat_due(last_beat: float, beating: bool, now: float, due: bool) -> None:
    assert PeerLink(created=0.0, last_beat=last_beat, beating=beating).beat_due(now, 1.0) is due


def test_beat_marks_one_under_way() -> None:
    link = PeerLink(created=0.0)
    link.beat(5.0)
    assert link.beating and link.last_beat == 5.0 and not link.beat_due(100.0, 1.0)
    link.beat_over()
    assert link.beat_due(100.0, 1.0)


@pytest.mark.parametrize(("link", "now", "idle"), [
    (PeerLink(created=0.0), 61.0, True),
    (PeerLink(created=0.0), 60.0, False),
    (PeerLink(created=0.0, last_ok=30.0), 61.0, False),  # heard from since
    (PeerLink(created=0.0, failed_at=30.0), 61.0, False),
    (PeerLink(created=0.0, calls=1), 1000.0, False),  # in use
    (PeerLink(created=0.0, beating=True), 1000.0, False),
    (PeerLink(created=0.0, state=S.HANDSHAKING), 1000.0, False),
    (PeerLink(created=0.0, pinned=True), 1000.0, False),  # a configured pre-connect peer stays open
])
def test_idle(link: PeerLink, now: float, idle: bool) -> None:
    assert link.idle(now, 60.0) is idle
