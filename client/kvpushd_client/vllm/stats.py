"""vLLM 0.33.0's connector stats for KVPushdConnector: ``KVConnectorStats`` and Prometheus metrics.

Modelled on vLLM's ``nixl/stats.py`` (``NixlKVConnectorStats``, ``NixlPromMetrics``): the same data
keys, the same log-line fields and the same metric names and buckets (``vllm:nixl_xfer_time_seconds``,
``vllm:nixl_post_time_seconds``, ``vllm:nixl_bytes_transferred``, ``vllm:nixl_num_descriptors``,
``vllm:nixl_num_failed_transfers``, ``vllm:nixl_num_failed_notifications``,
``vllm:nixl_num_kv_expired_reqs``, ``vllm:nixl_num_notifications_after_expiry``), so dashboards built
for NixlPushConnector keep working; plus ``vllm:kvpushd_rendezvous_wait_seconds`` and
``vllm:kvpushd_transfer_elapsed_seconds``. What each key holds and which side records it:
``xfer_stats.py``. Not a subclass of vLLM's classes: importing vLLM's nixl package loads its NIXL
worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from .xfer_stats import is_empty, new_data


@dataclass
class KVPushdKVConnectorStats(KVConnectorStats):
    """Per-interval transfer figures from the daemons (lists of observations, serializable)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = new_data()

    def is_empty(self) -> bool:
        return is_empty(self.data)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for k, v in other.data.items():
                self.data.setdefault(k, []).extend(v)
        return self

    @property
    def num_successful_transfers(self) -> int:
        return len(self.data.get("transfer_duration", []))

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        failures: dict[str, int | float] = {
            "Num failed transfers": len(d.get("num_failed_transfers", [])) + len(d.get("num_failed_handshakes", []))
            + len(d.get("num_failed_notifications", [])),
            "Num KV expired reqs": len(d.get("num_kv_expired_reqs", [])),
            "Num notifs after expiry": len(d.get("num_notifications_after_expiry", [])),
        }
        done = len(d.get("daemon_elapsed", []))
        elapsed = np.asarray(d.get("daemon_elapsed", []), dtype=float)
        mine: dict[str, int | float] = {
            "Num kvpushd completions": done,
            "Avg kvpushd time (ms)": round(float(elapsed.mean()) * 1e3, 3) if done else 0,
        }
        n = self.num_successful_transfers
        if n == 0:
            return {"Num successful transfers": 0, "Avg xfer time (ms)": 0, "P90 xfer time (ms)": 0,
                    "Avg post time (ms)": 0, "P90 post time (ms)": 0, "Avg MB per transfer": 0,
                    "Throughput (MB/s)": 0, "Avg number of descriptors": 0, **failures, **mine}
        xfer = np.asarray(d["transfer_duration"], dtype=float)
        post = np.asarray(d["post_duration"], dtype=float)
        mb = np.asarray(d["bytes_transferred"], dtype=float) / 2**20
        descs = np.asarray(d["num_descriptors"], dtype=float)
        wait = np.asarray(d.get("rendezvous_wait", []), dtype=float)
        total_s = float(xfer.sum())
        out: dict[str, int | float] = {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(float(xfer.mean()) * 1e3, 3),
            "P90 xfer time (ms)": round(float(np.percentile(xfer, 90)) * 1e3, 3),
            "Avg post time (ms)": round(float(post.mean()) * 1e3, 3),
            "P90 post time (ms)": round(float(np.percentile(post, 90)) * 1e3, 3),
            "Avg MB per transfer": round(float(mb.mean()), 3),
            "Throughput (MB/s)": round(float(mb.sum()) / total_s, 3) if total_s > 0 else 0,
            "Avg number of descriptors": round(float(descs.mean()), 1),
            **failures, **mine,
        }
        if len(wait):
            out["Avg rendezvous wait (ms)"] = round(float(wait.mean()) * 1e3, 3)
        return out


class KVPushdPromMetrics(KVConnectorPromMetrics):
    """NixlPromMetrics' series (same names and buckets) plus kvpushd's two histograms."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        times = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
        per_engine = self.per_engine_labelvalues

        def hist(name: str, doc: str, buckets: list[float] | list[int]) -> dict[int, Any]:
            return create_metric_per_engine(
                self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames), per_engine)

        def counter(name: str, doc: str) -> dict[int, Any]:
            return create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames), per_engine)

        self._hists = [
            (hist("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers "
                  "(kvpushd: posted -> done, measured in the daemon that posted them).", times[1:]),
             "transfer_duration"),
            (hist("vllm:nixl_post_time_seconds", "Histogram of transfer post time for NIXL KV Cache transfers "
                  "(kvpushd: queued -> posted, in the daemon).", times), "post_duration"),
            (hist("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.",
                  [2 ** (10 + i) for i in range(1, 25, 2)]), "bytes_transferred"),
            (hist("vllm:nixl_num_descriptors", "Histogram of number of descriptors per NIXL KV Cache transfers.",
                  [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]), "num_descriptors"),
            (hist("vllm:kvpushd_rendezvous_wait_seconds", "kvpushd, prefill side: first of publish and decode "
                  "registration -> the second (the WRITE starts).", times), "rendezvous_wait"),
            (hist("vllm:kvpushd_transfer_elapsed_seconds", "kvpushd: this engine's Publish or Expect -> its "
                  "completion, in the daemon.", times), "daemon_elapsed"),
        ]
        self._counters = [
            (counter("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers, including "
                     "handshake and notification failures. NOTE: KV expiry is tracked separately in "
                     "vllm:nixl_num_kv_expired_reqs."),
             ("num_failed_transfers", "num_failed_handshakes", "num_failed_notifications")),
            (counter("vllm:nixl_num_failed_notifications", "Number of failed NIXL KV Cache notifications "
                     "(kvpushd: always 0, the daemon holds notifications)."), ("num_failed_notifications",)),
            (counter("vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire. NOTE: This "
                     "metric is tracked on the P instance."), ("num_kv_expired_reqs",)),
            (counter("vllm:nixl_num_notifications_after_expiry", "Number of completion notifications for requests "
                     "that were no longer tracked (kvpushd: always 0)."), ("num_notifications_after_expiry",)),
        ]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for metric, key in self._hists:
            for v in transfer_stats_data.get(key, ()):
                metric[engine_idx].observe(v)
        for metric, keys in self._counters:
            for key in keys:
                for v in transfer_stats_data.get(key, ()):
                    metric[engine_idx].inc(v)
