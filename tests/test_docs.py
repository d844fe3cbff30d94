"""The docs a user reads point at files that exist: every `docs/...` path they name (result
files, figures, other pages) and every relative Markdown link or image."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]+")
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]+)\)")


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


def test_the_pages_name_result_files_and_the_check_sees_them():
    """The check above is not vacuous: the benchmarks page names its raw results."""
    names = [name for name, _ in named_paths(ROOT / "docs/benchmarks.md")]
    assert any(name.startswith("docs/results/") for name in names)
    assert "b2-timeline-proxy.png" in names
