"""The shape of the rendezvous' transition tables (in the spirit of h11's _state.py).

Each side names, per (state, event), what the event does; anything the table does not name is an
IllegalTransition that says the state and the event. Late or repeated events that are legal but
ignored are DROP: the side returns a Dropped action, and the runtime counts and logs it.
"""

from __future__ import annotations

import enum
from typing import Any

from .errors import IllegalTransition


class Move(enum.Enum):
    """What an event does to a record, in the tables below."""

    APPLY = "apply"  # handled: the event's rule runs
    DROP = "drop"    # late or repeated, ignored on purpose (a Dropped action: counted and logged)


# The prefill side's leg (one producer rank's WRITE or offered READ into one registration), in
# the spirit of h11's _state.py: each (state, event) the table names is legal; None is a leg that
# is gone (its transfer ended: worker gone, shutdown, timeout). Anything else is IllegalTransition.


def step(table: dict[tuple[Any, str], Move], state: Any, event: str, transfer_id: str = "") -> Move:
    """Look an event up in a side's table: a typed error naming state and event when illegal."""
    move = table.get((state, event))
    if move is None:
        name = state.value if isinstance(state, enum.Enum) else str(state)
        raise IllegalTransition(name, event, f"transfer {transfer_id[:256]!r}: event {event!r} is not allowed in "
                                             f"state {name!r}", transfer_id=transfer_id)
    return move
