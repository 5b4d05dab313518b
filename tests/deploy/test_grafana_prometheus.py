"""deploy/grafana/kvpushd.json and deploy/prometheus/kvpushd-rules.yml against the real thing.

Two real daemons move real transfers (finished, aborted, timed out, peer unreachable) while a real
Prometheus server (Debian's ``prometheus`` package) scrapes their metrics endpoints every second
with the alerting rules loaded; then every dashboard query is evaluated through Prometheus' HTTP
API and must return data, every rule must evaluate without error, and the failures moved must put
the transfer and peer alerts in their pending state. ``promtool check rules`` and ``promtool test
rules`` run on the rules and their unit tests.

Needs /usr/bin/prometheus and /usr/bin/promtool (``apt-get install prometheus``): skipped without
them, except under CI=true, where a missing Prometheus fails.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvpushd_client import Abort, CompletionKind, Expect, Publish
from prometheus_client.parser import text_string_to_metric_families
from support import KV, attach_pair, wait_for

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvpushd.json"
RULES = ROOT / "deploy" / "prometheus" / "kvpushd-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "kvpushd-rules.test.yml"
VLLM_STATS = ROOT / "client" / "kvpushd_client" / "vllm" / "stats.py"
# Grafana's variables as a dashboard with every daemon selected shows them
VARIABLES = {"$__rate_interval": "1m", "$job": "kvpushd", "$instance": ".+", "$vllm_job": ".+"}
# peer_api first (the launcher's config ends in that section): a dead peer fails fast as PEER_UNREACHABLE
CONFIG = ('connect_timeout_s = 1.0\n[transfer]\npublish_timeout_s = 2.0\nexpect_timeout_s = 30.0\n'
          '[metrics]\nlisten = "127.0.0.1:0"\n')
NAME = re.compile(r"\b(?:kvpushd_[a-z_]+|process_[a-z_]+)|vllm(?::|\[:_\])[a-z_]+")


def names(expr: str) -> set[str]:
    """The series an expression names; vLLM's as ``vllm:x`` (the dashboard matches ``vllm[:_]x``)."""
    return {n.replace("vllm[:_]", "vllm:") for n in NAME.findall(expr)}


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        why = f"{name} is not installed (apt-get install prometheus: Debian's package has prometheus and promtool)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(why + "; CI installs it (.ci/run)")
        pytest.skip(why)
    return path


def panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def exprs() -> list[tuple[str, str]]:
    """(panel title, query) for every query of the dashboard, variables substituted."""
    out = []
    for p in panels():
        for t in p["targets"]:
            e = t["expr"]
            for var, val in VARIABLES.items():
                e = e.replace(var, val)
            assert "$" not in e, f"{p['title']}: a variable the test does not know: {e}"
            out.append((p["title"], e))
    return out


def rule_exprs() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


# -- the files themselves -------------------------------------------------------------------------


def test_dashboard_is_what_its_generator_makes_and_is_well_formed() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "deploy" / "grafana" / "make_dashboard.py"), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, "deploy/grafana/kvpushd.json is stale: run python deploy/grafana/make_dashboard.py"
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "kvpushd" and board["panels"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in board["templating"]["list"]}
    assert names == {"datasource", "job", "instance", "vllm_job"}
    for p in panels():
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
    titles = " ".join(p["title"] for p in panels())
    for what in ("by outcome", "by code", "per peer pair", "Rendezvous wait", "WRITE post time",
                 "WRITE transfer time", "Held blocks", "Peer", "Ready", "(vLLM)"):
        assert what in titles, what


def test_vllm_panels_name_the_connectors_own_series() -> None:
    """The vLLM row's series are those KVPushdPromMetrics registers in vLLM (no vLLM server runs here)."""
    defined = set(re.findall(r'"(vllm:[a-z_]+)"', VLLM_STATS.read_text()))
    used = {n for _, e in exprs() for n in names(e) if n.startswith("vllm:")}
    assert used, "no vLLM panels"
    for n in used:
        assert re.sub(r"_(bucket|sum|count|total)$", "", n) in defined, n


def test_rules_pass_promtool_check_and_unit_tests() -> None:
    promtool = tool("promtool")
    for args in (["check", "rules", str(RULES)], ["test", "rules", str(RULE_TESTS)]):
        r = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120, cwd=RULES.parent)
        assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}\n{r.stderr}"
        assert "SUCCESS" in r.stdout + r.stderr


# -- a real Prometheus scraping real daemons -----------------------------------------------------


class Prometheus:
    def __init__(self, binary: str, workdir: Path, targets: list[str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cfg = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
               "rule_files": [str(RULES)],
               "scrape_configs": [{"job_name": "kvpushd", "static_configs": [{"targets": targets}]}]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT)

    def get(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited:\n{self.log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = self.get("/api/v1/query", query=expr)
        assert body["status"] == "success", (expr, body)
        return list(body["data"]["result"])

    def scalar(self, expr: str) -> float:
        r = self.query(expr)
        return float(r[0]["value"][1]) if r else math.nan

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def prometheus_binary() -> str:
    tool("promtool")
    return tool("prometheus")


def transfers_total(*metrics_texts: str) -> float:
    return sum(s.value for text in metrics_texts for fam in text_string_to_metric_families(text)
               for s in fam.samples if s.name == "kvpushd_transfers_total")


def test_every_panel_returns_data_from_real_daemons(prometheus_binary: str, daemon_factory: Any, workdir: Path,
                                                    kv_pair: tuple[KV, KV]) -> None:
    p, d = daemon_factory.pair(CONFIG)
    prom = Prometheus(prometheus_binary, workdir, [p.metrics_address, d.metrics_address])
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    with socket.socket() as s:  # a port nothing listens on: the decode daemon's prefill peer is unreachable
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    try:
        assert wait_for(prom.ready, timeout=60)
        # two scrapes of each daemon before anything moves: rates start from the idle counters
        assert wait_for(lambda: prom.scalar('min(count_over_time(up{job="kvpushd"}[1m]))') >= 2
                        and prom.scalar('sum(up{job="kvpushd"})') == 2, timeout=60)
        for batch in range(2):
            for i in range(4):  # four transfers, each of a run of 3 blocks (one descriptor per region)
                tid, base = f"graf-{batch}-{i}", 12 * batch + 3 * i
                dw.send(Expect(tid, (32 + base, 33 + base, 34 + base), p.peer_address, "prefill", 1))
                pw.send(Publish(tid, (base, base + 1, base + 2)))
                assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
                assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
            dw.send(Expect(f"graf-abort-{batch}", (60,), p.peer_address, "prefill", 1))
            assert dw.send(Abort(f"graf-abort-{batch}"))
            assert dw.next_completion(20).code == "ABORTED"
            dw.send(Expect(f"graf-dead-{batch}", (61,), dead, "prefill", 1))
            assert dw.next_completion(30).code == "PEER_UNREACHABLE"
            pw.send(Publish(f"graf-late-{batch}", (40,)))  # nobody registers for it
            assert pw.next_completion(30).code == "TIMEOUT"
            want = transfers_total(p.metrics(), d.metrics())
            assert wait_for(lambda w=want: prom.scalar('sum(kvpushd_transfers_total{job="kvpushd"})') == w, timeout=60)

        # every dashboard query returns data, and some of it is a number (not NaN)
        empty, nan = [], []
        for title, e in exprs():
            result = prom.query(e)
            if "vllm" in e:  # no vLLM server is scraped here: the query must parse and run
                continue
            values = [float(r["value"][1]) for r in result]
            if not values:
                empty.append(f"{title}: {e}")
            elif all(math.isnan(v) for v in values):
                nan.append(f"{title}: {e}")
        assert not empty, "queries without data:\n" + "\n".join(empty)
        assert not nan, "queries with only NaN:\n" + "\n".join(nan)

        # every series the dashboard and the rules name is one the daemons export
        exported = {s.name for text in (p.metrics(), d.metrics()) for fam in text_string_to_metric_families(text)
                    for s in fam.samples}
        named = {n for _, e in exprs() for n in names(e)} | {n for e in rule_exprs() for n in names(e)}
        assert {n for n in named if not n.startswith("vllm:")} - exported == set()

        # the rules, loaded by the server, evaluate on these series without error; the peer and the
        # failure alerts see the failures just moved (pending: their "for" has not passed)
        def rules_state() -> tuple[list[dict[str, Any]], set[tuple[str, str]]]:
            rules = [r for g in prom.get("/api/v1/rules")["data"]["groups"] for r in g["rules"]]
            alerts = {(a["labels"]["alertname"], a["labels"].get("code", "")) for a in prom.get("/api/v1/alerts")
                      ["data"]["alerts"] if a["labels"].get("instance") == d.metrics_address}
            return rules, alerts

        want_alerts = {("KvpushdPeerUnreachable", "PEER_UNREACHABLE"), ("KvpushdTransfersFailing", "PEER_UNREACHABLE")}
        assert wait_for(lambda: want_alerts <= rules_state()[1], timeout=30), rules_state()[1]
        rules, _ = rules_state()
        assert len(rules) == len(rule_exprs()) and all(r["health"] == "ok" for r in rules), rules
        assert not {a for a in rules_state()[1] if a[0] in ("KvpushdDown", "KvpushdNotReady")}
    finally:
        pw.detach()
        dw.detach()
        prom.close()
