"""A prefill and a decode engine as child processes, each driven over a pipe of tuples: what the
sweep's engines (``sweep/engines.py``) and the handover's (``handover_engines.py``) share.

A child answers ("ready", static kv_params) once up and ("error", text) when it fails; a pipe that
closes means the child exited. Both turn into a ``BenchError`` naming the engine.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from .common import BenchError

ROLES = ("prefill", "decode")


class ProcPair:
    def __init__(self, label: str, target: Callable[..., None], args_of: Callable[[str, Connection], tuple[Any, ...]],
                 proc_name: Callable[[str], str]) -> None:
        ctx = mp.get_context("spawn")
        self.label = label
        self.procs: dict[str, Any] = {}
        self.conns: dict[str, Connection] = {}
        for role in ROLES:
            mine, theirs = ctx.Pipe()
            pr = ctx.Process(target=target, args=args_of(role, theirs), daemon=True, name=proc_name(role))
            pr.start()
            theirs.close()
            self.procs[role], self.conns[role] = pr, mine

    def taken(self, role: str, msg: tuple[Any, ...]) -> bool:
        """A message the pair keeps for itself (not returned by ``recv``)."""
        return False

    def recv(self, timeout_s: float) -> list[tuple[str, tuple[Any, ...]]]:
        """The messages the engines sent within ``timeout_s`` (at most one per engine), as (role, msg)."""
        out = []
        for ready in wait(list(self.conns.values()), max(0.0, timeout_s)):
            role = "prefill" if ready is self.conns["prefill"] else "decode"
            try:
                msg = tuple(self.conns[role].recv())
            except EOFError:
                raise BenchError(f"{self.label}: the {role} engine exited (code {self.procs[role].exitcode})") from None
            if msg[0] == "error":
                raise BenchError(str(msg[1]))
            if not self.taken(role, msg):
                out.append((role, msg))
        return out

    def ready(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """Wait until both engines are up; the prefill engine's static kv_params."""
        static: dict[str, Any] = {}
        pending = set(ROLES)
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise BenchError(f"{self.label}: engines {sorted(pending)} not ready after {timeout_s:g} s")
            for role, msg in self.recv(0.5):
                if msg[0] == "ready":
                    pending.discard(role)
                    if role == "prefill":
                        static = dict(msg[1])
            for role in pending:
                if not self.procs[role].is_alive() and not self.conns[role].poll(0):
                    raise BenchError(f"{self.label}: the {role} engine exited while starting")
        return static

    def join(self, wait_s: float) -> None:
        """Wait for both engines to end (after "finish"); terminate one that does not."""
        for pr in self.procs.values():
            pr.join(wait_s)
            if pr.is_alive():
                pr.terminate()
                pr.join(10)
