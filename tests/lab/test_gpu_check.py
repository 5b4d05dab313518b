"""The CPU half of the GPU check (scripts/gpu_check.sh): the bundle a registry-less GPU machine gets is
under what travels (64 MiB with the checkout), its command under 2,000 characters, the repacked nixl-cu13
imports and moves bytes here where a Python 3.12 is at hand, and the run half skips its GPU parts
cleanly without a GPU. Prepare needs PyPI; downloads are cached in .whl/cache (ignored) between runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_run_half_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.fixture(scope="module")
def prepared() -> dict:
    r = subprocess.run(["bash", str(SCRIPT), "prepare"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stdout
    return json.loads(lines[0])


def test_prepare_fits_what_travels(prepared: dict) -> None:
    out = prepared
    assert set(out) >= {"bundle_dir", "bundle_bytes", "tree_bytes", "command", "carry"}
    assert out["tree_bytes"] < 64 << 20 and out["bundle_bytes"] < out["tree_bytes"]
    assert len(out["command"]) <= 2000
    assert out["carry"] == [out["bundle_dir"]] and len(out["carry"]) <= 8
    bundle = ROOT / out["bundle_dir"]
    names = {p.name.split("-")[0].lower() for p in bundle.glob("*.whl")}
    assert {"nixl", "nixl_cu13", "structlog", "grpcio_health_checking", "grpcio_reflection", "msgspec"} <= names
    assert "torch" not in names and "numpy" not in names  # the GPU machine has them
    assert sum(p.stat().st_size for p in bundle.glob("*.whl")) == out["bundle_bytes"]
    assert "--no-index" in out["command"] and "gpu_check.sh run $OUT" in out["command"]
    # git ignores the bundle: it travels only because it is carried
    ignored = subprocess.run(["git", "check-ignore", "-q", out["bundle_dir"]], cwd=ROOT)
    assert ignored.returncode == 0


def test_repacked_nixl_has_no_expert_parallel_modules_and_a_true_record(prepared: dict) -> None:
    import zipfile

    whl = next((ROOT / prepared["bundle_dir"]).glob("nixl_cu13-*.whl"))
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        assert not any(n.startswith("nixl_ep_cu13/") for n in names)
        assert any(n.startswith("nixl_cu13/") for n in names)
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        listed = {ln.rsplit(",", 2)[0] for ln in z.read(record).decode().splitlines() if ln}
        assert listed == names
    check = prepared["nixl_check"]
    # moved bytes with the repacked wheel here, unless this machine has no Python 3.12 to import it with
    assert (check["verified"] and check["bytes_ok"]) or check["why"].startswith("no Python 3.12 here"), check


def test_run_half_skips_gpu_parts_without_a_gpu(tmp_path: Path) -> None:
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is here: the run half would run the GPU parts")
    except ImportError:
        pass
    r = subprocess.run(["bash", str(SCRIPT), "run", str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "no CUDA GPU visible" in r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["gpu"] is False and line["ok"] and "skipped" in line
    assert line["gpu_tests_collect_rc"] == 0  # the GPU tests import and collect here
    collected = (tmp_path / "out" / "pytest.log").read_text()
    assert "test_vmm_gpu.py::test_vmm_chunks_by_fd_push_growth_and_restore" in collected  # the VMM path too
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(files) <= 8 and "gpu-check.json" in files
    assert json.loads((tmp_path / "out" / "gpu-check.json").read_text()) == line
