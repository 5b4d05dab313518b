"""KVPushdConnector's transfer stats through vLLM 0.33.0's own stats path: worker connectors'
get_kv_connector_stats -> KVOutputAggregator -> Scheduler.update_from_output (SchedulerStats) ->
PrometheusStatLogger (/metrics) and LoggingStatLogger's KV transfer line, with real daemons and a
real transfer. The numbers are the daemons' (Completion.figures). And the request's trace context
(vLLM's trace_headers) reaching both daemons' spans through the connector, received by a real
OTLP/gRPC receiver in this process (when the vLLM venv has opentelemetry; scripts/vllm_venv.sh adds it).

Runs with the vLLM venv, like test_vllm_connector.py (``make test`` does)."""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
pytest.importorskip("vllm.distributed", reason="needs vLLM 0.33.0: run with the venv scripts/vllm_venv.sh builds")

import torch
import vllm_support as vs
from engine_support import step_until_moved
from kvpushd_client.vllm import worker as vllm_worker
from kvpushd_client.vllm.connector import KVPushdConnector
from kvpushd_client.vllm.stats import KVPushdKVConnectorStats
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

try:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
    from otlp_receiver import Receiver
except ImportError:  # no opentelemetry-proto in this venv: the trace test skips
    Receiver = None  # type: ignore[assignment,misc]

P_ENGINE = "stats-prefill-001"
D_ENGINE = "stats-decode-001"
CONFIG = "[transfer]\npublish_timeout_s = 2.0\nexpect_timeout_s = 60.0\ndrain_timeout_s = 3.0\n"
NIXL_NAMES = ["vllm:nixl_xfer_time_seconds", "vllm:nixl_post_time_seconds", "vllm:nixl_bytes_transferred",
              "vllm:nixl_num_descriptors", "vllm:nixl_num_failed_transfers", "vllm:nixl_num_failed_notifications",
              "vllm:nixl_num_kv_expired_reqs", "vllm:nixl_num_notifications_after_expiry"]


class Engine:
    """vLLM's Scheduler plus one worker connector, stepped like vLLM's model runner mixin does:
    hooks, then get_kv_connector_stats into the KVConnectorOutput, aggregated, update_from_output."""

    def __init__(self, model_dir: Path, role: str, engine_id: str, sock: str, fill: str) -> None:
        self.cfg = vs.make_vllm_config(model_dir, role, engine_id, sock, block_size=32)
        self.kv_cache_config = vs.real_kv_cache_config(self.cfg, 48)
        self.sched = vs.create_scheduler(self.cfg, self.kv_cache_config)
        self.kv = vs.allocate_cpu_kv_caches(self.cfg, self.kv_cache_config)
        next(iter(self.kv.values())).share_memory_()
        gen = torch.Generator().manual_seed(zlib.crc32(engine_id.encode()))
        for t in self.kv.values():
            t.copy_(torch.randn(t.shape, generator=gen)) if fill == "random" else t.fill_(-7.0)
        with mock.patch.object(vllm_worker, "_tp_rank_and_size", return_value=(0, 1)):
            self.conn = KVPushdConnector(self.cfg, KVConnectorRole.WORKER, self.kv_cache_config)
        self.conn.register_kv_caches(self.kv)
        self.aggregator = KVOutputAggregator(1)
        self.stats: list[Any] = []  # SchedulerStats with connector stats, as the engine core sends them
        self.expects: list[Any] = []
        self.publishes: list[Any] = []

    def step(self, running: list[Any] | None = None, eos: bool = False) -> Any:
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        self.expects += meta.expects
        self.publishes += meta.publishes
        reqs = [r for r in (running or []) if r.request_id in so.num_scheduled_tokens]
        c = self.conn
        c.bind_connector_metadata(meta)
        c.start_load_kv(None)  # type: ignore[arg-type]
        c.wait_for_save()
        res = c.get_transfer_results(so.finished_req_ids)
        sending, recving = res.finished_sending, res.finished_recving
        kv = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                               invalid_block_ids=c.get_block_ids_with_load_errors(),
                               kv_connector_stats=c.get_kv_connector_stats())
        c.clear_connector_metadata()
        out = self.aggregator.aggregate([vs.model_output(reqs, kv, eos)])
        self.last_kv = out.kv_connector_output
        outs = self.sched.update_from_output(so, out)
        for eco in outs.values():
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                self.stats.append(eco.scheduler_stats)
        return outs

    def close(self) -> None:
        self.conn.shutdown()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Any]:
    if Receiver is None:
        yield None
        return
    r = Receiver()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def setup(receiver: Any) -> Iterator[tuple[vs.Daemon, vs.Daemon, Engine, Engine]]:
    with tempfile.TemporaryDirectory(prefix="kvpushd-vllm-stats-") as tmp, \
            mock.patch.dict(os.environ, {"OTEL_BSP_SCHEDULE_DELAY": "100"}):
        workdir = Path(tmp)
        (workdir / "m").mkdir()
        model_dir = vs.write_tiny_llama(workdir / "m")
        cfg = CONFIG + (f'[tracing]\notlp_endpoint = "{receiver.endpoint}"\n' if receiver is not None else "")
        p = vs.spawn_daemon(workdir, "pnode", cfg)
        d = vs.spawn_daemon(workdir, "dnode", cfg)
        try:
            p.wait_ready()
            d.wait_ready()
            pe = Engine(model_dir, "kv_producer", P_ENGINE, p.sock, "random")
            de = Engine(model_dir, "kv_consumer", D_ENGINE, d.sock, "poison")
        except BaseException:
            p.stop()
            d.stop()
            raise
        yield p, d, pe, de
        pe.close()
        de.close()
        for x in (p, d):
            assert x.stop() == 0, x.logs()[-3000:]


def _families(logger_cfg: Any, stats: list[Any]) -> tuple[dict[str, Any], list[str]]:
    """What vLLM's Prometheus logger exposes and its periodic log line says for these stats."""
    prom = PrometheusStatLogger(logger_cfg, engine_indexes=[0])
    logging = LoggingStatLogger(logger_cfg)
    for s in stats:
        prom.record(scheduler_stats=s, iteration_stats=None, engine_idx=0)
        logging.record(scheduler_stats=s, iteration_stats=None, engine_idx=0)
    lines: list[str] = []
    logging.kv_connector_logging.log(log_fn=lambda fmt, *a: lines.append(fmt % a))  # what log() calls
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(REGISTRY).decode())}
    return fams, lines


def _value(fams: dict[str, Any], family: str, sample: str) -> float:
    got = [s.value for s in fams[family].samples if s.name == sample and s.labels.get("engine") == "0"]
    assert len(got) == 1, (family, sample, fams[family].samples)
    return float(got[0])


def run_request(p: vs.Daemon, pe: Engine, de: Engine, traceparent: str = "") -> tuple[Any, Any]:
    """One request through both engines (the proxy sends both at once); returns (decode, prefill) requests."""
    x = str(uuid.uuid4())
    prompt = [(i % 100) + 3 for i in range(100)]  # 4 blocks of 32
    d_req = vs.create_request(f"cmpl-{x}-0-aaaaaaaa", len(prompt), 2,
                              vs.decode_params(P_ENGINE, p.peer_address, x), 32, prompt)
    p_req = vs.create_request(f"cmpl-{x}-0-bbbbbbbb", len(prompt), 1, vs.prefill_params(), 32, prompt)
    if traceparent:  # what vLLM's frontend puts there from the HTTP headers with tracing on
        d_req.trace_headers = p_req.trace_headers = {"traceparent": traceparent}
    de.sched.add_request(d_req)
    pe.sched.add_request(p_req)
    de.step()
    assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    pe.step([p_req])
    step_until_moved(pe, de, p_req.request_id, d_req.request_id)
    de.step([d_req])  # decode runs the request to its end, so the next one starts from a clean scheduler
    de.step([d_req], eos=True)
    de.step()
    assert d_req.is_finished()
    return d_req, p_req


def test_stats_of_a_real_transfer(setup: tuple[vs.Daemon, vs.Daemon, Engine, Engine]) -> None:
    p, _d, pe, de = setup
    run_request(p, pe, de)
    (e,) = de.expects
    layers = len(pe.kv)
    page = next(iter(pe.kv.values()))[0].numel() * 4  # one block of one layer, float32
    moved = len(e.block_ids) * page * layers

    # prefill: its daemon posted the WRITE, so vLLM shows the NIXL figures
    assert len(pe.stats) == 1
    data = pe.stats[0].kv_connector_stats
    st = KVPushdConnector.build_kv_connector_stats(data)
    assert isinstance(st, KVPushdKVConnectorStats) and st.num_successful_transfers == 1
    fams, lines = _families(pe.cfg, pe.stats)
    for name in [*NIXL_NAMES, "vllm:kvpushd_rendezvous_wait_seconds", "vllm:kvpushd_transfer_elapsed_seconds"]:
        assert name in fams, f"{name} not in /metrics"
    assert _value(fams, "vllm:nixl_xfer_time_seconds", "vllm:nixl_xfer_time_seconds_count") == 1
    assert _value(fams, "vllm:nixl_xfer_time_seconds", "vllm:nixl_xfer_time_seconds_sum") > 0
    assert _value(fams, "vllm:nixl_post_time_seconds", "vllm:nixl_post_time_seconds_sum") > 0
    assert _value(fams, "vllm:nixl_bytes_transferred", "vllm:nixl_bytes_transferred_sum") == moved
    descs = _value(fams, "vllm:nixl_num_descriptors", "vllm:nixl_num_descriptors_sum")
    assert layers <= descs <= layers * len(e.block_ids)  # adjacent blocks merge into one descriptor
    assert _value(fams, "vllm:kvpushd_rendezvous_wait_seconds", "vllm:kvpushd_rendezvous_wait_seconds_count") == 1
    for c in ("vllm:nixl_num_failed_transfers", "vllm:nixl_num_kv_expired_reqs"):
        assert _value(fams, c, c + "_total") == 0
    assert len(lines) == 1 and lines[0].startswith("KV Transfer metrics: Num successful transfers=1, ")
    assert f"Avg MB per transfer={round(moved / 2**20, 3)}" in lines[0]

    # decode: push mode, the WRITE was the prefill daemon's; it reports the completion and its time only.
    # The figures come with the completion, in the step that reads it (a later one than run_request's
    # last step when a loaded machine delivers it late).
    def figures_came() -> bool:
        de.step()
        return bool(de.stats)

    assert vs.wait_for(figures_came, 30, 0.01), "no decode figures"
    fams, lines = _families(de.cfg, de.stats)
    assert _value(fams, "vllm:nixl_xfer_time_seconds", "vllm:nixl_xfer_time_seconds_count") == 0
    assert _value(fams, "vllm:kvpushd_transfer_elapsed_seconds", "vllm:kvpushd_transfer_elapsed_seconds_count") == 1
    assert _value(fams, "vllm:nixl_num_failed_transfers", "vllm:nixl_num_failed_transfers_total") == 0
    assert len(lines) == 1 and "Num kvpushd completions=1" in lines[0]


def test_expired_publish_is_counted_on_prefill(setup: tuple[vs.Daemon, vs.Daemon, Engine, Engine]) -> None:
    """A prefill request no decode registers for: the daemon's lease (2 s here) expires: TIMEOUT."""
    _p, _d, pe, _de = setup
    pe.stats.clear()
    p_req = vs.create_request(f"cmpl-{uuid.uuid4()}-0-cccccccc", 64, 1, vs.prefill_params(), 32)
    pe.sched.add_request(p_req)
    pe.step([p_req])
    assert vs.wait_for(lambda: bool(pe.step() is not None and pe.stats), 30, 0.05)
    fams, lines = _families(pe.cfg, pe.stats)
    assert _value(fams, "vllm:nixl_num_kv_expired_reqs", "vllm:nixl_num_kv_expired_reqs_total") == 1
    assert _value(fams, "vllm:nixl_num_failed_transfers", "vllm:nixl_num_failed_transfers_total") == 0
    assert _value(fams, "vllm:nixl_xfer_time_seconds", "vllm:nixl_xfer_time_seconds_count") == 0
    assert len(lines) == 1 and "Num KV expired reqs=1" in lines[0]


def test_trace_of_a_real_transfer(setup: tuple[vs.Daemon, vs.Daemon, Engine, Engine], receiver: Any) -> None:
    """The request's traceparent goes scheduler -> metadata -> worker -> both daemons: their spans are
    children of the request's context, the prefill daemon's under the decode daemon's."""
    if receiver is None:
        pytest.skip("opentelemetry-proto is not installed in this venv")
    p, _d, pe, de = setup
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    tp = f"00-{trace_id}-{parent}-01"
    d_req, p_req = run_request(p, pe, de, traceparent=tp)
    assert [e.traceparent for e in de.expects if e.req_id == d_req.request_id] == [tp]
    assert [x.traceparent for x in pe.publishes if x.req_id == p_req.request_id] == [tp]

    def mine() -> dict[str, Any]:
        return {s.name: s for s in receiver.snapshot() if s.trace_id == trace_id}

    want = {"kvpushd.recv", "kvpushd.register", "kvpushd.wait_notifications", "kvpushd.send",
            "kvpushd.rendezvous_wait", "kvpushd.nixl_write"}
    assert vs.wait_for(lambda: want <= set(mine()), 30, 0.1), sorted(mine())
    got = mine()
    assert got["kvpushd.recv"].parent_span_id == parent  # the engine request's context, continued
    assert got["kvpushd.send"].parent_span_id == got["kvpushd.recv"].span_id
    assert got["kvpushd.nixl_write"].parent_span_id == got["kvpushd.send"].span_id
    assert got["kvpushd.wait_notifications"].parent_span_id == got["kvpushd.recv"].span_id
    assert got["kvpushd.send"].attributes["kvpushd.transfer_id"] == d_req.request_id.rsplit("-", 1)[0]
