"""The NIXL thread: the only code that calls NIXL (``engine`` means the LLM engine elsewhere).

NIXL agents are not thread-safe, so one thread owns every agent and every call on it. The asyncio
side hands it work through a queue (``submit``) and gets results back with
``loop.call_soon_threadsafe``. Between commands the thread polls in-flight WRITEs and, while the
decode side waits for any, new notifications.

One NIXL agent per attached worker: its memory is registered once, and its descriptor list (one
descriptor per region and block) is prepared once. A remote consumer's list is prepared once per
(local agent, remote agent) pair. Per request only numpy index arrays are built; NIXL merges
descriptors that are adjacent on both sides into one, and we sort nothing, so a request whose
blocks are allocated in runs costs one descriptor per run and region.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np
import structlog

from ..core.errors import FailedPrecondition, InvalidArgument
from ..core.layout import check_block_ids, plan_write
from ..core.notif import decode as decode_notif
from ..core.notif import decode_read as decode_read_notif
from ..core.rendezvous import LegKey
from .backends import THREADS_KEY, UNADVERTISED, AgentBackend, agent_devices, memory_device
from .descs import (
    WHOLE,
    IntArray,
    PairPlan,
    Part,
    RegionSpec,
    RemoteAgent,
    block_descs,
    pair_plan,
    plan_leg,
    region_bases,
)
from .faults import Faults
from .records import Inflight, Local, ReadResult, WriteResult, transfer_id_of

log = structlog.get_logger(__name__)
T = TypeVar("T")


class TransferThread:
    """Owns the NIXL agents. Public methods are called from the event loop."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        backends: Sequence[str],
        on_write_done: Callable[[list[WriteResult]], None],
        on_notifications: Callable[[list[tuple[int, int]]], None],
        poll_interval_s: float = 0.0002,
        poll_max_interval_s: float = 0.001,
        nixl_threads: int = 0,
        params_for: Callable[[str, str], dict[str, str]] | None = None,
        param_devices: Sequence[str] = (),
        on_read_done: Callable[[list[ReadResult]], None] | None = None,
        on_read_notifications: Callable[[list[tuple[str, int, int]]], None] | None = None,
        write_timeout_s: float = 60.0,
        poll_hot_s: float = 0.0,
    ) -> None:
        self._loop = loop
        self._backends = list(backends)
        # (backend, KV device) -> NIXL init parameters; param_devices: devices with their own hints
        self._params_for = params_for or (lambda backend, device: {})
        self._param_devices = tuple(param_devices)
        self.agent_backends: dict[str, tuple[AgentBackend, ...]] = {}  # worker id -> its agent's backends
        self._on_write_done = on_write_done
        self._on_notifications = on_notifications
        self._poll_s = poll_interval_s
        self._write_timeout_s = write_timeout_s  # a WRITE or READ in flight longer than this is cancelled
        self._poll_max_s = max(poll_max_interval_s, poll_interval_s)
        self._poll_hot_s = poll_hot_s  # a new receive keeps the short interval this long (set_expecting)
        self._hot_until = 0.0  # time.monotonic(): written by the loop, read by the thread (a float: atomic)
        self._nixl_threads = nixl_threads
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._locals: dict[str, Local] = {}
        self._inflight: list[Inflight] = []
        self._forget_later: set[str] = set()
        self._drained: list[tuple[str, Future[None]]] = []
        self.expecting = 0  # number of receives waiting for notifications (set_expecting)
        self.stray_notifications = 0
        self.faults = Faults.from_env()  # test-only fault injection (faults.py): off unless KVPUSHD_FAULTS
        if self.faults.active:
            log.warning("KVPUSHD_FAULTS is set: WRITEs will fail on purpose (tests only)", faults=self.faults.spec)
        # Pull mode: READs this node posted (decode side), and how many offered legs wait for a
        # READ notification on our producer agents (prefill side, set_pulling).
        self._on_read_done = on_read_done
        self._on_read_notifications = on_read_notifications
        self.pulling = 0
        self._thread = threading.Thread(target=self._run, name="kvpushd-nixl", daemon=True)
        self._stopping = False
        self._nixl: Any = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Import NIXL and check the backends exist before the daemon says READY."""
        self._thread.start()
        self._call(self._probe).result(timeout=300)  # first import of nixl (and torch) is slow on a busy host

    def _probe(self) -> None:
        import nixl._api as nixl_api

        self._nixl = nixl_api
        probe = nixl_api.nixl_agent("kvpushd-probe", nixl_api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        missing = [b for b in self._backends if b not in probe.get_plugin_list()]
        if missing:
            raise FailedPrecondition(f"NIXL backend(s) {missing} not available; have {probe.get_plugin_list()}")
        for b in self._backends:
            advertised = probe.get_plugin_params(b)  # {} where the plugin is listed but cannot load
            known = set(advertised) | UNADVERTISED.get(b, frozenset())
            for device in ("", *self._param_devices):
                params = self.init_params(b, device)
                where = f"transfer.device_params.{device} over transfer.backend_params" if device else \
                    "transfer.backend_params"
                if device and params == self.init_params(b, ""):
                    continue
                # Each backend is created once here, so a plugin that cannot load, a bad value or a
                # bad device fails at start, not at the first Attach.
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
                    raise FailedPrecondition(f"NIXL backend {b} does not start with {params} ({where}): "
                                             f"{type(e).__name__}: {e}; see the NIXL/UCX lines above in "
                                             "the log") from None
                del trial
                unknown = sorted(set(params) - known)
                if unknown:  # NIXL ignores unknown keys silently: a typo would change nothing
                    raise FailedPrecondition(f"NIXL backend {b} has no parameter(s) {unknown} ({where}); it "
                                             f"takes {sorted(known)}")
        del probe

    def init_params(self, backend: str, device: str) -> dict[str, str]:
        """NIXL init parameters for one backend of an agent whose KV lives on ``device``."""
        params = dict(self._params_for(backend, device))
        key = THREADS_KEY.get(backend)
        if self._nixl_threads > 0 and key:
            params.setdefault(key, str(self._nixl_threads))
        return params

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for in-flight WRITEs (bounded), release every agent, end the thread. Idempotent."""
        if self._stopping or not self._thread.is_alive():
            return
        self._stopping = True
        deadline = time.monotonic() + timeout_s

        def shutdown() -> None:
            while self._inflight and time.monotonic() < deadline:
                self._poll_inflight()
                time.sleep(0.001)
            self._cancel_inflight("the daemon is stopping")
            for wid in list(self._locals):
                self._release(wid)

        try:
            self._call(shutdown).result(timeout=timeout_s + 5)
        finally:
            self._q.put(None)
            self._thread.join(timeout=5)

    # -- API for the event loop ---------------------------------------------------------------

    def attach(self, worker_id: str, agent_name: str, mem_type: str,
               mappings: Sequence[tuple[int, int, int]], regions: Sequence[RegionSpec],
               receives: bool) -> asyncio.Future[bytes]:
        """Create the worker's agent, register its memory, prepare its descriptors; -> metadata."""
        return asyncio.wrap_future(self._call(
            lambda: self._attach(worker_id, agent_name, mem_type, mappings, regions, receives)))

    def detach(self, worker_id: str) -> asyncio.Future[None]:
        """Wait for the worker's in-flight WRITEs, then release its agent and registrations."""
        fut: Future[None] = Future()

        def run() -> None:
            self._drained.append((worker_id, fut))
            self._check_drained()

        self._q.put(run)
        return asyncio.wrap_future(fut)

    def post_write(self, leg: LegKey, worker_id: str, src: Sequence[int], remote: RemoteAgent,
                   dst: Sequence[int], notif: bytes, src_part: Part = WHOLE, dst_part: Part = WHOLE,
                   skip_tokens: int = 0, skip_replicated: bool = False, planned: bool = False) -> None:
        """Queue a WRITE as the core planned it; its WriteResult comes back through on_write_done.

        ``planned`` False: blocks map one to one, through the prepared lists. True (other block
        sizes, ``skip_tokens``, NHD or replicated regions across TP sizes, ``skip_replicated``):
        the descriptors are planned per request by ``core.layout.plan_write``."""
        t0 = time.perf_counter()
        if planned:
            self._q.put(lambda: self._post_planned(leg, worker_id, src, remote, dst, notif, t0, src_part, dst_part,
                                                   skip_tokens, skip_replicated))
        else:
            self._q.put(lambda: self._post(leg, worker_id, src, remote, dst, notif, t0, src_part, dst_part))

    def post_read(self, key: Any, worker_id: str, dst: Sequence[int], remote: RemoteAgent,
                  src: Sequence[int], notif: bytes, src_part: Part = WHOLE, dst_part: Part = WHOLE) -> None:
        """Pull mode: queue a READ of ``remote``'s ``src`` blocks into worker ``worker_id``'s ``dst``
        blocks (the notification goes to ``remote``); its ReadResult comes back through on_read_done."""
        t0 = time.perf_counter()
        self._q.put(lambda: self._post_read(key, worker_id, dst, remote, src, notif, t0, src_part, dst_part))

    def set_pulling(self, n: int) -> None:
        """Prefill side: how many offered legs wait for a READ notification; wakes the thread from idle."""
        was = self.pulling
        self.pulling = n
        if n > was:
            self._hot_until = time.monotonic() + self._poll_hot_s
        if n > 0 and was == 0:
            self._q.put(_wake)

    def set_expecting(self, n: int) -> None:
        """The loop says how many receives wait for notifications; wakes the thread from idle. More of
        them than before: a new Expect, whose WRITE comes when its prefill ends (a prefill of up to
        ``poll_hot_s`` finds the thread polling at the short interval, not backed off)."""
        was = self.expecting
        self.expecting = n
        if n > was:
            self._hot_until = time.monotonic() + self._poll_hot_s
        if n > 0 and was == 0:
            self._q.put(_wake)

    # -- the thread ----------------------------------------------------------------------------

    def _call(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)

        self._q.put(run)
        return fut

    def _run(self) -> None:
        """Commands first, then progress. Idle (nothing in flight, nothing expected) the thread
        sleeps until a command comes. Busy, it polls every ``poll_interval_s`` while something
        happens and for ``HOT_S`` after, and for ``poll_hot_s`` after a new receive is expected,
        then backs off (doubling) to ``poll_max_interval_s``: a completion right after activity, or
        for a prefill shorter than ``poll_hot_s``, is seen within the short interval, one after a
        long quiet wait within the max interval, and a long wait costs ~1/max_interval wakeups a
        second instead of 1/min."""
        wait = self._poll_s
        hot_until = 0.0
        while True:
            busy = bool(self._inflight) or self.expecting > 0 or self.pulling > 0
            try:
                cmd = self._q.get(timeout=wait) if busy else self._q.get()
            except queue.Empty:
                cmd = _NOOP
            worked = cmd is not _NOOP
            while cmd is not _NOOP:
                if cmd is None:
                    return
                try:
                    cmd()
                except Exception:  # a bug in a command must not kill the thread
                    log.exception("transfer thread command failed")
                try:
                    cmd = self._q.get_nowait()
                except queue.Empty:
                    cmd = _NOOP
            try:
                if self._inflight:
                    worked = self._poll_inflight() or worked
                if self.expecting > 0 or self.pulling > 0:
                    worked = self._poll_notifs() or worked
            except Exception:
                log.exception("transfer thread poll failed")
            now = time.monotonic()
            if worked:
                hot_until = now + HOT_S
            hot = worked or now < hot_until or now < self._hot_until
            wait = self._poll_s if hot else min(wait * 2, self._poll_max_s)

    def _attach(self, worker_id: str, agent_name: str, mem_type: str,
                mappings: Sequence[tuple[int, int, int]], regions: Sequence[RegionSpec],
                receives: bool) -> bytes:
        nx = self._nixl
        # No NIXL progress thread: it spins a whole core per agent (pthrDelay is 0 in the Python
        # API). This thread drives progress instead, by polling transfers and notifications.
        # Backends are created here rather than by nixl_agent_config, which cannot pass init parameters.
        cfg = nx.nixl_agent_config(enable_prog_thread=False, backends=[])
        device = memory_device(mem_type, mappings)
        used = []
        try:
            agent = nx.nixl_agent(agent_name, cfg)
            for b in self._backends:
                params = self.init_params(b, device)
                agent.create_backend(b, params)
                used.append(AgentBackend(b, dict(agent.get_backend_params(b)), *agent_devices(b, params), device))
        except Exception as e:
            raise FailedPrecondition(f"NIXL could not create an agent with backends {self._backends}: {e}") from None
        try:
            reg_descs = agent.register_memory([(a, s, d, "") for a, s, d in mappings], mem_type)
        except Exception as e:
            raise FailedPrecondition(f"NIXL could not register the worker's memory ({mem_type}): {e}") from None
        try:
            dlist = agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs(regions), mem_type)
        except Exception:
            agent.deregister_memory(reg_descs)
            raise
        self._locals[worker_id] = Local(worker_id, agent, mem_type, tuple(regions), reg_descs, dlist,
                                         region_bases(regions), receives)
        self.agent_backends[worker_id] = tuple(used)
        return bytes(agent.get_agent_metadata())

    def _remote_view(self, loc: Local, remote: RemoteAgent, part: Part) -> tuple[Any, IntArray]:
        """The remote agent's descriptor list in this local agent and its region bases, prepared once per slice."""
        view = loc.remotes.get((remote.name, part))
        if view is None:
            self._load_remote(loc, remote)
            dlist = loc.agent.prep_xfer_dlist(remote.name, block_descs(remote.regions, part), remote.mem_type)
            view = loc.remotes[(remote.name, part)] = (dlist, region_bases(remote.regions))
        return view

    def _local_list(self, loc: Local, part: Part) -> Any:
        if part == WHOLE:
            return loc.dlist
        dlist = loc.slices.get(part)
        if dlist is None:
            dlist = loc.slices[part] = loc.agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs(loc.regions, part),
                                                                 loc.mem_type)
        return dlist

    def forget_remote(self, name: str) -> None:
        """A consumer agent went away: drop its prepared lists and metadata (thread-safe)."""
        def run() -> None:
            if any(f.remote == name for f in self._inflight):
                self._forget_later.add(name)  # retried once its WRITEs have settled
                return
            self._forget_later.discard(name)
            for loc in self._locals.values():
                try:
                    for key in [k for k in loc.remotes if k[0] == name]:
                        loc.remotes.pop(key)[0].release()
                    for pk in [k for k in loc.pairs if k[0] == name]:
                        del loc.pairs[pk]
                    if name in loc.loaded:
                        loc.loaded.discard(name)
                        loc.agent.remove_remote_agent(name)
                except Exception:
                    log.warning("releasing remote agent failed", remote_agent=name, exc_info=True)
        self._q.put(run)

    def _pair(self, loc: Local, remote: RemoteAgent, src_part: Part, dst_part: Part, write: bool,
              rbases: IntArray) -> PairPlan:
        """The checked plan of this local/remote pair and slices, made once."""
        key = (remote.name, src_part, dst_part, "w" if write else "r")
        plan = loc.pairs.get(key)
        if plan is None:
            if write:
                plan = pair_plan(loc.regions, remote.regions, src_part, dst_part, loc.bases, rbases)
            else:
                plan = pair_plan(remote.regions, loc.regions, src_part, dst_part, rbases, loc.bases)
            loc.pairs[key] = plan
        return plan

    def _post(self, leg: LegKey, worker_id: str, src: Sequence[int], remote: RemoteAgent,
              dst: Sequence[int], notif: bytes, t0: float, src_part: Part, dst_part: Part) -> None:
        def fail(reason: str) -> None:
            self._deliver_results([WriteResult(leg, False, reason, 0, time.perf_counter() - t0, 0.0, 0, 0)])

        t_taken = time.perf_counter()
        loc = self._locals.get(worker_id)
        if loc is None:
            return fail("producer worker detached")
        try:
            dlist, rbases = self._remote_view(loc, remote, dst_part)
            ldlist = self._local_list(loc, src_part)
            p = plan_leg(self._pair(loc, remote, src_part, dst_part, True, rbases), src, dst)
        except InvalidArgument as e:
            return fail(str(e))
        except Exception as e:
            log.warning("preparing remote descriptors failed", transfer_id=leg.transfer_id, engine_id=leg.engine_id,
                        exc_info=True)
            return fail(f"cannot prepare remote descriptors: {e}")
        self._launch_write(leg, loc, remote.name, notif, fail,
                           lambda n: loc.agent.make_prepped_xfer("WRITE", ldlist, p.src_idx, dlist, p.dst_idx, n),
                           lambda t_post: WriteResult(leg, True, "", p.nbytes, t_post - t0, 0.0, p.requested,
                                                      p.merged, t_taken - t0))

    def _launch_write(self, leg: LegKey, loc: Local, remote_name: str, notif: bytes,
                      fail: Callable[[str], None], make_handle: Callable[[bytes], Any],
                      result: Callable[[float], WriteResult]) -> None:
        """Post one WRITE (either path) and track it; KVPUSHD_FAULTS applies here."""
        fault = self.faults.on_post() if self.faults.active else ""
        if fault == "write_post":
            return fail("injected fault (KVPUSHD_FAULTS write_post): WRITE not posted")
        if fault == "write_complete":
            notif = b""  # the WRITE runs without its notification, then reports an error
        try:
            handle = make_handle(notif)
            state = loc.agent.transfer(handle)
        except Exception as e:
            log.warning("posting WRITE failed", transfer_id=leg.transfer_id, engine_id=leg.engine_id, exc_info=True)
            return fail(f"NIXL could not post the WRITE: {e}")
        t_post = time.perf_counter()
        if state == "ERR":
            handle.release()
            return fail("NIXL returned ERR when posting the WRITE")
        loc.inflight += 1
        self._inflight.append(Inflight(handle, loc, result(t_post), t_post, remote_name, fault))
        if state == "DONE":
            self._poll_inflight()
        return None

    def _load_remote(self, loc: Local, remote: RemoteAgent) -> None:
        """Load a remote agent's metadata into this local agent, once."""
        if remote.name not in loc.loaded:
            loc.agent.add_remote_agent(remote.metadata)
            loc.loaded.add(remote.name)

    def _post_planned(self, leg: LegKey, worker_id: str, src_l: Sequence[int], remote: RemoteAgent,
                      dst_l: Sequence[int], notif: bytes, t0: float, src_part: Part, dst_part: Part,
                      skip_tokens: int, skip_replicated: bool) -> None:
        """A WRITE whose descriptors are planned per request (token mapping), merged, and posted unprepared."""
        src = np.asarray(src_l, dtype=np.int64)
        dst = np.asarray(dst_l, dtype=np.int64)

        def fail(reason: str) -> None:
            self._deliver_results([WriteResult(leg, False, reason, 0, time.perf_counter() - t0, 0.0, 0, 0)])

        loc = self._locals.get(worker_id)
        if loc is None:
            return fail("producer worker detached")
        try:
            check_block_ids(src, min(r.num_blocks for r in loc.regions), dst, min(r.num_blocks for r in remote.regions))
            plan = plan_write(loc.regions, remote.regions, src, dst, skip_tokens, src_part, dst_part, skip_replicated)
            if not len(plan.src):
                raise InvalidArgument("nothing to write: every region is written by another producer rank")
            self._load_remote(loc, remote)
            ldescs = loc.agent.get_xfer_descs(plan.src, loc.mem_type)
            rdescs = loc.agent.get_xfer_descs(plan.dst, remote.mem_type)
        except InvalidArgument as e:
            return fail(f"layout mismatch: {e}" if "mismatch" not in str(e) else str(e))
        except Exception as e:
            log.warning("preparing descriptors failed", transfer_id=leg.transfer_id, engine_id=leg.engine_id,
                        exc_info=True)
            return fail(f"cannot prepare descriptors: {e}")
        self._launch_write(leg, loc, remote.name, notif, fail,
                           lambda n: loc.agent.initialize_xfer("WRITE", ldescs, rdescs, remote.name, n),
                           lambda t_post: WriteResult(leg, True, "", plan.nbytes, t_post - t0, 0.0, plan.requested,
                                                      len(plan.src)))

    def _post_read(self, key: Any, worker_id: str, dst: Sequence[int], remote: RemoteAgent,
                   src: Sequence[int], notif: bytes, t0: float, src_part: Part, dst_part: Part) -> None:
        """Pull mode: like _post with the roles swapped: the local agent is the decode worker's
        (destination), the remote one the prefill worker's (source); same slicing for hetero TP."""
        def fail(reason: str) -> None:
            self._deliver_reads([ReadResult(key, False, reason, 0, time.perf_counter() - t0, 0.0, 0, 0)])

        loc = self._locals.get(worker_id)
        if loc is None:
            return fail("decode worker detached")
        try:
            rdlist, rbases = self._remote_view(loc, remote, src_part)
            ldlist = self._local_list(loc, dst_part)
            p = plan_leg(self._pair(loc, remote, src_part, dst_part, False, rbases), src, dst)
        except InvalidArgument as e:
            return fail(str(e))
        except Exception as e:
            log.warning("preparing remote descriptors failed", transfer_id=getattr(key, "transfer_id", ""),
                        exc_info=True)
            return fail(f"cannot prepare remote descriptors: {e}")
        try:
            handle = loc.agent.make_prepped_xfer("READ", ldlist, p.dst_idx, rdlist, p.src_idx, notif)
            state = loc.agent.transfer(handle)
        except Exception as e:
            log.warning("posting READ failed", transfer_id=getattr(key, "transfer_id", ""), exc_info=True)
            return fail(f"NIXL could not post the READ: {e}")
        t_post = time.perf_counter()
        res = ReadResult(key, True, "", p.nbytes, t_post - t0, 0.0, p.requested, p.merged)
        if state == "ERR":
            handle.release()
            return fail("NIXL returned ERR when posting the READ")
        loc.inflight += 1
        self._inflight.append(Inflight(handle, loc, res, t_post, remote.name))
        if state == "DONE":
            self._poll_inflight()

    def _deliver_reads(self, results: list[ReadResult]) -> None:
        if self._on_read_done is not None:
            self._loop.call_soon_threadsafe(self._on_read_done, results)

    def _deliver_read_notifs(self, got: list[tuple[str, int, int]]) -> None:
        if got and self._on_read_notifications is not None:
            self._loop.call_soon_threadsafe(self._on_read_notifications, got)

    def _poll_inflight(self) -> bool:
        """Check every WRITE and READ in flight; one past ``write_timeout_s`` is cancelled.
        True when any of them ended."""
        done: list[Inflight] = []
        keep: list[Inflight] = []
        now = time.perf_counter()
        for f in self._inflight:
            try:
                state = f.local.agent.check_xfer_state(f.handle)
            except Exception as e:  # e.g. the remote agent was invalidated mid-transfer: it failed
                log.warning(f"checking a {f.what} failed", transfer_id=transfer_id_of(f), error=str(e))
                state = "ERR"
            hold = self.faults.write_hold_s
            if state == "DONE" and hold and f.what == "WRITE" and now - f.t_post < hold:
                state = "PROC"  # injected slow network (KVPUSHD_FAULTS write_hold_s)
            if state == "PROC" and now - f.t_post > self._write_timeout_s:
                self._cancel(f, f"not complete within transfer.write_timeout_s = {self._write_timeout_s:g}s")
                done.append(f)
                continue
            if state == "PROC":
                keep.append(f)
                continue
            self._finish(f, state == "DONE" and not f.fault,
                         f"injected fault (KVPUSHD_FAULTS {f.fault}): {f.what} completed in error" if f.fault
                         else f"{f.what} completed in error", now)
            done.append(f)
        self._inflight = keep
        if done:
            self._report(done)
        return bool(done)

    def _finish(self, f: Inflight, ok: bool, reason: str, now: float) -> None:
        f.local.inflight -= 1
        try:
            f.handle.release()
        except Exception:
            log.warning("releasing a transfer handle failed", exc_info=True)
        r = f.result
        f.result = dataclasses.replace(r, ok=ok, reason="" if ok else reason, nbytes=r.nbytes if ok else 0,
                                       xfer_s=now - f.t_post)

    def _cancel(self, f: Inflight, why: str) -> None:
        """Give up on a transfer in flight: NIXL cancels it when its handle is released; if it cannot,
        the stalled remote agent is disconnected (invalidated) first, so nothing more can land."""
        log.warning(f"cancelling a {f.what} in flight", transfer_id=transfer_id_of(f), remote_agent=f.remote[:128],
                    why=why)
        f.local.inflight -= 1
        try:
            f.handle.release()
        except Exception:
            try:
                f.local.agent.remove_remote_agent(f.remote)
                f.local.loaded.discard(f.remote)
                f.handle.release()
            except Exception:
                log.warning("a stalled transfer could not be cancelled; its agent is disconnected", exc_info=True)
        self._forget_later.add(f.remote)  # its prepared lists and metadata go too: it reloads if it comes back
        r = f.result
        f.result = dataclasses.replace(r, ok=False, reason=f"{f.what} cancelled: {why}", nbytes=0,
                                       xfer_s=time.perf_counter() - f.t_post)

    def _cancel_inflight(self, why: str) -> None:
        """Every transfer still in flight ends now, in failure (drain past its bound, stop)."""
        cancelled, self._inflight = self._inflight, []
        for f in cancelled:
            self._cancel(f, why)
        if cancelled:
            self._report(cancelled)

    def cancel_inflight(self, why: str) -> None:
        """From the loop: end every transfer in flight now (each is reported failed)."""
        self._q.put(lambda: self._cancel_inflight(why))

    def _report(self, done: list[Inflight]) -> None:
        writes = [f.result for f in done if isinstance(f.result, WriteResult)]
        reads = [f.result for f in done if isinstance(f.result, ReadResult)]
        if writes:
            self._deliver_results(writes)
        if reads:
            self._deliver_reads(reads)
        self._check_drained()
        busy = {f.remote for f in self._inflight}
        for name in [n for n in self._forget_later if n not in busy]:
            self.forget_remote(name)

    def _deliver_results(self, results: list[WriteResult]) -> None:
        self._loop.call_soon_threadsafe(self._on_write_done, results)

    def _poll_notifs(self) -> bool:
        """Hand new notifications to the loop; True when there were any."""
        got: list[tuple[int, int]] = []
        reads: list[tuple[str, int, int]] = []  # pull mode: (remote agent, registration id, rank)
        for loc in self._locals.values():
            if not loc.receives and self.pulling <= 0:
                continue
            for remote_name, msgs in loc.agent.get_new_notifs().items():
                for m in msgs:
                    parsed = decode_notif(m)
                    if parsed is not None:
                        got.append(parsed)
                    elif (rp := decode_read_notif(m)) is not None:
                        reads.append((str(remote_name), *rp))
                    else:
                        self.stray_notifications += 1
        if got:
            self._loop.call_soon_threadsafe(self._on_notifications, got)
        self._deliver_read_notifs(reads)
        return bool(got or reads)

    def _check_drained(self) -> None:
        still: list[tuple[str, Future[None]]] = []
        for wid, fut in self._drained:
            loc = self._locals.get(wid)
            if loc is not None and loc.inflight > 0:
                still.append((wid, fut))
                continue
            try:
                self._release(wid)
                fut.set_result(None)
            except Exception as e:
                fut.set_exception(e)
        self._drained = still

    def _release(self, worker_id: str) -> None:
        loc = self._locals.pop(worker_id, None)
        self.agent_backends.pop(worker_id, None)
        if loc is None:
            return
        if loc.receives or self.pulling > 0:  # hand over notifications that raced the detach
            self._poll_notifs_of(loc)
        for dlist, _ in loc.remotes.values():
            dlist.release()
        for dlist in loc.slices.values():
            dlist.release()
        loc.dlist.release()
        loc.agent.deregister_memory(loc.reg_descs)
        del loc.agent

    def _poll_notifs_of(self, loc: Local) -> None:
        notifs = loc.agent.get_new_notifs()
        got = [p for msgs in notifs.values() for m in msgs if (p := decode_notif(m)) is not None]
        if got:
            self._loop.call_soon_threadsafe(self._on_notifications, got)
        self._deliver_read_notifs([(str(name), *rp) for name, msgs in notifs.items() for m in msgs
                                   if (rp := decode_read_notif(m)) is not None])


_NOOP: Any = object()
HOT_S = 0.02  # after any command, completion or notification, poll at the short interval this long


def _wake() -> None:
    """A command that does nothing: it ends an idle wait so polling starts at once."""
