"""Scheduler side (engine core process): decides what to expect, publish and abort, and ships it to
the workers in the connector metadata. Makes no daemon call per request (only one status call, once,
for the address prefill advertises). Imports vLLM only for type checking and one enum at run time.

Progressive push (``kvpushd_progressive``, on by default): a prefill request is *declared* in the
metadata of the step that computes its prompt's last tokens, so its workers hand the daemon the
publish before that step's forward and the daemon writes each layer as it is computed. Only a
request that this step also finishes is declared (``max_tokens`` reached with the token this step
samples: a P/D prefill leg asks for one). Its blocks then stay put: vLLM finishes it in this step's
``update_from_output`` and ``request_finished`` keeps them until the workers report the push done,
and until then ``has_pending_block_frees`` keeps the scheduler from preempting it (with async
scheduling the next step is scheduled before this one's output; a preemption would free blocks the
daemon may be writing from). Any other request is published once finished, as without the setting.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..client import KVPushClient
from ..types import KVPushError
from .groups import GroupPlan, transfer_block_ids
from .metadata import (
    COMPAT_HASH,
    COMPAT_HASH_KEY,
    AbortReq,
    ExpectReq,
    KVPushdConnectorMetadata,
    PublishReq,
    daemon_engine_id,
    producer_address,
    remote_params_problem,
    transfer_id_for,
    transfer_mode_of,
)
from .utils import Settings, logger, split_host_port

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVPushdConnectorScheduler:
    """The scheduler-side half of KVPushdConnector (one per engine)."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, settings: Settings,
                 groups: tuple[GroupPlan, ...]) -> None:
        pc = vllm_config.parallel_config
        self.groups = groups  # more than one: the hybrid KV cache manager is on (groups.py)
        self.engine_id = engine_id
        self.settings = settings
        self.tp_size = pc.tensor_parallel_size
        self.pp_size = pc.pipeline_parallel_size
        self.dcp_size = pc.decode_context_parallel_size
        self._expects: list[ExpectReq] = []
        self._publishes: list[PublishReq] = []
        self._aborts: list[AbortReq] = []
        self._recving: dict[str, str] = {}  # decode: req id -> transfer id, until finished_recving
        self._sending: dict[str, str] = {}  # prefill: req id -> transfer id, until finished_sending
        self._peer: tuple[str, int] | None = split_host_port(settings.peer_address) if settings.peer_address \
            else None
        self._peer_next_try = 0.0
        # progressive push: prefill requests not declared yet, and those declared but not finished
        self._prefills: dict[str, Request] = {}
        self._declared: dict[str, str] = {}  # req id -> transfer id
        self.kv_cache_manager: KVCacheManager | None = None  # the scheduler's (bind_kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if self.settings.progressive and params and params.get("do_remote_decode"):
            self._prefills[request.request_id] = request

    # decode side ---------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        problem = remote_params_problem(params)
        if problem is not None:
            logger.error("kvpushd: request %s asks for a remote prefill but %s; prefilling it here instead",
                         request.request_id, problem)
            params["do_remote_prefill"] = False
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        if count > 0 and num_computed_tokens and len(self.groups) > 1:
            # The blocks of a local prefix hit are shared and cached: with several KV cache groups the
            # transfer cannot leave them out (both sides move the same positions of every group).
            logger.warning("kvpushd: request %s hit %d tokens in this engine's prefix cache; with %d KV cache "
                           "groups the prompt is prefilled here instead", request.request_id,
                           num_computed_tokens, len(self.groups))
            params["do_remote_prefill"] = False
            return 0, False
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return  # also the second call, after the KV arrived: the flag is cleared below
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return
        tid = transfer_id_for(request.request_id, params)
        failed = ""
        if len(self.groups) > 1:  # every group's whole table (null placeholders included): the positions
            chosen = transfer_block_ids(self.groups, blocks.get_block_ids(), request.num_prompt_tokens)
            failed, block_ids = (chosen, ()) if isinstance(chosen, str) else ("", chosen)
        else:
            groups = blocks.get_unhashed_block_ids_all_groups()
            block_ids = tuple(groups[0]) if groups else ()  # empty: the worker reports it done at once
        self._expects.append(ExpectReq(
            request.request_id, tid, block_ids, producer_address(params),
            daemon_engine_id(str(params["remote_engine_id"])), int(params.get("tp_size") or 1),
            transfer_mode_of(params), traceparent_of(request), failed))
        self._recving[request.request_id] = tid

    # both sides ----------------------------------------------------------------------------------
    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        tid = self._recving.get(rid)
        if tid is not None:
            # Decode request finished (aborted) before its KV arrived. vLLM keeps its blocks until
            # the workers report finished_recving; they abort the transfer on both nodes first.
            self._aborts.append(AbortReq(rid, tid))
            return False, None
        self._prefills.pop(rid, None)
        declared = self._declared.pop(rid, None)
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            if declared is not None:  # its layers may be on the wire: stop, free once the daemon let go
                self._aborts.append(AbortReq(rid, declared, send=True))
                return True, None
            return False, None  # aborted or failed prefill: nothing to push; decode times out
        if len(self.groups) > 1:
            chosen = transfer_block_ids(self.groups, block_ids, request.num_prompt_tokens)
            if isinstance(chosen, str):
                logger.error("kvpushd: request %s: %s; its KV is not pushed (decode prefills it after its "
                             "expect times out)", rid, chosen)
                chosen = ()
            blocks: tuple[int, ...] = chosen
            remote_ids: list[Any] = [list(g) for g in block_ids]  # per group, as upstream's HMA connectors
        else:
            blocks = tuple(block_ids[0]) if block_ids else ()
            remote_ids = list(blocks)
        tid = transfer_id_for(rid, params)
        if declared is None and blocks:  # a declared one was published in the step that computed it
            self._publishes.append(PublishReq(rid, tid, blocks, traceparent_of(request),
                                              str(params.get("kvpushd_consumer_node") or ""),
                                              str(params.get("kvpushd_consumer_tls_name") or "")))
            self._sending[rid] = tid
        host, port = self._advertised_address()
        return bool(blocks) or declared is not None, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": remote_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": host,
            "remote_port": port,
            "tp_size": self.tp_size,
            "dcp_size": self.dcp_size,
            "pp_size": self.pp_size,
            "remote_num_tokens": request.num_computed_tokens if blocks else 0,
            "transfer_mode": transfer_mode_of(params),
            "transfer_id": tid,
            COMPAT_HASH_KEY: COMPAT_HASH,
        }

    def _advertised_address(self) -> tuple[str | None, int | None]:
        """This node's daemon peer address (asked once; what decode uses as remote_host/port)."""
        if self._peer is None and time.monotonic() >= self._peer_next_try:
            try:
                with KVPushClient(self.settings.socket, timeout_s=1.0) as c:
                    self._peer = split_host_port(c.status().peer_address)
            except (KVPushError, ValueError) as e:
                self._peer_next_try = time.monotonic() + 30.0
                logger.error("kvpushd: cannot ask the daemon at %s for its peer address (%s); prefill "
                             "responses carry no remote_host/remote_port", self.settings.socket, e)
        return self._peer if self._peer is not None else (None, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPushdConnectorMetadata:
        if self._prefills or self._declared:
            self._declare(scheduler_output)
        meta = KVPushdConnectorMetadata(self._expects, self._publishes, self._aborts)
        self._expects, self._publishes, self._aborts = [], [], []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for rid in connector_output.finished_sending or ():
            self._sending.pop(rid, None)
        for rid in connector_output.finished_recving or ():
            self._recving.pop(rid, None)

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while blocks wait to be pushed (their free comes from a worker)."""
        return bool(self._sending or self._expects or self._publishes or self._aborts)

    def has_pending_block_frees(self) -> bool:
        """While a declared request runs (declared, not finished yet), vLLM must not preempt to make
        room: that would free blocks the daemon may be writing from. It waits a step instead."""
        return bool(self._declared)

    # progressive push ----------------------------------------------------------------------------
    def _declare(self, so: SchedulerOutput) -> None:
        """Declare the prefills whose prompt this step completes and that this step finishes."""
        for rid in so.preempted_req_ids or ():
            tid = self._declared.pop(rid, None)
            if tid is not None:
                # Only reset_prefix_cache(reset_running_requests=True) preempts one (has_pending_block_frees
                # keeps the scheduler from it): vLLM freed its blocks; stop the push, report nothing,
                # and publish it once finished after its recompute.
                logger.warning("kvpushd: request %s was preempted after its push was declared; the push is "
                               "aborted and the request published once it finished again", rid)
                self._aborts.append(AbortReq(rid, tid, send=True, report=False))
                self._sending.pop(rid, None)
        if self.kv_cache_manager is None:
            return
        for rid, n in so.num_scheduled_tokens.items():
            req = self._prefills.get(rid)
            if req is None or req.num_computed_tokens + n < req.num_tokens:
                continue  # not a prefill leg, or an earlier chunk
            del self._prefills[rid]  # decided once
            if req.num_output_tokens + 1 < req.max_tokens:
                continue  # decodes on after this step: blocks may move; published once finished
            blocks, ready = self._declared_blocks(req, req.num_computed_tokens + n)
            if not blocks:
                continue
            params = req.kv_transfer_params or {}
            tid = transfer_id_for(rid, params)
            self._publishes.append(PublishReq(rid, tid, blocks, traceparent_of(req),
                                              str(params.get("kvpushd_consumer_node") or ""),
                                              str(params.get("kvpushd_consumer_tls_name") or ""),
                                              declared=True, ready_blocks=ready))
            self._declared[rid] = tid
            self._sending[rid] = tid

    def _declared_blocks(self, req: Request, tokens: int) -> tuple[tuple[int, ...], int]:
        """The blocks a declared publish moves (as ``request_finished`` would), and how many leading ones
        are complete already (computed before this step: a prefix-cache hit, earlier chunks)."""
        assert self.kv_cache_manager is not None
        table = self.kv_cache_manager.get_block_ids(req.request_id)
        done = req.num_computed_tokens
        if len(self.groups) > 1:
            chosen = transfer_block_ids(self.groups, table, req.num_prompt_tokens)
            if isinstance(chosen, str):
                return (), 0  # request_finished says why
            pos = self.groups[0].positions(req.num_prompt_tokens)
            return chosen, max(0, min(done // self.groups[0].block_size, pos.stop) - pos.start)
        bs = self.groups[0].block_size if self.groups else 1
        blocks = tuple(table[0][:-(-tokens // bs)]) if table else ()
        return blocks, min(done // bs, len(blocks))


def traceparent_of(request: Request) -> str:
    """The W3C trace context vLLM took from the request's headers (``--otlp-traces-endpoint`` on;
    vLLM's own ``llm_request`` span is its child): the daemons' spans for the transfer join that trace."""
    headers = request.trace_headers or {}
    tp = headers.get("traceparent", "")
    return tp if isinstance(tp, str) and len(tp) <= 128 else ""
