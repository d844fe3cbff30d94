"""The docs a user reads point at files that exist: every `docs/...` and `bench-archive/...` path
they name (figures, other pages, the archived benchmark results) and every relative Markdown
link or image; every private function they name is defined; and the archived results are
gzipped JSON that reads."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS_PATH = re.compile(r"(?<![\w/.-])(?:docs|bench-archive)/[\w./-]+")
ARCHIVE = ROOT / "bench-archive"
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]+)\)")
PRIVATE_NAME = re.compile(r"`(_[A-Za-z]\w*)`")


def named_paths(page: Path) -> list[tuple[str, Path]]:
    text = page.read_text()
    paths = [(match.group(0).rstrip(".,"), ROOT / match.group(0).rstrip(".,")) for match in DOCS_PATH.finditer(text)]
    for match in MARKDOWN_LINK.finditer(text):
        target = match.group(1)
        if "://" not in target and not target.startswith("mailto:"):
            paths.append((target, page.parent / target))
    return paths


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_page_names_exists(page):
    missing = sorted(name for name, path in named_paths(page) if not path.exists())
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"


def test_every_private_function_a_page_names_is_defined():
    """The pages find a rule by its function (`_limit_after`, `_candidates`): one renamed or split
    in the code is renamed in the pages too."""
    sources = "\n".join(path.read_text() for folder in ROOT.iterdir()
                        if folder.is_dir() and not folder.name.startswith(".") for path in folder.rglob("*.py"))
    defined = set(re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+(_\w+)", sources, re.MULTILINE))
    defined |= set(re.findall(r"^(_\w+)\s*[:=]", sources, re.MULTILINE))
    named = {name for page in PAGES for name in PRIVATE_NAME.findall(page.read_text())}
    assert "_limit_after" in named  # not vacuous
    assert not named - defined, f"the pages name functions the code does not define: {sorted(named - defined)}"


def test_the_pages_name_result_files_and_the_check_sees_them():
    """The check above is not vacuous: the benchmarks page names its raw results."""
    names = [name for name, _ in named_paths(ROOT / "docs/benchmarks.md")]
    assert any(name.startswith("bench-archive/") and name.endswith(".json.gz") for name in names)
    assert "b2-timeline-proxy.png" in names


def test_every_archived_result_is_cited_and_reads():
    """bench-archive/ holds gzipped JSON that a page cites: by path, inside a folder a page names,
    by file name, by a short form (`-080638`, `-212339.json.gz` after a sibling's full name), or
    as a regime map's cell result."""
    text = "\n".join(page.read_text() for page in PAGES)
    named = {name.rstrip("/") for page in PAGES for name, _ in named_paths(page)}
    files = sorted(path for path in ARCHIVE.rglob("*") if path.is_file())
    assert files
    results = {path: json.loads(gzip.decompress(path.read_bytes())) for path in files}
    in_maps = {Path(cell.get("b2_result", "")).name for data in results.values() for cell in data.get("cells", ())}
    for path in files:
        relative = path.relative_to(ROOT).as_posix()
        stem = path.name.removesuffix(".json.gz")
        cited = (relative in named or any(relative.startswith(name + "/") for name in named) or path.name in text
                 or re.search(rf"`-{re.escape(stem.rsplit('-', 1)[-1])}(?:\.json(?:\.gz)?)?`", text)
                 or path.name in in_maps)
        assert cited, f"{relative} is cited by no page"
