"""The daemon's per-transfer metrics are plain numbers turned into metric families at scrape time:
what a scrape shows must be what prometheus-client's own Counter and Histogram would show for the
same observations (bucket bounds inclusive, cumulative buckets, sums, labels, zero-initialised series)."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.registry import Collector

from kvpushd.runtime.tally import LATENCY_BUCKETS
from kvpushd.runtime.tally import Counts as _Counts
from kvpushd.runtime.tally import Histograms as _Histograms


class _One(Collector):
    def __init__(self, m: _Counts | _Histograms) -> None:
        self.m = m

    def collect(self):  # type: ignore[no-untyped-def]
        yield self.m.family()


def _text(r: CollectorRegistry) -> list[str]:
    return sorted(line for line in generate_latest(r).decode().splitlines() if "_created" not in line)


def test_histograms_expose_what_prometheus_client_would() -> None:
    rng = random.Random(7)
    values = [*LATENCY_BUCKETS, 0.0, 1e-9, 1e9, *(rng.uniform(0, 400) for _ in range(50)),
              *(10 ** rng.uniform(-6, 2) for _ in range(200))]  # every bound itself: le is inclusive
    ref, ours = CollectorRegistry(), CollectorRegistry()
    h = Histogram("x_seconds", "doc", ["side"], buckets=LATENCY_BUCKETS, registry=ref)
    u = Histogram("y_seconds", "doc", buckets=LATENCY_BUCKETS, registry=ref)
    mine = _Histograms("x_seconds", "doc", ["side"])
    plain = _Histograms("y_seconds", "doc")
    ours.register(_One(mine))
    ours.register(_One(plain))
    for i, v in enumerate(values):
        side = ("send", "recv")[i % 2]
        h.labels(side).observe(v)
        mine.observe(v, (side,))
        u.observe(v)
        plain.observe(v)
    assert _text(ours) == _text(ref)


def test_counters_expose_what_prometheus_client_would() -> None:
    ref, ours = CollectorRegistry(), CollectorRegistry()
    c = Counter("kvpushd_bytes", "doc", ["direction", "peer"], registry=ref)
    c.labels("sent", "a:1")  # a series named up front shows at 0
    mine = _Counts("kvpushd_bytes", "doc", ["direction", "peer"], ("sent", "a:1"))
    ours.register(_One(mine))
    assert _text(ours) == _text(ref)
    for key, n in [(("received", "b:2"), 4096), (("sent", "a:1"), 1), (("received", "b:2"), 8192)]:
        c.labels(*key).inc(n)
        mine.inc(key, n)
    assert _text(ours) == _text(ref)
