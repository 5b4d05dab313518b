"""Config: every key has a default, typos and bad values fail loudly at load."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvpushd import config
from kvpushd.core.errors import InvalidArgument

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_are_usable() -> None:
    cfg = config.load(None)
    assert cfg.transfer.backends == ("UCX",)
    assert cfg.listen_host_port == ("0.0.0.0", 7700)
    assert cfg.socket_path.endswith("worker.sock")
    assert cfg.node_id


def test_shipped_config_file_loads() -> None:
    data = tomllib.loads((ROOT / "systemd" / "kvpushd.toml").read_text())
    cfg = config.from_dict(data)
    assert cfg.worker_api.socket == "/run/kvpushd/worker.sock"
    assert cfg.worker_api.socket_mode == 0o660


@pytest.mark.parametrize("data, words", [
    ({"nope": {}}, "unknown section"),
    ({"transfer": {"backend": ["UCX"]}}, "unknown key transfer.backend"),
    ({"transfer": {"backends": "UCX"}}, "list of strings"),
    ({"transfer": {"backends": []}}, "at least one"),
    ({"transfer": {"publish_timeout_s": -1}}, "positive"),
    ({"transfer": {"expect_timeout_s": "10"}}, "number"),
    ({"peer_api": {"listen": "7700"}}, "host:port"),
    ({"worker_api": {"socket_mode": 0o1777}}, "permission bits"),
    ({"log": {"level": "loud"}}, "log.level"),
    ({"log": {"format": "xml"}}, "log.format"),
])
def test_bad_config(data: dict, words: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidArgument, match=words):
        config.from_dict(data)


def test_serve_rejects_bad_config_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[transfer]\npublish_timeout_s = 0\n")
    r = subprocess.run([sys.executable, "-m", "kvpushd", "serve", "--config", str(f)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "publish_timeout_s must be positive" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvpushd", "serve", "--config", str(tmp_path / "missing.toml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "does not exist" in r.stderr
