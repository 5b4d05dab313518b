"""NIXL without the daemon: the baselines the daemon is measured against.

``Target`` is a helper process that owns the destination agent (the KV memory of a decode worker,
in shared memory) and does what the decode daemon's NIXL thread does: it drives progress and reads
notifications every ``poll_s`` (the daemon's ``transfer.poll_interval_s``; 0 spins) while a WRITE
is expected, and wakes only every 50 ms otherwise, recording when each notification arrived.
``Initiator`` is an agent in the calling process on the source memory: prepared descriptor lists,
index arrays, ``make_prepped_xfer`` + ``transfer`` + ``check_xfer_state``, which is what the
daemon's NIXL thread does and what an engine that uses NIXL itself (vLLM's connectors) does in its
own thread. NIXL is imported lazily (only these baselines
need it in the bench process).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpushd.transfer.descs import RegionSpec, block_descs, leg_indices, region_bases

from ..backend import nixl_agent
from ..backend import preload as preload_backend
from .common import BenchError, KVMemory, Layout

IDLE_S = 0.05  # the daemon's NIXL thread's idle wait


def _agent(name: str, backend: str = "UCX") -> Any:
    preload_backend(backend)  # LIBFABRIC's libraries, before NIXL loads its plugin
    import nixl._api  # noqa: F401 - first: importing it sets the "nixl" logger's level

    # NIXL logs to stdout at INFO; stdout is for the bench's table or JSON.
    nlog = logging.getLogger("nixl")
    nlog.setLevel(logging.WARNING)
    for h in nlog.handlers:
        if isinstance(h, logging.StreamHandler):
            h.setStream(sys.stderr)

    # As the daemon does: no NIXL progress thread (it spins a core); the owner polls instead.
    return nixl_agent(name, backend)


def _target_main(shm_name: str, size: int, poll_s: float, conn: Connection, populate: bool = False,
                 backend: str = "UCX") -> None:
    """Like the decode daemon's NIXL thread: poll every ``poll_s`` while a WRITE is awaited (or while
    told to stay busy), otherwise wake every 50 ms only; ``poll_s`` 0 spins while awaiting."""
    from kvpushd.memory.shm import ShmMapping

    m = ShmMapping(os.open(shm_name, os.O_RDWR | os.O_CLOEXEC), size, shm_name)  # KVMemory.name: a path
    if populate:  # as a daemon does for host KV (worker_api.populate_host_kv)
        m.populate()
    agent = _agent(f"kvpushd-bench-target-{os.getpid()}", backend)
    reg = agent.register_memory([(m.addr, m.size, 0, "")], "DRAM")
    conn.send(("ready", bytes(agent.get_agent_metadata()), m.addr, agent.name))
    arrivals: dict[bytes, int] = {}
    waiting: bytes | None = None
    reply = False  # the caller waits for the arrival time of ``waiting``
    busy = False
    while True:
        active = waiting is not None or busy
        if active and poll_s > 0:
            # Not conn.poll(poll_s): poll(2) counts in milliseconds, so 200 us would become 1 ms.
            time.sleep(poll_s)
        if conn.poll(0 if active else IDLE_S):
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            if cmd[0] == "arm":
                waiting, reply = cmd[1], False
            elif cmd[0] == "wait":
                waiting, reply = cmd[1], True
            elif cmd[0] == "busy":
                busy = bool(cmd[1])
        now_msgs = agent.get_new_notifs()
        if now_msgs:
            t = time.monotonic_ns()
            for msgs in now_msgs.values():
                for msg in msgs:
                    arrivals[bytes(msg)] = t
        if waiting is not None and reply and waiting in arrivals:
            conn.send(("arrived", arrivals.pop(waiting)))
            waiting = None
        if len(arrivals) > 10_000:  # notifications nobody asks about (the busy mode's)
            arrivals.clear()
    agent.deregister_memory(reg)
    m.close()
    conn.close()
    os._exit(0)  # skip interpreter teardown (torch, UCX): seconds on a loaded machine, nothing left to do


def preload() -> threading.Thread:
    """Import NIXL (and torch, which it imports) in a thread, while daemons start."""
    t = threading.Thread(target=lambda: importlib.import_module("nixl._api"), name="nixl-preload", daemon=True)
    t.start()
    return t


class Target:
    """The destination agent in its own process (like a decode node's daemon)."""

    def __init__(self, mem: KVMemory, poll_s: float, populate: bool = False, backend: str = "UCX") -> None:
        ctx = mp.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        self.backend = backend  # the Initiator's agent runs the same
        self._proc = ctx.Process(target=_target_main, args=(mem.name, mem.layout.total_bytes, poll_s, theirs, populate,
                                                            backend), daemon=True)
        self._proc.start()
        self.layout = mem.layout
        self.metadata = b""
        self.addr = 0
        self.name = ""

    def wait_ready(self, timeout_s: float = 120.0) -> Target:
        """The process starts (imports NIXL) while the caller does other things; this waits for it."""
        if self.metadata:
            return self
        try:
            if not self._conn.poll(timeout_s):
                raise EOFError
            _, self.metadata, self.addr, self.name = self._conn.recv()
        except (EOFError, OSError):
            self._proc.kill()
            raise BenchError("the NIXL target process did not start") from None
        return self

    @property
    def pid(self) -> int:
        return int(self._proc.pid or 0)

    def regions(self) -> list[RegionSpec]:
        lay = self.layout
        return [RegionSpec(self.addr + i * lay.region_bytes, lay.num_blocks, lay.block_len, lay.block_len, 0)
                for i in range(lay.regions)]

    def arm(self, notif: bytes) -> None:
        """A WRITE with ``notif`` is about to come: poll every ``poll_s`` until it arrived."""
        self._conn.send(("arm", notif))

    def busy(self, on: bool) -> None:
        """Poll every ``poll_s`` (WRITEs in flight that nobody awaits one by one), or go idle."""
        self._conn.send(("busy", on))

    def arrival_ns(self, notif: bytes, timeout_s: float = 120.0) -> int:
        """When (monotonic ns) the notification ``notif`` reached the target."""
        self._conn.send(("wait", notif))
        if not self._conn.poll(timeout_s):
            raise BenchError(f"notification {notif!r} did not reach the target in {timeout_s:g} s")
        msg = self._conn.recv()
        return int(msg[1])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(("stop",))
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


class Initiator:
    """A NIXL agent in this process on the source memory, with prepared lists towards ``target``."""

    def __init__(self, mem: KVMemory, target: Target, name: str = "", populate: bool = False) -> None:
        from kvpushd.memory.shm import ShmMapping

        self.layout: Layout = mem.layout
        self._map = ShmMapping(os.open(mem.name, os.O_RDWR | os.O_CLOEXEC), mem.layout.total_bytes, mem.name)
        if populate:
            self._map.populate()
        self.agent = _agent(name or f"kvpushd-bench-initiator-{os.getpid()}", target.backend)
        self._reg = self.agent.register_memory([(self._map.addr, self._map.size, 0, "")], "DRAM")
        self.remote = self.agent.add_remote_agent(target.wait_ready().metadata)
        if isinstance(self.remote, bytes):
            self.remote = self.remote.decode()
        self.target = target
        lay = self.layout
        self.local_regions = [RegionSpec(self._map.addr + i * lay.region_bytes, lay.num_blocks, lay.block_len,
                                         lay.block_len, 0) for i in range(lay.regions)]
        self.remote_regions = target.regions()
        # One descriptor per region and block, prepared once (as the daemon does per worker).
        self.local_blocks = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs(self.local_regions), "DRAM")
        self.remote_blocks = self.agent.prep_xfer_dlist(self.remote, block_descs(self.remote_regions), "DRAM")
        self.local_bases = region_bases(self.local_regions)
        self.remote_bases = region_bases(self.remote_regions)
        self._lists: list[Any] = [self.local_blocks, self.remote_blocks]

    def region_lists(self, nblocks: int) -> tuple[Any, Any]:
        """Prepared lists of one descriptor per region covering blocks [0, nblocks): the ceiling's."""
        lay = self.layout

        def descs(regions: list[RegionSpec]) -> npt.NDArray[np.uint64]:
            d = np.empty((len(regions), 3), dtype=np.uint64)
            d[:, 0] = [r.addr for r in regions]
            d[:, 1] = nblocks * lay.block_len
            d[:, 2] = 0
            return d

        loc = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs(self.local_regions), "DRAM")
        rem = self.agent.prep_xfer_dlist(self.remote, descs(self.remote_regions), "DRAM")
        self._lists += [loc, rem]
        return loc, rem

    def block_indices(self, src: npt.NDArray[np.int64],
                      dst: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        return leg_indices(self.local_bases, src), leg_indices(self.remote_bases, dst)

    def post(self, local: Any, lidx: npt.NDArray[np.int32], remote: Any, ridx: npt.NDArray[np.int32],
             notif: bytes) -> tuple[Any, str]:
        h = self.agent.make_prepped_xfer("WRITE", local, lidx, remote, ridx, notif)
        state = self.agent.transfer(h)
        if state == "ERR":
            h.release()
            raise BenchError("NIXL returned ERR when posting a WRITE")
        return h, str(state)

    def state(self, h: Any) -> str:
        return str(self.agent.check_xfer_state(h))

    def write(self, local: Any, lidx: npt.NDArray[np.int32], remote: Any, ridx: npt.NDArray[np.int32],
              notif: bytes) -> tuple[int, int, int]:
        """One WRITE, to the end: (start, initiator saw DONE, target saw the notification), monotonic ns."""
        self.target.arm(notif)
        t0 = time.monotonic_ns()
        h, state = self.post(local, lidx, remote, ridx, notif)
        while state == "PROC":
            state = self.state(h)
        t_done = time.monotonic_ns()
        h.release()
        if state != "DONE":
            raise BenchError(f"raw NIXL WRITE ended in state {state}")
        return t0, t_done, self.target.arrival_ns(notif)

    def close(self) -> None:
        for dl in self._lists:
            dl.release()
        self.agent.deregister_memory(self._reg)
        del self.agent
        self._map.close()
