#!/usr/bin/env python3
"""The prepare half of ``scripts/gpu_check.sh``: the wheels a GPU machine without a package registry lacks.

The GPU machine this is made for: Python 3.12 on manylinux x86-64 with torch (CUDA 13), numpy, uvloop,
prometheus-client, pytest and many more (GPU_HAS), and no network. Into ``.whl/gpu`` (ignored by git):

* nixl 1.5.1 (the import shim) and nixl-cu13 1.5.1 repacked without ``nixl_ep_cu13`` (expert-parallel
  kernels for three torch versions, 27 MiB compressed, never imported by kvpushd) and the C++ headers,
  its RECORD rewritten to match; before it is trusted, the repacked wheel is installed into a scratch
  folder and two NIXL agents move bytes with it over UCX here (needs a Python 3.12 here: PYTHON312,
  python3.12 on PATH or pyenv; without one the JSON says ``"verified": false`` and why);
* everything else the daemon needs that the machine lacks: ``pip download`` resolves the daemon's and
  the client's requirements (pinned to the versions installed here, where they are) for that platform,
  and what the GPU machine already has is dropped, except grpcio and protobuf: the generated code needs
  the versions it was generated with, whatever the machine holds.

kvpushd and kvpushd-client travel as the checkout (PYTHONPATH), not as wheels. Downloads are cached in
``.whl/cache``; a second run only re-resolves. Prints ONE JSON line: bundle_dir, bundle_bytes, tree_bytes
(the checkout's tracked and unignored files plus the bundle: what travels), command, carry, and details.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NIXL_VERSION = "1.5.1"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
DROP_FROM_NIXL = ("nixl_ep_cu13/", f"nixl_cu13-{NIXL_VERSION}.data/headers/")
# Python packages the GPU machine's image holds (its published list, 2026-11-17), normalised names.
GPU_HAS = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click cloudpickle filelock frozenlist fsspec h11 httpcore httpx idna iniconfig jinja2
markupsafe mpmath msgpack multidict networkx numpy packaging pillow pip pluggy prometheus-client propcache
protobuf psutil pygments pytest pytest-timeout pytest-xdist pyyaml requests rich setuptools six sympy
torch tqdm triton typing-extensions urllib3 uvloop wheel yarl zipp grpcio hypothesis sortedcontainers
""".split())  # noqa: SIM905
ALWAYS_CARRY = {"grpcio", "protobuf"}       # versions the generated code was made with
NOT_ON_PYPI = {"kvpushd", "kvpushd-client", "kvpushd-lab"}
EXTRA = ["msgspec"]                          # the daemon's configuration schema (about to be required)
COMMAND_MAX = 2000
TREE_MAX = 64 << 20


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[str]:
    """The daemon's and client's runtime requirements, pinned to what is installed here where it is."""
    reqs: list[str] = []
    for pp in (ROOT / "pyproject.toml", ROOT / "client" / "pyproject.toml"):
        reqs += tomllib.loads(pp.read_text())["project"]["dependencies"]
    reqs += EXTRA
    out: dict[str, str] = {}
    for r in reqs:
        name = norm(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0])
        if name in NOT_ON_PYPI or name.startswith("nixl") or (name in GPU_HAS and name not in ALWAYS_CARRY):
            continue
        try:
            out[name] = f"{name}=={md.version(name)}"
        except md.PackageNotFoundError:
            out[name] = r
    return sorted(out.values())


def pip_download(args: list[str], dest: Path) -> None:
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", *plat, "-d", str(dest), *args]
    subprocess.run(cmd, check=True)


def wheel_name(path: Path) -> str:
    return norm(path.name.split("-")[0])


def repack_nixl(src: Path, dest_dir: Path) -> Path:
    """nixl-cu13 without the modules kvpushd never imports; RECORD lists exactly what remains."""
    out = dest_dir / src.name
    stamp = dest_dir / (src.name + ".src-sha256")
    src_sha = hashlib.sha256(src.read_bytes()).hexdigest()
    if out.exists() and stamp.exists() and stamp.read_text() == src_sha:
        return out
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        kept: set[str] = set()
        for info in zin.infolist():
            if info.filename == record_name or info.filename.startswith(DROP_FROM_NIXL):
                continue
            zout.writestr(info, zin.read(info.filename), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            kept.add(info.filename)
        lines = zin.read(record_name).decode().splitlines()
        record = [ln for ln in lines if ln and ln.rsplit(",", 2)[0] in kept] + [f"{record_name},,"]
        zout.writestr(record_name, "\n".join(record) + "\n")
    stamp.write_text(src_sha)
    return out


MOVE_BYTES = r"""
import json, numpy as np, nixl, nixl._api as api
def agent(name):
    cfg = api.nixl_agent_config(backends=["UCX"])
    return api.nixl_agent(name, cfg)
a, b = agent("gpu-bundle-src"), agent("gpu-bundle-dst")
src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
dst = np.full(1 << 20, 0xA5, dtype=np.uint8)
a.register_memory(a.get_reg_descs([(src.ctypes.data, src.nbytes, 0, "")], "DRAM"))
b.register_memory(b.get_reg_descs([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM"))
peer = a.add_remote_agent(b.get_agent_metadata())
h = a.initialize_xfer("WRITE", a.get_xfer_descs([(src.ctypes.data, 4096 * 8, 0)], "DRAM"),
                      b.get_xfer_descs([(dst.ctypes.data + 4096, 4096 * 8, 0)], "DRAM"), peer, b"check")
a.transfer(h)
import time
t0 = time.monotonic(); notifs = {}
while time.monotonic() - t0 < 60:
    st = a.check_xfer_state(h)
    for k, v in b.get_new_notifs().items():
        notifs.setdefault(k, []).extend(v)
    if st == "DONE" and notifs:
        break
    if st == "ERR":
        raise SystemExit("WRITE failed")
ok = bool((dst[4096:4096 * 9] == src[:4096 * 8]).all() and (dst[:4096] == 0xA5).all()
          and (dst[4096 * 9:] == 0xA5).all())
print(json.dumps({"module": nixl._api.__name__ if hasattr(nixl._api, "__name__") else "",
                  "nixl_file": nixl.__file__, "bytes_ok": ok, "notif": sorted(notifs)}))
raise SystemExit(0 if ok and notifs else 1)
"""


def python312() -> str | None:
    for cand in (os.environ.get("PYTHON312"), shutil.which("python3.12"),
                 str(Path.home() / ".pyenv/versions/3.12.1/bin/python3.12")):
        if cand and Path(cand).exists():
            r = subprocess.run([cand, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                               capture_output=True, text=True)
            if r.stdout.strip() == "True":
                return cand
    return None


def verify(bundle: Path, cache: Path, nixl_wheels: list[Path]) -> dict[str, object]:
    """Install the repacked nixl into a scratch folder and move bytes between two UCX agents with it."""
    digest = hashlib.sha256(b"".join(hashlib.sha256(w.read_bytes()).digest() for w in nixl_wheels)).hexdigest()
    stamp = cache / "verified.json"
    if stamp.exists():
        old = json.loads(stamp.read_text())
        if old.get("digest") == digest:
            return {**old["result"], "cached": True}
    py = python312()
    if py is None:
        return {"verified": False, "why": "no Python 3.12 here (set PYTHON312) to import the cp312 wheel"}
    pip_download(["--no-deps", f"numpy=={md.version('numpy')}"], cache / "verify")
    with tempfile.TemporaryDirectory(prefix="kvpushd-gpu-bundle-") as tmp:
        wheels = [*map(str, nixl_wheels), *map(str, (cache / "verify").glob("numpy-*.whl"))]
        subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                        "--no-deps", "--no-compile", "--target", tmp, *wheels], check=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "UCX_"))}
        env.update(PYTHONPATH=tmp, UCX_TLS="tcp,self,sm", NIXL_LOG_LEVEL="WARN")
        r = subprocess.run([py, "-c", MOVE_BYTES], capture_output=True, text=True, env=env, cwd=tmp, timeout=180)
    if r.returncode:
        return {"verified": False, "why": f"repacked nixl-cu13 failed here (rc {r.returncode}): "
                                          f"{(r.stdout + r.stderr)[-800:]}"}
    got = json.loads(r.stdout.strip().splitlines()[-1])
    result = {"verified": True, "python": py, "moved": "32 KiB WRITE + notification between two UCX agents",
              **got}
    stamp.write_text(json.dumps({"digest": digest, "result": result}))
    return result


def tree_bytes(bundle: Path) -> int:
    """What travels: the checkout's tracked and unignored files, plus the bundle."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout.decode()
    total = 0
    for rel in filter(None, out.split("\0")):
        p = ROOT / rel
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total + sum(f.stat().st_size for f in bundle.glob("*.whl"))


def run_command(bundle_rel: str) -> str:
    return (f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
            f"--target /tmp/site {bundle_rel}/*.whl || exit 1; "
            "export PYTHONPATH=/tmp/site:$PWD:$PWD/client:$PWD/lab PYTHONUNBUFFERED=1; "
            "timeout 480 bash scripts/gpu_check.sh run $OUT")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".whl", help="ignored folder for the cache and the bundle (default .whl)")
    ap.add_argument("--no-verify", action="store_true", help="skip moving bytes with the repacked wheel here")
    a = ap.parse_args()
    base = (ROOT / a.dir).resolve()
    cache, bundle = base / "cache", base / "gpu"
    cache.mkdir(parents=True, exist_ok=True)
    bundle.mkdir(parents=True, exist_ok=True)
    reqs = requirements()
    pip_download(["--no-deps", f"nixl=={NIXL_VERSION}", f"nixl-cu13=={NIXL_VERSION}"], cache / "nixl")
    pip_download(reqs, cache / "deps")
    wanted: dict[str, Path] = {}
    for w in sorted((cache / "deps").glob("*.whl")):
        n = wheel_name(w)
        if n in GPU_HAS and n not in ALWAYS_CARRY:
            continue
        wanted[n] = w  # one version of each (sorted: the newest cached one wins)
    for old in bundle.glob("*.whl"):
        if old.name not in {w.name for w in wanted.values()} and not old.name.startswith("nixl"):
            old.unlink()
    for w in wanted.values():
        if not (bundle / w.name).exists():
            shutil.copy2(w, bundle / w.name)
    shim = next((cache / "nixl").glob(f"nixl-{NIXL_VERSION}-*.whl"))
    shutil.copy2(shim, bundle / shim.name)
    repacked = repack_nixl(next((cache / "nixl").glob(f"nixl_cu13-{NIXL_VERSION}-cp312-*.whl")), bundle)
    check = {"verified": False, "why": "--no-verify"} if a.no_verify else verify(bundle, cache, [shim, repacked])
    rel = os.path.relpath(bundle, ROOT)
    cmd = run_command(rel)
    wheels = sorted(bundle.glob("*.whl"))
    out = {"bundle_dir": rel, "bundle_bytes": sum(w.stat().st_size for w in wheels),
           "tree_bytes": tree_bytes(bundle), "command": cmd, "carry": [rel],
           "command_chars": len(cmd), "tree_limit": TREE_MAX, "command_limit": COMMAND_MAX,
           "wheels": [w.name for w in wheels], "requirements": reqs,
           "nixl_cu13_repacked_bytes": repacked.stat().st_size, "nixl_check": check}
    print(json.dumps(out))
    return 0 if out["tree_bytes"] < TREE_MAX and len(cmd) <= COMMAND_MAX else 1


if __name__ == "__main__":
    sys.exit(main())
