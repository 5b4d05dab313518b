"""One engine for the vLLM connector tests: vLLM 0.33.0's Scheduler plus real worker connectors
attached to a live daemon, stepped through the hooks in the order vLLM's model runner calls them."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import vllm_support as vs
from kvpushd_client.vllm import worker as vllm_worker
from kvpushd_client.vllm.connector import KVPushdConnector
from kvpushd_client.vllm.layout import natural_key
from kvpushd_client.vllm.metadata import ExpectReq, KVPushdConnectorMetadata, PublishReq
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

POISON = -7.0


class Engine:
    """One engine: vLLM's Scheduler (scheduler-side connector inside) plus one worker connector per TP
    rank, each with its KV in shared memory, in the layout vLLM 0.33.0 allocates for the CPU attention
    backend. Worker outputs reach the scheduler through vLLM's KVOutputAggregator, as with TP > 1."""

    def __init__(self, model_dir: Path, role: str, engine_id: str, sock: str, num_blocks: int, fill: str,
                 tp: int = 1, extra: dict[str, Any] | None = None, window: int = 0,
                 policy: str = "fail", layout: str | None = None, split_heads: bool = False,
                 compute: bool = False) -> None:
        """``window``: every odd layer slides over that many tokens (two KV cache groups, vLLM's hybrid
        manager on). ``layout``: a KVCacheLayout name other than the CPU backend's (e.g. "LBNHC": tokens before
        heads). ``split_heads``: each TP rank holds 1/tp of the heads (else all of them).
        ``compute`` (one KV cache group): the forward poisons the blocks it computes, then writes
        each layer's fresh KV into them in turn before that layer's ``save_kv_layer``, so a WRITE
        that left before its layer was written would carry POISON."""
        self.cfg = vs.make_vllm_config(model_dir, role, engine_id, sock, block_size=32, extra=extra, policy=policy)
        if layout is not None:
            self.cfg.cache_config.kv_cache_layout = layout
        self.kv_cache_config = vs.real_kv_cache_config(self.cfg, num_blocks, window, tp if split_heads else 1)
        self.sched = vs.create_scheduler(self.cfg, self.kv_cache_config)
        self.ranks: list[tuple[KVPushdConnector, dict[str, torch.Tensor]]] = []
        for rank in range(tp):
            kv = vs.allocate_cpu_kv_caches(self.cfg, self.kv_cache_config)
            next(iter(kv.values())).share_memory_()  # every layer views one allocation: shares them all
            gen = torch.Generator().manual_seed(zlib.crc32(f"{engine_id}/{rank}".encode()))
            for t in kv.values():
                if fill == "random":
                    t.copy_(torch.randn(t.shape, generator=gen))
                else:
                    t.fill_(POISON)
            # Each worker finds its rank in vLLM's TP group; there is none in this process.
            with mock.patch.object(vllm_worker, "_tp_rank_and_size", return_value=(rank, tp)):
                conn = KVPushdConnector(self.cfg, KVConnectorRole.WORKER, self.kv_cache_config)
            conn.register_kv_caches(kv)
            self.ranks.append((conn, kv))
        self.conn, self.kv = self.ranks[0]
        self.compute = compute
        self.layer_names = sorted(self.kv, key=natural_key)  # the forward's order
        self.aggregator = KVOutputAggregator(tp)
        self.metas: list[KVPushdConnectorMetadata] = []

    def step(self, running: list[Any] | None = None, eos: bool = False, during: Any = None) -> Any:
        """schedule -> every worker's hooks in vLLM's order -> aggregate -> update_from_output.
        ``during``: called after schedule, before the workers run (e.g. a client aborts meanwhile)."""
        so = self.sched.schedule()
        if during is not None:
            during()
        meta = so.kv_connector_metadata
        self.metas.append(meta)
        reqs = [r for r in (running or []) if r.request_id in so.num_scheduled_tokens]
        outs = []
        for c, kv in self.ranks:
            c.bind_connector_metadata(meta)  # before the forward (vLLM 0.32/0.33 start loads after it)
            if so.total_num_scheduled_tokens:
                self._forward(so, c, kv)
            c.start_load_kv(None)  # type: ignore[arg-type]  # forward context: unused by this connector
            c.wait_for_save()
            # what vLLM's model runner calls (kv_connector_model_runner_mixin)
            res = c.get_transfer_results(so.finished_req_ids)
            sending, recving, failed = res.finished_sending, res.finished_recving, res.failed_recving
            errors = c.get_block_ids_with_load_errors()
            c.clear_connector_metadata()
            outs.append(vs.model_output(reqs, vs.kv_output(sending or None, recving or None, errors, failed), eos))
        out = self.aggregator.aggregate(outs)
        self.last_kv = out.kv_connector_output
        return self.sched.update_from_output(so, out)

    def _forward(self, so: Any, c: KVPushdConnector, kv: dict[str, torch.Tensor]) -> None:
        """The attention layers in order, each followed by save_kv_layer (vLLM's maybe_transfer_kv_layer)."""
        blocks: list[int] = []
        if self.compute:
            bs = self.cfg.cache_config.block_size
            for rid, n in so.num_scheduled_tokens.items():
                first = self.sched.requests[rid].num_computed_tokens - n  # already advanced by schedule()
                (table,) = self.sched.kv_cache_manager.get_block_ids(rid)
                blocks += table[first // bs:-(-(first + n) // bs)]
            for name in self.layer_names:
                kv[name][blocks] = POISON
        for name in self.layer_names:
            if blocks:
                kv[name][blocks] = torch.randn(kv[name][blocks].shape)
            c.save_kv_layer(name, kv[name], None)  # type: ignore[arg-type]  # attention metadata: unused

    def expects(self) -> list[ExpectReq]:
        return [e for m in self.metas for e in m.expects]

    def publishes(self) -> list[PublishReq]:
        return [p for m in self.metas for p in m.publishes]

    def close(self) -> None:
        for c, _ in self.ranks:
            c.shutdown()


def step_until_moved(pe: Any, de: Any, sent_id: str, recv_id: str, detail: Any = None) -> None:
    """Step the prefill engine until its workers report ``sent_id`` sent and the decode engine until
    they report ``recv_id`` received (within 60 s); a load error on decode fails at once.
    ``detail()``, if given, adds to the failure message."""
    sent = received = False

    def progress() -> bool:
        nonlocal sent, received
        if not sent:
            pe.step()
            sent = sent_id in (pe.last_kv.finished_sending or ())
        if not received:
            de.step()
            received = recv_id in (de.last_kv.finished_recving or ())
            assert not de.last_kv.failed_recving and not de.last_kv.invalid_block_ids, "load error"
        return sent and received

    assert vs.wait_for(progress, 60, 0.01), f"sent={sent} received={received}" + (f"\n{detail()}" if detail else "")
