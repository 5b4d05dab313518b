"""In-engine KV connectors: the baselines kvpushd is measured against (``kvpushd bench sweep``).

Here the engine process owns its NIXL agent, as vLLM's connectors do, and every NIXL call runs on
the engine thread inside the hooks (``on_prefill_done``, ``on_blocks_allocated``, ``poll``): that
cost, paid between model steps, is what the comparison with kvpushd is about.

* ``InEnginePullHooks`` (vLLM's ``NixlConnector``): prefill answers with its block ids and holds
  them; decode, once it gets the request with those ``kv_params``, fetches the prefill agent's
  metadata through the side channel (once per prefill engine), loads it and prepares the remote
  descriptor list, posts a NIXL READ, polls it in ``poll()``, then tells prefill to free its blocks
  with ``send_notif``; prefill reads that notification in its ``poll()``.
* ``InEnginePushHooks`` (``NixlPushConnector``): decode sends its destination blocks to the prefill
  engine through the side channel as soon as they are allocated (its agent metadata with the first
  one); prefill posts a WRITE with a notification when prefill is done or when the registration
  arrives, whichever is later; decode counts notifications in ``poll()``.

The side channel is a small TCP listener per engine (127.0.0.1) served by a thread, as vLLM's
handshake listener is: it answers "hello" with the static metadata (agent metadata, region
addresses) and queues every other message for the engine thread, which alone touches the agent
(NIXL agents are not thread-safe). Messages are length-prefixed JSON.

One TP rank on each side with the same layout (the reference model's caches): heterogeneous TP is
kvpushd's business, not the baselines'.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import queue
import socket
import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpushd.transfer.descs import RegionSpec, block_descs, leg_indices, region_bases

from .engine import KVEvents
from .kv import PagedKV, as_caches

MAX_FRAME = 16 << 20


def _send(sock: socket.socket, obj: Mapping[str, Any]) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("side channel closed")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise ConnectionError(f"side channel frame of {n} bytes")
    out: dict[str, Any] = json.loads(_recv_exact(sock, n))
    return out


class SideChannel:
    """A TCP listener served by threads: "hello" gets the static metadata, the rest is queued."""

    def __init__(self, static: Mapping[str, Any], host: str = "127.0.0.1") -> None:
        self.static = dict(static)
        self.inbox: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._lsock = socket.create_server((host, 0))
        self.host, self.port = host, int(self._lsock.getsockname()[1])
        self._closed = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, name="inengine-side-channel", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self._lsock.accept()
            except OSError:
                return
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns.append(c)
            threading.Thread(target=self._serve, args=(c,), name="inengine-side-conn", daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        with contextlib.suppress(OSError, ConnectionError, ValueError):
            while True:
                msg = _recv(c)
                if msg.get("op") == "hello":
                    _send(c, self.static)
                else:
                    self.inbox.put(msg)

    def drain(self) -> list[dict[str, Any]]:
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._closed = True
        for s in [self._lsock, *self._conns]:
            with contextlib.suppress(OSError):
                s.close()


def connect(host: str, port: int, timeout_s: float = 10.0) -> socket.socket:
    s = socket.create_connection((host, port), timeout=timeout_s)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _new_agent(name: str, backend: str = "UCX") -> Any:
    """An agent on ``backend`` (UCX, or LIBFABRIC: ``kvpushd_lab.backend``) without NIXL's progress
    thread (it would spin a core): the engine thread polls."""
    import logging

    from ..backend import nixl_agent, preload

    preload(backend)
    import nixl._api  # noqa: F401 - first: importing it sets the "nixl" logger's level

    # NIXL logs INFO lines to stdout, which belongs to the bench's table or JSON. (Only the level:
    # re-pointing its handler's stream, as rawnixl does, upsets pytest's capture in process.)
    logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent(name, backend)


@dataclass
class _Remote:
    agent: str
    dlist: Any
    bases: Any


class _InEngineBase:
    """The NIXL agent of one engine (TP1) on its KV cache, its prepared list and its side channel."""

    mode = ""

    def __init__(self, kv: PagedKV | Sequence[PagedKV], engine_id: str, host: str = "127.0.0.1",
                 backend: str = "UCX") -> None:
        caches = as_caches(kv)
        if len(caches) != 1:
            raise ValueError("the in-engine baselines run TP1 engines only")
        c = self.cache = caches[0]
        self.engine_id = engine_id
        layout = c.region_layout()
        base = c.k[0].data_ptr() - layout[0][0]  # address of the memory the cache's views start at
        self.regions = [RegionSpec(base + off, nb, bl, st, 0) for off, nb, bl, st in layout]
        self.agent = _new_agent(f"inengine-{self.mode}-{engine_id}-{os.getpid()}", backend)
        start = self.regions[0].addr
        self._reg = self.agent.register_memory([(start, c.nbytes, 0, "")], "DRAM")
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs(self.regions), "DRAM")
        self.bases = region_bases(self.regions)
        meta = bytes(self.agent.get_agent_metadata())
        self.side = SideChannel({
            "engine_id": engine_id, "agent": self.agent.name, "meta": base64.b64encode(meta).decode(),
            "regions": [[r.addr, r.num_blocks, r.block_len, r.block_stride] for r in self.regions]}, host)
        self.remotes: dict[str, _Remote] = {}  # by remote engine id
        self._failed_now: dict[str, str] = {}
        self.unknown_notifs = 0
        self.handshakes = 0

    @property
    def kv_params(self) -> dict[str, Any]:
        """What a decode engine needs to find this one (vLLM's names; the port is the side channel's)."""
        return {"remote_engine_id": self.engine_id, "remote_host": self.side.host, "remote_port": self.side.port,
                "tp_size": 1}

    def _load(self, static: Mapping[str, Any]) -> _Remote:
        """Load a remote agent's metadata and prepare its block list (once per remote engine)."""
        eid = str(static["engine_id"])
        r = self.remotes.get(eid)
        if r is not None:
            return r
        regions = [RegionSpec(int(a), int(nb), int(bl), int(st), 0) for a, nb, bl, st in static["regions"]]
        if len(regions) != len(self.regions) or regions[0].block_len != self.regions[0].block_len:
            raise ValueError(f"engine {eid!r} has another KV layout")
        name = self.agent.add_remote_agent(base64.b64decode(static["meta"]))
        if isinstance(name, bytes):
            name = name.decode()
        r = _Remote(str(name), self.agent.prep_xfer_dlist(str(name), block_descs(regions), "DRAM"),
                    region_bases(regions))
        self.remotes[eid] = r
        self.handshakes += 1
        return r

    def _indices(self, r: _Remote, local: Sequence[int], remote: Sequence[int]) -> tuple[Any, Any]:
        if len(local) != len(remote):
            raise ValueError(f"block counts differ ({len(local)} local, {len(remote)} remote)")
        return (leg_indices(self.bases, np.asarray(local, dtype=np.int64)),
                leg_indices(r.bases, np.asarray(remote, dtype=np.int64)))

    def _post(self, op: str, r: _Remote, local: Sequence[int], remote: Sequence[int], notif: bytes) -> Any:
        lidx, ridx = self._indices(r, local, remote)
        h = self.agent.make_prepped_xfer(op, self.local, lidx, r.dlist, ridx, notif)
        if self.agent.transfer(h) == "ERR":
            h.release()
            raise RuntimeError(f"NIXL {op} could not be posted")
        return h

    def _notifs(self) -> list[str]:
        out = []
        for msgs in self.agent.get_new_notifs().values():
            out += [bytes(m).decode(errors="replace") for m in msgs]
        return out

    def on_prefill_done(self, req_id: str, block_ids: Sequence[int]) -> dict[str, Any]:
        raise RuntimeError("not a prefill engine")

    def on_blocks_allocated(self, req_id: str, block_ids: Sequence[int], kv_params: Mapping[str, Any]) -> None:
        raise RuntimeError("not a decode engine")

    def close(self) -> None:
        self.side.close()
        with contextlib.suppress(Exception):
            for r in self.remotes.values():
                r.dlist.release()
                self.agent.remove_remote_agent(r.agent)
            self.local.release()
            self.agent.deregister_memory(self._reg)
        self.remotes = {}


class InEnginePullHooks(_InEngineBase):
    """vLLM NixlConnector-style pull: decode READs after prefill, then notifies prefill to free."""

    mode = "pull"

    def __init__(self, kv: PagedKV | Sequence[PagedKV], engine_id: str, host: str = "127.0.0.1",
                 backend: str = "UCX") -> None:
        super().__init__(kv, engine_id, host, backend)
        self._held: set[str] = set()                         # prefill: transfer ids whose blocks wait
        self._reads: dict[str, tuple[Any, str, str]] = {}    # decode: req id -> (handle, tid, remote agent)

    def on_prefill_done(self, req_id: str, block_ids: Sequence[int]) -> dict[str, Any]:
        self._held.add(req_id)
        return {"transfer_id": req_id, **self.kv_params, "remote_block_ids": list(block_ids), "transfer_mode": "pull"}

    def on_blocks_allocated(self, req_id: str, block_ids: Sequence[int], kv_params: Mapping[str, Any]) -> None:
        tid = str(kv_params.get("transfer_id") or req_id)
        try:
            eid = str(kv_params["remote_engine_id"])
            r = self.remotes.get(eid)
            if r is None:  # the handshake: fetch the prefill agent's metadata over the side channel
                with connect(str(kv_params["remote_host"]), int(kv_params["remote_port"])) as s:
                    _send(s, {"op": "hello"})
                    r = self._load(_recv(s))
            h = self._post("READ", r, block_ids, kv_params["remote_block_ids"], b"")
        except Exception as e:
            self._failed_now[req_id] = f"pull: {e}"
            return
        self._reads[req_id] = (h, tid, r.agent)

    def poll(self) -> KVEvents:
        ev = KVEvents(set(), set(), self._failed_now)
        self._failed_now = {}
        for tid in self._notifs() if self._held else ():
            if tid in self._held:
                self._held.discard(tid)
                ev.finished_sending.add(tid)
            else:
                self.unknown_notifs += 1
        for rid, (h, tid, agent) in list(self._reads.items()):
            st = self.agent.check_xfer_state(h)
            if st == "PROC":
                continue
            del self._reads[rid]
            h.release()
            if st == "DONE":
                self.agent.send_notif(agent, tid.encode())  # prefill may free its blocks now
                ev.finished_recving.add(rid)
            else:
                ev.failed[rid] = f"NIXL READ ended in state {st}"
        return ev


class InEnginePushHooks(_InEngineBase):
    """NixlPushConnector-style push: decode registers at allocation, prefill WRITEs with a notification."""

    mode = "push"

    def __init__(self, kv: PagedKV | Sequence[PagedKV], engine_id: str, host: str = "127.0.0.1",
                 backend: str = "UCX") -> None:
        super().__init__(kv, engine_id, host, backend)
        # prefill side
        self._done: dict[str, list[int]] = {}               # tid -> source blocks (prefill done)
        self._regs: dict[str, tuple[str, list[int]]] = {}   # tid -> (decode engine, destination blocks)
        self._writes: dict[str, Any] = {}                   # tid -> WRITE handle
        # decode side
        self._conns: dict[str, socket.socket] = {}          # prefill engine id -> side channel connection
        self._expect: dict[str, str] = {}                   # tid -> req id

    # prefill
    def on_prefill_done(self, req_id: str, block_ids: Sequence[int]) -> dict[str, Any]:
        self._done[req_id] = list(block_ids)
        self._registrations()
        self._match(req_id)
        return {"transfer_id": req_id, **self.kv_params, "transfer_mode": "push"}

    def _registrations(self) -> None:
        for msg in self.side.drain():
            if msg.get("op") != "register":
                continue
            tid = str(msg["tid"])
            try:
                if msg.get("static"):
                    self._load(msg["static"])
                if str(msg["engine"]) not in self.remotes:
                    raise ValueError(f"unknown decode engine {msg['engine']!r}")
            except Exception as e:
                self._failed_now[tid] = f"registration: {e}"
                continue
            self._regs[tid] = (str(msg["engine"]), [int(b) for b in msg["blocks"]])
            self._match(tid)

    def _match(self, tid: str) -> None:
        if tid not in self._done or tid not in self._regs:
            return
        src = self._done.pop(tid)
        eid, dst = self._regs.pop(tid)
        try:
            self._writes[tid] = self._post("WRITE", self.remotes[eid], src, dst, tid.encode())
        except Exception as e:
            self._failed_now[tid] = f"push: {e}"

    # decode
    def on_blocks_allocated(self, req_id: str, block_ids: Sequence[int], kv_params: Mapping[str, Any]) -> None:
        tid = str(kv_params.get("transfer_id") or req_id)
        eid = str(kv_params["remote_engine_id"])
        msg: dict[str, Any] = {"op": "register", "tid": tid, "engine": self.engine_id, "blocks": list(block_ids)}
        try:
            s = self._conns.get(eid)
            if s is None:  # first registration towards this prefill engine carries our metadata
                s = connect(str(kv_params["remote_host"]), int(kv_params["remote_port"]))
                msg["static"] = self.side.static
                self._conns[eid] = s
                self.handshakes += 1
            self._expect[tid] = req_id
            _send(s, msg)
        except Exception as e:
            self._expect.pop(tid, None)
            self._failed_now[req_id] = f"register: {e}"

    def poll(self) -> KVEvents:
        ev = KVEvents(set(), set(), self._failed_now)
        self._failed_now = {}
        if self._expect:
            for tid in self._notifs():
                rid = self._expect.pop(tid, None)
                if rid is None:
                    self.unknown_notifs += 1
                else:
                    ev.finished_recving.add(rid)
        if self._done or not self.side.inbox.empty():
            self._registrations()
        for tid, h in list(self._writes.items()):
            st = self.agent.check_xfer_state(h)
            if st == "PROC":
                continue
            del self._writes[tid]
            h.release()
            if st == "DONE":
                ev.finished_sending.add(tid)
            else:
                ev.failed[tid] = f"NIXL WRITE ended in state {st}"
        ev.failed.update(self._failed_now)
        self._failed_now = {}
        return ev

    def close(self) -> None:
        for s in self._conns.values():
            with contextlib.suppress(OSError):
                s.close()
        self._conns = {}
        super().close()
