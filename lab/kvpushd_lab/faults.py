"""Fault injection for tests and the soak benchmark: a NIXL agent that fails WRITEs on purpose.

The daemon knows nothing of it. A daemon started by ``launch.spawn`` with ``KVPUSHD_FAULTS`` in its
environment gets ``faultsite/`` on its PYTHONPATH; that directory's sitecustomize calls ``install``,
which wraps each worker's NIXL agent as the daemon creates it. Real NIXL still moves the bytes: the
wrapper only refuses, strips a notification, reports an error or holds a completion.

``KVPUSHD_FAULTS="write_post=0.1,write_complete=0.05,write_hold_s=2,seed=7"``:

- ``write_post=P``: with probability P a WRITE is refused before it is posted (as if NIXL could
  not post it);
- ``write_complete=P``: with probability P a WRITE is posted without its notification and then
  reported as completed in error (as a WRITE the network broke: the decode daemon never hears of
  it and learns of the failure only from the prefill daemon's notice);
- ``write_hold_s=S``: every WRITE is reported done no sooner than S seconds after it was posted
  (a slow network), e.g. to check that leases do not expire WRITEs in flight;
- ``seed=N``: seeds the draws (default: random).
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV = "KVPUSHD_FAULTS"
SITE_DIR = Path(__file__).resolve().parent / "faultsite"
_KINDS = ("write_post", "write_complete")


@dataclass
class Faults:
    write_post: float = 0.0
    write_complete: float = 0.0
    write_hold_s: float = 0.0
    spec: str = ""
    rng: random.Random = field(default_factory=random.Random)
    injected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_KINDS, 0))

    @classmethod
    def parse(cls, spec: str) -> Faults:
        f = cls(spec=spec)
        for item in filter(None, (x.strip() for x in spec.split(","))):
            key, sep, value = item.partition("=")
            try:
                v = float(value)
            except ValueError:
                v = -1.0
            if not sep or key not in (*_KINDS, "write_hold_s", "seed") or v < 0 or (key in _KINDS and v > 1):
                raise ValueError(f"{ENV}: {item!r} is not one of write_post=P, write_complete=P (0 <= P <= 1), "
                                 "write_hold_s=S, seed=N")
            if key == "seed":
                f.rng.seed(int(v))
            else:
                setattr(f, key, v)
        return f

    @property
    def active(self) -> bool:
        return bool(self.write_post or self.write_complete or self.write_hold_s)

    def draw(self) -> str:
        """Which fault (if any) this WRITE gets: "", "write_post" or "write_complete"."""
        for kind in _KINDS:
            p = getattr(self, kind)
            if p and self.rng.random() < p:
                self.injected[kind] += 1
                return kind
        return ""


class Handle:
    """A WRITE's transfer handle with the fault it drew (``inner`` None: it is never posted)."""

    def __init__(self, inner: Any, fault: str) -> None:
        self.inner = inner
        self.fault = fault
        self.t_post = 0.0

    def release(self) -> None:
        if self.inner is not None:
            self.inner.release()


class FaultAgent:
    """A NIXL agent whose WRITEs may be refused, stripped of their notification and failed, or held."""

    def __init__(self, agent: Any, faults: Faults) -> None:
        self._agent = agent
        self._faults = faults

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def make_prepped_xfer(self, op: str, ldl: Any, li: Any, rdl: Any, ri: Any, notif: bytes = b"") -> Any:
        return self._wrap(op, notif, lambda n: self._agent.make_prepped_xfer(op, ldl, li, rdl, ri, n))

    def initialize_xfer(self, op: str, ldescs: Any, rdescs: Any, remote: str, notif: bytes = b"") -> Any:
        return self._wrap(op, notif, lambda n: self._agent.initialize_xfer(op, ldescs, rdescs, remote, n))

    def _wrap(self, op: str, notif: bytes, make: Callable[[bytes], Any]) -> Any:
        if op != "WRITE":
            return make(notif)
        fault = self._faults.draw()
        if fault == "write_post":
            return Handle(None, fault)
        return Handle(make(b"" if fault == "write_complete" else notif), fault)

    def transfer(self, handle: Any) -> str:
        if not isinstance(handle, Handle):
            return str(self._agent.transfer(handle))
        if handle.inner is None:
            raise RuntimeError(f"injected fault ({ENV} {handle.fault}): WRITE not posted")
        state = str(self._agent.transfer(handle.inner))
        handle.t_post = time.perf_counter()
        return "PROC" if state == "DONE" else state  # the thread polls it: hold and faults apply there

    def check_xfer_state(self, handle: Any) -> str:
        if not isinstance(handle, Handle):
            return str(self._agent.check_xfer_state(handle))
        state = str(self._agent.check_xfer_state(handle.inner))
        if state != "DONE":
            return state
        if time.perf_counter() - handle.t_post < self._faults.write_hold_s:
            return "PROC"  # a slow network
        if handle.fault:
            raise RuntimeError(f"injected fault ({ENV} {handle.fault}): WRITE completed in error")
        return state


def install(spec: str) -> None:
    """Wrap the agent of every worker the daemon attaches from now on (called by faultsite's sitecustomize)."""
    from kvpushd.transfer.agents import AgentBook

    faults = Faults.parse(spec)
    if not faults.active:
        return
    attach = AgentBook.attach

    def attach_with_faults(self: AgentBook, worker_id: str, *args: Any, **kwargs: Any) -> bytes:
        metadata = attach(self, worker_id, *args, **kwargs)
        loc = self.locals[worker_id]
        loc.agent = FaultAgent(loc.agent, faults)
        return metadata

    AgentBook.attach = attach_with_faults  # type: ignore[method-assign]
    print(f"{ENV} is set: WRITEs will fail on purpose (tests only): {spec}", file=sys.stderr, flush=True)


def with_site(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a daemon process: with ``faultsite/`` first on PYTHONPATH when it sets KVPUSHD_FAULTS."""
    out = dict(env)
    if out.get(ENV):
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), out.get("PYTHONPATH", "")) if p)
    return out
