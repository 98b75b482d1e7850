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


# --- numbers quoted in the docs, against the commands beside them -----------------------------------------------------
def summary_params(overrides: list[str], out_dir: Path) -> dict[str, int]:
    """What ``python run.py mode=summary <overrides>`` counts as parameters (suite/summary.py: the trainable
    parameters of each network the task summarises), composed as run.py composes it; no FLOPs (the expensive part)."""
    from hydra import compose, initialize_config_dir

    from suite.compose import compose as compose_run

    args = ["mode=summary", "logger=none", *overrides]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=args)
    import torch

    with torch.device("meta"):  # shapes only: no memory, no weight initialisation, same parameter counts
        module = compose_run(cfg, args, out_dir).module
    return {name: sum(p.numel() for p in net.parameters() if p.requires_grad)
            for name, net, _ in module.summaries()}


def number(text: str) -> int:
    return int(text.replace(",", ""))


def test_parameter_counts_in_running_md_are_what_mode_summary_counts(tmp_path):
    """docs/running.md quotes mode=summary's parameter counts of the segmentation network (three heads) and the GAN
    (two variants, G and D); each is recounted from the network the command builds."""
    text = " ".join((ROOT / "docs" / "running.md").read_text().split())
    seg = re.search(r"ResNet-50 \+ external-attention head ([\d,]+) parameters .*?`attn=self` ([\d,]+) and .*?"
                    r"`model.head=none` ([\d,]+) and", text)
    gan = re.search(r"`attn=self` \(SAGAN, CIFAR-10 conditional\) has G ([\d,]+) and D ([\d,]+) parameters, "
                    r"`attn=external` \(EAGAN\) G ([\d,]+) and D ([\d,]+)\.", text)
    assert seg and gan, "the sentences quoting the counts were reworded: update this test with them"
    base = ["task=segmentation", "model.pretrained=false"]
    for quoted, overrides in zip(seg.groups(), [["attn=external"], ["attn=self"], ["model.head=none"]]):
        assert sum(summary_params([*base, *overrides], tmp_path).values()) == number(quoted), overrides
    for (g, d), attn in zip([gan.groups()[:2], gan.groups()[2:]], ["self", "external"]):
        counts = summary_params(["task=gan", f"attn={attn}"], tmp_path)
        assert (counts["G"], counts["D"]) == (number(g), number(d)), attn
