"""The agent book: one NIXL agent per attached worker, and what it has prepared (NIXL thread only).

Each worker's memory is registered once and its descriptor list (one descriptor per region and
block) prepared once; a remote agent's list is prepared once per (local agent, remote agent, slice),
and the checked plan of a local/remote pair once per slices and direction. Per request the post
path (thread.py) builds only index arrays from these.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import structlog

from ..core.actions import StartRead, StartWrite
from ..core.errors import FailedPrecondition, InvalidArgument
from ..core.layout import check_block_ids, plan_write
from .backends import THREADS_KEY, UNADVERTISED, AgentBackend, agent_devices, iface_not_running, memory_device
from .descs import (
    WHOLE,
    PairPlan,
    Part,
    RegionSpec,
    RemoteAgent,
    block_descs,
    pair_plan,
    plan_leg,
    ready_first,
    region_bases,
)
from .records import Local, Xfer

log = structlog.get_logger(__name__)
# read_out_errors: at most this long on the NIXL thread (about 50 us and five NIXL log lines per error here),
# so that an agent that stays broken costs each failing call a bounded stall
READ_OUT_S = 0.1
LOCAL = "NIXL_INIT_AGENT"  # how prep_xfer_dlist names the local agent (a list of its own memory)


class AgentBook:
    """The NIXL agents of attached workers, by worker id. Every method runs on the NIXL thread."""

    def __init__(self, backends: Sequence[str], params_for: Callable[[str, str], dict[str, str]] | None = None,
                 param_devices: Sequence[str] = (), nixl_threads: int = 0) -> None:
        self.backends = list(backends)
        # (backend, KV device) -> NIXL init parameters; param_devices: devices with their own hints
        self._params_for = params_for or (lambda backend, device: {})
        self._param_devices = tuple(param_devices)
        self._nixl_threads = nixl_threads
        self.locals: dict[str, Local] = {}
        self._nixl: Any = None

    def init_params(self, backend: str, device: str) -> dict[str, str]:
        """NIXL init parameters for one backend of an agent whose KV lives on ``device``."""
        params = dict(self._params_for(backend, device))
        key = THREADS_KEY.get(backend)
        if self._nixl_threads > 0 and key:
            params.setdefault(key, str(self._nixl_threads))
        return params

    def probe(self) -> None:
        """Import NIXL and create each backend once with its parameters, so that a plugin that cannot
        load, a bad value or a bad device fails at start, not at the first Attach."""
        import nixl._api as nixl_api

        self._nixl = nixl_api
        probe = nixl_api.nixl_agent("kvpushd-probe", nixl_api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        missing = [b for b in self.backends if b not in probe.get_plugin_list()]
        if missing:
            raise FailedPrecondition(f"NIXL backend(s) {missing} not available; have {probe.get_plugin_list()}")
        for b in self.backends:
            advertised = probe.get_plugin_params(b)  # {} where the plugin is listed but cannot load
            known = set(advertised) | UNADVERTISED.get(b, frozenset())
            for device in ("", *self._param_devices):
                params = self.init_params(b, device)
                where = f"transfer.device_params.{device} over transfer.backend_params" if device else \
                    "transfer.backend_params"
                if device and params == self.init_params(b, ""):
                    continue
                try:
                    trial = nixl_api.nixl_agent(f"kvpushd-probe-{b}-{device}", nixl_api.nixl_agent_config(
                        enable_prog_thread=False, backends=[]))
                    trial.create_backend(b, params)
                except Exception as e:
                    if not advertised:
                        raise FailedPrecondition(
                            f"NIXL lists a {b} plugin but cannot load it ({type(e).__name__}: {e}): a shared "
                            f"library it needs is missing (LIBFABRIC: libfabric.so.1 from the EFA installer, "
                            f"hwloc, libnuma; `ldd` the plugin's libplugin_{b}.so)") from None
                    why = (iface_not_running(os.environ) if b == "LIBFABRIC" else "") or \
                        "see the NIXL/UCX lines above in the log"
                    raise FailedPrecondition(f"NIXL backend {b} does not start with {params} ({where}): "
                                             f"{type(e).__name__}: {e}; {why}") from None
                del trial
                unknown = sorted(set(params) - known)
                if unknown:  # NIXL ignores unknown keys silently: a typo would change nothing
                    raise FailedPrecondition(f"NIXL backend {b} has no parameter(s) {unknown} ({where}); it "
                                             f"takes {sorted(known)}")
        del probe

    def attach(self, worker_id: str, agent_name: str, mem_type: str, mappings: Sequence[tuple[int, int, int]],
               regions: Sequence[RegionSpec], receives: bool, bell: Any = None) -> bytes:
        """Create the worker's agent, register its memory, prepare its descriptors; -> its metadata."""
        nx = self._nixl
        # No NIXL progress thread: it spins a whole core per agent (pthrDelay is 0 in the Python
        # API). The NIXL thread drives progress instead, by polling transfers and notifications.
        # Backends are created here rather than by nixl_agent_config, which cannot pass init parameters.
        cfg = nx.nixl_agent_config(enable_prog_thread=False, backends=[])
        device = memory_device(mem_type, mappings)
        used = []
        try:
            agent = nx.nixl_agent(agent_name, cfg)
            for b in self.backends:
                params = self.init_params(b, device)
                agent.create_backend(b, params)
                used.append(AgentBackend(b, dict(agent.get_backend_params(b)), *agent_devices(b, params), device))
        except Exception as e:
            raise FailedPrecondition(f"NIXL could not create an agent with backends {self.backends}: {e}") from None
        try:
            reg_descs = agent.register_memory([(a, s, d, "") for a, s, d in mappings], mem_type)
        except Exception as e:
            raise FailedPrecondition(f"NIXL could not register the worker's memory ({mem_type}): {e}") from None
        try:
            dlist = agent.prep_xfer_dlist(LOCAL, block_descs(regions), mem_type)
        except Exception:
            agent.deregister_memory(reg_descs)
            raise
        self.locals[worker_id] = Local(worker_id, agent, mem_type, tuple(regions), reg_descs, dlist,
                                       region_bases(regions), receives, bell=bell, backends=tuple(used))
        return bytes(agent.get_agent_metadata())

    def load_remote(self, loc: Local, remote: RemoteAgent) -> None:
        """Load a remote agent's metadata into this local agent, once."""
        if remote.name not in loc.loaded:
            loc.agent.add_remote_agent(remote.metadata)
            loc.loaded.add(remote.name)

    def prepared(self, loc: Local, part: Part, remote: RemoteAgent | None = None) -> Any:
        """A descriptor list of one slice of each block, prepared once per agent and slice: the remote
        agent's in this local agent, or (no ``remote``) the local agent's own (the whole block: at attach)."""
        if remote is None and part == WHOLE:
            return loc.dlist
        name = remote.name if remote is not None else LOCAL
        dlist = loc.lists.get((name, part))
        if dlist is None:
            if remote is not None:
                self.load_remote(loc, remote)
            regions, mem_type = (loc.regions, loc.mem_type) if remote is None else (remote.regions, remote.mem_type)
            dlist = loc.lists[(name, part)] = loc.agent.prep_xfer_dlist(name, block_descs(regions, part), mem_type)
        return dlist

    @staticmethod
    def pair(loc: Local, remote: RemoteAgent, src_part: Part, dst_part: Part, write: bool) -> PairPlan:
        """The checked plan of a local/remote pair and slices, made once (``write``: the local side is the source)."""
        key = (remote.name, src_part, dst_part, "w" if write else "r")
        plan = loc.pairs.get(key)
        if plan is None:
            ours, theirs = (loc.regions, loc.bases), (remote.regions, region_bases(remote.regions))
            (src, src_bases), (dst, dst_bases) = (ours, theirs) if write else (theirs, ours)
            plan = loc.pairs[key] = pair_plan(src, dst, src_part, dst_part, src_bases, dst_bases)
        return plan

    @staticmethod
    def read_out_errors(loc: Local, budget_s: float = READ_OUT_S) -> tuple[int, dict[str, list[bytes]], bool]:
        """Read the completions in error out of a local agent's queues: -> (errors read, the notifications
        of the first clean poll, clean). NIXL 1.5.1's LIBFABRIC backend leaves every other cancelled
        operation of a dead peer's transfer in the rail's completion queue, and each later call that
        progresses the agent (a check, a post, the handshake that loading a new peer's metadata sends)
        reads one of them and fails with NIXL_ERR_BACKEND. Polling notifications progresses the agent
        and reads one per call; it stops at the first clean poll or after ``budget_s``. On UCX the first
        poll is clean."""
        t0 = time.perf_counter()
        errors = 0
        while True:
            try:
                return errors, loc.agent.get_new_notifs(), True
            except Exception:
                errors += 1
                if time.perf_counter() - t0 > budget_s:
                    return errors, {}, False

    def forget_remote(self, name: str) -> None:
        """Drop a remote agent's prepared lists, pair plans and metadata from every local agent."""
        for loc in self.locals.values():
            try:
                for key in [k for k in loc.lists if k[0] == name]:
                    loc.lists.pop(key).release()
                for pk in [k for k in loc.pairs if k[0] == name]:
                    del loc.pairs[pk]
                if name in loc.loaded:
                    loc.loaded.discard(name)
                    loc.agent.remove_remote_agent(name)
            except Exception:
                log.warning("releasing remote agent failed", remote_agent=name, exc_info=True)

    @staticmethod
    def release(loc: Local) -> None:
        """Release everything prepared on a local agent and deregister its memory."""
        for dlist in loc.lists.values():
            dlist.release()
        loc.dlist.release()
        loc.agent.deregister_memory(loc.reg_descs)
        del loc.agent

    # -- one transfer's descriptors -------------------------------------------------------

    def xfer_maker(self, loc: Local, plan: StartWrite | StartRead, remote: RemoteAgent) -> Xfer:
        """The descriptors of the core's plan, ready to post. For the prepared lists,
        ``make(notif, lo, hi)`` posts index ``lo`` to ``hi`` only (region-major: a run of whole
        regions) and ``make.indices`` says how many there are."""
        write = isinstance(plan, StartWrite)
        src = plan.src_blocks
        dst = plan.registration.block_ids if isinstance(plan, StartWrite) else plan.dst_blocks
        src_part, dst_part = plan.src_part, plan.dst_part
        if isinstance(plan, StartWrite) and plan.planned:
            s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
            check_block_ids(s, min(r.num_blocks for r in loc.regions), d, min(r.num_blocks for r in remote.regions))
            tp = plan_write(loc.regions, remote.regions, s, d, plan.registration.skip_tokens, src_part, dst_part,
                            plan.skip_replicated)
            if not len(tp.src):
                raise InvalidArgument("nothing to write: every region is written by another producer rank")
            self.load_remote(loc, remote)
            ldescs = loc.agent.get_xfer_descs(tp.src, loc.mem_type)
            rdescs = loc.agent.get_xfer_descs(tp.dst, remote.mem_type)
            return Xfer(lambda n, lo=0, hi=0: loc.agent.initialize_xfer("WRITE", ldescs, rdescs, remote.name, n),
                        tp.nbytes, tp.requested, len(tp.src))
        local_part, remote_part = (src_part, dst_part) if write else (dst_part, src_part)
        rdlist, ldlist = self.prepared(loc, remote_part, remote), self.prepared(loc, local_part)
        p = plan_leg(self.pair(loc, remote, src_part, dst_part, write), src, dst)
        lidx, ridx = (p.src_idx, p.dst_idx) if write else (p.dst_idx, p.src_idx)
        return Xfer(Prepped(loc.agent, "WRITE" if write else "READ", ldlist, lidx, rdlist, ridx), p.nbytes,
                    p.requested, p.merged)


class Prepped:
    """A prepared transfer of index lists, whole or a slice of them (a run of layer groups)."""

    def __init__(self, agent: Any, op: str, ldlist: Any, lidx: Any, rdlist: Any, ridx: Any) -> None:
        self.agent, self.op, self.ldlist, self.lidx, self.rdlist, self.ridx = agent, op, ldlist, lidx, rdlist, ridx
        self.indices = len(lidx)

    def ready_first(self, blocks: int, ready: int) -> None:
        """Move every region's first ``ready`` blocks (of ``blocks``) to the front, on both sides."""
        self.lidx, self.ridx = ready_first(self.lidx, blocks, ready), ready_first(self.ridx, blocks, ready)

    def __call__(self, notif: bytes, lo: int = 0, hi: int = 0) -> Any:
        li, ri = (self.lidx[lo:hi], self.ridx[lo:hi]) if hi else (self.lidx, self.ridx)
        return self.agent.make_prepped_xfer(self.op, self.ldlist, li, self.rdlist, ri, notif)
