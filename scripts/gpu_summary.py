#!/usr/bin/env python3
"""The GPU check's one JSON line, from what scripts/gpu_check.sh run left in OUTDIR; also written to
OUTDIR/gpu-check.json."""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tests(xml: Path) -> dict[str, object] | None:
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return None
    cases = []
    for tc in root.iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                msg = (el.get("message") or "")[:300]
                break
        else:
            msg = ""
        props = {p.get("name", ""): (p.get("value") or "")[:300] for p in tc.iter("property")}  # record_property
        cases.append({"test": f"{tc.get('classname', '')}::{tc.get('name', '')}", "outcome": outcome,
                      "s": round(float(tc.get("time") or 0), 2), **({"message": msg} if msg else {}),
                      **({"props": props} if props else {})})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {**counts, "cases": cases}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--skipped", default="")
    for k in ("env-rc", "tests-rc", "ceiling-rc", "collect-rc"):
        ap.add_argument(f"--{k}", type=int)
    ap.add_argument("--elapsed-s", type=int)
    a = ap.parse_args()
    env = _json(a.outdir / "env.json")
    out: dict[str, object] = {"gpu": bool(isinstance(env, dict) and env.get("gpus")), "env": env}
    if a.skipped:
        out["skipped"] = a.skipped
        out["gpu_tests_collect_rc"] = a.collect_rc
    else:
        out["tests_rc"] = a.tests_rc
        out["tests"] = _tests(a.outdir / "pytest.xml")
        out["ceiling_rc"] = a.ceiling_rc
        out["ceiling"] = _json(a.outdir / "ceiling.json")
    smi = a.outdir / "nvidia-smi.txt"
    if smi.exists():
        out["nvidia_smi"] = smi.read_text().splitlines()[:3]
    out["elapsed_s"] = a.elapsed_s
    imports_ok = isinstance(env, dict) and not any(str(v).startswith("FAILED") for k, v in env.items()
                                                   if k.startswith("import_"))
    out["imports_ok"] = imports_ok
    if a.skipped:  # the CPU-only parts: the environment imports and the GPU tests collect
        out["ok"] = imports_ok and a.collect_rc in (0, 5)  # 5: none collected (no torch here)
    else:
        out["ok"] = imports_ok and a.tests_rc == 0 and a.ceiling_rc == 0
    line = json.dumps(out)
    (a.outdir / "gpu-check.json").write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
