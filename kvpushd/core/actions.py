"""What the rendezvous decides: the actions the runtime carries out, and the keys they name.

Each action carries its whole plan, so the runtime performs it as it stands (e.g. StartWrite:
slices, notification, planned or prepared descriptors), and never decides again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import msgspec

from .layout import Part, Shape  # Part: (slices per block, which slice): (1, 0) is the whole block
from .ledger import Ledger
from .types import Completion, FailureCode, TransferMode


@dataclass(frozen=True, slots=True)
class Registration:
    """A decode worker's destination blocks for one transfer, as the prefill side sees it."""

    registration_id: int
    origin: str  # the decode daemon's peer key (where failure notices go)
    transfer_id: str
    producer_engine_id: str
    producer_tp_size: int
    consumer_agent: str
    consumer_rank: int
    consumer_tp_size: int
    block_ids: tuple[int, ...]
    mode: TransferMode = TransferMode.PUSH  # PULL: offer the source blocks instead of writing
    skip_tokens: int = 0    # the consumer holds the prompt's first tokens: block_ids start there
    mla: bool = False       # every consumer region is replicated: one producer rank per consumer writes
    layouts: tuple[Shape, ...] = ()  # the consumer's regions (block size, layout, replication), if known
    node_id: str = ""       # the registering decode daemon's node id (checked against a publish's binding)
    tls_names: tuple[str, ...] = ()  # the CN and SANs of the client certificate it called with (TLS)
    traceparent: str = ""   # the decode daemon's span context, when it traces

    def __post_init__(self) -> None:
        # What the regions say decides; the flags may also be set directly (tests, older peers).
        if self.layouts and all(r.replicated for r in self.layouts) and not self.mla:
            object.__setattr__(self, "mla", True)


@dataclass(frozen=True, slots=True)
class StartWrite:
    """Post a NIXL WRITE of ``src_blocks`` into the registration's blocks: the whole plan.

    The runtime carries it out as it stands: which slice of each block on either side (TP sizes),
    the notification, whether replicated regions are left to another rank, and whether the
    prepared one-descriptor-per-block lists serve (``planned`` False) or descriptors are planned
    per token run (block sizes differ, a prefix is skipped, layouts differ).
    """

    leg: LegKey
    producer_worker: str
    producer_rank: int
    producer_tp_size: int
    src_blocks: tuple[int, ...]
    registration: Registration
    notif: bytes = b""
    src_part: Part = (1, 0)
    dst_part: Part = (1, 0)
    skip_replicated: bool = False
    planned: bool = False
    waited_s: float = 0.0  # first arrival of publish or registration -> this, the second
    # progressive push: the source is complete layer group by layer group as the producer worker's
    # doorbell passes step ``step`` (``layers`` groups, each with its own notification); 0: now.
    # ``ready_blocks``: the first that many of src_blocks are complete now (one WRITE of their every
    # layer goes first, with a notification unit of its own; core/notif.py)
    step: int = 0
    layers: int = 0
    ready_blocks: int = 0


@dataclass(frozen=True, slots=True)
class StopWrite:
    """Progressive push: post no more layer groups of this leg (its publish failed, or its
    registration ended); the leg still settles (write_done) once what was posted has."""

    leg: LegKey
    reason: str


@dataclass(frozen=True, slots=True)
class Deliver:
    """Hand a completion to a local worker, with the transfer's ledger (its figures)."""

    worker_id: str
    completion: Completion
    ledger: Ledger | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class SendFailNotice:
    """Prefill side -> decode daemon: this registration will not be written."""

    origin: str
    transfer_id: str
    registration_id: int
    code: FailureCode
    reason: str


@dataclass(frozen=True, slots=True)
class SendRegister:
    """Decode side -> prefill daemon: forward a registration."""

    producer_address: str
    registration_id: int
    worker_id: str
    transfer_id: str
    producer_engine_id: str
    producer_tp_size: int
    consumer_rank: int
    consumer_tp_size: int
    block_ids: tuple[int, ...]
    mode: TransferMode = TransferMode.PUSH
    skip_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SendWithdraw:
    """Decode side -> prefill daemon: the registration is withdrawn (abort, timeout, worker gone)."""

    producer_address: str
    transfer_id: str
    registration_id: int
    code: FailureCode
    reason: str
    # The runtime reports the answer (or that none came) with RecvSide.withdraw_answered: the
    # prefill daemon answers only once no WRITE into the registration is in flight, so a FAILED
    # the core deferred until then lets the decode worker free its blocks after the last byte.


@dataclass(frozen=True, slots=True)
class SendOffer:
    """Pull mode, prefill side -> decode daemon: READ ``src_blocks`` into the registration's blocks.

    The leg counts as in flight (the prefill worker's blocks stay held) until the READ's
    notification arrives, the decode daemon reports the READ failed (``read_done``), its offer is
    refused, the decode daemon is lost, or ``publish_timeout_s`` passes.
    """

    leg: LegKey
    producer_worker: str
    producer_rank: int
    producer_tp_size: int
    src_blocks: tuple[int, ...]
    registration: Registration


class ReadKey(msgspec.Struct, frozen=True, order=True, gc=False):
    """Pull mode, decode side: one READ of a producer rank's blocks into one registration."""

    producer_address: str
    transfer_id: str
    registration_id: int
    producer_rank: int


@dataclass(frozen=True, slots=True)
class StartRead:
    """Pull mode, decode side: post a NIXL READ of an accepted offer (src: prefill, dst: ours)."""

    key: ReadKey
    worker_id: str
    producer_tp_size: int
    consumer_rank: int
    consumer_tp_size: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    producer_agent: str = ""  # the offer's prefill agent (loaded by the runtime before the offer event)
    notif: bytes = b""
    src_part: Part = (1, 0)
    dst_part: Part = (1, 0)


@dataclass(frozen=True, slots=True)
class SendReadFailed:
    """Pull mode, decode side -> prefill daemon: the READ of an accepted offer failed."""

    key: ReadKey
    reason: str


# What ``Dropped.event`` names: every late or repeated event the rendezvous may drop (metrics export
# each from 0, so a rate over them has data before the first one happens).
DropEvent = Literal["registered", "notified", "offer", "read_done", "failed", "withdraw", "write_done"]
DROPPED_EVENTS: tuple[str, ...] = get_args(DropEvent)


@dataclass(frozen=True, slots=True)
class Dropped:
    """A late or repeated event ignored on purpose (a WRITE settling after its transfer ended, a
    notice for a registration already gone): the runtime counts and logs it."""

    event: DropEvent
    transfer_id: str
    why: str


Action = (StartWrite | StopWrite | Deliver | SendFailNotice | SendRegister | SendWithdraw | SendOffer | StartRead
          | SendReadFailed | Dropped)


class LegKey(msgspec.Struct, frozen=True, order=True, gc=False):
    """One WRITE: a producer rank's blocks into one registration."""

    engine_id: str
    transfer_id: str
    producer_rank: int
    registration_id: int
