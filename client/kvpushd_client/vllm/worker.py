"""Worker side (one per TP rank): hands the daemon this worker's KV memory once, then per request only
block ids; reports finished sends and receives to vLLM. The engine thread only appends this step's
commands and reads completions already delivered, so a step never waits on a gRPC call, let alone on
a transfer. The step's commands go out on the worker stream as ONE CommandBatch from
``get_transfer_results``, the hook vLLM calls exactly once per step after ``start_load_kv`` (and, unless spec
decoding defers it, ``wait_for_save``) has handed over the step's metadata.

Progressive push (``kvpushd_progressive``, progress.py): the batch goes out before the forward instead
(a decode worker's Expects as well), from ``bind_connector_metadata`` (vLLM 0.32/0.33 call ``start_load_kv`` after the
forward unless a load must precede it), which also begins the doorbell's step; declared publishes
name that step and the layer groups; ``save_kv_layer`` rings as layers finish; ``wait_for_save``
seals the step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..cuda import CudaMemoryError
from ..reconnect import Call, ReconnectingStreamWorker
from ..types import (
    Abort,
    Completion,
    CompletionKind,
    DaemonUnavailable,
    Decline,
    Expect,
    KVPushError,
    Publish,
    Role,
    TransferMode,
)
from ..vmm import VmmMemory
from . import compat
from .layout import describe_kv_caches, layer_specs, owned_memfd_names, release_owned_shm
from .metadata import ExpectReq, KVPushdConnectorMetadata, PublishReq
from .progress import Bell, LayerProgress, make_doorbell
from .utils import Settings, logger
from .xfer_stats import Data, is_empty, new_data, record, record_lost

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(eq=False)
class _Pending:
    """One request's transfer on this worker, from metadata to its one report."""

    recv: bool
    req: ExpectReq | PublishReq
    op: Call | None = None  # the Expect or Publish
    aborted: bool = False
    done: bool = False
    silent: bool = False  # a send vLLM no longer holds blocks for (preempted): reported to nobody


# ------------------------------------------------------------------------------------------------
# Worker side: request bookkeeping


class KVPushdConnectorWorker:
    """The worker-side half of KVPushdConnector (one per TP rank)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, engine_id: str,
                 role: Role, settings: Settings) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.role = role
        self.num_blocks = kv_cache_config.num_blocks
        self._specs = layer_specs(kv_cache_config)  # each layer's block size, heads: the regions' layout
        self.tp_rank, self.tp_size = _tp_rank_and_size(vllm_config)
        self._link: ReconnectingStreamWorker | None = None
        # pending transfers by (receive?, req id) and by (receive?, transfer id): a kv_both worker has both
        self._pending: dict[tuple[bool, str], _Pending] = {}
        self._by_tid: dict[tuple[bool, str], _Pending] = {}
        # this step's reports: finished sends, finished receives, failed receives (vLLM's failed_recving)
        self._results = compat.KVConnectorTransferResults()
        self._meta_done: KVConnectorMetadata | None = None
        self._shm_names: list[str] = []  # host KV memory: removed at shutdown if this connector made it
        self._stats: Data = new_data()  # this interval's figures (vLLM takes them every step)
        # progressive push (progress.py): this worker's doorbell, its layer groups, this step's state
        self._bell: Bell | None = None
        self._progress: LayerProgress | None = None
        self._ringing = False  # this step declared a publish: save_kv_layer rings
        self._step_rings = 0
        self._after_forward: list[tuple[PublishReq, _Pending]] = []  # declared, but no doorbell here: published whole
        self.declared = 0  # publishes declared so far
        self.rings = 0     # doorbell rings from save_kv_layer so far
        self._first_step_logged = False
        self._kv_caches: dict[str, torch.Tensor] | None = None  # what restore_kv_caches describes again
        self.detaches = 0  # unregister_kv_caches detaches so far
        self._vmm: list[VmmMemory] = []  # the KV's chunks by fd (vLLM 0.34's extensible KV cache)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches
        memory, regions, owners = self._describe(kv_caches)
        self._shm_names = owned_memfd_names(memory)
        logger.info("kvpushd: registering %d KV region(s) in %d memory object(s), %d blocks, block_len %s",
                    len(regions), len(memory), self.num_blocks, sorted({r.block_len for r in regions}))
        if self.settings.progressive and self.role.can_send:
            self._bell = make_doorbell(kv_caches)
            if self._bell is None:
                logger.info("kvpushd: no doorbell for this KV (CUDA KV needs a GPU doorbell); requests are "
                            "published whole once finished")
            else:
                self._progress = LayerProgress(owners)
                logger.info("kvpushd: progressive push on: %d layer groups of %d region(s) each, doorbell %s%s",
                            self._progress.layers, self._progress.per_group, self._bell.name,
                            "" if self._progress.in_order else " (regions not in forward order: groups go later)")
        self._connect(memory, regions)

    def _describe(self, kv_caches: dict[str, torch.Tensor]) -> tuple[list[Any], list[Any], list[list[str]]]:
        """The KV as memory and regions. vLLM 0.34's extensible KV cache (CUDA virtual memory; on by default
        on CUDA, ``EXPORTS_FD`` declared) goes chunk by chunk by file descriptor, kept open in
        ``self._vmm`` (a restarted daemon gets them again) until the KV is released."""
        exports_fd = compat.HAS_KV_CACHE_ACCESS and not self.settings.legacy_ipc
        try:
            memory, regions, owners = describe_kv_caches(kv_caches, self.num_blocks, self.settings.host_kv_to_shm,
                                                               self._specs, exports_fd)
        except CudaMemoryError as e:
            if not compat.HAS_KV_CACHE_ACCESS:  # vLLM 0.33: its cumem allocator, named in the message
                raise
            raise CudaMemoryError(f"{e} With vLLM 0.34 the extensible KV cache can be turned off for kvpushd: "
                                  'kv_connector_extra_config.kvpushd_kv_cache_access = "legacy_ipc"') from None
        self._vmm = [m for m in memory if isinstance(m, VmmMemory)]
        if self._vmm:
            logger.info("kvpushd: the KV is CUDA virtual memory (vLLM's extensible KV cache): %d chunk(s) in %d "
                        "range(s) go to the daemon by file descriptor", sum(len(m.chunks) for m in self._vmm),
                        len(self._vmm))
        return memory, regions, owners

    def _close_vmm(self) -> None:
        """Our descriptors of the KV's chunks go: they would keep released pages alive (sleep frees nothing)."""
        for m in self._vmm:
            m.close()
        self._vmm = []

    def _connect(self, memory: list[Any], regions: list[Any]) -> None:
        page = self._bell
        link = ReconnectingStreamWorker(self.settings.socket, {
            "engine_id": self.engine_id, "role": self.role, "tp_rank": self.tp_rank, "tp_size": self.tp_size,
            "memory": memory, "regions": regions, "description": f"vllm pid {os.getpid()}",
            **({"doorbell": page} if page is not None else {})},
            rpc_timeout_s=self.settings.rpc_timeout_s, reconnect_interval_s=self.settings.reconnect_interval_s,
            logger=logger)
        try:
            link.start(self.settings.connect_timeout_s)
        except DaemonUnavailable as e:
            raise RuntimeError(
                f"kvpushd: no daemon answers on {self.settings.socket} after "
                f"{self.settings.connect_timeout_s:g}s ({e}); start kvpushd on this node or set "
                "kv_connector_extra_config.kvpushd_socket") from None
        except KVPushError as e:
            raise RuntimeError(f"kvpushd: the daemon on {self.settings.socket} refused this worker's "
                               f"KV memory: {e}") from None
        self._link = link

    @property
    def link(self) -> ReconnectingStreamWorker:
        if self._link is None:
            raise RuntimeError("kvpushd: this worker is not attached to its daemon (register_kv_caches() has "
                               "not run, or unregister_kv_caches() detached it and restore_kv_caches() has not)")
        return self._link

    # sleep, wake and weight updates (vLLM 0.34's extensible KV cache releases and re-commits the pages) ---
    def unregister_kv_caches(self) -> None:
        """Settle every transfer into or out of this worker's KV, then detach: the daemon unmaps and
        deregisters, so no WRITE can land in pages vLLM is about to release. vLLM drains transfers first;
        any still pending are aborted and waited for (``rpc_timeout_s`` at most), then reported failed."""
        link = self._link
        if link is None:
            return
        pending = [p for p in self._pending.values() if not p.done]
        if pending:
            logger.warning("kvpushd: the KV is being released with %d transfer(s) pending; aborting them",
                           len(pending))
        for p in pending:  # not marked aborted: vLLM still waits for these requests' reports
            if p.op is not None and p.op.epoch is not None:
                self._link_abort(p, p.op.epoch)
        deadline = time.monotonic() + self.settings.rpc_timeout_s
        while True:
            link.step()
            self._poll()
            left = [p for p in pending if not p.done and p.op is not None]
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        for p in pending:
            self._finish(p, ok=False, why="the KV was released (sleep or weight update) before the transfer "
                         "settled")
        link.close()  # detached: the daemon deregisters and unmaps this worker's memory
        self._link = None
        self._close_vmm()
        self.detaches += 1
        logger.info("kvpushd: detached from the daemon: the KV is released (%d transfer(s) were pending)",
                    len(pending))

    def restore_kv_caches(self) -> None:
        """The pages are back (new chunks at the same addresses): describe them again and attach."""
        if self._link is not None or self._kv_caches is None:
            return
        memory, regions, _ = self._describe(self._kv_caches)
        self._connect(memory, regions)
        logger.info("kvpushd: attached again after the KV was restored: %d region(s)", len(regions))

    # progressive push: the engine thread, around the forward -----------------------------------------
    def begin_step(self, meta: KVConnectorMetadata | None) -> None:
        """Before the forward (``bind_connector_metadata``): a new doorbell step, this step's commands
        (declared publishes with that step) sent at once so the daemon has them before layer 0. A
        decode worker's Expects go out then too: the registration does not wait for decode's forward."""
        if not self.settings.progressive or self._link is None:
            return
        if self._bell is not None:
            self._bell.step()
        declared = self.declared
        self.process(meta)
        self._ringing = self.declared > declared
        if self._ringing:
            assert self._progress is not None
            self._progress.reset()
            self._step_rings = 0
        self._link.step()

    def layer_done(self, layer_name: str) -> None:
        """``save_kv_layer``: this layer's KV is written; ring when more leading groups are complete."""
        if self._ringing:
            assert self._progress is not None and self._bell is not None
            n = self._progress.layer_done(layer_name)
            if n:
                self._bell.layer_done(n)
                self._step_rings += 1

    def end_forward(self) -> None:
        """``wait_for_save``: the forward is complete; seal the step, publish what could not be declared."""
        if self._bell is not None:
            self._bell.seal()
            if self._ringing:
                self._ringing = False
                self.rings += self._step_rings
                if not self._first_step_logged:
                    self._first_step_logged = True
                    assert self._progress is not None
                    (logger.info if self._step_rings else logger.warning)(
                        "kvpushd: first progressive step (doorbell step %d): %d publish(es) declared before the "
                        "forward; save_kv_layer rang the doorbell %d time(s), %d of %d layer groups%s",
                        self._bell.seq, self.declared, self._step_rings, self._progress.groups_done,
                        self._progress.layers, "" if self._step_rings else
                        " (save_kv_layer did not fire: each step's KV goes once the step is sealed)")
        for req, pend in self._after_forward:
            if not pend.done:
                self._publish(req, pend)
        self._after_forward = []

    # metadata ------------------------------------------------------------------------------------
    def process(self, meta: KVConnectorMetadata | None) -> None:
        """Queue this step's daemon calls (once per metadata; called from several hooks)."""
        if meta is None or meta is self._meta_done or not isinstance(meta, KVPushdConnectorMetadata):
            return
        self._meta_done = meta
        for e in meta.expects:
            self._start(True, e)
        for p in meta.publishes:
            self._start(False, p)
        for a in meta.aborts:
            pend = self._pending.get((not a.send, a.req_id))
            if pend is None or pend.aborted:
                continue  # already reported
            pend.aborted = True
            pend.silent = not a.report
            if pend.op is None:  # a declared publish not made yet (no doorbell here): nothing to stop
                self._finish(pend, ok=True)
            elif pend.op.epoch is not None:
                self._link_abort(pend, pend.op.epoch)

    def _start(self, recv: bool, req: ExpectReq | PublishReq) -> None:
        pend = _Pending(recv, req)
        if isinstance(req, ExpectReq) and req.failed:
            self._finish(pend, ok=False, why=req.failed, tracked=False)
            return
        if not req.block_ids:
            self._finish(pend, ok=True, tracked=False)  # nothing to move (vLLM allocated no new block)
            return
        if (recv, req.req_id) in self._pending:
            logger.error("kvpushd: request %s was handed to this worker twice; ignoring the repeat", req.req_id)
            return
        if (recv, req.transfer_id) in self._by_tid:
            self._finish(pend, ok=False, why=f"transfer id {req.transfer_id!r} is already in use on this worker",
                         tracked=False)
            return
        self._pending[recv, req.req_id] = pend
        self._by_tid[recv, req.transfer_id] = pend
        if isinstance(req, ExpectReq):
            pend.op = self.link.send_nowait(Expect(
                req.transfer_id, req.block_ids, req.producer_address, req.producer_engine_id, req.producer_tp_size,
                transfer_mode=TransferMode.parse(req.transfer_mode), traceparent=req.traceparent), tag=pend)
        elif req.declared and self._bell is None:
            if not self._after_forward and not self.declared:
                logger.warning("kvpushd: a publish was declared but this worker has no doorbell; publishing "
                               "declared requests whole after the forward")
            self._after_forward.append((req, pend))
        else:
            self._publish(req, pend)

    def _publish(self, req: PublishReq, pend: _Pending) -> None:
        step = layers = ready = 0
        if req.declared and self._bell is not None:
            assert self._progress is not None
            step, layers, ready = self._bell.seq, self._progress.layers, req.ready_blocks
            self.declared += 1
        pend.op = self.link.send_nowait(Publish(req.transfer_id, req.block_ids, req.traceparent, req.consumer_node_id,
                                                req.consumer_tls_name, step, layers, ready), tag=pend)

    # results -------------------------------------------------------------------------------------
    def _finish(self, pend: _Pending, ok: bool, why: str = "", tracked: bool = True,
                unreachable: bool = False) -> None:
        if pend.done:
            return
        pend.done = True
        req = pend.req
        if unreachable and isinstance(req, ExpectReq) and not pend.aborted:
            # The prefill daemon may wait for a registration that will never come: once re-attached,
            # the link tells it so (Decline) and it frees the request's source blocks then.
            self.link.decline_nowait(Decline(req.transfer_id, req.producer_address, req.producer_engine_id,
                                             f"the decode worker's Expect did not reach its daemon: {why}"[:1000]))
        if tracked:
            self._pending.pop((pend.recv, req.req_id), None)
            self._by_tid.pop((pend.recv, req.transfer_id), None)
        if pend.recv:
            self._results.finished_recving.add(req.req_id)
            if not ok and not pend.aborted:
                self._results.failed_recving.add(req.req_id)
                logger.error("kvpushd: KV for request %s (transfer %s) did not arrive: %s; vLLM's "
                             "kv_load_failure_policy applies", req.req_id, req.transfer_id, why)
        elif not pend.silent:
            self._results.finished_sending.add(req.req_id)
            if not ok:
                logger.error("kvpushd: pushing the KV of request %s (transfer %s) failed: %s; its blocks "
                             "are freed and the decode side will not get them", req.req_id, req.transfer_id, why)

    def _on_completion(self, epoch: int, c: Completion) -> None:
        r, s = self._by_tid.get((True, c.transfer_id)), self._by_tid.get((False, c.transfer_id))
        if c.kind is CompletionKind.FINISHED_RECEIVING:
            cands = [r]
        elif c.kind is CompletionKind.FINISHED_SENDING:
            cands = [s]
        elif r is not None and s is not None:  # both directions on a kv_both worker: match the blocks
            cands = [r] if tuple(c.block_ids) == r.req.block_ids else [s]
        else:
            cands = [r, s]
        for pend in cands:
            if pend is not None and pend.op is not None and pend.op.epoch == epoch:
                if not pend.done:
                    record(self._stats, c, sending=not pend.recv)
                if c.ok:
                    self._finish(pend, ok=True)
                elif c.code == "ABORTED" and not pend.recv:
                    logger.warning("kvpushd: push of request %s cancelled: %s", pend.req.req_id, c.reason)
                    self._finish(pend, ok=True)
                else:  # unanswered: a stream command the stream's end left without an answer
                    self._finish(pend, ok=False, why=f"{c.code}: {c.reason}", unreachable=c.unanswered)
                return

    def _on_lost(self, epoch: int, reason: str) -> None:
        victims = [p for p in self._pending.values() if p.op is not None and p.op.epoch is not None
                   and p.op.epoch <= epoch]
        logger.error("kvpushd: lost the daemon at %s (%s); failing %d transfer(s) in flight and re-attaching",
                     self.settings.socket, reason, len(victims))
        record_lost(self._stats, sum(1 for p in victims if not p.aborted and not p.done))
        for p in victims:
            self._finish(p, ok=p.aborted, why=f"the kvpushd daemon went away ({reason})", unreachable=True)

    def _poll(self) -> None:
        if self._link is None:
            return
        for ev in self._link.poll():
            if ev.kind == "completion":
                assert ev.epoch is not None and ev.completion is not None
                self._on_completion(ev.epoch, ev.completion)
            elif ev.kind == "lost":
                assert ev.epoch is not None
                self._on_lost(ev.epoch, ev.reason)
            elif ev.kind == "refused":
                # A command that did not go out (not attached).
                call = ev.call
                assert call is not None and ev.completion is not None
                pend = call.tag
                assert isinstance(pend, _Pending)
                if pend.op is call or call.method == "Abort":
                    if not pend.done and not pend.aborted:
                        record(self._stats, ev.completion, sending=not pend.recv)
                    why = ev.error if ev.error is not None else ev.completion.reason
                    self._finish(pend, ok=pend.aborted, why=f"daemon call {call.method.lower()} failed: {why}",
                                 unreachable=isinstance(ev.error, DaemonUnavailable))

    def _link_abort(self, pend: _Pending, epoch: int) -> None:
        self.link.send_nowait(Abort(pend.req.transfer_id), pend, only_epoch=epoch)

    def get_transfer_results(self, finished_req_ids: set[str]) -> compat.KVConnectorTransferResults:
        """Finished sending, finished receiving and failed receiving since the last call, for vLLM's
        ``get_transfer_results``: a failed receive is reported by request id (and is finished too)."""
        # Sends exist only for requests vLLM already finished (request_finished published them), so
        # every id reported here is one vLLM handed in finished_req_ids.
        if self._link is not None:
            self._link.step()  # this step's commands: one CommandBatch on the stream
        self._poll()
        out, self._results = self._results, compat.KVConnectorTransferResults()
        return out

    def take_stats(self) -> Data | None:
        """This interval's transfer figures (reset); None when there were none."""
        if is_empty(self._stats):
            return None
        out, self._stats = self._stats, new_data()
        return out

    def shutdown(self) -> None:
        if self._link is not None:
            self._link.close()  # detached first (the link hands over its own copies of the descriptors)
        if self._bell is not None:
            self._bell.close()
        release_owned_shm(self._shm_names)
        self._close_vmm()


def _tp_rank_and_size(vllm_config: VllmConfig) -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import get_tp_group

        g = get_tp_group()
        return int(g.rank_in_group), int(g.world_size)
    except (AssertionError, ImportError, AttributeError):
        if vllm_config.parallel_config.tensor_parallel_size != 1:
            raise RuntimeError("kvpushd: the tensor-parallel group is not initialised in this worker") from None
        return 0, 1

