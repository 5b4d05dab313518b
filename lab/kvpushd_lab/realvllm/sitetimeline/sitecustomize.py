"""Per-request timeline of real vLLM engines and their kvpushd daemons (lab only): where a
disaggregated request's TTFT goes.

``kvpushd bench vllm --timeline DIR`` puts this directory first on every process's PYTHONPATH and sets
``KVPUSHD_LAB_TIMELINE``: every process that imports vLLM's engine core or scheduler, the kvpushd
connector or client, or the daemon appends one JSON line per event to ``<dir>/<pid>.jsonl``
(``{"t": wall seconds, "ev": name, "tid": transfer id, "rid": request id, ...}``). Nothing is patched
without the variable. ``kvpushd_lab.realvllm.timeline_report`` reads the files.

Engine events (``tid`` is the request's ``kv_transfer_params["transfer_id"]``, shared by the prefill and
the decode leg; worker processes know only ``rid``, mapped to ``tid`` by the report):
  add          EngineCore.add_request (``arrival``: the API server's arrival time)
  sched        the first step that schedules the request's tokens
  meta         build_connector_meta put an Expect (``kind`` expect) or a Publish (publish)
  step_begin   the worker's bind_connector_metadata (before the forward) of a step with that command
  fwd_end      wait_for_save of that step
  done         the worker reported finished sending / receiving (``kind`` send / recv)
  recv_seen    the scheduler took the finished receive
  first_tok    update_from_output gave the request its first output token
  figures      a completion's daemon figures
Client library: client_step (the engine thread's step() queues the command), client_sender (the
stream's sender thread takes it). Daemon: daemon_batch (the worker stream's pump reads it),
daemon_started / daemon_met / daemon_group_post / daemon_group_settled / daemon_writedone /
daemon_delivered, and daemon_thread_late: a daemon thread that sleeps 1 ms woke over 5 ms late
(``ms``; ``cpu_ms`` the process's CPU time meanwhile: near 0 means the process was not scheduled).
``KVPUSHD_LAB_VLLM_SPIN_S=S`` (``kvpushd bench vllm --vllm-spin-s``, independent of the timeline): vLLM's
shared-memory message-queue readers (each worker, and the engine core) busy-wait ``S`` seconds after a
read before parking on their notification socket, instead of vLLM's hard-coded 1 s; the knob vLLM PR
#52814 proposes as ``VLLM_SHM_BROADCAST_BUSY_LOOP_S``.
``KVPUSHD_LAB_SLICE_US=N`` (an experiment): the daemons ask the kernel for an N us scheduler slice
(sched_setattr runtime, EEVDF on Linux 6.12+), which lets their wake-ups preempt busy engine threads.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
from typing import Any

_DIR = os.environ.get("KVPUSHD_LAB_TIMELINE", "")
_SPIN_S = os.environ.get("KVPUSHD_LAB_VLLM_SPIN_S", "")
_STEPS = bool(os.environ.get("KVPUSHD_LAB_TIMELINE_STEPS"))  # also one "step" event per engine step
_tids: dict[str, str] = {}  # request id -> transfer id
_seen: dict[str, set[str]] = {}  # event -> keys already logged once
_out: Any = None


def _emit(ev: str, rid: str, once: bool = False, **kw: Any) -> None:
    global _out
    if once:
        s = _seen.setdefault(ev, set())
        if rid in s:
            return
        s.add(rid)
    if _out is None:
        _out = open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115
    _out.write(json.dumps({"t": time.time(), "ev": ev, "tid": _tids.get(rid, rid), "rid": rid, **kw}) + "\n")


def _emit_at(t: float, ev: str, rid: str, **kw: Any) -> None:
    global _out
    if _out is None:
        _out = open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115
    _out.write(json.dumps({"t": t, "ev": ev, "tid": _tids.get(rid, rid), "rid": rid, **kw}) + "\n")


def _tid_of(request: Any) -> None:
    p = getattr(request, "kv_transfer_params", None) or {}
    if p.get("transfer_id"):
        _tids[request.request_id] = str(p["transfer_id"])


def _patch_core(mod: Any) -> None:
    cls = mod.EngineCore
    orig = cls.add_request

    def add_request(self: Any, request: Any, *a: Any, **kw: Any) -> Any:
        _tid_of(request)
        _emit("add", request.request_id, arrival=getattr(request, "arrival_time", None))
        return orig(self, request, *a, **kw)

    cls.add_request = add_request


def _patch_scheduler(mod: Any) -> None:
    cls = mod.Scheduler
    sched, upd = cls.schedule, cls.update_from_output

    def schedule(self: Any, *a: Any, **kw: Any) -> Any:
        out = sched(self, *a, **kw)
        if _STEPS:
            _emit("step", "", tokens=out.total_num_scheduled_tokens, running=len(self.running),
                  waiting=len(self.waiting))
        for rid, n in out.num_scheduled_tokens.items():
            _emit("sched", rid, once=True, tokens=n)
        return out

    def update_from_output(self: Any, so: Any, mro: Any) -> Any:
        res = upd(self, so, mro)
        for eco in res.values():
            for o in eco.outputs:
                if o.new_token_ids:
                    _emit("first_tok", o.request_id, once=True)
        return res

    cls.schedule, cls.update_from_output = schedule, update_from_output


def _patch_connector(mod: Any) -> None:
    cls = mod.KVPushdConnector
    names = ("update_state_after_alloc", "build_connector_meta", "update_connector_output", "request_finished",
             "request_finished_all_groups", "bind_connector_metadata", "wait_for_save", "get_finished",
             "get_transfer_results")
    orig = {n: getattr(cls, n) for n in names if hasattr(cls, n)}
    step_rids: list[str] = []

    def build_connector_meta(self: Any, so: Any) -> Any:
        meta = orig["build_connector_meta"](self, so)
        for e in getattr(meta, "expects", ()):
            _tids.setdefault(e.req_id, e.transfer_id)
            _emit("meta", e.req_id, kind="expect")
        for p in getattr(meta, "publishes", ()):
            _tids.setdefault(p.req_id, p.transfer_id)
            _emit("meta", p.req_id, kind="publish", declared=bool(getattr(p, "declared", False)))
        return meta

    def bind_connector_metadata(self: Any, meta: Any) -> Any:
        step_rids[:] = [r.req_id for r in (*getattr(meta, "expects", ()), *getattr(meta, "publishes", ()))]
        for rid in step_rids:
            _emit("step_begin", rid)
        return orig["bind_connector_metadata"](self, meta)

    def wait_for_save(self: Any) -> Any:
        r = orig["wait_for_save"](self)
        for rid in step_rids:
            _emit("fwd_end", rid)
        step_rids.clear()
        return r

    def _report(res: Any) -> Any:
        if isinstance(res, tuple) and len(res) >= 2:
            sending, recving = res[0], res[1]
        else:
            sending, recving = getattr(res, "finished_sending", None), getattr(res, "finished_recving", None)
        for kind, ids in (("send", sending), ("recv", recving)):
            for rid in ids or ():
                _emit("done", rid, kind=kind)
        return res

    def get_finished(self: Any, ids: Any) -> Any:
        return _report(orig["get_finished"](self, ids))

    def get_transfer_results(self: Any, ids: Any) -> Any:
        return _report(orig["get_transfer_results"](self, ids))

    def update_connector_output(self: Any, out: Any) -> Any:
        for rid in getattr(out, "finished_recving", None) or ():
            _emit("recv_seen", rid)
        return orig["update_connector_output"](self, out)

    def request_finished_all_groups(self: Any, request: Any, block_ids: Any) -> Any:
        _emit("finished", request.request_id)
        return orig["request_finished_all_groups"](self, request, block_ids)

    for name, fn in (("build_connector_meta", build_connector_meta),
                     ("bind_connector_metadata", bind_connector_metadata), ("wait_for_save", wait_for_save),
                     ("get_finished", get_finished), ("get_transfer_results", get_transfer_results),
                     ("update_connector_output", update_connector_output),
                     ("request_finished_all_groups", request_finished_all_groups)):
        if name in orig:
            setattr(cls, name, fn)


def _patch_worker(mod: Any) -> None:
    cls = mod.KVPushdConnectorWorker
    orig = cls._on_completion

    def _on_completion(self: Any, epoch: int, c: Any) -> Any:
        pend = self._by_tid.get((True, c.transfer_id)) or self._by_tid.get((False, c.transfer_id))
        f = c.figures
        if pend is not None and f is not None:
            _emit("figures", pend.req.req_id, kind=c.kind.name, post_ms=1e3 * f.post_s,
                  transfer_ms=1e3 * f.transfer_s, rendezvous_wait_ms=1e3 * f.rendezvous_wait_s,
                  elapsed_ms=1e3 * f.elapsed_s, nbytes=f.nbytes)
        return orig(self, epoch, c)

    cls._on_completion = _on_completion


def _patch_observe(mod: Any) -> None:
    """A transfer's end brings its ledger: its stamps (monotonic) become daemon_started, daemon_met,
    daemon_writedone and daemon_delivered, placed on the wall clock by their distance from now."""
    cls = mod.Observations
    orig = cls.emit

    def emit(self: Any, rec: Any) -> Any:
        if type(rec).__name__ == "Ended":
            led, tid = rec.ledger, rec.completion.transfer_id
            wall, mono = time.time(), time.monotonic()
            for name, at in (("started", led.taken), ("met", led.met), ("writedone", led.written),
                             ("delivered", led.done)):
                if at:
                    _emit_at(wall - (mono - at), "daemon_" + name, tid, side=led.side)
        return orig(self, rec)

    cls.emit = emit


def _patch_staged(mod: Any) -> None:
    cls = mod.Stages
    post, settled = cls._post, cls.settled

    def _post(self: Any, s: Any, lo: int, hi: int, msg: bytes, track: Any) -> Any:
        _emit("daemon_group_post", s.key.transfer_id, lo=lo, hi=hi)
        return post(self, s, lo, hi, msg, track)

    def _settled(self: Any, f: Any) -> Any:
        _emit("daemon_group_settled", f.stage.key.transfer_id)
        return settled(self, f)

    cls._post, cls.settled = _post, _settled


def _patch_thread(mod: Any) -> None:
    cls = mod.TransferThread
    orig = cls._poll_notifs

    def _poll_notifs(self: Any, *args: Any) -> Any:
        got = orig(self, *args)
        if got:
            _emit("daemon_notifs", "")
        return got

    cls._poll_notifs = _poll_notifs


def _patch_stream(mod: Any) -> None:
    cls = mod.StreamWorker
    step, record = cls.step, cls._record

    def _step(self: Any) -> Any:
        for q in self._batch:  # command records (kvpushd_client.types)
            _emit("client_step", q.transfer_id, op=type(q).__name__)
        return step(self)

    def _record(self: Any, first: int, batch: Any) -> Any:
        for q in batch:
            _emit("client_sender", q.transfer_id, op=type(q).__name__)
        return record(self, first, batch)

    cls.step, cls._record = _step, _record


def _patch_pump(mod: Any) -> None:
    cls = mod.Pump
    orig = cls.batch

    def batch(self: Any, b: Any) -> Any:
        for it in getattr(b, self.wire.items):
            try:
                kind = it.WhichOneof("op")
            except ValueError:  # not a worker command
                break
            tid = getattr(getattr(it, kind), "transfer_id", "") if kind else ""
            if tid:
                _emit("daemon_batch", tid, op=kind)
        return orig(self, b)

    cls.batch = batch


def _patch_app(mod: Any) -> None:
    """Daemon: a thread that notes when it could not run (GIL or CPU) for over 5 ms, and the loop's lag."""
    import asyncio
    import threading

    def sampler() -> None:
        while True:
            t, c = time.perf_counter(), time.process_time()
            time.sleep(0.001)
            late = time.perf_counter() - t - 0.001
            if late > 0.005:
                _emit("daemon_thread_late", "", ms=1e3 * late, cpu_ms=1e3 * (time.process_time() - c))

    def apply_slice() -> None:
        if os.environ.get("KVPUSHD_LAB_SLICE_US"):  # experiment: EEVDF custom slice (sched_setattr runtime)
            import ctypes
            import struct
            libc = ctypes.CDLL(None, use_errno=True)
            us = int(os.environ["KVPUSHD_LAB_SLICE_US"])
            attr = struct.pack("IIQiIQQQII", 56, 0, 0, 0, 0, us * 1000, 0, 0, 0, 0)
            for t in os.listdir("/proc/self/task"):
                buf = ctypes.create_string_buffer(attr)
                if libc.syscall(314, int(t), buf, 0) != 0:
                    _emit("slice_failed", "", errno=ctypes.get_errno())

    apply_slice()
    threading.Thread(target=sampler, daemon=True).start()
    orig = mod.Daemon.start if hasattr(mod, "Daemon") and hasattr(mod.Daemon, "start") else None

    async def lag() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            late = time.perf_counter() - t - 0.001
            if late > 0.005:
                _emit("daemon_loop_late", "", ms=1e3 * late)

    if orig is not None:
        async def start(self: Any, *a: Any, **kw: Any) -> Any:
            asyncio.get_running_loop().create_task(lag())
            r = await orig(self, *a, **kw)
            apply_slice()
            return r
        mod.Daemon.start = start


def _patch_shm_broadcast(mod: Any) -> None:
    cls = mod.SpinCondition
    init = cls.__init__
    grace = float(_SPIN_S)

    def __init__(self: Any, is_reader: bool, context: Any, notify_address: str, busy_loop_s: float = grace) -> None:
        init(self, is_reader, context, notify_address, busy_loop_s)

    cls.__init__ = __init__


_TIMELINE_PATCHES = {"vllm.v1.engine.core": _patch_core, "vllm.v1.core.sched.scheduler": _patch_scheduler,
            "kvpushd_client.vllm.connector": _patch_connector, "kvpushd_client.vllm.worker": _patch_worker,
            "kvpushd.runtime.observe": _patch_observe, "kvpushd.transfer.staged": _patch_staged,
            "kvpushd.transfer.thread": _patch_thread, "kvpushd_client.stream": _patch_stream,
            "kvpushd.rpc.pump": _patch_pump, "kvpushd.app": _patch_app}
_PATCHES = {**(_TIMELINE_PATCHES if _DIR else {}),
            **({"vllm.distributed.device_communicators.shm_broadcast": _patch_shm_broadcast} if _SPIN_S else {})}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            _PATCHES[name](module)

        loader.exec_module = exec_and_patch
        return spec


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
if _PATCHES:
    sys.meta_path.insert(0, _Finder())
