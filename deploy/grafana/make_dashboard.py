"""Writes deploy/grafana/kvpushd.json, the Grafana dashboard of a kvpushd fleet.

    python deploy/grafana/make_dashboard.py          # rewrite kvpushd.json
    python deploy/grafana/make_dashboard.py --check  # exit 1 if kvpushd.json is not what this makes

Every query names only series the daemon exports (kvpushd/metrics.py; the process_* series of
prometheus-client) or, in the last row, the ones KVPushdConnector adds to vLLM's own /metrics
(client/kvpushd_client/vllm/stats.py). Variables: ``datasource``, ``job`` and ``instance`` (the
daemons' scrape job and targets), ``vllm_job`` (the vLLM servers' scrape job).
tests/deploy/test_grafana_prometheus.py evaluates every query against a real Prometheus.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("kvpushd.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", instance=~"$instance"'
VSEL = 'job=~"$vllm_job"'
NODE = " * on (job, instance) group_left (node_id) kvpushd_info"  # adds the daemon's node id to a series
W = 24  # grid width


def q(expr: str, legend: str = "", instant: bool = False) -> dict[str, Any]:
    t: dict[str, Any] = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ""}
    if instant:
        t.update(instant=True, range=False, format="table")
    return t


def vllm(name: str) -> str:
    """A vLLM series selector matching both spellings of its name: ``vllm:x`` and ``vllm_x``, which is how
    prometheus-client >= 0.22 writes it when the scraper negotiates OpenMetrics (Prometheus 2.x does)."""
    return f'{{__name__=~"vllm[:_]{name.removeprefix("vllm:")}", {VSEL}}}'


def quantiles(metric: str, by: str, sel: str = SEL) -> list[dict[str, Any]]:
    """p50 and p99 of a histogram, per ``by`` (``job, instance``: per daemon, named by its node id)."""
    per_daemon = by == "job, instance"
    series = vllm(f"{metric}_bucket") if metric.startswith("vllm:") else f"{metric}_bucket{{{sel}}}"
    return [q(f"histogram_quantile({p}, sum by (le, {by}) (rate({series}[$__rate_interval])))"
              + (NODE if per_daemon else ""), f"p{int(p * 100)} {{{{{'node_id' if per_daemon else by}}}}}")
            for p in (0.5, 0.99)]


class Board:
    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = self.y = self.row_h = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False, "panels": [],
                            "gridPos": {"x": 0, "y": self.y, "w": W, "h": 1}, "id": len(self.panels) + 1})
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0

    def panel(self, kind: str, title: str, desc: str, targets: list[dict[str, Any]], unit: str = "short",
              w: int = 8, h: int = 8, **extra: Any) -> None:
        if self.x + w > W:
            self._newline()
        for i, t in enumerate(targets):
            t["refId"] = chr(ord("A") + i)
        p: dict[str, Any] = {
            "id": len(self.panels) + 1, "type": kind, "title": title, "description": desc, "datasource": DS,
            "gridPos": {"x": self.x, "y": self.y, "w": w, "h": h}, "targets": targets,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "options": {},
        }
        if kind == "timeseries":
            p["fieldConfig"]["defaults"]["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                                                      "showPoints": "never", "spanNulls": False}
            p["options"] = {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                            "tooltip": {"mode": "multi", "sort": "desc"}}
        p.update(extra)
        self.panels.append(p)
        self.x += w
        self.row_h = max(self.row_h, h)

    def ts(self, title: str, desc: str, targets: list[dict[str, Any]], unit: str = "short", w: int = 8,
           **extra: Any) -> None:
        self.panel("timeseries", title, desc, targets, unit, w, **extra)

    def stat(self, title: str, desc: str, expr: str, unit: str = "short", w: int = 4, red_above: float | None = None,
             red_below: float | None = None) -> None:
        steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
        if red_above is not None:
            steps.append({"color": "red", "value": red_above})
        if red_below is not None:
            steps = [{"color": "red", "value": None}, {"color": "green", "value": red_below}]
        self.panel("stat", title, desc, [q(expr, instant=False)], unit, w, h=4,
                   options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                            "colorMode": "background", "graphMode": "none", "textMode": "value"})
        self.panels[-1]["fieldConfig"]["defaults"]["thresholds"] = {"mode": "absolute", "steps": steps}


def build() -> dict[str, Any]:
    b = Board()
    ready = f'up{{{SEL}}} == 1 and on (job, instance) kvpushd_draining == 0'
    b.row("Daemons")
    b.stat("Daemons scraped", "Targets of the daemons' scrape job Prometheus reached at its last scrape.",
           f"count(up{{{SEL}}} == 1) or vector(0)")
    b.stat("Ready", "Daemons serving: scraped (the metrics port opens with the worker and peer sockets, just "
           "before READY) and not draining.", f"count({ready}) or vector(0)")
    b.stat("Down or draining", "Targets Prometheus could not scrape, and daemons shutting down.",
           f"count(up{{{SEL}}} == 0 or on (job, instance) kvpushd_draining{{{SEL}}} == 1) or vector(0)", red_above=1)
    b.stat("Workers attached", "Engine workers (one per TP rank) attached to the daemons shown.",
           f"sum(kvpushd_workers{{{SEL}}}) or vector(0)")
    b.stat("Held blocks", "KV blocks covered by pending Publishes and Expects, over the daemons shown.",
           f"sum(kvpushd_held_blocks{{{SEL}}}) or vector(0)")
    b.stat("Restarts (1h)", "Daemon process starts seen in the last hour.",
           f"sum(changes(process_start_time_seconds{{{SEL}}}[1h])) or vector(0)", red_above=1)
    b.panel("table", "Daemons", "One row per daemon: node id, version, up (1) or not, draining, workers, "
            "uptime.", [
                q(f"max by (job, instance, node_id, version) (kvpushd_info{{{SEL}}})", instant=True),
                q(f"up{{{SEL}}}", instant=True),
                q(f"kvpushd_draining{{{SEL}}}", instant=True),
                q(f"kvpushd_workers{{{SEL}}}", instant=True),
                q(f"kvpushd_uptime_seconds{{{SEL}}}", instant=True),
            ], w=24, h=7,
            transformations=[{"id": "merge", "options": {}},
                             {"id": "organize", "options": {"excludeByName": {"Time": True, "__name__": True},
                                                            "renameByName": {"Value #A": "info", "Value #B": "up",
                                                                             "Value #C": "draining",
                                                                             "Value #D": "workers",
                                                                             "Value #E": "uptime (s)"}}}])

    b.row("Transfers")
    b.ts("Transfers ended by outcome", "Publishes (send, prefill) and Expects (recv, decode) ended per second.",
         [q(f"sum by (side, outcome) (rate(kvpushd_transfers_total{{{SEL}}}[$__rate_interval]))",
            "{{side}} {{outcome}}")], "ops")
    b.ts("Transfer failures by code", "Failed transfers per second by failure code (ABORTED: the engine "
         "aborted; SHUTDOWN: a daemon stopped; the rest need a look: docs/observability.md).",
         [q(f'sum by (side, code) (rate(kvpushd_transfers_total{{outcome="failed", {SEL}}}[$__rate_interval]))',
            "{{side}} {{code}}")], "ops")
    b.ts("Failed share by node", "Failed / ended transfers per daemon (ABORTED and SHUTDOWN left out).",
         [q(f'(sum by (job, instance) (rate(kvpushd_transfers_total{{outcome="failed", code!~"ABORTED|SHUTDOWN", '
            f'{SEL}}}[$__rate_interval])) / sum by (job, instance) (rate(kvpushd_transfers_total{{{SEL}}}'
            f'[$__rate_interval]))){NODE}', "{{node_id}}")], "percentunit")
    b.ts("Transfer time", "Publish or Expect taken -> its completion delivered, per side.",
         quantiles("kvpushd_transfer_duration_seconds", "side"), "s")
    b.ts("Pending transfers", "Not yet completed: send (prefill rendezvous, WRITEs in flight), recv (decode "
         "registrations).", [q(f"kvpushd_pending_transfers{{{SEL}}}{NODE}", "{{node_id}} {{side}}")])
    b.ts("Declines", "Transfers declined because a decode worker's Expect never reached its daemon.",
         [q(f"sum by (direction) (rate(kvpushd_declines_total{{{SEL}}}[$__rate_interval]))", "{{direction}}")], "ops")

    b.row("Data path")
    b.ts("KV bytes per peer pair", "Bytes per second by node and the other node's daemon (peer address): sent "
         "by the daemon that posted the WRITEs, received where they landed.",
         [q(f"sum by (node_id, direction, peer) (rate(kvpushd_bytes_total{{{SEL}}}[$__rate_interval]){NODE})",
            "{{node_id}} {{direction}} {{peer}}")], "Bps", w=12)
    b.ts("Rendezvous wait", "Prefill side: first arrival (publish or the decode registration) -> the second, "
         "which starts the WRITE.", quantiles("kvpushd_rendezvous_wait_seconds", "job, instance"), "s", w=12)
    b.ts("WRITE post time", "WRITE request reaching the NIXL thread -> WRITE posted.",
         quantiles("kvpushd_write_post_seconds", "job, instance"), "s")
    b.ts("WRITE transfer time", "WRITE posted -> its completion seen.",
         quantiles("kvpushd_write_seconds", "job, instance"), "s")
    b.ts("WRITEs by outcome", "Completed WRITEs per second; any error is a NIXL failure.",
         [q(f"sum by (outcome) (rate(kvpushd_writes_total{{{SEL}}}[$__rate_interval]))", "{{outcome}}")], "ops")
    b.ts("Descriptors per WRITE", "Descriptors requested (one per region and block) and posted (after merging "
         "blocks adjacent on both sides), per completed WRITE.",
         [q(f'sum by (stage) (rate(kvpushd_descriptors_total{{{SEL}}}[$__rate_interval])) / on () group_left '
            f'sum(rate(kvpushd_writes_total{{outcome="ok", {SEL}}}[$__rate_interval]))', "{{stage}}")])
    b.ts("Notifications", "WRITE notifications received (decode), notifications for no pending registration, "
         "late events the rendezvous dropped on purpose.",
         [q(f"sum(rate(kvpushd_notifications_total{{{SEL}}}[$__rate_interval]))", "received"),
          q(f"sum(rate(kvpushd_stray_notifications_total{{{SEL}}}[$__rate_interval]))", "stray"),
          q(f"sum by (event) (rate(kvpushd_late_events_total{{{SEL}}}[$__rate_interval]))", "late {{event}}")],
         "ops")
    b.ts("Watch streams", "Watch subscribers open, and events dropped for subscribers that fell behind.",
         [q(f"sum(kvpushd_watchers{{{SEL}}})", "open"),
          q(f"sum(rate(kvpushd_events_dropped_total{{{SEL}}}[$__rate_interval]))", "dropped/s")])

    b.row("Held blocks")
    b.ts("Held blocks", "Blocks of local workers covered by pending Publishes (send) and Expects (recv). They "
         "come back when each transfer ends: a plateau with nothing pending is a leak.",
         [q(f"kvpushd_held_blocks{{{SEL}}}{NODE}", "{{node_id}} {{side}}")], w=12)
    b.ts("Held blocks without a pending transfer", "Held blocks of a side that has no pending transfer (should "
         "stay 0; the KvpushdHeldBlocksWithoutTransfers alert).",
         [q(f"(kvpushd_held_blocks{{{SEL}}} * on (job, instance, side) (kvpushd_pending_transfers{{{SEL}}} == bool 0))"
            f"{NODE}", "{{node_id}} {{side}}")], w=12)

    b.row("Peers")
    b.ts("Peers exchanged KV with", "Other daemons each daemon has moved KV bytes with since it started (the "
         "peer label of kvpushd_bytes_total; the daemon exports no connection or handshake counts).",
         [q(f"count by (node_id) (count by (job, instance, peer) (kvpushd_bytes_total{{{SEL}}}){NODE})",
            "{{node_id}}")])
    b.ts("Peers carrying traffic", "Peers with KV bytes moving in the window, per daemon.",
         [q(f"count by (node_id) ((sum by (job, instance, peer) (rate(kvpushd_bytes_total{{{SEL}}}[$__rate_interval]))"
            f" > 0){NODE}) or on (node_id) (0 * max by (node_id) (kvpushd_info{{{SEL}}}))", "{{node_id}}")])
    b.ts("Peer failures", "Transfers failed because the other node's daemon could not be reached "
         "(PEER_UNREACHABLE: connect, RPC or heartbeat timeouts) or refused the registration (PEER_REJECTED).",
         [q(f'sum by (node_id, code) (rate(kvpushd_transfers_total{{code=~"PEER_UNREACHABLE|PEER_REJECTED", {SEL}}}'
            f'[$__rate_interval]){NODE})', "{{node_id}} {{code}}")], "ops")

    b.row("Process")
    b.ts("Resident memory", "", [q(f"process_resident_memory_bytes{{{SEL}}}{NODE}", "{{node_id}}")], "bytes")
    b.ts("CPU", "", [q(f"rate(process_cpu_seconds_total{{{SEL}}}[$__rate_interval]){NODE}", "{{node_id}}")],
         "percentunit")
    b.ts("Open file descriptors", "", [q(f"process_open_fds{{{SEL}}}{NODE}", "{{node_id}}")])

    b.row("vLLM connector (vLLM servers' /metrics)")
    b.ts("NIXL transfer time (vLLM)", "vllm:nixl_xfer_time_seconds from KVPushdConnector: posted -> done, "
         "measured in the daemon that posted the WRITEs.", quantiles("vllm:nixl_xfer_time_seconds", "model_name",
                                                                     VSEL), "s")
    b.ts("NIXL post time (vLLM)", "vllm:nixl_post_time_seconds: queued -> posted, in the daemon.",
         quantiles("vllm:nixl_post_time_seconds", "model_name", VSEL), "s")
    b.ts("KV bytes (vLLM)", "vllm:nixl_bytes_transferred: bytes per second over the engines' transfers.",
         [q(f"sum by (model_name) (rate({vllm('nixl_bytes_transferred_sum')}[$__rate_interval]))",
            "{{model_name}}")], "Bps")
    b.ts("Rendezvous wait (vLLM)", "vllm:kvpushd_rendezvous_wait_seconds (prefill engines).",
         quantiles("vllm:kvpushd_rendezvous_wait_seconds", "model_name", VSEL), "s")
    b.ts("Daemon transfer time (vLLM)", "vllm:kvpushd_transfer_elapsed_seconds: this engine's Publish or Expect "
         "-> its completion.", quantiles("vllm:kvpushd_transfer_elapsed_seconds", "model_name", VSEL), "s")
    b.ts("Failures and expiries (vLLM)", "vllm:nixl_num_failed_transfers and vllm:nixl_num_kv_expired_reqs.",
         [q(f"sum by (model_name) (rate({vllm('nixl_num_failed_transfers_total')}[$__rate_interval]))",
            "failed {{model_name}}"),
          q(f"sum by (model_name) (rate({vllm('nixl_num_kv_expired_reqs_total')}[$__rate_interval]))",
            "expired {{model_name}}")], "ops")

    def var(name: str, label: str, query: str, all_value: str) -> dict[str, Any]:
        return {"name": name, "label": label, "type": "query", "datasource": DS, "refresh": 2, "includeAll": True,
                "multi": True, "allValue": all_value, "current": {"text": "All", "value": "$__all"},
                "definition": query, "query": {"query": query, "refId": name}, "sort": 1}

    return {
        "uid": "kvpushd", "title": "kvpushd fleet", "description": "KV cache transfers between vLLM prefill and "
        "decode nodes: transfers, bytes per peer pair, rendezvous and WRITE times, held blocks, peers, daemons.",
        "tags": ["kvpushd", "vllm"], "timezone": "utc", "schemaVersion": 39, "version": 1, "editable": True,
        "graphTooltip": 1, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []}, "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            var("job", "Daemon job", "label_values(kvpushd_info, job)", ".+"),
            var("instance", "Daemon", 'label_values(kvpushd_info{job=~"$job"}, instance)', ".+"),
            var("vllm_job", "vLLM job",
                'label_values({__name__=~"vllm[:_]kvpushd_transfer_elapsed_seconds_count"}, job)', ".+"),
        ]},
        "panels": b.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=1) + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv[1:]:
        sys.exit(0 if OUT.read_text() == text else 1)
    OUT.write_text(text)
