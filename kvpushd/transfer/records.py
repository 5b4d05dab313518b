"""What the NIXL thread reads of the configuration, keeps per agent and per transfer in flight, and
reports back (and to whom)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core.actions import LegKey, ReadKey
from ..core.notif import Notified
from .backends import AgentBackend
from .descs import IntArray, PairPlan, Part, RegionSpec


class Settings(Protocol):
    """What the NIXL thread reads of the daemon's ``[transfer]`` section (kvpushd.config.TransferConfig
    is one; typed here so that this room imports nothing above it)."""

    @property
    def backends(self) -> Sequence[str]: ...
    @property
    def device_params(self) -> Mapping[str, Any]: ...  # its keys: the devices whose parameters are probed
    @property
    def nixl_threads(self) -> int: ...
    @property
    def poll_interval_s(self) -> float: ...
    @property
    def poll_max_interval_s(self) -> float: ...
    @property
    def poll_hot_s(self) -> float: ...
    @property
    def write_timeout_s(self) -> float: ...
    @property
    def progressive_min_write_bytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Reports:
    """Where the NIXL thread's reports go; each is called on the event loop (call_soon_threadsafe)."""

    write_done: Callable[[list[WriteResult]], None]
    notifications: Callable[[list[Notified]], None]
    read_done: Callable[[list[ReadResult]], None] | None = None  # pull mode: READs this node posted
    # pull mode: (agent, registration id, producer rank) of READ notifications on our producer agents
    read_notifications: Callable[[list[tuple[str, int, int]]], None] | None = None
    sealed: Callable[[list[tuple[str, int]]], None] | None = None  # progressive push: (worker, step) complete


@dataclass(frozen=True, slots=True)
class WriteResult:
    leg: LegKey
    ok: bool
    reason: str
    nbytes: int
    post_s: float      # time from the request reaching the thread to the WRITE being posted
    xfer_s: float      # time from post to completion seen
    descs_requested: int
    descs_posted: int
    queue_s: float = 0.0  # of post_s: from the request being queued to the thread taking it up


@dataclass(frozen=True, slots=True)
class ReadResult:
    """Pull mode: how one READ (prefill blocks -> this node's decode blocks) ended."""

    key: ReadKey
    ok: bool
    reason: str
    nbytes: int
    post_s: float
    xfer_s: float
    descs_requested: int
    descs_posted: int


@dataclass(frozen=True, slots=True)
class Xfer:
    """One transfer's descriptors, ready to post (agents.AgentBook.xfer_maker)."""

    make: Callable[..., Any]  # (notification[, first index, end index]) -> the NIXL transfer handle
    nbytes: int
    requested: int  # descriptors the request names
    posted: int     # descriptors posted, once adjacent ones are merged


@dataclass(slots=True)
class Local:
    worker_id: str
    agent: Any
    mem_type: str
    regions: tuple[RegionSpec, ...]
    reg_descs: Any
    dlist: Any
    bases: IntArray
    receives: bool
    # (remote agent, or agents.LOCAL for the local agent's block slices (hetero TP), slice) -> prepared list
    lists: dict[tuple[str, Part], Any] = field(default_factory=dict)
    loaded: set[str] = field(default_factory=set)  # remote agents whose metadata is loaded
    # (remote agent, source slice, destination slice, "w" or "r") -> the pair's checked plan
    pairs: dict[tuple[str, Part, Part, str], PairPlan] = field(default_factory=dict)
    bell: Any = None  # memory.doorbell.Doorbell: progressive push (read on this thread only)
    backends: tuple[AgentBackend, ...] = ()  # its agent's (status)


@dataclass(slots=True)
class Inflight:
    """One WRITE or READ posted and not yet seen complete (the same record for both)."""

    handle: Any
    local: Local
    result: WriteResult | ReadResult  # as it will be reported; ok/reason/xfer_s filled in at the end
    t_post: float
    remote: str = ""
    stage: Any = None  # staged.Staged: one layer group WRITE of a leg written progressively

    @property
    def what(self) -> str:
        return "WRITE" if isinstance(self.result, WriteResult) else "READ"


def transfer_id_of(f: Inflight) -> str:
    r = f.result
    return r.leg.transfer_id if isinstance(r, WriteResult) else r.key.transfer_id
