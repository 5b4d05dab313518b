"""Side-by-side figures of source trees: a base, a tree under test and a same-code control.

    python scripts/measure_tree.py --base /work/wt-base --control /work/wt-control --tree /work/main \
        --rounds 4 --json

For each tree, each run from its own directory with PYTHONPATH=TREE:TREE/client:TREE/lab and its own
``kvpushd bench rate`` (flags its ``--help`` lacks are left out):

1. Python calls per rendezvous: one short ``bench rate`` with the ``sitecustomize.py`` below first on
   the daemons' PYTHONPATH. It starts cProfile in each daemon's main thread (the event loop; other
   threads are not profiled), forgets what came before the worker socket appeared (imports, startup)
   and dumps the profile before the daemon's ``os._exit``. Calls (cProfile's, builtins included) are
   divided by the Publishes the prefill daemon took (calls of ``--publish-fn``) and the Expects the
   decode daemon took (``--expect-fn``): warm-up and drain are in both numerator and denominator.
2. Bookkeeping calls per push: the calls, in the same profiles, to functions matching BOOKKEEPING
   (``module:function``, fnmatch; a module or function that no longer exists counts 0), per Publish
   on the prefill daemon and per Expect on the decode daemon, with the per-function breakdown; and
   the issue's own measure, emits and sink calls: calls of EMITS from outside their own module and
   the calls SINK_CALLERS (the observation stream's emit, the event hub's publishing) make to
   functions (not builtins).
3. ``bench rate --json``: rendezvous/s and daemon CPU us per rendezvous (prefill + decode), rounds
   alternating with the order rotated each round; per-round ratios to the base and their medians first.
4. Product lines: lines of *.py under kvpushd/ and client/ (no *_pb2*) at the tree's HEAD commit.
5. Functions with 9+ parameters (self/cls not counted) in the same files.

Figures 4 and 5 read the committed files (git show), not the working tree; ``dirty`` says if they differ.
Every bench run records the 1-minute load average beside its figures.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BOOKKEEPING = (
    "kvpushd.events:*", "kvpushd.runtime.observe:*", "kvpushd.runtime.sinks:*", "kvpushd.runtime.tally:*",
    "kvpushd.runtime.figures:*", "kvpushd.runtime.ledger:*", "kvpushd.core.ledger:*", "kvpushd.metrics:*",
)
# The issue's own measure: emits (onto the observation stream or the event hub) and the sink calls
# they make (functions called by Observations.emit or by the hub's publishing, its listeners).
EMITS = ("kvpushd.runtime.observe:emit", "kvpushd.events:emit", "kvpushd.events:transfer",
         "kvpushd.events:annotate", "kvpushd.events:remember")
SINK_CALLERS = ("kvpushd.runtime.observe:emit", "kvpushd.events:_publish")
PRODUCT_DIRS = ("kvpushd", "client")

SITE = '''\
import os
if os.environ.get("MEASURE_PROF_DIR"):
    _argv = open("/proc/self/cmdline", "rb").read().split(b"\\0")
    if b"serve" in _argv and b"--config" in _argv:
        import cProfile, threading, time, tomllib
        _cfg = _argv[_argv.index(b"--config") + 1].decode()
        _out = os.path.join(os.environ["MEASURE_PROF_DIR"], os.path.basename(_cfg).rsplit(".", 1)[0])
        _prof = cProfile.Profile()
        _prof.enable()

        def _arm():  # forget startup: clear once the worker socket exists (GIL: no callback runs meanwhile)
            with open(_cfg, "rb") as f:
                sock = tomllib.load(f)["worker_api"]["socket"]
            while not os.path.exists(sock):
                time.sleep(0.02)
            _prof.clear()
            open(_out + ".armed", "w").close()

        threading.Thread(target=_arm, daemon=True).start()
        _exit = os._exit

        def _dump_exit(code):
            _prof.disable()
            _prof.dump_stats(_out + ".prof")
            _exit(code)

        os._exit = _dump_exit
'''


def log(msg: str) -> None:
    print(f"measure_tree: {msg}", file=sys.stderr, flush=True)


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def bench_rate(python: str, tree: Path, seconds: float, site: Path | None = None) -> dict[str, Any]:
    """One ``kvpushd bench rate --json`` of ``tree``, run from its directory; ``site``: the profiling one."""
    paths = [str(site)] if site else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, str(tree), str(tree / "client"), str(tree / "lab")])}
    if site:
        env["MEASURE_PROF_DIR"] = str(site)
    base = [python, "-m", "kvpushd", "bench", "rate"]
    helptext = subprocess.run([*base, "--help"], cwd=tree, env=env, capture_output=True, text=True).stdout
    argv = [*base, "--json"] + (["--seconds", str(seconds)] if "--seconds" in helptext else [])
    before = load1()
    p = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(argv)} in {tree} exited {p.returncode}:\n{p.stderr[-3000:]}")
    data: dict[str, Any] = json.loads(lines[-1])
    cpu = data.get("cpu_us_per_rendezvous", {})
    return {"rate_per_s": data["rate_per_s"], "failed": data.get("failed", 0),
            "cpu_us_prefill": cpu.get("prefill daemon"), "cpu_us_decode": cpu.get("decode daemon"),
            "cpu_us_daemons": round(cpu.get("prefill daemon", 0) + cpu.get("decode daemon", 0), 1),
            "load_before": before, "load_after": load1()}


def module_of(filename: str, tree: Path) -> str | None:
    """``kvpushd.runtime.sinks`` for TREE/kvpushd/runtime/sinks.py; None outside the tree's packages."""
    m = re.search(r"(?:^|/)((?:kvpushd|kvpushd_client|kvpushd_lab)/.*)\.py$", filename)
    if m is None:
        return None
    if not os.path.abspath(filename).startswith(str(tree) + os.sep):
        return "FOREIGN:" + filename  # a kvpushd module from another tree: the wrong code was measured
    return m.group(1).replace("/", ".").removesuffix(".__init__")


def read_profile(path: Path, tree: Path, count_fn: str, patterns: list[str]) -> dict[str, Any]:
    """Calls per counted call (Publish or Expect) in one daemon's profile, and the bookkeeping's."""
    stats: dict[Any, Any] = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    total, count = 0, 0
    book: dict[str, int] = {}
    emits: dict[str, int] = {}
    foreign: set[str] = set()
    names = {k: f"{module_of(k[0], tree)}:{k[2]}" for k in stats}
    for key, (_cc, _nc, _tt, _ct, callers) in stats.items():
        name = names[key]
        own = name.split(":")[0]
        for caller, (_c, n, *_rest) in callers.items():
            by = names.get(caller) or ""
            if name in EMITS and not by.startswith(own + ":"):  # an emit from outside: not a sink's own work
                emits[name] = emits.get(name, 0) + n
            if by in SINK_CALLERS and not name.startswith("None:"):  # builtins: the emit's own work
                emits[f"sink {name}"] = emits.get(f"sink {name}", 0) + n
    for (fname, line, func), (_cc, nc, _tt, _ct, _callers) in stats.items():
        total += nc
        mod = module_of(fname, tree)
        if mod is None:
            continue
        if mod.startswith("FOREIGN:"):
            foreign.add(mod[8:])
            continue
        name = f"{mod}:{func}"
        if fnmatch.fnmatchcase(name, count_fn):
            count += nc
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            book[f"{name}:{line}"] = book.get(f"{name}:{line}", 0) + nc
    per = (lambda n: round(n / count, 3)) if count else (lambda n: None)
    return {"counted": count_fn, "count": count, "calls": total, "calls_per": per(total),
            "bookkeeping_per": per(sum(book.values())), "emits_and_sinks_per": per(sum(emits.values())),
            "emits_and_sinks_by_function": {k: per(v) for k, v in sorted(emits.items(), key=lambda kv: -kv[1])},
            "bookkeeping_by_function": {k: per(v) for k, v in sorted(book.items(), key=lambda kv: -kv[1])},
            "foreign_files": sorted(foreign)}


def profile_tree(python: str, tree: Path, seconds: float, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="measure-prof-") as d:
        site = Path(d)
        (site / "sitecustomize.py").write_text(SITE)
        run = bench_rate(python, tree, seconds, site)
        armed = sorted(p.stem for p in site.glob("*.armed"))
        out: dict[str, Any] = {"bench": run, "armed": armed}
        for side, name, fn in (("prefill", "bench-pnode", args.publish_fn), ("decode", "bench-dnode", args.expect_fn)):
            prof = site / f"{name}.prof"
            out[side] = read_profile(prof, tree, fn, args.pattern) if prof.exists() else {"error": f"no {prof.name}"}
    return out


def product_files(tree: Path) -> tuple[str, dict[str, str], bool]:
    """HEAD's commit, its *.py under PRODUCT_DIRS (no *_pb2*) as path -> text, and whether the tree differs."""
    git = ["git", "-C", str(tree)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    names = subprocess.run([*git, "ls-tree", "-r", "--name-only", commit, "--", *PRODUCT_DIRS],
                           capture_output=True, text=True, check=True).stdout.split()
    files = {}
    for n in names:
        if n.endswith(".py") and "_pb2" not in n.rsplit("/", 1)[-1]:
            files[n] = subprocess.run([*git, "show", f"{commit}:{n}"], capture_output=True, text=True,
                                      check=True).stdout
    dirty = bool(subprocess.run([*git, "status", "--porcelain", "--", *PRODUCT_DIRS], capture_output=True,
                                text=True).stdout.strip())
    return commit, files, dirty


def many_params(files: dict[str, str], limit: int = 9) -> list[str]:
    """Functions with ``limit`` or more parameters (self/cls not counted): 'path:line name count'."""
    out = []
    for path, text in files.items():
        for f in ast.walk(ast.parse(text)):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = f.args
                k = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                if a.args and a.args[0].arg in ("self", "cls"):
                    k -= 1
                if k >= limit:
                    out.append(f"{path}:{f.lineno} {f.name} {k}")
    return sorted(out)


def code_figures(tree: Path) -> dict[str, Any]:
    commit, files, dirty = product_files(tree)
    params = many_params(files)
    return {"commit": commit[:12], "dirty": dirty, "files": len(files),
            "lines": sum(len(t.splitlines()) for t in files.values()),
            "functions_9plus_params": len(params), "functions_9plus_list": params}


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def rate_rounds(python: str, trees: dict[str, Path], rounds: int, seconds: float) -> dict[str, Any]:
    names = list(trees)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            runs[n].append(bench_rate(python, trees[n], seconds))
            log(f"rate round {r + 1}/{rounds} {n}: {runs[n][-1]}")
    keys = ("rate_per_s", "cpu_us_daemons", "cpu_us_prefill", "cpu_us_decode")
    ratios = {n: {k: [round(a[k] / b[k], 3) if a[k] and b[k] else None
                      for a, b in zip(runs[n], runs["base"], strict=True)] for k in keys}
              for n in names if n != "base"}
    return {
        "ratio_medians": {n: {k: median([x for x in v if x]) for k, v in rs.items()} for n, rs in ratios.items()},
        "ratios_per_round": ratios,
        "medians": {n: {k: median([x[k] for x in rs if x[k] is not None]) for k in keys} for n, rs in runs.items()},
        "runs": runs,
    }


def summary(res: dict[str, Any]) -> list[str]:
    """A table: each figure per tree, and each / base."""
    names = list(res["trees"])
    rows: list[tuple[str, list[Any]]] = []
    for side, what in (("prefill", "per Publish"), ("decode", "per Expect")):
        for key, label in (("calls_per", "Python calls"), ("bookkeeping_per", "bookkeeping calls"),
                           ("emits_and_sinks_per", "emits and sink calls")):
            rows.append((f"{label} {what} ({side} daemon)",
                         [res["profile"][n][side].get(key) for n in names] if "profile" in res else []))
    if "rate" in res:
        for key, label in (("rate_per_s", "rendezvous/s (median)"), ("cpu_us_daemons", "daemon CPU us/rendezvous")):
            rows.append((label, [res["rate"]["medians"][n][key] for n in names]))
    for key, label in (("lines", "product lines"), ("functions_9plus_params", "functions with 9+ params")):
        rows.append((label, [res["code"][n][key] for n in names]))
    out = [f"{'figure':44}" + "".join(f"{n:>12}" for n in names) + "".join(f"{n + '/base':>16}" for n in names[1:])]
    for label, vals in rows:
        if not vals:
            continue
        b = vals[0]
        out.append(f"{label:44}" + "".join(f"{v if v is not None else '-':>12}" for v in vals)
                   + "".join(f"{round(v / b, 3) if v and b else '-':>16}" for v in vals[1:]))
    if "rate" in res:
        out.insert(0, "rate: median of per-round ratios to base: " + json.dumps(res["rate"]["ratio_medians"]))
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="base tree (ratios are to it)")
    ap.add_argument("--tree", type=Path, required=True, help="tree under test")
    ap.add_argument("--control", type=Path, help="a second checkout of the base (same code)")
    ap.add_argument("--rounds", type=int, default=4, help="alternating bench rate rounds (0: none)")
    ap.add_argument("--seconds", type=float, default=5.0, help="bench rate --seconds per round")
    ap.add_argument("--profile-seconds", type=float, default=3.0,
                    help="bench rate --seconds of the profiled run (0: none)")
    ap.add_argument("--publish-fn", default="kvpushd.runtime.node:publish", help="module:function taking one Publish")
    ap.add_argument("--expect-fn", default="kvpushd.runtime.node:expect", help="module:function taking one Expect")
    ap.add_argument("--pattern", action="append", help=f"bookkeeping pattern (repeatable; default {BOOKKEEPING})")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the benches (default: this one)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (else a table)")
    args = ap.parse_args(argv)
    args.pattern = args.pattern or list(BOOKKEEPING)
    trees = {"base": args.base.resolve(), "tree": args.tree.resolve()}
    if args.control:
        trees = {"base": trees["base"], "control": args.control.resolve(), "tree": trees["tree"]}
    res: dict[str, Any] = {"trees": {n: str(t) for n, t in trees.items()}, "bookkeeping_patterns": args.pattern,
                           "load_start": load1(), "code": {n: code_figures(t) for n, t in trees.items()}}
    if args.profile_seconds > 0:
        res["profile"] = {}
        for n, t in trees.items():
            log(f"profiling {n} ({t})")
            res["profile"][n] = profile_tree(args.python, t, args.profile_seconds, args)
    if args.rounds > 0:
        res["rate"] = rate_rounds(args.python, trees, args.rounds, args.seconds)
    res["load_end"] = load1()
    if args.json:
        print(json.dumps(res))
        return 0
    print("\n".join(summary(res)))
    print(f"bookkeeping patterns: {args.pattern}\nload (1 min) start {res['load_start']}, end {res['load_end']}")
    for n in res.get("profile", {}):
        for side in ("prefill", "decode"):
            p = res["profile"][n][side]
            print(f"{n} {side}: {p.get('count')} of {p.get('counted')}; bookkeeping per call of it: "
                  + json.dumps({k: v for k, v in p.get("bookkeeping_by_function", {}).items() if v and v >= 0.01}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
