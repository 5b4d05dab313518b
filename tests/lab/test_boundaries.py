"""The daemon and the lab stay apart: nothing in kvpushd/ or client/ imports the lab, the lab's old
module paths inside the daemon are gone, and the daemon installs and imports without torch."""

from __future__ import annotations

import ast
import importlib.machinery
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OLD = ["kvpushd.demo", "kvpushd.refengine", "kvpushd.bench", "kvpushd.netns"]


def _lab_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                  if n == "kvpushd_lab" or n.startswith("kvpushd_lab.") or n in OLD or n.startswith(tuple(
                      o + "." for o in OLD))]
    return found


def test_nothing_outside_the_lab_imports_it() -> None:
    files = sorted((ROOT / "kvpushd").rglob("*.py")) + sorted((ROOT / "client").rglob("*.py"))
    assert files
    bad = [hit for f in files for hit in _lab_imports(f)]
    assert not bad, "the daemon and the client must not import the lab:\n" + "\n".join(bad)


def test_old_lab_paths_in_the_daemon_are_gone() -> None:
    for rel in ("kvpushd/demo.py", "kvpushd/refengine", "kvpushd/bench", "kvpushd/netns.py"):
        assert not (ROOT / rel).exists(), rel
    import kvpushd

    for mod in OLD:  # looked up in the package's own path (an editable install's finder may know older files)
        assert importlib.machinery.PathFinder.find_spec(mod.rsplit(".", 1)[1], list(kvpushd.__path__)) is None, mod


def test_torch_is_not_a_daemon_dependency() -> None:
    daemon = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in daemon["dependencies"] if d.lower().startswith("torch")]
    assert any(d.startswith("torch") for d in daemon["optional-dependencies"]["cuda"])
    lab = tomllib.loads((ROOT / "lab" / "pyproject.toml").read_text())["project"]
    assert lab["name"] == "kvpushd-lab"
    assert any(d.startswith("torch") for d in lab["dependencies"])
    assert lab["entry-points"]["kvpushd.commands"] == {"lab": "kvpushd_lab.commands:register"}


CHECK = """
import json, sys
import kvpushd.app, kvpushd.cli, kvpushd.ctl, kvpushd.transfer.thread, kvpushd.memory.cuda
try:
    kvpushd.cli.main(["serve", "--help"])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "kvpushd_lab"))))
"""


def test_the_daemon_imports_neither_torch_nor_the_lab() -> None:
    """The whole daemon and `kvpushd serve`'s argument parsing load no torch and no lab module (CUDA IPC,
    kvpushd/memory/cuda.py, imports torch when a GPU worker attaches). Not checked here: nixl itself
    imports torch.version where torch is installed; without torch it runs all the same."""
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == []


@pytest.mark.parametrize("cmd", ["demo", "bench"])
def test_lab_commands_without_the_lab_say_what_to_install(cmd: str) -> None:
    code = ("import sys; sys.modules['kvpushd_lab'] = None; "  # as if kvpushd-lab were not installed
            "from kvpushd.cli import main; raise SystemExit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, cmd, "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "kvpushd-lab" in r.stderr and "pip install" in r.stderr
