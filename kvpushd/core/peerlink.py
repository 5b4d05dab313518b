"""The link to one daemon we call (the outbound side of the peer API), as a pure state machine.

States are an enum and every (state, event) is a row of ``TABLE`` (in the spirit of h11's
_state.py): anything else is an IllegalTransition naming the state and the event. Time is fed in
(``now``, the caller's clock: the event loop's): nothing here reads a clock, opens a socket or
sleeps, so heartbeat, silence and idleness rules are tested as plain inputs
(tests/core/test_peerlink.py). runtime/outbound.py is the glue that makes the calls and feeds
their outcomes in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import IllegalTransition

HANDSHAKE_BACKOFF_S = 1.0  # after an unreachable handshake, calls fail at once for this long (the first time)
HANDSHAKE_BACKOFF_MAX_S = 5.0  # the back-off doubles per failure in a row, up to this


def backoff_s(failures: int, jitter: float, base_s: float = HANDSHAKE_BACKOFF_S,
              max_s: float = HANDSHAKE_BACKOFF_MAX_S) -> float:
    """How long calls fail at once after ``failures`` unreachable handshakes in a row: ``base_s``
    doubled per failure after the first, at most ``max_s``, times 0.5-1.0 by ``jitter`` (0-1, drawn
    by the caller), so daemons that lost one peer together do not all come back at the same instant."""
    if failures < 1:
        return 0.0
    return min(max_s, base_s * 2.0 ** min(failures - 1, 30)) * (0.5 + 0.5 * min(1.0, max(0.0, jitter)))


class LinkState(enum.Enum):
    NEW = "new"
    HANDSHAKING = "handshaking"
    CONNECTED = "connected"
    UNREACHABLE = "unreachable"  # stays so until a handshake succeeds


class LinkEvent(enum.Enum):
    HANDSHAKE = "handshake"  # a handshake starts
    HANDSHAKE_OK = "handshake_ok"
    REFUSED = "refused"  # the peer answered with an error (not unreachable): no state change
    UNREACHABLE = "unreachable"  # a call, a handshake or the stream: no answer, or the connection failed
    STREAM_BROKEN = "stream_broken"  # the Channel stream ended under us


S, E = LinkState, LinkEvent
# (state, event) -> the next state. A handshake from UNREACHABLE keeps UNREACHABLE until it succeeds.
TABLE: dict[tuple[LinkState, LinkEvent], LinkState] = {
    **{(s, E.HANDSHAKE): S.HANDSHAKING for s in (S.NEW, S.HANDSHAKING, S.CONNECTED)},
    (S.UNREACHABLE, E.HANDSHAKE): S.UNREACHABLE,
    **{(s, E.HANDSHAKE_OK): S.CONNECTED for s in S},
    **{(s, E.REFUSED): s for s in S},
    **{(s, E.UNREACHABLE): S.UNREACHABLE for s in S},
    (S.CONNECTED, E.STREAM_BROKEN): S.UNREACHABLE,
    **{(s, E.STREAM_BROKEN): s for s in (S.NEW, S.HANDSHAKING, S.UNREACHABLE)},
}


def step(state: LinkState, event: LinkEvent) -> LinkState:
    nxt = TABLE.get((state, event))
    if nxt is None:
        raise IllegalTransition(state.value, event.value,
                                f"peer link: event {event.value!r} is not allowed in state {state.value!r}")
    return nxt


@dataclass(slots=True)
class PeerLink:
    """What we know of one peer: its state, when it last answered, since when it fails, why."""

    created: float
    state: LinkState = LinkState.NEW
    last_error: str = ""
    since: float = 0.0  # connected since (the last successful handshake)
    last_ok: float = 0.0  # the last answer from the peer
    failing_since: float = 0.0  # the first failure in a row (0: healthy)
    failed_at: float = 0.0  # the last failed handshake
    failures: int = 0  # unreachable handshakes in a row
    retry_at: float = 0.0  # until then calls fail at once (after an unreachable handshake)
    last_beat: float = 0.0  # the last heartbeat sent
    beating: bool = False  # a heartbeat is under way
    calls: int = 0  # calls under way: a peer in use is never idle
    pinned: bool = False  # a configured pre-connect peer: kept open, never idle

    def _go(self, event: LinkEvent) -> None:
        self.state = step(self.state, event)

    # -- events ---------------------------------------------------------------------------------

    def handshake_due(self, force: bool = False) -> bool:
        """Whether a call must handshake first (not when connected, unless ``force``)."""
        return force or self.state is not LinkState.CONNECTED

    def backing_off(self, now: float) -> bool:
        """An unreachable handshake's back-off (``backoff_s``) has not passed: calls behind it fail
        at once, not one connect timeout after another."""
        return self.state is LinkState.UNREACHABLE and now < self.retry_at

    def retry_in(self, now: float) -> float:
        """Seconds until a handshake may be tried again (0: now)."""
        return max(0.0, self.retry_at - now) if self.state is LinkState.UNREACHABLE else 0.0

    def handshaking(self) -> None:
        self._go(LinkEvent.HANDSHAKE)

    def handshake_failed(self, now: float, error: str, unreachable: bool, jitter: float = 1.0,
                         base_s: float = HANDSHAKE_BACKOFF_S, max_s: float = HANDSHAKE_BACKOFF_MAX_S) -> None:
        """A handshake failed; an unreachable peer backs off (``backoff_s``, ``jitter`` drawn by the
        caller), a refusing one does not (it answered: the next call tries again)."""
        self.failed(error, unreachable)
        self.failed_at = now
        if unreachable:
            self.failures += 1
            self.retry_at = now + backoff_s(self.failures, jitter, base_s, max_s)

    def connected(self, now: float) -> None:
        self._go(LinkEvent.HANDSHAKE_OK)
        self.since = self.last_ok = now
        self.failing_since = 0.0
        self.failures = 0
        self.retry_at = 0.0

    def failed(self, error: str, unreachable: bool) -> None:
        """A call or the stream failed with ``error``: unreachable (no answer), or refused by the peer."""
        self._go(LinkEvent.UNREACHABLE if unreachable else LinkEvent.REFUSED)
        self.last_error = error

    def stream_broken(self, now: float) -> None:
        """The Channel stream ended: a failing peer (heartbeats decide) that handshakes on the next call."""
        self._go(LinkEvent.STREAM_BROKEN)
        self.failing_since = self.failing_since or now

    def answered(self, now: float) -> None:
        self.last_ok = now

    def beat(self, now: float) -> None:
        self.last_beat = now
        self.beating = True

    def beat_answered(self, now: float) -> None:
        self.failing_since = 0.0
        self.last_ok = now

    def beat_failed(self, now: float) -> None:
        self.failing_since = self.failing_since or now

    def beat_over(self) -> None:
        self.beating = False

    # -- what the glue asks -----------------------------------------------------------------------

    def silent(self, now: float, timeout_s: float) -> bool:
        """Failing for longer than ``timeout_s``: the peer is lost (the failure clock restarts)."""
        if self.failing_since and now - self.failing_since > timeout_s:
            self.failing_since = 0.0
            return True
        return False

    def beat_due(self, now: float, interval_s: float) -> bool:
        return not self.beating and now - self.last_beat >= interval_s

    def idle(self, now: float, idle_s: float) -> bool:
        """Nothing under way and nothing heard for ``idle_s``: the link may be closed."""
        return (not self.pinned and not self.beating and not self.calls and self.state is not LinkState.HANDSHAKING
                and now - max(self.last_ok, self.since, self.failed_at, self.created) > idle_s)
