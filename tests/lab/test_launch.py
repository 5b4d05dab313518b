"""The one daemon launcher (kvpushd_lab.launch): its config, and a daemon that cannot start."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from kvpushd_lab import launch

from kvpushd import config


def test_config_merges_settings_into_sections_and_loads(tmp_path: Path) -> None:
    text = launch.daemon_config("n1", str(tmp_path / "n1.sock"), "127.0.0.1:0", "127.0.0.1",
                                {"peer_api": {"connect_timeout_s": 2.0}, "transfer": {"publish_timeout_s": 3.0}},
                                extra='[log]\nlevel = "debug"\n')
    data = tomllib.loads(text)
    assert data["node"] == {"node_id": "n1", "advertise_host": "127.0.0.1"}
    assert data["peer_api"] == {"listen": "127.0.0.1:0", "connect_timeout_s": 2.0}
    assert data["transfer"] == {"publish_timeout_s": 3.0} and data["log"] == {"level": "debug"}
    f = tmp_path / "n1.toml"
    f.write_text(text)
    cfg = config.load(str(f))  # the daemon accepts what the launcher writes
    assert cfg.node.node_id == "n1" and cfg.transfer.publish_timeout_s == 3.0


def test_a_daemon_that_cannot_start_raises_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(launch.DaemonStartError, match="did not start"):
        launch.start(tmp_path, "bad", extra_config="[transfer]\npublish_timeout_s = -1.0\n", timeout_s=60)


def test_start_stop_restart(tmp_path: Path) -> None:
    d = launch.start(tmp_path, "again", settings={"metrics": {"listen": "127.0.0.1:0"}})
    try:
        assert d.client.status().node_id == "again" and d.peer_address.startswith("127.0.0.1:")
        assert d.stop() == 0
        d.restart()
        launch.wait_ready(d)
        assert d.client.status().node_id == "again"
        assert d.logs().count("kvpushd ready") == 2  # one log, appended to
    finally:
        assert launch.stop_all([d]) == {"again": 0}


@pytest.mark.parametrize("extra", ["", "[node]\nnode_id = \"n\"", "[transfer]\nmax_pending = 7\n"])
def test_with_backend_names_the_backend_once_wherever_the_config_has_it(extra: str) -> None:
    """In the raw TOML's [transfer] table when it has one, else in the settings, else (no settings)
    in a [transfer] table added to the raw TOML: the result always parses, with one backends key."""
    from kvpushd_lab.backend import with_backend

    for settings in (None, {"transfer": {"poll_interval_s": 0.001}}):
        got, toml = with_backend(settings, extra, "LIBFABRIC")
        parsed = tomllib.loads(toml)
        in_toml = parsed.get("transfer", {}).get("backends")
        in_settings = got.get("transfer", {}).get("backends")
        assert [in_toml, in_settings].count(["LIBFABRIC"]) == 1, (settings, extra, toml, got)
        assert in_toml == ["LIBFABRIC"] or settings is not None
