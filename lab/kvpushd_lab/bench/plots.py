"""PNG plots of a suite's figures (optional: needs matplotlib, ``pip install 'kvpushd-lab[bench]'``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .common import BenchError, Result


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError("--plot needs matplotlib, which is not installed; install it with: "
                         "pip install 'kvpushd-lab[bench]' (or: pip install 'matplotlib>=3.8')") from None


def plot(result: Result, outdir: Path) -> list[Path]:
    """Write the suite's plots into ``outdir``; returns the files written."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    outdir.mkdir(parents=True, exist_ok=True)
    fn = _PLOTS.get(result.suite)
    return fn(result, outdir) if fn is not None else []


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    if not values:
        return
    v = np.sort(np.asarray(values, dtype=float))
    ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=f"{label} (p99 {np.percentile(v, 99):.0f})")


def _ceiling(r: Result, outdir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    rows = r.rows
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    w = 0.27
    for i, (key, label) in enumerate((("ceiling_gbps", "ceiling: raw NIXL, 1 descriptor/region"),
                                      ("raw_blocks_gbps", "raw NIXL, daemon's descriptors"),
                                      ("daemon_gbps", "kvpushd daemons"))):
        ax.bar(x + (i - 1) * w, [row[key] for row in rows], w, label=label)
    ax.set_xticks(x, [f"{row['tokens']} tok\n{row['bytes'] / 2**20:.0f} MiB" for row in rows])
    ax.set_ylabel("GB/s")
    for xi, row in zip(x, rows, strict=True):
        ax.annotate(f"eff {row['efficiency']:.2f}", (xi + w, row["daemon_gbps"]), ha="center", va="bottom",
                    fontsize=8)
    frag = "fragmented" if r.data.get("fragmented") else "contiguous"
    ax.set_title(f"kvpushd bench ceiling ({frag} blocks; target efficiency >= {r.data['target_efficiency']})")
    ax.legend(fontsize=8)
    return [_save(fig, outdir / "ceiling.png")]


def _critical_path(r: Result, outdir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    s = r.samples
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _cdf(ax, s.get("publish_to_landed_us", []), "(a) Publish -> first byte landed")
    _cdf(ax, s.get("daemon_post_us", []), "daemon: WRITE queued -> posted")
    _cdf(ax, s.get("landed_to_told_us", []), "(b) last byte landed -> decode worker told")
    ax.axvline(r.data["target_p99_us"], color="red", linestyle="--", label="target p99")
    ax.set_xscale("log")
    ax.set_xlabel("microseconds")
    ax.set_ylabel("fraction of requests")
    ax.set_title("kvpushd bench critical-path")
    ax.legend(fontsize=8)
    return [_save(fig, outdir / "critical_path.png")]


def _engine_cost(r: Result, outdir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    s = r.samples
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _cdf(ax, s.get("prefill_step_us", []), "kvpushd prefill engine (Publish x B + completions)")
    _cdf(ax, s.get("decode_step_us", []), "kvpushd decode engine (Expect x B + completions)")
    _cdf(ax, s.get("inengine_step_us", []), "NIXL in the engine (prep + post + poll)")
    _cdf(ax, s.get("inengine_nopost_us", []), "NIXL in the engine, without transfer()")
    ax.axvline(r.data["target_p99_us"], color="red", linestyle="--", label="target p99")
    ax.set_xscale("log")
    ax.set_xlabel(f"microseconds per engine step (batch of {r.data['batch']})")
    ax.set_ylabel("fraction of steps")
    ax.set_title("kvpushd bench engine-cost")
    ax.legend(fontsize=8)
    return [_save(fig, outdir / "engine_cost.png")]


def _rate(r: Result, outdir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    s = r.samples
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    tl = s.get("timeline", [])
    if tl:
        t = np.arange(len(tl)) * s.get("bucket_s", 0.1)
        a1.plot(t, np.asarray(tl) / s.get("bucket_s", 0.1))
    a1.axhline(r.data["target_per_s"], color="red", linestyle="--", label="target")
    a1.set_xlabel("seconds")
    a1.set_ylabel("rendezvous completed per second")
    a1.legend(fontsize=8)
    _cdf(a2, s.get("latency_ms", []), "Expect+Publish -> both completions (ms)")
    a2.set_xscale("log")
    a2.set_xlabel("milliseconds")
    a2.set_ylabel("fraction of requests")
    a2.legend(fontsize=8)
    fig.suptitle(f"kvpushd bench rate (concurrency {r.data['concurrency']})")
    return [_save(fig, outdir / "rate.png")]


def _sweep(r: Result, outdir: Path) -> list[Path]:
    from .sweep import plot_sweep

    return plot_sweep(r, outdir)


def _vllm(r: Result, outdir: Path) -> list[Path]:
    return plot_vllm(r, outdir)


def _handover(r: Result, outdir: Path) -> list[Path]:
    """TTFT and forward end -> decode told against the prompt length, p50 with the p99 dashed, per mode."""
    import matplotlib.pyplot as plt

    rows = r.data["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = ((axes[0], "ttft_ms", "TTFT"), (axes[1], "handover_ms", "prefill forward end -> decode told"))
    for ax, key, title in panels:
        for mode in dict.fromkeys(row["mode"] for row in rows):
            pts = sorted((row["tokens"], row[key]["p50"], row[key]["p99"]) for row in rows if row["mode"] == mode)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{mode} p50")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], linestyle="--", color=line.get_color(), linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("ms (p99 dashed)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fab = r.data.get("fabric") or "loopback"

    def load(k: str) -> Any:
        v = r.data.get(k)
        return v.get("loadavg_1m", "?") if isinstance(v, dict) else v if v is not None else "?"
    fig.suptitle(f"kvpushd bench handover, one request at a time ({fab}; 1-min load {load('load_before')} -> "
                 f"{load('load_after')})", fontsize=9)
    return [_save(fig, outdir / "handover.png")]


_PLOTS: dict[str, Callable[[Result, Path], list[Path]]] = {
    "ceiling": _ceiling, "critical-path": _critical_path, "engine-cost": _engine_cost, "rate": _rate,
    "sweep": _sweep, "vllm": _vllm, "handover": _handover,
}


def main(argv: list[str] | None = None) -> int:
    """Plots of a saved ``--json`` result (suites that plot from the JSON: handover, vllm):
    ``python -m kvpushd_lab.bench.plots RESULT.json DIR [--stem NAME]``."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=(main.__doc__ or "").splitlines()[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--stem", default="", help="prefix the files' names with this")
    a = ap.parse_args(argv)
    data = json.loads(a.json.read_text())
    suite = data.pop("suite", "")
    if suite not in ("handover", "vllm"):
        raise SystemExit(f"{a.json}: suite {suite!r}; plots from saved JSON: handover, vllm")
    for path in plot(Result(suite, data), a.outdir):
        if a.stem:
            path = path.rename(path.with_name(f"{a.stem}-{path.name}"))
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def plot_vllm(r: Result, outdir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    lens = r.data["grid"]["prompt_lens"]
    fig, axes = plt.subplots(1, len(lens), figsize=(5.5 * len(lens), 4.2), squeeze=False)
    for ax, plen in zip(axes[0], lens, strict=True):
        for name, c in r.data["configs"].items():
            pts = sorted((x["qps"], x["ttft_ms"]["p50"], x["ttft_ms"]["p99"]) for x in c.get("cells", {}).values()
                         if x["prompt_len"] == plen and x["completed"])
            if pts:
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{name} p50")
                ax.plot([p[0] for p in pts], [p[2] for p in pts], linestyle="--", color=line.get_color(),
                        label=f"{name} p99")
        ax.set_yscale("log")
        ax.set_title(f"prompt {plen} tokens")
        ax.set_xlabel("QPS (Poisson)")
        ax.set_ylabel("TTFT ms (client, through the proxy)")
        ax.legend(fontsize=7)
    ld = r.data.get("load", {})
    fig.suptitle("kvpushd bench vllm: real vLLM engines on 2 CPU cores, one configuration at a time (1-min load "
                 f"{ld.get('before', {}).get('loadavg_1m', '?')} before, {ld.get('after', {}).get('loadavg_1m', '?')} "
                 "after)", fontsize=9)
    fig.tight_layout()
    outdir.mkdir(parents=True, exist_ok=True)
    paths = [outdir / "vllm-bench-ttft.png", outdir / "vllm-bench-idle-cpu.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    names = list(r.data["configs"])
    trees = ("prefill", "decode", "daemons")
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, t in enumerate(trees):
        vals = []
        for n in names:
            per = r.data["configs"][n].get("idle_cpu_pct", {}).get("per_tree", {})
            daemons = sum(v for k, v in per.items() if k.startswith("daemon-"))
            vals.append(daemons if t == "daemons" else per.get(t, 0.0))
        ax.bar([x + (i - 1) * 0.27 for x in range(len(names))], vals, 0.27, label=f"{t} (all its processes)")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("idle CPU, % of one core")
    ax.set_title("engines up, no requests", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths
