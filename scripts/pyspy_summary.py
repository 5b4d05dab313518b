"""Summarise py-spy raw (collapsed) profiles: share of samples per thread, by own time, and inclusive
time of kvpushd's own functions.

    py-spy record -p PID -d 10 -r 200 --threads [--gil] --format raw -o OUT.txt
    python scripts/pyspy_summary.py OUT.txt [OUT2.txt ...] [--top 20]

Percentages are of the samples in the file (py-spy leaves idle threads out unless --idle is given,
so they are shares of the time some thread of that process ran Python or native code it called).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"(?P<fn>\S+) \((?P<file>[^:)]+)(?::\d+)?\)")
_OURS = ("kvpushd/", "kvpushd_client/", "kvpushd_lab/")


def read(path: str | Path) -> tuple[int, Counter[str], Counter[str], Counter[str]]:
    """(samples, samples per thread, own time per leaf frame, inclusive time per function of ours)."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        threads[re.sub(r"\(\d+\)", "", frames[0])] += n
        own[frames[-1].strip()] += n
        seen = set()
        for fr in frames[1:]:
            m = _FRAME.match(fr)
            if m is None or not any(o in m["file"] for o in _OURS):
                continue
            key = f"{m['fn']} ({m['file'].split('site-packages/')[-1]})"
            if key not in seen:
                seen.add(key)
                incl[key] += n
    return total, threads, own, incl


def top_self(path: str | Path, n: int = 15) -> list[tuple[str, float]]:
    """Own time by function (the leaf frame of each stack), as percentages of all samples."""
    total, _, own, _ = read(path)
    return [(f, round(100 * c / max(total, 1), 1)) for f, c in own.most_common(n)]


def summary(path: str, top: int) -> str:
    total, threads, own, incl = read(path)
    if total == 0:
        return f"== {path}: no samples\n"
    out = [f"== {path}: {total} samples", "-- threads"]
    out += [f"  {100 * c / total:5.1f}%  {t}" for t, c in threads.most_common(8)]
    out.append("-- own time")
    out += [f"  {100 * c / total:5.1f}%  {k[:120]}" for k, c in own.most_common(top)]
    out.append("-- inclusive, kvpushd code")
    out += [f"  {100 * c / total:5.1f}%  {k[:120]}" for k, c in incl.most_common(top)]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--top", type=int, default=20)
    a = p.parse_args(argv)
    for path in a.files:
        sys.stdout.write(summary(path, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
