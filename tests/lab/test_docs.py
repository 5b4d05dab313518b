"""The documents: README.md stays a front door, and no relative link in README.md or docs/*.md points nowhere."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 10_240
# Documents other parts of the project provide (the configuration reference is generated from the
# config schema): a link to one is checked like any other once it exists; until then it is skipped,
# visibly, not passed.
PROVIDED_ELSEWHERE: set[str] = set()  # docs another change provides: skipped while missing

# [text](target) and [text](target "title"); images too. Reference-style links are not used here.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _links(text: str) -> list[str]:
    text = _CODE_SPAN.sub("", _FENCE.sub("", text))  # a link inside code is not a link
    return _LINK.findall(text)


def _relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) and not target.startswith("//")


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _FENCE.sub("", md.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = m.group(1).lower()
        slug = "".join(c for c in title if c in " -_" or unicodedata.category(c)[0] in "LN").replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _cases() -> list[tuple[str, str]]:
    cases = [(str(doc.relative_to(ROOT)), t) for doc in DOCUMENTS for t in _links(doc.read_text()) if _relative(t)]
    return list(dict.fromkeys(cases))


def test_readme_is_a_front_door() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, over {README_MAX_BYTES}: move detail to docs/"


def test_readme_names_the_two_commands() -> None:
    text = README.read_text()
    for command in ("make demo", "make test"):
        assert command in text, f"README.md does not name `{command}`"
    # and the Makefile has both targets, so the README's commands are real
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))
    assert {"demo", "test"} <= targets, targets


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test\b", ci, re.M), ".ci/run must run the README's test command, `make test`"


def test_link_parser_sees_links_and_skips_code() -> None:
    text = "see [a](docs/a.md) and ![p](x.png \"t\")\n`[b](nowhere.md)`\n```\n[c](nope.md)\n```\n[d](https://x.org)"
    assert _links(text) == ["docs/a.md", "x.png", "https://x.org"]
    assert not _relative("https://x.org") and not _relative("mailto:a@b") and _relative("docs/a.md#x")


def test_documents_have_links() -> None:
    assert len(_cases()) > 20  # the map of docs/ in the README alone has more


@pytest.mark.parametrize(("doc", "target"), _cases())
def test_relative_link_resolves(doc: str, target: str) -> None:
    path, _, anchor = target.partition("#")
    src = ROOT / doc
    dest = (src.parent / path).resolve() if path else src
    assert dest.is_relative_to(ROOT), f"{doc}: link {target} leaves the repository"
    if not dest.exists() and str(dest.relative_to(ROOT)) in PROVIDED_ELSEWHERE:
        pytest.skip(f"{dest.relative_to(ROOT)} is not in this tree yet")
    assert dest.exists(), f"{doc}: link {target} points at {dest.relative_to(ROOT)}, which does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), f"{doc}: link {target}: no heading #{anchor} in {dest.relative_to(ROOT)}"


# The map (docs/architecture.md) and the connector's README name files by their path from the root,
# in code spans: each must still be there, so a moved or removed module fails here until the map says so.
MAPS = [ROOT / "docs" / "architecture.md", ROOT / "client" / "kvpushd_client" / "vllm" / "README.md"]
_PATH = re.compile(r"`((?:kvpushd|client|lab|tests|scripts|protos|deploy|docs|systemd)/[^`\s]*)`")


def _named_paths(doc: Path) -> list[str]:
    return list(dict.fromkeys(_PATH.findall(_FENCE.sub("", doc.read_text()))))


def test_the_map_names_the_rooms() -> None:
    named = _named_paths(MAPS[0])
    assert len(named) > 60, named
    for room in ("core", "runtime", "transfer", "memory", "rpc"):
        assert any(p.startswith(f"kvpushd/{room}/") for p in named), room
    for top in ("kvpushd/app.py", "client/kvpushd_client/vllm/", "lab/kvpushd_lab/"):
        assert any(p.startswith(top) for p in named), top


@pytest.mark.parametrize("doc", MAPS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_path_a_map_names_exists(doc: Path) -> None:
    gone = [p for p in _named_paths(doc) if not (ROOT / p).exists()]
    assert not gone, f"{doc.relative_to(ROOT)} names paths that are gone (update the map): {gone}"
