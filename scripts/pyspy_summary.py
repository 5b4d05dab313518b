"""Summarise py-spy raw (collapsed) profiles: share of samples per thread, by own time, and inclusive
time of kvpushd's own functions.

    py-spy record -p PID -d 10 -r 200 --threads [--gil] --format raw -o OUT.txt
    python scripts/pyspy_summary.py OUT.txt [OUT2.txt ...] [--top 20]

Percentages are of the samples in the file (py-spy leaves idle threads out unless --idle is given,
so they are shares of the time some thread of that process ran Python or native code it called).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

_FRAME = re.compile(r"(?P<fn>\S+) \((?P<file>[^:)]+)(?::\d+)?\)")
_OURS = ("kvpushd/", "kvpushd_client/", "kvpushd_lab/")


def summary(path: str, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            line = line.rstrip()
            if not line or " " not in line:
                continue
            stack, count = line.rsplit(" ", 1)
            n = int(count)
            frames = stack.split(";")
            total += n
            threads[re.sub(r"\(\d+\)", "", frames[0])] += n
            own[frames[-1]] += n
            seen = set()
            for fr in frames[1:]:
                m = _FRAME.match(fr)
                if m is None or not any(o in m["file"] for o in _OURS):
                    continue
                key = f"{m['fn']} ({m['file'].split('site-packages/')[-1]})"
                if key not in seen:
                    seen.add(key)
                    incl[key] += n
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
