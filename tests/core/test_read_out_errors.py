"""agents.AgentBook.read_out_errors (the NIXL thread's recovery after a dead peer, LIBFABRIC): each poll of a
failing agent reads one completion in error; it stops at the first clean poll, whose notifications it
returns, or at its time budget. A fake agent stands in for NIXL (the real one: tests/lab/test_netns_backends.py)."""

from __future__ import annotations

from typing import Any

from kvpushd.transfer.agents import AgentBook


class nixlBackendError(Exception):  # the name NIXL's binding raises
    pass


class QueuedErrors:
    """An agent whose completion queue holds ``errors`` entries in error, then ``notifs``."""

    def __init__(self, errors: int, notifs: dict[str, list[bytes]] | None = None, forever: bool = False) -> None:
        self.errors, self.notifs, self.forever, self.polls = errors, notifs or {}, forever, 0

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self.polls += 1
        if self.forever or self.errors > 0:
            self.errors -= 1
            raise nixlBackendError("NIXL_ERR_BACKEND")
        notifs, self.notifs = self.notifs, {}
        return notifs


class Loc:
    def __init__(self, agent: Any) -> None:
        self.agent = agent


def test_every_error_is_read_out_and_the_clean_polls_notifications_come_back() -> None:
    agent = QueuedErrors(5, {"peer": [b"t:0"]})
    assert AgentBook.read_out_errors(Loc(agent)) == (5, {"peer": [b"t:0"]}, True)  # type: ignore[arg-type]
    assert agent.polls == 6


def test_a_clean_agent_costs_one_poll() -> None:
    agent = QueuedErrors(0)
    assert AgentBook.read_out_errors(Loc(agent)) == (0, {}, True)  # type: ignore[arg-type]
    assert agent.polls == 1


def test_an_agent_that_never_comes_clean_is_given_up_after_the_budget() -> None:
    agent = QueuedErrors(0, forever=True)
    errors, notifs, clean = AgentBook.read_out_errors(Loc(agent), budget_s=0.01)  # type: ignore[arg-type]
    assert not clean and notifs == {} and errors == agent.polls > 1
