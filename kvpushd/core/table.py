"""The shape of the rendezvous' transition tables (in the spirit of h11's _state.py).

Each side names, per (state, event) of a record, what the event does: the state the record moves
to, ``Move.GONE`` (the record ends), ``Move.DROP`` (a late or repeated event, ignored on purpose:
the side answers with a Dropped action, which the runtime counts and logs) or ``Move.STAY`` (nothing
changes and nothing is reported: a retry, or a failure after the first, whose cause stands). The
state ``None`` is a record that does not exist (never made, or ended). Anything a table does not
name is an IllegalTransition that says the state and the event: the side's code steps the table
at every change of a record, so a path the table forbids fails loudly instead of corrupting state.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, TypeVar

from .errors import IllegalTransition


class State(enum.Enum):
    """Base of the tables' enums: hashed by identity, as they compare (Enum's own ``__hash__`` is
    Python code, and a side looks a (state, event) up at every change of a record)."""

    __hash__ = object.__hash__


class Move(State):
    """What an event does to a record, besides moving it to another state."""

    GONE = "gone"  # the record ends
    DROP = "drop"  # late or repeated, ignored on purpose (a Dropped action: counted and logged)
    STAY = "stay"  # ignored without a report: a retry, or a failure after the first


S = TypeVar("S")


def state_name(state: Any) -> str:
    if state is None:
        return "none"
    if isinstance(state, tuple):
        return " ".join(state_name(s) for s in state)
    return str(state.name.lower() if isinstance(state, enum.Enum) else state)


def step(table: Mapping[tuple[Any, str], S], state: Any, event: str, transfer_id: str = "") -> S:
    """Look an event up in a side's table: a typed error naming state and event when illegal."""
    try:
        return table[(state, event)]
    except KeyError:
        name = state_name(state)
        raise IllegalTransition(name, event, f"transfer {transfer_id[:256]!r}: event {event!r} is not allowed in "
                                             f"state {name!r}", transfer_id=transfer_id) from None
