"""The README and the pages under docs/: every relative link leads somewhere, every page is one hop away.

The README is kept short and the manual lives in docs/, so a page renamed, a heading reworded or a file moved
by a refactor silently breaks the path a newcomer follows. These tests read the Markdown as text (no
rendering) and resolve each relative link against the file that holds it; a link with a ``#fragment`` must
name a heading of its target, turned into an anchor the way GitHub does it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def links(path: Path) -> list[str]:
    """The link targets of a Markdown file, outside fenced code blocks (code may contain brackets)."""
    return LINK.findall(FENCE.sub("", path.read_text()))


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*#*$", FENCE.sub("", path.read_text()), re.M)
    return {anchor(h) for h in headings}


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto: are not checked


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in filter(relative, links(page)):
        file, _, fragment = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target} (no heading with anchor #{fragment} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)} has broken links: " + "; ".join(broken)


def test_every_docs_page_is_one_hop_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in filter(relative, links(ROOT / "README.md"))}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link to: {unlinked}"


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The helpers themselves: a missing file and a missing heading are found, code blocks are skipped."""
    page = tmp_path / "page.md"
    page.write_text("# Weights & Biases\n\n[a](other.md#x) ![b](img.png)\n```\n[not](a/link.md)\n```\n")
    assert links(page) == ["other.md#x", "img.png"]
    assert anchors(page) == {"weights--biases"}
    assert anchor("What a crash, a NaN or a bad file costs") == "what-a-crash-a-nan-or-a-bad-file-costs"
    assert not relative("https://hydra.cc/docs/") and relative("docs/scale.md#resume")
