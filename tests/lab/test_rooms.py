"""File sizes of the hand-written code (kvpushd/, client/, lab/, scripts/): one idea per file. No file
is over 800 lines, and a file is over 500 only when it holds one state machine or one table, named in
LONG with the reason. Never squeeze lines or split one object across files to meet these numbers."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("kvpushd", "client", "lab", "scripts")
MAX_LINES = 800
LONG_FROM = 500
# file -> why it may be long (one state machine or one table)
LONG: dict[str, str] = {
    "kvpushd/core/send.py": "SendSide: the send side's state machine (legs, publishes, registrations) in one object",
    "kvpushd/runtime/node.py": ("Node: the one driver of the core: every event (a worker's or a peer's command, "
                                "the NIXL thread's reports, a peer's answer, the timer) goes in and every action "
                                "comes out (the action table) in one object"),
    "kvpushd/transfer/thread.py": ("TransferThread: the one owner of every NIXL call, the state of the transfers in "
                                   "flight (posted, polled, cancelled, drained) in one object"),
}


def _hand_written() -> dict[str, int]:
    out: dict[str, int] = {}
    for tree in TREES:
        for p in (ROOT / tree).rglob("*.py"):
            rel = p.relative_to(ROOT)
            if "_pb2" in p.name or "proto" in rel.parts or any(s.startswith(".") or s == "build" for s in rel.parts):
                continue
            out[rel.as_posix()] = len(p.read_text(encoding="utf-8").splitlines())
    return out


def test_no_file_over_800_lines() -> None:
    sizes = _hand_written()
    assert sizes
    over = {f: n for f, n in sizes.items() if n > MAX_LINES}
    assert not over, f"over {MAX_LINES} lines (split by idea, not by line count): {over}"


def test_files_over_500_lines_are_one_state_machine_or_one_table() -> None:
    over = {f: n for f, n in _hand_written().items() if n > LONG_FROM and f not in LONG}
    assert not over, (f"over {LONG_FROM} lines and not in LONG (one state machine or one table, with its reason; "
                      f"else split it by idea): {over}")


def test_every_long_file_named_exists_with_a_reason() -> None:
    for f, why in LONG.items():
        assert (ROOT / f).is_file(), f"LONG names {f}, which is gone"
        assert why.strip(), f
