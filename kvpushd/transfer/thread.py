"""The NIXL thread: the only code that calls NIXL (``engine`` means the LLM engine elsewhere).

NIXL agents are not thread-safe, so one thread owns every agent and every call on it. The asyncio
side hands it work through a queue (``submit``) and gets results back with
``loop.call_soon_threadsafe``. Between commands the thread polls in-flight WRITEs and, while the
decode side waits for any, new notifications.

One NIXL agent per attached worker, with what it prepared once, lives in the agent book
(agents.py). WRITEs and READs take one post path (``_post``): per request only index arrays are
built; NIXL merges descriptors that are adjacent on both sides into one, and we sort nothing, so a
request whose blocks are allocated in runs costs one descriptor per run and region.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import structlog

from ..core.actions import LegKey, ReadKey, StartRead, StartWrite
from ..core.errors import InvalidArgument
from ..core.notif import Notified
from ..core.notif import decode as decode_notif
from ..core.notif import decode_read as decode_read_notif
from .agents import AgentBook
from .backends import AgentBackend
from .descs import RegionSpec, RemoteAgent
from .records import Inflight, Local, ReadResult, Settings, WriteResult, Xfer, transfer_id_of
from .records import Reports as ThreadReports
from .staged import Stages

log = structlog.get_logger(__name__)
T = TypeVar("T")


class TransferThread:
    """Owns the NIXL agents. Public methods are called from the event loop."""

    Reports = ThreadReports  # where its reports go: TransferThread(loop, cfg, TransferThread.Reports(...))

    def __init__(self, loop: asyncio.AbstractEventLoop, cfg: Settings, reports: ThreadReports,
                 params_for: Callable[[str, str], dict[str, str]] | None = None) -> None:
        """``cfg``: the ``[transfer]`` section; ``params_for(backend, device)``: the NIXL init parameters
        of an agent whose KV is on ``device`` (none: NIXL's defaults), probed at start for every
        device of ``cfg.device_params``."""
        self._loop = loop
        self._book = AgentBook(cfg.backends, params_for, tuple(cfg.device_params), cfg.nixl_threads)
        self._reports = reports
        self._poll_s = cfg.poll_interval_s
        self._write_timeout_s = cfg.write_timeout_s  # a WRITE or READ in flight longer than this is cancelled
        self._poll_max_s = max(cfg.poll_max_interval_s, cfg.poll_interval_s)
        self._poll_hot_s = cfg.poll_hot_s  # a new receive keeps the short interval this long (set_expecting)
        self._hot_until = 0.0  # time.monotonic(): written by the loop, read by the thread (a float: atomic)
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._inflight: list[Inflight] = []
        self._posts: list[tuple[StartWrite | StartRead, RemoteAgent, float]] = []  # this loop turn's (the loop's)
        # progressive push: legs written layer group by layer group, steps watched for completion
        on_sealed = reports.sealed
        self._stages = Stages(on_sealed and (lambda steps: loop.call_soon_threadsafe(on_sealed, steps)),
                              cfg.progressive_min_write_bytes, cfg.write_timeout_s,
                              on_error=lambda loc, why: self._hand_over(self._recover(loc, why)))
        self._forget_later: set[str] = set()
        self._drained: list[tuple[str, Future[None]]] = []
        self.expecting = 0  # number of receives waiting for notifications (set_expecting)
        self.pulling = 0  # offered legs waiting for a READ notification (set_pulling)
        self.stray_notifications = 0
        self._thread = threading.Thread(target=self._run, name="kvpushd-nixl", daemon=True)
        self._stopping = False

    def agent_backends(self, worker_id: str) -> tuple[AgentBackend, ...]:
        """The backends of the worker's agent (status); none while it is not attached."""
        loc = self._book.locals.get(worker_id)
        return loc.backends if loc is not None else ()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Import NIXL and check the backends exist before the daemon says READY."""
        self._thread.start()
        self._call(self._book.probe).result(timeout=300)  # first import of nixl (and torch) is slow on a busy host

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for in-flight WRITEs (bounded), release every agent, end the thread. Idempotent."""
        if self._stopping or not self._thread.is_alive():
            return
        self._stopping = True
        deadline = time.monotonic() + timeout_s

        def shutdown() -> None:
            self._stages.stop("the daemon is stopping")
            while self._inflight and time.monotonic() < deadline:
                self._poll_inflight()
                time.sleep(0.001)
            self._cancel_inflight("the daemon is stopping")
            self._advance()
            for wid in list(self._book.locals):
                self._release(wid)

        try:
            self._call(shutdown).result(timeout=timeout_s + 5)
        finally:
            self._q.put(None)
            self._thread.join(timeout=5)

    # -- API for the event loop ---------------------------------------------------------------

    def attach(self, worker_id: str, agent_name: str, mem_type: str,
               mappings: Sequence[tuple[int, int, int]], regions: Sequence[RegionSpec],
               receives: bool, bell: Any = None) -> asyncio.Future[bytes]:
        """Create the worker's agent, register its memory, prepare its descriptors; -> metadata.
        ``bell``: the worker's doorbell (memory.doorbell), read by this thread for progressive push."""
        return asyncio.wrap_future(self._call(
            lambda: self._book.attach(worker_id, agent_name, mem_type, mappings, regions, receives, bell)))

    def detach(self, worker_id: str) -> asyncio.Future[None]:
        """Wait for the worker's in-flight WRITEs, then release its agent and registrations. Once asked,
        the release happens whoever waits: its future cannot be cancelled (a cancelled one left in the
        drain list failed every later check of it, and every other worker's detach waited for good)."""
        fut: Future[None] = Future()
        fut.set_running_or_notify_cancel()

        def run() -> None:
            self._stages.stop("the producer worker detached", worker_id=worker_id)
            self._drained.append((worker_id, fut))
            self._advance()
            self._check_drained()

        self._submit(run)
        return asyncio.wrap_future(fut)

    def post(self, plan: StartWrite | StartRead, remote: RemoteAgent) -> None:
        """Queue the core's plan as it stands: a WRITE (its WriteResult comes back through
        on_write_done) or, pull mode, a READ of ``remote``'s blocks into the local worker's (its
        ReadResult through on_read_done; the notification goes to ``remote``).

        A WRITE's ``planned`` False: blocks map one to one, through the prepared lists. True (other
        block sizes, skip_tokens, NHD or replicated regions across TP sizes, ``skip_replicated``):
        the descriptors are planned per request by ``core.layout.plan_write``. ``layers`` > 0:
        progressive push, written layer group by layer group as the worker's doorbell passes
        engine step ``step`` (staged.py), its first ``ready_blocks`` blocks at once."""
        t0 = time.perf_counter()
        self._posts.append((plan, remote, t0))
        if len(self._posts) == 1:  # the first of this loop turn: the others go with it, for one wake-up
            self._loop.call_soon(self._send_posts)

    def _send_posts(self) -> None:
        """The loop turn's posts, as one command: the thread takes the GIL once for all of them, not once
        each (measured: 0.90x the daemons' CPU per rendezvous in ``kvpushd bench rate``)."""
        posts, self._posts = self._posts, []
        if posts:
            self._q.put(lambda: self._post_all(posts))

    def _submit(self, cmd: Callable[[], None]) -> None:
        """A command from the loop (only: the posts are the loop's), after the posts queued before it (a
        StopWrite follows its StartWrite)."""
        self._send_posts()
        self._q.put(cmd)

    def cancel_to(self, remotes: Collection[str], why: str) -> None:
        """A peer daemon is gone (silent past peer_timeout_s, or restarted): every WRITE and READ in
        flight with its agents ``remotes`` is cancelled now and no more layer groups go to them, so the
        blocks they hold are released at the peer's liveness bound, not at write_timeout_s."""
        names = frozenset(remotes)
        if not names:
            return

        def run() -> None:
            self._stages.stop(why, remotes=names)
            self._cancel_inflight(why, names)
            self._advance()
        self._submit(run)

    def stop_write(self, leg: LegKey, why: str) -> None:
        """Progressive push: post no more layer groups of ``leg`` (it settles once what was posted has)."""
        self._submit(lambda: self._stages.stop(why, leg=leg))

    def watch_step(self, worker_id: str, step: int) -> None:
        """Report (on_sealed) when the worker's engine step ``step`` is complete, by its doorbell."""
        def run() -> None:
            loc = self._book.locals.get(worker_id)
            if loc is not None:
                self._stages.watched.append((loc, step))
        self._submit(run)

    def set_pulling(self, n: int) -> None:
        """Prefill side: how many offered legs wait for a READ notification; wakes the thread from idle."""
        was, self.pulling = self.pulling, n
        self._heat(was, n)

    def set_expecting(self, n: int) -> None:
        """The loop says how many receives wait for notifications; wakes the thread from idle. More of
        them than before: a new Expect, whose WRITE comes when its prefill ends (a prefill of up to
        ``poll_hot_s`` finds the thread polling at the short interval, not backed off)."""
        was, self.expecting = self.expecting, n
        self._heat(was, n)

    def _heat(self, was: int, n: int) -> None:
        if n > was:
            self._hot_until = time.monotonic() + self._poll_hot_s
        if n > 0 and was == 0:
            self._q.put(_wake)

    def forget_remote(self, name: str) -> None:
        """From the loop: a consumer agent went away: drop its prepared lists and metadata (once no WRITE
        to it is in flight)."""
        self._submit(lambda: self._forget(name))

    def _forget(self, name: str) -> None:
        if any(f.remote == name for f in self._inflight):
            self._forget_later.add(name)  # retried once its WRITEs have settled
            return
        self._forget_later.discard(name)
        self._book.forget_remote(name)

    def cancel_inflight(self, why: str) -> None:
        """From the loop: end every transfer in flight now (each is reported failed)."""
        self._submit(lambda: self._cancel_inflight(why))

    # -- the thread ----------------------------------------------------------------------------

    def _call(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return  # its caller went before it ran: nothing done, nothing owed
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
        second instead of 1/min. A doorbell watched through a long forward is such a wait: each ring
        that posts a layer group keeps the short interval for ``HOT_S``, layers further apart than
        that are seen within the max interval (measured: a declared publish waiting on its doorbell
        cost the prefill daemon 10.5% of a core at the short interval; scripts/bench_poll_cpu.py)."""
        _name_os_thread(b"kvpushd-nixl")  # what top -H, ps -L and /proc/<pid>/task/*/comm show
        wait = self._poll_s
        hot_until = 0.0
        while True:
            busy = bool(self._inflight) or self.expecting > 0 or self.pulling > 0 or bool(self._stages)
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
                if self._stages:
                    worked = self._advance() or worked
            except Exception:
                log.exception("transfer thread poll failed")
            now = time.monotonic()
            if worked:
                hot_until = now + HOT_S
            hot = worked or now < hot_until or now < self._hot_until
            wait = self._poll_s if hot else min(wait * 2, self._poll_max_s)

    # -- the one post path, for WRITE and READ -------------------------------------------------

    def _post_all(self, posts: list[tuple[StartWrite | StartRead, RemoteAgent, float]]) -> None:
        """Post each; those NIXL completed at once (a copy inside ``transfer()``) are reported together
        after the last, in one hand-over to the loop."""
        done = False
        for plan, remote, t0 in posts:
            try:
                done = self._post(plan, remote, t0) or done
            except Exception:  # a bug in one post must not lose the others
                log.exception("transfer thread post failed")
        if done:
            self._poll_inflight()

    def _post(self, plan: StartWrite | StartRead, remote: RemoteAgent, t0: float) -> bool:
        """Post one WRITE (a StartWrite: the local worker holds the source) or READ (a StartRead:
        the local worker holds the destination) and track it; True when NIXL says it is done already.
        The descriptors come from the prepared lists, or, for a WRITE the core ``planned``, are planned
        per request (token mapping), merged, and posted unprepared."""
        write = isinstance(plan, StartWrite)
        key = plan.leg if isinstance(plan, StartWrite) else plan.key
        what = "WRITE" if write else "READ"
        t_taken = time.perf_counter()

        def result(ok: bool, reason: str, x: Xfer | None = None, t_post: float = 0.0) -> WriteResult | ReadResult:
            post_s = (t_post or time.perf_counter()) - t0
            nbytes, requested, posted = (x.nbytes, x.requested, x.posted) if x is not None else (0, 0, 0)
            if isinstance(key, LegKey):
                return WriteResult(key, ok, reason, nbytes, post_s, 0.0, requested, posted, t_taken - t0)
            return ReadResult(key, ok, reason, nbytes, post_s, 0.0, requested, posted)

        def fail(reason: str) -> bool:
            self._deliver([result(False, reason)])
            return False

        loc = self._book.locals.get(plan.producer_worker if isinstance(plan, StartWrite) else plan.worker_id)
        if loc is None:
            return fail(f"{'producer' if write else 'decode'} worker detached")
        if remote.name not in loc.loaded:
            # Loading a new remote agent's metadata sends it a handshake; on LIBFABRIC that send fails on
            # a dead peer's completions in error still queued (and the pair stays unusable after), so they
            # are read out first. One poll of notifications when there are none.
            self._hand_over(self._recover(loc, "before loading a remote agent's metadata"))
        try:
            x = self._book.xfer_maker(loc, plan, remote)
        except Exception as e:
            if _nixl_error(e):
                self._hand_over(self._recover(loc, f"preparing descriptors: {e}"))
            return fail(self._descs_failed(plan, key, e))
        if isinstance(plan, StartWrite) and plan.layers:  # progressive push: layer groups go as they become ready
            r = result(True, "", x)  # the leg's figures, whatever WRITEs carry it
            assert isinstance(r, WriteResult)
            self._stages.add(plan, loc, remote.name, x.make, r, t0)
            self._advance()
            return False
        try:
            handle = x.make(plan.notif)
            state = loc.agent.transfer(handle)
        except Exception as e:
            log.warning(f"posting {what} failed", transfer_id=key.transfer_id, exc_info=True)
            self._hand_over(self._recover(loc, f"posting a {what}: {e}"))
            return fail(f"NIXL could not post the {what}: {e}")
        t_post = time.perf_counter()
        if state == "ERR":
            handle.release()
            return fail(f"NIXL returned ERR when posting the {what}")
        self._inflight.append(Inflight(handle, loc, result(True, "", x, t_post), t_post, remote.name))
        return bool(state == "DONE")

    @staticmethod
    def _descs_failed(plan: StartWrite | StartRead, key: LegKey | ReadKey, e: Exception) -> str:
        """Why the transfer's descriptors (agents.AgentBook.xfer_maker) could not be built."""
        if isinstance(e, InvalidArgument):
            planned = isinstance(plan, StartWrite) and plan.planned
            return f"layout mismatch: {e}" if planned and "mismatch" not in str(e) else str(e)
        log.warning("preparing descriptors failed", transfer_id=key.transfer_id, exc_info=e)
        return f"cannot prepare descriptors: {e}"

    def _advance(self) -> bool:
        worked, settled = self._stages.advance(self._inflight.append)
        if settled:
            self._deliver(settled)
            self._check_drained()
        return worked

    # -- progress ------------------------------------------------------------------------------

    def _poll_inflight(self) -> bool:
        """Check every WRITE and READ in flight; one past ``write_timeout_s`` is cancelled.
        True when any of them ended."""
        self._sweep({f.local.worker_id: f.local for f in self._inflight}.values())
        done: list[Inflight] = []
        keep: list[Inflight] = []
        now = time.perf_counter()
        for f in self._inflight:
            why = f"{f.what} completed in error"
            try:
                state = f.local.agent.check_xfer_state(f.handle)
            except Exception as e:  # e.g. the remote agent was invalidated mid-transfer: it failed, and says why
                log.warning(f"checking a {f.what} failed", transfer_id=transfer_id_of(f), error=str(e))
                state, why = "ERR", f"{why}: {e}"
                # LIBFABRIC: the rest of the dead peer's cancelled operations go now, not one per later call
                self._hand_over(self._recover(f.local, f"checking a {f.what}: {e}"))
            if state != "PROC":
                self._finish(f, state == "DONE", why, now)
            elif now - f.t_post > self._write_timeout_s:
                self._cancel(f, f"not complete within transfer.write_timeout_s = {self._write_timeout_s:g}s")
            else:
                keep.append(f)
                continue
            done.append(f)
        self._inflight = keep
        if done:
            self._report(done)
        return bool(done)

    def _finish(self, f: Inflight, ok: bool, reason: str, now: float) -> None:
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

    def _cancel_inflight(self, why: str, remotes: frozenset[str] | None = None) -> None:
        """Every transfer still in flight (only those with the agents ``remotes``, given them) ends now,
        in failure (drain past its bound, stop, a peer gone: cancel_to)."""
        cancelled = [f for f in self._inflight if remotes is None or f.remote in remotes]
        self._inflight = [f for f in self._inflight if remotes is not None and f.remote not in remotes]
        for f in cancelled:
            self._cancel(f, why)
        if cancelled:
            self._report(cancelled)

    def _report(self, done: list[Inflight]) -> None:
        staged = [f for f in done if f.stage is not None]
        for f in staged:
            self._stages.settled(f)
        self._deliver([f.result for f in done if f.stage is None])
        if staged:
            self._advance()
        self._check_drained()
        busy = {f.remote for f in self._inflight}
        for name in [n for n in self._forget_later if n not in busy]:
            self._q.put(functools.partial(self._forget, name))  # this thread's own: after what is queued now

    def _deliver(self, results: Sequence[WriteResult | ReadResult]) -> None:
        writes = [r for r in results if isinstance(r, WriteResult)]
        reads = [r for r in results if isinstance(r, ReadResult)]
        if writes:
            self._loop.call_soon_threadsafe(self._reports.write_done, writes)
        if reads and self._reports.read_done is not None:
            self._loop.call_soon_threadsafe(self._reports.read_done, reads)

    def _poll_notifs(self, locs: Collection[Local] | None = None, doing: str = "") -> bool:
        """Hand new notifications to the loop (of every agent that may get some, or of those of ``locs``;
        ``doing``: why else ``locs`` are polled, every one of them); True when there were any."""
        polled: list[dict[str, list[bytes]]] = []
        for loc in self._book.locals.values() if locs is None else locs:
            if not (doing or loc.receives or self.pulling > 0):
                continue
            try:
                polled.append(loc.agent.get_new_notifs())
            except Exception as e:
                polled.append(self._recover(loc, f"{doing or 'polling notifications'}: {e}"))
        return self._hand_over(*polled)

    def _hand_over(self, *polled: dict[str, list[bytes]]) -> bool:
        """Hand notifications NIXL returned to the loop; True when there were any."""
        got: list[Notified] = []
        reads: list[tuple[str, int, int]] = []  # pull mode: (remote agent, registration id, rank)
        for notifs in polled:
            for remote_name, msgs in notifs.items():
                for m in msgs:
                    parsed = decode_notif(m)
                    if parsed is not None:
                        got.append(parsed)
                    elif (rp := decode_read_notif(m)) is not None:
                        reads.append((str(remote_name), *rp))
                    else:
                        self.stray_notifications += 1
        if got:
            self._loop.call_soon_threadsafe(self._reports.notifications, got)
        if reads and self._reports.read_notifications is not None:
            self._loop.call_soon_threadsafe(self._reports.read_notifications, reads)
        return bool(got or reads)

    def _sweep(self, locs: Collection[Local]) -> None:
        """LIBFABRIC agents with transfers in flight are progressed by a notification poll before
        their transfers are checked. A completion in error is read by whichever call progresses the
        agent first, and a check that reads one fails its own transfer, whoever's the error was (NIXL
        does not say): with transfers to several peers on one agent, a dead peer's error failed a live
        peer's WRITE (and, its handle failed for good, a second check did not save it). Read by this
        poll, an error fails no transfer; the dead peer's ends when the daemon declares the peer lost
        (cancel_to: peer_timeout_s, or at once when it comes back restarted), else at write_timeout_s."""
        swept = [loc for loc in locs if any(b.name == "LIBFABRIC" for b in loc.backends)]
        if swept:
            self._poll_notifs(swept, "progressing the agent")

    def _recover(self, loc: Local, why: str) -> dict[str, list[bytes]]:
        """NIXL failed a call on ``loc``'s agent: read out the completions in error left behind
        (agents.AgentBook.read_out_errors), so that the agent's next call, and its handshake with a
        restarted peer's new agent, do not fail on them; -> the notifications of its clean poll."""
        t0 = time.perf_counter()
        errors, notifs, clean = self._book.read_out_errors(loc)
        if errors:
            (log.warning if clean else log.error)(
                "completions in error read out of the agent" if clean else
                "the agent still fails after reading completions in error out of it",
                worker_id=loc.worker_id, errors=errors, seconds=round(time.perf_counter() - t0, 4), after=why[:300])
        return notifs

    def _check_drained(self) -> None:
        still: list[tuple[str, Future[None]]] = []
        for wid, fut in self._drained:
            loc = self._book.locals.get(wid)
            if loc is not None and any(f.local is loc for f in self._inflight):
                still.append((wid, fut))
                continue
            try:
                self._release(wid)
            except Exception as e:
                fut.set_exception(e)
            else:
                fut.set_result(None)
        self._drained = still

    def _release(self, worker_id: str) -> None:
        loc = self._book.locals.pop(worker_id, None)
        if loc is None:
            return
        self._poll_notifs([loc])  # hand over notifications that raced the detach
        self._book.release(loc)


_NOOP: Any = object()
HOT_S = 0.02  # after any command, completion or notification, poll at the short interval this long


def _nixl_error(e: Exception) -> bool:
    """An error NIXL raised (nixlBackendError, nixlNotFoundError, ...), not one of ours or numpy's."""
    return type(e).__name__.startswith("nixl")


def _name_os_thread(name: bytes) -> None:
    """Name the calling thread for the kernel (Python 3.11 names threads for itself only); at most 15 bytes."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the name is only for operators' tools
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME


def _wake() -> None:
    """A command that does nothing: it ends an idle wait so polling starts at once."""
