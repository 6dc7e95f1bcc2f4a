"""ARCHITECTURE.md stays a map, not a ledger: at most 20,000 characters, no line over 400, a table row (one job) at
most 200, every repository path it names in backticks exists in the checkout, and every link into it from another
Markdown file (``ARCHITECTURE.md#anchor``) finds its heading.  The details belong in the module docstrings.

A backticked span is split into words; a word is a path claim when it holds a ``/`` and looks like a path (letters,
digits, ``_ . -`` and ``/``).  Globs and placeholders (``fleet-*.yaml``, ``<role>``, ``{name}``, ``...``), absolute
or URL-like words (``/api/offer``, ``https://``) and flags are not claims.  A claim ending in ``/`` must be a folder."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "ARCHITECTURE.md"
MAX_CHARS = 20_000
MAX_LINE = 400
MAX_ROW = 200

BACKTICKED = re.compile(r"`([^`\n]+)`")
PATHLIKE = re.compile(r"[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*/?")
PLACEHOLDER = re.compile(r"[*?\[\]{}<>$|]|\.\.\.")
LINK = re.compile(r"ARCHITECTURE\.md#([A-Za-z0-9_\-]+)")


def path_claims(text: str) -> list[str]:
    """The repository paths a Markdown text names in backticks, in order (globs and placeholders left out)."""
    claims = []
    for span in BACKTICKED.findall(text):
        for word in span.split():
            word = word.strip(",;:()'\"")
            if "/" not in word or PLACEHOLDER.search(word) or "://" in word:
                continue
            if word.startswith(("/", "-", ".")) or not PATHLIKE.fullmatch(word):
                continue
            claims.append(word)
    return claims


def missing_paths(text: str, root: Path) -> list[str]:
    """The claimed paths that do not exist under ``root`` (a claim ending in ``/`` must be a folder)."""
    missing = []
    for claim in path_claims(text):
        target = root / claim
        if not (target.is_dir() if claim.endswith("/") else target.exists()):
            missing.append(claim)
    return missing


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def markdown_files(root: Path) -> list[Path]:
    """The checkout's Markdown files, outside virtual environments, caches and dependencies."""
    skip = {".git", ".venv", "venv", "node_modules", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
    return [p for p in root.rglob("*.md") if not skip.intersection(p.relative_to(root).parts)]


def test_the_map_is_short():
    text = MAP.read_text()
    too_long = f"ARCHITECTURE.md is {len(text):,} characters, over {MAX_CHARS:,}: move details to docstrings"
    assert len(text) <= MAX_CHARS, too_long
    long_lines = [(n, len(line)) for n, line in enumerate(text.splitlines(), 1) if len(line) > MAX_LINE]
    assert not long_lines, f"ARCHITECTURE.md lines over {MAX_LINE} characters (line, length): {long_lines}"
    long_rows = [
        (n, len(line)) for n, line in enumerate(text.splitlines(), 1) if line.startswith("|") and len(line) > MAX_ROW
    ]
    assert not long_rows, f"ARCHITECTURE.md rows over {MAX_ROW} characters (line, length): {long_rows}"


def test_every_path_it_names_exists():
    text = MAP.read_text()
    assert len(path_claims(text)) > 100, "the map names the files of every package"
    assert not missing_paths(text, ROOT), f"ARCHITECTURE.md names paths that do not exist: {missing_paths(text, ROOT)}"


def test_it_names_every_product_package():
    claims = set(path_claims(MAP.read_text()))
    packages = ["coordinator", "stage_service", "gateway", "web", "stagecast", "launcher", "helm", "benchmarks"]
    packages += ["proto", "tests", "docker", "docs"] + (["clients"] if (ROOT / "clients").is_dir() else [])
    unnamed = [p for p in packages if not any(c == f"{p}/" or c.startswith(f"{p}/") for c in claims)]
    assert not unnamed, f"ARCHITECTURE.md names no path in: {unnamed}"


def test_links_into_it_resolve():
    known = anchors(MAP.read_text())
    broken = []
    for path in markdown_files(ROOT):
        for anchor in LINK.findall(path.read_text(errors="replace")):
            if anchor.lower() not in known:
                broken.append(f"{path.relative_to(ROOT)}: ARCHITECTURE.md#{anchor}")
    assert not broken, f"links to headings ARCHITECTURE.md does not have: {broken}"
    assert "ARCHITECTURE.md" in (ROOT / "README.md").read_text(), "README.md points a newcomer at the map"


def test_the_checks_can_fail(tmp_path):
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "agent.py").write_text("")
    (tmp_path / "helm").mkdir()
    text = (
        "`gateway/agent.py`, `gateway/gone.py` (`gateway/`), `coordinator/`, `helm/stagecast/values.yaml`; "
        "not claims: `helm/stagecast/templates/fleet-*.yaml`, `<role>/cert.pem`, `POST /api/offer`, `KEDA/HPA`... "
        "`https://example.com/x`, `--vae-devices cuda:0,cuda:1`, `benchmarks/{name}.json`"
    )
    assert "KEDA/HPA" in path_claims(text)  # a word with a slash is a claim: written as prose, it fails
    expected = ["gateway/gone.py", "coordinator/", "helm/stagecast/values.yaml", "KEDA/HPA"]
    assert missing_paths(text, tmp_path) == expected
    assert slug("A stream's open, through the files") == "a-streams-open-through-the-files"
